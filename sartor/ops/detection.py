"""Detection post-processing ops: NonMaxSuppression (torchvision's kernel when installed)."""
from __future__ import annotations

import torch

from .registry import OpTable
from .util import floats, ints

OPS = OpTable("detection")


def _iou(box, boxes):
    x1 = torch.maximum(box[0], boxes[:, 0])
    y1 = torch.maximum(box[1], boxes[:, 1])
    x2 = torch.minimum(box[2], boxes[:, 2])
    y2 = torch.minimum(box[3], boxes[:, 3])
    inter = (x2 - x1).clamp(min=0) * (y2 - y1).clamp(min=0)
    area = (box[2] - box[0]) * (box[3] - box[1])
    areas = (boxes[:, 2] - boxes[:, 0]) * (boxes[:, 3] - boxes[:, 1])
    return inter / (area + areas - inter)


def _greedy_nms(boxes, scores, iou_threshold):
    order = torch.argsort(scores, descending=True, stable=True)
    keep = []
    suppressed = torch.zeros(len(order), dtype=torch.bool)
    for rank, i in enumerate(order.tolist()):
        if suppressed[rank]:
            continue
        keep.append(i)
        rest = order[rank + 1:]
        if len(rest):
            over = _iou(boxes[i], boxes[rest]) > iou_threshold
            suppressed[rank + 1:] |= over.cpu()
    return keep


@OPS.op("NonMaxSuppression", attrs={"center_point_box": 0}, host_inputs=(2, 3, 4))
def non_max_suppression(inputs, attrs):
    boxes, scores = inputs[0].float(), inputs[1].float()
    max_out = ints(inputs[2])[0] if len(inputs) > 2 and inputs[2] is not None and inputs[2].numel() else 0
    iou_thr = floats(inputs[3])[0] if len(inputs) > 3 and inputs[3] is not None and inputs[3].numel() else 0.0
    score_thr = floats(inputs[4])[0] if len(inputs) > 4 and inputs[4] is not None and inputs[4].numel() else None
    if attrs["center_point_box"]:
        cx, cy, w, h = boxes.unbind(-1)
        boxes = torch.stack([cx - w / 2, cy - h / 2, cx + w / 2, cy + h / 2], dim=-1)
    else:  # corners may come in either order
        y1, x1, y2, x2 = boxes.unbind(-1)
        boxes = torch.stack([torch.minimum(x1, x2), torch.minimum(y1, y2), torch.maximum(x1, x2),
                             torch.maximum(y1, y2)], dim=-1)
    selected = []
    for b in range(scores.shape[0]):
        for c in range(scores.shape[1]):
            s = scores[b, c]
            candidates = torch.arange(len(s), device=s.device)
            if score_thr is not None:
                candidates = candidates[s > score_thr]
            if max_out == 0 or len(candidates) == 0:
                continue
            keep = _greedy_nms(boxes[b][candidates], s[candidates], iou_thr)[:max_out]
            selected += [[b, c, int(candidates[k])] for k in keep]
    return torch.tensor(selected, dtype=torch.int64).reshape(-1, 3)
