"""INT8 (FP8) stride-1 convolutions whose input tiles are loaded by the tensor memory accelerator:
each K step copies one tap's box of input pixels in one bulk tensor copy (tactics "tma.…"). A 1×1
layer of a larger stride without padding (ResNet's downsample) runs as the stride-1 layer over a
view of every stride-th pixel: the copy's pixel strides are the input's times the stride.

The implicit-GEMM kernel ran ResNet-50's 3×3 layers well below a plain Triton INT8 matmul over the
same shapes (docs/decisions/kernel-conv-tma.md). The implicit GEMM computes every row's address
and padding mask at each K step and loads through the threads.
Here a program's BLOCK_M output pixels are a rectangle of BH × BW pixels of one image, so the
input it needs for tap (kh, kw) is a box of the NHWC input [1, BH, BW, BLOCK_K] at (n, oh0 + kh -
pad, ow0 + kw - pad, c0): one TMA copy, whose out-of-bounds part (the padding, negative
coordinates included) the hardware fills with zeros. The weight, packed K-major [Cout, kh·kw·C]
(`conv_igemm.pack_weight`), is a second descriptor. Under Triton's interpreter the same
descriptors are emulated, so the tests run on the CPU.

The arithmetic is `tile_steps`' (`accumulate_dot`, `store_epilogue`): the output equals the
emulation's bit for bit, as the implicit-GEMM tiles' does. Rectangles that overhang the image's
right or bottom edge compute zeros there and store nothing.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ClassVar

import torch

from ..common.cache_keys import settle_cache_keys
from .igemm import (PERSISTENT_PROGRAMS_WITHOUT_GPU, TMA_ALIGNMENT, ConvGeometry, TensorDescriptor,
                         multiprocessors, packed_weight_descriptor)
from ..pointwise.epilogue import channels_last_output, pixel_stride, triton
from ..common.pdl import launch_options
from ..registry import PACKED_K_MAJOR, Dims, LayerFacts, Number, Tactic, register
from ..common.tile_steps import epilogue_arguments

if triton is not None and TensorDescriptor is not None:
    import triton.language as tl

    from ..common.tile_steps import store_epilogue, next_k_step
    from ..common.pdl import await_previous_kernel

    @triton.jit
    def _conv_tma_tile(
            tile, x_desc, w_desc, bias_ptr, scale_ptr, res_ptr, y_ptr,
            COUT, C, OH, OW, y_row, srn, src, srh, srw, pad_h, pad_w,
            res_scale, out_inv_scale, qmin, alpha, beta,
            KH: tl.constexpr, KW: tl.constexpr, INT8: tl.constexpr, FP8: tl.constexpr, HAS_BIAS: tl.constexpr,
            HAS_RES: tl.constexpr, RES_QUANT: tl.constexpr, RES_AFTER: tl.constexpr, ACT: tl.constexpr,
            OUT_QUANT: tl.constexpr, BH: tl.constexpr, BW: tl.constexpr, BLOCK_N: tl.constexpr,
            BLOCK_K: tl.constexpr):
        """Output tile number `tile`: its products over every tap and channel block, then the
        epilogue. Output channels vary fastest between tiles: the tiles that read one pixel
        rectangle run together, so its input boxes come from memory once and from L2 after."""
        num_pid_n = tl.cdiv(COUT, BLOCK_N)
        pid_n = tile % num_pid_n
        rect = tile // num_pid_n
        rects_w = tl.cdiv(OW, BW)
        rects_h = tl.cdiv(OH, BH)
        image = rect // (rects_h * rects_w)
        within = rect - image * (rects_h * rects_w)
        oh0 = (within // rects_w) * BH
        ow0 = (within % rects_w) * BW

        if INT8:
            acc = tl.zeros((BH * BW, BLOCK_N), dtype=tl.int32)
        else:
            acc = tl.zeros((BH * BW, BLOCK_N), dtype=tl.float32)
        c_blocks = C // BLOCK_K
        # The tap (kh, kw) and channel block cb, carried from step to step (next_k_step).
        kh = 0
        kw = 0
        cb = 0
        for step in range(KH * KW * c_blocks):
            c0 = cb * BLOCK_K
            a = x_desc.load([image, oh0 + kh - pad_h, ow0 + kw - pad_w, c0])
            a = tl.reshape(a, (BH * BW, BLOCK_K))
            b = w_desc.load([pid_n * BLOCK_N, (kh * KW + kw) * C + c0])
            if INT8:
                acc = tl.dot(a, tl.trans(b), acc, out_dtype=tl.int32)
            else:
                acc = tl.dot(a, tl.trans(b), acc, max_num_imprecise_acc=BLOCK_K)
            kh, kw, cb = next_k_step(kh, kw, cb, c_blocks, KW)

        r = tl.arange(0, BH * BW)
        oh = oh0 + r // BW
        ow = ow0 + r % BW
        m_ok = (oh < OH) & (ow < OW)
        offs_m = (image * OH + oh) * OW + ow
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        store_epilogue(acc, offs_m, offs_n, m_ok, offs_n < COUT, image, oh, ow, bias_ptr, scale_ptr, res_ptr, y_ptr,
                        y_row, srn, src, srh, srw, res_scale, out_inv_scale, qmin, alpha, beta,
                        INT8, FP8, HAS_BIAS, HAS_RES, RES_QUANT, RES_AFTER, ACT, OUT_QUANT)

    @triton.jit
    def _conv_tma_kernel(
            x_desc, w_desc, bias_ptr, scale_ptr, res_ptr, y_ptr,
            COUT, C, OH, OW, y_row, srn, src, srh, srw, pad_h, pad_w,
            res_scale, out_inv_scale, qmin, alpha, beta,
            KH: tl.constexpr, KW: tl.constexpr, INT8: tl.constexpr, FP8: tl.constexpr, HAS_BIAS: tl.constexpr,
            HAS_RES: tl.constexpr, RES_QUANT: tl.constexpr, RES_AFTER: tl.constexpr, ACT: tl.constexpr,
            OUT_QUANT: tl.constexpr, BH: tl.constexpr, BW: tl.constexpr, BLOCK_N: tl.constexpr,
            BLOCK_K: tl.constexpr, PDL: tl.constexpr = False):
        """One program per output tile."""
        await_previous_kernel(PDL)
        _conv_tma_tile(tl.program_id(0), x_desc, w_desc, bias_ptr, scale_ptr, res_ptr, y_ptr,
                       COUT, C, OH, OW, y_row, srn, src, srh, srw, pad_h, pad_w,
                       res_scale, out_inv_scale, qmin, alpha, beta,
                       KH, KW, INT8, FP8, HAS_BIAS, HAS_RES, RES_QUANT, RES_AFTER, ACT, OUT_QUANT,
                       BH, BW, BLOCK_N, BLOCK_K)

    @triton.jit
    def _conv_tma_persistent_kernel(
            x_desc, w_desc, bias_ptr, scale_ptr, res_ptr, y_ptr,
            N, COUT, C, OH, OW, y_row, srn, src, srh, srw, pad_h, pad_w,
            res_scale, out_inv_scale, qmin, alpha, beta, PROGRAMS,
            KH: tl.constexpr, KW: tl.constexpr, INT8: tl.constexpr, FP8: tl.constexpr, HAS_BIAS: tl.constexpr,
            HAS_RES: tl.constexpr, RES_QUANT: tl.constexpr, RES_AFTER: tl.constexpr, ACT: tl.constexpr,
            OUT_QUANT: tl.constexpr, BH: tl.constexpr, BW: tl.constexpr, BLOCK_N: tl.constexpr,
            BLOCK_K: tl.constexpr, PDL: tl.constexpr = False):
        """PROGRAMS programs (a few per SM) walk the tiles in turn. The loop nest is flattened, so the
        compiler can pipeline the next tile's first copies behind this tile's last products and
        epilogue, which a program per tile leaves to other programs to hide."""
        await_previous_kernel(PDL)
        tiles = N * tl.cdiv(OH, BH) * tl.cdiv(OW, BW) * tl.cdiv(COUT, BLOCK_N)
        for tile in tl.range(tl.program_id(0), tiles, PROGRAMS, flatten=True):
            _conv_tma_tile(tile, x_desc, w_desc, bias_ptr, scale_ptr, res_ptr, y_ptr,
                           COUT, C, OH, OW, y_row, srn, src, srh, srw, pad_h, pad_w,
                           res_scale, out_inv_scale, qmin, alpha, beta,
                           KH, KW, INT8, FP8, HAS_BIAS, HAS_RES, RES_QUANT, RES_AFTER, ACT, OUT_QUANT,
                           BH, BW, BLOCK_N, BLOCK_K)


@register
@dataclass(frozen=True)
class TmaTile(Tactic):
    """A tile's output pixels as a BH × BW rectangle, its output channels (BLOCK_N), the K step
    (channels per tap and copy), warps and pipeline stages; `persistent`: that many programs per SM
    walk the tiles between them ("persistent3"), else (0) one program per tile. Named e.g.
    "tma.8x16x64x64.w4.s4"."""
    bh: int
    bw: int
    block_n: int
    block_k: int
    warps: int
    stages: int
    persistent: int = 0

    FAMILY: ClassVar[str] = "tma"
    SCHEME: ClassVar[tuple] = (Dims(("bh", "bw", "block_n", "block_k")), Number("warps", "w"), Number("stages", "s"),
                               Number("persistent", "persistent", omit=0))
    WEIGHT_LAYOUT: ClassVar[str] = PACKED_K_MAJOR
    PROGRAMMATIC_LAUNCH: ClassVar[bool] = True

    def invalid(self) -> str | None:
        sizes = (self.bh, self.bw, self.block_n, self.block_k)
        return None if all(v > 0 and v & (v - 1) == 0 for v in sizes) else "Triton blocks are powers of 2"

    def describe(self, layer: LayerFacts) -> str:
        return (f"{layer.codes} triton implicit GEMM, input boxes by TMA bulk copies {self.fields_text} "
                f"+ fused epilogue")


# Best guesses first, as one program per tile, then the same rectangles as persistent programs.
# Rectangles 8 pixels wide divide ResNet's 56 and 28; the builder times as many as its effort
# allows. Persistent tiles run PERSISTENT_PROGRAMS_PER_SM programs per SM (164 registers a thread on
# sm_90, so 3 fit); they lost to the one-tile forms, so they come after every one-tile rectangle
# (docs/decisions/kernel-conv-tma.md).
PERSISTENT_PROGRAMS_PER_SM = 3
_RECTANGLES = (TmaTile(8, 16, 64, 64, 4, 4), TmaTile(8, 8, 64, 64, 4, 4), TmaTile(16, 8, 128, 64, 8, 3),
               TmaTile(8, 16, 128, 64, 8, 3), TmaTile(8, 8, 128, 64, 4, 3), TmaTile(4, 8, 64, 64, 4, 4))
TMA_TILES = _RECTANGLES + tuple(replace(tile, persistent=PERSISTENT_PROGRAMS_PER_SM) for tile in _RECTANGLES)
TMA_PER_EFFORT = {1: 2, 2: 6, 3: 12}


def _aligned(t: torch.Tensor) -> bool:
    """The base and every stride but the channels' (1) in 16-byte multiples, as the copy's
    descriptor requires of each dimension, size-1 ones included."""
    return t.data_ptr() % TMA_ALIGNMENT == 0 and all(
        (s * t.element_size()) % TMA_ALIGNMENT == 0 for d, s in enumerate(t.stride()) if d != 1)


def _strided_one_by_one(geometry: ConvGeometry) -> bool:
    """A 1×1 convolution of stride above 1 without padding (ResNet's downsample): the stride-1 1×1
    convolution of the input's every stride-th pixel, a view whose pixel strides are the input's
    times the stride (`_stride_one_view`)."""
    return (tuple(geometry.kernel) == (1, 1) and tuple(geometry.strides) != (1, 1) and not any(geometry.pads)
            and tuple(geometry.dilations) == (1, 1))


def _stride_one_view(x: torch.Tensor, geometry: ConvGeometry) -> tuple[torch.Tensor, ConvGeometry]:
    """The input and geometry the kernel runs: a strided 1×1 layer's every stride-th pixel at stride 1
    (no copy), any other layer as it is."""
    if not _strided_one_by_one(geometry):
        return x, geometry
    (sh, sw), (oh, ow) = geometry.strides, geometry.out_hw
    view = x[:, :, :(oh - 1) * sh + 1:sh, :(ow - 1) * sw + 1:sw]
    return view, ConvGeometry((1, 1), (1, 1), (0, 0), (1, 1), (oh, ow))


def tma_applies(x: torch.Tensor, w_shape: tuple, geometry: ConvGeometry | None, block_k: int) -> bool:
    """2-D convolutions of stride 1, dilation 1 (and 1×1 ones of any stride without padding, as a
    strided view), over 8-bit codes in channels-last memory (or a channel slice of it) whose
    channels are whole K steps and whose base and pixel strides the bulk copy can address (16-byte
    multiples); the weight's K (kh·kw·C bytes) likewise."""
    if TensorDescriptor is None or geometry is None or x.dim() != 4 or x.element_size() != 1:
        return False
    if pixel_stride(x) is None or x.stride(1) != 1:
        return False
    x, geometry = _stride_one_view(x, geometry)
    c = x.shape[1]
    k_total = w_shape[1] * geometry.kernel[0] * geometry.kernel[1]
    return (geometry.strides == (1, 1) and geometry.dilations == (1, 1) and c % block_k == 0
            and w_shape[1] == c and k_total % TMA_ALIGNMENT == 0 and min(geometry.out_hw) > 0 and _aligned(x))


def tma_tactics(x: torch.Tensor, w_shape: tuple, geometry: ConvGeometry | None, effort: int) -> list[str]:
    """The candidates the builder times at this effort for this layer: the tiles that apply to it."""
    return [tile.name for tile in TMA_TILES[:TMA_PER_EFFORT.get(effort, len(TMA_TILES))]
            if tma_applies(x, w_shape, geometry, tile.block_k)]


def conv_tma(x: torch.Tensor, w_packed: torch.Tensor, bias: torch.Tensor | None, geometry: ConvGeometry,
             tile: TmaTile, *, dequant_scale: torch.Tensor, residual: torch.Tensor | None = None,
             activation: str | None = None, alpha: float | None = None, beta: float | None = None,
             residual_after_activation: bool = False, input_inv_scale: float | None = None,
             residual_scale: float | None = None, output_inv_scale: float | None = None, qmin: int = -127,
             accumulator_bound: int | None = None, fp8: bool = False, float_dtype: torch.dtype = torch.float32,
             out: torch.Tensor | None = None, pdl: bool = False) -> torch.Tensor:
    """The INT8 (FP8: `fp8`) convolution y = epilogue(conv(x, w)) for x [N, C, H, W] 8-bit codes,
    channels-last (or a channel slice of it), w_packed [Cout, C, kh, kw] packed K-major by
    `pack_weight`; the epilogue's arguments are conv_igemm's (`pdl` and `float_dtype` too). Output
    channels-last (or into `out`)."""
    code = torch.float8_e4m3fn if fp8 else torch.int8
    if x.dtype != code or not tma_applies(x, tuple(w_packed.shape), geometry, tile.block_k):
        raise ValueError(f"conv_tma: input {tuple(x.shape)} {x.dtype} strides {x.stride()} with geometry {geometry} "
                         f"is not {code} codes in channels-last memory a bulk copy of {tile.block_k} channels "
                         f"can address at stride 1 (or, for a 1×1 layer without padding, at any stride)")
    del input_inv_scale  # the input is codes already (checked above)
    x, geometry = _stride_one_view(x, geometry)
    n, c, h, w = x.shape
    cout, kh, kw = w_packed.shape[0], geometry.kernel[0], geometry.kernel[1]
    oh, ow = geometry.out_hw
    y = channels_last_output((n, cout, oh, ow), code if output_inv_scale is not None else float_dtype, x.device,
                             out, "conv_tma")
    sxn, sxc, sxh, sxw = x.stride()
    # The input as [N, H, W, C] (its channels-last storage), boxes of one tap's rectangle.
    x_desc = TensorDescriptor(x, [n, h, w, c], [sxn, sxh, sxw, 1], [1, tile.bh, tile.bw, tile.block_k])
    w_desc = packed_weight_descriptor(w_packed, tile.block_n, tile.block_k)
    rs = residual.stride() if residual is not None else (0, 0, 0, 0)
    scalars, flags = epilogue_arguments(
        quantized=True, fp8=fp8, bias=bias, residual=residual, activation=activation, alpha=alpha, beta=beta,
        residual_after_activation=residual_after_activation, residual_scale=residual_scale,
        output_inv_scale=output_inv_scale, qmin=qmin,
        accumulator_bound=accumulator_bound)
    tiles = n * triton.cdiv(oh, tile.bh) * triton.cdiv(ow, tile.bw) * triton.cdiv(cout, tile.block_n)
    tensors = (x_desc, w_desc, bias if bias is not None else w_packed, dequant_scale,
               residual if residual is not None else y, y)
    constants = dict(KH=kh, KW=kw, **flags, BH=tile.bh, BW=tile.bw, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k,
                     PDL=pdl, **launch_options(pdl), num_warps=tile.warps, num_stages=tile.stages,
                     enable_fp_fusion=False)  # round as the emulation does (see conv_igemm)
    pads = (geometry.pads[0], geometry.pads[1])
    if tile.persistent:
        # `persistent` programs per SM (the interpreter, with no SMs, runs a few so that each walks
        # several tiles).
        programs = min(tiles, tile.persistent * (multiprocessors(x.device) or PERSISTENT_PROGRAMS_WITHOUT_GPU))
        _conv_tma_persistent_kernel[(programs,)](*tensors, n, cout, c, oh, ow, pixel_stride(y), *rs, *pads, *scalars,
                                                 programs, **constants)
    else:
        _conv_tma_kernel[(tiles,)](*tensors, cout, c, oh, ow, pixel_stride(y), *rs, *pads, *scalars, **constants)
    return y


settle_cache_keys(globals())  # last, once every Triton function above exists (common/cache_keys.py)
