"""Normalisation: BatchNormalization (inference form), LayerNormalization, Instance/GroupNormalization,
AddLayerNorm (a residual add and the LayerNorm reading it, made by passes/fuse_add_layernorm.py) and
GatherLayerNorm (a LayerNorm whose rows a RowGather then picks, made by passes/fuse_layernorm_rows.py,
which also gives AddLayerNorm its row tables)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .registry import OpTable
from ..ir.dtypes import FLOAT_DTYPES
from ..kernels.norm.add_layernorm import (ADD_LAYERNORM_APART, ADD_LAYERNORM_TILES, LAYERNORM_APART, LAYERNORM_TILES,
                                          RowTable, add_layernorm, add_layernorm_supported, layernorm,
                                          layernorm_supported)
from ..kernels.common.interpreter import kernel_runs_on
from ..kernels.registry import REFERENCE, parse_tactic
from .rows import gather_rows, images_of, output_shape, rows_through
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
    """Whether the Triton LayerNorm computes this layer: over the last axis alone."""
    return x.dim() >= 1 and norm_axis(attrs["axis"], x.dim()) == x.dim() - 1 and layernorm_supported(x, scale, bias)


def layer_norm_tactics(inputs: list, attrs: dict, effort: int = 2) -> list[str]:
    """The reference (torch's native_layer_norm) and, on CUDA over the last axis with one scale and
    bias per channel, the Triton kernel's row tiles: torch's kernel is slow on rows of a few hundred
    channels, and which is faster depends on the rows and channels, so both are timed."""
    x, scale = inputs[0], inputs[1]
    bias = inputs[2] if len(inputs) > 2 else None
    if x.is_cuda and _kernel_takes(x, scale, bias, attrs):
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
    if (attrs.get("tactic") or REFERENCE) != REFERENCE and kernel_runs_on(x) and _kernel_takes(x, scale, bias, attrs):
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


def _tables(inputs: list, attrs: dict) -> tuple[RowTable | None, RowTable | None]:
    """AddLayerNorm's row tables: input 4 picks the rows of its normalised output (attributes
    rows_in, shape, batch_axis, as RowGather's), input 5 the rows of b (b_rows_in, b_shape, b_batch_axis)."""
    rows = inputs[4] if len(inputs) > 4 else None
    b_rows = inputs[5] if len(inputs) > 5 else None
    return (None if rows is None else RowTable(rows, attrs["rows_in"]),
            None if b_rows is None else RowTable(b_rows, attrs["b_rows_in"]))


def _gathered_b(b: torch.Tensor, attrs: dict, b_rows: RowTable | None) -> torch.Tensor:
    return b if b_rows is None else gather_rows(b, b_rows.table, b_rows.rows_in, attrs["b_shape"], attrs["b_batch_axis"])


def _gathered_y(y: torch.Tensor, attrs: dict, rows: RowTable | None) -> torch.Tensor:
    return y if rows is None else gather_rows(y, rows.table, rows.rows_in, attrs["shape"], attrs["batch_axis"])


def _b_apart_fits(a: torch.Tensor, b: torch.Tensor, attrs: dict, b_rows: RowTable | None) -> bool:
    """Whether b gathered apart has a's shape (the one-pass kernel's operands are equal shapes)."""
    if b_rows is None:
        return True
    try:
        return output_shape(attrs["b_shape"], attrs["b_batch_axis"], images_of(b, b_rows.rows_in)) == list(a.shape)
    except Exception:  # noqa: BLE001 - rows that are not whole images: the reference says so
        return False


def add_layernorm_tactics(inputs: list, attrs: dict, effort: int = 2) -> list[str]:
    """The reference (the Add, then torch's LayerNorm), and on CUDA the one-pass kernel's row tiles;
    with row tables, also each tile with the rows gathered apart."""
    a, b, weight = inputs[:3]
    bias = inputs[3] if len(inputs) > 3 else None
    rows, b_rows = _tables(inputs, attrs)
    if not a.is_cuda:
        return [REFERENCE]
    tiles = list(ADD_LAYERNORM_TILES) if add_layernorm_supported(a, b, weight, bias, rows, b_rows) else []
    if (rows is not None or b_rows is not None) and _b_apart_fits(a, b, attrs, b_rows) \
            and add_layernorm_supported(a, a, weight, bias) and b.dtype == a.dtype:
        tiles += ADD_LAYERNORM_APART
    return [REFERENCE] + [tile.name for tile in tiles]


def _add_layer_norm_kernel(a, b, weight, bias, attrs: dict, rows: RowTable | None, b_rows: RowTable | None):
    """The one-pass kernel reading b's rows and writing the output's through their tables, or
    (a tactic ending in "apart") with the rows gathered by torch before and after it; None where it
    does not take these operands."""
    tile = parse_tactic(attrs["tactic"])
    if tile.apart:
        b = _gathered_b(b, attrs, b_rows).contiguous()
        if not add_layernorm_supported(a, b, weight, bias):
            return None
        total, normed = add_layernorm(a, b, weight, bias, attrs["epsilon"], tile.rows)
        return total, _gathered_y(normed, attrs, rows)
    if not add_layernorm_supported(a, b, weight, bias, rows, b_rows):
        return None
    total, normed = add_layernorm(a, b, weight, bias, attrs["epsilon"], tile.rows, rows=rows, b_rows=b_rows)
    if rows is not None:
        normed = normed.reshape(output_shape(attrs["shape"], attrs["batch_axis"], images_of(a, rows.rows_in)))
    return total, normed


@OPS.internal("AddLayerNorm", tactics=add_layernorm_tactics)
def add_layer_norm(inputs, attrs):
    """(a + b, LayerNormalization(a + b) over the last axis): the sum is the residual stream the
    next block reads, the normalised value what this block's branch reads. Attribute `epsilon`;
    optional row tables (inputs 4 and 5, see _tables): b read through one, the normalised output
    written through the other (a permutation of each image's rows)."""
    a, b, weight = inputs[:3]
    bias = inputs[3] if len(inputs) > 3 else None
    rows, b_rows = _tables(inputs, attrs)
    if (attrs.get("tactic") or REFERENCE) != REFERENCE and kernel_runs_on(a):
        result = _add_layer_norm_kernel(a, b, weight, bias, attrs, rows, b_rows)
        if result is not None:
            return result
    total = a + _gathered_b(b, attrs, b_rows)
    normed = layer_norm([total, weight, bias], {"axis": -1, "epsilon": attrs["epsilon"], "stash_type": 1})[0]
    return total, _gathered_y(normed, attrs, rows)


def _gather_layer_norm_inputs(inputs: list) -> tuple:
    x, weight, bias, table = (list(inputs) + [None] * 4)[:4]
    return x, weight, bias, table


def gather_layer_norm_tactics(inputs: list, attrs: dict, effort: int = 2) -> list[str]:
    """The reference (gather, then torch's LayerNorm), and on CUDA the kernel reading its rows through
    the table, and with the rows gathered apart."""
    x, weight, bias, table = _gather_layer_norm_inputs(inputs)
    if not x.is_cuda:
        return [REFERENCE]
    tiles = list(LAYERNORM_TILES) if layernorm_supported(x, weight, bias, RowTable(table, attrs["rows_in"])) else []
    tiles += LAYERNORM_APART if layernorm_supported(x, weight, bias) else []
    return [REFERENCE] + [tile.name for tile in tiles]


@OPS.internal("GatherLayerNorm", tactics=gather_layer_norm_tactics)
def gather_layer_norm(inputs, attrs):
    """LayerNormalization over the last axis of x's rows through a per-image table: a LayerNorm and the
    RowGather reading it (passes/fuse_layernorm_rows.py). Inputs x, scale, bias ("" for none), table;
    attributes epsilon and RowGather's rows_in, shape, batch_axis."""
    x, weight, bias, table = _gather_layer_norm_inputs(inputs)
    rows = RowTable(table, attrs["rows_in"])
    shape = output_shape(attrs["shape"], attrs["batch_axis"], images_of(x, rows.rows_in))
    if (attrs.get("tactic") or REFERENCE) != REFERENCE and kernel_runs_on(x):
        tile = parse_tactic(attrs["tactic"])
        source, through = (rows_through(x, table, rows.rows_in), None) if tile.apart else (x, rows)
        if layernorm_supported(source, weight, bias, through):
            return layernorm(source, weight, bias, attrs["epsilon"], tile.rows, rows=through,
                             stats=False)[0].reshape(shape)
    gathered = gather_rows(x, table, rows.rows_in, attrs["shape"], attrs["batch_axis"])
    return layer_norm([gathered, weight, bias], {"axis": -1, "epsilon": attrs["epsilon"], "stash_type": 1})[0]


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
