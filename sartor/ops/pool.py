"""Pooling: MaxPool, AveragePool, LpPool and their global forms."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..kernels.pointwise.epilogue import code_words, pixel_stride
from ..kernels.pool.max_pool import PoolTile, max_pool_nhwc, max_pool_nhwc_supported, pool_tactics
from ..kernels.registry import tactic_for
from .conv import resolve_padding
from .registry import REQUIRED, OpTable
from ..ir.dtypes import FLOAT_DTYPES
from .util import only_dtypes, programmatic_launch

OPS = OpTable("pool")

# The dtypes PyTorch's max pool takes on every device; others are pooled in float32.
POOLED_IN_PLACE = (torch.float32, torch.float16, torch.bfloat16, torch.float64)

POOL_ATTRS = {"auto_pad": "NOTSET", "ceil_mode": 0, "dilations": None, "kernel_shape": None,
              "pads": None, "strides": None}


def _pool_check(attrs: dict, dtypes: list):
    if not attrs.get("kernel_shape"):
        return "kernel_shape is required"
    return only_dtypes(set(FLOAT_DTYPES) | {"int8", "uint8"})(attrs, dtypes)


def _out_size(size, k, s, d, lo, hi, ceil_mode):
    span = size + lo + hi - ((k - 1) * d + 1)
    return (math.ceil(span / s) if ceil_mode else span // s) + 1


def _pool_geometry(x, attrs):
    """(kernel, strides, dilations, begin pads, end pads, output sizes) under ONNX rules."""
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
    return kernel, strides, dilations, begin, end, outs


def _pad_for_pool(x, attrs, fill):
    """Apply ONNX padding (explicit, SAME_* or ceil_mode overhang) as an explicit pad with `fill`."""
    kernel, strides, dilations, begin, end, outs = _pool_geometry(x, attrs)
    # Extra padding so that a floor-mode pool over the padded tensor gives the ceil-mode size.
    extra = [max((o - 1) * s + (k - 1) * d + 1 - (n + lo + hi), 0)
             for n, k, s, d, o, lo, hi in zip(x.shape[2:], kernel, strides, dilations, outs, begin, end)]
    pad_arg = []
    for lo, hi, ex in zip(reversed(begin), reversed(end), reversed(extra)):
        pad_arg += [lo, hi + ex]
    padded = F.pad(x, pad_arg, value=fill) if any(pad_arg) else x
    return padded, kernel, strides, dilations, begin, end, extra


def max_pool_tactics(inputs, attrs, effort: int = 2) -> list[str]:
    """"torch" (the reference: explicit padding, then PyTorch's pool) and, for channels-last
    CUDA tensors without an Indices output, the Triton kernel that pads by masks, in as many tiles
    as the effort times (`kernels.pool.max_pool.POOL_TILES`)."""
    x = inputs[0]
    if x.is_cuda and not attrs.get("_with_indices") and max_pool_nhwc_supported(x):
        *_, outs = _pool_geometry(x, attrs)
        output_elements = x.shape[0] * x.shape[1] * math.prod(outs)
        sms = torch.cuda.get_device_properties(x.device).multi_processor_count
        return ["torch", *pool_tactics(effort, output_elements, sms, int8_words=code_words(x) is not None)]
    return ["torch"]


def _triton_max_pool(x: torch.Tensor, attrs: dict, out: torch.Tensor | None = None) -> torch.Tensor | None:
    """A Triton tactic's result ("max_pool.…"), new or in `out`; None where the tactic is not one
    or does not apply."""
    tile = tactic_for(attrs.get("tactic"))
    if not isinstance(tile, PoolTile) or attrs.get("_with_indices") or not max_pool_nhwc_supported(x):
        return None
    kernel, strides, dilations, begin, _, outs = _pool_geometry(x, attrs)
    return max_pool_nhwc(x, tuple(kernel), tuple(strides), tuple(begin), tuple(dilations), tuple(outs), out=out,
                         tile=tile, pdl=programmatic_launch(x, attrs))


def max_pool_into(inputs, attrs, out):
    """The Triton tactic's result stored straight into `out` (a channel slice of a Concat's
    buffer, as in YOLO's SPPF); None for PyTorch's kernel."""
    if out.dtype != inputs[0].dtype or pixel_stride(out) is None:
        return None
    return _triton_max_pool(inputs[0], attrs, out)


# `_with_indices` is set by the importer when the node's Indices output is used.
@OPS.op("MaxPool", attrs=dict(POOL_ATTRS, storage_order=0, _with_indices=0), check=_pool_check,
        tactics=max_pool_tactics, write_into=max_pool_into)
def max_pool(inputs, attrs):
    x = inputs[0]
    pooled = _triton_max_pool(x, attrs)
    if pooled is not None:
        return pooled
    fn = {1: F.max_pool1d, 2: F.max_pool2d, 3: F.max_pool3d}[x.dim() - 2]
    if x.dtype not in POOLED_IN_PLACE:
        # INT8 and FP8 codes (a pool between two INT8 layers), other integers: float32 holds every
        # int8, uint8 and e4m3 value exactly and its lowest value never wins the max, so pooling
        # there and converting back is exact. PyTorch's CPU pool takes neither int8 nor FP8.
        out = max_pool([x.float()], attrs)
        return (out[0].to(x.dtype), out[1]) if isinstance(out, tuple) else out.to(x.dtype)
    low = torch.finfo(x.dtype).min
    padded, kernel, strides, dilations, begin, *_ = _pad_for_pool(x, attrs, low)
    if not attrs.get("_with_indices"):
        return fn(padded, kernel, strides, 0, dilations)
    y, where = fn(padded, kernel, strides, 0, dilations, return_indices=True)
    return y, _onnx_indices(where, padded.shape[2:], x.shape, begin, attrs["storage_order"])


def _onnx_indices(where, padded_spatial, in_shape, begin, storage_order):
    """torch's per-plane indices into the padded input → ONNX's indices into the whole input
    tensor, row-major (storage_order 0) or column-major over the spatial dims (1)."""
    spatial = list(in_shape[2:])
    coords, rest = [], where
    for size in reversed(padded_spatial):
        coords.append(rest % size)
        rest = rest // size
    coords = [c - b for c, b in zip(reversed(coords), begin)]
    flat = torch.zeros_like(where)
    stride = 1
    order = range(len(spatial)) if storage_order else reversed(range(len(spatial)))
    for i in order:
        flat = flat + coords[i] * stride
        stride *= spatial[i]
    n, c = in_shape[:2]
    plane = torch.arange(n * c, dtype=torch.int64, device=where.device).reshape((n, c) + (1,) * len(spatial))
    return flat + plane * stride


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


def _window_sum(t, kernel, strides, dilations):
    """Sum over each (dilated) pooling window of every channel: a grouped convolution with ones."""
    channels = t.shape[1]
    ones = torch.ones((channels, 1) + tuple(kernel), dtype=t.dtype, device=t.device)
    fn = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}[t.dim() - 2]
    return fn(t, ones, None, strides, 0, dilations, channels)


def _dilated_average(x, padded, attrs, kernel, strides, dilations, begin, end, extra):
    total = _window_sum(padded, kernel, strides, dilations)
    counts = _window_sum(_count_mask(x, begin, end, extra, attrs), kernel, strides, dilations)
    return total / counts


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
    if any(d != 1 for d in dilations):
        return _window_sum(padded.abs() ** p, kernel, strides, dilations) ** (1.0 / p)
    fn = {1: F.avg_pool1d, 2: F.avg_pool2d, 3: F.avg_pool3d}[x.dim() - 2]
    return (fn(padded.abs() ** p, kernel, strides, 0) * math.prod(kernel)) ** (1.0 / p)


@OPS.op("GlobalLpPool", attrs={"p": 2})
def global_lp_pool(inputs, attrs):
    x = inputs[0]
    p = attrs["p"]
    return (x.abs() ** p).sum(dim=tuple(range(2, x.dim())), keepdim=True) ** (1.0 / p)


@OPS.op("MaxUnpool", attrs={"kernel_shape": REQUIRED, "pads": None, "strides": None}, host_inputs=(2,))
def max_unpool(inputs, attrs):
    """Scatter each value to its (whole-tensor, row-major) index, as MaxPool's Indices give it."""
    x, indices = inputs[0], inputs[1]
    kernel = list(attrs["kernel_shape"])
    n = len(kernel)
    strides = list(attrs["strides"] or [1] * n)
    pads = list(attrs["pads"] or [0] * (2 * n))
    spatial = [(size - 1) * s - (pads[i] + pads[i + n]) + k
               for i, (size, s, k) in enumerate(zip(x.shape[2:], strides, kernel))]
    shape = list(x.shape[:2]) + spatial
    out = torch.zeros(math.prod(shape), dtype=x.dtype, device=x.device)
    out = out.scatter(0, indices.to(x.device).reshape(-1).to(torch.int64), x.reshape(-1)).reshape(shape)
    if len(inputs) > 2 and inputs[2] is not None:  # output_shape: zero-pad at the end
        target = [int(v) for v in inputs[2].reshape(-1).tolist()]
        pad_arg = []
        for have, want in zip(reversed(shape), reversed(target)):
            pad_arg += [0, want - have]
        out = F.pad(out, pad_arg)
    return out
