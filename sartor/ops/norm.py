"""Normalisation: BatchNormalization (inference form), LayerNormalization, Instance/GroupNormalization."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .registry import OpTable
from .util import FLOAT_DTYPES, norm_axis, only_dtypes

OPS = OpTable("norm")
_float_only = only_dtypes(set(FLOAT_DTYPES))


def _bn_check(attrs: dict, dtypes: list):
    if attrs.get("training_mode", 0):
        return "training_mode=1 (batch statistics) is not an inference op"
    return _float_only(attrs, dtypes)


@OPS.op("BatchNormalization", attrs={"epsilon": 1e-5, "momentum": 0.9, "training_mode": 0, "spatial": 1},
        check=_bn_check)
def batch_norm(inputs, attrs):
    x, scale, bias, mean, var = inputs[:5]
    shape = (1, -1) + (1,) * (x.dim() - 2)
    inv = torch.rsqrt(var.to(torch.float32) + attrs["epsilon"])
    mult = (scale.to(torch.float32) * inv).to(x.dtype).view(shape)
    shift = (bias.to(torch.float32) - mean.to(torch.float32) * scale.to(torch.float32) * inv).to(x.dtype).view(shape)
    return x * mult + shift


@OPS.op("LayerNormalization", attrs={"axis": -1, "epsilon": 1e-5, "stash_type": 1}, check=_float_only)
def layer_norm(inputs, attrs):
    x, scale = inputs[0], inputs[1]
    bias = inputs[2] if len(inputs) > 2 else None
    axis = norm_axis(attrs["axis"], x.dim())
    dims = tuple(range(axis, x.dim()))
    # Statistics in FP32 (stash_type=1), as ONNX and TensorRT compute them.
    xf = x.to(torch.float32)
    mean = xf.mean(dim=dims, keepdim=True)
    var = ((xf - mean) ** 2).mean(dim=dims, keepdim=True)
    inv = torch.rsqrt(var + attrs["epsilon"])
    y = ((xf - mean) * inv * scale.to(torch.float32))
    if bias is not None:
        y = y + bias.to(torch.float32)
    return y.to(x.dtype), mean, inv


@OPS.op("InstanceNormalization", attrs={"epsilon": 1e-5}, check=_float_only)
def instance_norm(inputs, attrs):
    x, scale, bias = inputs
    return F.instance_norm(x.float(), weight=scale.float(), bias=bias.float(), eps=attrs["epsilon"]).to(x.dtype)


@OPS.op("GroupNormalization", attrs={"epsilon": 1e-5, "num_groups": None, "stash_type": 1}, check=_float_only)
def group_norm(inputs, attrs):
    x, scale, bias = inputs
    groups = attrs["num_groups"]
    n, c = x.shape[:2]
    xf = x.float().reshape(n, groups, -1)
    mean = xf.mean(-1, keepdim=True)
    var = ((xf - mean) ** 2).mean(-1, keepdim=True)
    y = ((xf - mean) * torch.rsqrt(var + attrs["epsilon"])).reshape(x.shape)
    shape = (1, -1) + (1,) * (x.dim() - 2)
    # opset 21 gives per-channel scale/bias; opset 18 gave per-group ones.
    if scale.numel() == groups and groups != c:
        scale = scale.repeat_interleave(c // groups)
        bias = bias.repeat_interleave(c // groups)
    return (y * scale.float().view(shape) + bias.float().view(shape)).to(x.dtype)


@OPS.op("LRN", attrs={"alpha": 0.0001, "beta": 0.75, "bias": 1.0, "size": None}, check=_float_only)
def lrn(inputs, attrs):
    return F.local_response_norm(inputs[0], attrs["size"], attrs["alpha"], attrs["beta"], attrs["bias"])


@OPS.op("MeanVarianceNormalization", attrs={"axes": [0, 2, 3]}, check=_float_only)
def mvn(inputs, attrs):
    x = inputs[0]
    axes = tuple(attrs["axes"])
    mean = x.mean(dim=axes, keepdim=True)
    var = ((x - mean) ** 2).mean(dim=axes, keepdim=True)
    return (x - mean) / torch.sqrt(var + 1e-9)
