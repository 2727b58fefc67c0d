"""Detection-head decoding made by sartor's passes: YoloDecode (see passes/fuse_yolo_head.py).

YoloDecode's inputs are the head's per-scale box logits [B, 4·reg_max, H_i, W_i] for every scale,
then the class logits [B, NC, H_i, W_i] in the same scale order; its attributes `reg_max` (DFL bins)
and `strides` (one per scale). Its output is Ultralytics' `output0`: [B, 4 + NC, Σ H_i W_i], per
anchor the box (cx, cy, w, h) in input pixels and the class scores after the sigmoid, computed in
FP32 and stored in the inputs' float dtype or the one its FLOAT_OUTPUT names (the engine's float32
output, where the layer computes in FP16: boxes near 640 px would otherwise be rounded to half a
pixel).
"""
from __future__ import annotations

import torch

from ..kernels.registry import fixed_tactic
from ..kernels.pointwise.yolo_head import yolo_decode, yolo_decode_out_fits, yolo_decode_supported
from .registry import OpTable, stored_float_dtype

OPS = OpTable("detection_head")
YOLO_DECODE = "YoloDecode"

REFERENCE = "torch"
TRITON = "triton_yolo_decode"
fixed_tactic(TRITON, "triton one-pass YOLO decode (DFL softmax, boxes, sigmoid)")


def box_logit_inputs(node) -> list[str]:
    """The names of a YoloDecode node's box-logit inputs (its first input per scale)."""
    return list(node.inputs[:len(node.attrs["strides"])])


def _split_inputs(inputs: list, attrs: dict) -> tuple[list, list]:
    scales = len(attrs["strides"])
    if len(inputs) != 2 * scales:
        raise ValueError(f"YoloDecode: {len(inputs)} inputs for {scales} scales (box and class logits per scale)")
    boxes, classes = list(inputs[:scales]), list(inputs[scales:])
    for box, cls in zip(boxes, classes):
        if box.shape[0] != cls.shape[0] or box.shape[2:] != cls.shape[2:] or box.shape[1] != 4 * attrs["reg_max"]:
            raise ValueError(f"YoloDecode: box logits {tuple(box.shape)} and class logits {tuple(cls.shape)} are "
                             f"not one scale's ({attrs['reg_max']} bins per side)")
    return boxes, classes


def _anchor_grid(height: int, width: int, device: torch.device) -> torch.Tensor:
    """[2, H·W]: each cell's centre (x + 0.5, y + 0.5), row-major, as Ultralytics' make_anchors."""
    ys = torch.arange(height, dtype=torch.float32, device=device) + 0.5
    xs = torch.arange(width, dtype=torch.float32, device=device) + 0.5
    grid_y, grid_x = torch.meshgrid(ys, xs, indexing="ij")
    return torch.stack((grid_x.reshape(-1), grid_y.reshape(-1)))


def yolo_decode_reference(boxes: list, classes: list, reg_max: int, strides: list,
                          out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """The decode in PyTorch, in FP32 whatever the inputs' dtype, returned in `out_dtype` (by
    default the inputs')."""
    bins = torch.arange(reg_max, dtype=torch.float32, device=boxes[0].device).reshape(1, 1, reg_max, 1)
    scales = []
    for box, cls, stride in zip(boxes, classes, strides):
        batch, _, height, width = box.shape
        logits = box.float().reshape(batch, 4, reg_max, height * width)
        distance = (logits.softmax(2) * bins).sum(2)  # [B, 4, HW]: left, top, right, bottom
        anchors = _anchor_grid(height, width, box.device).unsqueeze(0)
        top_left = anchors - distance[:, :2]
        bottom_right = anchors + distance[:, 2:]
        xywh = torch.cat(((top_left + bottom_right) / 2, bottom_right - top_left), 1) * float(stride)
        scales.append(torch.cat((xywh, cls.float().reshape(batch, cls.shape[1], height * width).sigmoid()), 1))
    return torch.cat(scales, 2).to(out_dtype or boxes[0].dtype)


def yolo_decode_tactics(inputs, attrs, effort: int = 2) -> list[str]:
    """The PyTorch reference and, on CUDA, the one-pass Triton kernel."""
    boxes, classes = _split_inputs(inputs, attrs)
    if boxes[0].is_cuda and yolo_decode_supported(boxes, classes, attrs["reg_max"]):
        return [REFERENCE, TRITON]
    return [REFERENCE]


def yolo_decode_into(inputs, attrs, outs):
    """The decode run with `outs[0]` (the context's shared output buffer) given to the Triton tactic,
    which writes it there; None where the buffer is not the output as the op makes it."""
    boxes, classes = _split_inputs(inputs, attrs)
    (out,) = outs
    if not yolo_decode_out_fits(out, boxes, classes, stored_float_dtype(attrs, boxes[0].dtype)):
        return None
    return yolo_decode_op(inputs, attrs, out=out)


@OPS.internal(YOLO_DECODE, tactics=yolo_decode_tactics, stores_any_float=True, write_outputs=yolo_decode_into)
def yolo_decode_op(inputs, attrs, out: torch.Tensor | None = None):
    """`out`: where the Triton tactic writes the decode (yolo_decode); the reference makes its own."""
    boxes, classes = _split_inputs(inputs, attrs)
    out_dtype = stored_float_dtype(attrs)
    if attrs.get("tactic") == TRITON and yolo_decode_supported(boxes, classes, attrs["reg_max"]):
        return yolo_decode(boxes, classes, attrs["reg_max"], attrs["strides"], out_dtype, out)
    return yolo_decode_reference(boxes, classes, attrs["reg_max"], attrs["strides"], out_dtype)
