"""INT8 layers: QConv and QGemm, made by `sartor.quant.quantize_graph` from Conv/FusedConv and
Gemm/FusedGemm/MatMul layers planned INT8.

What one INT8 layer computes, in the order a GPU kernel does it:

1. Its data input arrives either as INT8 (the producer was an INT8 layer that wrote INT8) or as
   floats, which are quantized here: q = clamp(round_half_even(x * inv_scale), -127, 127).
2. int8 × int8 products accumulated exactly in integers, plus the INT32 bias (quantized at build
   time with scale input_scale · weight_scale[c]).
3. Dequantize: float32(acc + bias) * dequant_scale[c], where dequant_scale = input_scale ·
   weight_scale[c] (float32, computed at build time).
4. The FP32 epilogue: the residual, then the activation, in the order the fused layer asks. A
   residual stored as codes is added with its scale in one fused multiply-add:
   fma(code, residual_scale, y), rounded once (`fused_multiply_add`).
5. When every reader of the output is an INT8 layer, the output is re-quantized with its scale and
   written as INT8: round half to even of the exact product y · output_inv_scale, saturated to
   ±127 (`requantize`; on the GPU one fused multiply-add with 1.5·2^23); otherwise it stays FP32.

Steps 4 and 5 are defined with fused multiply-adds because the GPU's epilogue is bound by its
instruction count on the 1×1 layers, and each fma is one instruction where a multiply and an add,
each rounded, were two (docs/decisions/kernel-int8-epilogue-fma.md).

A projected QConv (`passes/fuse_projected_residual.py`; inputs from PROJECTION_FIRST_INPUT) takes as
its residual a second unpadded 1×1 layer's output, computed by steps 1–3 of that layer and not
re-quantized: float32, added in step 4. Its kernels are the resident tiles with the second product
beside the first (`kernels/gemm/resident.py`, Projection).

Saturation is to [-127, 127] (symmetric) for the layers sartor calibrates. Layers folded from a
Q/DQ model (`sartor/passes/fold_qdq.py`) carry `qmin = -128`: they saturate to [-128, 127] as ONNX
QuantizeLinear does, so that they compute what the model's Q/DQ nodes compute.

Exact integer accumulation runs as float64 convolutions/matmuls of integer-valued tensors: every
int8 × int8 product and every partial sum below 2^53 is exact in float64, whatever the summation
order, so the result equals an int32/int64 accumulator (tests check it against int64). cuDNN is
turned off for these calls on CUDA so that no transform-based algorithm (FFT, Winograd) runs: the
native im2col + DGEMM and direct depthwise kernels then produce the same integers as the CPU.
Quantization multiplies by a float32 reciprocal that is stored with the layer (on CUDA, dividing
by a host scalar is itself a multiplication by a reciprocal, so the reciprocal is explicit).

That emulation is the reference ("torch" tactic). On CUDA the builder also times Triton kernels
with int8 tensor-core products, int32 accumulation and this same epilogue, fused, producing the
same numbers: the implicit-GEMM tiles (`sartor/kernels/conv/igemm.py`), and where they apply
im2col + GEMM and packed pixel windows for few-channel stems (`ops/quantized_window.py`: the
implicit GEMM or a resident-weight GEMM over them),
resident weight tiles for 1×1 layers of one K block (`sartor/kernels/gemm/resident.py`), input
boxes loaded by TMA bulk copies for stride-1 layers (`sartor/kernels/conv/tma.py`), 1×1 stride-1
layers and GEMMs as dense GEMMs of TMA-loaded tiles (`sartor/kernels/gemm/tma.py`), and
cuBLAS's GEMMs through torch with the epilogue as a Triton kernel (`ops/quantized_library.py`).

FP8 layers (attribute `qformat="fp8e4m3"`, see `sartor/ops/fp8.py` for the format) are the same
ops with three differences:
- quantization is q = e4m3(clamp(x · inv_scale, -448, 448)) (round to nearest even), inputs and
  stored outputs are torch.float8_e4m3fn, residuals stored FP8 are dequantized with their scale;
- the bias stays float32 and is added after dequantization: float32(acc) · dequant_scale[c] + bias[c];
- the e4m3 × e4m3 products are accumulated in float64, exactly for K ≤ 171196 (the argument is in
  `sartor/ops/fp8.py`). The GPU kernel accumulates in float32 (FP8 tensor cores, sm_89 and newer),
  so its result equals this one up to that accumulation, not bit for bit; the tactic check
  accepts one e4m3 step of difference in FP8 outputs, and more where the error stays under a small
  fraction of the layer's largest output (`sartor/tactics/select.py`, FP8_CANCELLATION_TOLERANCE).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import ClassVar

import torch

from ..ir.dtypes import INT8_QMAX as QMAX
from ..kernels.conv.igemm import (ConvGeometry, TileConfig, candidate_tiles, conv_igemm, halved_epilogue_tiles,
                                  pack_weight, weight_tma_tiles)
from ..kernels.conv.direct_stem import (DIRECT_STEM_FORMS, direct_stem_applies, direct_stem_conv, row_words,
                                        stem_forms, tap_words)
from ..kernels.conv.direct_words import DIRECT_WORDS_FORMS, direct_int8_words_conv, direct_words_applies
from ..kernels.conv.depthwise import (NAMED_DEPTHWISE_TILES, TRITON_DEPTHWISE_INT8, TRITON_DEPTHWISE_INT8_LINES,
                                      TRITON_DEPTHWISE_INT8_WORDS, DepthwiseTile, depthwise_tile_for, depthwise_tiles,
                                      depthwise_codes_supported, depthwise_qconv_nhwc,
                                      pack_depthwise_weight)
from ..kernels.pointwise.epilogue import ACTIVATION_CODES, code_words, pixel_stride, triton
from ..kernels.pool.max_pool import POOL_TILES
from ..kernels.pointwise.quantize import quantize_kernel_applies, quantize_kernel_into
from ..kernels.conv.tma import TmaTile, conv_tma, tma_applies, tma_tactics
from ..kernels.gemm.tma import GemmTmaTile, gemm_tma, gemm_tma_applies, gemm_tma_tactics
from ..kernels.gemm.resident import (PROJECTION_COLUMNS_MAX_BLOCK_N, RESIDENT_TILES, Projection, ResidentTile,
                                     resident_applies, resident_gemm, resident_tactics)
from ..kernels.window.resident import WindowResidentTile
from ..kernels.registry import (AS_GIVEN, CHANNELS_LAST, DEPTHWISE_TAPS, IM2COL_ROWS, PACKED_K_MAJOR, PIXEL_WINDOWS,
                                REFERENCE, ROW_WORDS, TAP_WORDS, Inline, LayerFacts, Tactic, register, tactic_for)
from .conv import conv_nd, depthwise_geometry, igemm_epilogue, igemm_geometry, igemm_variant_tiles
from .elementwise import apply_activation
from .fp8 import DTYPE as FP8_DTYPE
from .fp8 import is_fp8, quantize_fp8
from .fused_pool import fused_max_pool, pool_in_kernel, without_max_pool
from .int8_cpu import conv_by_int_mm, depthwise_in_float32, matmul_by_int_mm
from .quantized_im2col import IM2COL_MAX_CHANNELS, Im2colIgemm, im2col_conv, im2col_weight
from .quantized_library import LIBRARY_TACTICS, library_applies, library_qlayer, library_tactics
from .quantized_window import (WINDOW_TACTICS, WindowResident, space_to_depth_applies, window_applies, window_conv,
                               window_tactics, window_weight)
from .pool import max_pool
from .registry import OpTable, stored_float_dtype
from .util import exact_integer_math, programmatic_launch

OPS = OpTable("quantized")

# Attributes of an INT8 layer besides its conv/gemm and epilogue attributes.
QUANT_ATTRS = ("input_scale", "input_inv_scale", "residual_scale", "output_scale", "output_inv_scale",
               "weight_scale", "qmin", "qformat")


def quantize(x: torch.Tensor, inv_scale: float, qmin: int = -QMAX) -> torch.Tensor:
    """Symmetric INT8: clamp(round_half_even(x * inv_scale), qmin, 127) as int8 (qmin -127, or
    -128 for layers folded from Q/DQ)."""
    return torch.round(x.float() * inv_scale).clamp_(qmin, QMAX).to(torch.int8)


def quantize_into(x: torch.Tensor, out: torch.Tensor, inv_scale: float, qmin: int = -QMAX) -> torch.Tensor:
    """`out` (int8, `x`'s shape) set to `quantize(x, inv_scale, qmin)`: on CUDA by one kernel that reads
    `x` once and writes the codes (`kernels/pointwise/quantize.py`), where both share one layout."""
    if x.shape != out.shape or out.dtype != torch.int8:
        raise ValueError(f"quantize_into writes int8 codes of shape {tuple(x.shape)}; got a {out.dtype} buffer "
                         f"of shape {tuple(out.shape)}")
    if quantize_kernel_applies(x, out):
        return quantize_kernel_into(x, out, inv_scale, qmin)
    return out.copy_(quantize(x, inv_scale, qmin))


def as_int8(x: torch.Tensor, inv_scale: float, qmin: int = -QMAX) -> torch.Tensor:
    """The layer's INT8 input: as it arrived when the producer wrote INT8, else quantized here."""
    return x if x.dtype == torch.int8 else quantize(x, inv_scale, qmin)


def as_quantized(x: torch.Tensor, attrs: dict) -> torch.Tensor:
    """The layer's data input in its format (INT8 or FP8): as it arrived when the producer stored
    it so, else quantized here."""
    if is_fp8(attrs):
        return x if x.dtype == FP8_DTYPE else quantize_fp8(x, attrs["input_inv_scale"])
    return as_int8(x, attrs["input_inv_scale"], attrs.get("qmin", -QMAX))


def _as_float32(value: float) -> float:
    """A scale as the kernels receive it: a float32 scalar."""
    return float(torch.tensor(value, dtype=torch.float32))


def requantize(y: torch.Tensor, inv_scale: float, qmin: int = -QMAX) -> torch.Tensor:
    """An epilogue's INT8 output: clamp(round_half_even(y · inv_scale), qmin, 127), the product of
    float32 y and float32 inv_scale taken exactly (it is, in float64) and rounded once, as the
    GPU's fma(y, inv_scale, 1.5·2^23) does. `quantize` (a layer's float input) rounds the float32
    product instead, as the packing kernels do."""
    product = y.to(torch.float64) * _as_float32(inv_scale)
    return torch.round(product).clamp_(qmin, QMAX).to(torch.int8)


def fused_multiply_add(a: torch.Tensor, b: float, c: torch.Tensor) -> torch.Tensor:
    """a · b + c for float32 a, c and a float32 scalar b, rounded once to float32, as the GPU's
    fma: the product is exact in float64, the float64 sum is made round-to-odd from its exact
    error (TwoSum), and rounding a round-to-odd float64 to float32 gives the correctly rounded
    result (Boldo and Melquiond, 2008). `kernels/common/tile_steps.py` `_fma_round_to_odd` is the same
    for interpreted kernels."""
    product = a.to(torch.float64) * _as_float32(b)
    addend = c.to(torch.float64)
    total = product + addend
    back = total - product
    error = (product - (total - back)) + (addend - back)
    bits = total.view(torch.int64)
    toward_exact = torch.where((error > 0) == (total > 0), 1, -1)
    inexact_even = (error != 0) & ((bits & 1) == 0) & torch.isfinite(total)
    return torch.where(inexact_even, bits + toward_exact, bits).view(torch.float64).to(torch.float32)


def _requantize(y: torch.Tensor, attrs: dict) -> torch.Tensor:
    if is_fp8(attrs):
        return quantize_fp8(y, attrs["output_inv_scale"])
    return requantize(y, attrs["output_inv_scale"], attrs.get("qmin", -QMAX))


def int8_conv_accumulate(xq: torch.Tensor, wq: torch.Tensor, attrs: dict) -> torch.Tensor:
    """The exact accumulator of an int8 (or e4m3, K ≤ 171196) convolution: for INT8 codes on the
    CPU, int32 from an integer GEMM or float32 for depthwise layers (`int8_cpu.py`), else float64."""
    acc = conv_by_int_mm(xq, wq, attrs)
    if acc is None:
        acc = depthwise_in_float32(xq, wq, attrs)
    if acc is not None:
        return acc
    with exact_integer_math(xq.device):
        return conv_nd(xq.to(torch.float64), wq.to(torch.float64), None, attrs)


def int8_matmul_accumulate(xq: torch.Tensor, wq: torch.Tensor) -> torch.Tensor:
    """x [..., K] · w[M, K]ᵀ accumulated exactly (int8, or e4m3 with K ≤ 171196): int32 where an
    integer GEMM computes it, else float64; [..., M]."""
    acc = matmul_by_int_mm(xq, wq)
    if acc is not None:
        return acc
    return torch.matmul(xq.to(torch.float64), wq.to(torch.float64).t())


def _dequantize(acc: torch.Tensor, bias: torch.Tensor | None, dequant_scale: torch.Tensor, axis: int,
                fp8: bool = False) -> torch.Tensor:
    shape = [1] * acc.dim()
    shape[axis] = -1
    if fp8:  # float32 bias, added after the scale
        y = acc.to(torch.float32) * dequant_scale.to(torch.float32).reshape(shape)
        return y if bias is None else y + bias.to(torch.float32).reshape(shape)
    if bias is not None:
        acc = acc + bias.to(torch.float64).reshape(shape)  # int32 + int32, exact in float64 (int32 acc too)
    return acc.to(torch.float32) * dequant_scale.to(torch.float32).reshape(shape)


def _add_residual(y: torch.Tensor, residual: torch.Tensor, attrs: dict) -> torch.Tensor:
    """Step 4's residual: codes with their scale in one fused multiply-add, floats as they are."""
    if residual.dtype in (torch.int8, FP8_DTYPE):
        return fused_multiply_add(residual.to(torch.float32), attrs["residual_scale"], y)
    return y + residual.to(torch.float32)


def _epilogue(y: torch.Tensor, residual: torch.Tensor | None, attrs: dict) -> torch.Tensor:
    after = attrs.get("residual_after_activation", False)
    if residual is not None and not after:
        y = _add_residual(y, residual, attrs)
    if attrs.get("activation"):
        y = apply_activation(y, attrs["activation"], attrs.get("activation_alpha"), attrs.get("activation_beta"))
    if residual is not None and after:
        y = _add_residual(y, residual, attrs)
    if attrs.get("output_inv_scale") is not None:
        return _requantize(y, attrs)
    return y


def _igemm_geometry(x: torch.Tensor, wq: torch.Tensor, attrs: dict, gemm: bool) -> ConvGeometry | None:
    """Where the implicit-GEMM kernel applies: dense 2-D convolutions, and GEMMs over 2-D inputs
    (a 1×1 convolution of 1×1 pixels), on CUDA."""
    if gemm:
        return ConvGeometry.gemm() if triton is not None and x.is_cuda and x.dim() == 2 else None
    return igemm_geometry(x, wq, attrs)


def fp8_tensor_cores(device: torch.device) -> bool:
    """FP8 tensor-core products (Triton's FP8 tl.dot) need compute capability 8.9 or newer."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


def _qlayer_tactics(gemm: bool):
    def tactics(inputs, attrs, effort: int = 2) -> list[str]:
        """The exact emulation ("torch", the reference) and, on CUDA (FP8: sm_89 and newer), the
        implicit-GEMM tiles with their variants, and where they apply the resident kernel, the
        TMA-fed kernels (stride-1 convolutions of 8-bit codes; 1×1 ones and GEMMs as dense GEMMs),
        the library GEMMs, im2col + GEMM, the CUDA cores' dp4a kernel (at most 32 channels in whole
        words), their stem kernel (a float image of few channels) and the pixel windows (few-channel
        convolutions); an INT8 depthwise layer, the depthwise kernel. A projected layer:
        `projected_tactics`."""
        names = [REFERENCE]
        if is_fp8(attrs) and not fp8_tensor_cores(inputs[0].device):
            return names
        if projection_inputs(inputs) is not None:
            return names + projected_tactics(inputs, attrs, effort)
        if not gemm and depthwise_int8_geometry(inputs[0], inputs[1], attrs) is not None:
            # 128-channel blocks only where they differ from the 64-channel ones
            wide = inputs[0].shape[1] > NAMED_DEPTHWISE_TILES[TRITON_DEPTHWISE_INT8].max_block_c
            words = code_words(inputs[0]) is not None  # INT8 codes in whole words
            return (names + [TRITON_DEPTHWISE_INT8] + ([TRITON_DEPTHWISE_INT8_LINES] if wide else [])
                    + [t.name for t in depthwise_tiles(effort)]  # code by code in smaller blocks
                    + ([TRITON_DEPTHWISE_INT8_WORDS] + [t.name for t in depthwise_tiles(effort, words=True)]
                       if words else []))
        geometry = _igemm_geometry(inputs[0], inputs[1], attrs, gemm)
        if geometry is not None:
            tiles = candidate_tiles(int8=True, effort=effort)
            kernels = tiles + igemm_variant_tiles(tiles, inputs[0], inputs[1], geometry)
            residual = len(inputs) > 3 and inputs[3] is not None
            residual_codes = residual and inputs[3].dtype == torch.int8  # for the residual-mma variants
            halved = halved_epilogue_tiles(kernels, residual)
            names += [tile.name for tile in kernels + halved]
            if not gemm:
                names += [tile.name for tile in weight_tma_tiles(
                    kernels + [t for t in halved if not t.residual_early], inputs[0].shape[1],
                    tuple(inputs[1].shape), inputs[1].element_size())]
            if resident_applies(inputs[0], inputs[1].shape[1], geometry):
                names += resident_tactics(effort, residual, inputs[1].shape[1], residual_codes,
                                          out_channels=inputs[1].shape[0])
            if not gemm:
                names += tma_tactics(inputs[0], tuple(inputs[1].shape), geometry, effort)
            names += gemm_tma_tactics(inputs[0], tuple(inputs[1].shape), geometry, effort, residual, residual_codes)
            if library_applies(inputs[0], inputs[1], geometry):
                names += library_tactics(is_fp8(attrs))
            if not gemm and inputs[1].shape[1] < IM2COL_MAX_CHANNELS and (len(inputs) < 4 or inputs[3] is None):
                names += [Im2colIgemm(tile).name for tile in tiles]
            if not gemm and direct_words_int8(inputs[0], inputs[1], attrs):
                names.extend(DIRECT_WORDS_FORMS)
            if not gemm and direct_stem_int8(inputs, attrs):
                names.extend(stem_forms(tuple(inputs[1].shape[2:]), attrs.get("dilations", (1, 1)), inputs[1].shape[0]))
            if not gemm and window_applies(inputs[0], inputs[1], attrs):
                pooled = (pool_in_kernel(fused_max_pool(attrs)) and not residual and not is_fp8(attrs)
                          and attrs.get("output_inv_scale") is not None)
                names += window_tactics(effort, space_to_depth=space_to_depth_applies(inputs[0], inputs[1], attrs),
                                        max_pool=pooled, out_channels=inputs[1].shape[0])
        return names
    return tactics


def qlayer_weight_for_tactic(wq: torch.Tensor, tactic: str | None) -> torch.Tensor:
    """The weight in the layout the tactic's family declares: windowed for the pixel windows
    (`quantized_window.window_weight`); packed K-major for the implicit-GEMM tiles, the resident
    kernel and the library GEMMs; flat rows for im2col (`quantized_im2col.im2col_weight`); taps
    outermost for the depthwise kernel; channels-last for the dp4a kernel; words of four taps for the
    stem kernel (`direct_stem.tap_words`), of a filter row for its quads form (`direct_stem.row_words`);
    as built for the emulation."""
    chosen = tactic_for(tactic)
    layout = chosen.weight_layout if wq.dim() == 4 else AS_GIVEN
    if layout == PIXEL_WINDOWS:
        return window_weight(wq, space_to_depth=chosen.space_to_depth)
    if layout == IM2COL_ROWS:
        return im2col_weight(wq, chosen.tile)
    if layout == DEPTHWISE_TAPS:
        return pack_depthwise_weight(wq)
    if layout == CHANNELS_LAST:
        return wq.contiguous(memory_format=torch.channels_last)
    if layout == TAP_WORDS:
        return tap_words(wq)
    if layout == ROW_WORDS:
        return row_words(wq)
    return pack_weight(wq) if chosen.weight_layout == PACKED_K_MAJOR else wq


def own_kernel_tactic(tactic: str | None) -> bool:
    """Whether the tactic is one of sartor's own Triton kernels with the layer's epilogue fused that
    --pdl launches with programmatic dependent launch (the family's PROGRAMMATIC_LAUNCH)."""
    return tactic_for(tactic).PROGRAMMATIC_LAUNCH


# The attribute bounding an INT8 layer's int32 sums (`passes/bound_accumulators.py`), which its kernels
# take as `accumulator_bound` (`kernels/common/tile_steps.py`, epilogue_arguments).
ACCUMULATOR_BOUND = "accumulator_bound"


def _int8_epilogue(attrs: dict) -> dict:
    """An INT8 or FP8 layer's epilogue and scales as conv_igemm's keyword arguments."""
    return dict(igemm_epilogue(attrs), input_inv_scale=attrs["input_inv_scale"],
                residual_scale=attrs.get("residual_scale"), output_inv_scale=attrs.get("output_inv_scale"),
                qmin=attrs.get("qmin", -QMAX), fp8=is_fp8(attrs),
                accumulator_bound=attrs.get(ACCUMULATOR_BOUND), float_dtype=float_output_dtype(attrs))


def _unpacked_weight_shape(x: torch.Tensor, wq: torch.Tensor, attrs: dict) -> torch.Tensor:
    """A stand-in (no data) for the [Cout, C, kh, kw] weight that a tactic stored in another layout
    (im2col's flat rows, the windows'), for the geometry and applicability checks that read it."""
    return torch.empty((wq.shape[0], x.shape[1], *attrs["kernel_shape"]), dtype=torch.int8, device="meta")


def _im2col_conv(x, w_flat, bias, dequant_scale, attrs, tile: TileConfig):
    """The INT8 (FP8) columns [N·OH·OW, kh·kw·C (padded)] in one pass (`kernels/conv/im2col.py`), then
    one GEMM with the epilogue."""
    geometry = igemm_geometry(x, _unpacked_weight_shape(x, w_flat, attrs), attrs, require_cuda=False)
    if geometry is None:
        return None
    return im2col_conv(x, w_flat, bias, dequant_scale, geometry, tile, code_dtype(attrs), _int8_epilogue(attrs))


def _window_conv(x, w_window, bias, residual, dequant_scale, attrs, tile: TileConfig | WindowResidentTile,
                 space_to_depth: bool = False):
    """Packed pixels (or block pixels: `space_to_depth`), then a GEMM kernel over their windows
    (`ops/quantized_window.py`)."""
    full = _unpacked_weight_shape(x, w_window, attrs)
    geometry = igemm_geometry(x, full, attrs, require_cuda=False)
    if geometry is None or not (space_to_depth_applies if space_to_depth else window_applies)(x, full, attrs):
        return None
    return window_conv(x, w_window, bias, residual, dequant_scale, geometry, tile, code_dtype(attrs),
                       _int8_epilogue(attrs), pdl=programmatic_launch(x, attrs), space_to_depth=space_to_depth)


def _any_device_geometry(x, wq, attrs, gemm: bool) -> ConvGeometry | None:
    """The layer's geometry for the kernel tactics on any tensors (CPU ones run under Triton's
    interpreter, in tests; the builder lists these tactics on CUDA only)."""
    if gemm:
        return ConvGeometry.gemm() if triton is not None and x.dim() == 2 else None
    return igemm_geometry(x, wq, attrs, require_cuda=False)


def _qlayer_library(x, wq, bias, residual, dequant_scale, attrs, tactic: str, gemm: bool,
                    out: torch.Tensor | None = None):
    """A cuBLAS GEMM through torch and the Triton epilogue (`ops/quantized_library.py`), or None
    where it does not apply."""
    geometry = _any_device_geometry(x, wq, attrs, gemm)
    if geometry is None or not library_applies(x, wq, geometry):
        return None
    codes = x if x.dtype == code_dtype(attrs) else as_quantized(x, attrs)
    return library_qlayer(codes, wq, tactic, bias, residual, dequant_scale, _int8_epilogue(attrs), out=out)


def _qlayer_resident(x, wq, bias, residual, dequant_scale, attrs, tile: ResidentTile, gemm: bool,
                     out: torch.Tensor | None = None):
    """The resident-weight kernel (`kernels/gemm/resident.py`), or None where it does not apply."""
    geometry = _any_device_geometry(x, wq, attrs, gemm)
    if geometry is None or not resident_applies(x, wq.shape[1], geometry):
        return None
    return resident_gemm(x, wq, bias, tile, dequant_scale=dequant_scale, residual=residual, out=out,
                         pdl=programmatic_launch(x, attrs), strides=tuple(geometry.strides), **_int8_epilogue(attrs))


def _qlayer_tma(x, wq, bias, residual, dequant_scale, attrs, tile: TmaTile, gemm: bool,
                out: torch.Tensor | None = None):
    """The TMA-fed convolution (`kernels/conv/tma.py`), or None where it does not apply (GEMMs too)."""
    if gemm:
        return None
    geometry = _any_device_geometry(x, wq, attrs, gemm=False)
    if not tma_applies(x, tuple(wq.shape), geometry, tile.block_k) or x.dtype != code_dtype(attrs):
        return None
    return conv_tma(x, wq, bias, geometry, tile, dequant_scale=dequant_scale, residual=residual, out=out,
                    pdl=programmatic_launch(x, attrs), **_int8_epilogue(attrs))


def _qlayer_gemm_tma(x, wq, bias, residual, dequant_scale, attrs, tile: GemmTmaTile, gemm: bool,
                     out: torch.Tensor | None = None):
    """The TMA-fed dense GEMM (`kernels/gemm/tma.py`), or None where it does not apply."""
    geometry = _any_device_geometry(x, wq, attrs, gemm)
    if not gemm_tma_applies(x, tuple(wq.shape), geometry) or x.dtype != code_dtype(attrs):
        return None
    return gemm_tma(x, wq, bias, geometry, tile, dequant_scale=dequant_scale, residual=residual, out=out,
                    pdl=programmatic_launch(x, attrs), **_int8_epilogue(attrs))


def _qlayer_igemm(x, wq, bias, residual, dequant_scale, attrs, tile: TileConfig, gemm: bool,
                  out: torch.Tensor | None = None):
    geometry = _any_device_geometry(x, wq, attrs, gemm)
    if geometry is None:
        return None
    return conv_igemm(x, wq, bias, geometry, tile, dequant_scale=dequant_scale, residual=residual, out=out,
                      pdl=programmatic_launch(x, attrs), **_int8_epilogue(attrs))


def depthwise_int8_geometry(x: torch.Tensor, wq: torch.Tensor, attrs: dict,
                            require_cuda: bool = True) -> ConvGeometry | None:
    """The geometry of an INT8 depthwise QConv (group = C = Cout) the depthwise kernel runs, else
    None: CUDA tensors (any under Triton's interpreter, with `require_cuda=False`), not FP8, an
    epilogue the kernel knows."""
    if is_fp8(attrs):
        return None
    return depthwise_geometry(x, wq, attrs, require_cuda, supported=depthwise_codes_supported)


def _qlayer_depthwise(x, wq, bias, residual, dequant_scale, attrs, out: torch.Tensor | None,
                      tile: DepthwiseTile):
    """The INT8 depthwise kernels in `tile`'s blocks (the layer's tactic, `depthwise_tile_for`)."""
    geometry = depthwise_int8_geometry(x, wq, attrs, require_cuda=False)
    if geometry is None or (residual is not None and tuple(residual.shape) != (x.shape[0], x.shape[1],
                                                                               *geometry.out_hw)):
        return None
    epilogue = _int8_epilogue(attrs)
    epilogue.pop("fp8")
    return depthwise_qconv_nhwc(x, wq, bias, geometry, dequant_scale=dequant_scale, residual=residual, out=out,
                                tile=tile, pdl=programmatic_launch(x, attrs), **epilogue)


def direct_words_int8(x: torch.Tensor, wq: torch.Tensor, attrs: dict) -> bool:
    """Whether the CUDA cores' dp4a kernel runs this dense INT8 QConv (`kernels/conv/direct_words.py`):
    few channels, codes in whole words, not FP8, an epilogue the kernel knows."""
    return (not is_fp8(attrs) and attrs.get("group", 1) == 1 and attrs.get("activation") in ACTIVATION_CODES
            and direct_words_applies(x, wq))


def _qlayer_direct_words(x, wq, bias, residual, dequant_scale, attrs, out: torch.Tensor | None = None,
                         tactic: str | None = None):
    geometry = igemm_geometry(x, wq, attrs, require_cuda=False)
    if geometry is None or not direct_words_int8(x, wq, attrs) or (
            residual is not None and tuple(residual.shape) != (x.shape[0], wq.shape[0], *geometry.out_hw)):
        return None
    epilogue = _int8_epilogue(attrs)
    for unused in ("fp8", "input_inv_scale"):  # codes in, never FP8
        epilogue.pop(unused)
    return direct_int8_words_conv(x, wq, bias, geometry, dequant_scale=dequant_scale, residual=residual, out=out,
                                  tactic=tactic, pdl=programmatic_launch(x, attrs), **epilogue)


def direct_stem_int8(inputs: list, attrs: dict) -> bool:
    """Whether the CUDA cores' stem kernel runs this dense INT8 QConv (`kernels/conv/direct_stem.py`): a
    float image (or its INT8 codes) of few channels, few outputs, no residual or projection, not FP8, an
    epilogue it knows."""
    residual = len(inputs) > 3 and inputs[3] is not None
    return (not residual and projection_inputs(inputs) is None and not is_fp8(attrs) and attrs.get("group", 1) == 1
            and attrs.get("activation") in ACTIVATION_CODES and not attrs.get("residual_after_activation")
            and direct_stem_applies(inputs[0], inputs[1]))


def _qlayer_direct_stem(x, w_words, bias, residual, dequant_scale, attrs, out: torch.Tensor | None = None,
                        tactic: str | None = None):
    """The layer by the stem kernel, its weight stored as TAP_WORDS ([words, Cout])."""
    full = torch.empty((w_words.shape[-1], x.shape[1], *attrs["kernel_shape"]), dtype=torch.int8, device="meta")
    geometry = igemm_geometry(x, full, attrs, require_cuda=False)
    if geometry is None or residual is not None or not direct_stem_int8([x, full, bias, None, dequant_scale], attrs):
        return None
    epilogue = _int8_epilogue(attrs)
    for unused in ("fp8", "residual_scale", "residual_after_activation"):  # no residual, never FP8
        epilogue.pop(unused)
    return direct_stem_conv(x, w_words, bias, geometry, dequant_scale=dequant_scale, out=out, tactic=tactic,
                            pdl=programmatic_launch(x, attrs), **epilogue)


def _kernel_tactic(x, wq, bias, residual, dequant_scale, attrs, gemm: bool, out: torch.Tensor | None = None):
    """The layer by its tactic when that is a library GEMM, the resident kernel, a TMA tile (of a
    convolution or a dense GEMM), an implicit-GEMM tile, the depthwise or the dp4a kernel; None for
    any other tactic, or where this one does not apply to these inputs (the caller then runs the
    emulation)."""
    name = attrs.get("tactic") or REFERENCE
    if name in LIBRARY_TACTICS:
        return _qlayer_library(x, wq, bias, residual, dequant_scale, attrs, name, gemm, out)
    depthwise_tile = depthwise_tile_for(name)
    if depthwise_tile is not None and not gemm:
        return _qlayer_depthwise(x, wq, bias, residual, dequant_scale, attrs, out, depthwise_tile)
    if name in DIRECT_WORDS_FORMS and not gemm:
        return _qlayer_direct_words(x, wq, bias, residual, dequant_scale, attrs, out, name)
    if name in DIRECT_STEM_FORMS and not gemm:
        return _qlayer_direct_stem(x, wq, bias, residual, dequant_scale, attrs, out, name)
    tactic = tactic_for(name)
    run = _KERNEL_RUNNERS.get(type(tactic))
    return None if run is None else run(x, wq, bias, residual, dequant_scale, attrs, tactic, gemm, out)


# How `_kernel_tactic` runs each kernel family's tactic on a QConv or QGemm.
_KERNEL_RUNNERS = {ResidentTile: _qlayer_resident, TmaTile: _qlayer_tma, GemmTmaTile: _qlayer_gemm_tma,
                   TileConfig: _qlayer_igemm}


def code_dtype(attrs: dict) -> torch.dtype:
    """The dtype of an INT8 (FP8) layer's codes."""
    return FP8_DTYPE if is_fp8(attrs) else torch.int8


def float_output_dtype(attrs: dict) -> torch.dtype:
    """What an INT8 (FP8) layer's output is stored as when it is not quantized: float32, or the
    float its readers compute in (FLOAT_OUTPUT: the layer's float32 values rounded to it, as each
    reader would have converted them on reading)."""
    return stored_float_dtype(attrs, torch.float32)


def qlayer_output_dtype(attrs: dict) -> torch.dtype:
    """What an INT8 (FP8) layer writes: its codes when its output is stored quantized, else
    `float_output_dtype`."""
    return float_output_dtype(attrs) if attrs.get("output_inv_scale") is None else code_dtype(attrs)


# A QConv may carry a projection (`passes/fuse_projected_residual.py`): inputs 5–8 are the projection
# layer's input, weight [Cout, K, 1, 1], bias and dequant scale, and the attributes
# "projection_strides" and "projection_input_inv_scale" its strides and input scale. Its residual is
# that unpadded 1×1 layer's output dequantized to float32, not requantized (what the layer's own
# epilogue gives with no output scale), added as a float residual (input 3 stays empty).
PROJECTION_FIRST_INPUT = 5


@register
@dataclass(frozen=True)
class ResidentSplitProjection(Tactic):
    """The projection run as a layer of its own before the resident kernel reads its float32 output
    as the residual: a slower route to the same numbers, for where the fused kernel is rejected.
    Named "resident_split_projection." + the resident tile's fields."""
    tile: ResidentTile

    FAMILY: ClassVar[str] = "resident_split_projection"
    SCHEME: ClassVar[tuple] = (Inline("tile", ResidentTile),)

    def describe(self, layer: LayerFacts) -> str:
        return (f"{layer.codes} triton GEMM of the projection (float32 out), then of the layer, weight tiles "
                f"resident over row tiles {self.tile.fields_text} + fused epilogue")


SPLIT_TACTIC = ResidentSplitProjection(replace(RESIDENT_TILES[0], n_adjacent=True)).name


def projection_inputs(inputs) -> list | None:
    """A projected layer's (input, weight, bias, dequant scale) of its projection, else None."""
    if len(inputs) <= PROJECTION_FIRST_INPUT or inputs[PROJECTION_FIRST_INPUT] is None:
        return None
    return list(inputs[PROJECTION_FIRST_INPUT:PROJECTION_FIRST_INPUT + 4])


def _projection_attrs(attrs: dict) -> dict:
    """The projection's own layer attributes: an unpadded 1×1 convolution whose output stays float32."""
    own = {"strides": list(attrs["projection_strides"]), "kernel_shape": [1, 1], "pads": [0, 0, 0, 0],
           "dilations": [1, 1], "group": 1, "input_inv_scale": attrs["projection_input_inv_scale"],
           "qmin": attrs.get("qmin", -QMAX), "output_inv_scale": None}
    return dict(own, qformat=attrs["qformat"]) if "qformat" in attrs else own


def _projected_residual(inputs, attrs: dict) -> torch.Tensor:
    """The emulation's projection: its exact accumulator, bias and dequant scale, in float32."""
    px, pw, pb, ps = projection_inputs(inputs)
    own = _projection_attrs(attrs)
    return _dequantize(int8_conv_accumulate(as_quantized(px, own), pw, own), pb, ps, 1, is_fp8(attrs))


# A projected layer has no implicit-GEMM tiles to fall back on where the resident tiles' programs are
# too few for the device (ResNet-50's layer1 at batch 1: 3,136 rows, 28 programs of the first tile
# on 132 SMs): then this tile, of a sixteenth of the first one's rows per program, is timed too.
FEW_ROWS_TILE = ResidentTile(32, 64, 2, 4, 2, n_adjacent=True)


def projected_tactics(inputs, attrs: dict, effort: int) -> list[str]:
    """The resident tiles with the projection fused (each timed as for a layer of the larger K;
    the early-residual variants have no residual to load early; each cols-loaded grouped tile of up
    to PROJECTION_COLUMNS_MAX_BLOCK_N columns also with proj-cols-loaded, the projection's columns
    loaded once too; FEW_ROWS_TILE where the first tile would leave multiprocessors idle) and SPLIT_TACTIC,
    where both the layer and its projection are resident-kernel layers on CUDA."""
    x, wq = inputs[0], inputs[1]
    px, pw = projection_inputs(inputs)[:2]
    if not px.is_cuda or not _projected_resident_applies(x, wq, px, pw, igemm_geometry(x, wq, attrs)):
        return []
    names = resident_tactics(effort, residual=False, k_total=max(wq.shape[1], pw.shape[1]))
    names += [replace(tile, projection_columns_loaded=True).name for tile in map(ResidentTile.parse, names)
              if tile.columns_loaded and tile.n_adjacent and tile.block_n <= PROJECTION_COLUMNS_MAX_BLOCK_N]
    rows = x.shape[0] * x.shape[2] * x.shape[3]
    programs = math.prod(RESIDENT_TILES[0].grid(rows, wq.shape[0]))
    if programs < torch.cuda.get_device_properties(x.device).multi_processor_count and FEW_ROWS_TILE.name not in names:
        names.append(FEW_ROWS_TILE.name)
    return names + [SPLIT_TACTIC]


def _projected_resident_applies(x, wq, px, pw, geometry: ConvGeometry | None) -> bool:
    """Whether the resident kernel runs the layer (stride 1) and its projection."""
    return (geometry is not None and resident_applies(x, wq.shape[1], geometry) and tuple(geometry.strides) == (1, 1)
            and resident_applies(px, pw.shape[1]))


def _projection(inputs, attrs: dict) -> Projection:
    px, pw, pb, ps = projection_inputs(inputs)
    return Projection(px, pw, pb, ps, tuple(attrs["projection_strides"]), attrs["projection_input_inv_scale"])


def _projected_kernel(inputs, attrs: dict, out: torch.Tensor | None = None) -> torch.Tensor | None:
    """A projected layer by its tactic (a resident tile, or SPLIT_TACTIC), or None for the emulation."""
    x, wq, bias, scale = inputs[0], inputs[1], inputs[2], inputs[4]
    tactic = tactic_for(attrs.get("tactic"))
    split = isinstance(tactic, ResidentSplitProjection)
    tile = tactic.tile if split else tactic
    if not isinstance(tile, ResidentTile):
        return None
    projection = _projection(inputs, attrs)
    if not _projected_resident_applies(x, wq, projection.x, projection.weight,
                                       _any_device_geometry(x, wq, attrs, gemm=False)):
        return None
    epilogue = _int8_epilogue(attrs)
    if split:
        residual = resident_gemm(projection.x, projection.weight, projection.bias, tile,
                                 dequant_scale=projection.dequant_scale, input_inv_scale=projection.input_inv_scale,
                                 qmin=epilogue["qmin"], fp8=epilogue["fp8"], strides=projection.strides)
        return resident_gemm(x, wq, bias, tile, dequant_scale=scale, residual=residual, out=out,
                             pdl=programmatic_launch(x, attrs), **epilogue)
    return resident_gemm(x, wq, bias, tile, dequant_scale=scale, projection=projection, out=out,
                         pdl=programmatic_launch(x, attrs), **epilogue)


def qconv_into(inputs, attrs, out: torch.Tensor) -> torch.Tensor | None:
    """QConv written straight into `out` (a channel slice of a Concat's buffer: INT8 or FP8 codes
    when the Concat passes them through, see `sartor/quant/quantize.py`) by the implicit-GEMM
    tiles, the resident kernel and the library GEMMs' epilogue, which store any pixel stride. None
    for the emulation, im2col and the windows (whose kernels write rows of their own): the layer
    then runs as usual and the Concat copies its result."""
    if out.dtype != qlayer_output_dtype(attrs) or pixel_stride(out) is None or fused_max_pool(attrs) is not None:
        return None
    if projection_inputs(inputs) is not None:
        return _projected_kernel(inputs, attrs, out)
    bias = inputs[2] if len(inputs) > 2 else None
    residual = inputs[3] if len(inputs) > 3 else None
    return _kernel_tactic(inputs[0], inputs[1], bias, residual, inputs[4], attrs, gemm=False, out=out)


def _qconv_kernel(x, wq, bias, residual, dequant_scale, attrs: dict) -> torch.Tensor | None:
    """The layer by its tactic when that is one of the kernels (windows, im2col, `_kernel_tactic`'s),
    else None (the emulation)."""
    tactic = tactic_for(attrs.get("tactic"))
    if tactic.fuses_max_pool:
        raise ValueError(f"QConv: tactic {attrs['tactic']} pools the layer's output, and the layer carries no max pool")
    if isinstance(tactic, WINDOW_TACTICS):
        y = _window_conv(x, wq, bias, residual, dequant_scale, attrs, tactic.tile, space_to_depth=tactic.space_to_depth)
        if y is not None:
            return y
    if isinstance(tactic, Im2colIgemm) and residual is None:
        y = _im2col_conv(x, wq, bias, dequant_scale, attrs, tactic.tile)
        if y is not None:
            return y
    return _kernel_tactic(x, wq, bias, residual, dequant_scale, attrs, gemm=False)


def _pooled_qconv(inputs, attrs: dict, pool: dict) -> torch.Tensor:
    """A QConv carrying its max pool (`ops/fused_pool.py`): one kernel for a pooled window tile
    ("max-pool"), else the layer by its tactic (the emulation too) and then the pool, by the Triton
    pool's first tile on CUDA (the pool's own timing is the unfused graph's)."""
    layer = without_max_pool(attrs)
    tactic = tactic_for(attrs.get("tactic"))
    if isinstance(tactic, WindowResident) and tactic.fuses_max_pool:
        if not pool_in_kernel(pool):
            raise ValueError(f"QConv: tactic {attrs['tactic']} pools 3x3/2 with padding 1, not the layer's {pool}")
        y = _window_conv(inputs[0], inputs[1], inputs[2] if len(inputs) > 2 else None, None, inputs[4], layer,
                         tactic.tile, space_to_depth=tactic.space_to_depth)
        if y is not None:
            return y
        layer["tactic"] = REFERENCE  # the windows do not apply to these inputs
    y = qconv(inputs, layer)
    return max_pool([y], dict(pool, tactic=POOL_TILES[0].name if y.is_cuda else REFERENCE))


@OPS.internal("QConv", tactics=_qlayer_tactics(gemm=False), weight_for_tactic=qlayer_weight_for_tactic,
              write_into=qconv_into, stores_any_float=True)
def qconv(inputs, attrs):
    """inputs: x, weight (int8 or float8_e4m3fn, [M, C/group, *k]), bias (int32 [M], FP8: float32
    [M], or omitted), residual (or omitted), dequant scale (float32 [M]), and for a projected layer
    its projection's four (PROJECTION_FIRST_INPUT). A layer carrying its max pool
    (`ops/fused_pool.py`) outputs the pooled codes."""
    pool = fused_max_pool(attrs)
    if pool is not None:
        return _pooled_qconv(inputs, attrs, pool)
    x, wq = inputs[0], inputs[1]
    bias = inputs[2] if len(inputs) > 2 else None
    residual = inputs[3] if len(inputs) > 3 else None
    if projection_inputs(inputs) is not None:
        y = _projected_kernel(inputs, attrs)
        residual = _projected_residual(inputs, attrs) if y is None else None
    else:
        y = _qconv_kernel(x, wq, bias, residual, inputs[4], attrs)
    if y is not None:
        return y
    acc = int8_conv_accumulate(as_quantized(x, attrs), wq, attrs)
    y = _epilogue(_dequantize(acc, bias, inputs[4], 1, is_fp8(attrs)), residual, attrs)
    # The emulation wins the timing of tiny layers on a GPU too: there it hands on the layout it
    # was given, as the kernels do, so that a Concat it feeds stays one channels-last buffer (the
    # CPU's convolution keeps the layout by itself).
    if x.is_cuda and x.dim() == 4 and pixel_stride(x) is not None:
        return y.to(qlayer_output_dtype(attrs), memory_format=torch.channels_last)
    return y.to(qlayer_output_dtype(attrs))


@OPS.internal("QGemm", tactics=_qlayer_tactics(gemm=True), weight_for_tactic=qlayer_weight_for_tactic,
              stores_any_float=True)
def qgemm(inputs, attrs):
    """inputs: x [..., K], weight (int8 or float8_e4m3fn [M, K]), bias (int32 [M], FP8: float32
    [M], or omitted), unused, dequant scale (float32 [M]). Gemm's alpha/beta and MatMul's weight
    layout were folded in at build time."""
    x, wq = inputs[0], inputs[1]
    bias = inputs[2] if len(inputs) > 2 else None
    y = _kernel_tactic(x, wq, bias, None, inputs[4], attrs, gemm=True)
    if y is not None:
        return y
    acc = int8_matmul_accumulate(as_quantized(x, attrs), wq)
    return _epilogue(_dequantize(acc, bias, inputs[4], -1, is_fp8(attrs)), None, attrs).to(qlayer_output_dtype(attrs))
