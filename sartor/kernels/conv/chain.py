"""Two convolutions in one kernel: a layer and the unpadded 1×1 layer that alone reads it (a "chain").

A program owns a tile of output pixels. It runs the first layer's implicit GEMM over every one of
that layer's output channels (at most MAX_CHAIN_CHANNELS, one tile wide), applies the first
layer's epilogue (bias, dequantization, activation and, for INT8, the requantization to the codes
the second layer reads), and multiplies that tile, still in registers, by the 1×1 layer's weight,
a block of its output channels at a time, each with the second layer's epilogue and one store.

An INT8 first layer may also hand a float second layer its output as the float that layer reads
(a "mixed" chain: a QConv writing float, then an FP16/BF16 FusedConv): the intermediate is rounded to
the second weight's dtype and the second product runs in that float, as the two layers would.

The first layer's output is never written: at batch 1 one launch is saved (the layers of a small
detector are launch-bound there), at large batches the intermediate's write and read. The numbers
are those of the two layers run one after the other: the intermediate is rounded as it would have
been stored (INT8 codes, or the float16 or bfloat16 of a FusedConv), and each epilogue is the
implicit GEMM's (`tile_steps.epilogue_output`), so an INT8 chain equals the emulation bit for bit.
Whether a chain runs as one kernel is the builder's choice, by timing it against the two layers'
own winners (`builder/conv_chains.py`; docs/decisions/kernel-conv-chain.md).

Both weights are K-major: the first packed by `igemm.pack_weight` ([Cout, kh·kw·C] in memory), the
1×1's [Cout, C] as built. The first layer's K is walked tap by tap in channel blocks where its
channel count is a multiple of the K block; else a filter row at a time where its row of a multiple of 8
channels fits one block (`igemm.row_block`), each pixel's channels loaded as vectors, unless the tile is
`gathered`; else as one flat gather over (kh, kw, c). The gathered tiles (GATHERED_CHAIN_TILES) take that
gather where the row walk would run, their K block holding whole taps of a power-of-two channel count.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ClassVar

import torch

from ..common.cache_keys import settle_cache_keys
from ..common.pdl import launch_options
from ..common.tile_steps import epilogue_arguments
from ..pointwise.epilogue import channels_last_output, pixel_stride, triton
from ..registry import PACKED_K_MAJOR, Dims, Flag, LayerFacts, Number, Tactic, register
from .igemm import (ROW_TAPS_MIN_CHANNELS, ConvGeometry, aligned_start, as_nchw_view, is_packed, narrow_block_n,
                    row_alignment, row_block)

# The first layer's output channels a program holds at once, as one tile (padded to a power of two):
# its accumulators and then its codes stay in registers for the second product.
MAX_CHAIN_CHANNELS = 128
# The floats a float chain runs in, and a mixed chain's second layer (the tensor cores' 16-bit products).
CHAIN_FLOAT_DTYPES = (torch.float16, torch.bfloat16)

if triton is not None:
    import triton.language as tl

    from ..common.pdl import await_previous_kernel
    from ..common.tile_steps import COMPILED, accumulate_dot, epilogue_output, pixel_coords, requantize_int8

    @triton.jit
    def _middle_codes(y, inv_scale, qmin):
        """The INT8 codes the second product reads: requantize_int8's, converted from their float
        value rather than taken from the low byte of their bits, as `quantize_operand` does for the
        same reason (codes from the low bytes went wrong in a tl.dot on the GPU)."""
        if COMPILED:
            t = tl.fma(y, inv_scale, 12582912.0)
            t = tl.minimum(tl.maximum(t, 12582912.0 + qmin), 12583039.0)
            return (t - 12582912.0).to(tl.int8)
        return requantize_int8(y, inv_scale, qmin)

    @triton.jit
    def _conv_chain_kernel(
            x_ptr, w1_ptr, b1_ptr, s1_ptr, w2_ptr, b2_ptr, s2_ptr, y_ptr,
            M, C, H, W, OH, OW, C_MID, COUT, K1, y_row,
            sxn, sxc, sxh, sxw, x_shift, pad_h, pad_w, dil_h, dil_w,
            in_inv_scale, mid_inv_scale, out_inv_scale, qmin, alpha1, beta1, alpha2, beta2,
            KH: tl.constexpr, KW: tl.constexpr, STRIDE_H: tl.constexpr, STRIDE_W: tl.constexpr,
            INT8: tl.constexpr, INT8_1: tl.constexpr, INT8_2: tl.constexpr, QUANTIZE_INPUT: tl.constexpr,
            HAS_BIAS1: tl.constexpr, HAS_BIAS2: tl.constexpr, ACT1: tl.constexpr, ACT2: tl.constexpr,
            OUT_QUANT: tl.constexpr, GATHER: tl.constexpr, C_TAPS: tl.constexpr, MID: tl.constexpr,
            BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, PDL: tl.constexpr = False,
            ROW_TAPS: tl.constexpr = 0, ROW_K: tl.constexpr = 0, ROW_ALIGN: tl.constexpr = 1,
            CHANNEL_TAIL: tl.constexpr = False, SECOND_FLOAT: tl.constexpr = False):
        # INT8: the first product on INT8 codes; SECOND_FLOAT: the second layer is a float one (a
        # mixed chain), whose product runs in its weight's dtype.
        offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        m_ok = offs_m < M
        n_idx, oh, ow = pixel_coords(offs_m, OH, OW)
        image = n_idx.to(tl.int64) * sxn + x_shift  # x_ptr is 16-byte aligned; the input starts x_shift after
        offs_mid = tl.arange(0, MID)
        mid_ok = offs_mid < C_MID
        if INT8:
            acc = tl.zeros((BLOCK_M, MID), dtype=tl.int32)
        else:
            acc = tl.zeros((BLOCK_M, MID), dtype=tl.float32)
        await_previous_kernel(PDL)  # every load below reads an activation (or follows one)
        if ROW_TAPS > 0:
            # One K step per filter row, as igemm's row taps: its KW taps' ROW_TAPS (= C, a multiple of 8)
            # channels side by side in ROW_K columns, each run of C one pixel's contiguous channels, loaded
            # as vectors where the flat gather loaded an element at a time.
            offs_r = tl.arange(0, ROW_K)
            tap_w = offs_r // ROW_TAPS
            r_ok = offs_r < KW * ROW_TAPS
            iw = (ow * STRIDE_W - pad_w)[:, None] + (tap_w * dil_w)[None, :]
            cols_ok = m_ok[:, None] & r_ok[None, :] & (iw >= 0) & (iw < W)
            cols = image[:, None] + iw * sxw + ((offs_r % ROW_TAPS) * sxc)[None, :]
            # The weight's rows are KH·KW·C apart as a constant, whose factor 8 Triton sees (not K1).
            w_rows = offs_mid[None, :] * (KH * KW * ROW_TAPS) + offs_r[:, None]
            # Pixels whose offsets Triton cannot prove multiples of 16 (24 or 40 channels): told that every
            # run of ROW_VECTOR columns is contiguous from a multiple of ROW_VECTOR (igemm's ROW_TOLD).
            ROW_VECTOR: tl.constexpr = ROW_ALIGN if ROW_ALIGN < (ROW_TAPS & -ROW_TAPS) else (ROW_TAPS & -ROW_TAPS)
            ROW_TOLD: tl.constexpr = ROW_TAPS % 16 != 0 or ROW_TAPS & (ROW_TAPS - 1) != 0 or ROW_ALIGN < 16
            for tap_h in range(KH):
                ih = oh * STRIDE_H - pad_h + tap_h * dil_h
                a_cols = cols + (ih * sxh)[:, None]
                if ROW_TOLD and ROW_VECTOR > 1:
                    a_cols = tl.max_contiguous(tl.multiple_of(a_cols, [1, ROW_VECTOR]), [1, ROW_VECTOR])
                a = tl.load(x_ptr + a_cols, mask=cols_ok & ((ih >= 0) & (ih < H))[:, None], other=0)
                b = tl.load(w1_ptr + w_rows + tap_h * (KW * ROW_TAPS),
                            mask=r_ok[:, None] & mid_ok[None, :], other=0)
                acc = accumulate_dot(acc, a, b, in_inv_scale, qmin, INT8, False, QUANTIZE_INPUT, ROW_K)
        elif GATHER:
            for k0 in range(0, K1, BLOCK_K):
                offs_k = k0 + tl.arange(0, BLOCK_K)
                k_ok = offs_k < K1
                if C_TAPS:  # a power-of-two count, told: shifts and masks, and each tap's channels one vector
                    tap = offs_k // C_TAPS
                    c = offs_k % C_TAPS
                else:
                    tap = offs_k // C
                    c = offs_k - tap * C
                kh = tap // KW
                kw = tap - kh * KW
                ih = oh[:, None] * STRIDE_H - pad_h + kh[None, :] * dil_h
                iw = ow[:, None] * STRIDE_W - pad_w + kw[None, :] * dil_w
                ok = m_ok[:, None] & k_ok[None, :] & (ih >= 0) & (ih < H) & (iw >= 0) & (iw < W)
                a = tl.load(x_ptr + image[:, None] + ih * sxh + iw * sxw + c[None, :] * sxc, mask=ok, other=0)
                b = tl.load(w1_ptr + offs_mid[None, :] * K1 + offs_k[:, None], mask=k_ok[:, None] & mid_ok[None, :],
                            other=0)
                acc = accumulate_dot(acc, a, b, in_inv_scale, qmin, INT8, False, QUANTIZE_INPUT, BLOCK_K)
        else:
            # Tap by tap in channel blocks; with CHANNEL_TAIL (a multiple of 8 channels that the block does
            # not divide: YOLOv8n's 80-class branch) a tap's last block is masked, its runs still vectors.
            c_blocks = tl.cdiv(C, BLOCK_K) if CHANNEL_TAIL else C // BLOCK_K
            for step in range(0, KH * KW * c_blocks):
                tap = step // c_blocks
                c0 = (step - tap * c_blocks) * BLOCK_K
                kh = tap // KW
                kw = tap - kh * KW
                ih = oh * STRIDE_H - pad_h + kh * dil_h
                iw = ow * STRIDE_W - pad_w + kw * dil_w
                ok = m_ok & (ih >= 0) & (ih < H) & (iw >= 0) & (iw < W)
                offs_c = c0 + tl.arange(0, BLOCK_K)
                a_ok = ok[:, None]
                b_ok = mid_ok[None, :]
                if CHANNEL_TAIL:
                    a_ok = a_ok & (offs_c < C)[None, :]
                    b_ok = b_ok & (offs_c < C)[:, None]
                a = tl.load(x_ptr + (image + ih * sxh + iw * sxw)[:, None] + offs_c[None, :] * sxc, mask=a_ok, other=0)
                offs_k = tap * C + offs_c
                b = tl.load(w1_ptr + offs_mid[None, :] * K1 + offs_k[:, None], mask=b_ok, other=0)
                acc = accumulate_dot(acc, a, b, in_inv_scale, qmin, INT8, False, QUANTIZE_INPUT, BLOCK_K)
        middle = epilogue_output(acc, 0.0, offs_mid, mid_ok, b1_ptr, s1_ptr, 1.0, 1.0, qmin, alpha1, beta1,
                                 INT8_1, False, HAS_BIAS1, False, False, False, ACT1, 0)
        if INT8 and not SECOND_FLOAT:
            middle = _middle_codes(middle, mid_inv_scale, qmin)
        else:  # rounded as the first layer would have stored it for its float reader
            middle = middle.to(w2_ptr.dtype.element_ty)
        rows = offs_m.to(tl.int64)[:, None] * y_row
        for n0 in range(0, COUT, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            n_ok = offs_n < COUT
            w2 = tl.load(w2_ptr + offs_n[None, :] * C_MID + offs_mid[:, None], mask=mid_ok[:, None] & n_ok[None, :],
                         other=0)
            if INT8 and not SECOND_FLOAT:
                acc2 = tl.dot(middle, w2, out_dtype=tl.int32)
            else:
                acc2 = tl.dot(middle, w2)
            y = epilogue_output(acc2, 0.0, offs_n, n_ok, b2_ptr, s2_ptr, 1.0, out_inv_scale, qmin, alpha2, beta2,
                                INT8_2, False, HAS_BIAS2, False, False, False, ACT2, OUT_QUANT)
            tl.store(y_ptr + rows + offs_n[None, :], y.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


@register
@dataclass(frozen=True)
class ChainTile(Tactic):
    """A chain kernel's tile: output pixels a program, the first product's K block, the second
    product's block of output channels, warps and pipeline stages; `gathered`: the first layer's K
    walked as a gather of whole taps where the row walk would run. Named e.g. "chain.64x64x64.w4.s3",
    "chain.128x32x32.w4.s4.gathered"."""
    block_m: int
    block_k: int
    block_n: int
    warps: int
    stages: int
    gathered: bool = False

    FAMILY: ClassVar[str] = "chain"
    SCHEME: ClassVar[tuple] = (Dims(("block_m", "block_k", "block_n")), Number("warps", "w"), Number("stages", "s"),
                               Flag("gathered", "gathered"))
    WEIGHT_LAYOUT: ClassVar[str] = PACKED_K_MAJOR
    PROGRAMMATIC_LAUNCH: ClassVar[bool] = True

    def invalid(self) -> str | None:
        sizes = (self.block_m, self.block_k, self.block_n)
        if any(size < 16 or size & (size - 1) for size in sizes):
            return "the blocks are powers of two of 16 or more (tensor-core tiles)"
        return None

    def describe(self, layer: LayerFacts) -> str:
        walk = ", the first layer's taps gathered" if self.gathered else ""
        return (f"triton chain {self.fields_text}: a layer and the 1×1 layer reading it in one kernel on the tensor "
                f"cores, the intermediate kept in registers, both epilogues fused{walk}")


# Candidates, best guesses first; the builder times the first CHAIN_TILES_PER_EFFORT[effort].
CHAIN_TILES = (ChainTile(64, 64, 64, 4, 3), ChainTile(128, 64, 64, 8, 3), ChainTile(32, 64, 64, 4, 3),
               ChainTile(64, 32, 128, 4, 2), ChainTile(128, 32, 128, 8, 2), ChainTile(32, 32, 64, 2, 3))
CHAIN_TILES_PER_EFFORT = {1: 3, 2: 4, 3: 6}
# Tiles whose first layer gathers whole taps where the row walk would run (16 channels at 3×3: YOLO's first
# backbone chain), timed beside the others there; four warps, where the row walk wants eight
# (docs/decisions/kernel-conv-chain.md, "The gathered walk").
GATHERED_CHAIN_TILES = (ChainTile(128, 32, 64, 4, 4, gathered=True), ChainTile(64, 32, 64, 4, 3, gathered=True))
GATHERED_CHAIN_TILES_PER_EFFORT = {1: 1, 2: 1, 3: 2}


def gathered_walk_applies(channels: int, kernel: tuple[int, int], block_k: int, eight_bit: bool) -> bool:
    """Whether a tile of `block_k` gathers whole taps where it would otherwise walk filter rows: the
    row walk applies (`igemm.row_block`), the channels do not fill the K block and divide it (a power
    of two, each tap's channels one vector)."""
    return (row_block(channels, kernel, eight_bit) > 0 and channels % block_k != 0
            and block_k % channels == 0)


def chain_tiles(effort: int, out_channels: int | None = None, channels: int | None = None,
                kernel: tuple[int, int] | None = None, eight_bit: bool = True) -> list[ChainTile]:
    """The tiles timed at `effort`; with `out_channels` (the second layer's), each one's N block
    narrowed to hold them as igemm's narrowed tiles are (`igemm.narrow_block_n`): a 32-channel cv1
    after YOLO's stride-2 3×3, or a class head of a few outputs, spent half or more of the second
    product and of its epilogue (the SiLU's two special-function operations an element) on columns
    it masks off. With the first layer's `channels` and `kernel`, the gathered tiles too where their
    walk applies (`gathered_walk_applies`)."""
    tiles = list(CHAIN_TILES[:CHAIN_TILES_PER_EFFORT.get(effort, len(CHAIN_TILES))])
    if channels is not None and kernel is not None:
        gathered = GATHERED_CHAIN_TILES[:GATHERED_CHAIN_TILES_PER_EFFORT.get(effort, len(GATHERED_CHAIN_TILES))]
        tiles += [tile for tile in gathered if gathered_walk_applies(channels, kernel, tile.block_k, eight_bit)]
    if out_channels is None:
        return tiles
    return [replace(tile, block_n=min(tile.block_n, narrow_block_n(out_channels))) for tile in tiles]


def middle_width(channels: int, int8: bool) -> int:
    """The first layer's output channels as the kernel holds them: a power of two, at least the
    tensor cores' K step of the second product (32 bytes of INT8 codes, 16 elements of floats)."""
    return max(32 if int8 else 16, 1 << max(0, channels - 1).bit_length())


@dataclass(frozen=True)
class ChainLayer:
    """One layer of a chain as the kernel takes it: its bias (None without), its dequant scale (INT8:
    per output channel; None for float layers) and its epilogue's activation, alpha and beta, the
    codes' scale and the INT8 sums' bound (`tile_steps.epilogue_arguments`)."""
    bias: torch.Tensor | None
    dequant_scale: torch.Tensor | None
    activation: str | None = None
    alpha: float | None = None
    beta: float | None = None
    input_inv_scale: float | None = None
    output_inv_scale: float | None = None
    accumulator_bound: int | None = None


def chain_applies(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, geometry: ConvGeometry | None) -> bool:
    """Whether the kernel runs this chain: a 2-D convolution whose output channels fit one tile, then
    a 1×1 over exactly those channels, on CUDA tensors (any under Triton's interpreter)."""
    return (triton is not None and geometry is not None and x.dim() == 4 and w1.dim() == 4 and w2.dim() == 4
            and w1.shape[0] <= MAX_CHAIN_CHANNELS and tuple(w2.shape[1:]) == (w1.shape[0], 1, 1))


def conv_chain(x: torch.Tensor, w1_packed: torch.Tensor, w2: torch.Tensor, geometry: ConvGeometry, first: ChainLayer,
               second: ChainLayer, tile: ChainTile, *, qmin: int = -127, out_dtype: torch.dtype | None = None,
               out: torch.Tensor | None = None, pdl: bool = False) -> torch.Tensor:
    """Run the chain (module docstring): x [N, C, H, W] any strides; w1_packed [C_MID, C, kh, kw]
    packed by `igemm.pack_weight`; w2 [COUT, C_MID, 1, 1]. INT8 when `first.dequant_scale` is given
    (w1 int8, its bias int32, x int8 codes or floats quantized with `first.input_inv_scale`): with
    `second.dequant_scale` too, w2 int8 and the intermediate requantized with `first.output_inv_scale`;
    without (mixed), w2 and its bias float16 or bfloat16 and the intermediate that float. Else float
    (x, w1, w2 of one float dtype, the intermediate rounded to it). The output is channels-last,
    `out_dtype` (INT8: the codes where `second.output_inv_scale` is given), or `out`. `pdl`: launched
    with programmatic dependent launch (`kernels/common/pdl.py`; CUDA tensors only)."""
    if not is_packed(w1_packed):
        raise ValueError("conv_chain needs the first weight packed by pack_weight")
    int8 = first.dequant_scale is not None
    second_float = int8 and second.dequant_scale is None
    if int8 and not second_float and first.output_inv_scale is None:
        raise ValueError("conv_chain: an INT8 chain's first layer writes codes the second reads")
    if second_float and (first.output_inv_scale is not None or w2.dtype not in CHAIN_FLOAT_DTYPES):
        raise ValueError("conv_chain: a mixed chain's INT8 layer writes the float16 or bfloat16 its second layer "
                         f"reads, not codes for a {w2.dtype} weight")
    x4 = as_nchw_view(x)
    x_base, x_shift = aligned_start(x4)
    n, c, h, w_in = x4.shape
    c_mid, cout = w1_packed.shape[0], w2.shape[0]
    if c_mid > MAX_CHAIN_CHANNELS or tuple(w2.shape[1:]) != (c_mid, 1, 1):
        raise ValueError(f"conv_chain: {c_mid} channels between the layers (at most {MAX_CHAIN_CHANNELS}) and a "
                         f"1×1 second weight over them, not {tuple(w2.shape)}")
    oh, ow = geometry.out_hw
    if out_dtype is None:
        if second_float:
            out_dtype = w2.dtype
        else:
            out_dtype = (torch.int8 if second.output_inv_scale is not None else torch.float32) if int8 else x.dtype
    y = channels_last_output((n, cout, oh, ow), out_dtype, x.device, out, "conv_chain")
    m = n * oh * ow
    k1 = c * geometry.kernel[0] * geometry.kernel[1]
    block_k = tile.block_k
    row_k = row_block(c, geometry.kernel, int8) if c % block_k and not tile.gathered else 0
    channel_tail = c % block_k != 0 and not row_k and not tile.gathered and c % ROW_TAPS_MIN_CHANNELS == 0
    gather = c % block_k != 0 and not row_k and not channel_tail
    _, flags1 = epilogue_arguments(quantized=int8, fp8=False, bias=first.bias, residual=None,
                                   activation=first.activation, alpha=first.alpha, beta=first.beta,
                                   residual_after_activation=False, residual_scale=None, output_inv_scale=None,
                                   qmin=qmin, accumulator_bound=first.accumulator_bound)
    _, flags2 = epilogue_arguments(quantized=int8 and not second_float, fp8=False, bias=second.bias, residual=None,
                                   activation=second.activation, alpha=second.alpha, beta=second.beta,
                                   residual_after_activation=False, residual_scale=None,
                                   output_inv_scale=second.output_inv_scale, qmin=qmin,
                                   accumulator_bound=second.accumulator_bound)
    placeholder = w2  # for absent biases and a float chain's scales: never read
    grid = (triton.cdiv(m, tile.block_m),)
    _conv_chain_kernel[grid](
        x_base, w1_packed, first.bias if first.bias is not None else placeholder,
        first.dequant_scale if int8 else placeholder, w2,
        second.bias if second.bias is not None else placeholder,
        second.dequant_scale if second.dequant_scale is not None else placeholder, y,
        m, c, h, w_in, oh, ow, c_mid, cout, k1, pixel_stride(y),
        *x4.stride(), x_shift, geometry.pads[0], geometry.pads[1], geometry.dilations[0], geometry.dilations[1],
        float(first.input_inv_scale or 1.0), float(first.output_inv_scale or 1.0),
        float(second.output_inv_scale or 1.0), float(qmin),
        float(first.alpha or 0.0), float(first.beta or 0.0), float(second.alpha or 0.0), float(second.beta or 0.0),
        KH=geometry.kernel[0], KW=geometry.kernel[1], STRIDE_H=geometry.strides[0], STRIDE_W=geometry.strides[1],
        INT8=int8, INT8_1=flags1["INT8"], INT8_2=flags2["INT8"], QUANTIZE_INPUT=int8 and x.dtype != torch.int8,
        HAS_BIAS1=flags1["HAS_BIAS"], HAS_BIAS2=flags2["HAS_BIAS"], ACT1=flags1["ACT"], ACT2=flags2["ACT"],
        OUT_QUANT=flags2["OUT_QUANT"], GATHER=gather, C_TAPS=c if gather and block_k % c == 0 else 0,
        MID=middle_width(c_mid, int8),
        BLOCK_M=tile.block_m, BLOCK_K=block_k, BLOCK_N=tile.block_n,
        PDL=pdl, ROW_TAPS=c if row_k else 0, ROW_K=row_k,
        ROW_ALIGN=row_alignment(x4, geometry, x_shift) if row_k else 1, CHANNEL_TAIL=channel_tail,
        SECOND_FLOAT=second_float,
        num_warps=tile.warps, num_stages=tile.stages, enable_fp_fusion=not int8, **launch_options(pdl))
    return y


settle_cache_keys(globals())  # last, once every Triton function above exists (common/cache_keys.py)
