"""passes/cleanup_reshapes.py alone: it fires where it should (and the numbers still match ONNX Runtime),
and it leaves the graph alone where a rewrite would be wrong."""
from __future__ import annotations

import numpy as np
import pytest

from passes_helpers import OnnxBuilder, assert_matches_ort, nodes_of, apply_pass, assert_unchanged
from sartor.passes.cleanup_reshapes import cleanup_reshapes


def test_cleanup_reshapes_collapses_reshape_chains():
    b = OnnxBuilder()
    x = b.input("x", ["N", 3, 4, 2])
    r = b.node("Relu", [x], name="relu")
    flat = b.node("Flatten", [r], name="flatten", axis=1)
    first = b.node("Reshape", [flat, b.const("s1", np.array([-1, 6, 4], np.int64))], name="reshape1")
    second = b.node("Reshape", [first, b.const("s2", np.array([-1, 4, 6], np.int64))], name="reshape2")
    model = b.model([b.node("Sigmoid", [second], name="sigmoid")])
    graph, count = apply_pass(model, cleanup_reshapes, expect_fired=True)
    assert count == 2
    assert [n.op_type for n in graph.nodes] == ["Relu", "Reshape", "Sigmoid"]
    reshape = graph.nodes[1]
    assert reshape.inputs[0] == r and reshape.origin == ["flatten", "reshape1", "reshape2"]
    assert_matches_ort(graph, model, b.feeds(shapes={"x": [2, 3, 4, 2]}))


@pytest.mark.parametrize("perms", [([0, 2, 3, 1], [0, 3, 1, 2]), ([1, 0, 2, 3], [0, 2, 3, 1]),
                                   ([3, 2, 1, 0], [2, 0, 3, 1])])
def test_cleanup_reshapes_composes_transposes(perms):
    b = OnnxBuilder()
    x = b.input("x", [2, 3, 4, 5])
    t1 = b.node("Transpose", [b.node("Relu", [x], name="relu")], name="t1", perm=perms[0])
    t2 = b.node("Transpose", [t1], name="t2", perm=perms[1])
    model = b.model([b.node("Sigmoid", [t2], name="sigmoid")])
    graph, count = apply_pass(model, cleanup_reshapes, expect_fired=True)
    assert count == 1
    transposes = nodes_of(graph, "Transpose")
    assert len(transposes) == 1 and transposes[0].origin == ["t1", "t2"]
    assert_matches_ort(graph, model, b.feeds())


def test_cleanup_reshapes_drops_noop_reshape():
    b = OnnxBuilder()
    x = b.input("x", [2, 3, 4])
    r = b.node("Relu", [x], name="relu")
    same = b.node("Reshape", [r, b.const("same", np.array([2, -1, 4], np.int64))], name="reshape_same")
    model = b.model([b.node("Sigmoid", [same], name="sigmoid")])
    graph, count = apply_pass(model, cleanup_reshapes, expect_fired=True)
    assert count == 1 and [n.op_type for n in graph.nodes] == ["Relu", "Sigmoid"]
    assert_matches_ort(graph, model, b.feeds())


@pytest.mark.parametrize("case", ["second_shape_has_zero", "first_read_twice", "first_is_output",
                                  "transpose_read_twice", "dynamic_noop_candidate"])
def test_cleanup_reshapes_must_not_fire(case):
    b = OnnxBuilder()
    x = b.input("x", ["N", 3, 8] if case == "dynamic_noop_candidate" else [2, 3, 8])
    r = b.node("Relu", [x], name="relu")
    outputs = []
    if case == "second_shape_has_zero":  # 0 copies dim 0 of reshape1's output (3), not of x (2)
        first = b.node("Reshape", [r, b.const("s1", np.array([3, 16], np.int64))], name="reshape1")
        outputs.append(b.node("Reshape", [first, b.const("s2", np.array([0, 4, -1], np.int64))], name="reshape2"))
    elif case in ("first_read_twice", "first_is_output"):
        first = b.node("Reshape", [r, b.const("s1", np.array([6, 8], np.int64))], name="reshape1")
        outputs.append(b.node("Reshape", [first, b.const("s2", np.array([8, 6], np.int64))], name="reshape2"))
        outputs.append(first if case == "first_is_output" else b.node("Sigmoid", [first], name="sigmoid"))
    elif case == "transpose_read_twice":
        first = b.node("Transpose", [r], name="t1", perm=[0, 2, 1])
        outputs.append(b.node("Transpose", [first], name="t2", perm=[2, 1, 0]))
        outputs.append(b.node("Sigmoid", [first], name="sigmoid"))
    else:  # the input shape has a symbolic dim, so "same shape" cannot be proven
        reshaped = b.node("Reshape", [r, b.const("s", np.array([-1, 3, 8], np.int64))], name="reshape")
        outputs.append(b.node("Sigmoid", [reshaped], name="sigmoid"))
    model = b.model(outputs)
    assert_unchanged(model, cleanup_reshapes, b.feeds(shapes={"x": [2, 3, 8]}))
