"""Recognise activations that exporters spell out elementwise, so that they can fuse:

    GELU      x * 0.5 * (1 + erf(x / sqrt(2)))   (also x * (0.5 + 0.5 * erf...), Mul orders)
    HardSwish x * clip(x + 3, 0, 6) / 6          (or * (1/6))
"""
from __future__ import annotations

import math

from ..ir import Graph, Node
from .base import scalar_constant, single_consumer

_TOL = 1e-4


def _near(value: float | None, target: float) -> bool:
    return value is not None and abs(value - target) <= _TOL * max(1.0, abs(target))


def _other_input(node: Node, value: str) -> str | None:
    if len(node.inputs) != 2 or value not in node.inputs:
        return None
    return node.inputs[1] if node.inputs[0] == value else node.inputs[0]


def _only_user(graph, value, consumers):
    return single_consumer(graph, value, consumers)


def _match_gelu(graph: Graph, erf: Node, producers: dict, consumers: dict) -> tuple[str, list[Node], str] | None:
    div = producers.get(erf.inputs[0])
    if div is None or div.op_type not in ("Div", "Mul") or graph.is_constant(div.inputs[0]) is True:
        return None
    x = div.inputs[0]
    scale = scalar_constant(graph, div.inputs[1])
    if not (_near(scale, math.sqrt(2.0)) if div.op_type == "Div" else _near(scale, 1 / math.sqrt(2.0))):
        return None
    add = _only_user(graph, erf.outputs[0], consumers)
    if add is None or add.op_type != "Add" or not _near(scalar_constant(graph, _other_input(add, erf.outputs[0]) or ""), 1.0):
        return None
    first = _only_user(graph, add.outputs[0], consumers)
    if first is None or first.op_type != "Mul":
        return None
    partner = _other_input(first, add.outputs[0])
    if partner == x:  # x * (1 + erf) then * 0.5
        half = _only_user(graph, first.outputs[0], consumers)
        if half is None or half.op_type != "Mul" or not _near(scalar_constant(graph, _other_input(half, first.outputs[0]) or ""), 0.5):
            return None
        return x, [div, erf, add, first, half], half.outputs[0]
    if _near(scalar_constant(graph, partner or ""), 0.5):  # (1 + erf) * 0.5 then * x
        last = _only_user(graph, first.outputs[0], consumers)
        if last is None or last.op_type != "Mul" or _other_input(last, first.outputs[0]) != x:
            return None
        return x, [div, erf, add, first, last], last.outputs[0]
    return None


def _match_hardswish(graph: Graph, clip: Node, producers: dict, consumers: dict) -> tuple[str, list[Node], str] | None:
    add = producers.get(clip.inputs[0])
    if add is None or add.op_type != "Add":
        return None
    x = next((i for i in add.inputs if not graph.is_constant(i)), None)
    if x is None or not _near(scalar_constant(graph, _other_input(add, x) or ""), 3.0):
        return None
    lo = scalar_constant(graph, clip.inputs[1]) if len(clip.inputs) > 1 and clip.inputs[1] else clip.attrs.get("min")
    hi = scalar_constant(graph, clip.inputs[2]) if len(clip.inputs) > 2 and clip.inputs[2] else clip.attrs.get("max")
    if not (_near(lo, 0.0) and _near(hi, 6.0)):
        return None
    mul = _only_user(graph, clip.outputs[0], consumers)
    if mul is None or mul.op_type != "Mul" or _other_input(mul, clip.outputs[0]) != x:
        return None
    scale = _only_user(graph, mul.outputs[0], consumers)
    if scale is None or scale.inputs[0] != mul.outputs[0]:
        return None
    factor = scalar_constant(graph, scale.inputs[1])
    if not ((scale.op_type == "Div" and _near(factor, 6.0)) or (scale.op_type == "Mul" and _near(factor, 1 / 6))):
        return None
    if single_consumer(graph, add.outputs[0], consumers) is not clip:
        return None
    return x, [add, clip, mul, scale], scale.outputs[0]


def fuse_activation_patterns(graph: Graph) -> int:
    rewrites = 0
    for anchor in list(graph.nodes):
        if anchor not in graph.nodes or anchor.op_type not in ("Erf", "Clip"):
            continue
        producers, consumers = graph.producers(), graph.consumers()
        matcher, op_type = (_match_gelu, "Gelu") if anchor.op_type == "Erf" else (_match_hardswish, "HardSwish")
        found = matcher(graph, anchor, producers, consumers)
        if found is None:
            continue
        x, matched, out = found
        inner = [n.outputs[0] for n in matched[:-1]]
        # Every intermediate value must die inside the pattern (e.g. x / sqrt(2) read elsewhere).
        matched_ids = {id(n) for n in matched}
        if any(v in graph.output_names() or any(id(u) not in matched_ids for u in consumers.get(v, []))
               for v in inner):
            continue
        position = graph.nodes.index(matched[-1])
        fused = Node(op_type, graph.fresh_name(matched[-1].name + f"_{op_type.lower()}"), [x], [out], {},
                     origin=[o for n in matched for o in n.origin])
        graph.nodes.insert(position, fused)
        for node in matched:
            graph.nodes.remove(node)
        rewrites += 1
    return rewrites
