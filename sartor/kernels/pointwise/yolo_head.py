"""The YOLOv8 / YOLO11 detection head's decode in one pass per scale, in Triton.

Exported, the decode is some 20 small layers: reshape copies of the channels-last head outputs,
Concat along anchors, Softmax over the DFL bins, the DFL's 1x1 conv, Slice/Sub/Add/Div/Concat
(dist2bbox), Mul by the strides, Sigmoid, and the final Concat. Here each program reads a block of
pixels of one scale in whatever layout the head convs left them (channels-last, or a channel slice
of a wider buffer: all through strides), takes the softmax expectation of each side's bins in FP32,
decodes the box around the pixel's anchor (x + 0.5, y + 0.5), applies the sigmoid to the class
logits, and writes its anchors' column range of the [B, 4 + NC, A] output.
"""
from __future__ import annotations

import torch

from ..common.cache_keys import settle_cache_keys
from .epilogue import triton

if triton is not None:
    import triton.language as tl

    @triton.jit
    def _expected_distance(box_ptr, pixel, ok, side: tl.constexpr, sbc, R: tl.constexpr):
        """Softmax over the R bins of one box side, then its expectation Σ p_r · r (the DFL)."""
        bins = tl.arange(0, R)
        logits = tl.load(box_ptr + pixel[:, None] + (side * R + bins)[None, :] * sbc, mask=ok[:, None],
                         other=0.0).to(tl.float32)
        weights = tl.exp(logits - tl.max(logits, axis=1)[:, None])
        return tl.sum(weights * bins.to(tl.float32)[None, :], axis=1) / tl.sum(weights, axis=1)

    @triton.jit
    def _yolo_decode_kernel(box_ptr, cls_ptr, out_ptr, HW, W, NC, anchors, anchor_start, stride,
                            sbn, sbc, sbh, sbw, scn, scc, sch, scw,
                            R: tl.constexpr, BLOCK_A: tl.constexpr, BLOCK_C: tl.constexpr):
        batch = tl.program_id(1).to(tl.int64)
        offs = tl.program_id(0) * BLOCK_A + tl.arange(0, BLOCK_A)
        ok = offs < HW
        h = offs // W
        w = offs % W
        box_pixel = batch * sbn + h * sbh + w * sbw
        left = _expected_distance(box_ptr, box_pixel, ok, 0, sbc, R)
        top = _expected_distance(box_ptr, box_pixel, ok, 1, sbc, R)
        right = _expected_distance(box_ptr, box_pixel, ok, 2, sbc, R)
        bottom = _expected_distance(box_ptr, box_pixel, ok, 3, sbc, R)
        # The operations of Ultralytics' dist2bbox(xywh=True), in its order, then × stride.
        anchor_x = w.to(tl.float32) + 0.5
        anchor_y = h.to(tl.float32) + 0.5
        x1 = anchor_x - left
        y1 = anchor_y - top
        x2 = anchor_x + right
        y2 = anchor_y + bottom
        out_row = out_ptr + batch * (4 + NC) * anchors + anchor_start + offs
        dtype = out_ptr.dtype.element_ty
        tl.store(out_row, ((x1 + x2) / 2.0 * stride).to(dtype), mask=ok)
        tl.store(out_row + anchors, ((y1 + y2) / 2.0 * stride).to(dtype), mask=ok)
        tl.store(out_row + 2 * anchors, ((x2 - x1) * stride).to(dtype), mask=ok)
        tl.store(out_row + 3 * anchors, ((y2 - y1) * stride).to(dtype), mask=ok)
        cls_pixel = batch * scn + h * sch + w * scw
        for c0 in range(0, NC, BLOCK_C):
            classes = c0 + tl.arange(0, BLOCK_C)
            mask = ok[:, None] & (classes < NC)[None, :]
            logits = tl.load(cls_ptr + cls_pixel[:, None] + classes[None, :] * scc, mask=mask,
                             other=0.0).to(tl.float32)
            scores = 1.0 / (1.0 + tl.exp(-logits))
            tl.store(out_row[:, None] + (4 + classes)[None, :] * anchors, scores.to(dtype), mask=mask)


def yolo_decode_supported(boxes: list[torch.Tensor], classes: list[torch.Tensor], reg_max: int) -> bool:
    """4-D float inputs, one device, a power-of-two number of DFL bins (Triton's block sizes)."""
    tensors = list(boxes) + list(classes)
    return (triton is not None and reg_max > 0 and reg_max & (reg_max - 1) == 0
            and all(t.dim() == 4 and t.is_floating_point() and t.device == tensors[0].device for t in tensors))


def yolo_decode(boxes: list[torch.Tensor], classes: list[torch.Tensor], reg_max: int,
                strides: list[float], out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """[B, 4 + NC, Σ H_i W_i] in `out_dtype` (by default the inputs' dtype), computed in FP32:
    boxes[i] is [B, 4·reg_max, H_i, W_i] and classes[i] [B, NC, H_i, W_i] of scale i, any strides;
    one launch per scale."""
    batch = boxes[0].shape[0]
    num_classes = classes[0].shape[1]
    anchors = sum(b.shape[2] * b.shape[3] for b in boxes)
    out = torch.empty((batch, 4 + num_classes, anchors), dtype=out_dtype or boxes[0].dtype, device=boxes[0].device)
    block_a = 64
    block_c = min(32, triton.next_power_of_2(max(num_classes, 1)))
    start = 0
    for box, cls, stride in zip(boxes, classes, strides):
        _, _, height, width = box.shape
        pixels = height * width
        grid = (triton.cdiv(pixels, block_a), batch)
        _yolo_decode_kernel[grid](box, cls, out, pixels, width, num_classes, anchors, start, float(stride),
                                  *box.stride(), *cls.stride(), R=reg_max, BLOCK_A=block_a, BLOCK_C=block_c,
                                  num_warps=4)
        start += pixels
    return out


settle_cache_keys(globals())  # last, once every Triton function above exists (common/cache_keys.py)
