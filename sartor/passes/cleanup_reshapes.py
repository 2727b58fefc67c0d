"""Reshape and Transpose cleanup: Reshape∘Reshape → Reshape, Transpose∘Transpose → Transpose
(or nothing), and a Reshape to the shape its input already has disappears."""
from __future__ import annotations

import numpy as np

from ..ir import Graph
from .base import bypass, single_consumer


def _collapse_reshapes(graph: Graph) -> int:
    count = 0
    for second in list(graph.nodes):
        if second.op_type != "Reshape" or second not in graph.nodes:
            continue
        first = graph.producers().get(second.inputs[0])
        if first is None or first.op_type not in ("Reshape", "Flatten", "Squeeze", "Unsqueeze"):
            continue
        if single_consumer(graph, first.outputs[0]) is not second:
            continue
        target = graph.constant(second.inputs[1])
        if target is None or (np.any(target == 0) and not second.attrs.get("allowzero", 0)):
            continue  # a 0 copies a dim of the first reshape's output
        second.inputs = [first.inputs[0], second.inputs[1]]
        second.origin = first.origin + second.origin
        graph.nodes.remove(first)
        count += 1
    return count


def _compose_transposes(graph: Graph) -> int:
    count = 0
    for second in list(graph.nodes):
        if second.op_type != "Transpose" or second not in graph.nodes or second.attrs.get("perm") is None:
            continue
        first = graph.producers().get(second.inputs[0])
        if first is None or first.op_type != "Transpose" or first.attrs.get("perm") is None:
            continue
        if single_consumer(graph, first.outputs[0]) is not second:
            continue
        p1, p2 = list(first.attrs["perm"]), list(second.attrs["perm"])
        second.attrs = dict(second.attrs, perm=[p1[i] for i in p2])
        second.inputs = [first.inputs[0]]
        second.origin = first.origin + second.origin
        graph.nodes.remove(first)
        count += 1
    return count


def _drop_noop_reshapes(graph: Graph) -> int:
    count = 0
    for node in list(graph.nodes):
        if node.op_type != "Reshape":
            continue
        before, after = graph.shape_of(node.inputs[0]), graph.shape_of(node.outputs[0])
        if before is None or after is None or not all(isinstance(d, int) for d in before):
            continue
        if tuple(before) == tuple(after) and bypass(graph, node, node.inputs[0]):
            count += 1
    return count


def cleanup_reshapes(graph: Graph) -> int:
    return _collapse_reshapes(graph) + _compose_transposes(graph) + _drop_noop_reshapes(graph)
