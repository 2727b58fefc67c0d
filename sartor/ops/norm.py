"""Normalisation: BatchNormalization (inference form), LayerNormalization, Instance/GroupNormalization,
and AddLayerNorm (a residual add and the LayerNorm reading it, made by passes/fuse_add_layernorm.py)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .registry import OpTable
from ..ir.dtypes import FLOAT_DTYPES
from ..kernels.norm.add_layernorm import (ADD_LAYERNORM_TILES, LAYERNORM_TILES, add_layernorm, add_layernorm_supported,
                                          layernorm, layernorm_supported)
from ..kernels.registry import REFERENCE, parse_tactic
from .util import norm_axis, only_dtypes

OPS = OpTable("norm")
_float_only = only_dtypes(set(FLOAT_DTYPES))


def _bn_check(attrs: dict, dtypes: list):
    if not attrs.get("spatial", 1):
        return "spatial=0 (per-element statistics) not supported"
    return _float_only(attrs, dtypes)


def _batch_norm_training(x, scale, bias, mean, var, attrs):
    """training_mode=1: normalise with the batch's statistics (population variance) and return
    the updated running statistics as the optional outputs."""
    dims = [d for d in range(x.dim()) if d != 1]
    xf = x.to(torch.float32)
    batch_mean = xf.mean(dim=dims)
    batch_var = xf.var(dim=dims, unbiased=False)
    shape = (1, -1) + (1,) * (x.dim() - 2)
    y = (xf - batch_mean.view(shape)) * torch.rsqrt(batch_var.view(shape) + attrs["epsilon"])
    y = y * scale.to(torch.float32).view(shape) + bias.to(torch.float32).view(shape)
    m = attrs["momentum"]
    running_mean = mean.to(torch.float32) * m + batch_mean * (1 - m)
    running_var = var.to(torch.float32) * m + batch_var * (1 - m)
    return y.to(x.dtype), running_mean.to(mean.dtype), running_var.to(var.dtype)


@OPS.op("BatchNormalization", attrs={"epsilon": 1e-5, "momentum": 0.9, "training_mode": 0, "spatial": 1},
        check=_bn_check)
def batch_norm(inputs, attrs):
    x, scale, bias, mean, var = inputs[:5]
    if attrs["training_mode"]:
        return _batch_norm_training(x, scale, bias, mean, var, attrs)
    shape = (1, -1) + (1,) * (x.dim() - 2)
    inv = torch.rsqrt(var.to(torch.float32) + attrs["epsilon"])
    mult = (scale.to(torch.float32) * inv).to(x.dtype).view(shape)
    shift = (bias.to(torch.float32) - mean.to(torch.float32) * scale.to(torch.float32) * inv).to(x.dtype).view(shape)
    return x * mult + shift


def _kernel_takes(x, scale, bias, attrs: dict) -> bool:
    """Whether the Triton LayerNorm computes this layer: over the last axis alone, on CUDA."""
    return x.is_cuda and x.dim() >= 1 and norm_axis(attrs["axis"], x.dim()) == x.dim() - 1 \
        and layernorm_supported(x, scale, bias)


def layer_norm_tactics(inputs: list, attrs: dict, effort: int = 2) -> list[str]:
    """The reference (torch's native_layer_norm) and, on CUDA over the last axis with one scale and
    bias per channel, the Triton kernel's row tiles: torch's kernel is slow on rows of a few hundred
    channels, and which is faster depends on the rows and channels, so both are timed."""
    x, scale = inputs[0], inputs[1]
    bias = inputs[2] if len(inputs) > 2 else None
    if _kernel_takes(x, scale, bias, attrs):
        return [REFERENCE] + [tile.name for tile in LAYERNORM_TILES]
    return [REFERENCE]


def _layer_norm_kernel(x, scale, bias, attrs: dict):
    y, mean, inv = layernorm(x, scale, bias, attrs["epsilon"], parse_tactic(attrs["tactic"]).rows)
    stats_shape = (*x.shape[:-1], 1)
    return y.view(x.shape), mean.view(stats_shape), inv.view(stats_shape)


@OPS.op("LayerNormalization", attrs={"axis": -1, "epsilon": 1e-5, "stash_type": 1}, check=_float_only,
        tactics=layer_norm_tactics)
def layer_norm(inputs, attrs):
    x, scale = inputs[0], inputs[1]
    bias = inputs[2] if len(inputs) > 2 else None
    if (attrs.get("tactic") or REFERENCE) != REFERENCE and _kernel_takes(x, scale, bias, attrs):
        return _layer_norm_kernel(x, scale, bias, attrs)
    axis = norm_axis(attrs["axis"], x.dim())
    normalized = tuple(x.shape[axis:])
    if x.dtype in (torch.float32, torch.float16, torch.bfloat16) and tuple(scale.shape) == normalized \
            and (bias is None or tuple(bias.shape) == normalized):
        # One kernel (a transformer has two LayerNorms a block), statistics in FP32 whatever x's
        # dtype, as stash_type=1 asks; the spelled-out form below is for broadcast scales and FP64.
        y, mean, inv = torch.native_layer_norm(x, normalized, scale.to(x.dtype),
                                               None if bias is None else bias.to(x.dtype), attrs["epsilon"])
        return y, mean.float(), inv.float()
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


def add_layernorm_tactics(inputs: list, attrs: dict, effort: int = 2) -> list[str]:
    """The reference (the Add, then torch's LayerNorm), and on CUDA the one-pass kernel's row tiles."""
    a, b, weight = inputs[:3]
    bias = inputs[3] if len(inputs) > 3 else None
    if a.is_cuda and add_layernorm_supported(a, b, weight, bias):
        return [REFERENCE] + [tile.name for tile in ADD_LAYERNORM_TILES]
    return [REFERENCE]


@OPS.internal("AddLayerNorm", tactics=add_layernorm_tactics)
def add_layer_norm(inputs, attrs):
    """(a + b, LayerNormalization(a + b) over the last axis): the sum is the residual stream the
    next block reads, the normalised value what this block's branch reads. Attribute `epsilon`."""
    a, b, weight = inputs[:3]
    bias = inputs[3] if len(inputs) > 3 else None
    tactic = attrs.get("tactic") or REFERENCE
    if tactic != REFERENCE and a.is_cuda and add_layernorm_supported(a, b, weight, bias):
        return add_layernorm(a, b, weight, bias, attrs["epsilon"], parse_tactic(tactic).rows)
    total = a + b
    return total, layer_norm([total, weight, bias], {"axis": -1, "epsilon": attrs["epsilon"], "stash_type": 1})[0]


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


def _lp_check(attrs: dict, dtypes: list):
    if attrs["p"] not in (1, 2):
        return f"p={attrs['p']} not supported (1 or 2)"
    return _float_only(attrs, dtypes)


@OPS.op("LpNormalization", attrs={"axis": -1, "p": 2}, check=_lp_check)
def lp_norm(inputs, attrs):
    x = inputs[0]
    axis = norm_axis(attrs["axis"], x.dim())
    norm = x.abs().sum(axis, keepdim=True) if attrs["p"] == 1 else torch.sqrt((x * x).sum(axis, keepdim=True))
    return torch.where(norm == 0, torch.zeros_like(x), x / norm)


@OPS.op("RMSNormalization", attrs={"axis": -1, "epsilon": 1e-5, "stash_type": 1}, check=_float_only)
def rms_norm(inputs, attrs):
    x, scale = inputs
    dims = tuple(range(norm_axis(attrs["axis"], x.dim()), x.dim()))
    xf = x.to(torch.float64 if x.dtype == torch.float64 else torch.float32)
    inv = torch.rsqrt((xf * xf).mean(dim=dims, keepdim=True) + attrs["epsilon"])
    return (xf * inv * scale.to(xf.dtype)).to(x.dtype)
