"""Reductions, Softmax family, ArgMax/ArgMin, TopK, CumSum."""
from __future__ import annotations

import torch

from .registry import OpTable
from .util import ints, norm_axis

OPS = OpTable("reduce")

REDUCE_ATTRS = {"axes": None, "keepdims": 1, "noop_with_empty_axes": 0}


def _axes(inputs, attrs, rank):
    axes = attrs.get("axes")
    if len(inputs) > 1 and inputs[1] is not None:
        axes = ints(inputs[1])
    if not axes:
        return None if not attrs.get("noop_with_empty_axes") else ()
    return tuple(norm_axis(a, rank) for a in axes)


def _reducer(fn):
    def impl(inputs, attrs):
        x = inputs[0]
        axes = _axes(inputs, attrs, x.dim())
        if axes == ():
            return x
        if axes is None:
            axes = tuple(range(x.dim()))
        keep = bool(attrs["keepdims"])
        if x.dim() == 0:
            return fn(x.reshape(1), (0,), False).reshape(())
        return fn(x, axes, keep)
    return impl


def _prod(x, axes, keep):
    out = x
    for a in sorted(axes, reverse=True):
        out = torch.prod(out, dim=a, keepdim=keep)
    return out


def _extreme(dtype: torch.dtype, low: bool):
    """The identity of max (low=True) or min over an empty set: -inf/+inf, the integer bounds, False/True."""
    if dtype == torch.bool:
        return not low
    if dtype.is_floating_point:
        return float("-inf") if low else float("inf")
    return torch.iinfo(dtype).min if low else torch.iinfo(dtype).max


def _amax(x, axes, keep):
    if x.numel() == 0:
        shape = [1 if i in axes else s for i, s in enumerate(x.shape)] if keep else [s for i, s in enumerate(x.shape) if i not in axes]
        return torch.full(shape, _extreme(x.dtype, low=True), dtype=x.dtype, device=x.device)
    return torch.amax(x, dim=axes, keepdim=keep)


def _amin(x, axes, keep):
    if x.numel() == 0:
        shape = [1 if i in axes else s for i, s in enumerate(x.shape)] if keep else [s for i, s in enumerate(x.shape) if i not in axes]
        return torch.full(shape, _extreme(x.dtype, low=False), dtype=x.dtype, device=x.device)
    return torch.amin(x, dim=axes, keepdim=keep)


def _sum(x, axes, keep):
    return torch.sum(x, dim=axes, keepdim=keep).to(x.dtype)


def _log_sum_exp(x, axes, keep):
    if x.numel() == 0:
        return torch.log(_sum(torch.exp(x), axes, keep))
    return torch.logsumexp(x, dim=axes, keepdim=keep)


_REDUCERS = {
    "ReduceMean": lambda x, a, k: torch.mean(x, dim=a, keepdim=k),
    "ReduceSum": _sum,
    "ReduceMax": _amax,
    "ReduceMin": _amin,
    "ReduceProd": _prod,
    "ReduceL1": lambda x, a, k: _sum(torch.abs(x), a, k),
    "ReduceL2": lambda x, a, k: torch.sqrt(_sum(x * x, a, k)),
    "ReduceSumSquare": lambda x, a, k: _sum(x * x, a, k),
    "ReduceLogSum": lambda x, a, k: torch.log(_sum(x, a, k)),
    "ReduceLogSumExp": _log_sum_exp,
}
for _name, _fn in _REDUCERS.items():
    OPS.op(_name, attrs=dict(REDUCE_ATTRS), host_inputs=(1,), shape_arith=_name in ("ReduceProd", "ReduceSum", "ReduceMax", "ReduceMin"))(_reducer(_fn))


def _softmax_like(fn):
    def impl(inputs, attrs):
        x = inputs[0]
        axis = attrs.get("axis", -1)
        if attrs.get("_coerce_2d"):
            # Opset < 13: softmax over the flattened trailing dims from `axis`.
            axis = norm_axis(axis, x.dim())
            flat = x.reshape(int(torch.tensor(x.shape[:axis]).prod()), -1)
            return fn(flat, 1).reshape(x.shape)
        return fn(x, axis)
    return impl


def _hardmax(x, axis):
    idx = torch.argmax(x, dim=axis, keepdim=True)
    return torch.zeros_like(x).scatter_(axis, idx, 1.0)


OPS.op("Softmax", attrs={"axis": -1, "_coerce_2d": 0})(_softmax_like(lambda x, a: torch.softmax(x, a)))
OPS.op("LogSoftmax", attrs={"axis": -1, "_coerce_2d": 0})(_softmax_like(lambda x, a: torch.log_softmax(x, a)))
OPS.op("Hardmax", attrs={"axis": -1, "_coerce_2d": 0})(_softmax_like(_hardmax))


def _arg(fn, flip):
    def impl(inputs, attrs):
        x = inputs[0]
        axis = norm_axis(attrs["axis"], x.dim())
        if attrs["select_last_index"]:
            x = torch.flip(x, (axis,))
            idx = fn(x, dim=axis, keepdim=bool(attrs["keepdims"]))
            return (x.shape[axis] - 1 - idx).to(torch.int64)
        return fn(x, dim=axis, keepdim=bool(attrs["keepdims"])).to(torch.int64)
    return impl


ARG_ATTRS = {"axis": 0, "keepdims": 1, "select_last_index": 0}
OPS.op("ArgMax", attrs=dict(ARG_ATTRS))(_arg(torch.argmax, False))
OPS.op("ArgMin", attrs=dict(ARG_ATTRS))(_arg(torch.argmin, False))


@OPS.op("TopK", attrs={"axis": -1, "largest": 1, "sorted": 1}, host_inputs=(1,))
def topk(inputs, attrs):
    x = inputs[0]
    k = ints(inputs[1])[0]
    axis = norm_axis(attrs["axis"], x.dim())
    largest = bool(attrs["largest"])
    # Stable order for ties (lower index first), as the ONNX reference does.
    order = torch.argsort(x, dim=axis, descending=largest, stable=True)
    idx = order.narrow(axis, 0, k)
    return torch.gather(x, axis, idx), idx


@OPS.op("CumSum", attrs={"exclusive": 0, "reverse": 0}, host_inputs=(1,))
def cumsum(inputs, attrs):
    x = inputs[0]
    axis = norm_axis(ints(inputs[1])[0], x.dim())
    if attrs["reverse"]:
        x = torch.flip(x, (axis,))
    if attrs["exclusive"]:  # shift by one (not cumsum - x: exact for floats, inf and NaN too)
        x = _shift_in(x, axis, 0)
    out = torch.cumsum(x, dim=axis).to(x.dtype)
    return torch.flip(out, (axis,)) if attrs["reverse"] else out


def _shift_in(x, axis, fill):
    """x shifted one step along axis: `fill` in front, the last element dropped."""
    if x.shape[axis] == 0:
        return x
    first = torch.full_like(x.narrow(axis, 0, 1), fill)
    return torch.cat([first, x.narrow(axis, 0, x.shape[axis] - 1)], dim=axis)


@OPS.op("CumProd", attrs={"exclusive": 0, "reverse": 0}, host_inputs=(1,))
def cumprod(inputs, attrs):
    x = inputs[0]
    axis = norm_axis(ints(inputs[1])[0], x.dim())
    if attrs["reverse"]:
        x = torch.flip(x, (axis,))
    if attrs["exclusive"]:
        x = _shift_in(x, axis, 1)
    out = torch.cumprod(x, dim=axis).to(x.dtype)
    return torch.flip(out, (axis,)) if attrs["reverse"] else out
