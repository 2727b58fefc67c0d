"""Thresholds (amax) from a tensor's |x| histogram; the INT8 scale is then amax / 127.

- `minmax`: the exact max |x| seen.
- `percentile`: the given percentile of |x| (default 99.99), interpolated within its bin.
- `entropy`: TensorRT's KL-divergence search (Szymon Migacz, "8-bit Inference with TensorRT",
  GTC 2017), as MXNet and ONNX Runtime implement it: for each candidate i (in bins) from 128 up,
  P = the first i bins with everything beyond folded into the last one; Q = the first i bins
  (without the outliers) merged into 128 levels and expanded back over P's non-empty bins; keep
  the i with the smallest KL(P || Q) (the largest such i on ties). Two details follow NVIDIA's own
  pytorch-quantization calibrator: the zero bin's count is replaced by its neighbour's, so that
  the exact zeros a ReLU writes (half of a tensor, all in bin 0) do not dominate the divergence
  and drag the threshold down; and the threshold is the bin edge i · width (the talk's
  (i + 0.5) · width differs by half a bin), capped at the max seen. Sparse histograms (fewer
  than 16 values per bin in use) are coarsened first, or not clipped at all when too small.
- `mse`: the threshold minimising the expected squared quantization error over the histogram.
  Values are taken uniform within each bin, so a bin's expected rounding error is an exact
  integral (not a bin-centre sample), and values beyond the threshold cost their clipping error.
"""
from __future__ import annotations

import numpy as np

from ..ir.dtypes import INT8_QMAX
from .observers import HistogramObserver

METHODS = ("entropy", "percentile", "minmax", "mse")
# mse by measurement (docs/decisions/0001-mse-default-calibrator.md); entropy (TensorRT's KL
# search) stays available with --calib-method entropy.
DEFAULT_METHOD = "mse"
DEFAULT_PERCENTILE = 99.99
QUANTIZED_BINS = 128  # 2^7 levels of |x|: INT8 is sign + 7 bits
MIN_PER_BIN = 16  # entropy: average values per histogram bin in use below which bins are merged


def _last_nonzero(counts: np.ndarray) -> int:
    nonzero = np.flatnonzero(counts)
    return int(nonzero[-1]) if nonzero.size else -1


def minmax_amax(observer: HistogramObserver) -> float:
    return float(observer.amax)


def percentile_amax(observer: HistogramObserver, percentile: float = DEFAULT_PERCENTILE) -> float:
    counts = observer.counts
    total = int(counts.sum())
    if total == 0 or observer.range == 0.0:
        return float(observer.amax)
    if percentile >= 100.0:
        return float(observer.amax)
    target = percentile / 100.0 * total
    cdf = np.cumsum(counts)
    b = int(np.searchsorted(cdf, target, side="left"))
    below = float(cdf[b - 1]) if b > 0 else 0.0
    fraction = (target - below) / float(counts[b]) if counts[b] else 0.0
    value = (b + min(max(fraction, 0.0), 1.0)) * observer.bin_width
    return float(min(value, observer.amax))


def _smooth(p: np.ndarray, eps: float = 1e-4) -> np.ndarray | None:
    """MXNet/ONNX Runtime's smoothing: move eps of mass onto the empty bins (None if all empty)."""
    zeros = p == 0
    n_zeros = int(zeros.sum())
    n_nonzeros = p.size - n_zeros
    if n_nonzeros == 0:
        return None
    eps1 = eps * n_zeros / n_nonzeros
    out = p.astype(np.float64) + np.where(zeros, eps, -eps1)
    if (out <= 0).any():
        return None
    return out


def _kl(p: np.ndarray, q: np.ndarray) -> float:
    p = p / p.sum()
    q = q / q.sum()
    return float(np.sum(p * np.log(p / q)))


def entropy_amax(observer: HistogramObserver, quantized_bins: int = QUANTIZED_BINS) -> float:
    counts = observer.counts.astype(np.float64)
    width = observer.bin_width
    last = _last_nonzero(observer.counts)
    if last < 0 or width == 0.0:
        return float(observer.amax)
    # A divergence between sparse histograms is noise: merge bin pairs until the bins in use hold
    # MIN_PER_BIN values on average, keeping at least 2 × 128 of them; if that is not enough
    # (a small tensor: the pooled features of a few samples), do not clip at all.
    total = counts.sum()
    while total < MIN_PER_BIN * (last + 1) and (last + 1) // 2 >= 2 * quantized_bins:
        counts = counts.reshape(-1, 2).sum(axis=1)
        width *= 2.0
        last //= 2
    if total < MIN_PER_BIN * (last + 1):
        return float(observer.amax)
    counts[0] = counts[1]
    if last + 1 <= quantized_bins:
        # All values fit in fewer bins than there are levels: no clipping can help.
        return float(observer.amax)
    suffix = np.concatenate([np.cumsum(counts[::-1])[::-1], [0.0]])  # suffix[i] = sum(counts[i:])
    best_i, best_kl = None, np.inf
    for i in range(quantized_bins, min(len(counts), last + 1) + 1):
        sliced = counts[:i]
        p = sliced.copy()
        p[i - 1] += suffix[i]
        nonzero = p != 0
        merged = i // quantized_bins
        starts = np.arange(quantized_bins) * merged
        stops = starts + merged
        stops[-1] = i
        cumulative = np.concatenate([[0.0], np.cumsum(sliced)])
        level_sums = cumulative[stops] - cumulative[starts]
        cumulative_nz = np.concatenate([[0], np.cumsum(nonzero)])
        level_nonzero = cumulative_nz[stops] - cumulative_nz[starts]
        level_of = np.minimum(np.arange(i) // merged, quantized_bins - 1)
        with np.errstate(divide="ignore", invalid="ignore"):
            per_bin = np.where(level_nonzero > 0, level_sums / np.maximum(level_nonzero, 1), 0.0)
        q = np.where(nonzero, per_bin[level_of], 0.0)
        ps, qs = _smooth(p), _smooth(q)
        if ps is None or qs is None:
            continue
        divergence = _kl(ps, qs)
        if divergence <= best_kl:
            best_i, best_kl = i, divergence
    if best_i is None:
        return float(observer.amax)
    return float(min(best_i * width, observer.amax))


def _rounding_integral(x: np.ndarray, step: np.ndarray) -> np.ndarray:
    """∫_0^x (u - step·round(u/step))² du, elementwise (x ≥ 0)."""
    k = np.floor(x / step + 0.5)
    r = x - k * step
    return k * step ** 3 / 12.0 + r ** 3 / 3.0


def mse_errors(observer: HistogramObserver, candidates: np.ndarray) -> np.ndarray:
    """Expected squared quantization error (sum over values) for each candidate bin index i
    (threshold = i · bin width)."""
    counts = observer.counts.astype(np.float64)
    width = observer.bin_width
    edges = np.arange(observer.bins + 1, dtype=np.float64) * width
    lo, hi = edges[:-1], edges[1:]
    errors = np.empty(len(candidates))
    chunk = 128
    for start in range(0, len(candidates), chunk):
        idx = candidates[start:start + chunk].astype(np.float64)[:, None]
        t = idx * width
        step = t / INT8_QMAX
        g = _rounding_integral(edges[None, :], step)
        rounding = (g[:, 1:] - g[:, :-1]) / width  # mean error of a value uniform in each bin
        clipped = ((hi - t) ** 3 - (lo - t) ** 3) / (3.0 * width)
        below = np.arange(observer.bins)[None, :] < idx
        errors[start:start + chunk] = np.sum(counts[None, :] * np.where(below, rounding, clipped), axis=1)
    return errors


def mse_amax(observer: HistogramObserver) -> float:
    last = _last_nonzero(observer.counts)
    if last < 0 or observer.bin_width == 0.0:
        return float(observer.amax)
    # A coarse pass over every `stride`-th threshold, then every threshold around the best one.
    stride = max(1, (last + 1) // 256)
    coarse = np.arange(1, last + 2, stride)
    best = int(coarse[int(np.argmin(mse_errors(observer, coarse)))])
    fine = np.arange(max(1, best - stride), min(last + 1, best + stride) + 1)
    best = int(fine[int(np.argmin(mse_errors(observer, fine)))])
    return float(min(best * observer.bin_width, observer.amax))


def compute_amax(observer: HistogramObserver, method: str = DEFAULT_METHOD,
                 percentile: float = DEFAULT_PERCENTILE) -> float:
    if method == "minmax":
        return minmax_amax(observer)
    if method == "percentile":
        return percentile_amax(observer, percentile)
    if method == "entropy":
        return entropy_amax(observer)
    if method == "mse":
        return mse_amax(observer)
    raise ValueError(f"unknown calibration method {method!r}")
