"""ONNX quantization ops, computed as the ONNX specification writes them: QuantizeLinear,
DequantizeLinear, DynamicQuantizeLinear, QLinearConv, QLinearMatMul and ConvInteger
(MatMulInteger is in `linalg`).

These run a Q/DQ model as given (fake quantization in float around float layers). The pass
`sartor/passes/fold_qdq.py` turns the Q/DQ patterns around Conv/Gemm/MatMul into the INT8 layers
of `quantized.py`; what it does not fold runs here.

- QuantizeLinear: y = saturate(round_half_even(x / y_scale) + y_zero_point), the division in x's
  type (or in `precision`'s, opset 23+). Per tensor (scalar scale) or per axis (1-D scale along
  `axis`). Outputs int8, uint8 (the default without a zero point) or int16. Blocked quantization
  (`block_size`) is refused.
- DequantizeLinear: y = (float32(x) - float32(x_zero_point)) * x_scale, cast to the scale's type
  (or `output_dtype`). Inputs int8, uint8, int16 or int32.
- Integer accumulations (QLinearConv, QLinearMatMul, ConvInteger) are exact: float64
  convolutions/matmuls of integer-valued tensors, as in `quantized.py`. QLinear* requantize with the
  float multiplier x_scale · w_scale / y_scale computed in the scales' type, as the reference does.
"""
from __future__ import annotations

import torch

from .conv import CONV_ATTRS, conv_nd
from .registry import OpTable
from .util import exact_integer_math, norm_axis

OPS = OpTable("qdq")

INTEGER_RANGES = {torch.uint8: (0, 255), torch.int8: (-128, 127), torch.int16: (-32768, 32767)}
QUANTIZED_DTYPES = {"uint8", "int8", "int16"}
# TensorProto element types: FLOAT, FLOAT16, DOUBLE, BFLOAT16 (the `precision` and `output_dtype` attributes)
FLOAT_ELEM_TYPES = {1: torch.float32, 10: torch.float16, 11: torch.float64, 16: torch.bfloat16}
Q_OUTPUT_ELEM_TYPES = {2: torch.uint8, 3: torch.int8, 5: torch.int16}


def per_axis(value: torch.Tensor, rank: int, axis: int) -> torch.Tensor:
    """A scale or zero point shaped to broadcast against an input of `rank` dims: a scalar when it
    holds one value, else a vector laid along `axis`."""
    if value.numel() == 1:
        return value.reshape(())
    shape = [1] * rank
    shape[axis] = -1
    return value.reshape(shape)


def _blocked(attrs: dict) -> str | None:
    if attrs.get("block_size"):
        return (f"blocked quantization (block_size={attrs['block_size']}) is not supported: sartor quantizes "
                f"per tensor or per axis")
    return None


def _check_quantize(attrs: dict, dtypes: list) -> str | None:
    why = _blocked(attrs)
    if why:
        return why
    zp = dtypes[2] if len(dtypes) > 2 else None
    if zp is not None and zp not in QUANTIZED_DTYPES:
        return f"zero point dtype {zp} not supported (int8, uint8, int16)"
    if not (len(dtypes) > 2 and dtypes[2]) and attrs.get("output_dtype") and \
            attrs["output_dtype"] not in Q_OUTPUT_ELEM_TYPES:
        return f"output_dtype {attrs['output_dtype']} not supported (int8, uint8, int16)"
    if attrs.get("precision") and attrs["precision"] not in FLOAT_ELEM_TYPES:
        return f"precision {attrs['precision']} not supported"
    return None


def _check_dequantize(attrs: dict, dtypes: list) -> str | None:
    why = _blocked(attrs)
    if why:
        return why
    x = dtypes[0] if dtypes else None
    if x is not None and x not in QUANTIZED_DTYPES | {"int32"}:
        return f"input dtype {x} not supported (int8, uint8, int16, int32)"
    if attrs.get("output_dtype") and attrs["output_dtype"] not in FLOAT_ELEM_TYPES:
        return f"output_dtype {attrs['output_dtype']} not supported"
    return None


@OPS.op("QuantizeLinear", attrs={"axis": 1, "saturate": 1, "block_size": 0, "output_dtype": 0, "precision": 0},
        check=_check_quantize)
def quantize_linear(inputs, attrs):
    x, scale = inputs[0], inputs[1]
    zero_point = inputs[2] if len(inputs) > 2 else None
    if zero_point is not None:
        dtype = zero_point.dtype
    else:
        dtype = Q_OUTPUT_ELEM_TYPES[attrs.get("output_dtype") or 2]
    if attrs.get("precision"):
        compute = FLOAT_ELEM_TYPES[attrs["precision"]]
    else:  # integer inputs (QuantizeLinear-10/13 take int32) are divided in float64, as numpy does
        compute = x.dtype if x.is_floating_point() else torch.float64
    axis = norm_axis(attrs.get("axis", 1), x.dim()) if x.dim() else 0
    q = torch.round(x.to(compute) / per_axis(scale, x.dim(), axis).to(compute)).to(torch.float64)
    if zero_point is not None:
        q = q + per_axis(zero_point, x.dim(), axis).to(torch.float64)
    low, high = INTEGER_RANGES[dtype]
    return q.clamp_(low, high).to(dtype)


@OPS.op("DequantizeLinear", attrs={"axis": 1, "block_size": 0, "output_dtype": 0}, check=_check_dequantize)
def dequantize_linear(inputs, attrs):
    x, scale = inputs[0], inputs[1]
    zero_point = inputs[2] if len(inputs) > 2 else None
    out = FLOAT_ELEM_TYPES[attrs["output_dtype"]] if attrs.get("output_dtype") else scale.dtype
    compute = torch.float64 if scale.dtype == torch.float64 else torch.float32
    axis = norm_axis(attrs.get("axis", 1), x.dim()) if x.dim() else 0
    dx = x.to(compute)
    if zero_point is not None:
        dx = dx - per_axis(zero_point, x.dim(), axis).to(compute)
    return (dx * per_axis(scale, x.dim(), axis).to(compute)).to(out)


@OPS.op("DynamicQuantizeLinear", check=lambda attrs, dtypes: None if not dtypes or dtypes[0] in (None, "float32")
        else f"input dtype {dtypes[0]} not supported (float32)")
def dynamic_quantize_linear(inputs, attrs):
    """uint8, scale = (max(0, max x) - min(0, min x)) / 255, zero point = round(-min / scale)
    saturated to [0, 255], all in float32 as the reference computes them."""
    x = inputs[0].float()
    zero = torch.zeros((), dtype=torch.float32, device=x.device)
    maxx = torch.maximum(zero, x.max()) if x.numel() else zero
    minx = torch.minimum(zero, x.min()) if x.numel() else zero
    span = torch.where(maxx == minx, torch.ones_like(maxx), maxx - minx)
    scale = span / 255.0  # a Python scalar: a host tensor moved to the device would be a copy
    zp = torch.round((zero - minx / scale).clamp(0, 255))
    y = (torch.round(x / scale) + zp).clamp_(0, 255)
    return y.to(torch.uint8), scale, zp.to(torch.uint8)


def _centered(q: torch.Tensor, zero_point: torch.Tensor | None, rank: int, axis: int) -> torch.Tensor:
    """float64(q - zero_point), exact."""
    q = q.to(torch.float64)
    if zero_point is None:
        return q
    return q - per_axis(zero_point, rank, axis).to(torch.float64)


def _requantize(acc: torch.Tensor, multiplier: torch.Tensor, zero_point: torch.Tensor | None,
                dtype: torch.dtype) -> torch.Tensor:
    y = acc * multiplier.to(torch.float64)
    if zero_point is not None:
        y = y + zero_point.to(torch.float64).reshape(())
    low, high = INTEGER_RANGES[dtype]
    return torch.round(y.clamp_(low, high)).to(dtype)


def _int8_operands(positions: tuple) -> callable:
    def check(attrs: dict, dtypes: list) -> str | None:
        for i in positions:
            if i < len(dtypes) and dtypes[i] is not None and dtypes[i] not in ("int8", "uint8"):
                return f"input {i} dtype {dtypes[i]} not supported (int8, uint8)"
        return None
    return check


@OPS.op("QLinearConv", attrs=CONV_ATTRS, check=_int8_operands((0, 3)))
def qlinear_conv(inputs, attrs):
    """inputs: x, x_scale, x_zero_point, w, w_scale, w_zero_point (per output channel or not),
    y_scale, y_zero_point, B (int32)."""
    x, x_scale, x_zp, w, w_scale, w_zp, y_scale, y_zp = (list(inputs) + [None] * 9)[:8]
    bias = inputs[8] if len(inputs) > 8 else None
    xc = _centered(x, x_zp, x.dim(), 1)
    wc = _centered(w, w_zp, w.dim(), 0)
    with exact_integer_math(x.device):
        acc = conv_nd(xc, wc, None if bias is None else bias.to(torch.float64), attrs)
    multiplier = per_axis(x_scale, acc.dim(), 1) * per_axis(w_scale, acc.dim(), 1) / per_axis(y_scale, acc.dim(), 1)
    return _requantize(acc, multiplier, y_zp, y_zp.dtype if y_zp is not None else x.dtype)


@OPS.op("QLinearMatMul", check=_int8_operands((0, 3)))
def qlinear_matmul(inputs, attrs):
    """a_scale/a_zero_point per tensor or per row of a; b_scale/b_zero_point per tensor or per
    column of b."""
    a, a_scale, a_zp, b, b_scale, b_zp, y_scale, y_zp = (list(inputs) + [None] * 8)[:8]
    ac = _centered(a, a_zp, a.dim(), max(a.dim() - 2, 0))
    bc = _centered(b, b_zp, b.dim(), b.dim() - 1)
    acc = torch.matmul(ac, bc)
    rank = acc.dim()
    a_s = per_axis(a_scale, rank, rank - 2) if a_scale.numel() > 1 else a_scale.reshape(())
    b_s = per_axis(b_scale, rank, rank - 1) if b_scale.numel() > 1 else b_scale.reshape(())
    multiplier = a_s * b_s / y_scale.reshape(())
    return _requantize(acc, multiplier, y_zp, y_zp.dtype if y_zp is not None else a.dtype)


@OPS.op("ConvInteger", attrs=CONV_ATTRS, check=_int8_operands((0, 1)))
def conv_integer(inputs, attrs):
    """int32 conv(x - x_zero_point, w - w_zero_point); w's zero point per tensor or per output channel."""
    x, w = inputs[0], inputs[1]
    x_zp = inputs[2] if len(inputs) > 2 else None
    w_zp = inputs[3] if len(inputs) > 3 else None
    xc, wc = _centered(x, x_zp, x.dim(), 1), _centered(w, w_zp, w.dim(), 0)
    with exact_integer_math(x.device):
        return conv_nd(xc, wc, None, attrs).to(torch.int32)
