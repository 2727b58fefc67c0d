"""Pooling: MaxPool, AveragePool, LpPool and their global forms."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .conv import resolve_padding
from .registry import OpTable
from .util import FLOAT_DTYPES, only_dtypes

OPS = OpTable("pool")

POOL_ATTRS = {"auto_pad": "NOTSET", "ceil_mode": 0, "dilations": None, "kernel_shape": None,
              "pads": None, "strides": None}


def _pool_check(attrs: dict, dtypes: list):
    if not attrs.get("kernel_shape"):
        return "kernel_shape is required"
    return only_dtypes(set(FLOAT_DTYPES) | {"int8", "uint8"})(attrs, dtypes)


def _out_size(size, k, s, d, lo, hi, ceil_mode):
    span = size + lo + hi - ((k - 1) * d + 1)
    return (math.ceil(span / s) if ceil_mode else span // s) + 1


def _pad_for_pool(x, attrs, fill):
    """Apply ONNX padding (explicit, SAME_* or ceil_mode overhang) as an explicit pad with `fill`."""
    spatial = x.dim() - 2
    kernel = list(attrs["kernel_shape"])
    strides = list(attrs.get("strides") or [1] * spatial)
    dilations = list(attrs.get("dilations") or [1] * spatial)
    begin, end = resolve_padding(list(x.shape[2:]), kernel, strides, dilations, attrs.get("pads"),
                                 attrs.get("auto_pad", "NOTSET"))
    outs = [_out_size(n, k, s, d, lo, hi, attrs.get("ceil_mode", 0))
            for n, k, s, d, lo, hi in zip(x.shape[2:], kernel, strides, dilations, begin, end)]
    if attrs.get("ceil_mode", 0):
        for i, (n, k, s, d, o) in enumerate(zip(x.shape[2:], kernel, strides, dilations, outs)):
            # A window must start inside the input or left padding (PyTorch and ONNX agree on this).
            if (o - 1) * s >= n + begin[i]:
                outs[i] = o - 1
    # Extra padding so that a floor-mode pool over the padded tensor gives the ceil-mode size.
    extra = [max((o - 1) * s + (k - 1) * d + 1 - (n + lo + hi), 0)
             for n, k, s, d, o, lo, hi in zip(x.shape[2:], kernel, strides, dilations, outs, begin, end)]
    pad_arg = []
    for lo, hi, ex in zip(reversed(begin), reversed(end), reversed(extra)):
        pad_arg += [lo, hi + ex]
    padded = F.pad(x, pad_arg, value=fill) if any(pad_arg) else x
    return padded, kernel, strides, dilations, begin, end, extra


@OPS.op("MaxPool", attrs=dict(POOL_ATTRS, storage_order=0), check=_pool_check)
def max_pool(inputs, attrs):
    x = inputs[0]
    fn = {1: F.max_pool1d, 2: F.max_pool2d, 3: F.max_pool3d}[x.dim() - 2]
    if not x.is_floating_point():
        return max_pool([x.float()], attrs).to(x.dtype)
    low = torch.finfo(x.dtype).min
    padded, kernel, strides, dilations, *_ = _pad_for_pool(x, attrs, low)
    return fn(padded, kernel, strides, 0, dilations)


@OPS.op("AveragePool", attrs=dict(POOL_ATTRS, count_include_pad=0), check=_pool_check)
def average_pool(inputs, attrs):
    x = inputs[0]
    spatial = x.dim() - 2
    padded, kernel, strides, dilations, begin, end, extra = _pad_for_pool(x, attrs, 0.0)
    if any(d != 1 for d in dilations):
        return _dilated_average(x, padded, attrs, kernel, strides, dilations, begin, end, extra)
    fn = {1: F.avg_pool1d, 2: F.avg_pool2d, 3: F.avg_pool3d}[spatial]
    total = fn(padded, kernel, strides, 0) * math.prod(kernel)
    count = fn(_count_mask(x, begin, end, extra, attrs), kernel, strides, 0) * math.prod(kernel)
    return total / count


def _count_mask(x, begin, end, extra, attrs):
    """1 where a cell counts toward an average's divisor: the input, explicit pads if
    count_include_pad, never the ceil-mode overhang."""
    ones = torch.ones((1, 1) + tuple(x.shape[2:]), dtype=x.dtype, device=x.device)
    explicit, overhang = [], []
    for lo, hi, ex in zip(reversed(begin), reversed(end), reversed(extra)):
        explicit += [lo, hi]
        overhang += [0, ex]
    ones = F.pad(ones, explicit, value=1.0 if attrs.get("count_include_pad", 0) else 0.0)
    return F.pad(ones, overhang, value=0.0)


def _dilated_average(x, padded, attrs, kernel, strides, dilations, begin, end, extra):
    if x.dim() != 4:
        raise NotImplementedError("dilated AveragePool is supported for 2-D inputs")
    n, c = x.shape[:2]
    cols = F.unfold(padded, kernel, dilation=dilations, stride=strides)
    counts = F.unfold(_count_mask(x, begin, end, extra, attrs), kernel, dilation=dilations, stride=strides).sum(1)
    out_h = (padded.shape[2] - ((kernel[0] - 1) * dilations[0] + 1)) // strides[0] + 1
    out_w = (padded.shape[3] - ((kernel[1] - 1) * dilations[1] + 1)) // strides[1] + 1
    total = cols.view(n, c, -1, cols.shape[-1]).sum(2)
    return (total / counts).view(n, c, out_h, out_w)


@OPS.op("GlobalAveragePool")
def global_average_pool(inputs, attrs):
    x = inputs[0]
    return x.mean(dim=tuple(range(2, x.dim())), keepdim=True)


@OPS.op("GlobalMaxPool")
def global_max_pool(inputs, attrs):
    x = inputs[0]
    return x.amax(dim=tuple(range(2, x.dim())), keepdim=True)


@OPS.op("LpPool", attrs=dict(POOL_ATTRS, p=2), check=_pool_check)
def lp_pool(inputs, attrs):
    x = inputs[0]
    p = attrs["p"]
    padded, kernel, strides, dilations, *_ = _pad_for_pool(x, attrs, 0.0)
    fn = {1: F.avg_pool1d, 2: F.avg_pool2d, 3: F.avg_pool3d}[x.dim() - 2]
    if any(d != 1 for d in dilations):
        raise NotImplementedError("dilated LpPool")
    return (fn(padded.abs() ** p, kernel, strides, 0) * math.prod(kernel)) ** (1.0 / p)


@OPS.op("GlobalLpPool", attrs={"p": 2})
def global_lp_pool(inputs, attrs):
    x = inputs[0]
    p = attrs["p"]
    return (x.abs() ** p).sum(dim=tuple(range(2, x.dim())), keepdim=True) ** (1.0 / p)
