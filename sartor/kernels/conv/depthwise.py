"""2-D depthwise convolution over channels-last tensors in Triton, with the FusedConv epilogue.

The implicit GEMM does not serve grouped convolutions, so a depthwise layer (group = C = Cout:
MobileNetV3, EfficientNet, YOLO11's DWConv and C2PSA `pe`) otherwise runs cuDNN's depthwise kernel
and then a separate epilogue pass over memory, and cannot store into a Concat's channel slice.
Depthwise convolution does KH·KW multiply-adds per output value, so it is bound by memory traffic,
not arithmetic: no tensor cores, one read of the input per tap (neighbouring taps hit in L1/L2),
one write of the output.

Laid out as the max pool kernel is (sartor/kernels/pool/max_pool.py): each program owns a block of output
pixels × a block of channels; channels are contiguous in NHWC, so every tap is one coalesced load
of [BLOCK_P, BLOCK_C], and the weight, stored [KH, KW, C] by `pack_depthwise_weight`, is one
coalesced load of BLOCK_C per tap. Padding (asymmetric too) is done by masks, never by a padded
copy. Accumulation is float32; bias, residual (before or after the activation) and the
activation are applied before the single store, in the input's dtype, into a new channels-last
tensor or a channel slice of a wider one.

INT8 (a QConv's codes, `depthwise_qconv_nhwc`): int8 × int8 taps summed in int32, which is exact
(81 taps of 127 · 127 stay far below 2^31), then the implicit GEMM's INT8 epilogue (bias,
per-channel dequantization, residual, activation, requantization), so the output equals the
emulation's bit for bit; float inputs are quantized as they are loaded. Quantized so, a tap's codes
stay float32 values (rounded by adding 1.5·2^23, not converted) and are summed in float32, which holds
every such sum exactly (FLOAT_SUM_TAPS): each input value is read by every tap over it, and a
float → int8 and int8 → int32 conversion a value and tap ran at Hopper's conversion rate, an eighth of
its float32 one; the sums are converted to int32 once, for the epilogue.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from ..common.cache_keys import settle_cache_keys
from ..common.pdl import launch_options
from .igemm import ConvGeometry
from ..pointwise.epilogue import WORD_CODES, channels_last_output, code_words, pixel_stride, told_alignment, triton
from ..common.tile_steps import epilogue_arguments
from ..registry import DEPTHWISE_TAPS, Flag, LayerFacts, Number, Tactic, fixed_tactic, register, tactic_for

# Float32 holds every integer below 2^24 exactly: a sum of this many taps of codes (|code| ≤ 128, |weight|
# ≤ 127) stays below it in any order, so a float input's codes are summed in float32 (module docstring).
FLOAT_SUM_TAPS = (1 << 24) // (128 * 127)

if triton is not None:
    import triton.language as tl

    from ..common.pdl import await_previous_kernel
    from ..common.tile_steps import (float_codes, pixel_channel_tile, quantize_operand, store_epilogue, tap_pixels,
                                     window_origin)
    from ..pointwise.epilogue import told_multiple, told_pixel_strides

    @triton.jit
    def _depthwise_nhwc_kernel(x_ptr, w_ptr, bias_ptr, scale_ptr, res_ptr, y_ptr, P, C, H, W, OH, OW, y_row,
                               sxn, sxh, sxw, swc, swh, sww, srn, src, srh, srw, pad_h, pad_w,
                               in_inv_scale, res_scale, out_inv_scale, qmin, alpha, beta,
                               KH: tl.constexpr, KW: tl.constexpr, SH: tl.constexpr, SW: tl.constexpr,
                               DH: tl.constexpr, DW: tl.constexpr, INT8: tl.constexpr, QUANTIZE_INPUT: tl.constexpr,
                               HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, RES_QUANT: tl.constexpr,
                               RES_AFTER: tl.constexpr, ACT: tl.constexpr, OUT_QUANT: tl.constexpr,
                               BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr, CH_ALIGN: tl.constexpr = 1,
                               PDL: tl.constexpr = False, FLOAT_SUMS: tl.constexpr = False):
        # Channel counts and strides multiples of 8 that Triton cannot see (MobileNet's 24, 40, 72,
        # 120 channels): told, each pixel's channels, the taps' channel vectors and the stores go as
        # vectors. PDL: launched with programmatic dependent launch (`kernels/common/pdl.py`).
        C, y_row, sxn, sxh, sxw = told_pixel_strides(C, y_row, sxn, sxh, sxw, CH_ALIGN)
        swh = told_multiple(swh, CH_ALIGN)
        sww = told_multiple(sww, CH_ALIGN)
        srn = told_multiple(srn, CH_ALIGN)
        srh = told_multiple(srh, CH_ALIGN)
        srw = told_multiple(srw, CH_ALIGN)
        offs_p, offs_c, p_ok, c_ok, n, oh, ow = pixel_channel_tile(P, C, OH, OW, BLOCK_P, BLOCK_C)
        base, ih0, iw0 = window_origin(n, oh, ow, sxn, SH, SW, pad_h, pad_w)
        w_col = offs_c * swc
        await_previous_kernel(PDL)  # every tap's pixels below are an activation's
        # FLOAT_SUMS: a float input's codes summed as float32 values, exactly (up to FLOAT_SUM_TAPS taps).
        if INT8 and not FLOAT_SUMS:
            acc = tl.zeros((BLOCK_P, BLOCK_C), dtype=tl.int32)
        else:
            acc = tl.zeros((BLOCK_P, BLOCK_C), dtype=tl.float32)
        for kh in tl.static_range(KH):
            for kw in tl.static_range(KW):
                pixels, ok = tap_pixels(base, ih0 + kh * DH, iw0 + kw * DW, p_ok, H, W, sxh, sxw)
                v = tl.load(x_ptr + pixels[:, None] + offs_c[None, :], mask=ok[:, None] & c_ok[None, :], other=0.0)
                tap = tl.load(w_ptr + w_col + (kh * swh + kw * sww), mask=c_ok, other=0.0)
                if FLOAT_SUMS:  # padding loads 0.0, whose code is 0
                    acc += float_codes(v.to(tl.float32), in_inv_scale, qmin) * tap.to(tl.float32)[None, :]
                elif INT8:
                    if QUANTIZE_INPUT:
                        v = quantize_operand(v.to(tl.float32), in_inv_scale, qmin)
                    acc += v.to(tl.int32) * tap.to(tl.int32)[None, :]
                else:
                    acc += v.to(tl.float32) * tap.to(tl.float32)[None, :]
        if FLOAT_SUMS:
            acc = acc.to(tl.int32)
        # The implicit-GEMM kernel's epilogue: bias, (dequantization,) residual, activation,
        # (requantization,) one store.
        store_epilogue(acc, offs_p, offs_c, p_ok, c_ok, n, oh, ow, bias_ptr, scale_ptr, res_ptr, y_ptr,
                        y_row, srn, src, srh, srw, res_scale, out_inv_scale, qmin, alpha, beta,
                        INT8, False, HAS_BIAS, HAS_RES, RES_QUANT, RES_AFTER, ACT, OUT_QUANT)


    @triton.jit
    def _depthwise_int8_words_kernel(x_ptr, w_ptr, bias_ptr, scale_ptr, res_ptr, y_ptr, P, C, H, W, OH, OW, y_row,
                                     sxn, sxh, sxw, swh, sww, srn, src, srh, srw, pad_h, pad_w,
                                     res_scale, out_inv_scale, qmin, alpha, beta,
                                     KH: tl.constexpr, KW: tl.constexpr, SH: tl.constexpr, SW: tl.constexpr,
                                     DH: tl.constexpr, DW: tl.constexpr, HAS_BIAS: tl.constexpr,
                                     HAS_RES: tl.constexpr, RES_QUANT: tl.constexpr, RES_AFTER: tl.constexpr,
                                     ACT: tl.constexpr, OUT_QUANT: tl.constexpr, BLOCK_P: tl.constexpr,
                                     BLOCK_W: tl.constexpr, DP4A: tl.constexpr = False, WORD_ALIGN: tl.constexpr = 1,
                                     CH_ALIGN: tl.constexpr = 1, PDL: tl.constexpr = False):
        """The INT8 depthwise convolution over words of four channels' codes: x and w are int32
        views (x's strides, w's tap strides and BLOCK_W count words; C, y_row and the residual's
        strides count channels). Each channel lane of a word has its own int32 accumulator, and a
        tap adds lane L's product with one dp4a of the input word and the weight word masked to
        lane L (DP4A; the interpreter shifts the lane out instead): one instruction a value and
        tap, where widening each code and multiplying took two (docs/decisions/kernel-depthwise-int8.md).
        WORD_ALIGN / CH_ALIGN: powers of two dividing the word and channel strides (`told_alignment`). PDL:
        launched with programmatic dependent launch (`kernels/common/pdl.py`)."""
        sxn = told_multiple(sxn, WORD_ALIGN)
        sxh = told_multiple(sxh, WORD_ALIGN)
        sxw = told_multiple(sxw, WORD_ALIGN)
        swh = told_multiple(swh, WORD_ALIGN)
        sww = told_multiple(sww, WORD_ALIGN)
        C = told_multiple(C, CH_ALIGN)
        y_row = told_multiple(y_row, CH_ALIGN)
        offs_p, offs_w, p_ok, w_ok, n, oh, ow = pixel_channel_tile(P, C // 4, OH, OW, BLOCK_P, BLOCK_W)
        base, ih0, iw0 = window_origin(n, oh, ow, sxn, SH, SW, pad_h, pad_w)
        await_previous_kernel(PDL)  # every tap's words below are an activation's
        lane0 = tl.zeros((BLOCK_P, BLOCK_W), dtype=tl.int32)
        lane1 = tl.zeros((BLOCK_P, BLOCK_W), dtype=tl.int32)
        lane2 = tl.zeros((BLOCK_P, BLOCK_W), dtype=tl.int32)
        lane3 = tl.zeros((BLOCK_P, BLOCK_W), dtype=tl.int32)
        for kh in tl.static_range(KH):
            for kw in tl.static_range(KW):
                pixels, ok = tap_pixels(base, ih0 + kh * DH, iw0 + kw * DW, p_ok, H, W, sxh, sxw)
                words = tl.load(x_ptr + pixels[:, None] + offs_w[None, :], mask=ok[:, None] & w_ok[None, :], other=0)
                taps = tl.load(w_ptr + offs_w + (kh * swh + kw * sww), mask=w_ok, other=0)[None, :]
                lane0 = _lane_product_sum(words, taps, 0, lane0, DP4A)
                lane1 = _lane_product_sum(words, taps, 1, lane1, DP4A)
                lane2 = _lane_product_sum(words, taps, 2, lane2, DP4A)
                lane3 = _lane_product_sum(words, taps, 3, lane3, DP4A)
        # channel 4j + L is lane L of word j
        acc = tl.interleave(tl.interleave(lane0, lane2), tl.interleave(lane1, lane3))
        offs_c = tl.program_id(1) * (4 * BLOCK_W) + tl.arange(0, 4 * BLOCK_W)
        store_epilogue(acc, offs_p, offs_c, p_ok, offs_c < C, n, oh, ow, bias_ptr, scale_ptr, res_ptr, y_ptr,
                        y_row, srn, src, srh, srw, res_scale, out_inv_scale, qmin, alpha, beta,
                        True, False, HAS_BIAS, HAS_RES, RES_QUANT, RES_AFTER, ACT, OUT_QUANT)

    @triton.jit
    def _lane_product_sum(words, taps, LANE: tl.constexpr, acc, DP4A: tl.constexpr):
        """acc + (byte LANE of `words`) × (byte LANE of `taps`), both signed codes."""
        if DP4A:
            # the other lanes' taps zeroed, so are their products (a mask as a tensor: 0xFF << 24 is no int32 literal)
            lane_taps = taps & (tl.full((1, 1), 0xFF, tl.int32) << (8 * LANE))
            return tl.inline_asm_elementwise("dp4a.s32.s32 $0, $1, $2, $3;", "=r,r,r,r", [words, lane_taps, acc],
                                             dtype=tl.int32, is_pure=True, pack=1)
        return acc + ((words << (24 - 8 * LANE)) >> 24) * ((taps << (24 - 8 * LANE)) >> 24)


DEPTHWISE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# The taps are unrolled (one coalesced load each); beyond 9×9 the unrolled kernel only costs
# compile time for shapes no vision model uses.
MAX_TAPS = 81
# 64 channels of FP16 are one 128-byte line per pixel per tap; a [64, 64] float32 accumulator is 32
# registers a thread at 4 warps, leaving room for the unrolled 5×5 loads.
_BLOCK_C = 64
# 128 INT8 channels are that line of codes (TRITON_DEPTHWISE_INT8_LINES); the builder times both.
LINE_BLOCK_C = 128
_BLOCK_ELEMENTS = 4096
_MIN_BLOCK_P = 16


def _depthwise_layout(x: torch.Tensor, w: torch.Tensor) -> bool:
    """A channels-last 4-D input (or a channel slice of one) and a [C, 1, KH, KW] weight of at most
    MAX_TAPS taps: one filter per input channel, channel multiplier 1."""
    return (triton is not None and x.dim() == 4 and w.dim() == 4 and w.shape[0] == x.shape[1] and w.shape[1] == 1
            and w.shape[2] * w.shape[3] <= MAX_TAPS and pixel_stride(x) is not None)


def depthwise_supported(x: torch.Tensor, w: torch.Tensor) -> bool:
    """A float channels-last input (or a channel slice of one) and a [C, 1, KH, KW] weight: one
    filter per input channel, channel multiplier 1. The caller checks group == C."""
    return x.dtype in DEPTHWISE_DTYPES and w.dtype in DEPTHWISE_DTYPES and _depthwise_layout(x, w)


def pack_depthwise_weight(w: torch.Tensor) -> torch.Tensor:
    """A [C, 1, KH, KW] weight with its memory ordered [KH, KW, C] (its shape kept, so torch's
    convolution and the geometry still read it): each tap's channel vector is contiguous."""
    return w.permute(2, 3, 0, 1).contiguous().permute(2, 3, 0, 1)


def _block_sizes(pixels: int, channels: int, min_programs: int, max_block_c: int = _BLOCK_C,
                 elements: int = _BLOCK_ELEMENTS) -> tuple[int, int]:
    """Blocks of `elements` (pixels × channels), halved along pixels while the grid would leave SMs idle
    (late MobileNet stages hold 7×7 pixels at batch 1)."""
    block_c = min(max_block_c, max(16, triton.next_power_of_2(channels)))
    block_p = max(_MIN_BLOCK_P, elements // block_c)
    while block_p > _MIN_BLOCK_P and triton.cdiv(pixels, block_p) * triton.cdiv(channels, block_c) < min_programs:
        block_p //= 2
    return block_p, block_c


def min_programs(device: torch.device) -> int:
    # Two programs per SM hide a load's latency behind the other's; the interpreter wants few.
    if device.type != "cuda":
        return 1
    return 2 * torch.cuda.get_device_properties(device).multi_processor_count


def depthwise_conv_nhwc(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, geometry: ConvGeometry, *,
                        residual: torch.Tensor | None = None, activation: str | None = None,
                        alpha: float | None = None, beta: float | None = None,
                        residual_after_activation: bool = False, out: torch.Tensor | None = None,
                        pdl: bool = False, tile: "DepthwiseTile | None" = None) -> torch.Tensor:
    """Depthwise convolution of a channels-last [N, C, H, W] tensor (any pixel stride) by a
    [C, 1, KH, KW] weight (any strides; `pack_depthwise_weight`'s layout loads fastest), then
    bias, residual (the output's shape, any strides) and activation. The result has x's dtype:
    a new channels-last tensor, or `out` (a channel slice of a Concat's buffer). `pdl`: launched with
    programmatic dependent launch (CUDA tensors only). `tile`: the elements a program, the widest channel
    block and the warps (default: TRITON_DEPTHWISE's); every tile sums each output's taps in the same order."""
    tile = tile or ORIGINAL_DEPTHWISE_TILE
    if tile.words:
        raise ValueError(f"depthwise_conv_nhwc: {tile.name} reads INT8 codes as words; a float layer has none")
    if not depthwise_supported(x, w):
        raise ValueError(f"depthwise_conv_nhwc: input {tuple(x.shape)} {x.dtype} strides {x.stride()} and weight "
                         f"{tuple(w.shape)} are not a channels-last depthwise convolution")
    n, c, h, w_in = x.shape
    oh, ow = geometry.out_hw
    shape = (n, c, oh, ow)
    y = channels_last_output(shape, x.dtype, x.device, out, "depthwise_conv_nhwc")
    if residual is not None and tuple(residual.shape) != shape:
        raise ValueError(f"depthwise_conv_nhwc: residual {tuple(residual.shape)} is not the output's shape {shape}")
    scalars, flags = epilogue_arguments(quantized=False, fp8=False, bias=bias, residual=residual, activation=activation,
                                        alpha=alpha, beta=beta, residual_after_activation=residual_after_activation,
                                        residual_scale=None, output_inv_scale=None, qmin=-127.0)
    _launch(x, w, bias, None, residual, y, geometry, 1.0, scalars, dict(flags, QUANTIZE_INPUT=False), fusion=True,
            pdl=pdl, tile=tile)
    return y


def depthwise_codes_supported(x: torch.Tensor, wq: torch.Tensor) -> bool:
    """An INT8 depthwise layer the kernel runs: int8 codes (or a float input, quantized on load)
    channels-last, and a [C, 1, KH, KW] int8 weight."""
    return (wq.dtype == torch.int8 and (x.dtype == torch.int8 or x.dtype in DEPTHWISE_DTYPES)
            and _depthwise_layout(x, wq))


def depthwise_qconv_nhwc(x: torch.Tensor, wq: torch.Tensor, bias: torch.Tensor | None, geometry: ConvGeometry, *,
                         dequant_scale: torch.Tensor, input_inv_scale: float, residual: torch.Tensor | None = None,
                         activation: str | None = None, alpha: float | None = None, beta: float | None = None,
                         residual_after_activation: bool = False, residual_scale: float | None = None,
                         output_inv_scale: float | None = None, qmin: int = -127,
                         accumulator_bound: int | None = None, float_dtype: torch.dtype = torch.float32,
                         out: torch.Tensor | None = None, tile: "DepthwiseTile | None" = None,
                         pdl: bool = False) -> torch.Tensor:
    """An INT8 depthwise QConv: x int8 codes (or float, quantized with `input_inv_scale` on load),
    wq int8 [C, 1, KH, KW] (`pack_depthwise_weight`'s layout loads fastest), bias int32, the
    per-channel `dequant_scale`; the output is int8 codes with `output_inv_scale`, else `float_dtype`,
    channels-last or into `out`. The arithmetic is conv_igemm's, so it equals the emulation.
    `tile`: the blocks (default: TRITON_DEPTHWISE_INT8's): elements a program, the widest channel block,
    warps, and whether codes are read as words of four channels, a dp4a a lane, where the input's
    channels, strides and offset allow it (`code_words`; else code by code). `pdl`: launched with
    programmatic dependent launch (CUDA tensors only)."""
    tile = tile or ORIGINAL_DEPTHWISE_TILE
    if not depthwise_codes_supported(x, wq):
        raise ValueError(f"depthwise_qconv_nhwc: input {tuple(x.shape)} {x.dtype} strides {x.stride()} and weight "
                         f"{tuple(wq.shape)} {wq.dtype} are not a channels-last INT8 depthwise convolution")
    n, c, _, _ = x.shape
    shape = (n, c, *geometry.out_hw)
    y = channels_last_output(shape, torch.int8 if output_inv_scale is not None else float_dtype, x.device, out,
                             "depthwise_qconv_nhwc")
    if residual is not None and tuple(residual.shape) != shape:
        raise ValueError(f"depthwise_qconv_nhwc: residual {tuple(residual.shape)} is not the output's shape {shape}")
    scalars, flags = epilogue_arguments(quantized=True, fp8=False, bias=bias, residual=residual, activation=activation,
                                        alpha=alpha, beta=beta, residual_after_activation=residual_after_activation,
                                        residual_scale=residual_scale, output_inv_scale=output_inv_scale, qmin=qmin,
                                        accumulator_bound=accumulator_bound)
    x_words = code_words(x) if tile.words else None
    if x_words is not None:
        _launch_words(x_words, wq, bias, dequant_scale, residual, y, geometry, scalars, flags, tile, pdl)
        return y
    quantize_input = x.dtype != torch.int8
    float_sums = quantize_input and geometry.kernel[0] * geometry.kernel[1] <= FLOAT_SUM_TAPS
    # No fused multiply-adds: the epilogue must round as the emulation does (see conv_igemm).
    _launch(x, wq, bias, dequant_scale, residual, y, geometry, float(input_inv_scale), scalars,
            dict(flags, QUANTIZE_INPUT=quantize_input, FLOAT_SUMS=float_sums), fusion=False, pdl=pdl, tile=tile)
    return y


def _launch_words(x_words: torch.Tensor, wq: torch.Tensor, bias, scale, residual, y: torch.Tensor,
                  geometry: ConvGeometry, scalars: tuple, flags: dict, tile: "DepthwiseTile", pdl: bool) -> None:
    n, oh, ow = y.shape[0], *geometry.out_hw
    kh, kw = geometry.kernel
    c = y.shape[1]
    # the packed weight's memory is [KH, KW, C] (pack_depthwise_weight): as words of four channels' taps
    w_words = wq.permute(2, 3, 0, 1).reshape(kh, kw, c).contiguous().view(torch.int32)
    sxn, sxh, sxw = x_words.stride()[:3]
    swh, sww = w_words.stride()[:2]
    rs = residual.stride() if residual is not None else (0, 0, 0, 0)
    pixels = n * oh * ow
    block_p, block_c = _block_sizes(pixels, c, min_programs(y.device), tile.max_block_c, tile.elements)
    block_w = block_c // WORD_CODES
    kept = ("HAS_BIAS", "HAS_RES", "RES_QUANT", "RES_AFTER", "ACT", "OUT_QUANT")
    grid = (triton.cdiv(pixels, block_p), triton.cdiv(c // WORD_CODES, block_w))
    _depthwise_int8_words_kernel[grid](
        x_words, w_words, bias if bias is not None else w_words, scale if scale is not None else w_words,
        residual if residual is not None else y, y, pixels, c, x_words.shape[1], x_words.shape[2], oh, ow,
        pixel_stride(y), sxn, sxh, sxw, swh, sww, *rs, geometry.pads[0], geometry.pads[1], *scalars,
        KH=kh, KW=kw, SH=geometry.strides[0], SW=geometry.strides[1], DH=geometry.dilations[0],
        DW=geometry.dilations[1], **{k: flags[k] for k in kept}, BLOCK_P=block_p, BLOCK_W=block_w,
        DP4A=y.device.type == "cuda", WORD_ALIGN=told_alignment(sxn, sxh, sxw, swh, sww),
        CH_ALIGN=told_alignment(c, pixel_stride(y), rs[0], rs[2], rs[3]), PDL=pdl, num_warps=tile.warps,
        enable_fp_fusion=False, **launch_options(pdl))


def _launch(x: torch.Tensor, w: torch.Tensor, bias, scale, residual, y: torch.Tensor, geometry: ConvGeometry,
            in_inv_scale: float, scalars: tuple, flags: dict, fusion: bool, pdl: bool,
            tile: "DepthwiseTile") -> None:
    flags = {k: v for k, v in flags.items() if k != "FP8"}  # no FP8 depthwise: its layers keep the emulation
    n, c, h, w_in = x.shape
    oh, ow = geometry.out_hw
    sxn, _, sxh, sxw = x.stride()
    swc, _, swh, sww = w.stride()
    rs = residual.stride() if residual is not None else (0, 0, 0, 0)
    pixels = n * oh * ow
    block_p, block_c = _block_sizes(pixels, c, min_programs(x.device), tile.max_block_c, tile.elements)
    grid = (triton.cdiv(pixels, block_p), triton.cdiv(c, block_c))
    _depthwise_nhwc_kernel[grid](
        x, w, bias if bias is not None else w, scale if scale is not None else w,
        residual if residual is not None else y, y,
        pixels, c, h, w_in, oh, ow, pixel_stride(y), sxn, sxh, sxw, swc, swh, sww, *rs,
        geometry.pads[0], geometry.pads[1], in_inv_scale, *scalars,
        KH=geometry.kernel[0], KW=geometry.kernel[1], SH=geometry.strides[0], SW=geometry.strides[1],
        DH=geometry.dilations[0], DW=geometry.dilations[1], **flags,
        BLOCK_P=block_p, BLOCK_C=block_c,
        CH_ALIGN=told_alignment(c, sxn, sxh, sxw, pixel_stride(y), swh, sww, rs[0], rs[2], rs[3]), PDL=pdl,
        num_warps=tile.warps, enable_fp_fusion=fusion, **launch_options(pdl))


@register
@dataclass(frozen=True)
class DepthwiseTile(Tactic):
    """The depthwise kernels' blocks: elements (pixels × channels) a program, the widest channel block,
    warps and, for INT8 codes, whether they are read as words of four channels (a dp4a a lane). Named e.g.
    "depthwise.elements2048.w8" (64-channel blocks), "depthwise.elements2048.channels128.w8.words". The
    fixed names below are the original blocks; these are the others, timed beside them
    (docs/decisions/kernel-depthwise-blocks.md). A float layer runs the float kernel in them, an INT8
    layer the codes' kernels."""
    elements: int
    warps: int
    max_block_c: int = _BLOCK_C
    words: bool = False

    FAMILY: ClassVar[str] = "depthwise"
    WEIGHT_LAYOUT: ClassVar[str] = DEPTHWISE_TAPS
    PROGRAMMATIC_LAUNCH: ClassVar[bool] = True
    SCHEME: ClassVar[tuple] = (Number("elements", "elements"), Number("max_block_c", "channels", omit=_BLOCK_C),
                               Number("warps", "w"), Flag("words", "words"))

    def invalid(self) -> str | None:
        powers = all(v > 0 and v & (v - 1) == 0 for v in (self.elements, self.warps, self.max_block_c))
        if not powers or self.elements < _MIN_BLOCK_P * self.max_block_c:
            return f"sizes are powers of 2, elements at least {_MIN_BLOCK_P} pixels of the channel block"
        return None

    def describe(self, layer: LayerFacts) -> str:
        int8 = self.words or layer.op_type == "QConv"
        if self.words:
            codes = " of int8 codes as words of four channels, a dp4a a lane, int32 accumulate"
        else:
            codes = " of int8 codes, int32 accumulate" if int8 else ", fp32 accumulate"
        return (f"triton channels-last depthwise conv{codes}, padding by masks, {self.elements} elements of up to "
                f"{self.max_block_c} channels a program, {self.warps} warps + fused {'INT8 ' if int8 else ''}epilogue")


ORIGINAL_DEPTHWISE_TILE = DepthwiseTile(_BLOCK_ELEMENTS, 4)
# The original blocks, under the names engines already carry: the float kernel; the INT8 one in 64-channel
# blocks, in 128-channel ones (a 128-byte line of codes per pixel per tap, as the float kernel's 64 halves
# are; offered where a layer has more than 64 channels), and reading words of four channels (offered where
# the channels are a multiple of four).
TRITON_DEPTHWISE = "triton_depthwise"
TRITON_DEPTHWISE_INT8 = "triton_depthwise_int8"
TRITON_DEPTHWISE_INT8_LINES = "triton_depthwise_int8_lines"
TRITON_DEPTHWISE_INT8_WORDS = "triton_depthwise_int8_words"
NAMED_DEPTHWISE_TILES = {
    TRITON_DEPTHWISE: ORIGINAL_DEPTHWISE_TILE,
    TRITON_DEPTHWISE_INT8: ORIGINAL_DEPTHWISE_TILE,
    TRITON_DEPTHWISE_INT8_LINES: DepthwiseTile(_BLOCK_ELEMENTS, 4, LINE_BLOCK_C),
    TRITON_DEPTHWISE_INT8_WORDS: DepthwiseTile(_BLOCK_ELEMENTS, 4, LINE_BLOCK_C, words=True),
}
for _name, _tile in NAMED_DEPTHWISE_TILES.items():  # described as their blocks are
    fixed_tactic(_name, _tile.describe, weight_layout=DEPTHWISE_TAPS, programmatic_launch=True)

# Fewer elements a thread than the original blocks: their registers left few warps an SM to a kernel that
# waits on its loads (docs/decisions/kernel-depthwise-blocks.md). Float layers, then INT8 codes in words.
DEPTHWISE_TILES = (DepthwiseTile(2048, 4), DepthwiseTile(2048, 8), DepthwiseTile(1024, 8))
DEPTHWISE_WORDS_TILES = (DepthwiseTile(2048, 8, LINE_BLOCK_C, words=True),
                         DepthwiseTile(4096, 8, LINE_BLOCK_C, words=True))
DEPTHWISE_TILES_PER_EFFORT = {1: 1, 2: 2, 3: 3}


def depthwise_tiles(effort: int, words: bool = False) -> list[DepthwiseTile]:
    """The blocks timed at `effort` beside the named ones: a float layer's, or (`words`) those of INT8
    codes read as words."""
    tiles = DEPTHWISE_WORDS_TILES if words else DEPTHWISE_TILES
    return list(tiles[:DEPTHWISE_TILES_PER_EFFORT.get(effort, len(tiles))])


def depthwise_tile_for(tactic: str | None) -> DepthwiseTile | None:
    """The blocks a layer's tactic runs a depthwise kernel in, or None for another kernel."""
    if tactic in NAMED_DEPTHWISE_TILES:
        return NAMED_DEPTHWISE_TILES[tactic]
    chosen = tactic_for(tactic)
    return chosen if isinstance(chosen, DepthwiseTile) else None


settle_cache_keys(globals())  # last, once every Triton function above exists (common/cache_keys.py)
