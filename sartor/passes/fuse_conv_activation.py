"""Conv(+bias) followed by an activation becomes one FusedConv with an activation epilogue.

Activations: Relu, Sigmoid, Tanh, HardSwish, HardSigmoid, LeakyRelu, Clip (Relu6), Gelu, and
SiLU written as x * sigmoid(x).
"""
from __future__ import annotations

from ..ir import Graph, Node
from .base import scalar_constant, single_consumer

FUSABLE_PRODUCERS = ("Conv", "FusedConv", "Gemm", "FusedGemm")


def _activation_of(graph: Graph, node: Node) -> tuple | None:
    """(kind, alpha, beta) when `node` is an activation that can become an epilogue."""
    op = node.op_type
    if op in ("Relu", "Sigmoid", "Tanh", "HardSwish"):
        return op, None, None
    if op == "HardSigmoid":
        return op, node.attrs.get("alpha", 0.2), node.attrs.get("beta", 0.5)
    if op == "LeakyRelu":
        return op, node.attrs.get("alpha", 0.01), None
    if op == "Gelu" and node.attrs.get("approximate", "none") == "none":
        return op, None, None
    if op == "Clip":
        bounds = []
        for position, attr in ((1, "min"), (2, "max")):
            if len(node.inputs) > position and node.inputs[position]:
                value = scalar_constant(graph, node.inputs[position])
                if value is None:
                    return None
                bounds.append(value)
            else:
                bounds.append(node.attrs.get(attr))
        if bounds[0] is None and bounds[1] is None:
            return None  # an unbounded Clip is an identity, not an epilogue (torch.clamp refuses it)
        return "Clip", bounds[0], bounds[1]
    return None


def _silu_pair(graph: Graph, value: str, consumers: dict) -> tuple[Node, Node] | None:
    """(Sigmoid, Mul) when `value` feeds exactly Sigmoid(value) and Mul(value, that sigmoid)."""
    users = consumers.get(value, [])
    if len(users) != 2 or value in graph.output_names():
        return None
    sigmoid = next((u for u in users if u.op_type == "Sigmoid"), None)
    mul = next((u for u in users if u.op_type == "Mul"), None)
    if sigmoid is None or mul is None:
        return None
    if sorted(mul.inputs) != sorted([value, sigmoid.outputs[0]]):
        return None
    if single_consumer(graph, sigmoid.outputs[0], consumers) is not mul:
        return None
    return sigmoid, mul


def _can_take_activation(node: Node) -> bool:
    if node.attrs.get("activation"):
        return False
    return node.op_type in FUSABLE_PRODUCERS


def _as_fused(node: Node) -> None:
    if node.op_type == "Conv":
        node.op_type = "FusedConv"
    elif node.op_type == "Gemm":
        node.op_type = "FusedGemm"


def fuse_conv_activation(graph: Graph) -> int:
    fused = 0
    for producer in list(graph.nodes):
        if producer not in graph.nodes or not _can_take_activation(producer):
            continue
        if producer.op_type in ("Gemm", "FusedGemm") and len(producer.inputs) > 3:
            continue
        out = producer.outputs[0]
        consumers = graph.consumers()
        silu = _silu_pair(graph, out, consumers)
        if silu is not None:
            kind, alpha, beta = "SiLU", None, None
            removed = list(silu)
        else:
            user = single_consumer(graph, out, consumers)
            if user is None or user.inputs[0] != out:
                continue
            spec = _activation_of(graph, user)
            if spec is None:
                continue
            kind, alpha, beta = spec
            removed = [user]
        last = removed[-1]
        _as_fused(producer)
        producer.attrs = dict(producer.attrs, activation=kind, activation_alpha=alpha, activation_beta=beta)
        producer.outputs = [last.outputs[0]]
        producer.origin = producer.origin + [n for r in removed for n in r.origin]
        for node in removed:
            graph.nodes.remove(node)
        fused += 1
    return fused
