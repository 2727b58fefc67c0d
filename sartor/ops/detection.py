"""Detection ops: NonMaxSuppression (torchvision's kernel when installed) and RoiAlign."""
from __future__ import annotations

import math

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


@OPS.op("NonMaxSuppression", attrs={"center_point_box": 0}, host_inputs=(2, 3, 4), data_dependent_shape=True)
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


def _roi_align_check(attrs: dict, dtypes: list):
    if attrs["mode"] not in ("avg", "max"):
        return f"mode {attrs['mode']} not supported"
    if attrs["coordinate_transformation_mode"] not in ("half_pixel", "output_half_pixel"):
        return f"coordinate_transformation_mode {attrs['coordinate_transformation_mode']} not supported"
    return None


def _roi_axis(start, bin_size, pooled, grid, size, device):
    """Sample positions along one axis of a ROI: clamped low/high taps and their weights (zero weight
    for samples beyond the feature map), flattened over (bin, sample)."""
    bins = torch.arange(pooled, dtype=torch.float64, device=device).unsqueeze(1)
    samples = torch.arange(grid, dtype=torch.float64, device=device).unsqueeze(0)
    pos = (start + bins * bin_size + (samples + 0.5) * bin_size / grid).reshape(-1)
    inside = (pos >= -1.0) & (pos <= size)
    pos = pos.clamp(min=0)
    low = pos.floor().to(torch.int64)
    at_edge = low >= size - 1
    low = torch.where(at_edge, torch.full_like(low, size - 1), low)
    high = torch.where(at_edge, low, low + 1)
    frac = torch.where(at_edge, torch.zeros_like(pos), pos - low)
    return low, high, (1 - frac) * inside, frac * inside


@OPS.op("RoiAlign", attrs={"coordinate_transformation_mode": "half_pixel", "mode": "avg", "output_height": 1,
                           "output_width": 1, "sampling_ratio": 0, "spatial_scale": 1.0}, check=_roi_align_check,
        capturable=False)  # reads each box on the host
def roi_align(inputs, attrs):
    x, rois, batch_indices = inputs
    ph, pw = attrs["output_height"], attrs["output_width"]
    half_pixel = attrs["coordinate_transformation_mode"] == "half_pixel"
    offset = 0.5 if half_pixel else 0.0
    height, width = x.shape[2], x.shape[3]
    out = torch.zeros((rois.shape[0], x.shape[1], ph, pw), dtype=x.dtype, device=x.device)
    for n, (box, b) in enumerate(zip(rois.double().tolist(), ints(batch_indices))):
        x1, y1, x2, y2 = [v * attrs["spatial_scale"] - offset for v in box]
        roi_w, roi_h = x2 - x1, y2 - y1
        if not half_pixel:  # malformed ROIs become 1x1
            roi_w, roi_h = max(roi_w, 1.0), max(roi_h, 1.0)
        ratio = attrs["sampling_ratio"]
        gh = ratio if ratio > 0 else math.ceil(roi_h / ph)
        gw = ratio if ratio > 0 else math.ceil(roi_w / pw)
        if gh <= 0 or gw <= 0:
            continue
        y_low, y_high, wy_low, wy_high = _roi_axis(y1, roi_h / ph, ph, gh, height, x.device)
        x_low, x_high, wx_low, wx_high = _roi_axis(x1, roi_w / pw, pw, gw, width, x.device)
        plane = x[b].double()
        terms = [plane[:, ys][:, :, xs] * (wy.unsqueeze(1) * wx.unsqueeze(0))
                 for ys, wy in ((y_low, wy_low), (y_high, wy_high)) for xs, wx in ((x_low, wx_low), (x_high, wx_high))]
        if attrs["mode"] == "avg":
            value = sum(terms).reshape(-1, ph, gh, pw, gw).sum(dim=(2, 4)) / (gh * gw)
        else:  # ONNX's max: the largest weighted corner of any sample
            value = torch.stack(terms).amax(0).reshape(-1, ph, gh, pw, gw).amax(dim=(2, 4))
        out[n] = value.to(x.dtype)
    return out
