"""Structural checks that hold after every pass."""
from __future__ import annotations

from ..errors import GraphError
from .graph import Graph


def verify_graph(graph: Graph) -> None:
    """Raise GraphError unless every value has one producer, is defined before use, and outputs exist."""
    defined = set(graph.input_names()) | set(graph.initializers)
    node_names: set[str] = set()
    for node in graph.nodes:
        if node.name in node_names:
            raise GraphError(f"two nodes are named {node.name!r}")
        node_names.add(node.name)
        for name in node.present_inputs():
            if name not in defined:
                raise GraphError(f"node {node.name!r} ({node.op_type}) reads {name!r} before it is defined")
        for out in node.outputs:
            if not out:
                continue
            if out in defined:
                raise GraphError(f"value {out!r} has more than one producer (last: node {node.name!r})")
            defined.add(out)
    for out in graph.outputs:
        if out.name not in defined:
            raise GraphError(f"graph output {out.name!r} is never produced")
