"""BatchedNms: a YOLO head's decode into boxes and class-aware NMS with fixed-size outputs, made by
`passes/append_nms.py` for `sartor build --nms` (TensorRT's EfficientNMS, with torchvision's
greedy semantics).

Input: the head's output [B, 4 + C, A] (cx, cy, w, h in input pixels, then C class scores). Every
(anchor, class) pair scoring over `conf` is a candidate (multi-label, as Ultralytics' validator
and `pipeline.detections.YoloNms`); the `topk` best of each image go on, sorted by score with ties
in (class, anchor) order, which is the order torchvision's stable sort gives the host decoder's
candidates; a greedy pass keeps a box unless a kept box of its class (any class with `agnostic`)
overlaps it by IoU > `iou`; the first `max_det` kept are written out. Outputs, EfficientNMS's:
num_detections [B] int32, detection_boxes [B, max_det, 4] float32 (x1, y1, x2, y2 in input
pixels), detection_scores [B, max_det] float32, detection_classes [B, max_det] int32; slots past
an image's count are zero. Every shape is fixed and nothing is read back to the host, so the layer
runs inside the engine's CUDA graph.

Tactics: two candidate stages (one top-k over all C·A scores, or two levels: anchors, then their
pairs; `nms_candidates`) times two greedy passes: `torch` (the IoU matrix of the K candidates and
the greedy walk in tensor ops; on the CPU only as far as the last valid candidate) and, on CUDA,
`triton_greedy_nms` (`kernels/detection/greedy_nms.py`: one program per image); the `two_level_`
tactics are the second stage's. On CUDA a third, `fused_triton_greedy_nms`, takes the two-level
stage's candidates from Triton kernels (`fused_candidates`) and feeds them to the Triton greedy pass.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from ..errors import ConfigError
from ..kernels.detection.greedy_nms import (
    MAX_CANDIDATES,
    float32_threshold,
    greedy_nms,
    greedy_nms_supported,
    nms_outputs_fit,
)
from ..kernels.detection.nms_candidates import (
    INDEX_BITS,
    INDEX_MASK,
    select_candidates,
    select_candidates_supported,
)
from ..kernels.registry import fixed_tactic
from .registry import OpTable

OPS = OpTable("nms")

REFERENCE = "torch"
TRITON = "triton_greedy_nms"
TWO_LEVEL = "two_level_torch"
TWO_LEVEL_TRITON = "two_level_triton_greedy_nms"
fixed_tactic(TRITON, "triton greedy NMS (one program per image over its sorted candidates)")
fixed_tactic(TWO_LEVEL, "two-level top-k candidates, torch greedy NMS")
fixed_tactic(TWO_LEVEL_TRITON, "two-level top-k candidates, triton greedy NMS")
FUSED_TRITON = "fused_triton_greedy_nms"
fixed_tactic(FUSED_TRITON, "triton candidates (anchor floor, pairs over it, one sort), triton greedy NMS")
TWO_LEVEL_TACTICS = (TWO_LEVEL, TWO_LEVEL_TRITON)

OUTPUT_NAMES = ("num_detections", "detection_boxes", "detection_scores", "detection_classes")
NO_SCORE = -1.0  # what a candidate under the threshold scores in the top-k (class scores are sigmoids ≥ 0)


@dataclass(frozen=True)
class NmsSettings:
    """`--nms conf=0.25,iou=0.45,max_det=300,topk=1000[,agnostic]`."""
    conf: float = 0.25
    iou: float = 0.45
    max_det: int = 300
    topk: int = 1000
    agnostic: bool = False

    def check(self) -> NmsSettings:
        # `not a <= x <= b` also refuses NaN.
        if not 0.0 <= self.conf < 1.0:
            raise ConfigError(f"--nms conf={self.conf:g} must be in [0, 1)")
        if not 0.0 < self.iou <= 1.0:
            raise ConfigError(f"--nms iou={self.iou:g} must be in (0, 1]")
        if not 1 <= self.topk <= MAX_CANDIDATES:
            raise ConfigError(f"--nms topk={self.topk} must be in 1..{MAX_CANDIDATES} (the candidates one image "
                              f"keeps for NMS)")
        if not 1 <= self.max_det <= self.topk:
            raise ConfigError(f"--nms max_det={self.max_det} must be in 1..topk ({self.topk}): NMS keeps at most "
                              f"its candidates")
        return self

    def describe(self) -> str:
        return (f"conf={self.conf:g},iou={self.iou:g},max_det={self.max_det},topk={self.topk}"
                + (",agnostic" if self.agnostic else ""))

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, record: dict) -> NmsSettings:
        return cls(**{k: record[k] for k in ("conf", "iou", "max_det", "topk", "agnostic") if k in record})


def parse_nms(spec: str) -> NmsSettings:
    """`conf=0.25,iou=0.45,max_det=300,topk=1000,agnostic` (any subset, any order) → checked settings."""
    kinds = {"conf": float, "iou": float, "max_det": int, "topk": int}
    values: dict = {}
    for token in (t.strip() for t in str(spec).split(",")):
        if not token:
            continue
        if token == "agnostic":
            values["agnostic"] = True
            continue
        key, sep, text = token.partition("=")
        key = key.strip().replace("-", "_")
        if not sep or key not in kinds:
            raise ConfigError(f"--nms {spec!r}: {token!r} is not one of conf=X, iou=X, max_det=N, topk=N, agnostic")
        try:
            values[key] = kinds[key](text.strip())
        except ValueError:
            raise ConfigError(f"--nms {spec!r}: {key} needs a {'number' if kinds[key] is float else 'whole number'}, "
                              f"not {text.strip()!r}") from None
    return NmsSettings(**values).check()


def settings_of(attrs: dict) -> NmsSettings:
    return NmsSettings.from_json(attrs)


# ---- the candidates (both tactics) -------------------------------------------------------------
# A candidate's key: its score's float32 bits, then 2³² − 1 − its index (class · A + anchor); the
# Triton stage (kernels/detection/nms_candidates.py) ranks by the same keys.


def nms_candidates(pred: torch.Tensor, settings: NmsSettings, two_level: bool = False) -> tuple:
    """(boxes [B, K, 4] x1y1x2y2, scores [B, K], classes [B, K] int64, valid [B, K] bool) of each
    image's K = min(topk, C·A) best (anchor, class) pairs, sorted by score, ties by class then
    anchor; the valid ones (score > conf) come first. The scores are ranked in the head's own
    dtype (an FP16 engine's head is float16: no float32 copy of it), against the threshold that
    makes the test there the float32 one. Two stages give the same valid candidates but where
    scores tie at the K-th place: `flat_candidates` keeps those topk leaves, `two_level_candidates`
    the lower (class, anchor); which is faster depends on the device and the head's dtype."""
    return (two_level_candidates if two_level else flat_candidates)(pred, settings)


def flat_candidates(pred: torch.Tensor, settings: NmsSettings) -> tuple:
    """One top-k over all C·A masked scores, then re-sorted."""
    batch, channels, anchors = pred.shape
    scores = pred[:, 4:, :].reshape(batch, (channels - 4) * anchors)  # index: class · A + anchor
    masked = torch.where(scores > threshold_in(settings.conf, scores.dtype), scores, NO_SCORE)
    k = min(settings.topk, scores.shape[1])
    top, index = masked.topk(k, dim=1, sorted=False)
    # topk orders equal scores as it likes: order the K by index, then stably by score.
    index, by_index = index.sort(dim=1)
    top, by_score = top.gather(1, by_index).float().sort(dim=1, descending=True, stable=True)
    index = index.gather(1, by_score)
    return corner_boxes(pred, index), top, index // anchors, top > settings.conf


def corner_boxes(pred: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """[B, K, 4] x1y1x2y2 float32 of the pairs at `index` (class · A + anchor)."""
    batch, _, anchors = pred.shape
    anchor = index % anchors
    xywh = pred[:, :4, :].gather(2, anchor[:, None, :].expand(batch, 4, index.shape[1])).float()
    cx, cy, w, h = xywh.unbind(1)
    return torch.stack((cx - w / 2, cy - h / 2, cx + w / 2, cy + h / 2), dim=2)


def two_level_candidates(pred: torch.Tensor, settings: NmsSettings) -> tuple:
    """`nms_candidates` by two levels of top-k: the K best anchors by their best pair, then the K
    best of those anchors' C·K pairs (exact: see `candidate_anchors`), ranked by int64 keys, so a
    tie at the K-th place keeps the pairs of lower (class, anchor). A class score of NaN hides
    its anchor's other classes (the anchor's best is NaN, not over conf, and the second level
    takes pairs of anchors over conf only, also where such an anchor fills a place at the first)."""
    batch, channels, anchors = pred.shape
    scores = pred[:, 4:, :]  # [B, C, A]
    threshold = threshold_in(settings.conf, scores.dtype)
    k = candidate_count(pred, settings)
    anchor_keys, anchor = candidate_anchors(scores, threshold, min(k, anchors))
    keys = candidate_pair_keys(scores, anchor, threshold, anchor_keys > INDEX_MASK)
    top = keys.topk(k, dim=1).values  # distinct keys: sorted, and the same K whatever topk's algorithm
    index = INDEX_MASK - (top & INDEX_MASK)
    bits = (top >> INDEX_BITS).int()
    valid = bits > 0  # only a pair over the threshold has a nonzero score in its key
    top = torch.where(valid, bits.view(torch.float32), NO_SCORE)
    return corner_boxes(pred, index), top, index // anchors, valid


def fused_candidates(pred: torch.Tensor, settings: NmsSettings, capacity: int | None = None) -> tuple:
    """`two_level_candidates`'s, the valid ones equal bit for bit, from Triton kernels
    (`kernels/detection/nms_candidates.py`: the K-th best anchor's score is a floor no top-K pair is
    under, so only pairs at or over it are sorted, `capacity` of them an image without the slow
    exact path). Invalid slots: score −1, class 0, anchor 0."""
    boxes, scores, classes, count = select_candidates(pred, threshold_in(settings.conf, pred.dtype),
                                                      candidate_count(pred, settings), capacity)
    valid = torch.arange(scores.shape[1], device=pred.device) < count[:, None]
    return boxes, scores, classes.long(), valid


def candidate_count(pred: torch.Tensor, settings: NmsSettings) -> int:
    """K = min(topk, C·A)."""
    return min(settings.topk, (pred.shape[1] - 4) * pred.shape[2])


def ranking_keys(scores: torch.Tensor, index: torch.Tensor, threshold: float,
                 eligible: torch.Tensor | None = None) -> torch.Tensor:
    """int64 keys ordered as the candidates are: score (0 under the threshold or where not
    `eligible`; scores over it are positive, and positive floats order as their bits), then lower
    index first. All distinct."""
    over = scores > threshold if eligible is None else (scores > threshold) & eligible
    bits = torch.where(over, scores.float(), 0.0).view(torch.int32).long()
    return (bits << INDEX_BITS) | (INDEX_MASK - index)


def candidate_anchors(scores: torch.Tensor, threshold: float, count: int) -> tuple:
    """(keys, anchors) [B, count] of the `count` largest anchor keys, an anchor's key being its best
    pair's key (best score, its first class). An anchor holding one of the K largest pair keys
    has a key at least the K-th pair key, and at most K anchors do (each holds its own pair at
    least as large), so the K anchors taken hold all K pairs."""
    best, first_class = scores.max(dim=1)  # the first class among equal best scores
    anchors = scores.shape[2]
    index = first_class * anchors + torch.arange(anchors, device=scores.device)
    return tuple(ranking_keys(best, index, threshold).topk(count, dim=1, sorted=False))


def candidate_pair_keys(scores: torch.Tensor, anchor: torch.Tensor, threshold: float,
                        anchor_over: torch.Tensor) -> torch.Tensor:
    """[B, C · count] the keys of every (class, anchor) pair of the anchors taken; the pairs of an
    anchor not over the threshold (`anchor_over` false: none of its pairs is, or one is NaN) score 0."""
    batch, classes, _ = scores.shape
    gathered = scores.gather(2, anchor[:, None, :].expand(batch, classes, anchor.shape[1]))
    index = torch.arange(classes, device=scores.device)[None, :, None] * scores.shape[2] + anchor[:, None, :]
    return ranking_keys(gathered, index, threshold, anchor_over[:, None, :]).reshape(batch, -1)


def threshold_in(conf: float, dtype: torch.dtype) -> float:
    """The largest `dtype` value not above float32(conf): for x of that dtype, x > it exactly when
    float32(x) > float32(conf), as the float32 decode tests it."""
    limit = torch.tensor(conf, dtype=torch.float32)
    if dtype == torch.float32:
        return float(limit)
    value = limit.to(dtype)
    if value.float() > limit:  # rounded up: one step down, through the bits (sign-magnitude)
        bits = value.reshape(1).view(torch.int16)
        value = (bits - 1 if float(value) > 0 else bits + 1).view(dtype)[0]
    return float(value)


# ---- the torch tactic ------------------------------------------------------------------------
def overlaps(boxes: torch.Tensor, groups: torch.Tensor, iou: float) -> torch.Tensor:
    """[B, K, K] bool: box j comes after box i, is of its group, and IoU(i, j) > iou, computed as
    torchvision's CPU kernel computes it (float32, step by step, the threshold compared in float64)."""
    x1, y1, x2, y2 = boxes.unbind(2)
    areas = (x2 - x1) * (y2 - y1)
    width = (torch.minimum(x2[:, :, None], x2[:, None, :]) - torch.maximum(x1[:, :, None], x1[:, None, :])).clamp(min=0)
    height = (torch.minimum(y2[:, :, None], y2[:, None, :]) - torch.maximum(y1[:, :, None], y1[:, None, :])).clamp(min=0)
    inter = width * height
    ratio = inter / (areas[:, :, None] + areas[:, None, :] - inter)
    k = boxes.shape[1]
    later = torch.ones((k, k), dtype=torch.bool, device=boxes.device).triu(1)
    return (ratio > float32_threshold(iou)) & (groups[:, :, None] == groups[:, None, :]) & later


def greedy_keep(boxes: torch.Tensor, groups: torch.Tensor, valid: torch.Tensor, iou: float) -> torch.Tensor:
    """[B, K] bool: the boxes greedy NMS keeps. On CUDA every step runs (no host read, so it can be
    captured); on the CPU only up to the last valid candidate."""
    total = steps = boxes.shape[1]
    if not boxes.is_cuda:
        steps = int(valid.sum(1).max()) if valid.numel() else 0
        boxes, groups, valid = boxes[:, :steps], groups[:, :steps], valid[:, :steps]
    over = overlaps(boxes, groups, iou)
    removed = ~valid
    for i in range(steps):
        removed = removed | (over[:, i, :] & ~removed[:, i:i + 1])
    return torch.nn.functional.pad(~removed, (0, total - steps), value=False)


def compact(keep: torch.Tensor, boxes: torch.Tensor, scores: torch.Tensor, classes: torch.Tensor,
            max_det: int) -> tuple:
    """The kept candidates in order, the first `max_det` of each image, zero past its count."""
    batch = keep.shape[0]
    rank = keep.cumsum(1) - 1
    slot = torch.where(keep & (rank < max_det), rank, torch.full_like(rank, max_det))  # max_det: dropped
    out_boxes = boxes.new_zeros((batch, max_det + 1, 4)).scatter_(1, slot[:, :, None].expand(-1, -1, 4), boxes)
    out_scores = scores.new_zeros((batch, max_det + 1)).scatter_(1, slot, scores)
    out_classes = classes.new_zeros((batch, max_det + 1)).scatter_(1, slot, classes)
    count = keep.sum(1).clamp(max=max_det).to(torch.int32)
    return count, out_boxes[:, :max_det], out_scores[:, :max_det], out_classes[:, :max_det].int()


def batched_nms_reference(pred: torch.Tensor, settings: NmsSettings, two_level: bool = False) -> tuple:
    boxes, scores, classes, valid = nms_candidates(pred, settings, two_level)
    groups = torch.zeros_like(classes) if settings.agnostic else classes
    keep = greedy_keep(boxes, groups, valid, settings.iou)
    return compact(keep, boxes, scores, classes, settings.max_det)


def batched_nms_tactics(inputs, attrs, effort: int = 2) -> list[str]:
    pred = inputs[0]
    k = min(attrs.get("topk", NmsSettings.topk), max(1, (pred.shape[1] - 4) * pred.shape[2]))
    if pred.is_cuda and greedy_nms_supported(torch.empty((1, k, 4), device="meta")):
        fused = [FUSED_TRITON] if select_candidates_supported(pred, k) else []
        return [REFERENCE, TRITON, TWO_LEVEL, TWO_LEVEL_TRITON, *fused]
    return [REFERENCE, TWO_LEVEL]


def batched_nms_into(inputs, attrs, outs):
    """The NMS run with `outs` (the context's shared output buffers, whatever they held: the kernel
    writes every slot) given to the greedy kernel, which writes the four outputs there where the
    tactic ends in it; None where the buffers are not the outputs as the kernel writes them."""
    if not nms_outputs_fit(outs, inputs[0].shape[0], settings_of(attrs).max_det):
        return None
    return batched_nms_op(inputs, attrs, out=tuple(outs))


@OPS.internal("BatchedNms", tactics=batched_nms_tactics, write_outputs=batched_nms_into)
def batched_nms_op(inputs, attrs, out: tuple | None = None):
    """`out`: the greedy kernel's outputs (greedy_nms), where the tactic ends in it."""
    settings = settings_of(attrs)
    tactic = attrs.get("tactic")
    two_level = tactic in TWO_LEVEL_TACTICS
    pred = inputs[0]
    if tactic == FUSED_TRITON:
        k = candidate_count(pred, settings)
        if select_candidates_supported(pred, k):
            boxes, scores, classes, count = select_candidates(pred, threshold_in(settings.conf, pred.dtype), k)
            groups = torch.zeros_like(classes) if settings.agnostic else classes
            return greedy_nms(boxes, scores, groups, classes, count, settings.iou, settings.max_det, out)
        two_level = True  # the same candidates by torch where the kernels cannot take the head
    if tactic in (TRITON, TWO_LEVEL_TRITON):
        boxes, scores, classes, valid = nms_candidates(inputs[0], settings, two_level)
        if greedy_nms_supported(boxes):
            groups = torch.zeros_like(classes) if settings.agnostic else classes
            return greedy_nms(boxes, scores, groups, classes, valid.sum(1), settings.iou, settings.max_det, out)
    return batched_nms_reference(inputs[0], settings, two_level)
