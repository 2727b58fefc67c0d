"""Data movement: shapes, reshapes, slicing, gathering, concatenation, padding, tiling."""
from __future__ import annotations

import math

import numpy as np
import torch

from .registry import REQUIRED, OpTable
from ..ir.dtypes import ONNX_TO_TORCH
from .util import ints, norm_axis, same_device, tensor_from_numpy

OPS = OpTable("tensor")


@OPS.op("Shape", attrs={"start": 0, "end": None}, shape_arith=True)
def shape(inputs, attrs):
    dims = list(inputs[0].shape)
    rank = len(dims)
    start = max(0, min(rank, norm_axis(attrs["start"], rank)))
    end = rank if attrs["end"] is None else max(0, min(rank, norm_axis(attrs["end"], rank)))
    return torch.tensor(dims[start:end], dtype=torch.int64)


@OPS.op("Size", shape_arith=True)
def size(inputs, attrs):
    return torch.tensor(inputs[0].numel(), dtype=torch.int64)


def reshape_target(data_shape: list[int], target: list[int], allowzero: int) -> list[int]:
    out = []
    for i, d in enumerate(target):
        out.append(data_shape[i] if d == 0 and not allowzero else d)
    return out


@OPS.op("Reshape", attrs={"allowzero": 0}, host_inputs=(1,), shape_arith=True)
def reshape(inputs, attrs):
    x = inputs[0]
    return x.reshape(reshape_target(list(x.shape), ints(inputs[1]), attrs["allowzero"]))


@OPS.op("Flatten", attrs={"axis": 1}, shape_arith=True)
def flatten(inputs, attrs):
    x = inputs[0]
    axis = norm_axis(attrs["axis"], x.dim())
    lead = int(np.prod(x.shape[:axis])) if axis > 0 else 1
    return x.reshape(lead, -1) if x.numel() else x.reshape(lead, int(np.prod(x.shape[axis:])))


@OPS.op("Transpose", attrs={"perm": None}, shape_arith=True)
def transpose(inputs, attrs):
    x = inputs[0]
    perm = attrs["perm"] or list(reversed(range(x.dim())))
    return x.permute(*perm)


@OPS.op("Squeeze", attrs={"axes": None}, host_inputs=(1,), shape_arith=True)
def squeeze(inputs, attrs):
    x = inputs[0]
    axes = ints(inputs[1]) if len(inputs) > 1 and inputs[1] is not None else attrs["axes"]
    if not axes:
        return x.reshape([d for d in x.shape if d != 1])
    axes = sorted({norm_axis(a, x.dim()) for a in axes})
    return x.reshape([d for i, d in enumerate(x.shape) if i not in axes])


@OPS.op("Unsqueeze", attrs={"axes": None}, host_inputs=(1,), shape_arith=True)
def unsqueeze(inputs, attrs):
    x = inputs[0]
    axes = ints(inputs[1]) if len(inputs) > 1 and inputs[1] is not None else attrs["axes"]
    rank = x.dim() + len(axes)
    shape = list(x.shape)
    for a in sorted(norm_axis(a, rank) for a in axes):
        shape.insert(a, 1)
    return x.reshape(shape)


@OPS.op("Concat", attrs={"axis": REQUIRED}, shape_arith=True)
def concat(inputs, attrs):
    parts = [t for t in inputs if t is not None]
    anchor = next((t for t in parts if t.dim() > 0 and t.device.type != "cpu"), parts[0])
    parts = [same_device(t, anchor) for t in parts]
    dtype = parts[0].dtype
    return torch.cat([t.to(dtype) for t in parts], dim=norm_axis(attrs["axis"], parts[0].dim()))


@OPS.op("Split", attrs={"axis": 0, "split": None, "num_outputs": None}, host_inputs=(1,))
def split(inputs, attrs, n_outputs: int | None = None):
    x = inputs[0]
    axis = norm_axis(attrs["axis"], x.dim())
    sizes = ints(inputs[1]) if len(inputs) > 1 and inputs[1] is not None else attrs["split"]
    if not sizes:
        n = attrs.get("num_outputs") or attrs.get("_num_outputs")
        total = x.shape[axis]
        chunk = -(-total // n)
        sizes = [chunk] * (n - 1) + [total - chunk * (n - 1)]
    return tuple(torch.split(x, list(sizes), dim=axis))


def _slice_params(dim: int, start: int, end: int, step: int) -> tuple[int, int]:
    if start < 0:
        start += dim
    if end < 0:
        end += dim
    if step > 0:
        start = max(0, min(dim, start))
        end = max(0, min(dim, end))
    else:
        start = max(-1, min(dim - 1, start))
        end = max(-1, min(dim - 1, end))
    return start, end


@OPS.op("Slice", attrs={"starts": None, "ends": None, "axes": None}, host_inputs=(1, 2, 3, 4), shape_arith=True)
def slice_op(inputs, attrs):
    x = inputs[0]
    if len(inputs) > 1:
        starts, ends = ints(inputs[1]), ints(inputs[2])
        axes = ints(inputs[3]) if len(inputs) > 3 and inputs[3] is not None else list(range(len(starts)))
        steps = ints(inputs[4]) if len(inputs) > 4 and inputs[4] is not None else [1] * len(starts)
    else:  # opset < 10: attributes
        starts, ends = attrs["starts"], attrs["ends"]
        axes = attrs["axes"] or list(range(len(starts)))
        steps = [1] * len(starts)
    out = x
    for start, end, axis, step in zip(starts, ends, axes, steps):
        axis = norm_axis(axis, x.dim())
        dim = x.shape[axis]
        start, end = _slice_params(dim, start, end, step)
        if step > 0:
            index = [slice(None)] * x.dim()
            index[axis] = slice(start, max(start, end), step)
            out = out[tuple(index)]
        else:
            idx = torch.arange(start, end, step, device=x.device)
            out = out.index_select(axis, idx)
    return out


@OPS.op("Gather", attrs={"axis": 0}, shape_arith=True)
def gather(inputs, attrs):
    data, indices = inputs
    axis = norm_axis(attrs["axis"], data.dim())
    idx = same_device(indices, data).to(torch.int64) if indices.dim() > 0 else indices.to(torch.int64).to(data.device)
    idx = torch.where(idx < 0, idx + data.shape[axis], idx)
    out = data.index_select(axis, idx.reshape(-1))
    return out.reshape(list(data.shape[:axis]) + list(indices.shape) + list(data.shape[axis + 1:]))


@OPS.op("GatherElements", attrs={"axis": 0})
def gather_elements(inputs, attrs):
    data, indices = inputs
    axis = norm_axis(attrs["axis"], data.dim())
    idx = same_device(indices, data).to(torch.int64)
    idx = torch.where(idx < 0, idx + data.shape[axis], idx)
    return torch.gather(data, axis, idx)


@OPS.op("GatherND", attrs={"batch_dims": 0})
def gather_nd(inputs, attrs):
    data, indices = inputs
    b = attrs["batch_dims"]
    idx = same_device(indices, data).to(torch.int64)
    k = idx.shape[-1]
    batch_shape = list(data.shape[:b])
    nb = int(np.prod(batch_shape)) if b else 1
    flat_data = data.reshape([nb] + list(data.shape[b:]))
    flat_idx = idx.reshape(nb, -1, k)
    # The extents as a device tensor made by kernels (a host list copied over would break capture).
    dims = torch.stack([torch.full((), d, dtype=torch.int64, device=data.device) for d in data.shape[b:b + k]]) \
        if k else torch.zeros(0, dtype=torch.int64, device=data.device)
    flat_idx = torch.where(flat_idx < 0, flat_idx + dims, flat_idx)
    rows = []
    for i in range(nb):
        rows.append(flat_data[i][tuple(flat_idx[i, :, j] for j in range(k))])
    out = torch.stack(rows)
    return out.reshape(list(idx.shape[:-1]) + list(data.shape[b + k:]))


@OPS.op("ScatterElements", "Scatter", attrs={"axis": 0, "reduction": "none"})
def scatter_elements(inputs, attrs):
    data, indices, updates = inputs
    axis = norm_axis(attrs["axis"], data.dim())
    idx = same_device(indices, data).to(torch.int64)
    idx = torch.where(idx < 0, idx + data.shape[axis], idx)
    reduce = {"none": None, "add": "sum", "mul": "prod", "max": "amax", "min": "amin"}[attrs["reduction"]]
    if reduce is None:
        return data.scatter(axis, idx, updates)
    return data.scatter_reduce(axis, idx, updates, reduce=reduce, include_self=True)


# ScatterND's reductions as index_copy/index_add/scatter_reduce over the rows its indices address:
# kernels all, where reading each index on the host would wait for the device (and break capture).
_SCATTER_REDUCE = {"mul": "prod", "max": "amax", "min": "amin"}


@OPS.op("ScatterND", attrs={"reduction": "none"})
def scatter_nd(inputs, attrs):
    data, indices, updates = inputs
    out = data.clone()
    idx = same_device(indices, data).to(torch.int64)
    k = idx.shape[-1]
    flat_idx = idx.reshape(-1, k)
    rows = math.prod(data.shape[:k])
    row = torch.zeros(flat_idx.shape[0], dtype=torch.int64, device=data.device)
    for j in range(k):  # negative indices count from the end, as the spec allows
        column = flat_idx[:, j]
        row = row * data.shape[j] + torch.where(column < 0, column + data.shape[j], column)
    table = out.view(rows, -1)
    upd = updates.reshape(flat_idx.shape[0], -1).to(out.dtype)
    reduction = attrs["reduction"]
    if reduction == "none":
        table.index_copy_(0, row, upd)
    elif reduction == "add":
        table.index_add_(0, row, upd)
    else:
        table.scatter_reduce_(0, row.unsqueeze(1).expand_as(upd), upd, reduce=_SCATTER_REDUCE[reduction])
    return out


@OPS.op("Expand", host_inputs=(1,), shape_arith=True)
def expand(inputs, attrs):
    x = inputs[0]
    target = ints(inputs[1])
    rank = max(x.dim(), len(target))
    xs = [1] * (rank - x.dim()) + list(x.shape)
    ts = [1] * (rank - len(target)) + target
    out_shape = [max(a, b) if 1 in (a, b) else a for a, b in zip(xs, ts)]
    return x.reshape(xs).expand(out_shape)


@OPS.op("Tile", host_inputs=(1,))
def tile(inputs, attrs):
    return inputs[0].repeat(ints(inputs[1]))


def _constant_value(attrs):
    value = attrs.get("value")
    return value if value is not None else np.zeros([1], dtype=np.float32)


@OPS.op("ConstantOfShape", attrs={"value": None}, host_inputs=(0,), shape_arith=True)
def constant_of_shape(inputs, attrs):
    value = tensor_from_numpy(_constant_value(attrs))
    return torch.full(ints(inputs[0]), value.reshape(-1)[0].item(), dtype=value.dtype)


@OPS.op("Range", host_inputs=(0, 1, 2), shape_arith=True)
def range_op(inputs, attrs):
    start, limit, delta = inputs
    dtype = start.dtype
    if dtype.is_floating_point:
        s, lim, d = float(start), float(limit), float(delta)
    else:
        s, lim, d = int(start), int(limit), int(delta)
    n = max(int(np.ceil((lim - s) / d)), 0)
    return (torch.arange(n, dtype=torch.float64 if dtype.is_floating_point else torch.int64) * d + s).to(dtype)


@OPS.op("Constant", attrs={"value": None, "value_float": None, "value_floats": None, "value_int": None,
                           "value_ints": None, "sparse_value": None, "value_string": None, "value_strings": None})
def constant(inputs, attrs):
    for key, dtype in (("value", None), ("value_float", np.float32), ("value_floats", np.float32),
                       ("value_int", np.int64), ("value_ints", np.int64)):
        if attrs.get(key) is not None:
            return torch.as_tensor(np.asarray(attrs[key], dtype=dtype))
    raise ValueError("Constant without a numeric value")


@OPS.op("EyeLike", attrs={"dtype": None, "k": 0})
def eye_like(inputs, attrs):
    x = inputs[0]
    dtype = ONNX_TO_TORCH[attrs["dtype"]] if attrs["dtype"] else x.dtype
    n, m = x.shape
    k = attrs["k"]
    # The diagonal k as a difference of two triangles: kernels only (assigning each element from
    # the host would be a host-to-device copy per element, which capture refuses).
    ones = torch.ones(n, m, dtype=torch.float32, device=x.device)
    return (ones.triu(k) - ones.triu(k + 1)).to(dtype)


@OPS.op("Trilu", attrs={"upper": 1}, host_inputs=(1,))
def trilu(inputs, attrs):
    k = ints(inputs[1])[0] if len(inputs) > 1 and inputs[1] is not None else 0
    return torch.triu(inputs[0], k) if attrs["upper"] else torch.tril(inputs[0], k)


@OPS.op("DepthToSpace", attrs={"blocksize": REQUIRED, "mode": "DCR"})
def depth_to_space(inputs, attrs):
    x = inputs[0]
    b = attrs["blocksize"]
    n, c, h, w = x.shape
    if attrs["mode"] == "DCR":
        y = x.reshape(n, b, b, c // (b * b), h, w).permute(0, 3, 4, 1, 5, 2)
    else:
        y = x.reshape(n, c // (b * b), b, b, h, w).permute(0, 1, 4, 2, 5, 3)
    return y.reshape(n, c // (b * b), h * b, w * b)


def _space_to_depth_check(attrs: dict, dtypes: list):
    if attrs["mode"] not in ("DCR", "CRD"):
        return f"mode {attrs['mode']} not supported"
    return None


@OPS.op("SpaceToDepth", attrs={"blocksize": REQUIRED, "mode": "DCR"}, check=_space_to_depth_check)
def space_to_depth(inputs, attrs):
    x = inputs[0]
    b = attrs["blocksize"]
    n, c, h, w = x.shape
    y = x.reshape(n, c, h // b, b, w // b, b)
    # DCR: output channel (bh * b + bw) * C + c; CRD: c * b * b + bh * b + bw.
    y = y.permute(0, 3, 5, 1, 2, 4) if attrs["mode"] == "DCR" else y.permute(0, 1, 3, 5, 2, 4)
    return y.reshape(n, c * b * b, h // b, w // b)


@OPS.op("NonZero", data_dependent_shape=True)
def nonzero(inputs, attrs):
    x = inputs[0]
    if x.dim() == 0:
        return torch.zeros((0, int(bool(x))), dtype=torch.int64) if not bool(x) else torch.zeros((0, 1), dtype=torch.int64)
    return torch.nonzero(x).t().contiguous()


@OPS.op("OneHot", attrs={"axis": -1}, host_inputs=(1,))
def one_hot(inputs, attrs):
    indices, depth, values = inputs
    depth = int(ints(depth)[0])
    idx = indices.to(torch.int64)
    idx = torch.where(idx < 0, idx + depth, idx)
    valid = (idx >= 0) & (idx < depth)
    hot = torch.nn.functional.one_hot(torch.where(valid, idx, 0), depth) * valid.unsqueeze(-1)
    axis = norm_axis(attrs["axis"], indices.dim() + 1)
    hot = hot.movedim(-1, axis)
    values = same_device(values, hot)
    return torch.where(hot.bool(), values[1], values[0])


@OPS.op("Compress", attrs={"axis": None}, data_dependent_shape=True)
def compress(inputs, attrs):
    x, condition = inputs
    keep = torch.nonzero(same_device(condition, x).reshape(-1).to(torch.bool)).reshape(-1)
    if attrs["axis"] is None:
        flat = x.reshape(-1)
        return flat.index_select(0, keep[keep < flat.numel()])
    axis = norm_axis(attrs["axis"], x.dim())
    return x.index_select(axis, keep[keep < x.shape[axis]])


@OPS.op("ReverseSequence", attrs={"batch_axis": 1, "time_axis": 0})
def reverse_sequence(inputs, attrs):
    x, lens = inputs
    batch_axis, time_axis = attrs["batch_axis"], attrs["time_axis"]
    steps = x.shape[time_axis]
    t = torch.arange(steps, device=x.device).unsqueeze(0)  # [1, T]
    lens = same_device(lens, x).to(torch.int64).unsqueeze(1)  # [B, 1]
    source = torch.where(t < lens, lens - 1 - t, t)  # [B, T]: reversed inside each sequence
    moved = x.movedim((batch_axis, time_axis), (0, 1))
    index = source.reshape(source.shape + (1,) * (moved.dim() - 2)).expand(moved.shape)
    return torch.gather(moved, 1, index).movedim((0, 1), (batch_axis, time_axis))


@OPS.op("CenterCropPad", attrs={"axes": None}, host_inputs=(1,))
def center_crop_pad(inputs, attrs):
    x = inputs[0]
    target = ints(inputs[1])
    axes = [norm_axis(a, x.dim()) for a in (attrs["axes"] or range(x.dim()))]
    out = x
    for axis, size in zip(axes, target):
        dim = out.shape[axis]
        if size < dim:  # crop: the extra element of an odd difference comes off the end
            out = out.narrow(axis, (dim - size) // 2, size)
        elif size > dim:  # pad with zeros, the extra element of an odd difference at the end
            shape = list(out.shape)
            before = (size - dim) // 2
            shape[axis] = size
            padded = torch.zeros(shape, dtype=out.dtype, device=out.device)
            padded.narrow(axis, before, dim).copy_(out)
            out = padded
    return out


def _window(fn):
    def impl(inputs, attrs):
        size = ints(inputs[0])[0]
        n = torch.arange(size, dtype=torch.float64)
        period = size if attrs["periodic"] else size - 1
        return fn(2 * torch.pi * n / period).to(ONNX_TO_TORCH[attrs["output_datatype"]])
    return impl


def _window_check(attrs: dict, dtypes: list):
    if attrs["output_datatype"] not in ONNX_TO_TORCH:
        return f"output_datatype {attrs['output_datatype']} not supported"
    return None


WINDOW_ATTRS = {"output_datatype": 1, "periodic": 1}
OPS.op("HannWindow", attrs=dict(WINDOW_ATTRS), host_inputs=(0,), check=_window_check)(
    _window(lambda a: 0.5 - 0.5 * torch.cos(a)))
OPS.op("HammingWindow", attrs=dict(WINDOW_ATTRS), host_inputs=(0,), check=_window_check)(
    _window(lambda a: 25 / 46 - (1 - 25 / 46) * torch.cos(a)))
OPS.op("BlackmanWindow", attrs=dict(WINDOW_ATTRS), host_inputs=(0,), check=_window_check)(
    _window(lambda a: 0.42 - 0.5 * torch.cos(a) + 0.08 * torch.cos(2 * a)))


@OPS.op("Unique", attrs={"axis": None, "sorted": 1}, data_dependent_shape=True)
def unique(inputs, attrs):
    """Unique values (or slices along `axis`), first-occurrence indices, inverse indices, counts."""
    x = inputs[0]
    axis = None if attrs["axis"] is None else norm_axis(attrs["axis"], x.dim())
    source = x.reshape(-1) if axis is None else x
    dim = 0 if axis is None else axis
    values, inverse, counts = torch.unique(source, sorted=True, return_inverse=True, return_counts=True, dim=dim)
    positions = torch.arange(source.shape[dim], device=x.device)
    first = torch.full((values.shape[dim],), source.shape[dim], dtype=torch.int64, device=x.device)
    first = first.scatter_reduce(0, inverse, positions, reduce="amin")
    if not attrs["sorted"]:  # order of first occurrence
        order = torch.argsort(first)
        rank = torch.empty_like(order)
        rank[order] = torch.arange(len(order), device=x.device)
        values, first, counts, inverse = values.index_select(dim, order), first[order], counts[order], rank[inverse]
    return values, first, inverse.to(torch.int64), counts.to(torch.int64)
