"""Detections, and the raw YOLOv8/YOLO11 head decoded on the engine's device: every (anchor, class)
pair over the confidence threshold is a candidate (multi-label, as Ultralytics' validator decodes),
then class-aware NMS (`torchvision.ops.batched_nms`), the `max_det` best, and the boxes mapped back
to original-image pixels. Only the kept boxes cross to the host. `sartor.validate.decoders.decode_yolo`
is the same decode on the host."""
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
    def empty(cls) -> "Detections":
        return cls(np.zeros((0, 4), np.float32), np.zeros(0, np.float32), np.zeros(0, np.int64))

    def above(self, threshold: float) -> "Detections":
        keep = self.scores >= threshold
        return Detections(self.boxes[keep], self.scores[keep], self.classes[keep])


def _to_original(boxes: torch.Tensor, meta: ImageMeta) -> torch.Tensor:
    """Input-pixel boxes → original pixels, clipped to the image (ImageMeta.to_original on the device)."""
    top, left = meta.pad
    sy, sx = meta.scale
    h, w = meta.orig_size
    out = torch.empty_like(boxes)
    out[:, 0::2] = ((boxes[:, 0::2] - left) / sx).clamp_(0, w)
    out[:, 1::2] = ((boxes[:, 1::2] - top) / sy).clamp_(0, h)
    return out


class YoloNms:
    """A pipeline decoder: `[B, 4+C, N]` head outputs on any device → one Detections per image."""

    def __init__(self, conf: float = 0.25, iou: float = 0.7, max_det: int = 300, agnostic: bool = False,
                 output: str | None = None) -> None:
        self.conf, self.iou, self.max_det, self.agnostic, self.output = conf, iou, max_det, agnostic, output

    def __call__(self, outputs: dict, metas: Sequence[ImageMeta]) -> list[Detections]:
        from torchvision.ops import batched_nms
        name = self.output or next((k for k, v in outputs.items() if v.dim() == 3 and v.shape[2] > v.shape[1] > 4),
                                   None)
        if name is None:
            shapes = ", ".join(f"{k} {list(v.shape)}" for k, v in outputs.items())
            raise DataError(f"YoloNms needs one output of shape [B, 4+C, N] with N > 4+C; the model gives {shapes}")
        pred = torch.as_tensor(outputs[name]).float()
        results = []
        for image, meta in zip(pred, metas):
            scores_all = image[4:]  # C × N
            anchors, classes = torch.nonzero(scores_all.T > self.conf, as_tuple=True)
            if not len(anchors):
                results.append(Detections.empty())
                continue
            scores = scores_all[classes, anchors]
            if len(scores) > MAX_CANDIDATES:
                top = torch.topk(scores, MAX_CANDIDATES).indices
                anchors, classes, scores = anchors[top], classes[top], scores[top]
            xywh = image[:4, anchors].T
            boxes = torch.cat([xywh[:, :2] - xywh[:, 2:] / 2, xywh[:, :2] + xywh[:, 2:] / 2], dim=1)
            groups = torch.zeros_like(classes) if self.agnostic else classes
            keep = batched_nms(boxes, scores, groups, self.iou)[:self.max_det]
            kept = _to_original(boxes[keep], meta) if meta is not None else boxes[keep]
            results.append(Detections(kept.cpu().numpy(), scores[keep].cpu().numpy(), classes[keep].cpu().numpy()))
        return results
