"""One-pass epilogue for convolution and GEMM outputs: y = act(y + bias[c] (+ residual)), in place or
into a channel slice of a wider buffer.

PyTorch adds a broadcast bias with a non-vectorised kernel and then runs the residual add and the
activation as further passes over memory; this kernel reads y (and the residual) once and writes
once. It walks tiles of pixels × channels, so it serves channels-last 4-D tensors and row-major
2-D ones.
"""
from __future__ import annotations

import math

import torch

from ..common.cache_keys import settle_cache_keys

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU runtime does not need Triton
    triton = None

ACTIVATION_CODES = {None: 0, "Relu": 1, "Sigmoid": 2, "SiLU": 3, "Clip": 4, "HardSwish": 5, "HardSigmoid": 6,
                    "LeakyRelu": 7, "Gelu": 8, "Tanh": 9}

if triton is not None:
    from triton.runtime.interpreter import InterpretedFunction

    @triton.jit
    def _flushed_sigmoid(y):
        """1 / (1 + e^-y) by the hardware's 2^x and reciprocal with subnormals flushed
        (ex2.approx.ftz, rcp.approx.ftz): four instructions. tl.exp and "/" compile to the same
        approximations with range checks for subnormal and huge operands added, about ten more
        instructions a value, and the epilogues of small-channel layers are bound by instruction
        issue (docs/decisions/kernel-flushed-sigmoid.md). Compiled kernels only: the interpreter
        cannot run inline PTX."""
        return tl.inline_asm_elementwise(
            """{
            .reg .f32 e;
            mul.ftz.f32 e, $1, 0fBFB8AA3B;
            ex2.approx.ftz.f32 e, e;
            add.ftz.f32 e, e, 0f3F800000;
            rcp.approx.ftz.f32 $0, e;
            }""",
            "=f,f", [y.to(tl.float32)], dtype=tl.float32, is_pure=True, pack=1)

    # Interpreted kernels keep tl.exp and the division: decided once, as @triton.jit made the function.
    _FLUSHED = tl.constexpr(not isinstance(_flushed_sigmoid, InterpretedFunction))

    @triton.jit
    def told_multiple(value, ALIGN: tl.constexpr):
        """`value`, a channel count or stride the wrapper knows to be a multiple of ALIGN
        (`told_alignment`), rewritten as (value // ALIGN) · ALIGN: the same number, from which
        Triton's alignment analysis learns a factor it cannot see in an argument (it proves
        multiples of 16 only), so that loads and stores along it go as vectors
        (docs/decisions/kernel-told-alignment.md). ALIGN 1: the value as it is."""
        if ALIGN > 1:
            value = (value // ALIGN) * ALIGN
        return value

    @triton.jit
    def told_pixel_strides(C, y_row, sxn, sxh, sxw, ALIGN: tl.constexpr):
        """`told_multiple` of a channels-last kernel's channel count, output pixel stride and input
        image, row and pixel strides, which one `told_alignment` of them all divides."""
        return (told_multiple(C, ALIGN), told_multiple(y_row, ALIGN), told_multiple(sxn, ALIGN),
                told_multiple(sxh, ALIGN), told_multiple(sxw, ALIGN))

    @triton.jit
    def activate(y, ACT: tl.constexpr, alpha, beta):
        if ACT == 1:
            y = tl.maximum(y, 0.0)
        elif ACT == 2:
            if _FLUSHED:
                y = _flushed_sigmoid(y)
            else:
                y = 1.0 / (1.0 + tl.exp(-y))
        elif ACT == 3:
            if _FLUSHED:
                y = y * _flushed_sigmoid(y)
            else:
                y = y / (1.0 + tl.exp(-y))
        elif ACT == 4:
            y = tl.minimum(tl.maximum(y, alpha), beta)
        elif ACT == 5:
            y = y * tl.minimum(tl.maximum(y + 3.0, 0.0), 6.0) / 6.0
        elif ACT == 6:
            y = tl.minimum(tl.maximum(y * alpha + beta, 0.0), 1.0)
        elif ACT == 7:
            y = tl.where(y >= 0.0, y, y * alpha)
        elif ACT == 8:
            y = 0.5 * y * (1.0 + tl.erf(y * 0.7071067811865476))
        elif ACT == 9:
            if _FLUSHED:
                y = 2.0 * _flushed_sigmoid(2.0 * y) - 1.0
            else:
                y = 2.0 / (1.0 + tl.exp(-2.0 * y)) - 1.0
        return y

    @triton.jit
    def _epilogue_kernel(y_ptr, bias_ptr, res_ptr, out_ptr, pixels, channels, res_row, out_row, alpha, beta,
                         HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, RES_AFTER: tl.constexpr,
                         ACT: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr,
                         CH_ALIGN: tl.constexpr = 1):
        # A tile of BLOCK_P pixels × BLOCK_C channels: a pixel's channels are contiguous; pixels of
        # the residual and the output may lie further apart (channel slices of a wider buffer, as a
        # Concat's inputs are when written in place). Tiled so, no element divides its flat index by
        # the channel count (two runtime divisions a value).
        channels = told_multiple(channels, CH_ALIGN)
        res_row = told_multiple(res_row, CH_ALIGN)
        out_row = told_multiple(out_row, CH_ALIGN)
        offs_p = (tl.program_id(0) * BLOCK_P + tl.arange(0, BLOCK_P)).to(tl.int64)
        offs_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        c_ok = offs_c < channels
        mask = (offs_p < pixels)[:, None] & c_ok[None, :]
        y = tl.load(y_ptr + offs_p[:, None] * channels + offs_c[None, :], mask=mask).to(tl.float32)
        if HAS_BIAS:
            y += tl.load(bias_ptr + offs_c, mask=c_ok).to(tl.float32)[None, :]
        if HAS_RES:
            residual = tl.load(res_ptr + offs_p[:, None] * res_row + offs_c[None, :], mask=mask).to(tl.float32)
            if not RES_AFTER:
                y += residual
        y = activate(y, ACT, alpha, beta)
        if HAS_RES:
            if RES_AFTER:
                y += residual
        tl.store(out_ptr + offs_p[:, None] * out_row + offs_c[None, :], y.to(out_ptr.dtype.element_ty), mask=mask)


# The elementwise epilogue's tile: 1,024 values (8 a thread at 4 warps), as many channels of a
# pixel as fit up to 128 (a pixel's 128 FP16 values are two 128-byte lines).
EPILOGUE_BLOCK_ELEMENTS = 1024
EPILOGUE_MAX_BLOCK_C = 128


def told_alignment(*sizes: int) -> int:
    """The largest power of two below 16 dividing every one of `sizes` (element counts and strides:
    a layer's channels and its pixel stride), which a kernel is told (OUT_ALIGN, IN_ALIGN,
    CH_ALIGN); 1 where they are all multiples of 16 (Triton sees those itself) or one is odd
    (docs/decisions/kernel-told-alignment.md)."""
    common = math.gcd(*sizes, 16)
    common &= -common
    return common if common < 16 else 1


def pixel_stride(t: torch.Tensor) -> int | None:
    """Elements from one pixel (row) to the next when channels are the fastest dimension and the
    pixels are evenly spaced — a channels-last tensor, or a channel slice of one — else None."""
    if t.dim() == 2:
        return t.stride(0) if t.stride(1) == 1 or t.shape[1] == 1 else None
    if t.dim() != 4 or (t.stride(1) != 1 and t.shape[1] != 1):
        return None
    pixels_below = 1  # pixels one step of the dimension spans
    row = None
    for dim in (3, 2, 0):
        size = t.shape[dim]
        if size > 1:
            if row is None:
                row = t.stride(dim)
            if t.stride(dim) != row * pixels_below:
                return None
        pixels_below *= size
    row = t.shape[1] if row is None else row
    return row if row >= t.shape[1] else None


def channels_last_output(shape: tuple, dtype: torch.dtype, device: torch.device, out: torch.Tensor | None,
                         kernel: str) -> torch.Tensor:
    """Where a kernel stores its [N, C, H, W] (or [N, C]) output: `out` when given, checked to hold
    it (a channels-last tensor or a channel slice of a Concat's buffer), else a new channels-last
    tensor."""
    shape = tuple(shape)
    if out is not None:
        if tuple(out.shape) != shape or out.dtype != dtype or pixel_stride(out) is None:
            raise ValueError(f"{kernel}: out {tuple(out.shape)} {out.dtype} strides {out.stride()} cannot hold the "
                             f"output {shape} {dtype}")
        return out
    if len(shape) == 4:
        return torch.empty(shape, dtype=dtype, device=device, memory_format=torch.channels_last)
    return torch.empty(shape, dtype=dtype, device=device)


WORD_CODES = 4


def code_words(t: torch.Tensor) -> torch.Tensor | None:
    """An INT8 channels-last tensor as [N, H, W, C/4] int32 words of four channels each, where its
    channel count, strides and offset allow it; None otherwise (the max pool's and the INT8
    depthwise kernel's word-wise loads)."""
    if t.dtype != torch.int8 or t.shape[1] % WORD_CODES or t.stride(1) != 1:
        return None
    if any(stride % WORD_CODES for stride in (t.stride(0), t.stride(2), t.stride(3))):
        return None
    if t.storage_offset() % WORD_CODES or t.data_ptr() % WORD_CODES:
        return None
    return t.permute(0, 2, 3, 1).view(torch.int32)


def _channel_fastest(t: torch.Tensor) -> bool:
    if t.dim() == 4:
        return t.is_contiguous(memory_format=torch.channels_last)
    return t.is_contiguous()


def epilogue_supported(y: torch.Tensor, residual: torch.Tensor | None) -> bool:
    if triton is None or not y.is_cuda or y.dim() not in (2, 4) or not _channel_fastest(y):
        return False
    return residual is None or (residual.shape == y.shape and residual.dtype == y.dtype
                                and pixel_stride(residual) is not None)


def fused_epilogue(y: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor | None,
                   activation: str | None, alpha: float | None, beta: float | None,
                   residual_after_activation: bool = False, out: torch.Tensor | None = None) -> torch.Tensor:
    """Apply the epilogue to `y` (channels-last 4-D or contiguous 2-D), in place, or into `out`:
    y's shape and dtype, channels fastest, pixels evenly spaced (see pixel_stride)."""
    channels = y.shape[1] if y.dim() == 4 else y.shape[-1]
    out = y if out is None else out
    if out.shape != y.shape or out.dtype != y.dtype or pixel_stride(out) is None:
        raise ValueError(f"fused_epilogue: out {tuple(out.shape)} {out.dtype} strides {out.stride()} "
                         f"cannot hold y {tuple(y.shape)} {y.dtype}")
    res_row = pixel_stride(residual) if residual is not None else channels
    out_row = pixel_stride(out)
    pixels = y.numel() // channels if channels else 0
    block_c = min(EPILOGUE_MAX_BLOCK_C, triton.next_power_of_2(max(channels, 1)))
    block_p = EPILOGUE_BLOCK_ELEMENTS // block_c
    grid = (triton.cdiv(pixels, block_p), triton.cdiv(channels, block_c))
    _epilogue_kernel[grid](
        y, bias if bias is not None else y, residual if residual is not None else y, out, pixels, channels,
        res_row, out_row, float(alpha) if alpha is not None else 0.0, float(beta) if beta is not None else 0.0,
        HAS_BIAS=bias is not None, HAS_RES=residual is not None, RES_AFTER=bool(residual_after_activation),
        ACT=ACTIVATION_CODES[activation], BLOCK_P=block_p, BLOCK_C=block_c,
        CH_ALIGN=told_alignment(channels, res_row, out_row), num_warps=4)
    return out


settle_cache_keys(globals())  # last, once every Triton function above exists (common/cache_keys.py)
