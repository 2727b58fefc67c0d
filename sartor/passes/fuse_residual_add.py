"""Add(conv_out, other) becomes a residual input of the FusedConv, added in its epilogue.

When the conv already has an activation the residual is added after it (YOLO bottlenecks);
otherwise before, so a following activation can still fuse (ResNet blocks).
"""
from __future__ import annotations

from ..ir import Graph, Node, topological_order
from .base import single_consumer


def _same_known_shape(graph: Graph, a: str, b: str, producers: dict | None = None) -> bool:
    sa, sb = graph.shape_of(a), graph.shape_of(b)
    if sa is not None and sb is not None and len(sa) == len(sb) and all(x == y for x, y in zip(sa, sb)):
        return True
    # Shape inference names every unknown dim afresh ("unk__4" vs "unk__8"), so with dynamic H/W
    # equal shapes only show after following shape-preserving convs back to a common value.
    producers = producers if producers is not None else graph.producers()
    sa, sb = _traced_shape(graph, a, producers), _traced_shape(graph, b, producers)
    return sa is not None and sb is not None and len(sa) == len(sb) and all(x == y for x, y in zip(sa, sb))


def _preserves_spatial(graph: Graph, node: Node) -> bool:
    """A Conv with stride 1 whose padding keeps every spatial size (3x3 pad 1, 1x1, 'SAME')."""
    weight = graph.constant(node.inputs[1]) if len(node.inputs) > 1 else None
    if weight is None or weight.ndim < 3:
        return False
    kernel = list(weight.shape[2:])
    n = len(kernel)
    strides = list(node.attrs.get("strides") or [1] * n)
    dilations = list(node.attrs.get("dilations") or [1] * n)
    if any(s != 1 for s in strides):
        return False
    auto_pad = node.attrs.get("auto_pad", "NOTSET")
    if auto_pad in ("SAME_UPPER", "SAME_LOWER"):
        return True
    if auto_pad == "VALID":
        return all(k == 1 for k in kernel)
    pads = list(node.attrs.get("pads") or [0] * (2 * n))
    return all(pads[i] + pads[i + n] == d * (k - 1) for i, (k, d) in enumerate(zip(kernel, dilations)))


def _traced_shape(graph: Graph, value: str, producers: dict, depth: int = 64) -> tuple | None:
    """The shape of `value`, written in the dims of the first value up a chain of shape-preserving
    convs (batch and spatial dims pass through; channels come from the weight)."""
    node = producers.get(value)
    if depth and node is not None and node.op_type in ("Conv", "FusedConv") and _preserves_spatial(graph, node):
        source = _traced_shape(graph, node.inputs[0], producers, depth - 1)
        if source is not None and len(source) >= 3:
            return (source[0], int(graph.constant(node.inputs[1]).shape[0])) + tuple(source[2:])
    return graph.shape_of(value)


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
        if not _same_known_shape(graph, conv.outputs[0], other, producers):
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
