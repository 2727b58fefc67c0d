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


@functools.lru_cache(maxsize=64)
def used_taps(in_size: int, out_size: int) -> int:
    """How many leading taps of `pillow_taps` carry a weight somewhere: past it every output
    pixel's weight is 0 (a 2× shrink has 4 taps in a table of 5), so a kernel may stop there and
    sum the same nonzero products."""
    _, weights = pillow_taps(in_size, out_size)
    return 1 + max((j for row in weights for j, w in enumerate(row) if w != 0), default=0)


# The most input rows a program of several output rows filters (its SPAN): the kernel unrolls them,
# so past this (shrinks beyond about 4× at 4 rows) the one-row kernel runs instead.
MAX_SPAN = 24


@functools.lru_cache(maxsize=64)
def row_groups(in_size: int, out_size: int, first: int, count: int, rows: int) -> tuple[list, list, list, int] | None:
    """The vertical taps of output rows first..first+count-1 (indices into the resized image) in
    groups of `rows` consecutive rows, one group per program: (each group's first input row Y0,
    how many input rows from Y0 it reads, its weights [SPAN][rows] flattened: the weight of input
    row Y0 + k in output row r, 0 where r does not read it or lies past `count`, and SPAN, the
    most rows any group reads); None when SPAN exceeds MAX_SPAN. A row's weights are its own
    Pillow taps moved to where its first input row lies from Y0, so each output row sums the same
    products as alone."""
    starts, weights = pillow_taps(in_size, out_size)
    firsts, used, tables = [], [], []
    for g in range(-(-count // rows)):
        members = [first + g * rows + r for r in range(rows) if g * rows + r < count]
        y0 = min(starts[iy] for iy in members)
        table: dict[tuple[int, int], int] = {}
        for r, iy in enumerate(members):
            for i, w in enumerate(weights[iy]):
                if w != 0:
                    table[starts[iy] - y0 + i, r] = w
        firsts.append(y0)
        used.append(1 + max((k for k, _ in table), default=0))
        tables.append(table)
    span = max(used)
    if span > MAX_SPAN:
        return None
    flat = [[table.get((k, r), 0) for k in range(span) for r in range(rows)] for table in tables]
    return firsts, used, flat, span


@functools.lru_cache(maxsize=64)
def device_row_groups(in_size: int, out_size: int, first: int, count: int, rows: int,
                      device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int] | None:
    """`row_groups` as int32 tensors on `device` (first rows, rows read, weights [groups, SPAN·rows]) and
    SPAN, made once per geometry and device; None where the one-row kernel runs."""
    groups = row_groups(in_size, out_size, first, count, rows)
    if groups is None:
        return None
    firsts, used, flat, span = groups
    return (torch.tensor(firsts, dtype=torch.int32, device=device),
            torch.tensor(used, dtype=torch.int32, device=device),
            torch.tensor(flat, dtype=torch.int32, device=device), span)
