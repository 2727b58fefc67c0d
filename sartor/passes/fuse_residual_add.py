"""Add(conv_out, other) becomes a residual input of the FusedConv, added in its epilogue.

When the conv already has an activation the residual is added after it (YOLO bottlenecks);
otherwise before, so a following activation can still fuse (ResNet blocks).
"""
from __future__ import annotations

from ..ir import Graph, Node, topological_order
from .base import single_consumer


def _same_known_shape(graph: Graph, a: str, b: str) -> bool:
    sa, sb = graph.shape_of(a), graph.shape_of(b)
    return sa is not None and sb is not None and len(sa) == len(sb) and all(
        x == y for x, y in zip(sa, sb))


def _conv_input_order(graph: Graph, add: Node, producers: dict) -> tuple[Node, str] | None:
    for conv_pos in (0, 1):
        conv = producers.get(add.inputs[conv_pos])
        other = add.inputs[1 - conv_pos]
        if conv is None or conv.op_type not in ("Conv", "FusedConv"):
            continue
        if len(conv.inputs) > 3 or graph.is_constant(other):
            continue
        if single_consumer(graph, conv.outputs[0]) is not add:
            continue
        if not _same_known_shape(graph, conv.outputs[0], other):
            continue
        return conv, other
    return None


def fuse_residual_add(graph: Graph) -> int:
    fused = 0
    for add in list(graph.nodes):
        if add.op_type != "Add" or len(add.inputs) != 2:
            continue
        found = _conv_input_order(graph, add, graph.producers())
        if found is None:
            continue
        conv, other = found
        if graph.producers().get(other) is None and other not in graph.input_names():
            continue
        inputs = conv.inputs + [""] * (3 - len(conv.inputs))
        conv.inputs = inputs[:3] + [other]
        had_activation = bool(conv.attrs.get("activation"))
        conv.op_type = "FusedConv"
        conv.attrs = dict(conv.attrs, residual_after_activation=had_activation)
        conv.outputs = [add.outputs[0]]
        conv.origin = conv.origin + add.origin
        graph.nodes.remove(add)
        fused += 1
    if fused:
        # The residual branch may be computed after the conv in the original order.
        graph.nodes = topological_order(graph.nodes, graph.input_names() + list(graph.initializers))
    return fused
