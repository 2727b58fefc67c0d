"""Swin's shifted-window attention into one `Attention` layer (ops/attention.py). The unshifted
blocks fuse through fuse_attention; the shifted ones add their window mask to the scores viewed
with the windows split out of the batch:

    S = MatMul(q', k_t') [BW, H, N, N] → Add(S, B) → Reshape [-1, W, H, N, N] → Add(·, M)
      → Reshape [-1, H, N, N] → Softmax(last axis) → MatMul(·, v)

B, the relative-position bias, is the same for every window ([1, H, N, N] or less); M, the mask,
is one [N, N] per window position ([1, W, 1, N, N]). With q, k_t and v viewed the same way, as
[-1, W, H, N, D] (the Attention layer's `windows` attribute: a view splitting the leading dim),
the two adds are one constant bias B + M of [1, W, H, N, N] that broadcasts over the images:

    Attention(q, k_t, v, B + M; windows=W) → [BW, H, N, Dv]

It fires only with both reshape shapes constant, splitting and merging exactly the leading dim
([-1, W, H, N, N] and [-1, H, N, N]), B and M constants that do not vary over the images, q, k_t
and v of rank 4, and every intermediate read once, inside the pattern.
"""
from __future__ import annotations

import math

import numpy as np

from ..ir import Graph, Node
from .base import single_consumer
from .fuse_attention import FLOAT_TYPES, replace_softmax_blocks, scaled_operands


def _reshape_to(graph: Graph, node: Node | None, rank: int) -> list[int] | None:
    """The constant target shape of a Reshape of `rank` dims whose first is -1, else None."""
    if node is None or node.op_type != "Reshape" or len(node.inputs) < 2 or node.attrs.get("allowzero", 0):
        return None
    shape = graph.constant(node.inputs[1])
    if shape is None or shape.ndim != 1 or len(shape) != rank or int(shape[0]) != -1 or (shape[1:] <= 0).any():
        return None
    return [int(d) for d in shape]


def _constant_other(graph: Graph, add: Node | None, value: str) -> np.ndarray | None:
    """The constant `add` adds to `value`, or None."""
    if add is None or add.op_type != "Add" or len(add.inputs) != 2 or add.inputs.count(value) != 1:
        return None
    return graph.constant(add.inputs[1 - add.inputs.index(value)])


def _match(graph: Graph, softmax: Node, producers: dict, consumers: dict):
    axis = softmax.attrs.get("axis", -1)
    if axis not in (-1, 3) or graph.dtype_of(softmax.inputs[0]) not in FLOAT_TYPES:
        return None
    second = single_consumer(graph, softmax.outputs[0], consumers)
    if second is None or second.op_type != "MatMul" or second.inputs != [softmax.outputs[0], second.inputs[1]] \
            or second.inputs[1] == softmax.outputs[0]:
        return None
    merge = producers.get(softmax.inputs[0])
    merged = _reshape_to(graph, merge, 4)
    if merged is None or single_consumer(graph, merge.outputs[0], consumers) is not softmax:
        return None
    mask_add = producers.get(merge.inputs[0])
    if mask_add is None or single_consumer(graph, mask_add.outputs[0], consumers) is not merge:
        return None
    split = next((producers.get(i) for i in mask_add.inputs if producers.get(i) is not None
                  and producers[i].op_type == "Reshape"), None)
    windowed = _reshape_to(graph, split, 5)
    mask = None if split is None else _constant_other(graph, mask_add, split.outputs[0])
    if windowed is None or mask is None or single_consumer(graph, split.outputs[0], consumers) is not mask_add:
        return None
    _, windows, heads, rows, cols = windowed
    if merged != [-1, heads, rows, cols] or rows != cols:
        return None
    matched = [softmax, merge, mask_add, split]
    value, reader, bias = split.inputs[0], split, np.zeros((1, 1, 1, 1), np.float32)
    bias_add = producers.get(value)
    relative = None if bias_add is None else _constant_other(
        graph, bias_add, next((i for i in bias_add.inputs if not graph.is_constant(i)), ""))
    if relative is not None and single_consumer(graph, value, consumers) is split:
        bias = relative
        matched.append(bias_add)
        value, reader = next(i for i in bias_add.inputs if not graph.is_constant(i)), bias_add
    found = scaled_operands(graph, value, reader, producers, consumers, matched)
    if found is None:
        return None
    q, k_t, scale = found
    v = second.inputs[1]
    if any(graph.shape_of(name) is None or len(graph.shape_of(name)) != 4 for name in (q, k_t, v)):
        return None
    # The bias must not vary over the images (its leading dims of one), nor the mask over heads.
    if bias.ndim > 4 or (bias.ndim == 4 and bias.shape[0] != 1) or mask.ndim > 5 \
            or (mask.ndim == 5 and mask.shape[0] != 1) or not math.isfinite(scale):
        return None
    try:
        combined = (bias.reshape((1,) * (5 - bias.ndim) + bias.shape).astype(np.float32)
                    + mask.reshape((1,) * (5 - mask.ndim) + mask.shape).astype(np.float32))
        combined = np.broadcast_to(combined, np.broadcast_shapes(combined.shape, (1, windows, 1, rows, cols)))
    except ValueError:
        return None
    if combined.shape[0] != 1 or combined.shape[1] not in (1, windows) or combined.shape[2] not in (1, heads) \
            or combined.shape[3:] not in ((1, 1), (1, cols), (rows, 1), (rows, cols)):
        return None
    matched.append(second)
    bias_name = graph.fresh_name(softmax.name + "_window_attention_bias")
    graph.initializers[bias_name] = np.ascontiguousarray(combined, dtype=np.result_type(bias.dtype, mask.dtype))
    fused = Node("Attention", graph.fresh_name(softmax.name + "_window_attention"), [q, k_t, v, bias_name],
                 [second.outputs[0]], {"scale": float(scale), "windows": windows},
                 origin=[o for n in matched for o in n.origin])
    return fused, matched


def fuse_window_attention(graph: Graph) -> int:
    return replace_softmax_blocks(graph, _match)
