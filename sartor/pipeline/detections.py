"""Detections, and the raw YOLOv8/YOLO11 head decoded on the engine's device: every (anchor, class)
pair over the confidence threshold is a candidate (multi-label, as Ultralytics' validator decodes),
then class-aware NMS (`torchvision.ops.batched_nms`), the `max_det` best, and the boxes mapped back
to original-image pixels. Only the kept boxes cross to the host. `sartor.validate.decoders.decode_yolo`
is the same decode on the host. `EngineNms` reads the outputs of an engine that ran this NMS itself
(`sartor build --nms`, ops/nms.py)."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ..data.preprocess import ImageMeta
from ..errors import DataError

MAX_CANDIDATES = 30000  # per image, before NMS (Ultralytics' max_nms)


@dataclass
class Detections:
    """One image's detections: boxes N×4 (x1, y1, x2, y2, original-image pixels), scores N, classes N."""
    boxes: np.ndarray
    scores: np.ndarray
    classes: np.ndarray

    def __post_init__(self) -> None:
        self.boxes = np.asarray(self.boxes, dtype=np.float32).reshape(-1, 4)
        self.scores = np.asarray(self.scores, dtype=np.float32).reshape(-1)
        self.classes = np.asarray(self.classes).reshape(-1).astype(np.int64)
        if not (len(self.boxes) == len(self.scores) == len(self.classes)):
            raise DataError(f"detections have {len(self.boxes)} boxes, {len(self.scores)} scores and "
                            f"{len(self.classes)} classes: the three must have the same length")

    def __len__(self) -> int:
        return len(self.scores)

    @classmethod
    def per_image(cls, boxes: np.ndarray, scores: np.ndarray, classes: np.ndarray, counts: Sequence[int]) -> list:
        """One Detections per image from batch arrays (boxes [B, K, 4], scores and classes [B, K]),
        image b's first counts[b]: converted once for the batch, each image a view of it."""
        boxes = np.asarray(boxes, dtype=np.float32)
        scores = np.asarray(scores, dtype=np.float32)
        classes = np.asarray(classes).astype(np.int64)
        if boxes.shape[:2] != scores.shape or scores.shape != classes.shape or boxes.shape[2:] != (4,) \
                or len(scores) != len(counts) or max(counts, default=0) > scores.shape[1]:
            raise DataError(f"batch detections of boxes {boxes.shape}, scores {scores.shape}, classes "
                            f"{classes.shape} do not hold counts {list(counts)}")
        made = []
        for b, n in enumerate(counts):
            one = object.__new__(cls)  # the arrays are already what __post_init__ would make of them
            one.boxes, one.scores, one.classes = boxes[b, :n], scores[b, :n], classes[b, :n]
            made.append(one)
        return made

    @classmethod
    def empty(cls) -> "Detections":
        return cls(np.zeros((0, 4), np.float32), np.zeros(0, np.float32), np.zeros(0, np.int64))

    def above(self, threshold: float) -> "Detections":
        keep = self.scores >= threshold
        return Detections(self.boxes[keep], self.scores[keep], self.classes[keep])


def _shape(value) -> tuple:
    """A tensor's or an array's shape, or a shape given as a tuple/list of ints."""
    if isinstance(value, (tuple, list)) and all(isinstance(d, (int, np.integer)) for d in value):
        return tuple(int(d) for d in value)
    return tuple(value.shape) if hasattr(value, "shape") else tuple(np.shape(value))


def yolo_output(outputs: dict) -> str | None:
    """The first output shaped [B, 4+C, N] with N > 4+C (values: arrays, tensors or shapes)."""
    for name, value in outputs.items():
        shape = _shape(value)
        if len(shape) == 3 and shape[1] > 4 and shape[2] > shape[1]:
            return name
    return None


def to_original(boxes: torch.Tensor, image: torch.Tensor, metas: Sequence[ImageMeta]) -> torch.Tensor:
    """Input-pixel boxes [N, 4] of images `image` [N] → original-image pixels (the letterbox undone,
    clamped to the image), on the boxes' device (float32 numpy arrays in, numpy out); as they are
    when any meta is None."""
    if not len(boxes) or any(m is None for m in metas):
        return boxes
    rows = [[m.pad[1], m.pad[0], m.scale[1], m.scale[0], m.orig_size[1], m.orig_size[0]] for m in metas]
    if isinstance(boxes, np.ndarray):  # host outputs: the same float32 steps in numpy, without torch's per-op cost
        left, top, sx, sy, w, h = np.asarray(rows, dtype=np.float32)[image].T
        return np.stack([np.minimum(np.maximum((boxes[:, 0] - left) / sx, 0), w),
                         np.minimum(np.maximum((boxes[:, 1] - top) / sy, 0), h),
                         np.minimum(np.maximum((boxes[:, 2] - left) / sx, 0), w),
                         np.minimum(np.maximum((boxes[:, 3] - top) / sy, 0), h)], axis=1)
    geometry = torch.tensor(rows, dtype=torch.float32, device=boxes.device)[image]
    left, top, sx, sy, w, h = geometry.unbind(1)
    return torch.stack([((boxes[:, 0] - left) / sx).clamp(min=0).minimum(w),
                        ((boxes[:, 1] - top) / sy).clamp(min=0).minimum(h),
                        ((boxes[:, 2] - left) / sx).clamp(min=0).minimum(w),
                        ((boxes[:, 3] - top) / sy).clamp(min=0).minimum(h)], dim=1)


class EngineNms:
    """A pipeline decoder for engines built with `--nms`, whose NMS ran inside the engine: its four
    fixed-size outputs (count, boxes, scores, classes; on any device) → one Detections per image.
    The counts come to the host first, then only the slots up to the largest count, mapped back to
    original-image pixels on the device. `record` is the engine's `nms` header record."""

    def __init__(self, record: dict) -> None:
        self.record = record
        self.count, self.boxes, self.scores, self.classes = record["outputs"]

    def __call__(self, outputs: dict, metas: Sequence[ImageMeta]) -> list[Detections]:
        missing = [n for n in (self.count, self.boxes, self.scores, self.classes) if n not in outputs]
        if missing:
            raise DataError(f"the engine's NMS outputs {', '.join(missing)} are missing from its outputs "
                            f"({', '.join(outputs)})")
        counts = torch.as_tensor(outputs[self.count]).reshape(-1)
        if len(counts) != len(metas):
            raise DataError(f"the engine's NMS output has batch {len(counts)} but {len(metas)} images were given")
        on_device = counts.device.type != "cpu"
        counts = counts.cpu().tolist()
        top = max(counts, default=0)
        if not on_device:  # already in host memory (the pipeline copies them there): numpy from here on
            boxes = np.asarray(outputs[self.boxes])[:, :top].astype(np.float32, copy=False)
            image = np.repeat(np.arange(len(counts)), top)
            host_boxes = to_original(boxes.reshape(-1, 4), image, metas).reshape(len(counts), top, 4)
            host_scores = np.asarray(outputs[self.scores])[:, :top]
            host_classes = np.asarray(outputs[self.classes])[:, :top]
            return Detections.per_image(host_boxes, host_scores, host_classes, counts)
        boxes = torch.as_tensor(outputs[self.boxes])[:, :top]
        image = torch.arange(len(counts), device=boxes.device).repeat_interleave(top)
        mapped = to_original(boxes.reshape(-1, 4).float(), image, metas).reshape(len(counts), top, 4)
        host_boxes = mapped.cpu().numpy()
        host_scores = torch.as_tensor(outputs[self.scores])[:, :top].cpu().numpy()
        host_classes = torch.as_tensor(outputs[self.classes])[:, :top].cpu().numpy()
        return Detections.per_image(host_boxes, host_scores, host_classes, counts)


class YoloNms:
    """A pipeline decoder: `[B, 4+C, N]` head outputs on any device → one Detections per image.

    The whole batch is decoded at once: candidates of every image found by one `nonzero`, one
    class-aware NMS over all of them with the image as part of each box's group (boxes of two
    images or two classes never suppress each other), and one copy of the kept boxes to the host."""

    def __init__(self, conf: float = 0.25, iou: float = 0.7, max_det: int = 300, agnostic: bool = False,
                 output: str | None = None) -> None:
        self.conf, self.iou, self.max_det, self.agnostic, self.output = conf, iou, max_det, agnostic, output

    def _head(self, outputs: dict) -> torch.Tensor:
        name = self.output or yolo_output(outputs)
        if name is None:
            shapes = ", ".join(f"{k} {list(v.shape)}" for k, v in outputs.items())
            raise DataError(f"YoloNms needs one output of shape [B, 4+C, N] with N > 4+C; the model gives {shapes}")
        return torch.as_tensor(outputs[name]).float()

    def __call__(self, outputs: dict, metas: Sequence[ImageMeta]) -> list[Detections]:
        from torchvision.ops import nms
        pred = self._head(outputs)
        batch, classes = pred.shape[0], pred.shape[1] - 4
        if len(metas) != batch:
            raise DataError(f"YoloNms: the output has batch {batch} but {len(metas)} images were given")
        scores_all = pred[:, 4:]  # B × C × N
        image, cls, anchor = torch.nonzero(scores_all > self.conf, as_tuple=True)
        scores = scores_all[image, cls, anchor]
        per_image = torch.bincount(image, minlength=batch)
        if len(scores) > MAX_CANDIDATES and int(per_image.max()) > MAX_CANDIDATES:
            keep = torch.cat([torch.nonzero(image == b).flatten()[
                torch.topk(scores[image == b], min(MAX_CANDIDATES, int(per_image[b]))).indices]
                for b in range(batch)])
            image, cls, anchor, scores = image[keep], cls[keep], anchor[keep], scores[keep]
        xywh = pred[image, :4, anchor]
        boxes = torch.cat([xywh[:, :2] - xywh[:, 2:] / 2, xywh[:, :2] + xywh[:, 2:] / 2], dim=1)
        # One NMS over every image and class: each group's boxes are moved apart by more than any
        # box spans, in float64 so that the shifted coordinates keep float32's precision.
        group = image if self.agnostic else image * classes + cls
        span = float(boxes.abs().max()) * 2 + 1 if len(boxes) else 1.0
        shifted = boxes.double() + (group.double() * span)[:, None]
        keep = nms(shifted, scores.double(), self.iou)  # by decreasing score
        keep = keep[torch.argsort(image[keep], stable=True)]  # by image, by score within each
        kept_image = image[keep]
        counts = torch.bincount(kept_image, minlength=batch)
        rank = torch.arange(len(keep), device=keep.device) - (torch.cumsum(counts, 0) - counts)[kept_image]
        keep = keep[rank < self.max_det]
        kept_image, kept = image[keep], boxes[keep]
        kept = to_original(kept, kept_image, metas)
        counts = torch.bincount(kept_image, minlength=batch).tolist()
        host_boxes, host_scores, host_classes = (t.cpu().numpy() for t in (kept, scores[keep], cls[keep]))
        results, start = [], 0
        for n in counts:
            results.append(Detections(host_boxes[start:start + n], host_scores[start:start + n],
                                      host_classes[start:start + n]))
            start += n
        return results
