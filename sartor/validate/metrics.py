"""Task metrics: top-1/top-5 for classifiers; for detectors the result every AP method returns
(the methods themselves are in `ap/`), pseudo-labels and score histograms.

Everything here takes plain arrays, so the same functions score labelled data and the reference
mode, where the FP32 model's own outputs are the ground truth (`pseudo_labels`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from ..errors import ConfigError, DataError
from .decoders import Detections

DEFAULT_PSEUDO_CONF = 0.25  # reference detections at or above this score become pseudo-labels


# ---- classification ------------------------------------------------------------------------------

def probabilities(scores: np.ndarray) -> np.ndarray:
    """Rows that already are probabilities (non-negative, summing to 1) as they are; logits through softmax."""
    x = np.asarray(scores, dtype=np.float64)
    if x.ndim != 2:
        x = x.reshape(len(x), -1)
    if x.size and np.all(x >= 0) and np.allclose(x.sum(axis=1), 1.0, atol=1e-3):
        return x
    x = x - x.max(axis=1, keepdims=True)
    e = np.exp(x)
    return e / e.sum(axis=1, keepdims=True)


def label_ranks(scores: np.ndarray, labels: np.ndarray) -> np.ndarray:
    """Per row, the label's position in a stable best-first order of the scores (0: top-1). Ties go
    to the lower class index, as argmax does. A row holding NaN, or a label outside the scores
    (-1: no label), ranks last: a broken output never counts as a hit."""
    scores = np.asarray(scores, dtype=np.float64)
    labels = np.asarray(labels).reshape(-1).astype(np.int64)
    n, c = scores.shape
    valid = (labels >= 0) & (labels < c)
    safe = np.where(valid, labels, 0)
    label_scores = scores[np.arange(n), safe][:, None]
    higher = (scores > label_scores).sum(axis=1)
    tied_before = ((scores == label_scores) & (np.arange(c)[None, :] < safe[:, None])).sum(axis=1)
    ranks = higher + tied_before
    broken = ~valid | np.isnan(scores).any(axis=1)
    ranks[broken] = c
    return ranks.astype(np.int64)


def predictions(scores: np.ndarray) -> np.ndarray:
    """Argmax per row; -1 for rows holding NaN."""
    scores = np.asarray(scores, dtype=np.float64)
    pred = np.argmax(np.nan_to_num(scores, nan=-np.inf), axis=1)
    pred[np.isnan(scores).any(axis=1)] = -1
    return pred


def topk_accuracy(scores: np.ndarray, labels: np.ndarray, k: int) -> float | None:
    """Fraction of rows whose label is among the k highest scores (None when there are no rows)."""
    labels = np.asarray(labels).reshape(-1)
    if len(labels) == 0:
        return None
    return float(np.mean(label_ranks(scores, labels) < k))


def metrics_from_ranks(ranks: np.ndarray, labels: np.ndarray, num_classes: int) -> dict:
    """top1, top5 (None with 5 classes or fewer, where it says nothing) and per-class top-1 accuracy."""
    ranks = np.asarray(ranks).reshape(-1)
    labels = np.asarray(labels).reshape(-1)
    if not len(ranks):
        return {"top1": None, "top5": None, "per_class": {}, "images": 0}
    hits = ranks == 0
    per_class = {int(c): float(hits[labels == c].mean()) for c in np.unique(labels) if c >= 0}
    return {"top1": float(hits.mean()), "top5": float(np.mean(ranks < 5)) if num_classes > 5 else None,
            "per_class": per_class, "images": len(ranks)}


def classification_metrics(scores: np.ndarray, labels: np.ndarray) -> dict:
    """top1, top5 (None with 5 classes or fewer) and per-class accuracy of scores [N, C] against labels."""
    scores = np.asarray(scores)
    labels = np.asarray(labels).reshape(-1).astype(np.int64)
    if scores.ndim != 2 or len(scores) != len(labels):
        raise DataError(f"classification scores of shape {list(scores.shape)} do not match {len(labels)} labels")
    c = scores.shape[1]
    if len(labels) and (labels.min() < 0 or labels.max() >= c):
        raise DataError(f"label {int(labels.max() if labels.max() >= c else labels.min())} is outside the "
                        f"model's {c} classes")
    return metrics_from_ranks(label_ranks(scores, labels), labels, c)


# ---- detection -------------------------------------------------------------------------------------

@dataclass
class DetectionMetrics:
    map: float | None  # AP@[.5:.95] as the AP method computes it; None when there is no ground truth
    map50: float | None
    per_class: dict = field(default_factory=dict)  # class id -> {"ap": .., "ap50": .., "instances": n}
    images: int = 0
    instances: int = 0
    detections: int = 0

    def to_json(self) -> dict:
        return {"map": self.map, "map50": self.map50, "images": self.images, "instances": self.instances,
                "detections": self.detections,
                "per_class": {str(k): v for k, v in self.per_class.items()}}


def pseudo_labels(reference: Sequence[Detections], threshold: float = DEFAULT_PSEUDO_CONF) -> list[Detections]:
    """The reference's detections at or above `threshold`, used as ground truth where none exists."""
    if not 0.0 <= threshold <= 1.0:
        raise ConfigError(f"pseudo-label threshold {threshold} must be in [0, 1]")
    return [d.above(threshold) for d in reference]


def score_histogram(scores: np.ndarray, bins: int = 20, top: float = 1.0) -> list[int]:
    """Counts of scores in `bins` equal bins over [0, top] (scores outside are clipped into the ends)."""
    scores = np.asarray(scores, dtype=np.float64).reshape(-1)
    scores = np.clip(scores[np.isfinite(scores)], 0.0, top)
    counts, _ = np.histogram(scores, bins=bins, range=(0.0, top))
    return [int(c) for c in counts]


def histogram_top(*score_sets) -> float:
    """The histogram's upper end: 1, or a round number just over the highest score when all scores are
    small (an untrained detector's scores sit near 1e-4 and would all fall in one bin of [0, 1])."""
    highest = max((float(np.max(s)) for s in score_sets if np.size(s)), default=0.0)
    if not math.isfinite(highest) or highest <= 0 or highest >= 0.5:
        return 1.0
    exponent = math.floor(math.log10(highest))
    for step in (1, 2, 2.5, 5, 10):
        top = step * 10.0 ** exponent
        if top >= highest * (1 + 1e-9):
            return min(1.0, top)
    return 1.0


def finite_or_none(value: float | None) -> float | None:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return None
    return float(value)
