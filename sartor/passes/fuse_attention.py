"""Attention blocks into one `Attention` layer (ops/attention.py):

    MatMul(q', k_t') → scalar Mul/Div … → Add(bias)? → Softmax(last axis) → MatMul(·, v)

q' is q or q scaled by scalar constants (Mul, Div), and so is k_t': torch exports
scaled_dot_product_attention as (q·√s) @ (kᵀ·√s), with √s computed from the head dim, which
`fold_constants` has made a constant when that dim is static. Every scalar folds into `scale`. The
bias is any tensor (LeViT's gathered attention biases, Swin's relative-position bias, masks):
Attention adds it as the Add did, broadcasting either side. A scalar Mul after the Add would scale
the bias too, so the Add must be the Softmax's input. Each intermediate has one reader, inside the pattern, and
is no graph output; the ranks of q, k_t and v must be known and at least 2 (MatMul treats 1-D
operands otherwise), and their dtype floating.

Swin's shifted windows, which add their mask to the scores viewed as [batch, windows, heads, N, N]
through Reshape → Add → Reshape, are fuse_window_attention's (it runs first).
"""
from __future__ import annotations

import math

from ..ir import Graph, Node
from .base import scalar_constant, single_consumer

FLOAT_TYPES = ("float32", "float16", "bfloat16", "float64")


def _rank(graph: Graph, name: str) -> int | None:
    shape = graph.shape_of(name)
    return None if shape is None else len(shape)


def _scalar_factor(graph: Graph, node: Node) -> tuple[str, float] | None:
    """(the scaled input, its factor) when `node` multiplies or divides one tensor by a scalar
    constant that cannot change its shape (a constant of higher rank would broadcast it)."""
    if node.op_type not in ("Mul", "Div") or len(node.inputs) != 2:
        return None
    positions = (0, 1) if node.op_type == "Mul" else (0,)  # Div: only the dividend may be the tensor
    for position in positions:
        data, constant = node.inputs[position], node.inputs[1 - position]
        value = scalar_constant(graph, constant)
        rank = _rank(graph, data)
        if value is None or graph.is_constant(data) or rank is None or graph.constant(constant).ndim > rank:
            continue
        if node.op_type == "Div":
            if value == 0.0:
                return None
            value = 1.0 / value
        return data, value
    return None


def unscaled(graph: Graph, value: str, reader: Node, producers: dict, consumers: dict,
              matched: list) -> tuple[str, float]:
    """`value` with the scalar Mul/Div nodes read only by `reader` (chained) peeled off: (the source,
    the product of their factors); the peeled nodes are appended to `matched`."""
    factor = 1.0
    while True:
        node = producers.get(value)
        found = None if node is None else _scalar_factor(graph, node)
        if found is None or single_consumer(graph, value, consumers) is not reader:
            return value, factor
        value, scale = found
        factor *= scale
        matched.append(node)
        reader = node


def _match(graph: Graph, softmax: Node, producers: dict, consumers: dict) -> tuple[Node, list[Node]] | None:
    """(the Attention node, the nodes it replaces) for the block ending at `softmax`, or None."""
    scores_rank = _rank(graph, softmax.inputs[0])
    axis = softmax.attrs.get("axis", -1)
    if not (axis == -1 or (scores_rank is not None and axis == scores_rank - 1)):
        return None
    if graph.dtype_of(softmax.inputs[0]) not in FLOAT_TYPES:
        return None
    second = single_consumer(graph, softmax.outputs[0], consumers)
    if second is None or second.op_type != "MatMul" or second.inputs[0] != softmax.outputs[0] \
            or second.inputs[1] == softmax.outputs[0]:
        return None
    matched = [softmax]
    value, reader, bias = softmax.inputs[0], softmax, None
    add = producers.get(value)
    if add is not None and add.op_type == "Add" and single_consumer(graph, value, consumers) is softmax:
        for scores_side in (0, 1):
            found = scores_product(graph, add.inputs[scores_side], add, producers, consumers)
            if found is not None:
                bias = add.inputs[1 - scores_side]
                matched.append(add)
                value, reader = add.inputs[scores_side], add
                break
    found = scaled_operands(graph, value, reader, producers, consumers, matched)
    if found is None:
        return None
    q, k_t, scale = found
    v = second.inputs[1]
    if any((_rank(graph, name) or 0) < 2 for name in (q, k_t, v)):
        return None
    if not math.isfinite(scale):
        return None
    matched.append(second)
    inputs = [q, k_t, v] + ([bias] if bias is not None else [])
    fused = Node("Attention", graph.fresh_name(softmax.name + "_attention"), inputs, [second.outputs[0]],
                 {"scale": float(scale)}, origin=[o for n in matched for o in n.origin])
    return fused, matched


def scaled_operands(graph: Graph, value: str, reader: Node, producers: dict, consumers: dict,
                    matched: list) -> tuple[str, str, float] | None:
    """(q, k_t, scale) when `value` is their product q' @ k_t' with every scalar factor on either side
    and after it peeled into `scale`; the product and the peeled nodes are appended to `matched`."""
    found = scores_product(graph, value, reader, producers, consumers)
    if found is None:
        return None
    first, scale_nodes, scale = found
    matched += scale_nodes + [first]
    q, q_scale = unscaled(graph, first.inputs[0], first, producers, consumers, matched)
    k_t, k_scale = unscaled(graph, first.inputs[1], first, producers, consumers, matched)
    return q, k_t, scale * q_scale * k_scale


def scores_product(graph: Graph, value: str, reader: Node, producers: dict,
                    consumers: dict) -> tuple[Node, list[Node], float] | None:
    """(the MatMul q @ k_t, the scalar Mul/Div nodes between it and `reader`, their factor) when
    `value` is that product, each step read only by the next."""
    scale_nodes, factor = [], 1.0
    while True:
        if single_consumer(graph, value, consumers) is not reader:
            return None
        node = producers.get(value)
        if node is None:
            return None
        if node.op_type == "MatMul":
            return node, scale_nodes, factor
        found = _scalar_factor(graph, node)
        if found is None:
            return None
        value, scale = found
        factor *= scale
        scale_nodes.append(node)
        reader = node


def replace_softmax_blocks(graph: Graph, match) -> int:
    """For each Softmax, `match(graph, softmax, producers, consumers)` → (the fused node, the nodes it
    replaces, the last of them the block's final MatMul) or None; the fused node takes that MatMul's
    place. Returns how many blocks were replaced."""
    rewrites = 0
    for softmax in [n for n in graph.nodes if n.op_type == "Softmax"]:
        if softmax not in graph.nodes:
            continue
        found = match(graph, softmax, graph.producers(), graph.consumers())
        if found is None:
            continue
        fused, matched = found
        graph.nodes.insert(graph.nodes.index(matched[-1]), fused)
        for node in matched:
            graph.nodes.remove(node)
        rewrites += 1
    return rewrites


def fuse_attention(graph: Graph) -> int:
    return replace_softmax_blocks(graph, _match)
