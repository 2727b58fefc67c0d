"""passes/eliminate_dead_nodes.py alone: it fires where it should (and the numbers still match ONNX Runtime),
and it leaves the graph alone where a rewrite would be wrong."""
from __future__ import annotations

import numpy as np

from passes_helpers import OnnxBuilder, assert_matches_ort, apply_pass, assert_unchanged
from sartor.passes.eliminate_dead_nodes import eliminate_dead_nodes


def test_eliminate_dead_nodes_removes_dead_branch_and_unused_weights():
    b = OnnxBuilder()
    x = b.input("x", [2, 3])
    live = b.node("Relu", [x], name="live")
    dead = b.node("Mul", [x, b.weight("dead_w", [3])], name="dead_mul")
    b.node("Sigmoid", [dead], name="dead_sigmoid")
    b.weight("never_used", [5])
    model = b.model([live])
    graph, count = apply_pass(model, eliminate_dead_nodes, expect_fired=True)
    assert count == 4  # two nodes + two weights
    assert [n.name for n in graph.nodes] == ["live"]
    assert not graph.initializers
    assert_matches_ort(graph, model, b.feeds())


def test_eliminate_dead_nodes_keeps_node_with_partly_used_outputs():
    b = OnnxBuilder()
    x = b.input("x", [2, 6])
    first, _unused = b.node("Split", [x, b.const("split", np.array([3, 3], dtype=np.int64))],
                            name="split", outputs=2, axis=1)
    y = b.node("Relu", [first], name="relu")
    model = b.model([y])
    assert_unchanged(model, eliminate_dead_nodes, b.feeds())
