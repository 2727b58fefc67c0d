"""Raw network outputs → per-image detections in original-image pixels.

Three decoders, chosen with `--decoder` or recognised from the output shapes:

- `yolo`: the raw YOLOv8/YOLO11 head, one output `[B, 4+C, N]` holding (cx, cy, w, h) in
  network-input pixels and C per-class scores per anchor. Decoded like Ultralytics' validator:
  every (anchor, class) pair over the confidence threshold is a candidate (multi-label),
  then class-aware NMS, then the `max_det` best.
- `boxes`: graphs that already end in boxes: `boxes [B,N,4]` (x1, y1, x2, y2 in input pixels)
  with `scores [B,N,C]`, or with `scores [B,N]` and `classes [B,N]`, optionally `num_dets [B]`/
  `[B,1]`; or a single `[B,N,6]` (x1, y1, x2, y2, score, class: end-to-end YOLO exports). Scores
  per class go through the same NMS as `yolo`; boxes that come with one class each are taken as
  already suppressed.
- `module:function`: a user function `fn(outputs: dict[str, np.ndarray], metas: list[ImageMeta])
  -> list[Detections]` (boxes in original-image pixels), imported from the current directory or
  `sys.path`.

Boxes are mapped back through each image's `ImageMeta` (undoing the letterbox scale and padding)
and clipped to the image, unless `DecodeOptions.clip` is False.
"""
from __future__ import annotations

import importlib
import os
import sys
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np

from ..errors import ConfigError, DataError
from ..pipeline.detections import MAX_CANDIDATES, Detections, yolo_output

DEFAULT_CONF = 0.001  # keep nearly everything: mAP integrates over all scores (Ultralytics val)
DEFAULT_IOU = 0.7  # Ultralytics val's NMS IoU
DEFAULT_MAX_DET = 300
DECODERS = ("yolo", "boxes")


@dataclass
class DecodeOptions:
    conf: float = DEFAULT_CONF
    iou: float = DEFAULT_IOU
    max_det: int = DEFAULT_MAX_DET
    agnostic: bool = False  # class-agnostic NMS
    clip: bool = True  # boxes clipped to the image (False: as NMS left them, which Ultralytics' AP scores)
    notes: list = field(default_factory=list)

    def check(self) -> None:
        if not 0.0 <= self.conf <= 1.0:
            raise ConfigError(f"--conf {self.conf} must be in [0, 1]")
        if not 0.0 < self.iou <= 1.0:
            raise ConfigError(f"--iou {self.iou} must be in (0, 1]")
        if self.max_det < 1:
            raise ConfigError(f"--max-det {self.max_det} must be at least 1")


# ---- NMS -----------------------------------------------------------------------------------------

def _torchvision_nms():
    try:
        from torchvision.ops import batched_nms
        return batched_nms
    except Exception:  # torchvision missing or its C++ ops not loadable
        return None


def numpy_nms(boxes: np.ndarray, scores: np.ndarray, iou: float) -> np.ndarray:
    """Greedy NMS (one class): indices kept, best score first. IoU > `iou` suppresses."""
    boxes = np.asarray(boxes, dtype=np.float64)
    order = np.argsort(-np.asarray(scores, dtype=np.float64), kind="stable")
    x1, y1, x2, y2 = boxes.T
    areas = np.clip(x2 - x1, 0, None) * np.clip(y2 - y1, 0, None)
    keep = []
    while order.size:
        i = order[0]
        keep.append(i)
        rest = order[1:]
        w = np.clip(np.minimum(x2[i], x2[rest]) - np.maximum(x1[i], x1[rest]), 0, None)
        h = np.clip(np.minimum(y2[i], y2[rest]) - np.maximum(y1[i], y1[rest]), 0, None)
        inter = w * h
        union = areas[i] + areas[rest] - inter
        overlap = np.where(union > 0, inter / np.where(union > 0, union, 1), 0.0)
        order = rest[overlap <= iou]
    return np.asarray(keep, dtype=np.int64)


def batched_nms(boxes: np.ndarray, scores: np.ndarray, classes: np.ndarray, iou: float,
                use_torchvision: bool | None = None) -> np.ndarray:
    """Class-aware NMS: boxes of different classes never suppress each other. Indices kept, by
    decreasing score. torchvision's kernel when it loads, else the numpy implementation."""
    if len(scores) == 0:
        return np.zeros(0, dtype=np.int64)
    fn = _torchvision_nms() if use_torchvision in (None, True) else None
    if use_torchvision and fn is None:
        raise ConfigError("torchvision's batched_nms is not available")
    if fn is not None:
        import torch
        keep = fn(torch.from_numpy(np.ascontiguousarray(boxes, dtype=np.float32)),
                  torch.from_numpy(np.ascontiguousarray(scores, dtype=np.float32)),
                  torch.from_numpy(np.ascontiguousarray(classes, dtype=np.int64)), float(iou))
        return keep.numpy().astype(np.int64)
    keep = []
    for c in np.unique(classes):
        idx = np.nonzero(classes == c)[0]
        keep.append(idx[numpy_nms(boxes[idx], scores[idx], iou)])
    keep = np.concatenate(keep)
    return keep[np.argsort(-scores[keep], kind="stable")]


def _nms_detections(boxes: np.ndarray, scores: np.ndarray, classes: np.ndarray, options: DecodeOptions) -> tuple:
    if len(scores) > MAX_CANDIDATES:
        top = np.argpartition(-scores, MAX_CANDIDATES - 1)[:MAX_CANDIDATES]
        boxes, scores, classes = boxes[top], scores[top], classes[top]
    groups = np.zeros_like(classes) if options.agnostic else classes
    keep = batched_nms(boxes, scores, groups, options.iou)[:options.max_det]
    return boxes[keep], scores[keep], classes[keep]


def _finish(boxes, scores, classes, meta, clip: bool = True) -> Detections:
    """Input-pixel boxes → original pixels through the image's letterbox geometry."""
    if meta is not None and len(boxes):
        boxes = meta.to_original(boxes, clip=clip)
    return Detections(boxes, scores, classes)


def xywh_to_xyxy(xywh: np.ndarray) -> np.ndarray:
    xywh = np.asarray(xywh, dtype=np.float32)
    out = np.empty_like(xywh)
    half_w, half_h = xywh[..., 2] / 2, xywh[..., 3] / 2
    out[..., 0] = xywh[..., 0] - half_w
    out[..., 1] = xywh[..., 1] - half_h
    out[..., 2] = xywh[..., 0] + half_w
    out[..., 3] = xywh[..., 1] + half_h
    return out


# ---- the YOLOv8/YOLO11 raw head ----------------------------------------------------------------

def decode_yolo(outputs: dict, metas: Sequence, options: DecodeOptions | None = None,
                output: str | None = None) -> list[Detections]:
    """`[B, 4+C, N]` (cx, cy, w, h, C class scores per anchor) → detections per image."""
    options = options or DecodeOptions()
    name = output or yolo_output(outputs)
    if name is None:
        shapes = ", ".join(f"{k} {list(np.shape(v))}" for k, v in outputs.items())
        raise DataError(f"decoder yolo needs one output of shape [B, 4+C, N] with N > 4+C; the model gives {shapes}")
    pred = np.asarray(outputs[name], dtype=np.float32)
    if len(pred) != len(metas):
        raise DataError(f"output {name} has batch {len(pred)} but {len(metas)} images were given")
    results = []
    for image, meta in zip(pred, metas):
        scores_all = image[4:]  # C × N
        anchors, classes = np.nonzero(scores_all.T > options.conf)  # multi-label candidates
        if not len(anchors):
            results.append(Detections.empty())
            continue
        scores = scores_all[classes, anchors]
        boxes = xywh_to_xyxy(image[:4, anchors].T)
        boxes, scores, classes = _nms_detections(boxes, scores, classes, options)
        results.append(_finish(boxes, scores, classes, meta, options.clip))
    return results


def yolo_num_classes(shape: Sequence[int]) -> int:
    return int(shape[1]) - 4


# ---- graphs that end in boxes ---------------------------------------------------------------------

@dataclass
class BoxesLayout:
    boxes: str | None = None  # [B,N,4], or [B,N,6] combined when `combined`
    scores: str | None = None  # [B,N,C] or [B,N]
    classes: str | None = None  # [B,N]
    count: str | None = None  # [B] or [B,1]
    combined: bool = False

    @property
    def per_class_scores(self) -> bool:
        return self.classes is None and not self.combined


def boxes_layout(shapes: dict, dtypes: dict | None = None) -> BoxesLayout | None:
    """Which output is which, from shapes (and dtypes/names where shapes tie)."""
    dtypes = dtypes or {}
    rank3 = {k: s for k, s in shapes.items() if len(s) == 3}
    boxes = [k for k, s in rank3.items() if s[2] == 4]
    if not boxes:
        combined = [k for k, s in rank3.items() if s[2] == 6]
        if len(shapes) == 1 and combined:
            return BoxesLayout(boxes=combined[0], combined=True)
        return None
    layout = BoxesLayout(boxes=boxes[0])
    n = shapes[layout.boxes][1]
    others = {k: s for k, s in shapes.items() if k != layout.boxes}
    per_class = [k for k, s in others.items() if len(s) == 3 and s[1] == n and s[2] != 4]
    if per_class:
        layout.scores = per_class[0]
    pairs = [k for k, s in others.items() if len(s) == 2 and s[1] == n and n != 1]
    if not layout.scores and pairs:
        def is_class(k):
            lower = k.lower()
            return "class" in lower or "label" in lower or np.dtype(dtypes.get(k, "float32")).kind in "iu"
        classes = [k for k in pairs if is_class(k)]
        scores = [k for k in pairs if k not in classes]
        if not scores or not classes:
            return None
        layout.scores, layout.classes = scores[0], classes[0]
    if layout.scores is None:
        return None
    counts = [k for k, s in others.items() if k not in (layout.scores, layout.classes)
              and (len(s) == 1 or (len(s) == 2 and s[1] == 1))]
    layout.count = counts[0] if counts else None
    return layout


def decode_boxes(outputs: dict, metas: Sequence, options: DecodeOptions | None = None,
                 layout: BoxesLayout | None = None) -> list[Detections]:
    options = options or DecodeOptions()
    layout = layout or boxes_layout({k: np.shape(v) for k, v in outputs.items()},
                                     {k: np.asarray(v).dtype for k, v in outputs.items()})
    if layout is None:
        shapes = ", ".join(f"{k} {list(np.shape(v))}" for k, v in outputs.items())
        raise DataError(f"decoder boxes needs boxes [B,N,4] with scores [B,N,C] or scores [B,N] + classes [B,N] "
                        f"(or one [B,N,6]); the model gives {shapes}")
    raw = np.asarray(outputs[layout.boxes], dtype=np.float32)
    if len(raw) != len(metas):
        raise DataError(f"output {layout.boxes} has batch {len(raw)} but {len(metas)} images were given")
    results = []
    for b, meta in enumerate(metas):
        if layout.combined:
            boxes, scores, classes = raw[b, :, :4], raw[b, :, 4], raw[b, :, 5].round().astype(np.int64)
        else:
            boxes = raw[b]
            scores = np.asarray(outputs[layout.scores][b], dtype=np.float32)
            classes = None
            if layout.classes is not None:
                classes = np.asarray(outputs[layout.classes][b]).round().astype(np.int64)
        if layout.count is not None:
            n = int(np.asarray(outputs[layout.count][b]).reshape(-1)[0])
            boxes, scores = boxes[:n], scores[:n]
            classes = None if classes is None else classes[:n]
        if classes is None:  # per-class scores: same candidates and NMS as the raw YOLO head
            anchors, classes = np.nonzero(scores > options.conf)
            boxes, scores = boxes[anchors], scores[anchors, classes]
            boxes, scores, classes = _nms_detections(boxes, scores, classes, options)
        else:  # one class per box: the graph has already suppressed duplicates
            keep = np.nonzero(scores > options.conf)[0]
            keep = keep[np.argsort(-scores[keep], kind="stable")][:options.max_det]
            boxes, scores, classes = boxes[keep], scores[keep], classes[keep]
        results.append(_finish(boxes, scores, classes, meta, options.clip))
    return results


# ---- user decoders ---------------------------------------------------------------------------------

def load_user_decoder(spec: str) -> Callable:
    """`package.module:function` → the function; the current directory is searched first."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ConfigError(f"--decoder {spec!r} must be yolo, boxes or module:function")
    cwd = os.getcwd()
    added = cwd not in sys.path
    if added:
        sys.path.insert(0, cwd)
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(f"--decoder {spec}: cannot import module {module_name!r} ({exc})") from None
    except Exception as exc:
        raise ConfigError(f"--decoder {spec}: importing {module_name!r} failed: {type(exc).__name__}: {exc}") from None
    finally:
        if added and cwd in sys.path:
            sys.path.remove(cwd)
    fn = module
    for part in attr.split("."):
        fn = getattr(fn, part, None)
        if fn is None:
            raise ConfigError(f"--decoder {spec}: module {module_name!r} has no {attr!r}")
    if not callable(fn):
        raise ConfigError(f"--decoder {spec}: {attr!r} is not callable")
    return fn


def _coerce_detections(value, where: str) -> Detections:
    if isinstance(value, Detections):
        return value
    if isinstance(value, dict):
        try:
            return Detections(value["boxes"], value["scores"], value["classes"])
        except KeyError as exc:
            raise DataError(f"{where}: a detections dict needs boxes, scores and classes (missing {exc})") from None
    if isinstance(value, (tuple, list)) and len(value) == 3:
        return Detections(*value)
    raise DataError(f"{where}: returned {type(value).__name__}, not Detections (or a boxes/scores/classes triple)")


# ---- choosing a decoder ---------------------------------------------------------------------------

class Decoder:
    """A chosen decoder: `decoder(outputs, metas) -> list[Detections]`, with `name` and `num_classes`
    (None when the outputs do not say)."""

    def __init__(self, name: str, fn: Callable, num_classes: int | None, options: DecodeOptions) -> None:
        self.name, self._fn, self.num_classes, self.options = name, fn, num_classes, options

    def __call__(self, outputs: dict, metas: Sequence) -> list[Detections]:
        result = self._fn(outputs, list(metas))
        if self.name in DECODERS:
            return result
        where = f"decoder {self.name}"
        if not isinstance(result, (list, tuple)):
            raise DataError(f"{where} returned {type(result).__name__}, not a list with one Detections per image")
        if len(result) != len(metas):
            raise DataError(f"{where} returned {len(result)} detection sets for {len(metas)} images")
        return [_coerce_detections(r, where) for r in result]

    def __repr__(self) -> str:
        return f"Decoder({self.name!r}, num_classes={self.num_classes})"


def detect_decoder(shapes: dict, dtypes: dict | None = None) -> str | None:
    """`yolo`, `boxes`, or None when the output shapes fit neither."""
    shapes = {k: tuple(s) for k, s in shapes.items()}
    if boxes_layout(shapes, dtypes) is not None:
        return "boxes"
    if yolo_output(shapes) is not None:
        return "yolo"
    return None


def make_decoder(spec: str | None, shapes: dict, dtypes: dict | None = None,
                 options: DecodeOptions | None = None) -> Decoder:
    """The decoder named by `spec` (yolo | boxes | module:function), or the one the output shapes
    (name -> shape, from one real batch) call for when `spec` is None."""
    options = options or DecodeOptions()
    options.check()
    shapes = {k: tuple(int(d) for d in s) for k, s in shapes.items()}
    listing = ", ".join(f"{k} {list(s)}" for k, s in shapes.items())
    name = spec
    if name is None:
        name = detect_decoder(shapes, dtypes)
        if name is None:
            raise DataError(f"cannot tell how to decode detections from the outputs {listing}: give --decoder "
                            f"yolo, boxes or module:function")
    if name == "yolo":
        out = yolo_output(shapes)
        if out is None:
            raise DataError(f"decoder yolo needs one output [B, 4+C, N] with N > 4+C; the model gives {listing}")
        return Decoder("yolo", lambda o, m: decode_yolo(o, m, options, out), yolo_num_classes(shapes[out]), options)
    if name == "boxes":
        layout = boxes_layout(shapes, dtypes)
        if layout is None:
            raise DataError(f"decoder boxes needs boxes [B,N,4] with scores [B,N,C] or scores [B,N] + classes "
                            f"[B,N] (or one [B,N,6]); the model gives {listing}")
        classes = shapes[layout.scores][2] if layout.per_class_scores else None
        return Decoder("boxes", lambda o, m: decode_boxes(o, m, options, layout), classes, options)
    return Decoder(name, load_user_decoder(name), None, options)
