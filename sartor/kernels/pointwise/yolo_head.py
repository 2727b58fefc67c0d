"""The YOLOv8 / YOLO11 detection head's decode in one pass, in Triton: the three scales in one launch.

Exported, the decode is some 20 small layers: reshape copies of the channels-last head outputs,
Concat along anchors, Softmax over the DFL bins, the DFL's 1x1 conv, Slice/Sub/Add/Div/Concat
(dist2bbox), Mul by the strides, Sigmoid, and the final Concat. Here each program reads a block of
pixels of one scale (a launch's blocks run through its scales in order) in whatever layout the head
convs left them (channels-last, or a channel slice of a wider buffer: all through strides), takes the
softmax expectation of each side's bins in FP32, decodes the box around the pixel's anchor
(x + 0.5, y + 0.5), applies the sigmoid to the class logits, and writes its anchors' column range of
the [B, 4 + NC, A] output.
"""
from __future__ import annotations

import torch

from ..common.cache_keys import settle_cache_keys
from .epilogue import triton

LAUNCH_SCALES = 3  # the scales one launch decodes: _yolo_decode_kernel's argument slots

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
    def _decode_scale(box_ptr, cls_ptr, out_ptr, block, batch, HW, W, NC, anchors, anchor_start, stride,
                      sbn, sbc, sbh, sbw, scn, scc, sch, scw,
                      R: tl.constexpr, BLOCK_A: tl.constexpr, BLOCK_C: tl.constexpr):
        """One block of BLOCK_A pixels of one scale: its anchors' columns of the output."""
        offs = block * BLOCK_A + tl.arange(0, BLOCK_A)
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

    @triton.jit
    def _yolo_decode_kernel(out_ptr, NC, anchors, first1, first2, start0, start1, start2,
                            box0, cls0, hw0, w0, stride0, sb0n, sb0c, sb0h, sb0w, sc0n, sc0c, sc0h, sc0w,
                            box1, cls1, hw1, w1, stride1, sb1n, sb1c, sb1h, sb1w, sc1n, sc1c, sc1h, sc1w,
                            box2, cls2, hw2, w2, stride2, sb2n, sb2c, sb2h, sb2w, sc2n, sc2c, sc2h, sc2w,
                            SCALES: tl.constexpr, R: tl.constexpr, BLOCK_A: tl.constexpr,
                            BLOCK_C: tl.constexpr):
        """Up to three scales in one launch (a YOLO head's P3–P5): blocks [0, first1) are scale 0's,
        [first1, first2) scale 1's, the rest scale 2's; scale i's anchors start at column start_i."""
        block = tl.program_id(0)
        batch = tl.program_id(1).to(tl.int64)
        if block < first1:
            _decode_scale(box0, cls0, out_ptr, block, batch, hw0, w0, NC, anchors, start0, stride0,
                          sb0n, sb0c, sb0h, sb0w, sc0n, sc0c, sc0h, sc0w, R, BLOCK_A, BLOCK_C)
        elif SCALES > 1:
            if block < first2:
                _decode_scale(box1, cls1, out_ptr, block - first1, batch, hw1, w1, NC, anchors, start1, stride1,
                              sb1n, sb1c, sb1h, sb1w, sc1n, sc1c, sc1h, sc1w, R, BLOCK_A, BLOCK_C)
            elif SCALES > 2:
                _decode_scale(box2, cls2, out_ptr, block - first2, batch, hw2, w2, NC, anchors, start2,
                              stride2, sb2n, sb2c, sb2h, sb2w, sc2n, sc2c, sc2h, sc2w, R, BLOCK_A, BLOCK_C)


def yolo_decode_supported(boxes: list[torch.Tensor], classes: list[torch.Tensor], reg_max: int) -> bool:
    """4-D float inputs, one device, a power-of-two number of DFL bins (Triton's block sizes)."""
    tensors = list(boxes) + list(classes)
    return (triton is not None and reg_max > 0 and reg_max & (reg_max - 1) == 0
            and all(t.dim() == 4 and t.is_floating_point() and t.device == tensors[0].device for t in tensors))


def yolo_decode_shape(boxes: list[torch.Tensor], classes: list[torch.Tensor]) -> tuple[int, int, int]:
    """The decode's output shape: [B, 4 + NC, Σ H_i W_i]."""
    return boxes[0].shape[0], 4 + classes[0].shape[1], sum(b.shape[2] * b.shape[3] for b in boxes)


def yolo_decode_out_fits(out: torch.Tensor | None, boxes: list[torch.Tensor], classes: list[torch.Tensor],
                         dtype: torch.dtype | None = None) -> bool:
    """Whether yolo_decode can write into `out`: contiguous, of the decode's shape, on the inputs' device
    (and of `dtype`, where given)."""
    return (out is not None and tuple(out.shape) == yolo_decode_shape(boxes, classes) and out.is_contiguous()
            and out.device == boxes[0].device and (dtype is None or out.dtype == dtype))


def yolo_decode(boxes: list[torch.Tensor], classes: list[torch.Tensor], reg_max: int,
                strides: list[float], out_dtype: torch.dtype | None = None,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """[B, 4 + NC, Σ H_i W_i] in `out_dtype` (by default the inputs' dtype), computed in FP32:
    boxes[i] is [B, 4·reg_max, H_i, W_i] and classes[i] [B, NC, H_i, W_i] of scale i, any strides;
    one launch per three scales (a head's P3–P5 in one: at batch 1 a launch costs more than a scale).
    `out`: a contiguous tensor of that shape to write (its dtype the output's)."""
    batch, channels, anchors = yolo_decode_shape(boxes, classes)
    num_classes = channels - 4
    if out is None:
        out = torch.empty((batch, channels, anchors), dtype=out_dtype or boxes[0].dtype, device=boxes[0].device)
    elif not yolo_decode_out_fits(out, boxes, classes):
        raise ValueError(f"yolo_decode: `out` must be a contiguous {[batch, channels, anchors]} tensor on "
                         f"{boxes[0].device}, not {list(out.shape)} on {out.device}")
    block_a = 64
    block_c = min(32, triton.next_power_of_2(max(num_classes, 1)))
    scales = list(zip(boxes, classes, strides))
    start = 0
    for group in (scales[i:i + LAUNCH_SCALES] for i in range(0, len(scales), LAUNCH_SCALES)):
        slots, starts, firsts, blocks = [], [], [], 0
        for box, cls, stride in group:
            pixels = box.shape[2] * box.shape[3]
            slots.append([box, cls, pixels, box.shape[3], float(stride), *box.stride(), *cls.stride()])
            starts.append(start)
            firsts.append(blocks)
            start += pixels
            blocks += triton.cdiv(pixels, block_a)
        unused = LAUNCH_SCALES - len(group)  # slots the kernel never reads (SCALES): the last one's again
        slots, starts, firsts = slots + [slots[-1]] * unused, starts + [start] * unused, firsts + [blocks] * unused
        _yolo_decode_kernel[(blocks, batch)](out, num_classes, anchors, firsts[1], firsts[2], *starts,
                                             *(value for slot in slots for value in slot), SCALES=len(group),
                                             R=reg_max, BLOCK_A=block_a, BLOCK_C=block_c, num_warps=4)
    return out


settle_cache_keys(globals())  # last, once every Triton function above exists (common/cache_keys.py)
