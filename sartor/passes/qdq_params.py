"""Reading QuantizeLinear/DequantizeLinear nodes: their scale, zero point, integer type and axis,
for the passes that rewrite Q/DQ patterns (`drop_redundant_qdq`, `fold_qdq`). Not a pass."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..ir import Graph, Node

Q_OUTPUT_TYPES = {2: "uint8", 3: "int8", 5: "int16"}  # QuantizeLinear's output_dtype attribute
# The zero point that makes a type's quantization symmetric around 0 with codes -128..127.
SYMMETRIC_ZERO_POINT = {"int8": 0, "uint8": 128}
QDQ_QMIN = -128  # the low code of ONNX QuantizeLinear's int8 saturation (sartor's calibration uses -127)


@dataclass
class QParams:
    scale: np.ndarray  # as stored (float32 normally), 0-d or 1-D
    zero_point: np.ndarray  # int64 values, same shape as the scale (zeros when omitted)
    dtype: str  # the integer type: "int8", "uint8", "int16", "int32"
    axis: int  # as written (may be negative); meaningful only when the scale has several values

    @property
    def per_tensor(self) -> bool:
        return self.scale.size == 1 and self.zero_point.size == 1

    def symmetric(self) -> bool:
        """Codes -128..127 around zero: int8 with zero point 0, or uint8 with zero point 128."""
        zero = SYMMETRIC_ZERO_POINT.get(self.dtype)
        return zero is not None and bool(np.all(self.zero_point == zero))

    def same_as(self, other: QParams) -> bool:
        if self.dtype != other.dtype or self.scale.dtype != other.scale.dtype:
            return False
        if self.scale.size != other.scale.size or self.zero_point.size != other.zero_point.size:
            return False
        if self.scale.size > 1 and self.axis != other.axis:
            return False
        return bool(np.array_equal(self.scale.reshape(-1), other.scale.reshape(-1))
                    and np.array_equal(self.zero_point.reshape(-1), other.zero_point.reshape(-1)))

    def describe_zero_point(self) -> str:
        values = np.unique(self.zero_point)
        shown = str(int(values[0])) if values.size == 1 else f"{values.size} values"
        return f"{shown} ({self.dtype})"


def qparams(graph: Graph, node: Node) -> QParams | None:
    """The parameters of a QuantizeLinear or DequantizeLinear whose scale (and zero point, if
    given) are constants; None otherwise or for blocked quantization."""
    if node.op_type not in ("QuantizeLinear", "DequantizeLinear") or node.attrs.get("block_size"):
        return None
    scale = graph.constant(node.inputs[1]) if len(node.inputs) > 1 and node.inputs[1] else None
    if scale is None or scale.ndim > 1:
        return None
    zp_name = node.inputs[2] if len(node.inputs) > 2 else ""
    if zp_name:
        zp = graph.constant(zp_name)
        if zp is None:
            return None
        dtype = str(zp.dtype)
        zero_point = zp.astype(np.int64)
    else:
        if node.op_type == "QuantizeLinear":
            dtype = Q_OUTPUT_TYPES.get(node.attrs.get("output_dtype") or 2, "other")
        else:
            dtype = graph.dtype_of(node.inputs[0]) or "unknown"
        zero_point = np.zeros(scale.shape, dtype=np.int64)
    if zero_point.size not in (1, scale.size):
        return None
    return QParams(np.asarray(scale), zero_point, dtype, int(node.attrs.get("axis", 1)))


def quantized_by(graph: Graph, value: str, producers: dict) -> tuple[Node, Node] | None:
    """(QuantizeLinear, DequantizeLinear) when `value` is DequantizeLinear(QuantizeLinear(x))."""
    dq = producers.get(value)
    if dq is None or dq.op_type != "DequantizeLinear":
        return None
    q = producers.get(dq.inputs[0])
    if q is None or q.op_type != "QuantizeLinear":
        return None
    return q, dq


def fake_quant_params(graph: Graph, q: Node, dq: Node) -> QParams | None:
    """The common parameters of a Q → DQ pair that quantizes per tensor with one scale and zero
    point on both sides (float32 scale, no `precision` other than float32); None otherwise."""
    pq, pdq = qparams(graph, q), qparams(graph, dq)
    if pq is None or pdq is None or not pq.per_tensor or not pq.same_as(pdq):
        return None
    if pq.scale.dtype != np.float32 or q.attrs.get("precision") not in (None, 0, 1):
        return None
    return pq
