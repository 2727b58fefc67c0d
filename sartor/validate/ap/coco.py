"""The `coco` AP method: pycocotools' COCOeval (or faster-coco-eval's), box mAP as COCO defines it.

Area range "all", each image's `max_dets` best detections (COCO's 100), crowd regions as COCOeval
ignores them, the precision at 101 recall points averaged per class, then over the classes that
have ground truth.
"""
from __future__ import annotations

import contextlib
import io
from typing import Sequence

import numpy as np

from ...errors import DataError, MissingExtraError
from ..decoders import Detections
from ..metrics import DetectionMetrics

COCO_MAX_DETS = 100  # COCO's AP is computed over each image's 100 best detections


def _coco_api():
    try:
        from pycocotools.coco import COCO
        from pycocotools.cocoeval import COCOeval
        return COCO, COCOeval
    except ImportError:
        pass
    try:
        from faster_coco_eval import COCO
        from faster_coco_eval import COCOeval_faster as COCOeval
        return COCO, COCOeval
    except ImportError:
        raise MissingExtraError("detection metrics (COCO mAP)", "build", "pycocotools",
                                "No module named 'pycocotools', nor 'faster_coco_eval'") from None


def _xywh(boxes: np.ndarray) -> np.ndarray:
    boxes = np.asarray(boxes, dtype=np.float64).reshape(-1, 4)
    return np.stack([boxes[:, 0], boxes[:, 1], boxes[:, 2] - boxes[:, 0], boxes[:, 3] - boxes[:, 1]], axis=1)


def coco_map(ground_truth: Sequence, detections: Sequence[Detections], class_ids: Sequence[int] | None = None,
             image_sizes: Sequence | None = None, max_dets: int = COCO_MAX_DETS) -> DetectionMetrics:
    """COCO box mAP of `detections` against `ground_truth`, one entry per image each.

    A ground-truth entry is anything with `.boxes` (N×4 x1 y1 x2 y2) and `.classes` (N), such as a
    dataset Sample or a Detections. `class_ids` lists the categories (default: every class seen in
    either). Per class: AP and AP50 over the classes that have ground truth.
    """
    if len(ground_truth) != len(detections):
        raise DataError(f"{len(ground_truth)} ground-truth images but {len(detections)} detection sets")
    COCO, COCOeval = _coco_api()
    images, annotations, results, crowd = [], [], [], []
    seen = set()
    for i, (gt, det) in enumerate(zip(ground_truth, detections)):
        h, w = (image_sizes[i] if image_sizes is not None else (0, 0))
        images.append({"id": i + 1, "height": int(h), "width": int(w)})
        gt_boxes = np.asarray(gt.boxes, dtype=np.float64).reshape(-1, 4)
        gt_classes = np.asarray(gt.classes).reshape(-1).astype(np.int64)
        for box, cls in zip(_xywh(gt_boxes), gt_classes):
            seen.add(int(cls))
            annotations.append({"id": len(annotations) + 1, "image_id": i + 1, "category_id": int(cls) + 1,
                                "bbox": [float(v) for v in box], "area": float(max(box[2], 0) * max(box[3], 0)),
                                "iscrowd": 0})
        crowd_boxes = getattr(gt, "crowd_boxes", None)
        if crowd_boxes is not None and len(crowd_boxes):  # COCO iscrowd regions: detections there are not FPs
            for box, cls in zip(_xywh(crowd_boxes), np.asarray(gt.crowd_classes).reshape(-1)):
                seen.add(int(cls))
                crowd.append({"id": 0, "image_id": i + 1, "category_id": int(cls) + 1,
                              "bbox": [float(v) for v in box], "area": float(max(box[2], 0) * max(box[3], 0)),
                              "iscrowd": 1})
        for box, score, cls in zip(_xywh(det.boxes), det.scores, det.classes):
            seen.add(int(cls))
            results.append({"id": len(results) + 1, "image_id": i + 1, "category_id": int(cls) + 1,
                            "bbox": [float(v) for v in box], "area": float(max(box[2], 0) * max(box[3], 0)),
                            "score": float(score), "iscrowd": 0})
    if any(c < 0 for c in seen):
        raise DataError(f"class id {min(seen)} is negative: classes are 0-based indices")
    ids = sorted(set(int(c) for c in class_ids) | seen) if class_ids is not None else sorted(seen)
    metrics = DetectionMetrics(None, None, images=len(images), instances=len(annotations), detections=len(results))
    if not annotations:
        return metrics
    categories = [{"id": c + 1, "name": str(c)} for c in ids]
    counts = np.bincount([a["category_id"] - 1 for a in annotations], minlength=max(ids) + 1 if ids else 0)
    for region in crowd:
        region["id"] = len(annotations) + 1
        annotations.append(region)
    with contextlib.redirect_stdout(io.StringIO()):
        gt_api = COCO()
        gt_api.dataset = {"images": images, "annotations": annotations, "categories": categories}
        gt_api.createIndex()
        dt_api = COCO()
        dt_api.dataset = {"images": images, "annotations": results, "categories": categories}
        dt_api.createIndex()
        evaluator = COCOeval(gt_api, dt_api, "bbox")
        evaluator.params.maxDets = [1, 10, max_dets]
        evaluator.evaluate()
        evaluator.accumulate()
    precision = np.asarray(evaluator.eval["precision"])  # T × R × K × A × M
    at_all = precision[:, :, :, 0, -1]  # every area, max_dets
    metrics.map = _mean_valid(at_all)
    metrics.map50 = _mean_valid(at_all[0])
    for k, cat in enumerate(evaluator.params.catIds):
        cls = int(cat) - 1
        if counts[cls] == 0:
            continue
        metrics.per_class[cls] = {"ap": _mean_valid(at_all[:, :, k]) or 0.0,
                                  "ap50": _mean_valid(at_all[0, :, k]) or 0.0, "instances": int(counts[cls])}
    return metrics


def _mean_valid(values: np.ndarray) -> float | None:
    """COCOeval marks categories without ground truth with -1: average the rest."""
    valid = values[values > -1]
    return float(valid.mean()) if valid.size else None
