"""Entropy's KL search read off running sums (`calibrators._kl_divergences`) against the loop it
replaced, one candidate at a time, kept here verbatim as the reference: the same divergences
within rounding and the same thresholds, bit for bit, on fixed histograms of every shape the
calibrator meets."""
from __future__ import annotations

import numpy as np
import pytest

from sartor.quant.calibrators import MIN_PER_BIN, QUANTIZED_BINS, _kl_divergences, entropy_amax
from sartor.quant.observers import HistogramObserver, histogram_of


def _smooth(p: np.ndarray, eps: float = 1e-4) -> np.ndarray | None:
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


def loop_divergences(counts: np.ndarray, candidates, quantized_bins: int = QUANTIZED_BINS) -> np.ndarray:
    """The per-candidate loop of entropy_amax before the running sums (NaN: skipped)."""
    suffix = np.concatenate([np.cumsum(counts[::-1])[::-1], [0.0]])
    out = []
    for i in candidates:
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
        out.append(np.nan if ps is None or qs is None else _kl(ps, qs))
    return np.asarray(out)


def loop_entropy_amax(observer: HistogramObserver, quantized_bins: int = QUANTIZED_BINS) -> float:
    """entropy_amax as it was, around the loop."""
    counts = observer.counts.astype(np.float64)
    width = observer.bin_width
    nonzero = np.flatnonzero(observer.counts)
    last = int(nonzero[-1]) if nonzero.size else -1
    if last < 0 or width == 0.0:
        return float(observer.amax)
    total = counts.sum()
    while total < MIN_PER_BIN * (last + 1) and (last + 1) // 2 >= 2 * quantized_bins:
        counts = counts.reshape(-1, 2).sum(axis=1)
        width *= 2.0
        last //= 2
    if total < MIN_PER_BIN * (last + 1) or last + 1 <= quantized_bins:
        return float(observer.amax)
    counts[0] = counts[1]
    best_i, best_kl = None, np.inf
    candidates = range(quantized_bins, min(len(counts), last + 1) + 1)
    for i, divergence in zip(candidates, loop_divergences(counts, candidates, quantized_bins)):
        if divergence <= best_kl:
            best_i, best_kl = i, divergence
    if best_i is None:
        return float(observer.amax)
    return float(min(best_i * width, observer.amax))


def _histograms() -> dict[str, HistogramObserver]:
    rng = np.random.default_rng(29)
    pixels = np.round(rng.random(300_000) * 255) / 255  # an image's 256 levels: most bins empty
    relu = np.maximum(rng.standard_normal(300_000), 0)  # half exact zeros
    gaps = np.concatenate([rng.standard_normal(200_000), [40.0, 41.0, 90.0]])  # a far tail of lone values
    return {"gaussian": histogram_of(rng.standard_normal(300_000).astype(np.float32), batches=3),
            "student-t": histogram_of(rng.standard_t(2, 300_000).astype(np.float32), batches=3),
            "lognormal": histogram_of(rng.lognormal(size=200_000).astype(np.float32)),
            "uniform": histogram_of(rng.random(200_000).astype(np.float32)),
            "pixels": histogram_of(pixels.astype(np.float32)),
            "relu": histogram_of(relu.astype(np.float32)),
            "silu-bimodal": histogram_of(np.concatenate([rng.normal(0, 0.1, 150_000),
                                                         rng.normal(6, 1, 50_000)]).astype(np.float32)),
            "gaps": histogram_of(gaps.astype(np.float32)),
            "coarsened": histogram_of(rng.lognormal(size=20_000).astype(np.float32))}


HISTOGRAMS = _histograms()


@pytest.mark.parametrize("name", sorted(HISTOGRAMS))
def test_running_sums_give_the_loops_divergences_and_thresholds(name):
    observer = HISTOGRAMS[name]
    fast, slow = entropy_amax(observer), loop_entropy_amax(observer)
    assert fast == slow, (name, fast, slow)
    counts = observer.counts.astype(np.float64)
    counts[0] = counts[1]
    last = int(np.flatnonzero(counts)[-1])
    candidates = np.arange(QUANTIZED_BINS, last + 2)
    expected = loop_divergences(counts, candidates)
    got = _kl_divergences(counts, candidates)
    assert np.array_equal(np.isnan(got), np.isnan(expected))
    usable = ~np.isnan(expected)
    assert usable.any()
    np.testing.assert_allclose(got[usable], expected[usable], rtol=1e-9, atol=1e-13)


def test_the_histograms_reach_every_branch_of_the_search():
    """The fixed histograms clip and keep: a comparison where every threshold were the max (or
    where no bin were empty, so that the smoothing shift were 0) would not test the search."""
    clipped = {name for name, o in HISTOGRAMS.items() if entropy_amax(o) < 0.9 * o.amax}
    assert {"student-t", "lognormal", "gaps"} <= clipped and "uniform" not in clipped
    empty_bins = {name for name, o in HISTOGRAMS.items() if (o.counts[:np.flatnonzero(o.counts)[-1]] == 0).any()}
    assert {"pixels", "gaps"} <= empty_bins and "uniform" not in empty_bins


def test_candidates_without_a_divergence_are_skipped_as_the_loop_skipped_them():
    """Only the outlier bin filled below the candidate: no Q level has mass, so no divergence."""
    counts = np.zeros(512)
    counts[300:] = 1.0
    candidates = np.arange(QUANTIZED_BINS, 301)
    expected = loop_divergences(counts, candidates)
    got = _kl_divergences(counts, candidates)
    assert np.isnan(expected).all() and np.isnan(got).all()
