"""One-pass epilogue for convolution and GEMM outputs: y = act(y + bias[c] (+ residual)), in place.

PyTorch adds a broadcast bias with a non-vectorised kernel and then runs the residual add and the
activation as further passes over memory; this kernel reads y (and the residual) once and writes
once. Channel = flat index % C, so it serves channels-last 4-D tensors and row-major 2-D ones.
"""
from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU runtime does not need Triton
    triton = None

ACTIVATION_CODES = {None: 0, "Relu": 1, "Sigmoid": 2, "SiLU": 3, "Clip": 4, "HardSwish": 5, "HardSigmoid": 6,
                    "LeakyRelu": 7, "Gelu": 8, "Tanh": 9}

if triton is not None:
    @triton.jit
    def _activate(y, ACT: tl.constexpr, alpha, beta):
        if ACT == 1:
            y = tl.maximum(y, 0.0)
        elif ACT == 2:
            y = 1.0 / (1.0 + tl.exp(-y))
        elif ACT == 3:
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
            y = 2.0 / (1.0 + tl.exp(-2.0 * y)) - 1.0
        return y

    @triton.jit
    def _epilogue_kernel(y_ptr, bias_ptr, res_ptr, n, channels, alpha, beta,
                         HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, RES_AFTER: tl.constexpr,
                         ACT: tl.constexpr, BLOCK: tl.constexpr):
        offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offsets < n
        y = tl.load(y_ptr + offsets, mask=mask).to(tl.float32)
        if HAS_BIAS:
            y += tl.load(bias_ptr + offsets % channels, mask=mask).to(tl.float32)
        if HAS_RES:
            if not RES_AFTER:
                y += tl.load(res_ptr + offsets, mask=mask).to(tl.float32)
        y = _activate(y, ACT, alpha, beta)
        if HAS_RES:
            if RES_AFTER:
                y += tl.load(res_ptr + offsets, mask=mask).to(tl.float32)
        tl.store(y_ptr + offsets, y.to(y_ptr.dtype.element_ty), mask=mask)


def _channel_fastest(t: torch.Tensor) -> bool:
    if t.dim() == 4:
        return t.is_contiguous(memory_format=torch.channels_last)
    return t.is_contiguous()


def epilogue_supported(y: torch.Tensor, residual: torch.Tensor | None) -> bool:
    if triton is None or not y.is_cuda or y.dim() not in (2, 4) or not _channel_fastest(y):
        return False
    return residual is None or (residual.shape == y.shape and residual.dtype == y.dtype and _channel_fastest(residual))


def fused_epilogue(y: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor | None,
                   activation: str | None, alpha: float | None, beta: float | None,
                   residual_after_activation: bool = False) -> torch.Tensor:
    """Apply the epilogue to `y` in place (y must be channels-last 4-D or contiguous 2-D)."""
    channels = y.shape[1] if y.dim() == 4 else y.shape[-1]
    n = y.numel()
    block = 1024
    grid = (triton.cdiv(n, block),)
    _epilogue_kernel[grid](
        y, bias if bias is not None else y, residual if residual is not None else y, n, channels,
        float(alpha) if alpha is not None else 0.0, float(beta) if beta is not None else 0.0,
        HAS_BIAS=bias is not None, HAS_RES=residual is not None, RES_AFTER=bool(residual_after_activation),
        ACT=ACTIVATION_CODES[activation], BLOCK=block, num_warps=4)
    return y
