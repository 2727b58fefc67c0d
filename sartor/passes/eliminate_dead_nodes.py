"""Remove nodes whose outputs nobody reads, and weights nobody uses."""
from __future__ import annotations

from ..ir import Graph


def eliminate_dead_nodes(graph: Graph) -> int:
    live = set(graph.output_names())
    kept = []
    for node in reversed(graph.nodes):
        if any(out in live for out in node.outputs if out):
            kept.append(node)
            live.update(node.present_inputs())
    removed = len(graph.nodes) - len(kept)
    graph.nodes = list(reversed(kept))
    before = len(graph.initializers)
    graph.remove_unused_initializers()
    return removed + (before - len(graph.initializers))
