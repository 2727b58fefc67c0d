"""Fold a RowGather (passes/gather_rows.py) into the LayerNorm beside it, so that no copy of the rows
is left: LayerNorm is row by row, so it may read its rows through the table as well as after it.

    y = LayerNormalization(x) → g = RowGather(y, table)   ⇒  g = GatherLayerNorm(x, scale, bias, table)
    s, y = AddLayerNorm(a, b) → g = RowGather(y, table)   ⇒  s, g = AddLayerNorm(a, b, …, rows=table)
    g = RowGather(p, table) → s, y = AddLayerNorm(a, g)   ⇒  s, y = AddLayerNorm(a, p, …, b_rows=table)

Swin's window partition reads a LayerNorm's output (the first of each block's two) and its window
reverse is the residual operand of the second: both copies go. AddLayerNorm writes its sum as well,
every row once, so its output table must be a permutation of each image's rows (the partition is
one; a crop is not): the kernel normalises sum row table[r] into output row r and stores the sum
row where it belongs. Its residual table may be any.

The LayerNorm must be over the last axis alone with one scale and bias per channel and no
statistics read; the gathered value may be read by nothing else (Shape nodes aside: they read
the LayerNorm's input, or the sum, of equal shape). Float builds only, as the two passes before it.
Whether the kernel reads rows in the table's order or the gather runs apart is the tactics' choice
(`layernorm.r4` or `layernorm.r4.apart`), by timing.
"""
from __future__ import annotations

import numpy as np

from ..ir import Graph, Node
from .fuse_add_layernorm import last_axis_only, per_channel_constant

ROWS_ATTRS = ("rows_in", "shape", "batch_axis")


def _only_reader(graph: Graph, value: str, reader: Node) -> bool:
    """Whether `reader` is the one node reading `value` (Shape nodes aside) and it is no graph output."""
    users = [user for user in graph.consumers().get(value, []) if user.op_type != "Shape"]
    return value not in graph.output_names() and users == [reader]


def _redirect_shapes(graph: Graph, value: str, same_shape: str) -> None:
    for node in graph.nodes:
        if node.op_type == "Shape" and node.inputs[0] == value:
            node.inputs = [same_shape]


def _is_permutation(table: np.ndarray, rows_in: int) -> bool:
    return len(table) == rows_in and np.array_equal(np.sort(table), np.arange(rows_in))


def _plain_layer_norm(graph: Graph, node: Node) -> bool:
    """A LayerNormalization the Triton kernel computes: last axis, per-channel affine, no statistics read."""
    if node.op_type != "LayerNormalization" or not last_axis_only(graph, node):
        return False
    consumers = graph.consumers()
    if any(out and (out in graph.output_names() or consumers.get(out)) for out in node.outputs[1:]):
        return False
    bias = node.inputs[2] if len(node.inputs) > 2 and node.inputs[2] else None
    return per_channel_constant(graph, node.inputs[1]) and (bias is None or per_channel_constant(graph, bias))


def _fold_into_layer_norm(graph: Graph, gather: Node, layer_norm: Node) -> None:
    bias = layer_norm.inputs[2] if len(layer_norm.inputs) > 2 else ""
    fused = Node("GatherLayerNorm", layer_norm.name, [layer_norm.inputs[0], layer_norm.inputs[1], bias, gather.inputs[1]],
                 list(gather.outputs), attrs={"epsilon": float(layer_norm.attrs.get("epsilon", 1e-5)),
                                              **{k: gather.attrs[k] for k in ROWS_ATTRS}},
                 origin=layer_norm.origin + gather.origin)
    _redirect_shapes(graph, layer_norm.outputs[0], layer_norm.inputs[0])
    graph.nodes[graph.nodes.index(gather)] = fused
    graph.nodes.remove(layer_norm)


def _inputs_with(node: Node, position: int, value: str) -> list[str]:
    inputs = list(node.inputs) + [""] * (6 - len(node.inputs))
    inputs[position] = value
    return inputs


def _fold_output_rows(graph: Graph, gather: Node, add_norm: Node) -> bool:
    if len(add_norm.inputs) > 4 and add_norm.inputs[4]:
        return False
    table = graph.constant(gather.inputs[1])
    if table is None or not _is_permutation(table, gather.attrs["rows_in"]):
        return False
    _redirect_shapes(graph, add_norm.outputs[1], add_norm.outputs[0])
    add_norm.inputs = _inputs_with(add_norm, 4, gather.inputs[1])
    add_norm.attrs = dict(add_norm.attrs, **{k: gather.attrs[k] for k in ROWS_ATTRS})
    add_norm.outputs = [add_norm.outputs[0], gather.outputs[0]]
    add_norm.origin = add_norm.origin + gather.origin
    graph.nodes.remove(gather)
    return True


def _fold_residual_rows(graph: Graph, add_norm: Node) -> bool:
    """A RowGather making a or b read through AddLayerNorm's residual table (a and b swap: the sum
    is the same)."""
    if len(add_norm.inputs) > 5 and add_norm.inputs[5]:
        return False
    producers = graph.producers()
    for position in (1, 0):
        gather = producers.get(add_norm.inputs[position])
        # Read by this layer alone, Shape nodes included: the gathered value goes.
        if gather is None or gather.op_type != "RowGather" or gather.outputs[0] in graph.output_names() \
                or graph.consumers().get(gather.outputs[0], []) != [add_norm]:
            continue
        other = add_norm.inputs[1 - position]
        inputs = _inputs_with(add_norm, 1, gather.inputs[0])
        inputs[0], inputs[5] = other, gather.inputs[1]
        add_norm.inputs = inputs
        add_norm.attrs = dict(add_norm.attrs, b_rows_in=gather.attrs["rows_in"], b_shape=gather.attrs["shape"],
                              b_batch_axis=gather.attrs["batch_axis"])
        add_norm.origin = gather.origin + add_norm.origin
        graph.nodes.remove(gather)
        return True
    return False


def _trim(node: Node) -> None:
    """Trailing omitted inputs dropped, as the node had them before."""
    while node.inputs and not node.inputs[-1]:
        node.inputs.pop()


def fuse_layernorm_rows(graph: Graph) -> int:
    fused = 0
    for node in list(graph.nodes):
        if node not in graph.nodes:
            continue
        if node.op_type == "AddLayerNorm" and _fold_residual_rows(graph, node):
            _trim(node)
            fused += 1
            continue
        if node.op_type != "RowGather":
            continue
        source = graph.producers().get(node.inputs[0])
        if source is None or not _only_reader(graph, node.inputs[0], node):
            continue
        if _plain_layer_norm(graph, source):
            _fold_into_layer_norm(graph, node, source)
            fused += 1
        elif source.op_type == "AddLayerNorm" and source.outputs[1] == node.inputs[0] \
                and _fold_output_rows(graph, node, source):
            _trim(source)
            fused += 1
    return fused
