"""The FP8 format of sartor's FP8 layers: OCP E4M3 ("e4m3fn": no infinities, one NaN code per
sign, largest finite value 448), `torch.float8_e4m3fn` in tensors, `ml_dtypes.float8_e4m3fn` in
the graph's numpy initializers, Triton's `tl.float8e4nv` in kernels.

Quantization is q = e4m3(clamp(x · inv_scale, -448, 448)), rounding to the nearest value, ties to
even. The clamp comes first: casts of out-of-range values saturate in some PyTorch releases and
turn into NaN in others.

Exactness of the float64 emulation (`sartor/ops/quantized.py`):
- every finite e4m3 value is an integer multiple of 2^-9 (the smallest subnormal) of magnitude at
  most 448;
- so a product of two is a multiple of 2^-18 of magnitude at most 448² = 200704, and a sum of K
  products a multiple of 2^-18 of magnitude at most K · 200704;
- float64 holds every multiple of 2^-18 up to 2^53 · 2^-18 = 2^35 exactly, so any partial sum, in
  any order, is exact for K ≤ FP8_EXACT_K = 171196 products per output (K = kh·kw·C/group;
  ResNet-50's largest is 4608).
"""
from __future__ import annotations

import numpy as np
import torch

QFORMAT = "fp8e4m3"  # the `qformat` attribute of an FP8 QConv/QGemm (absent: INT8)
DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
FP8_EXACT_K = 2 ** 35 // int(FP8_MAX) ** 2  # 171196


def numpy_dtype():
    """ml_dtypes' float8_e4m3fn (imported late: only FP8 builds need it)."""
    from .util import ml_dtypes_module
    return np.dtype(ml_dtypes_module().float8_e4m3fn)


def is_fp8(attrs: dict) -> bool:
    return attrs.get("qformat") == QFORMAT


def quantize_fp8(x: torch.Tensor, inv_scale: float | torch.Tensor) -> torch.Tensor:
    """e4m3(clamp(x · inv_scale, -448, 448)), round to nearest even, as torch.float8_e4m3fn."""
    return (x.float() * inv_scale).clamp_(-FP8_MAX, FP8_MAX).to(DTYPE)


def quantize_fp8_numpy(x: np.ndarray) -> np.ndarray:
    """The same rounding on numpy values already scaled (float64 in, ml_dtypes float8_e4m3fn out).
    The value goes through float32 first, as the torch path rounds: a double rounding that can
    differ from a direct float64 → e4m3 rounding only for values within 2^-24 (relative) of a tie."""
    clipped = np.clip(np.asarray(x, dtype=np.float64), -FP8_MAX, FP8_MAX).astype(np.float32)
    return clipped.astype(numpy_dtype())


def ordered_codes(t: torch.Tensor) -> torch.Tensor:
    """e4m3 bit patterns as integers that keep the values' order (sign-magnitude → two's
    complement): neighbouring representable values differ by one, +0 and -0 are both 0."""
    bits = t.contiguous().view(torch.uint8).to(torch.int32)
    magnitude = bits & 0x7F
    return torch.where(bits >= 0x80, -magnitude, magnitude)


def code_distance(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """How many representable e4m3 steps separate two FP8 tensors, elementwise."""
    return (ordered_codes(a) - ordered_codes(b)).abs()
