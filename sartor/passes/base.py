"""What every pass shares: the signature, graph surgery helpers and the pipeline runner."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from ..ir import Graph, Node, verify_graph

# A pass rewrites the graph in place and returns how many rewrites it made, so that tests can
# assert it fired (or did not) and the build log can say what each pass did.
Pass = Callable[[Graph], int]


@dataclass
class PipelineReport:
    rewrites: dict = field(default_factory=dict)  # pass name -> rewrites
    notes: list = field(default_factory=list)  # build-log lines about what the passes did (Q/DQ models)

    def total(self) -> int:
        return sum(self.rewrites.values())


def run_passes(graph: Graph, passes: list[Pass], verify: bool = False, max_rounds: int = 4) -> PipelineReport:
    """Run the passes in order, repeating the sequence until nothing changes (bounded)."""
    report = PipelineReport()
    for _ in range(max_rounds):
        changed = 0
        for rewrite in passes:
            count = rewrite(graph)
            if count:
                report.rewrites[rewrite.__name__] = report.rewrites.get(rewrite.__name__, 0) + count
                changed += count
            if verify:
                verify_graph(graph)
        if not changed:
            break
    return report


def single_consumer(graph: Graph, value: str, consumers: dict | None = None) -> Node | None:
    """The only node reading `value`, if exactly one does and it is not a graph output."""
    if value in graph.output_names():
        return None
    users = (consumers or graph.consumers()).get(value, [])
    if len(users) != 1:
        return None
    return users[0]


def bypass(graph: Graph, node: Node, source: str) -> bool:
    """Remove `node`, whose first output equals `source`, rewiring its readers to `source`.

    When the output is a graph output the public name must survive, so the producer of `source`
    is renamed instead; that is only possible when `source` is produced by a node that feeds
    nothing else. Returns False (and changes nothing) when the node cannot go.
    """
    out = node.outputs[0]
    if out in graph.output_names():
        producer = graph.producers().get(source)
        if producer is None or source in graph.output_names() or len(graph.consumers().get(source, [])) != 1:
            return False
        producer.outputs = [out if o == source else o for o in producer.outputs]
        graph.nodes.remove(node)
        _move_value_info(graph, source, out)
        return True
    graph.nodes.remove(node)
    graph.replace_uses(out, source)
    return True


def _move_value_info(graph: Graph, old: str, new: str) -> None:
    if old in graph.value_info and new not in graph.value_info:
        info = graph.value_info.pop(old)
        info.name = new
        graph.value_info[new] = info


def scalar_constant(graph: Graph, name: str) -> float | None:
    array = graph.constant(name)
    if array is None or array.size != 1:
        return None
    return float(array.reshape(-1)[0])
