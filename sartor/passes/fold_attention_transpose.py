"""An Attention layer's output Transpose into the layer (ops/attention.py, `rows_before_heads`).

Transformers merge the heads back into the channels after attention:

    Attention → [..., heads, L, Dv] → Transpose (heads ⇄ rows) → [..., L, heads, Dv] → Reshape [..., L, C]

The Transpose is a view, so the Reshape after it copies the whole output (Swin-T: one copy per
attention layer). With `rows_before_heads` the layer writes [..., L, heads, Dv] itself (the
one-kernel tactic stores it so directly), and the Reshape after it becomes a view.

It fires where the Transpose swaps the last-but-two and last-but-one dims and keeps every other, and
is the only reader of the layer's output (which is no graph output).
"""
from __future__ import annotations

from ..ir import Graph, Node
from .base import single_consumer


def _swaps_heads_and_rows(perm: list | None, rank: int | None) -> bool:
    if perm is None or rank is None or rank < 3 or len(perm) != rank:
        return False
    return list(perm) == list(range(rank - 3)) + [rank - 2, rank - 3, rank - 1]


def fold_attention_transpose(graph: Graph) -> int:
    folded = 0
    consumers = graph.consumers()
    for attention in [n for n in graph.nodes if n.op_type == "Attention"]:
        transpose = single_consumer(graph, attention.outputs[0], consumers)
        shape = graph.shape_of(attention.outputs[0])
        if attention.attrs.get("rows_before_heads") or transpose is None or transpose.op_type != "Transpose" \
                or not _swaps_heads_and_rows(transpose.attrs.get("perm"), None if shape is None else len(shape)):
            continue
        fused = Node("Attention", attention.name, list(attention.inputs), [transpose.outputs[0]],
                     dict(attention.attrs, rows_before_heads=1), origin=list(attention.origin) + list(transpose.origin))
        graph.nodes[graph.nodes.index(attention)] = fused
        graph.nodes.remove(transpose)
        folded += 1
    return folded
