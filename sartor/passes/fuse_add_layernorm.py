"""Fuse a residual Add and the LayerNormalization that reads it into one AddLayerNorm layer, which
writes both the sum (the residual stream later layers read) and its normalised value: one pass over
memory where there were two, the sum not read back. A transformer block has two such pairs.

    s = Add(a, b) → y = LayerNormalization(s, scale[C], bias[C], axis=-1)  ⇒  s, y = AddLayerNorm(a, b, scale, bias)

A Reshape between them that keeps the last axis (C both sides: Swin's [B, H, W, C] sum read as
[B, HW, C]) changes which rows are which, not what is in a row, so the layer normalises the sum
as it is and its output is reshaped as the sum was:

    s = Add(a, b) → r = Reshape(s, shape) → y = LN(r)  ⇒  s, y' = AddLayerNorm(a, b, …); r = Reshape(s, shape); y = Reshape(y', shape)

It does not fire when either addend is a constant (a position embedding: it broadcasts, and the
one-pass kernel takes equal shapes), when the LayerNorm is not over the last axis alone, its scale
or bias is not a constant of one value per channel, or its mean / inverse-deviation outputs are
read. Float builds only (the builder runs it where no layer is planned INT8 or FP8), as
fuse_linear_bias: calibration and the INT8 planner know the two ops apart.
"""
from __future__ import annotations

from ..ir import Graph, Node


def last_axis_only(graph: Graph, layer_norm: Node) -> bool:
    axis = layer_norm.attrs.get("axis", -1)
    if axis == -1:
        return True
    info = graph.value_info.get(layer_norm.inputs[0])
    return info is not None and info.shape is not None and axis == len(info.shape) - 1


def _keeps_last_axis(graph: Graph, reshape: Node) -> bool:
    """Whether the Reshape's input and output end in the same known size."""
    before, after = graph.shape_of(reshape.inputs[0]), graph.shape_of(reshape.outputs[0])
    return bool(before and after and isinstance(before[-1], int) and before[-1] == after[-1])


def per_channel_constant(graph: Graph, name: str) -> bool:
    value = graph.constant(name) if name else None
    return value is not None and value.ndim == 1


def fuse_add_layernorm(graph: Graph) -> int:
    fused = 0
    producers = graph.producers()
    consumers = graph.consumers()
    graph_outputs = set(graph.output_names())
    for layer_norm in list(graph.nodes):
        if layer_norm.op_type != "LayerNormalization" or not last_axis_only(graph, layer_norm):
            continue
        if any(out and (out in graph_outputs or consumers.get(out)) for out in layer_norm.outputs[1:]):
            continue
        add = producers.get(layer_norm.inputs[0])
        view = None
        if add is not None and add.op_type == "Reshape" and _keeps_last_axis(graph, add):
            view, add = add, producers.get(add.inputs[0])
        if add is None or add.op_type != "Add" or len(add.inputs) != 2 or add not in graph.nodes:
            continue
        if any(graph.constant(name) is not None for name in add.inputs):
            continue
        scale = layer_norm.inputs[1]
        bias = layer_norm.inputs[2] if len(layer_norm.inputs) > 2 and layer_norm.inputs[2] else None
        if not per_channel_constant(graph, scale) or (bias is not None and not per_channel_constant(graph, bias)):
            continue
        normed = layer_norm.outputs[0] if view is None else graph.fresh_name(layer_norm.outputs[0] + "_rows")
        node = Node("AddLayerNorm", layer_norm.name, [*add.inputs, scale, *([bias] if bias else [])],
                    [add.outputs[0], normed], attrs={"epsilon": float(layer_norm.attrs.get("epsilon", 1e-5))},
                    origin=add.origin + layer_norm.origin)
        graph.nodes[graph.nodes.index(add)] = node
        if view is None:
            graph.nodes.remove(layer_norm)
        else:  # the normalised sum viewed as the sum was; where the LayerNorm was, its shape is made by then
            graph.nodes[graph.nodes.index(layer_norm)] = Node(
                "Reshape", graph.fresh_name(layer_norm.name + "_view"), [normed, *view.inputs[1:]],
                [layer_norm.outputs[0]], attrs=dict(view.attrs), origin=list(layer_norm.origin))
        producers = graph.producers()
        consumers = graph.consumers()
        fused += 1
    return fused
