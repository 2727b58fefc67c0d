"""The taps of Pillow's antialiased bilinear resize along one axis, as Pillow computes them, kept on
the device once per (input size, output size).

Pillow (`Resample.c: precompute_coeffs`) stretches the triangle filter by the shrink factor, gives
each output pixel the input pixels its support covers (first index and count), normalises their
weights to sum to one in float64, and for 8-bit images turns them into 22-bit fixed point. Each
pass then rounds to uint8: `clip8((2^21 + Σ pixel · weight) >> 22)`. Computing the same integers
here lets the GPU kernel reproduce Pillow's classic order (horizontal pass, then vertical) exactly;
the Pillow installed here (13) runs the vertical pass first for some shapes, and those pixels then
differ from it by at most one level (docs/decisions/0024-preprocessing-kernel.md).
"""
from __future__ import annotations

import functools
import math

import torch

PRECISION_BITS = 22  # Pillow's 32 - 8 - 2 for 8-bit images
BILINEAR_SUPPORT = 1.0


def _triangle(x: float) -> float:
    x = -x if x < 0.0 else x
    return 1.0 - x if x < 1.0 else 0.0


def pillow_taps(in_size: int, out_size: int) -> tuple[list[int], list[list[int]]]:
    """(first input index per output pixel, fixed-point weights per output pixel, `ksize` each,
    zero past the pixel's own count), in Pillow's float64 arithmetic and order."""
    if in_size <= 0 or out_size <= 0:
        raise ValueError(f"pillow_taps: sizes {in_size} -> {out_size} must be positive")
    scale = in_size / out_size
    filterscale = max(scale, 1.0)
    support = BILINEAR_SUPPORT * filterscale
    ksize = math.ceil(support) * 2 + 1
    starts, weights = [], []
    for xx in range(out_size):
        center = (xx + 0.5) * scale
        ss = 1.0 / filterscale
        xmin = max(int(center - support + 0.5), 0)  # int() truncates toward zero, as C's cast
        count = min(int(center + support + 0.5), in_size) - xmin
        ks = [_triangle((x + xmin - center + 0.5) * ss) for x in range(count)]
        total = 0.0
        for w in ks:
            total += w
        if total != 0.0:
            ks = [w / total for w in ks]
        fixed = [int(-0.5 + w * (1 << PRECISION_BITS)) if w < 0 else int(0.5 + w * (1 << PRECISION_BITS))
                 for w in ks]
        starts.append(xmin)
        weights.append(fixed + [0] * (ksize - count))
    return starts, weights


@functools.lru_cache(maxsize=64)
def device_taps(in_size: int, out_size: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(starts int32 [out], weights int32 [out, ksize], ksize) on `device`: made once per size pair
    and device, so that a batch touches no host data."""
    starts, weights = pillow_taps(in_size, out_size)
    return (torch.tensor(starts, dtype=torch.int32, device=device),
            torch.tensor(weights, dtype=torch.int32, device=device), len(weights[0]))
