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
  Every candidate is searched at once (`_kl_divergences`): Q is constant per level, so the
  divergence is per-level running sums and one sum over P's own bins, not a loop of 2048-bin
  arrays per candidate (tests/quant/test_entropy_search.py holds that loop as the reference).
- `mse`: the threshold minimising the expected squared quantization error over the histogram.
  Values are taken uniform within each bin, so a bin's expected rounding error is an exact
  integral (not a bin-centre sample), and values beyond the threshold cost their clipping error.
"""
from __future__ import annotations

import math

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
ENTROPY_CHUNK = 256  # entropy: candidate thresholds summed at once (rows × up to 2048 bins of float64)
SMOOTHING = 1e-4  # entropy: the mass moved onto empty bins (MXNet's and ONNX Runtime's eps)


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


def _kl_divergences(counts: np.ndarray, candidates: np.ndarray, quantized_bins: int = QUANTIZED_BINS,
                    eps: float = SMOOTHING) -> np.ndarray:
    """KL(P || Q) of the entropy search (module docstring) for each candidate i (in bins, each
    ≥ quantized_bins); NaN where smoothing cannot keep every bin positive (no divergence).

    P and Q are constant per merged level but for P's own bins, so the divergence splits into
    per-level sums read off running sums, O(levels) per candidate, and one O(bins) sum,
    Σ (p − e) log(p − e) over P's non-empty bins (e: P's smoothing shift), that is itself a
    running sum when no bin is empty (e = 0). Equal to the per-candidate loop within rounding."""
    i = np.asarray(candidates, np.int64)
    nonempty = counts != 0
    cumulative = np.concatenate([[0.0], np.cumsum(counts)])  # Σ counts[:t]
    filled = np.concatenate([[0], np.cumsum(nonempty)])  # non-empty bins in counts[:t]
    suffix = np.concatenate([np.cumsum(counts[::-1])[::-1], [0.0]])  # Σ counts[t:]
    # P: the first i − 1 bins as counted, the outliers folded into bin i − 1; zeros get eps, the
    # others give up e each so that the mass stays.
    last = counts[i - 1] + suffix[i]
    last_filled = (last != 0).astype(np.int64)
    inner = filled[i - 1]  # P's non-empty bins before its last
    p_nonzero = inner + last_filled
    with np.errstate(divide="ignore", invalid="ignore"):
        e = eps * (i - p_nonzero) / p_nonzero
    smallest = np.minimum.accumulate(np.where(nonempty, counts, np.inf))[i - 2]
    p_ok = (p_nonzero > 0) & (smallest - e > 0) & ((last_filled == 0) | (last - e > 0))
    last_p = np.where(last_filled == 1, last - e, eps)
    p_mass = (cumulative[i - 1] - e * inner) + eps * (i - 1 - inner) + last_p
    # Q: each level's count (without the outliers) spread evenly over its bins that P fills.
    levels = np.arange(quantized_bins)
    merged = i // quantized_bins
    starts = levels[None, :] * merged[:, None]
    stops = starts + merged[:, None]
    stops[:, -1] = i
    level_sums = cumulative[stops] - cumulative[starts]
    level_filled = filled[stops] - filled[starts]
    level_filled[:, -1] += last_filled - (filled[i] - filled[i - 1])  # bin i − 1 as P has it
    with np.errstate(divide="ignore", invalid="ignore"):
        per_bin = np.where(level_filled > 0, level_sums / np.maximum(level_filled, 1), 0.0)
    q_filled = np.where(per_bin != 0, level_filled, 0)
    q_nonzero = q_filled.sum(axis=1)
    with np.errstate(divide="ignore", invalid="ignore"):
        f = eps * (i - q_nonzero) / q_nonzero
    q_level = per_bin - f[:, None]
    q_ok = (q_nonzero > 0) & np.all((q_filled == 0) | (q_level > 0), axis=1)
    # Σ_j p_j log q_j: P's smoothed mass per level times the log of that level's Q (eps where Q
    # is empty; P's empty bins cancel in the divergence, eps against eps).
    level_p = level_sums - e[:, None] * (filled[stops] - filled[starts])
    top = starts[:, -1]  # the last level without bin i − 1, then that bin as P has it
    level_p[:, -1] = (cumulative[i - 1] - cumulative[top]) - e * (inner - filled[top]) \
        + np.where(last_filled == 1, last - e, 0.0)
    with np.errstate(divide="ignore", invalid="ignore"):
        q_mass = np.sum(np.where(q_filled > 0, q_filled * q_level, 0.0), axis=1) + eps * (i - q_nonzero)
        log_q = np.where(q_filled > 0, np.log(np.where(q_level > 0, q_level, 1.0)), math.log(eps))
        cross = np.sum(np.where(level_filled > 0, level_p * log_q, 0.0), axis=1)
        own = _filled_entropy(counts, nonempty, inner, e) + np.where(last_filled == 1, last_p * np.log(last_p), 0.0)
        divergence = (own - cross) / p_mass + np.log(q_mass) - np.log(p_mass)
    return np.where(p_ok & q_ok, divergence, np.nan)


def _filled_entropy(counts: np.ndarray, nonempty: np.ndarray, inner: np.ndarray, e: np.ndarray) -> np.ndarray:
    """Σ (c − e) log(c − e) over the first `inner` non-empty counts c, per candidate: a running
    sum where e = 0, else summed row by row in chunks."""
    filled_counts = counts[nonempty]
    with np.errstate(divide="ignore", invalid="ignore"):
        running = np.concatenate([[0.0], np.cumsum(filled_counts * np.log(filled_counts))])
    out = running[inner]
    shifted = np.flatnonzero(e != 0)
    for start in range(0, len(shifted), ENTROPY_CHUNK):
        rows = shifted[start:start + ENTROPY_CHUNK]
        width = int(inner[rows].max())
        x = filled_counts[None, :width] - e[rows, None]
        x = np.where(np.arange(width)[None, :] < inner[rows, None], x, 1.0)  # log 1 = 0 beyond each row's bins
        with np.errstate(divide="ignore", invalid="ignore"):
            out[rows] = np.sum(x * np.log(x), axis=1)
    return out


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
    candidates = np.arange(quantized_bins, min(len(counts), last + 1) + 1)
    divergences = _kl_divergences(counts, candidates, quantized_bins)
    usable = ~np.isnan(divergences)
    if not usable.any():
        return float(observer.amax)
    # The largest i among the smallest divergences, as a loop keeping i when KL <= the best did.
    best_i = int(candidates[usable & (divergences == divergences[usable].min())][-1])
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
