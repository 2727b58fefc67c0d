"""An INT8 stem on the CUDA cores: a convolution of few input channels that reads the float image
itself, quantizes each value as it is loaded, packs four taps' codes into an int32 word and adds
their four products to each output channel with one dp4a.

A detector's first layer (3 → 16 channels, 3×3 at stride 2 over a 640×640 float image) has little
for the tensor cores to do, N = 16 and K = 27, and its other tactics move the image twice: the
window tactics pack it into INT8 block pixels and then run a GEMM over them, the implicit-GEMM
tiles gather K from three planes with an index division per element. Here a program owns a block of
output pixels and all of the output channels; the taps are unrolled (channel, row and column known at
compile time), so each tap is one load of the program's pixels from the image as it lies (NCHW or
channels-last, float32, float16 or bfloat16) and one quantization (or none: an image that arrives as
INT8 codes, which the engine's copy of its input wrote, docs/decisions/0068); every four taps' codes make a word
(27 taps: 7 words, the last one's fourth byte 0), and each word meets the output channels' words of
the same four taps (the weight stored as TAP_WORDS, [words, Cout], once at load) in a dp4a:
docs/decisions/kernel-direct-stem.md.

The int32 sums are exact and go through the implicit GEMM's epilogue (`store_epilogue`: bias,
per-channel dequantization, activation, requantization, one store), so the output equals the
emulation's bit for bit. A value is quantized as `tile_steps.quantize_int8` rounds it (half to even,
clamped to [qmin, 127]); padding loads 0, whose code is 0. Under Triton's interpreter, which has no
inline assembly, the four lanes' products are summed by shifts instead (`direct_words`).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..common.cache_keys import settle_cache_keys
from ..common.pdl import launch_options
from ..common.tile_steps import epilogue_arguments
from ..pointwise.epilogue import WORD_CODES, channels_last_output, pixel_stride, told_alignment, triton
from ..registry import ROW_WORDS, TAP_WORDS, fixed_tactic
from .depthwise import min_programs
from .direct_words import block_sizes
from .igemm import ConvGeometry

if triton is not None:
    import triton.language as tl

    from ..common.pdl import await_previous_kernel
    from ..common.tile_steps import quantize_int8, store_epilogue, pixel_channel_tile, tap_pixels, window_origin
    from ..pointwise.epilogue import told_multiple
    from .direct_words import four_products_sum

    @triton.jit
    def _code_byte(v, inv_scale, qmin):
        """The INT8 code of an image value in the low byte of an int32, the other bytes 0: quantize_int8's
        code of a float value; an int8 value is the code already (an image its copy into the engine
        quantized, docs/decisions/0068)."""
        if v.dtype == tl.int8:
            return v.to(tl.int32) & 0xFF
        return quantize_int8(v.to(tl.float32), inv_scale, qmin).to(tl.int32) & 0xFF

    @triton.jit
    def _direct_stem_kernel(x_ptr, w_ptr, bias_ptr, scale_ptr, y_ptr, P, COUT, H, W, OH, OW, y_row,
                            sxn, sxc, sxh, sxw, pad_h, pad_w,
                            in_inv_scale, res_scale, out_inv_scale, qmin, alpha, beta,
                            C: tl.constexpr, KH: tl.constexpr, KW: tl.constexpr, SH: tl.constexpr, SW: tl.constexpr,
                            DH: tl.constexpr, DW: tl.constexpr, HAS_BIAS: tl.constexpr, ACT: tl.constexpr,
                            OUT_QUANT: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_CO: tl.constexpr,
                            INT8: tl.constexpr = True, DP4A: tl.constexpr = False, CH_ALIGN: tl.constexpr = 1,
                            PDL: tl.constexpr = False):
        """x: the float image [N, C, H, W] (or its int8 codes) by its strides; w: the int32 tap words [words, COUT]
        (`tap_words`). INT8: the epilogue's form of the sums (`epilogue_arguments`: decoded from their
        bits where the layer's bound allows). CH_ALIGN: a power of two dividing COUT and the output's
        pixel stride. PDL: launched with programmatic dependent launch (`kernels/common/pdl.py`)."""
        COUT = told_multiple(COUT, CH_ALIGN)  # whole vectors of channels loaded and stored at once
        y_row = told_multiple(y_row, CH_ALIGN)
        offs_p, offs_c, p_ok, c_ok, n, oh, ow = pixel_channel_tile(P, COUT, OH, OW, BLOCK_P, BLOCK_CO)
        base, ih0, iw0 = window_origin(n, oh, ow, sxn, SH, SW, pad_h, pad_w)
        await_previous_kernel(PDL)  # the image is an activation (a preprocessing kernel's output)
        acc = tl.zeros((BLOCK_P, BLOCK_CO), dtype=tl.int32)
        TAPS: tl.constexpr = C * KH * KW
        for j in tl.static_range((TAPS + 3) // 4):
            word = tl.zeros((BLOCK_P,), dtype=tl.int32)
            for lane in tl.static_range(4):
                if 4 * j + lane < TAPS:  # taps in (channel, row, column) order, as the weight's words
                    pixels, ok = tap_pixels(base + ((4 * j + lane) // (KH * KW)) * sxc,
                                            ih0 + ((4 * j + lane) // KW % KH) * DH, iw0 + ((4 * j + lane) % KW) * DW,
                                            p_ok, H, W, sxh, sxw)
                    v = tl.load(x_ptr + pixels, mask=ok, other=0)
                    word = word | (_code_byte(v, in_inv_scale, qmin) << (8 * lane))
            taps = tl.load(w_ptr + j * COUT + offs_c, mask=c_ok, other=0)
            acc = four_products_sum(tl.broadcast_to(word[:, None], (BLOCK_P, BLOCK_CO)),
                                    tl.broadcast_to(taps[None, :], (BLOCK_P, BLOCK_CO)), acc, DP4A)
        store_epilogue(acc, offs_p, offs_c, p_ok, c_ok, n, oh, ow, bias_ptr, scale_ptr, y_ptr, y_ptr,
                        y_row, 0, 0, 0, 0, res_scale, out_inv_scale, qmin, alpha, beta,
                        INT8, False, HAS_BIAS, False, False, False, ACT, OUT_QUANT)


    @triton.jit
    def _direct_stem_quads_kernel(x_ptr, w_ptr, bias_ptr, scale_ptr, y_ptr, Q, COUT, H, W, OH, OW, QH, QW, y_row,
                                  sxn, sxc, sxh, sxw, pad_h, pad_w,
                                  in_inv_scale, res_scale, out_inv_scale, qmin, alpha, beta,
                                  C: tl.constexpr, KH: tl.constexpr, KW: tl.constexpr, SH: tl.constexpr,
                                  SW: tl.constexpr, HAS_BIAS: tl.constexpr, ACT: tl.constexpr,
                                  OUT_QUANT: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_CO: tl.constexpr,
                                  INT8: tl.constexpr = True, DP4A: tl.constexpr = False, CH_ALIGN: tl.constexpr = 1,
                                  PDL: tl.constexpr = False):
        """The stem over quads of output pixels (2 × 2): a program owns BLOCK_Q quads and all of the
        output channels. The four pixels' windows overlap (at stride 2 and 3 × 3, 5 × 5 inputs for 4 × 9
        taps), so each input value of a quad is loaded and quantized once, where the per-pixel kernel
        did so for every tap over it. A filter row's KW (≤ 4) codes make a word; the weight is stored as
        ROW_WORDS ([C·KH, COUT]: the row's KW taps of each output channel, byte i tap i, the rest 0), and
        each input row's words for the quad's left and right pixels meet the rows of the filter they
        lie under (the top pixels' row r, the bottom ones' row r - SH) in a dp4a. Dilation 1 only; a
        thread holds a quad's BLOCK_CO outputs (`quads_apply`)."""
        COUT = told_multiple(COUT, CH_ALIGN)
        y_row = told_multiple(y_row, CH_ALIGN)
        offs_q = tl.program_id(0) * BLOCK_Q + tl.arange(0, BLOCK_Q)
        offs_c = tl.arange(0, BLOCK_CO)
        q_ok = offs_q < Q
        c_ok = offs_c < COUT
        qx = offs_q % QW
        rest = offs_q // QW
        qy = rest % QH
        n = rest // QH
        oh0 = 2 * qy
        ow0 = 2 * qx
        ih0 = oh0 * SH - pad_h
        iw0 = ow0 * SW - pad_w
        # each input row's first value, an address a quad: the row's values follow at constant offsets
        window = x_ptr + (n.to(tl.int64) * sxn + ih0 * sxh + iw0 * sxw)
        await_previous_kernel(PDL)  # the image is an activation (a preprocessing kernel's output)
        top_left = tl.zeros((BLOCK_Q, BLOCK_CO), dtype=tl.int32)
        top_right = tl.zeros((BLOCK_Q, BLOCK_CO), dtype=tl.int32)
        bottom_left = tl.zeros((BLOCK_Q, BLOCK_CO), dtype=tl.int32)
        bottom_right = tl.zeros((BLOCK_Q, BLOCK_CO), dtype=tl.int32)
        for c in tl.static_range(C):
            for r in tl.static_range(SH + KH):
                ih = ih0 + r
                row_ok = q_ok & (ih >= 0) & (ih < H)
                row = window + (c * sxc + r * sxh)
                left = tl.zeros((BLOCK_Q,), dtype=tl.int32)  # the left pixels' codes of this row: columns 0..KW-1
                right = tl.zeros((BLOCK_Q,), dtype=tl.int32)  # the right pixels': columns SW..SW+KW-1
                for col in tl.static_range(SW + KW):
                    iw = iw0 + col
                    v = tl.load(row + col * sxw, mask=row_ok & (iw >= 0) & (iw < W), other=0)
                    code = _code_byte(v, in_inv_scale, qmin)
                    if col < KW:
                        left = left | (code << (8 * col))
                    if col >= SW:
                        if col - SW < KW:
                            right = right | (code << (8 * (col - SW)))
                left = tl.broadcast_to(left[:, None], (BLOCK_Q, BLOCK_CO))
                right = tl.broadcast_to(right[:, None], (BLOCK_Q, BLOCK_CO))
                if r < KH:  # the top pixels' filter row r
                    taps = tl.broadcast_to(tl.load(w_ptr + (c * KH + r) * COUT + offs_c, mask=c_ok, other=0)[None, :],
                                           (BLOCK_Q, BLOCK_CO))
                    top_left = four_products_sum(left, taps, top_left, DP4A)
                    top_right = four_products_sum(right, taps, top_right, DP4A)
                if r >= SH:
                    if r - SH < KH:  # the bottom pixels' filter row r - SH
                        taps = tl.broadcast_to(tl.load(w_ptr + (c * KH + r - SH) * COUT + offs_c, mask=c_ok,
                                                       other=0)[None, :], (BLOCK_Q, BLOCK_CO))
                        bottom_left = four_products_sum(left, taps, bottom_left, DP4A)
                        bottom_right = four_products_sum(right, taps, bottom_right, DP4A)
        for corner in tl.static_range(4):
            oh = oh0 + corner // 2
            ow = ow0 + corner % 2
            if corner == 0:
                acc = top_left
            elif corner == 1:
                acc = top_right
            elif corner == 2:
                acc = bottom_left
            else:
                acc = bottom_right
            store_epilogue(acc, (n * OH + oh) * OW + ow, offs_c, q_ok & (oh < OH) & (ow < OW), c_ok, n, oh, ow,
                           bias_ptr, scale_ptr, y_ptr, y_ptr, y_row, 0, 0, 0, 0, res_scale, out_inv_scale, qmin,
                           alpha, beta, INT8, False, HAS_BIAS, False, False, False, ACT, OUT_QUANT)


# Where the CUDA cores can be worth timing against the tensor cores: an image's few channels into few
# outputs, over few taps (the loop is unrolled: YOLO's 27 taps are 7 words).
MAX_IN_CHANNELS = 4
MAX_OUT_CHANNELS = 32
MAX_TAPS = 64


@dataclass(frozen=True)
class DirectStemForm:
    """A tactic's block: `block_elements` int32 accumulators a program (16 registers a thread at 4
    warps for 2048), all of the output channels, pixels for the rest. `quads`: the pixels in 2 × 2
    quads, each input value of a quad quantized once (`_direct_stem_quads_kernel`), the weight as
    ROW_WORDS; else one pixel at a time, the weight as TAP_WORDS."""
    block_elements: int
    quads: bool = False

    @property
    def weight_layout(self) -> str:
        return ROW_WORDS if self.quads else TAP_WORDS


TRITON_DIRECT_STEM_INT8 = "triton_direct_stem_int8"
# Twice the pixels a program: each word of weights loaded once for twice the products.
TRITON_DIRECT_STEM_INT8_WIDE = "triton_direct_stem_int8_wide"
TRITON_DIRECT_STEM_INT8_QUADS = "triton_direct_stem_int8_quads"
DIRECT_STEM_FORMS = {TRITON_DIRECT_STEM_INT8: DirectStemForm(2048), TRITON_DIRECT_STEM_INT8_WIDE: DirectStemForm(4096),
                     TRITON_DIRECT_STEM_INT8_QUADS: DirectStemForm(8192, quads=True)}
# A filter row's taps make one word in the quads form.
MAX_QUAD_ROW_TAPS = WORD_CODES
# A thread holds a whole quad's outputs up to this many channels (64 accumulators); past it the program's
# threads split a quad's channels and each loads and quantizes its inputs again (docs/decisions/
# kernel-direct-stem.md, "The quads form").
MAX_QUAD_OUT_CHANNELS = 16


def direct_stem_applies(x: torch.Tensor, wq: torch.Tensor) -> bool:
    """Whether the kernel runs this convolution: a float image (or its INT8 codes) of at most
    MAX_IN_CHANNELS channels, an int8 [Cout, Cin, KH, KW] weight (or a stand-in of its shape) of group 1,
    few outputs, few taps."""
    if wq.dtype != torch.int8 or wq.dim() != 4 or x.dim() != 4 or wq.shape[1] != x.shape[1]:
        return False
    cout, cin, kh, kw = wq.shape
    return (x.dtype in (torch.float32, torch.float16, torch.bfloat16, torch.int8) and cin <= MAX_IN_CHANNELS
            and cout <= MAX_OUT_CHANNELS and cin * kh * kw <= MAX_TAPS)


def tap_words(wq: torch.Tensor) -> torch.Tensor:
    """The int8 weight [Cout, C, KH, KW] as int32 words of four taps' codes in (channel, row, column)
    order, the last word padded with zero codes, one row of Cout words for each four taps: [words, Cout]
    (TAP_WORDS), so that a word's output channels load as vectors."""
    cout = wq.shape[0]
    taps = wq.reshape(cout, -1)
    padded = torch.zeros((cout, -(-taps.shape[1] // WORD_CODES) * WORD_CODES), dtype=torch.int8, device=wq.device)
    padded[:, :taps.shape[1]] = taps
    return padded.view(torch.int32).t().contiguous()


def quads_apply(kernel: tuple, dilations: tuple, out_channels: int) -> bool:
    """Whether the quads form runs this layer: a filter row of at most four taps, no dilation, at most
    MAX_QUAD_OUT_CHANNELS outputs."""
    return kernel[1] <= MAX_QUAD_ROW_TAPS and tuple(dilations) == (1, 1) and out_channels <= MAX_QUAD_OUT_CHANNELS


def stem_forms(kernel: tuple, dilations: tuple, out_channels: int) -> list[str]:
    """The forms that run this layer (the layer itself: `direct_stem_applies`)."""
    return [name for name, form in DIRECT_STEM_FORMS.items()
            if not form.quads or quads_apply(kernel, dilations, out_channels)]


def row_words(wq: torch.Tensor) -> torch.Tensor:
    """The int8 weight [Cout, C, KH, KW] (KW ≤ 4) as int32 words of one filter row's codes, byte i tap
    i of the row and the bytes past KW zero, one row of Cout words for each (channel, filter row):
    [C·KH, Cout] (ROW_WORDS), the quads form's weight."""
    cout, c, kh, kw = wq.shape
    if kw > MAX_QUAD_ROW_TAPS:
        raise ValueError(f"row_words: filter rows of {kw} taps do not fit a word of {MAX_QUAD_ROW_TAPS}")
    padded = torch.zeros((cout, c, kh, WORD_CODES), dtype=torch.int8, device=wq.device)
    padded[..., :kw] = wq
    return padded.reshape(cout, c * kh * WORD_CODES).view(torch.int32).t().contiguous()


def direct_stem_conv(x: torch.Tensor, w_words: torch.Tensor, bias: torch.Tensor | None, geometry: ConvGeometry, *,
                     dequant_scale: torch.Tensor, input_inv_scale: float, activation: str | None = None,
                     alpha: float | None = None, beta: float | None = None, output_inv_scale: float | None = None,
                     qmin: int = -127, accumulator_bound: int | None = None, float_dtype: torch.dtype = torch.float32,
                     out: torch.Tensor | None = None, tactic: str | None = None, pdl: bool = False) -> torch.Tensor:
    """An INT8 QConv reading a float image (module docstring): x float [N, C, H, W] any strides,
    quantized with `input_inv_scale` (or its int8 codes, read as they are); w_words the weight's
    `tap_words`; bias int32; the per-channel `dequant_scale`. The output is int8 codes with `output_inv_scale`, else `float_dtype`,
    channels-last or into `out`, by one of DIRECT_STEM_FORMS (`tactic`, the first by default); `pdl`:
    launched with programmatic dependent launch (CUDA tensors only)."""
    form = DIRECT_STEM_FORMS.get(tactic or TRITON_DIRECT_STEM_INT8)
    if form is None:
        raise ValueError(f"direct_stem_conv: tactic {tactic!r} is not one of {', '.join(DIRECT_STEM_FORMS)}")
    n, c, h, w_in = x.shape if x.dim() == 4 else (0, 0, 0, 0)
    kh, kw = geometry.kernel
    words = c * kh if form.quads else -(-c * kh * kw // WORD_CODES)
    cout = w_words.shape[-1]
    weight = torch.empty((cout, c, kh, kw), dtype=torch.int8, device="meta")
    if not (direct_stem_applies(x, weight) and w_words.dtype == torch.int32 and tuple(w_words.shape) == (words, cout)
            and w_words.is_contiguous()):
        raise ValueError(f"direct_stem_conv: input {tuple(x.shape)} {x.dtype} and weight words "
                         f"{tuple(w_words.shape)} {w_words.dtype} are not an image (float or codes) of at most "
                         f"{MAX_IN_CHANNELS} channels and the {'row' if form.quads else 'tap'} words of at most {MAX_OUT_CHANNELS} "
                         f"outputs over at most {MAX_TAPS} taps")
    if form.quads and not quads_apply(geometry.kernel, geometry.dilations, cout):
        raise ValueError(f"direct_stem_conv: the quads form runs filter rows of at most {MAX_QUAD_ROW_TAPS} taps "
                         f"without dilation into at most {MAX_QUAD_OUT_CHANNELS} outputs, not {geometry.kernel} "
                         f"dilated {geometry.dilations} into {cout}")
    oh, ow = geometry.out_hw
    y = channels_last_output((n, cout, oh, ow), torch.int8 if output_inv_scale is not None else float_dtype,
                             x.device, out, "direct_stem_conv")
    scalars, flags = epilogue_arguments(quantized=True, fp8=False, bias=bias, residual=None, activation=activation,
                                        alpha=alpha, beta=beta, residual_after_activation=False, residual_scale=None,
                                        output_inv_scale=output_inv_scale, qmin=qmin,
                                        accumulator_bound=accumulator_bound)
    if form.quads:
        _launch_quads(x, w_words, bias, dequant_scale, y, geometry, float(input_inv_scale), scalars, flags,
                      form.block_elements, pdl)
        return y
    pixels = n * oh * ow
    block_p, block_co = block_sizes(pixels, cout, min_programs(y.device), form.block_elements)
    grid = (triton.cdiv(pixels, block_p), triton.cdiv(cout, block_co))
    # No fused multiply-adds: the epilogue must round as the emulation does (see conv_igemm).
    _direct_stem_kernel[grid](
        x, w_words, bias if bias is not None else w_words, dequant_scale, y, pixels, cout, h, w_in, oh, ow,
        pixel_stride(y), *x.stride(), geometry.pads[0], geometry.pads[1], float(input_inv_scale), *scalars,
        C=c, KH=kh, KW=kw, SH=geometry.strides[0], SW=geometry.strides[1], DH=geometry.dilations[0],
        DW=geometry.dilations[1], HAS_BIAS=flags["HAS_BIAS"], ACT=flags["ACT"], OUT_QUANT=flags["OUT_QUANT"],
        BLOCK_P=block_p, BLOCK_CO=block_co, INT8=flags["INT8"], DP4A=y.device.type == "cuda",
        CH_ALIGN=told_alignment(cout, pixel_stride(y)), PDL=pdl, num_warps=4, enable_fp_fusion=False,
        **launch_options(pdl))
    return y


def _launch_quads(x: torch.Tensor, w_rows: torch.Tensor, bias, scale, y: torch.Tensor, geometry: ConvGeometry,
                  input_inv_scale: float, scalars: tuple, flags: dict, block_elements: int, pdl: bool) -> None:
    n, c, h, w_in = x.shape
    cout = w_rows.shape[-1]
    oh, ow = geometry.out_hw
    qh, qw = -(-oh // 2), -(-ow // 2)
    quads = n * qh * qw
    block_q, block_co = block_sizes(quads, cout, min_programs(y.device), block_elements // 4)
    # No fused multiply-adds: the epilogue must round as the emulation does (see conv_igemm).
    _direct_stem_quads_kernel[(triton.cdiv(quads, block_q),)](
        x, w_rows, bias if bias is not None else w_rows, scale, y, quads, cout, h, w_in, oh, ow, qh, qw,
        pixel_stride(y), *x.stride(), geometry.pads[0], geometry.pads[1], input_inv_scale, *scalars,
        C=c, KH=geometry.kernel[0], KW=geometry.kernel[1], SH=geometry.strides[0], SW=geometry.strides[1],
        HAS_BIAS=flags["HAS_BIAS"], ACT=flags["ACT"], OUT_QUANT=flags["OUT_QUANT"], BLOCK_Q=block_q,
        BLOCK_CO=block_co, INT8=flags["INT8"], DP4A=y.device.type == "cuda",
        CH_ALIGN=told_alignment(cout, pixel_stride(y)), PDL=pdl, num_warps=4, enable_fp_fusion=False,
        **launch_options(pdl))


for _name, _form in DIRECT_STEM_FORMS.items():
    _words = ("each filter row's codes a word (2 × 2 output pixels a thread, each input value quantized once)"
              if _form.quads else "four taps' codes a word")
    fixed_tactic(_name,
                 f"triton INT8 stem on the CUDA cores: the float image read as it lies and quantized as loaded, taps "
                 f"unrolled, {_words} and a dp4a a word and output channel, int32 accumulate (at most "
                 f"{MAX_IN_CHANNELS} channels in, {MAX_OUT_CHANNELS} out, {MAX_TAPS} taps; {_form.block_elements} "
                 f"accumulators a program) + fused INT8 epilogue", weight_layout=_form.weight_layout,
                 programmatic_launch=True)


settle_cache_keys(globals())  # last, once every Triton function above exists (common/cache_keys.py)
