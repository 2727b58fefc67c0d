"""Random YOLO heads and the torchvision comparison shared by the BatchedNms op's tests and the
greedy NMS kernel's. Not a test module (no test_ prefix)."""
from __future__ import annotations

import torch
from torchvision.ops import batched_nms

from sartor.ops.nms import NO_SCORE, NmsSettings, threshold_in


def grid_head(seed: int, batch: int, classes: int, anchors: int, levels: int = 20, size: int = 64) -> torch.Tensor:
    """[B, 4+C, A]: boxes on a quarter-pixel grid clustered in a small image (many overlaps; the
    coordinate trick's offsets stay exact), scores on `levels` steps (many ties)."""
    g = torch.Generator().manual_seed(seed)
    centres = torch.randint(0, size * 4, (batch, 2, anchors), generator=g).float() / 4
    sizes = torch.randint(8, size * 2, (batch, 2, anchors), generator=g).float() / 4
    scores = torch.randint(0, levels, (batch, classes, anchors), generator=g).float() / levels
    return torch.cat([centres, sizes, scores], 1)


def torchvision_kept(pred: torch.Tensor, settings: NmsSettings) -> list[tuple]:
    """Per image: (boxes, scores, classes) torchvision keeps from the host decoder's candidates
    (every (class, anchor) over conf, in class then anchor order), the first max_det."""
    kept = []
    for image in pred:
        classes, anchors = torch.nonzero(image[4:] > settings.conf, as_tuple=True)
        scores = image[4:][classes, anchors]
        xywh = image[:4, anchors].T
        boxes = torch.cat([xywh[:, :2] - xywh[:, 2:] / 2, xywh[:, :2] + xywh[:, 2:] / 2], 1)
        groups = torch.zeros_like(classes) if settings.agnostic else classes
        keep = batched_nms(boxes, scores, groups, settings.iou)[:settings.max_det]
        kept.append((boxes[keep], scores[keep], classes[keep]))
    return kept


def assert_equal_to_torchvision(pred: torch.Tensor, settings: NmsSettings, outputs: tuple) -> int:
    count, boxes, scores, classes = outputs
    assert count.dtype == classes.dtype == torch.int32
    assert boxes.shape == (len(pred), settings.max_det, 4) and scores.shape == classes.shape == (len(pred), settings.max_det)
    total = 0
    for b, (e_boxes, e_scores, e_classes) in enumerate(torchvision_kept(pred, settings)):
        n = int(count[b])
        assert n == len(e_scores)
        assert torch.equal(boxes[b, :n], e_boxes)
        assert torch.equal(scores[b, :n], e_scores)
        assert torch.equal(classes[b, :n].long(), e_classes)
        assert not boxes[b, n:].any() and not scores[b, n:].any() and not classes[b, n:].any()
        total += n
    return total


def sorted_candidates(pred: torch.Tensor, settings: NmsSettings) -> tuple:
    """(scores, classes, anchors, valid) [B, K] the first K pairs of a full stable sort of every
    masked score: the two-level stage's exact answer, ties at the K-th place included."""
    batch, channels, anchors = pred.shape
    scores = pred[:, 4:, :].reshape(batch, (channels - 4) * anchors)
    masked = torch.where(scores > threshold_in(settings.conf, scores.dtype), scores, NO_SCORE).float()
    k = min(settings.topk, scores.shape[1])
    top, index = masked.sort(dim=1, descending=True, stable=True)
    top, index = top[:, :k], index[:, :k]
    return top, index // anchors, index % anchors, top > settings.conf
