"""The columns of an INT8 (FP8) convolution of few input channels, in one pass.

A convolution reading 3 channels (a network's stem) walks K = kh·kw·C in steps far narrower than
the tensor cores' 32 bytes, so it runs as an explicit im2col followed by the GEMM kernel
(`sartor/ops/quantized.py`, tactic "im2col_…"). Built from PyTorch ops, the columns took four passes
over memory (quantize, pad, gather the windows, pad K); with this kernel most of the stem's time is
its GEMM (docs/decisions/kernel-stem-im2col-and-pixel-windows.md).

This kernel reads the input once per tap (any strides: NCHW or NHWC; float, quantized as loaded,
or codes the producer already stored) and writes each row of the columns [N·OH·OW, K padded]
once: K ordered (kh, kw, c) as the packed weight, zero for the padding taps and the padded K, which
is code 0 in INT8 and in e4m3 alike.
"""
from __future__ import annotations

import torch

from ..common.cache_keys import settle_cache_keys
from ..pointwise.epilogue import triton

if triton is not None:
    import triton.language as tl

    from ..common.tile_steps import stored_codes, pixel_coords

    @triton.jit
    def _im2col_kernel(x_ptr, col_ptr, M, C, H, W, OH, OW, K, KP,
                       sxn, sxc, sxh, sxw, pad_h, pad_w, dil_h, dil_w, in_inv_scale, qmin,
                       KW: tl.constexpr, STRIDE_H: tl.constexpr, STRIDE_W: tl.constexpr,
                       QUANTIZE: tl.constexpr, FP8: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
        # Every division and 64-bit product is on a row or a column vector; the tile itself
        # takes adds and compares (the stem's tile is 8192 elements per program).
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
        n, oh, ow = pixel_coords(rows, OH, OW)
        ih0 = oh * STRIDE_H - pad_h
        iw0 = ow * STRIDE_W - pad_w
        tap = cols // C
        c = cols - tap * C
        kh = tap // KW
        dh = kh * dil_h
        dw = (tap - kh * KW) * dil_w
        row_offsets = n.to(tl.int64) * sxn + ih0.to(tl.int64) * sxh + iw0.to(tl.int64) * sxw
        col_offsets = c.to(tl.int64) * sxc + dh.to(tl.int64) * sxh + dw.to(tl.int64) * sxw
        ih = ih0[:, None] + dh[None, :]
        iw = iw0[:, None] + dw[None, :]
        inside = ((rows < M)[:, None] & (cols < K)[None, :] & (ih >= 0) & (ih < H) & (iw >= 0) & (iw < W))
        v = stored_codes(tl.load(x_ptr + (row_offsets[:, None] + col_offsets[None, :]), mask=inside, other=0),
                         in_inv_scale, qmin, QUANTIZE, FP8)
        stored = (rows < M)[:, None] & (cols < KP)[None, :]
        tl.store(col_ptr + ((rows.to(tl.int64) * KP)[:, None] + cols[None, :]), v, mask=stored)


CODE_DTYPES = {torch.int8: False, torch.float8_e4m3fn: True}  # code dtype → FP8
MAX_ROW_BLOCK_K = 256  # columns up to this many are one program's row (the stem: 160)


def code_source(x: torch.Tensor, code: torch.dtype, kernel: str) -> tuple[torch.Tensor, bool]:
    """What a kernel writing `code` reads from `x`, and whether it quantizes: a float `x` as it is,
    an `x` already in `code` as bytes (one copy kernel serves both code formats). Other code
    dtypes and integer inputs are refused in one line."""
    if code not in CODE_DTYPES:
        raise ValueError(f"{kernel} writes int8 or float8_e4m3fn codes, not {code}")
    if x.dtype == code:
        return x.view(torch.uint8), False
    if not x.is_floating_point():
        raise ValueError(f"{kernel} quantizes float inputs, not {x.dtype}")
    return x, True


def im2col_codes(x: torch.Tensor, kernel: tuple[int, int], strides: tuple[int, int], pads: tuple[int, int],
                 dilations: tuple[int, int], out_hw: tuple[int, int], k_padded: int, code: torch.dtype,
                 inv_scale: float = 1.0, qmin: float = -127.0) -> torch.Tensor:
    """The INT8 (`code` torch.int8) or e4m3 columns [N·OH·OW, k_padded] of a 2-D convolution of `x`
    [N, C, H, W] (any strides): K ordered (kh, kw, c), zero past kh·kw·C and at padding taps.
    A float `x` is quantized as loaded (`inv_scale`, `qmin`: the layer's input quantization);
    an `x` already in `code` is copied."""
    if triton is None:
        raise RuntimeError("im2col_codes needs Triton")
    x, quantize = code_source(x, code, "im2col_codes")
    n, c, h, w = x.shape
    (kh, kw), (oh, ow) = kernel, out_hw
    k = kh * kw * c
    if k_padded < k:
        raise ValueError(f"k_padded {k_padded} is under the layer's K {k}")
    rows = n * oh * ow
    columns = torch.empty((rows, k_padded), dtype=torch.uint8 if not quantize else code, device=x.device)
    block_k = triton.next_power_of_2(k_padded) if k_padded <= MAX_ROW_BLOCK_K else 64
    block_m = max(16, 8192 // block_k)
    grid = (triton.cdiv(rows, block_m), triton.cdiv(k_padded, block_k))
    _im2col_kernel[grid](
        x, columns, rows, c, h, w, oh, ow, k, k_padded,
        *x.stride(), pads[0], pads[1], dilations[0], dilations[1], float(inv_scale), float(qmin),
        KW=kw, STRIDE_H=strides[0], STRIDE_W=strides[1], QUANTIZE=quantize, FP8=CODE_DTYPES[code],
        BLOCK_M=block_m, BLOCK_K=block_k, num_warps=4,
        enable_fp_fusion=False)  # quantize as the emulation does, one rounding per operation
    return columns if quantize else columns.view(code)


settle_cache_keys(globals())  # last, once every Triton function above exists (common/cache_keys.py)
