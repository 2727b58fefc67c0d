"""Convolution family: Conv, ConvTranspose and the fused convolution the passes produce."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .elementwise import apply_activation
from .registry import OpTable
from .util import FLOAT_DTYPES, only_dtypes

OPS = OpTable("conv")

CONV_ATTRS = {"auto_pad": "NOTSET", "dilations": None, "group": 1, "kernel_shape": None,
              "pads": None, "strides": None}


def resolve_padding(in_spatial: list[int], kernel: list[int], strides: list[int], dilations: list[int],
                    pads: list[int] | None, auto_pad: str) -> tuple[list[int], list[int]]:
    """ONNX padding rules → (begin pads, end pads) per spatial dim."""
    n = len(kernel)
    if auto_pad in ("SAME_UPPER", "SAME_LOWER"):
        begin, end = [], []
        for size, k, s, d in zip(in_spatial, kernel, strides, dilations):
            out = -(-size // s)
            total = max((out - 1) * s + (k - 1) * d + 1 - size, 0)
            small, large = total // 2, total - total // 2
            begin.append(small if auto_pad == "SAME_UPPER" else large)
            end.append(large if auto_pad == "SAME_UPPER" else small)
        return begin, end
    if auto_pad == "VALID" or pads is None:
        return [0] * n, [0] * n
    return list(pads[:n]), list(pads[n:])


def _conv_func(rank: int):
    return {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}[rank]


def conv_nd(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, attrs: dict) -> torch.Tensor:
    spatial = x.dim() - 2
    kernel = list(attrs.get("kernel_shape") or w.shape[2:])
    strides = list(attrs.get("strides") or [1] * spatial)
    dilations = list(attrs.get("dilations") or [1] * spatial)
    begin, end = resolve_padding(list(x.shape[2:]), kernel, strides, dilations, attrs.get("pads"),
                                 attrs.get("auto_pad", "NOTSET"))
    if begin == end:
        padding = begin
    else:
        pad_arg = []
        for lo, hi in zip(reversed(begin), reversed(end)):
            pad_arg += [lo, hi]
        x = F.pad(x, pad_arg)
        padding = [0] * spatial
    if b is not None and b.dtype != x.dtype:
        b = b.to(x.dtype)
    return _conv_func(spatial)(x, w.to(x.dtype), b, strides, padding, dilations, attrs.get("group", 1))


@OPS.op("Conv", attrs=CONV_ATTRS, check=only_dtypes(set(FLOAT_DTYPES), (0, 1)))
def conv(inputs, attrs):
    x, w = inputs[0], inputs[1]
    b = inputs[2] if len(inputs) > 2 else None
    return conv_nd(x, w, b, attrs)


@OPS.internal("FusedConv")
def fused_conv(inputs, attrs):
    """Conv (+bias) (+residual) (+activation); the residual adds before or after the activation."""
    x, w = inputs[0], inputs[1]
    b = inputs[2] if len(inputs) > 2 else None
    residual = inputs[3] if len(inputs) > 3 else None
    y = conv_nd(x, w, b, attrs)
    activation = attrs.get("activation")
    if residual is not None and not attrs.get("residual_after_activation", False):
        y = y + residual.to(y.dtype)
    if activation:
        y = apply_activation(y, activation, attrs.get("activation_alpha"), attrs.get("activation_beta"))
    if residual is not None and attrs.get("residual_after_activation", False):
        y = y + residual.to(y.dtype)
    return y


CONV_TRANSPOSE_ATTRS = dict(CONV_ATTRS, output_padding=None, output_shape=None)


@OPS.op("ConvTranspose", attrs=CONV_TRANSPOSE_ATTRS, check=only_dtypes(set(FLOAT_DTYPES), (0, 1)))
def conv_transpose(inputs, attrs):
    x, w = inputs[0], inputs[1]
    b = inputs[2] if len(inputs) > 2 else None
    spatial = x.dim() - 2
    kernel = list(attrs.get("kernel_shape") or w.shape[2:])
    strides = list(attrs.get("strides") or [1] * spatial)
    dilations = list(attrs.get("dilations") or [1] * spatial)
    out_pad = list(attrs.get("output_padding") or [0] * spatial)
    in_sizes = list(x.shape[2:])
    full = [(i - 1) * s + op + (k - 1) * d + 1 for i, s, op, k, d in zip(in_sizes, strides, out_pad, kernel, dilations)]
    if attrs.get("output_shape"):
        target = list(attrs["output_shape"])[-spatial:]
        total = [f - t for f, t in zip(full, target)]
        if attrs.get("auto_pad") == "SAME_LOWER":
            begin = [t - t // 2 for t in total]
        else:
            begin = [t // 2 for t in total]
        end = [t - bg for t, bg in zip(total, begin)]
    elif attrs.get("auto_pad") in ("SAME_UPPER", "SAME_LOWER"):
        target = [i * s for i, s in zip(in_sizes, strides)]
        total = [f - t for f, t in zip(full, target)]
        if attrs["auto_pad"] == "SAME_UPPER":
            begin = [t // 2 for t in total]
        else:
            begin = [t - t // 2 for t in total]
        end = [t - bg for t, bg in zip(total, begin)]
    elif attrs.get("pads") and attrs.get("auto_pad", "NOTSET") == "NOTSET":
        begin, end = list(attrs["pads"][:spatial]), list(attrs["pads"][spatial:])
    else:
        begin, end = [0] * spatial, [0] * spatial
    fn = {1: F.conv_transpose1d, 2: F.conv_transpose2d, 3: F.conv_transpose3d}[spatial]
    y = fn(x, w.to(x.dtype), None if b is None else b.to(x.dtype), strides, 0, out_pad, attrs.get("group", 1), dilations)
    # Crop the padding afterwards: handles asymmetric pads and output_padding in one place.
    index = [slice(None), slice(None)]
    for size, lo, hi in zip(y.shape[2:], begin, end):
        index.append(slice(lo, size - hi))
    return y[tuple(index)]
