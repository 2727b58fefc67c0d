"""INT8 accumulators on the CPU by integer GEMMs: torch._int_mm (oneDNN's int8 × int8 → int32)
over the codes, with convolutions as im2col first. The INT8 emulation's products and sums, exact in
int32 as in float64, so the emulation's outputs do not change, only its speed: on this project's
CPU machine a 1×1 layer of 64 → 256 channels over 8 × 56 × 56 pixels took 4.1 ms this way against
31.8 ms as a float64 convolution. CPU INT8 engines are what validation, sensitivity and the
accuracy planner run, layer after layer, image after image.

Only INT8 codes (e4m3 codes keep the float64 path: int8 GEMMs cannot multiply them), dense 2-D
convolutions (group 1) and GEMMs, and K small enough that no int32 sum can overflow.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .conv import conv_geometry

# |sum| ≤ 127 · 127 · K must stay below 2^31 for every partial sum, in any order.
MAX_EXACT_K = (2**31 - 1) // (127 * 127)


def _applies(xq: torch.Tensor, wq: torch.Tensor, k: int) -> bool:
    return (xq.device.type == "cpu" and xq.dtype == torch.int8 and wq.dtype == torch.int8
            and 0 < k <= MAX_EXACT_K)


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
    return out if xq.is_contiguous(memory_format=torch.channels_last) and not xq.is_contiguous() else out.contiguous()


def matmul_by_int_mm(xq: torch.Tensor, wq: torch.Tensor) -> torch.Tensor | None:
    """The int32 accumulator [..., M] of int8 codes `xq` [..., K] by int8 `wq` [M, K]; None where
    the integer GEMM does not apply."""
    if wq.dim() != 2 or not _applies(xq, wq, wq.shape[1]):
        return None
    acc = torch._int_mm(xq.reshape(-1, xq.shape[-1]).contiguous(), wq.t())
    return acc.view(*xq.shape[:-1], wq.shape[0])
