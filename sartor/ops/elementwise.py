"""Elementwise ops: activations, arithmetic, comparison, logic and casts."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .registry import REQUIRED, OpTable
from ..ir.dtypes import FLOAT_DTYPES, ONNX_TO_TORCH
from .util import device_scalar, only_dtypes, same_device

OPS = OpTable("elementwise")
_float_only = only_dtypes(set(FLOAT_DTYPES))


# ---- activations (also the epilogues that fusion passes attach to conv and gemm) ----------
def hard_sigmoid(x: torch.Tensor, alpha: float = 0.2, beta: float = 0.5) -> torch.Tensor:
    return torch.clamp(x * alpha + beta, 0.0, 1.0)


def gelu(x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    return F.gelu(x, approximate=approximate)


def apply_activation(x: torch.Tensor, kind: str, alpha: float | None = None, beta: float | None = None) -> torch.Tensor:
    """Activation by name, as fused epilogues name them."""
    if kind == "Relu":
        return torch.relu(x)
    if kind == "Sigmoid":
        return torch.sigmoid(x)
    if kind == "SiLU":
        return F.silu(x)
    if kind == "Clip":
        return torch.clamp(x, alpha, beta)
    if kind == "HardSwish":
        return F.hardswish(x)
    if kind == "HardSigmoid":
        return hard_sigmoid(x, alpha, beta)
    if kind == "LeakyRelu":
        return F.leaky_relu(x, alpha)
    if kind == "Gelu":
        return gelu(x)
    if kind == "Tanh":
        return torch.tanh(x)
    raise ValueError(f"unknown activation {kind}")


FUSABLE_ACTIVATIONS = ("Relu", "Sigmoid", "SiLU", "Clip", "HardSwish", "HardSigmoid", "LeakyRelu", "Gelu", "Tanh")

_UNARY = {
    "Relu": torch.relu, "Sigmoid": torch.sigmoid, "Tanh": torch.tanh, "Exp": torch.exp,
    "Log": torch.log, "Sqrt": torch.sqrt, "Abs": torch.abs, "Neg": torch.neg, "Erf": torch.erf,
    "Floor": torch.floor, "Ceil": torch.ceil, "Reciprocal": torch.reciprocal, "Sin": torch.sin,
    "Cos": torch.cos, "Tan": torch.tan, "Asin": torch.asin, "Acos": torch.acos, "Atan": torch.atan,
    "Sinh": torch.sinh, "Cosh": torch.cosh, "Asinh": torch.asinh, "Acosh": torch.acosh,
    "Atanh": torch.atanh, "Sign": torch.sign, "Softsign": F.softsign, "Mish": F.mish,
    "Round": torch.round,  # round-half-to-even, as ONNX asks
}
_FLOAT_UNARY = {"Tanh", "Exp", "Log", "Sqrt", "Erf", "Floor", "Ceil", "Reciprocal", "Sin", "Cos", "Tan", "Asin",
                "Acos", "Atan", "Sinh", "Cosh", "Asinh", "Acosh", "Atanh", "Softsign", "Mish", "Round", "Sigmoid"}


def _make_unary(fn):
    return lambda inputs, attrs: fn(inputs[0])


# Exporters compute padding and attention scales from shapes with these (Swin's window padding,
# scaled_dot_product_attention's 1/sqrt(head dim)): on host values they stay on the host.
_UNARY_SHAPE_ARITH = {"Sqrt", "Abs", "Neg", "Floor", "Ceil", "Reciprocal"}

for _name, _fn in _UNARY.items():
    OPS.op(_name, check=_float_only if _name in _FLOAT_UNARY else None,
           shape_arith=_name in _UNARY_SHAPE_ARITH)(_make_unary(_fn))


@OPS.op("Identity")
def identity(inputs, attrs):
    return inputs[0]


def _dropout_check(attrs: dict, dtypes: list):
    # Inputs: data, ratio, training_mode. A training_mode input may switch random dropout on, which
    # an inference engine cannot reproduce; without one Dropout is an identity.
    if len(dtypes) > 2 and dtypes[2] is not None:
        return "training_mode input (random training-time dropout) not supported"
    return None


@OPS.op("Dropout", attrs={"seed": 0, "ratio": 0.5}, check=_dropout_check)  # ratio: opset < 12
def dropout(inputs, attrs):
    # Inference: output = data, mask (the optional second output) = all true.
    x = inputs[0]
    return x, torch.ones((), dtype=torch.bool, device=x.device).expand(x.shape)  # a view: no allocation


@OPS.op("Not")
def logical_not(inputs, attrs):
    return torch.logical_not(inputs[0])


@OPS.op("IsNaN")
def isnan(inputs, attrs):
    return torch.isnan(inputs[0])


@OPS.op("IsInf", attrs={"detect_negative": 1, "detect_positive": 1})
def isinf(inputs, attrs):
    x = inputs[0]
    pos = torch.isposinf(x) if attrs["detect_positive"] else torch.zeros_like(x, dtype=torch.bool)
    neg = torch.isneginf(x) if attrs["detect_negative"] else torch.zeros_like(x, dtype=torch.bool)
    return pos | neg


@OPS.op("HardSigmoid", attrs={"alpha": 0.2, "beta": 0.5}, check=_float_only)
def hardsigmoid_op(inputs, attrs):
    return hard_sigmoid(inputs[0], attrs["alpha"], attrs["beta"])


@OPS.op("HardSwish", check=_float_only)
def hardswish_op(inputs, attrs):
    return F.hardswish(inputs[0])


@OPS.op("LeakyRelu", attrs={"alpha": 0.01}, check=_float_only)
def leaky_relu(inputs, attrs):
    return F.leaky_relu(inputs[0], attrs["alpha"])


@OPS.op("Elu", attrs={"alpha": 1.0}, check=_float_only)
def elu(inputs, attrs):
    return F.elu(inputs[0], attrs["alpha"])


@OPS.op("Celu", attrs={"alpha": 1.0}, check=_float_only)
def celu(inputs, attrs):
    return F.celu(inputs[0], attrs["alpha"])


@OPS.op("Selu", attrs={"alpha": 1.67326319217681884765625, "gamma": 1.05070102214813232421875}, check=_float_only)
def selu(inputs, attrs):
    x = inputs[0]
    return attrs["gamma"] * torch.where(x > 0, x, attrs["alpha"] * (torch.exp(x) - 1))


@OPS.op("ThresholdedRelu", attrs={"alpha": 1.0}, check=_float_only)
def thresholded_relu(inputs, attrs):
    x = inputs[0]
    return torch.where(x > attrs["alpha"], x, torch.zeros_like(x))


@OPS.op("Softplus", check=_float_only)
def softplus(inputs, attrs):
    return F.softplus(inputs[0])


@OPS.op("Gelu", attrs={"approximate": "none"}, check=_float_only)
def gelu_op(inputs, attrs):
    return gelu(inputs[0], attrs["approximate"])


@OPS.op("PRelu")
def prelu(inputs, attrs):
    x, slope = inputs
    return torch.where(x >= 0, x, x * same_device(slope, x))


# min and max are read as Python numbers: kept on the host, so reading them never waits for the device.
@OPS.op("Clip", attrs={"min": None, "max": None}, host_inputs=(1, 2))
def clip(inputs, attrs):
    x = inputs[0]
    lo = inputs[1] if len(inputs) > 1 and inputs[1] is not None else attrs["min"]
    hi = inputs[2] if len(inputs) > 2 and inputs[2] is not None else attrs["max"]
    lo = lo.item() if isinstance(lo, torch.Tensor) else lo
    hi = hi.item() if isinstance(hi, torch.Tensor) else hi
    if lo is None and hi is None:
        return x
    if lo is not None and hi is not None and lo > hi:
        return torch.full_like(x, hi)  # ONNX: every element becomes max when min > max
    return torch.clamp(x, lo, hi)


# ---- binary and variadic arithmetic -------------------------------------------------
def _binary(fn):
    def impl(inputs, attrs):
        a, b = inputs
        if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.device != b.device:
            if a.dim() == 0 and a.device.type == "cpu":
                a = device_scalar(a, b.device)
            else:
                b = same_device(b, a) if b.dim() > 0 else device_scalar(b, a.device)
        return fn(a, b)
    return impl


def _div(a, b):
    if a.is_floating_point() or b.is_floating_point():
        return torch.div(a, b)
    return torch.div(a, b, rounding_mode="trunc").to(torch.promote_types(a.dtype, b.dtype))


def _pow(a, b):
    out = torch.pow(a, b.to(a.dtype) if a.is_floating_point() else b)
    return out.to(a.dtype)


def _mod(a, b, fmod):
    if fmod:
        return torch.fmod(a, b)
    if not (a.is_floating_point() or b.is_floating_point()):
        return torch.remainder(a, b)
    # fmod=0 on floats: the result takes the divisor's sign, as numpy's mod (inf and zero cases too).
    r = torch.fmod(a, b)
    r = torch.where((r != 0) & ((r < 0) != (b < 0)), r + b, r)
    return torch.where(r == 0, torch.copysign(torch.zeros_like(r), b), r)


_BINARY = {
    "Add": torch.add, "Sub": torch.sub, "Mul": torch.mul, "Div": _div, "Pow": _pow,
    "Equal": torch.eq, "Less": torch.lt, "Greater": torch.gt, "LessOrEqual": torch.le,
    "GreaterOrEqual": torch.ge, "And": torch.logical_and, "Or": torch.logical_or,
    "Xor": torch.logical_xor, "BitwiseAnd": torch.bitwise_and, "BitwiseOr": torch.bitwise_or,
    "BitwiseXor": torch.bitwise_xor,
}
_SHAPE_ARITH = {"Add", "Sub", "Mul", "Div", "Equal", "Less", "Greater", "LessOrEqual", "GreaterOrEqual", "And", "Or"}

for _name, _fn in _BINARY.items():
    OPS.op(_name, shape_arith=_name in _SHAPE_ARITH)(_binary(_fn))


@OPS.op("Mod", attrs={"fmod": 0}, shape_arith=True)
def mod(inputs, attrs):
    return _binary(lambda a, b: _mod(a, b, attrs["fmod"]))(inputs, attrs)


@OPS.op("BitwiseNot")
def bitwise_not(inputs, attrs):
    return torch.bitwise_not(inputs[0])


def _variadic(fn):
    def impl(inputs, attrs):
        out = inputs[0]
        for other in inputs[1:]:
            out = fn(out, same_device(other, out))
        return out
    return impl


OPS.op("Max", shape_arith=True)(_variadic(torch.maximum))
OPS.op("Min", shape_arith=True)(_variadic(torch.minimum))
OPS.op("Sum")(_variadic(torch.add))


@OPS.op("Mean")
def mean(inputs, attrs):
    return _variadic(torch.add)(inputs, attrs) / len(inputs)


@OPS.op("Where", shape_arith=True)
def where(inputs, attrs):
    cond, a, b = inputs
    device = next((t.device for t in (a, b, cond) if isinstance(t, torch.Tensor) and t.dim() > 0), a.device)
    return torch.where(*(device_scalar(t, device) if t.dim() == 0 else t.to(device) for t in (cond, a, b)))


# ---- casts -------------------------------------------------------------------------
def _cast_check(attrs: dict, dtypes: list):
    if attrs.get("to") not in ONNX_TO_TORCH:
        return f"cast to ONNX element type {attrs.get('to')} not supported"
    if dtypes and dtypes[0] is not None and dtypes[0] == "string":
        return "cast from string not supported"
    return None


def cast_to(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if x.is_floating_point() and not dtype.is_floating_point and dtype != torch.bool:
        # ONNX truncates toward zero; out-of-range float → int is undefined there, NaN → 0 here.
        x = torch.nan_to_num(torch.trunc(x), nan=0.0)
    return x.to(dtype)


@OPS.op("Cast", attrs={"to": REQUIRED, "saturate": 1, "round_mode": "up"}, shape_arith=True, check=_cast_check)
def cast(inputs, attrs):
    return cast_to(inputs[0], ONNX_TO_TORCH[attrs["to"]])


@OPS.op("CastLike", attrs={"saturate": 1, "round_mode": "up"}, shape_arith=True)
def cast_like(inputs, attrs):
    return cast_to(inputs[0], inputs[1].dtype)



@OPS.op("Swish", attrs={"alpha": 1.0}, check=_float_only)
def swish(inputs, attrs):
    x = inputs[0]
    return x * torch.sigmoid(attrs["alpha"] * x)


@OPS.op("Shrink", attrs={"bias": 0.0, "lambd": 0.5})
def shrink(inputs, attrs):
    x = inputs[0]
    lambd, bias = attrs["lambd"], attrs["bias"]
    out = torch.where(x < -lambd, x + bias, torch.where(x > lambd, x - bias, torch.zeros_like(x)))
    return out.to(x.dtype)


def _bitshift_check(attrs: dict, dtypes: list):
    if attrs["direction"] not in ("LEFT", "RIGHT"):
        return f"direction {attrs['direction']} not supported"
    return only_dtypes({"uint8", "int8", "int16", "int32", "int64"}, (0, 1))(attrs, dtypes)


@OPS.op("BitShift", attrs={"direction": REQUIRED}, check=_bitshift_check)
def bit_shift(inputs, attrs):
    a, b = inputs
    b = same_device(b, a).to(a.dtype)
    bits = torch.iinfo(a.dtype).bits
    a, b = torch.broadcast_tensors(a, b)
    out_of_range = (b < 0) | (b >= bits)
    safe = torch.where(out_of_range, torch.zeros_like(b), b)
    if attrs["direction"] == "LEFT":
        out = torch.bitwise_left_shift(a, safe)
        return torch.where(out_of_range, torch.zeros_like(a), out)
    out = torch.bitwise_right_shift(a, safe)  # arithmetic for signed types, as ONNX asks
    fill = torch.where(a < 0, -torch.ones_like(a), torch.zeros_like(a)) if a.dtype != torch.uint8 else torch.zeros_like(a)
    return torch.where(out_of_range, fill, out)
