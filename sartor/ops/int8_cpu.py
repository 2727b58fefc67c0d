"""Exact INT8 accumulators on the CPU, faster than the emulation's float64 convolutions. The
products and sums are the emulation's, exact, so its outputs do not change, only its speed. CPU
INT8 engines are what validation, sensitivity and the accuracy planner run, layer after layer,
image after image.

- Dense convolutions (group 1) and GEMMs: torch._int_mm (oneDNN's int8 × int8 → int32) over the
  codes, convolutions as im2col first. int32 sums are exact for K ≤ MAX_EXACT_K.
- Depthwise convolutions: float32 in channels-last memory. A product of two codes is at most
  127² = 16,129 and a depthwise sum has kh·kw of them, so for kh·kw ≤ MAX_FLOAT32_TAPS every
  partial sum is an integer below 2^24, exact in float32 in any order (oneDNN runs depthwise
  convolutions directly, with no Winograd transform).

Why and how much faster: docs/decisions/0015-cpu-int8-integer-gemms.md.

Only INT8 codes: e4m3 codes keep the float64 path.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .conv import conv_geometry, conv_nd

# |sum| ≤ 127 · 127 · K must stay below 2^31 (int32) or 2^24 (float32) for every partial sum, in any order.
MAX_EXACT_K = (2**31 - 1) // (127 * 127)
MAX_FLOAT32_TAPS = 2**24 // (127 * 127)


def _applies(xq: torch.Tensor, wq: torch.Tensor, k: int) -> bool:
    return (xq.device.type == "cpu" and xq.dtype == torch.int8 and wq.dtype == torch.int8
            and 0 < k <= MAX_EXACT_K)


def _channels_last(x: torch.Tensor) -> bool:
    """A 4-D tensor in channels-last memory (and not also contiguous, as tensors of one pixel are)."""
    return x.is_contiguous(memory_format=torch.channels_last) and not x.is_contiguous()


def conv_by_int_mm(xq: torch.Tensor, wq: torch.Tensor, attrs: dict) -> torch.Tensor | None:
    """The int32 accumulator [N, Cout, OH, OW] of a 2-D convolution of int8 codes `xq` by int8
    `wq` (ONNX attributes: strides, pads, dilations), in the input's memory format; None where the
    integer GEMM does not apply."""
    if xq.dim() != 4 or wq.dim() != 4 or attrs.get("group", 1) != 1 or not _applies(xq, wq, wq[0].numel()):
        return None
    strides, dilations, begin, end = conv_geometry(xq, wq, attrs)
    x = xq
    if begin != end:
        x = F.pad(x, [begin[1], end[1], begin[0], end[0]])  # code 0 is the value 0
        begin = [0, 0]
    n, c = x.shape[:2]
    cout, _, kh, kw = wq.shape
    oh = (x.shape[2] + 2 * begin[0] - dilations[0] * (kh - 1) - 1) // strides[0] + 1
    ow = (x.shape[3] + 2 * begin[1] - dilations[1] * (kw - 1) - 1) // strides[1] + 1
    if (kh, kw) == (1, 1) and strides == [1, 1] and begin == [0, 0]:
        rows = x.permute(0, 2, 3, 1).reshape(-1, c)
    else:
        # Unfolded in float32, where 8-bit integers are exact; K ordered (c, kh, kw) as wq's rows.
        columns = F.unfold(x.to(torch.float32), (kh, kw), dilation=dilations, padding=begin, stride=strides)
        rows = columns.transpose(1, 2).reshape(-1, columns.shape[1]).to(torch.int8)
    acc = torch._int_mm(rows.contiguous(), wq.reshape(cout, -1).t())
    out = acc.view(n, oh, ow, cout).permute(0, 3, 1, 2)  # channels-last memory
    return out if _channels_last(xq) else out.contiguous()


def matmul_by_int_mm(xq: torch.Tensor, wq: torch.Tensor) -> torch.Tensor | None:
    """The int32 accumulator [..., M] of int8 codes `xq` [..., K] by int8 `wq` [M, K]; None where
    the integer GEMM does not apply."""
    if wq.dim() != 2 or not _applies(xq, wq, wq.shape[1]):
        return None
    acc = torch._int_mm(xq.reshape(-1, xq.shape[-1]).contiguous(), wq.t())
    return acc.view(*xq.shape[:-1], wq.shape[0])


def depthwise_in_float32(xq: torch.Tensor, wq: torch.Tensor, attrs: dict) -> torch.Tensor | None:
    """The accumulator (float32, integer-valued, exact) [N, C·m, OH, OW] of a depthwise 2-D
    convolution (group = C) of int8 codes by int8 `wq` [C·m, 1, kh, kw], in the input's memory
    format; None where it does not apply."""
    if (xq.dim() != 4 or wq.dim() != 4 or attrs.get("group", 1) != xq.shape[1] or wq.shape[1] != 1
            or not _applies(xq, wq, wq.shape[2] * wq.shape[3]) or wq.shape[2] * wq.shape[3] > MAX_FLOAT32_TAPS):
        return None
    x = xq.to(torch.float32).contiguous(memory_format=torch.channels_last)  # oneDNN's fast depthwise layout
    acc = conv_nd(x, wq.to(torch.float32), None, attrs)
    return acc if _channels_last(xq) else acc.contiguous()

