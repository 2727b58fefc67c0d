"""The `ultralytics` AP method: the mAP50 and mAP50-95 that `yolo val` prints, in numpy.

Ultralytics 8.4's DetectionValidator, step for step, so that the same detections give the same figure:

- matching, per image (`match_predictions`): detections in descending confidence each claim, at
  every IoU threshold 0.50:0.05:0.95, the unclaimed label of their class with the highest IoU
  (IoU in float32 with Ultralytics' 1e-7 in the denominator; a tie goes to the first label);
- AP per class (`ap_per_class`, `compute_ap`): every image's detections sorted by confidence,
  cumulative true and false positives, recall over the class's labels, the precision envelope with
  Ultralytics' end points (precision 0 past the last recall reached), integrated by the trapezoid
  rule over 101 recall points;
- mAP: the mean over the classes that have labels (a class with labels and no detection scores 0,
  detections of a class without labels count nowhere); mAP@[.5:.95] also averages the thresholds.

Where it differs from the `coco` method: boxes as NMS left them, not clipped to the image (Ultralytics
matches in the network's input, before scale_boxes clips them; `validate` decodes them unclipped for
this method), no cap of 100 detections an image (all that decoding kept, up to --max-det), no area
ranges, no crowd regions (Ultralytics' COCO converter drops iscrowd annotations, so a detection on
one is a false positive here), greedy matching in confidence order, and the trapezoid over an
interpolated envelope rather than COCO's step lookup at 101 recall points.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from ...errors import DataError
from ..decoders import Detections
from ..metrics import DetectionMetrics

# float32, as Ultralytics' torch.linspace(0.5, 0.95, 10): an IoU is compared with the same values
IOU_THRESHOLDS = np.linspace(0.5, 0.95, 10, dtype=np.float32)
RECALL_POINTS = np.linspace(0, 1, 101)
IOU_EPS = 1e-7  # box_iou's
RECALL_EPS = 1e-16  # ap_per_class's
_trapezoid = getattr(np, "trapezoid", None) or np.trapz  # np.trapz is deprecated from numpy 2.0


def box_iou(labels: np.ndarray, detections: np.ndarray) -> np.ndarray:
    """IoU [L, D] of x1 y1 x2 y2 boxes, in float32 and in the order of operations of Ultralytics'
    box_iou, so that an IoU at a threshold falls on the same side."""
    a = np.asarray(labels, dtype=np.float32).reshape(-1, 4)[:, None, :]
    b = np.asarray(detections, dtype=np.float32).reshape(-1, 4)[None, :, :]
    wh = np.clip(np.minimum(a[..., 2:], b[..., 2:]) - np.maximum(a[..., :2], b[..., :2]), 0, None)
    wh1, wh2 = a[..., 2:] - a[..., :2], b[..., 2:] - b[..., :2]
    inter = wh[..., 0] * wh[..., 1]
    return inter / (wh1[..., 0] * wh1[..., 1] + wh2[..., 0] * wh2[..., 1] - inter + np.float32(IOU_EPS))


def match_detections(label_classes: np.ndarray, label_boxes: np.ndarray, det_classes: np.ndarray,
                     det_boxes: np.ndarray) -> np.ndarray:
    """Correct [D, 10] of one image's detections, given in descending confidence: at each threshold
    a detection takes the best label of its class that no earlier detection took."""
    correct = np.zeros((len(det_classes), len(IOU_THRESHOLDS)), dtype=bool)
    if not len(label_classes) or not len(det_classes):
        return correct
    iou = box_iou(label_boxes, det_boxes) * (label_classes[:, None] == det_classes[None, :])
    claimed = np.zeros((len(label_classes), len(IOU_THRESHOLDS)), dtype=bool)
    columns = np.arange(len(IOU_THRESHOLDS))
    for j in np.flatnonzero((iou >= IOU_THRESHOLDS.min()).any(0)):
        available = np.where(claimed, 0, iou[:, j, None])
        best = available.argmax(0)
        correct[j] = available[best, columns] >= IOU_THRESHOLDS
        claimed[best, columns] |= correct[j]
    return correct


def interpolated_ap(recall: np.ndarray, precision: np.ndarray) -> float:
    """Ultralytics' compute_ap ("interp"): the envelope of precision over recall, with (0, 1) in
    front and precision dropping to 0 at the last recall, integrated over 101 recall points."""
    mrec = np.concatenate(([0.0], recall, [recall[-1] if len(recall) else 1.0], [1.0]))
    mpre = np.concatenate(([1.0], precision, [0.0], [0.0]))
    mpre = np.flip(np.maximum.accumulate(np.flip(mpre)))
    return float(_trapezoid(np.interp(RECALL_POINTS, mrec, mpre), RECALL_POINTS))


def ap_per_class(tp: np.ndarray, conf: np.ndarray, pred_cls: np.ndarray, target_cls: np.ndarray) -> tuple:
    """(classes with labels, their label counts, AP [classes, 10]) from the concatenated per-image
    statistics, as Ultralytics' ap_per_class computes `ap`."""
    order = np.argsort(-conf)  # numpy's default sort, as Ultralytics': tied scores end up in its order
    tp, pred_cls = tp[order], pred_cls[order]
    classes, counts = np.unique(target_cls, return_counts=True)
    ap = np.zeros((len(classes), tp.shape[1]))
    for ci, (cls, labels) in enumerate(zip(classes, counts)):
        hits = tp[pred_cls == cls]
        if not len(hits):
            continue
        tpc, fpc = hits.cumsum(0), (1 - hits).cumsum(0)
        recall = tpc / (labels + RECALL_EPS)
        precision = tpc / (tpc + fpc)
        for j in range(tp.shape[1]):
            ap[ci, j] = interpolated_ap(recall[:, j], precision[:, j])
    return classes, counts, ap


def image_statistics(gt, det: Detections) -> dict:
    """One image's entry of Ultralytics' stats: tp, conf, pred_cls, target_cls. Detections are
    matched in descending confidence, the order Ultralytics' NMS hands them over in."""
    label_classes = np.asarray(gt.classes).reshape(-1).astype(np.float32)
    order = np.argsort(-np.asarray(det.scores), kind="stable")
    det_classes = np.asarray(det.classes).reshape(-1)[order].astype(np.float32)
    tp = match_detections(label_classes, np.asarray(gt.boxes).reshape(-1, 4), det_classes,
                          np.asarray(det.boxes).reshape(-1, 4)[order])
    if not len(order):  # Ultralytics' empty arrays are float64, which makes the concatenation float64
        return {"tp": tp, "conf": np.zeros(0), "pred_cls": np.zeros(0), "target_cls": label_classes}
    return {"tp": tp, "conf": np.asarray(det.scores, dtype=np.float32)[order], "pred_cls": det_classes,
            "target_cls": label_classes}


def ultralytics_map(ground_truth: Sequence, detections: Sequence[Detections],
                    class_ids: Sequence[int] | None = None, image_sizes: Sequence | None = None) -> DetectionMetrics:
    """Ultralytics' box mAP of `detections` against `ground_truth`, one entry per image each (as
    coco_map takes them; `class_ids` and `image_sizes` change nothing here: only classes with labels
    count, and IoU needs no image size). None when there are no labels, where Ultralytics prints 0."""
    if len(ground_truth) != len(detections):
        raise DataError(f"{len(ground_truth)} ground-truth images but {len(detections)} detection sets")
    stats = [image_statistics(gt, det) for gt, det in zip(ground_truth, detections)]
    joined = {k: np.concatenate([s[k] for s in stats]) if stats else np.zeros(0) for k in
              ("conf", "pred_cls", "target_cls")}
    tp = np.concatenate([s["tp"] for s in stats]) if stats else np.zeros((0, len(IOU_THRESHOLDS)), dtype=bool)
    seen = np.concatenate([joined["pred_cls"], joined["target_cls"]])
    if len(seen) and seen.min() < 0:
        raise DataError(f"class id {int(seen.min())} is negative: classes are 0-based indices")
    metrics = DetectionMetrics(None, None, images=len(stats), instances=len(joined["target_cls"]),
                               detections=len(joined["conf"]))
    if not len(joined["target_cls"]):
        return metrics
    classes, counts, ap = ap_per_class(tp, joined["conf"], joined["pred_cls"], joined["target_cls"])
    metrics.map, metrics.map50 = float(ap.mean()), float(ap[:, 0].mean())
    metrics.per_class = {int(c): {"ap": float(row.mean()), "ap50": float(row[0]), "instances": int(n)}
                         for c, n, row in zip(classes, counts, ap)}
    return metrics
