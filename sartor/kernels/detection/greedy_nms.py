"""Greedy non-maximum suppression of one image's sorted candidates per program, in Triton.

The candidates come sorted (score descending, ties by their (class, anchor) index: torchvision's
stable order) with the valid ones first, `count[b]` of them. One program holds an image's K boxes
in registers and walks them in order: a box not yet removed is kept, written to the next output
slot, and removes every later box of its group whose IoU with it exceeds the threshold. The walk
stops at the last valid candidate or at `max_det` kept boxes, so a sparse image costs a few steps.

The IoU is torchvision's CPU arithmetic step by step in float32: (x2 - x1)·(y2 - y1) areas, the
clamped intersection, `inter / (area_i + area_j - inter)` correctly rounded (`div_rn`), and no
fused multiply-add (launched with `enable_fp_fusion=False`), so kept boxes equal its `nms` bit for
bit. The threshold is the largest float32 not above the float64 one, which makes `iou > t32` the
same test as torchvision's `(double) iou > threshold`.
"""
from __future__ import annotations

import numpy as np
import torch

from ..common.cache_keys import settle_cache_keys
from ..pointwise.epilogue import triton

MAX_CANDIDATES = 4096  # K per image held in one program's registers (see docs/decisions/0023)

if triton is not None:
    import triton.language as tl

    @triton.jit
    def _greedy_nms_kernel(boxes_ptr, scores_ptr, groups_ptr, classes_ptr, count_ptr,
                           out_boxes_ptr, out_scores_ptr, out_classes_ptr, out_count_ptr,
                           K, max_det, threshold, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr):
        image = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK_K)
        inside = offs < K
        row = image * K
        x1 = tl.load(boxes_ptr + (row + offs) * 4, mask=inside, other=0.0)
        y1 = tl.load(boxes_ptr + (row + offs) * 4 + 1, mask=inside, other=0.0)
        x2 = tl.load(boxes_ptr + (row + offs) * 4 + 2, mask=inside, other=0.0)
        y2 = tl.load(boxes_ptr + (row + offs) * 4 + 3, mask=inside, other=0.0)
        groups = tl.load(groups_ptr + row + offs, mask=inside, other=-1)
        areas = (x2 - x1) * (y2 - y1)
        valid = tl.load(count_ptr + image)
        removed = (offs >= valid).to(tl.int32)
        kept = valid * 0
        i = valid * 0
        while (i < valid) & (kept < max_det):
            if tl.max(tl.where(offs == i, removed, 0), axis=0) == 0:
                bx1 = tl.load(boxes_ptr + (row + i) * 4)
                by1 = tl.load(boxes_ptr + (row + i) * 4 + 1)
                bx2 = tl.load(boxes_ptr + (row + i) * 4 + 2)
                by2 = tl.load(boxes_ptr + (row + i) * 4 + 3)
                group = tl.load(groups_ptr + row + i)
                area = (bx2 - bx1) * (by2 - by1)
                width = tl.maximum(tl.minimum(x2, bx2) - tl.maximum(x1, bx1), 0.0)
                height = tl.maximum(tl.minimum(y2, by2) - tl.maximum(y1, by1), 0.0)
                inter = width * height
                iou = tl.math.div_rn(inter, area + areas - inter)
                suppress = (iou > threshold) & (groups == group) & (offs > i)
                removed = removed | suppress.to(tl.int32)
                slot = image * max_det + kept
                tl.store(out_boxes_ptr + slot * 4, bx1)
                tl.store(out_boxes_ptr + slot * 4 + 1, by1)
                tl.store(out_boxes_ptr + slot * 4 + 2, bx2)
                tl.store(out_boxes_ptr + slot * 4 + 3, by2)
                tl.store(out_scores_ptr + slot, tl.load(scores_ptr + row + i))
                tl.store(out_classes_ptr + slot, tl.load(classes_ptr + row + i))
                kept += 1
            i += 1
        tl.store(out_count_ptr + image, kept)
        # The slots past the kept boxes are zeroed here, not by a fill before the launch: the outputs
        # may be buffers the last run wrote (the context's shared outputs), and a fill is a launch.
        for start in range(0, max_det, BLOCK_D):
            slots = start + tl.arange(0, BLOCK_D)
            empty = (slots >= kept) & (slots < max_det)
            slot = image * max_det + slots
            zeros = tl.zeros([BLOCK_D], dtype=tl.float32)
            tl.store(out_scores_ptr + slot, zeros, mask=empty)
            tl.store(out_classes_ptr + slot, zeros.to(tl.int32), mask=empty)
            for corner in tl.static_range(4):
                tl.store(out_boxes_ptr + slot * 4 + corner, zeros, mask=empty)


def float32_threshold(threshold: float) -> float:
    """The largest float32 not above `threshold`: for float32 x, x > it exactly when x > threshold."""
    t32 = np.float32(threshold)
    if float(t32) > threshold:
        t32 = np.nextafter(t32, np.float32(-np.inf))
    return float(t32)


def greedy_nms_supported(boxes: torch.Tensor) -> bool:
    return triton is not None and boxes.dim() == 3 and boxes.shape[1] <= MAX_CANDIDATES and boxes.dtype == torch.float32


def nms_outputs_fit(outs, batch: int, max_det: int) -> bool:
    """Whether `outs` can take greedy_nms's outputs as they are: (count [B] int32, boxes [B, max_det, 4],
    scores [B, max_det] float32, classes [B, max_det] int32), contiguous, on one device."""
    shapes = ((batch,), (batch, max_det, 4), (batch, max_det), (batch, max_det))
    dtypes = (torch.int32, torch.float32, torch.float32, torch.int32)
    return (len(outs) == 4 and all(t is not None and tuple(t.shape) == shape and t.dtype == dtype and t.is_contiguous()
                                   and t.device == outs[0].device for t, shape, dtype in zip(outs, shapes, dtypes)))


def greedy_nms(boxes: torch.Tensor, scores: torch.Tensor, groups: torch.Tensor, classes: torch.Tensor,
               count: torch.Tensor, iou_threshold: float, max_det: int, out: tuple | None = None) -> tuple:
    """(count [B] int32, boxes [B, max_det, 4], scores [B, max_det], classes [B, max_det] int32) kept
    from the sorted candidates `boxes` [B, K, 4] (float32), `scores`, `groups` and `classes` [B, K],
    `count` [B] valid ones first. Slots past an image's count are zero. `out`: the four tensors to
    write (`nms_outputs_fit`), whatever they held."""
    batch, k = boxes.shape[:2]
    device = boxes.device
    if out is None:
        out = (torch.empty((batch,), dtype=torch.int32, device=device),
               torch.empty((batch, max_det, 4), dtype=torch.float32, device=device),
               torch.empty((batch, max_det), dtype=torch.float32, device=device),
               torch.empty((batch, max_det), dtype=torch.int32, device=device))
    elif not nms_outputs_fit(out, batch, max_det):
        raise ValueError("greedy_nms: `out` must be (count [B] int32, boxes [B, max_det, 4] float32, "
                         "scores [B, max_det] float32, classes [B, max_det] int32), contiguous")
    out_count, out_boxes, out_scores, out_classes = out
    block = max(16, triton.next_power_of_2(k))
    _greedy_nms_kernel[(batch,)](
        boxes.contiguous(), scores.float().contiguous(), groups.to(torch.int32).contiguous(),
        classes.to(torch.int32).contiguous(), count.to(torch.int32).contiguous(),
        out_boxes, out_scores, out_classes, out_count, k, max_det, float32_threshold(iou_threshold),
        BLOCK_K=block, BLOCK_D=min(256, max(16, triton.next_power_of_2(max_det))),
        num_warps=4 if block <= 1024 else 8, enable_fp_fusion=False)
    return out_count, out_boxes, out_scores, out_classes


settle_cache_keys(globals())  # last, once every Triton function above exists (common/cache_keys.py)
