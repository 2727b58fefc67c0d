"""Fuse a residual Add and the LayerNormalization that reads it into one AddLayerNorm layer, which
writes both the sum (the residual stream later layers read) and its normalised value: one pass over
memory where there were two, the sum not read back. A transformer block has two such pairs.

    s = Add(a, b) → y = LayerNormalization(s, scale[C], bias[C], axis=-1)  ⇒  s, y = AddLayerNorm(a, b, scale, bias)

It does not fire when either addend is a constant (a position embedding: it broadcasts, and the
one-pass kernel takes equal shapes), when the LayerNorm is not over the last axis alone, its scale
or bias is not a constant of one value per channel, or its mean / inverse-deviation outputs are
read. Float builds only (the builder runs it where no layer is planned INT8 or FP8), as
fuse_linear_bias: calibration and the INT8 planner know the two ops apart.
"""
from __future__ import annotations

from ..ir import Graph, Node


def _last_axis_only(graph: Graph, layer_norm: Node) -> bool:
    axis = layer_norm.attrs.get("axis", -1)
    if axis == -1:
        return True
    info = graph.value_info.get(layer_norm.inputs[0])
    return info is not None and info.shape is not None and axis == len(info.shape) - 1


def _per_channel_constant(graph: Graph, name: str) -> bool:
    value = graph.constant(name) if name else None
    return value is not None and value.ndim == 1


def fuse_add_layernorm(graph: Graph) -> int:
    fused = 0
    producers = graph.producers()
    consumers = graph.consumers()
    graph_outputs = set(graph.output_names())
    for layer_norm in list(graph.nodes):
        if layer_norm.op_type != "LayerNormalization" or not _last_axis_only(graph, layer_norm):
            continue
        if any(out and (out in graph_outputs or consumers.get(out)) for out in layer_norm.outputs[1:]):
            continue
        add = producers.get(layer_norm.inputs[0])
        if add is None or add.op_type != "Add" or len(add.inputs) != 2 or add not in graph.nodes:
            continue
        if any(graph.constant(name) is not None for name in add.inputs):
            continue
        scale = layer_norm.inputs[1]
        bias = layer_norm.inputs[2] if len(layer_norm.inputs) > 2 and layer_norm.inputs[2] else None
        if not _per_channel_constant(graph, scale) or (bias is not None and not _per_channel_constant(graph, bias)):
            continue
        node = Node("AddLayerNorm", layer_norm.name, [*add.inputs, scale, *([bias] if bias else [])],
                    [add.outputs[0], layer_norm.outputs[0]],
                    attrs={"epsilon": float(layer_norm.attrs.get("epsilon", 1e-5))},
                    origin=add.origin + layer_norm.origin)
        graph.nodes[graph.nodes.index(add)] = node
        graph.nodes.remove(layer_norm)
        producers = graph.producers()
        consumers = graph.consumers()
        fused += 1
    return fused
