"""Dense INT8 convolutions of few channels on the CUDA cores: the codes read as int32 words of four
input channels, one dp4a a word, tap, output pixel and output channel.

For the layers where the tensor cores have little to do: a 3×3 convolution of 16 channels into 8
(YOLO11n's C3k2 at 160×160) is a GEMM with N = 8, half of the narrowest tile an mma takes, and K
= 144, nine steps of 16; every implicit-GEMM tile ran it no faster in INT8 than in FP16
(docs/decisions/kernel-direct-int8-words.md). Here each program owns a block of output pixels and
a block of output channels, with an int32 accumulator for each pair. A tap loads each of its
pixels' words once (the neighbouring taps hitting in L1) and the weight's words for each output
channel (the same for every program), a word at a time or, in the tile forms, a tap's words as
two tiles of vector loads (DIRECT_WORDS_FORMS, each a tactic the builder times); one dp4a adds
the four products of a word to the accumulator. Padding is done by masks.

The weight is stored channels-last ([Cout, KH, KW, Cin] in memory, the CHANNELS_LAST layout), so
the four input channels of a word are one int32. The sums are the exact int32 sums, and the
epilogue is the implicit GEMM's (`store_epilogue`: bias, per-channel dequantization, residual,
activation, requantization, one store, into a Concat's channel slice too), so the output equals
the emulation's bit for bit, as the depthwise kernel's does. Under Triton's interpreter, which has
no inline assembly, the four lanes' products are summed by shifts instead.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..common.cache_keys import settle_cache_keys
from ..common.pdl import launch_options
from ..common.tile_steps import epilogue_arguments
from ..pointwise.epilogue import WORD_CODES, channels_last_output, code_words, pixel_stride, told_alignment, triton
from ..registry import CHANNELS_LAST, fixed_tactic
from .depthwise import min_programs
from .igemm import ConvGeometry

if triton is not None:
    import triton.language as tl

    from ..common.pdl import await_previous_kernel
    from ..common.tile_steps import store_epilogue, pixel_channel_tile, tap_pixels, window_origin
    from ..pointwise.epilogue import told_multiple

    @triton.jit
    def _direct_int8_words_kernel(x_ptr, w_ptr, bias_ptr, scale_ptr, res_ptr, y_ptr, P, COUT, H, W, OH, OW, y_row,
                                  sxn, sxh, sxw, swo, swh, sww, srn, src, srh, srw, pad_h, pad_w,
                                  res_scale, out_inv_scale, qmin, alpha, beta,
                                  WORDS: tl.constexpr, KH: tl.constexpr, KW: tl.constexpr, SH: tl.constexpr,
                                  SW: tl.constexpr, DH: tl.constexpr, DW: tl.constexpr, HAS_BIAS: tl.constexpr,
                                  HAS_RES: tl.constexpr, RES_QUANT: tl.constexpr, RES_AFTER: tl.constexpr,
                                  ACT: tl.constexpr, OUT_QUANT: tl.constexpr, BLOCK_P: tl.constexpr,
                                  BLOCK_CO: tl.constexpr, DP4A: tl.constexpr = False, WORD_ALIGN: tl.constexpr = 1,
                                  CH_ALIGN: tl.constexpr = 1, TAP_ALIGN: tl.constexpr = 1,
                                  TILES: tl.constexpr = False, WORDS_P2: tl.constexpr = 1,
                                  PDL: tl.constexpr = False):
        """x and w are int32 views: x's strides and w's strides count words (WORDS a pixel's input
        channels), COUT, y_row and the residual's strides count channels. WORD_ALIGN, CH_ALIGN and
        TAP_ALIGN: powers of two dividing the input's word strides, the channel strides and the
        weight's word strides (`told_alignment`). TILES: each tap's words loaded as one [BLOCK_P,
        WORDS_P2] and one [BLOCK_CO, WORDS_P2] tile (a pixel's and an output channel's words are
        contiguous: vector loads), each word then taken from its row; else one word at a time. PDL:
        launched with programmatic dependent launch (`kernels/common/pdl.py`)."""
        sxn = told_multiple(sxn, WORD_ALIGN)
        sxh = told_multiple(sxh, WORD_ALIGN)
        sxw = told_multiple(sxw, WORD_ALIGN)
        swo = told_multiple(swo, TAP_ALIGN)
        swh = told_multiple(swh, TAP_ALIGN)
        sww = told_multiple(sww, TAP_ALIGN)
        COUT = told_multiple(COUT, CH_ALIGN)  # whole vectors of channels stored at once
        y_row = told_multiple(y_row, CH_ALIGN)
        offs_p, offs_c, p_ok, c_ok, n, oh, ow = pixel_channel_tile(P, COUT, OH, OW, BLOCK_P, BLOCK_CO)
        base, ih0, iw0 = window_origin(n, oh, ow, sxn, SH, SW, pad_h, pad_w)
        offs_w = tl.arange(0, WORDS_P2)
        w_ok = offs_w < WORDS
        await_previous_kernel(PDL)  # every tap's words below are an activation's
        acc = tl.zeros((BLOCK_P, BLOCK_CO), dtype=tl.int32)
        for kh in tl.static_range(KH):
            for kw in tl.static_range(KW):
                pixels, ok = tap_pixels(base, ih0 + kh * DH, iw0 + kw * DW, p_ok, H, W, sxh, sxw)
                tap = w_ptr + offs_c * swo + (kh * swh + kw * sww)
                if TILES:
                    word_tile = tl.load(x_ptr + pixels[:, None] + offs_w[None, :], mask=ok[:, None] & w_ok[None, :],
                                        other=0)
                    tap_tile = tl.load(tap[:, None] + offs_w[None, :], mask=c_ok[:, None] & w_ok[None, :], other=0)
                for j in tl.static_range(WORDS):
                    if TILES:  # the row's j-th word: a sum of one nonzero, within each thread's row
                        words = tl.sum(tl.where(offs_w[None, :] == j, word_tile, 0), axis=1)
                        taps = tl.sum(tl.where(offs_w[None, :] == j, tap_tile, 0), axis=1)
                    else:
                        words = tl.load(x_ptr + pixels + j, mask=ok, other=0)
                        taps = tl.load(tap + j, mask=c_ok, other=0)
                    acc = four_products_sum(tl.broadcast_to(words[:, None], (BLOCK_P, BLOCK_CO)),
                                            tl.broadcast_to(taps[None, :], (BLOCK_P, BLOCK_CO)), acc, DP4A)
        store_epilogue(acc, offs_p, offs_c, p_ok, c_ok, n, oh, ow, bias_ptr, scale_ptr, res_ptr, y_ptr,
                        y_row, srn, src, srh, srw, res_scale, out_inv_scale, qmin, alpha, beta,
                        True, False, HAS_BIAS, HAS_RES, RES_QUANT, RES_AFTER, ACT, OUT_QUANT)

    @triton.jit
    def four_products_sum(words, taps, acc, DP4A: tl.constexpr):
        """acc + the sum of the four signed byte products of `words` and `taps`."""
        if DP4A:
            return tl.inline_asm_elementwise("dp4a.s32.s32 $0, $1, $2, $3;", "=r,r,r,r", [words, taps, acc],
                                             dtype=tl.int32, is_pure=True, pack=1)
        for lane in tl.static_range(4):
            acc += ((words << (24 - 8 * lane)) >> 24) * ((taps << (24 - 8 * lane)) >> 24)
        return acc


# Where the CUDA cores can be worth timing against the tensor cores: few input and output channels.
# A program unrolls KH·KW·Cin/4 word steps; more than this is compile time for layers the implicit
# GEMM serves well.
MAX_IN_CHANNELS = 32
MAX_OUT_CHANNELS = 32
MAX_WORD_STEPS = 72
_BLOCK_ELEMENTS = 2048  # accumulators a program: 16 int32 registers a thread at 4 warps
_MIN_BLOCK_P = 32


def direct_words_applies(x: torch.Tensor, wq: torch.Tensor) -> bool:
    """Whether the kernel runs this dense convolution: INT8 codes whose channels come in whole words
    (`code_words`), an int8 [Cout, Cin, KH, KW] weight of group 1, and few channels."""
    if wq.dtype != torch.int8 or wq.dim() != 4 or x.dim() != 4 or wq.shape[1] != x.shape[1]:
        return False
    cout, cin, kh, kw = wq.shape
    return (cin <= MAX_IN_CHANNELS and cout <= MAX_OUT_CHANNELS and kh * kw * cin // WORD_CODES <= MAX_WORD_STEPS
            and code_words(x) is not None)


def weight_words(wq: torch.Tensor) -> torch.Tensor:
    """The weight as [Cout, KH, KW, Cin/4] int32 words of four input channels (a copy only where it
    is not stored channels-last, as CHANNELS_LAST stores it)."""
    cout, cin, kh, kw = wq.shape
    # viewed again with its shape: a 1×1 weight's unit dims may keep strides a word view refuses
    return wq.permute(0, 2, 3, 1).contiguous().view(cout, kh, kw, cin).view(torch.int32)


def block_sizes(pixels: int, channels: int, min_programs: int, block_elements: int) -> tuple[int, int]:
    """All the output channels a program, pixels as `block_elements` accumulators allow, halved
    while the grid would leave SMs idle."""
    block_co = max(8, triton.next_power_of_2(channels))
    block_p = max(_MIN_BLOCK_P, block_elements // block_co)
    while block_p > _MIN_BLOCK_P and triton.cdiv(pixels, block_p) < min_programs:
        block_p //= 2
    return block_p, block_co


def direct_int8_words_conv(x: torch.Tensor, wq: torch.Tensor, bias: torch.Tensor | None, geometry: ConvGeometry, *,
                           dequant_scale: torch.Tensor, residual: torch.Tensor | None = None,
                           activation: str | None = None, alpha: float | None = None, beta: float | None = None,
                           residual_after_activation: bool = False, residual_scale: float | None = None,
                           output_inv_scale: float | None = None, qmin: int = -127,
                           accumulator_bound: int | None = None, float_dtype: torch.dtype = torch.float32,
                           out: torch.Tensor | None = None, tactic: str | None = None,
                           pdl: bool = False) -> torch.Tensor:
    """A dense INT8 QConv of few channels: x int8 codes channels-last in whole words, wq int8
    [Cout, Cin, KH, KW] (stored channels-last it is read in place), bias int32, the per-channel
    `dequant_scale`; the output is int8 codes with `output_inv_scale`, else `float_dtype`,
    channels-last or into `out`, by one of DIRECT_WORDS_FORMS (`tactic`, the first by default).
    The arithmetic is conv_igemm's, so it equals the emulation. `pdl`: launched with programmatic dependent
    launch (CUDA tensors only)."""
    form = DIRECT_WORDS_FORMS.get(tactic or TRITON_DIRECT_INT8_WORDS)
    if form is None:
        raise ValueError(f"direct_int8_words_conv: tactic {tactic!r} is not one of {', '.join(DIRECT_WORDS_FORMS)}")
    if not direct_words_applies(x, wq):
        raise ValueError(f"direct_int8_words_conv: input {tuple(x.shape)} {x.dtype} strides {x.stride()} and weight "
                         f"{tuple(wq.shape)} {wq.dtype} are not a dense INT8 convolution of at most "
                         f"{MAX_IN_CHANNELS} channels in whole words into at most {MAX_OUT_CHANNELS}")
    n = x.shape[0]
    cout, _, kh, kw = wq.shape
    oh, ow = geometry.out_hw
    shape = (n, cout, oh, ow)
    y = channels_last_output(shape, torch.int8 if output_inv_scale is not None else float_dtype, x.device, out,
                             "direct_int8_words_conv")
    if residual is not None and tuple(residual.shape) != shape:
        raise ValueError(f"direct_int8_words_conv: residual {tuple(residual.shape)} is not the output's shape {shape}")
    scalars, flags = epilogue_arguments(quantized=True, fp8=False, bias=bias, residual=residual, activation=activation,
                                        alpha=alpha, beta=beta, residual_after_activation=residual_after_activation,
                                        residual_scale=residual_scale, output_inv_scale=output_inv_scale, qmin=qmin,
                                        accumulator_bound=accumulator_bound)
    x_words, w_words = code_words(x), weight_words(wq)
    sxn, sxh, sxw = x_words.stride()[:3]
    swo, swh, sww = w_words.stride()[:3]
    rs = residual.stride() if residual is not None else (0, 0, 0, 0)
    pixels = n * oh * ow
    block_p, block_co = block_sizes(pixels, cout, min_programs(y.device), form.block_elements)
    kept = ("HAS_BIAS", "HAS_RES", "RES_QUANT", "RES_AFTER", "ACT", "OUT_QUANT")
    grid = (triton.cdiv(pixels, block_p), triton.cdiv(cout, block_co))
    # No fused multiply-adds: the epilogue must round as the emulation does (see conv_igemm).
    _direct_int8_words_kernel[grid](
        x_words, w_words, bias if bias is not None else w_words, dequant_scale,
        residual if residual is not None else y, y, pixels, cout, x_words.shape[1], x_words.shape[2], oh, ow,
        pixel_stride(y), sxn, sxh, sxw, swo, swh, sww, *rs, geometry.pads[0], geometry.pads[1], *scalars,
        WORDS=x_words.shape[3], KH=kh, KW=kw, SH=geometry.strides[0], SW=geometry.strides[1],
        DH=geometry.dilations[0], DW=geometry.dilations[1], **{k: flags[k] for k in kept}, BLOCK_P=block_p,
        BLOCK_CO=block_co, DP4A=y.device.type == "cuda", WORD_ALIGN=told_alignment(sxn, sxh, sxw),
        CH_ALIGN=told_alignment(cout, pixel_stride(y), rs[0], rs[2], rs[3]), TAP_ALIGN=told_alignment(swo, swh, sww),
        TILES=form.tiles, WORDS_P2=triton.next_power_of_2(x_words.shape[3]), PDL=pdl, num_warps=4,
        enable_fp_fusion=False, **launch_options(pdl))
    return y


@dataclass(frozen=True)
class DirectWordsForm:
    """How a tactic of the kernel loads and blocks: `tiles`, each tap's words as two tiles (vector
    loads) or one word at a time; `block_elements`, the accumulators a program holds."""
    tiles: bool
    block_elements: int


TRITON_DIRECT_INT8_WORDS = "triton_direct_int8_words"
# Each tap's words as tiles: a pixel's words and an output channel's are 16 contiguous bytes at 16
# channels, so a thread issues a vector load for each where it issued four word loads; "wide" holds
# twice the accumulators, each weight word then serving twice the pixels.
TRITON_DIRECT_INT8_WORD_TILES = "triton_direct_int8_word_tiles"
TRITON_DIRECT_INT8_WORD_TILES_WIDE = "triton_direct_int8_word_tiles_wide"
DIRECT_WORDS_FORMS = {TRITON_DIRECT_INT8_WORDS: DirectWordsForm(False, _BLOCK_ELEMENTS),
                      TRITON_DIRECT_INT8_WORD_TILES: DirectWordsForm(True, _BLOCK_ELEMENTS),
                      TRITON_DIRECT_INT8_WORD_TILES_WIDE: DirectWordsForm(True, 2 * _BLOCK_ELEMENTS)}
for _name, _form in DIRECT_WORDS_FORMS.items():
    _loads = "each tap's words as vector tiles" if _form.tiles else "a word a load"
    fixed_tactic(_name,
                 f"triton channels-last dense conv of int8 codes as words of four channels on the CUDA cores (a dp4a "
                 f"a word, tap and output channel, int32 accumulate, padding by masks; at most {MAX_IN_CHANNELS} "
                 f"channels in and {MAX_OUT_CHANNELS} out; {_loads}, {_form.block_elements} accumulators a program) "
                 f"+ fused INT8 epilogue", weight_layout=CHANNELS_LAST, programmatic_launch=True)


settle_cache_keys(globals())  # last, once every Triton function above exists (common/cache_keys.py)
