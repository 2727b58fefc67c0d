"""A float tensor's INT8 codes written into a buffer of the same shape and memory layout, in one pass
over memory: the copy of an engine's input into the buffer its CUDA graph reads, where every reader of
that input is an INT8 layer quantizing it alike (`runtime/context.py`, docs/decisions/0068).

A plain copy of a float32 image reads and writes four bytes a value, and the stem then reads the four
bytes again to quantize them as it loads them. Here the copy reads the four bytes once and writes the
one-byte code the stem would have made; the stem reads that code as it is.

The codes are the readers' own: round(x · inv_scale) of the float32 product, half to even, saturated
to [qmin, 127] (`tile_steps.quantize_int8`, launched without fused multiply-adds so the product is
rounded before the rounding add, as `ops/quantized.py`'s `quantize` computes it).
"""
from __future__ import annotations

import torch

from ..common.cache_keys import settle_cache_keys
from ..common.interpreter import kernel_runs_on
from .epilogue import triton

BLOCK = 4096  # values a program: 16 a thread over 8 warps, four 16-byte loads of float32 each
WARPS = 8
FLOATS = (torch.float32, torch.float16, torch.bfloat16)

if triton is not None:
    import triton.language as tl

    from ..common.tile_steps import quantize_int8

    @triton.jit
    def _quantize_kernel(x_ptr, y_ptr, count, inv_scale, qmin, C, H, W, sxn, sxc, sxh, sxw,
                         BLOCK: tl.constexpr, GATHER: tl.constexpr):
        """y's values in their storage order; x's at the same place (GATHER off: one layout), or, for an
        NCHW y, at its strides (sxn, sxc, sxh, sxw): a channels-last or any other 4-D source."""
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        ok = offs < count
        if GATHER:
            w = offs % W
            h = offs // W % H
            c = offs // (W * H) % C
            n = offs // (W * H * C)
            v = tl.load(x_ptr + (n * sxn + c * sxc + h * sxh + w * sxw), mask=ok, other=0.0).to(tl.float32)
        else:
            v = tl.load(x_ptr + offs, mask=ok, other=0.0).to(tl.float32)
        tl.store(y_ptr + offs, quantize_int8(v, inv_scale, qmin), mask=ok)


def same_layout(x: torch.Tensor, y: torch.Tensor) -> bool:
    """Whether `x` and `y` hold their values in one order in dense memory: element k of the one's
    storage is element k of the other's (one shape, one set of strides, no gaps or overlaps)."""
    dense = x.is_contiguous() or (x.dim() == 4 and x.is_contiguous(memory_format=torch.channels_last))
    return x.shape == y.shape and x.stride() == y.stride() and dense


def _gathers(x: torch.Tensor, y: torch.Tensor) -> bool:
    """Whether the kernel reads `x` by its strides into a contiguous 4-D `y` of its shape."""
    return x.dim() == 4 and x.shape == y.shape and y.is_contiguous() and not same_layout(x, y)


def quantize_kernel_applies(x: torch.Tensor, y: torch.Tensor) -> bool:
    """Whether the kernel writes `y`'s codes of `x`: both on one device it runs on (`kernel_runs_on`),
    `x` float and `y` int8, in the same dense layout or `y` contiguous NCHW (`x` read by its strides),
    and Triton present."""
    return (triton is not None and kernel_runs_on(x) and y.device == x.device and x.dtype in FLOATS
            and y.dtype == torch.int8 and (same_layout(x, y) or _gathers(x, y)))


def quantize_kernel_into(x: torch.Tensor, y: torch.Tensor, inv_scale: float, qmin: int) -> torch.Tensor:
    """`y` set to the INT8 codes of `x`, clamp(round_half_even(x · inv_scale), qmin, 127), by the kernel
    (where `quantize_kernel_applies`; `ops/quantized.py` `quantize_into` chooses)."""
    count = x.numel()
    gather = _gathers(x, y)
    dims, strides = (x.shape[1:], x.stride()) if gather else ((1, 1, 1), (0, 0, 0, 0))
    if count:
        _quantize_kernel[(triton.cdiv(count, BLOCK),)](x, y, count, inv_scale, qmin, *dims, *strides, BLOCK=BLOCK,
                                                       GATHER=gather, num_warps=WARPS, enable_fp_fusion=False)
    return y


settle_cache_keys(globals())  # last, once every Triton function above exists (common/cache_keys.py)
