"""The window convolution of a network's stem with the weight resident in each program (tactics
"window_resident_…", `sartor/ops/quantized_window.py`).

The window tactic packs the few-channel image into 4-byte pixels and runs the implicit GEMM over
overlapping windows of them as a kh × 1 convolution: ResNet-50's INT8 stem took 0.389 ms of GEMM
for 92 GOP at batch 256 on the H200 (BENCHMARKS.md, session 16), bound neither by memory nor by
the tensor cores, each program walking 7 K steps with the general implicit-GEMM index math for one
row tile. Here, as in the resident kernel of 1×1 layers (`resident_gemm.py`), each program loads
its weight block [K, BLOCK_N] once (K = kh · window: 7 · 32 = 224 for the stem) and walks TILES row
tiles, gathering each tile's K in one step: kh rows of `window` contiguous bytes per output pixel.
Two forms: one product over K padded to a power of two (the weight's padding rows are zero), or
(`_kh`) one product per filter row, the kh weight blocks held as a tuple, nothing padded.

The products and their sums are `tile_steps`' (`_accumulate`, `_epilogue_store_halves`): the output
equals the emulation's as the other window tiles' does.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from .conv_igemm import ConvGeometry
from .epilogue import channels_last_output, pixel_stride, triton
from .pdl import launch_options
from .tile_steps import epilogue_arguments
from .pixel_pack import PIXEL_BYTES
from .resident_gemm import ResidentTile

if triton is not None:
    import triton.language as tl

    from .tile_steps import (_accumulate, _column_halves, _epilogue_store_halves, _epilogue_store_halves_loaded,
                             _residual_halves, pixel_coords)
    from .pdl import await_previous_kernel
    from .resident_gemm import program_tiles

    @triton.jit
    def _window_resident_kernel(
            p_ptr, w_ptr, bias_ptr, scale_ptr, res_ptr, y_ptr,
            M, COUT, OH, OW, image_bytes, row_bytes, y_row, srn, src, srh, srw,
            res_scale, out_inv_scale, qmin, alpha, beta,
            KH: tl.constexpr, WINDOW: tl.constexpr, STRIDE_H: tl.constexpr, PIXEL_STEP: tl.constexpr,
            DIL_H: tl.constexpr, INT8: tl.constexpr, FP8: tl.constexpr, HAS_BIAS: tl.constexpr,
            HAS_RES: tl.constexpr, RES_QUANT: tl.constexpr, RES_AFTER: tl.constexpr, ACT: tl.constexpr,
            OUT_QUANT: tl.constexpr, KH_STEPS: tl.constexpr, TILES: tl.constexpr, N_ADJACENT: tl.constexpr,
            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, K_PAD: tl.constexpr, PDL: tl.constexpr = False,
            COLUMNS_LOADED: tl.constexpr = False, OUTPUT_ROWS: tl.constexpr = 1, WINDOW_ALIGN: tl.constexpr = None):
        await_previous_kernel(PDL)
        row_group, column_tile = program_tiles(COUT, BLOCK_N, N_ADJACENT)
        first_column = column_tile * BLOCK_N
        offs_n = first_column + tl.arange(0, BLOCK_N)
        n_ok = offs_n < COUT
        w_col = offs_n.to(tl.int64)[None, :] * (KH * WINDOW)
        if KH_STEPS:
            offs_k = tl.arange(0, WINDOW)
            weights = ()
            for kh in tl.static_range(KH):
                weights = weights + (tl.load(w_ptr + w_col + (kh * WINDOW + offs_k)[:, None], mask=n_ok[None, :],
                                             other=0.0),)
        else:
            # K index kh · WINDOW + byte, padded to K_PAD: the padding's rows of the weight are zero
            # and its A columns masked, so neither reads past its tensor.
            offs_k = tl.arange(0, K_PAD)
            filter_row = offs_k // WINDOW
            k_ok = filter_row < KH
            k_offsets = filter_row * (DIL_H * row_bytes) + offs_k % WINDOW
            weight = tl.load(w_ptr + w_col + offs_k[:, None], mask=n_ok[None, :] & k_ok[:, None], other=0.0)
        if COLUMNS_LOADED:  # each half's bias and scale, once for all the program's row tiles (ResidentTile `_c`)
            bias_lo, scale_lo, bias_hi, scale_hi = _column_halves(first_column, COUT, bias_ptr, scale_ptr, INT8, FP8,
                                                                  HAS_BIAS, BLOCK_N)
        else:
            bias_lo, scale_lo, bias_hi, scale_hi = 0.0, 0.0, 0.0, 0.0
        if OUTPUT_ROWS == 2:
            _window_row_pairs(p_ptr, weights, bias_ptr, scale_ptr, res_ptr, y_ptr, bias_lo, scale_lo, bias_hi,
                              scale_hi, row_group, first_column, offs_k, M, COUT, OH, OW, image_bytes, row_bytes,
                              y_row, srn, src, srh, srw, res_scale, out_inv_scale, qmin, alpha, beta, KH, STRIDE_H,
                              DIL_H, PIXEL_STEP, INT8, FP8, HAS_BIAS, HAS_RES, RES_QUANT, RES_AFTER, ACT, OUT_QUANT, TILES,
                              BLOCK_M, BLOCK_N, WINDOW, COLUMNS_LOADED, WINDOW_ALIGN)
        else:
            for t in range(TILES):
                offs_m = (row_group * TILES + t) * BLOCK_M + tl.arange(0, BLOCK_M)
                m_ok = offs_m < M
                n_idx, oh, ow = pixel_coords(offs_m, OH, OW)
                window_start = _window_starts(n_idx, oh, ow, image_bytes, row_bytes, STRIDE_H, PIXEL_STEP,
                                              WINDOW_ALIGN)
                if INT8:
                    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
                else:
                    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                if KH_STEPS:
                    for kh in tl.static_range(KH):
                        a = tl.load(p_ptr + window_start[:, None] + (kh * DIL_H * row_bytes + offs_k)[None, :],
                                    mask=m_ok[:, None], other=0.0)
                        acc = _accumulate(acc, a, weights[kh], 1.0, -127.0, INT8, FP8, False, WINDOW)
                else:
                    a = tl.load(p_ptr + window_start[:, None] + k_offsets[None, :], mask=m_ok[:, None] & k_ok[None, :],
                                other=0.0)
                    # FP8 sums move to the float32 accumulator after each window, as the window
                    # tiles' K steps of 32-byte windows do.
                    acc = _accumulate(acc, a, weight, 1.0, -127.0, INT8, FP8, False, WINDOW)
                _window_tile_store(acc, offs_m, m_ok, n_idx, oh, ow, first_column, COUT, bias_lo, scale_lo, bias_hi,
                                   scale_hi, bias_ptr, scale_ptr, res_ptr, y_ptr, y_row, srn, src, srh, srw, res_scale,
                                   out_inv_scale, qmin, alpha, beta, INT8, FP8, HAS_BIAS, HAS_RES, RES_QUANT, RES_AFTER,
                                   ACT, OUT_QUANT, BLOCK_M, BLOCK_N, COLUMNS_LOADED)

    @triton.jit
    def _window_starts(n_idx, oh, ow, image_bytes, row_bytes, STRIDE_H: tl.constexpr, PIXEL_STEP: tl.constexpr,
                       WINDOW_ALIGN: tl.constexpr):
        """Where the window of output pixel (n, oh, ow) and filter row 0 starts: padded pixel
        (oh·sh, ow·sw), a multiple of WINDOW_ALIGN bytes (`window_alignment`)."""
        return tl.multiple_of(n_idx.to(tl.int64) * image_bytes + (oh * STRIDE_H) * row_bytes + ow * PIXEL_STEP,
                              [WINDOW_ALIGN])

    @triton.jit
    def _window_tile_store(acc, offs_m, m_ok, n_idx, oh, ow, first_column, COUT, bias_lo, scale_lo, bias_hi, scale_hi,
                           bias_ptr, scale_ptr, res_ptr, y_ptr, y_row, srn, src, srh, srw, res_scale, out_inv_scale,
                           qmin, alpha, beta, INT8: tl.constexpr, FP8: tl.constexpr, HAS_BIAS: tl.constexpr,
                           HAS_RES: tl.constexpr, RES_QUANT: tl.constexpr, RES_AFTER: tl.constexpr, ACT: tl.constexpr,
                           OUT_QUANT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                           COLUMNS_LOADED: tl.constexpr):
        """One row tile's epilogue: with the columns' bias and scale given (`_c`) or loaded here."""
        if COLUMNS_LOADED:
            res_lo, res_hi = 0.0, 0.0
            if HAS_RES:
                res_lo, res_hi = _residual_halves(res_ptr, first_column, COUT, m_ok, n_idx, oh, ow, srn, src,
                                                  srh, srw, BLOCK_N)
            _epilogue_store_halves_loaded(acc, res_lo, res_hi, offs_m, first_column, COUT, m_ok, bias_lo, bias_hi,
                                          scale_lo, scale_hi, y_ptr, y_row, res_scale, out_inv_scale, qmin, alpha,
                                          beta, INT8, FP8, HAS_BIAS, HAS_RES, RES_QUANT, RES_AFTER, ACT, OUT_QUANT,
                                          BLOCK_M, BLOCK_N)
        else:
            _epilogue_store_halves(acc, offs_m, first_column, COUT, m_ok, n_idx, oh, ow, bias_ptr, scale_ptr,
                                   res_ptr, y_ptr, y_row, srn, src, srh, srw, res_scale, out_inv_scale, qmin,
                                   alpha, beta, INT8, FP8, HAS_BIAS, HAS_RES, RES_QUANT, RES_AFTER, ACT,
                                   OUT_QUANT, BLOCK_M, BLOCK_N)

    @triton.jit
    def _window_row_pairs(p_ptr, weights, bias_ptr, scale_ptr, res_ptr, y_ptr, bias_lo, scale_lo, bias_hi, scale_hi,
                          row_group, first_column, offs_k, M, COUT, OH, OW, image_bytes, row_bytes, y_row, srn, src,
                          srh, srw, res_scale, out_inv_scale, qmin, alpha, beta, KH: tl.constexpr,
                          STRIDE_H: tl.constexpr, DIL_H: tl.constexpr, PIXEL_STEP: tl.constexpr,
                          INT8: tl.constexpr, FP8: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, RES_QUANT: tl.constexpr,
                          RES_AFTER: tl.constexpr, ACT: tl.constexpr, OUT_QUANT: tl.constexpr, TILES: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, WINDOW: tl.constexpr,
                          COLUMNS_LOADED: tl.constexpr, WINDOW_ALIGN: tl.constexpr):
        """The `_o2` walk: each row tile is BLOCK_M pixels of output rows 2p and 2p + 1 at once (M
        counts such pairs). The lower row's filter row i reads the packed row that the upper row's
        filter row i + STRIDE_H / DIL_H reads: undilated, the pair loads STRIDE_H + KH rows of windows
        for 2 · KH products, where two tiles would load 2 · KH (the stem's space-to-depth form: 5
        for 8)."""
        pair_rows = (OH + 1) // 2
        for t in range(TILES):
            offs_p = (row_group * TILES + t) * BLOCK_M + tl.arange(0, BLOCK_M)
            p_ok = offs_p < M
            n_idx, pair, ow = pixel_coords(offs_p, pair_rows, OW)
            oh = pair * 2
            lower_ok = p_ok & (oh + 1 < OH)
            window_start = _window_starts(n_idx, oh, ow, image_bytes, row_bytes, STRIDE_H, PIXEL_STEP, WINDOW_ALIGN)
            if INT8:
                upper = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
                lower = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
            else:
                upper = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                lower = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for r in tl.static_range(STRIDE_H + (KH - 1) * DIL_H + 1):
                # Packed row r of the pair: filter row r / DIL_H of the upper output row, and
                # (r - STRIDE_H) / DIL_H of the lower, where those are whole filter rows.
                # (Conditions written out in each `if`: Triton 3.6 neither reassigns a constexpr in an
                # unrolled loop nor keeps `&` of two constexprs one.)
                if r % DIL_H == 0 and r // DIL_H < KH:
                    a = tl.load(p_ptr + window_start[:, None] + (r * row_bytes + offs_k)[None, :],
                                mask=p_ok[:, None], other=0.0)
                    upper = _accumulate(upper, a, weights[r // DIL_H], 1.0, -127.0, INT8, FP8, False, WINDOW)
                    if r >= STRIDE_H and (r - STRIDE_H) % DIL_H == 0 and (r - STRIDE_H) // DIL_H < KH:
                        lower = _accumulate(lower, a, weights[(r - STRIDE_H) // DIL_H], 1.0, -127.0, INT8, FP8, False,
                                            WINDOW)
                elif r >= STRIDE_H and (r - STRIDE_H) % DIL_H == 0 and (r - STRIDE_H) // DIL_H < KH:
                    a = tl.load(p_ptr + window_start[:, None] + (r * row_bytes + offs_k)[None, :],
                                mask=lower_ok[:, None], other=0.0)
                    lower = _accumulate(lower, a, weights[(r - STRIDE_H) // DIL_H], 1.0, -127.0, INT8, FP8, False,
                                        WINDOW)
            offs_m = (n_idx * OH + oh) * OW + ow
            _window_tile_store(upper, offs_m, p_ok, n_idx, oh, ow, first_column, COUT, bias_lo, scale_lo, bias_hi,
                               scale_hi, bias_ptr, scale_ptr, res_ptr, y_ptr, y_row, srn, src, srh, srw, res_scale,
                               out_inv_scale, qmin, alpha, beta, INT8, FP8, HAS_BIAS, HAS_RES, RES_QUANT, RES_AFTER,
                               ACT, OUT_QUANT, BLOCK_M, BLOCK_N, COLUMNS_LOADED)
            _window_tile_store(lower, offs_m + OW, lower_ok, n_idx, oh + 1, ow, first_column, COUT, bias_lo, scale_lo,
                               bias_hi, scale_hi, bias_ptr, scale_ptr, res_ptr, y_ptr, y_row, srn, src, srh, srw,
                               res_scale, out_inv_scale, qmin, alpha, beta, INT8, FP8, HAS_BIAS, HAS_RES, RES_QUANT,
                               RES_AFTER, ACT, OUT_QUANT, BLOCK_M, BLOCK_N, COLUMNS_LOADED)

KH_STEPS_SUFFIX = "_kh"
ROW_PAIRS_SUFFIX = "_o2"  # after KH_STEPS_SUFFIX: two output rows per row tile


@dataclass(frozen=True)
class WindowResidentTile:
    """A resident tile (its residual is loaded in the epilogue: `residual_prefetch` 0), whether K
    is walked one filter row at a time (suffix `_kh`) rather than in one product over K padded to a
    power of two, and, walking by filter rows, whether each row tile covers the same pixels of two
    output rows (`_o2`, `_window_row_pairs`). Nsight Compute found the stem's GEMM bound by L2 (80%
    busy, 1.56 GB through it for 236 MB of DRAM traffic: session 25): each output pixel reads 4
    windows of 64 bytes there; a pair of rows shares 3 of its 4."""
    resident: ResidentTile
    kh_steps: bool = False
    row_pairs: bool = False

    def __post_init__(self):
        if self.row_pairs and not self.kh_steps:
            raise ValueError("WindowResidentTile: row pairs walk K by filter rows (kh_steps)")

    @property
    def name(self) -> str:
        return (self.resident.name + (KH_STEPS_SUFFIX if self.kh_steps else "")
                + (ROW_PAIRS_SUFFIX if self.row_pairs else ""))

    @property
    def output_rows(self) -> int:
        """Output rows per row tile."""
        return 2 if self.row_pairs else 1

    @classmethod
    def parse(cls, name: str | None) -> "WindowResidentTile | None":
        row_pairs = bool(name) and name.endswith(KH_STEPS_SUFFIX + ROW_PAIRS_SUFFIX)
        name = name[:-len(ROW_PAIRS_SUFFIX)] if row_pairs else name
        kh_steps = bool(name) and name.endswith(KH_STEPS_SUFFIX)
        resident = ResidentTile.parse(name[:-len(KH_STEPS_SUFFIX)] if kh_steps else name)
        if resident is None or resident.residual_prefetch:
            return None
        return cls(resident, kh_steps, row_pairs)


# Fastest first as the H200 timed them over pre-packed pixels (session 17's probe, batch 256; ms):
# _kh 64×64 2 stages 0.301, 64×64 2 stages 0.321, 3 stages 0.333, _kh 3 stages 0.334, 128×64 8 warps
# 0.365, 64×64 8 warps 0.414; the implicit-GEMM window tile took 0.392. bench/kernel_asm.py --layer
# stem (sm_90, Triton 3.6): 54–84 registers, 44–84 KiB of shared memory per program, no spills.
# The stem's 64 output channels are one column tile.
WINDOW_RESIDENT_TILES = (WindowResidentTile(ResidentTile(64, 64, 8, 4, 2), kh_steps=True),
                         WindowResidentTile(ResidentTile(64, 64, 8, 4, 2)),
                         WindowResidentTile(ResidentTile(64, 64, 8, 4, 3)),
                         WindowResidentTile(ResidentTile(64, 64, 8, 4, 3), kh_steps=True),
                         WindowResidentTile(ResidentTile(128, 64, 8, 8, 2)),
                         WindowResidentTile(ResidentTile(64, 64, 8, 8, 3)))
# Builder effort -> how many are timed (beside the implicit-GEMM window tiles): both forms from the start.
WINDOW_RESIDENT_PER_EFFORT = {1: 2, 2: 4}


def window_resident_tiles(effort: int) -> list[WindowResidentTile]:
    """The candidates the builder times at this effort, each also with its columns' bias and scale
    loaded once per program (ResidentTile's `_c`), then those walking by filter rows also over row
    pairs (`_o2`)."""
    tiles = list(WINDOW_RESIDENT_TILES[:WINDOW_RESIDENT_PER_EFFORT.get(effort, len(WINDOW_RESIDENT_TILES))])
    tiles += [replace(tile, resident=replace(tile.resident, columns_loaded=True)) for tile in tiles]
    return tiles + [replace(tile, row_pairs=True) for tile in tiles if tile.kh_steps]


def window_alignment(pixel_step: int, row_bytes: int, image_bytes: int) -> int:
    """The largest power of two, up to 16, dividing every window's first byte: windows start
    `pixel_step` bytes apart in rows of `row_bytes` and images of `image_bytes`. Stated to the kernel
    because Triton 3.6 proved the row-pair walk's windows 16-byte aligned where the 4-byte form's
    start every 8 bytes, and copied them 16 bytes at a time: a misaligned address on the H200
    (session 25)."""
    return math.gcd(pixel_step, row_bytes, image_bytes, 16)


def window_resident_conv(packed: torch.Tensor, w_window: torch.Tensor, bias: torch.Tensor | None,
                         tile: WindowResidentTile, *, geometry: ConvGeometry, dequant_scale: torch.Tensor,
                         residual: torch.Tensor | None = None, activation: str | None = None,
                         alpha: float | None = None, beta: float | None = None,
                         residual_after_activation: bool = False, residual_scale: float | None = None,
                         output_inv_scale: float | None = None, qmin: int = -127,
                         accumulator_bound: int | None = None, fp8: bool = False,
                         out: torch.Tensor | None = None, pdl: bool = False) -> torch.Tensor:
    """The convolution of the packed pixels `packed` [N, HP, WP, 4] (`window_pack`'s codes) with
    `w_window` [Cout, window, kh, 1] (`window_weight`'s: [Cout, kh, window] in memory) at
    `geometry` (the layer's, whose pads the packing applied), with the epilogue of resident_gemm's
    arguments. Output channels-last [N, Cout, OH, OW] (or into `out`)."""
    code = torch.float8_e4m3fn if fp8 else torch.int8
    cout, window, kh, _ = w_window.shape
    if packed.dtype != code or packed.dim() != 4 or packed.shape[3] != PIXEL_BYTES or not packed.is_contiguous():
        raise ValueError(f"window_resident_conv: packed {tuple(packed.shape)} {packed.dtype} is not contiguous "
                         f"[N, HP, WP, {PIXEL_BYTES}] {code} pixels")
    if w_window.dtype != code or not w_window.permute(0, 2, 1, 3).is_contiguous():
        raise ValueError(f"window_resident_conv: weight {tuple(w_window.shape)} is not window_weight's layout")
    n, _, padded_w, _ = packed.shape
    oh, ow = geometry.out_hw
    y = channels_last_output((n, cout, oh, ow), code if output_inv_scale is not None else torch.float32,
                             packed.device, out, "window_resident_conv")
    rs = residual.stride() if residual is not None else (0, 0, 0, 0)
    rows = n * -(-oh // tile.output_rows) * ow  # row pairs count once
    resident = tile.resident
    scalars, flags = epilogue_arguments(
        quantized=True, fp8=fp8, bias=bias, residual=residual, activation=activation, alpha=alpha, beta=beta,
        residual_after_activation=residual_after_activation, residual_scale=residual_scale,
        output_inv_scale=output_inv_scale, qmin=qmin,
        accumulator_bound=accumulator_bound)
    _window_resident_kernel[resident.grid(rows, cout)](
        packed, w_window, bias if bias is not None else w_window, dequant_scale,
        residual if residual is not None else y, y, rows, cout, oh, ow, packed.stride(0), padded_w * PIXEL_BYTES,
        pixel_stride(y), *rs, *scalars, KH=kh, WINDOW=window, STRIDE_H=geometry.strides[0],
        PIXEL_STEP=geometry.strides[1] * PIXEL_BYTES, DIL_H=geometry.dilations[0], **flags, KH_STEPS=tile.kh_steps,
        TILES=resident.tiles, N_ADJACENT=resident.n_adjacent, BLOCK_M=resident.block_m, BLOCK_N=resident.block_n,
        K_PAD=triton.next_power_of_2(kh * window), PDL=pdl, COLUMNS_LOADED=resident.columns_loaded,
        OUTPUT_ROWS=tile.output_rows,
        WINDOW_ALIGN=window_alignment(geometry.strides[1] * PIXEL_BYTES, padded_w * PIXEL_BYTES, packed.stride(0)),
        **launch_options(pdl), num_warps=resident.warps,
        num_stages=resident.stages, enable_fp_fusion=False)  # round as the emulation does (see conv_igemm)
    return y
