"""Streaming per-tensor statistics for calibration, in bounded memory.

`HistogramObserver` keeps a histogram of |x| with a fixed number of bins (2048, as TensorRT's
calibrators) over [0, R), plus the exact running max |x|. R is the smallest power of two above
the running max: when a batch exceeds it, R doubles until it covers the new max, and every new
bin is the union of two old ones, so re-binning is an exact merge (no interpolation, no
smearing). The data always fills more than half of the bins, and since the bin of a value only
depends on R, the histogram does not depend on the order or the size of the batches. Binning
runs on the tensor's device with torch ops; only the 2048 counts come back to the host.
"""
from __future__ import annotations

import math

import numpy as np
import torch

DEFAULT_BINS = 2048


class HistogramObserver:
    def __init__(self, bins: int = DEFAULT_BINS) -> None:
        if bins < 2 or bins & (bins - 1):
            raise ValueError("bins must be a power of two")
        self.bins = bins
        self.counts = np.zeros(bins, dtype=np.int64)
        self.range = 0.0  # upper edge R of the histogram; 0 until a non-zero value is seen
        self.amax = 0.0  # exact max |x| over every finite value observed
        self.count = 0  # finite values observed
        self.nonfinite = 0  # NaN/inf values seen (left out of the statistics)
        self.batches = 0

    @property
    def bin_width(self) -> float:
        return self.range / self.bins

    def edges(self) -> np.ndarray:
        return np.linspace(0.0, self.range, self.bins + 1)

    def _grow(self, new_max: float) -> None:
        target = math.ldexp(1.0, math.frexp(new_max)[1])  # the smallest power of two > new_max
        if self.range == 0.0:
            # Only zeros so far: they sit in bin 0 under any range.
            self.range = target
            return
        while self.range < target:
            self.counts = np.concatenate([self.counts.reshape(-1, 2).sum(axis=1),
                                          np.zeros(self.bins // 2, dtype=np.int64)])
            self.range *= 2.0

    def update(self, x: torch.Tensor) -> None:
        a = x.detach().reshape(-1)
        if a.numel() == 0:
            return
        a = a.float().abs()
        finite = torch.isfinite(a)
        bad = int(a.numel() - finite.sum())
        if bad:
            self.nonfinite += bad
            a = a[finite]
            if a.numel() == 0:
                return
        batch_max = float(a.max())
        self.batches += 1
        self.count += int(a.numel())
        self.amax = max(self.amax, batch_max)
        if batch_max > 0.0 and batch_max >= self.range:
            self._grow(batch_max)
        if self.range == 0.0:
            self.counts[0] += a.numel()
            return
        index = torch.floor(a * (self.bins / self.range)).clamp_(max=self.bins - 1).to(torch.int64)
        self.counts += torch.bincount(index, minlength=self.bins).cpu().numpy()

    def to_json(self) -> dict:
        return {"bins": self.bins, "range": self.range, "amax": self.amax, "count": self.count,
                "nonfinite": self.nonfinite}

    def __repr__(self) -> str:
        return (f"HistogramObserver(bins={self.bins}, range={self.range:.6g}, amax={self.amax:.6g}, "
                f"count={self.count})")


def histogram_of(values: np.ndarray | torch.Tensor, bins: int = DEFAULT_BINS, batches: int = 1) -> HistogramObserver:
    """An observer fed `values` in `batches` chunks (tests and tools)."""
    observer = HistogramObserver(bins)
    tensor = torch.as_tensor(np.asarray(values)) if not isinstance(values, torch.Tensor) else values
    for chunk in torch.tensor_split(tensor.reshape(-1), max(1, batches)):
        observer.update(chunk)
    return observer


def finite_or(value: float, fallback: float) -> float:
    return value if math.isfinite(value) and value > 0 else fallback
