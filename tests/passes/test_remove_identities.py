"""passes/remove_identities.py alone: it fires where it should (and the numbers still match ONNX Runtime),
and it leaves the graph alone where a rewrite would be wrong."""
from __future__ import annotations

import numpy as np
import pytest

from passes_helpers import OnnxBuilder, assert_matches_ort, nodes_of, apply_pass, assert_unchanged
from sartor.passes.remove_identities import remove_identities

import onnx


def _noop_between(op: str, b: OnnxBuilder, x: str) -> str:
    if op == "Identity":
        return b.node("Identity", [x], name="noop")
    if op == "Dropout":
        return b.node("Dropout", [x], name="noop")
    if op == "Cast":
        return b.node("Cast", [x], name="noop", to=onnx.TensorProto.FLOAT)
    if op == "Transpose":
        return b.node("Transpose", [x], name="noop", perm=[0, 1, 2, 3])
    kind, order = op.split("-")
    neutral = {"Mul": 1.0, "Div": 1.0, "Add": 0.0, "Sub": 0.0}[kind]
    # Neutral constants of several broadcast-compatible shapes (scalar, per-channel, full rank 1s).
    c = b.const("neutral", np.full({"Mul": [], "Add": [1, 4, 1, 1], "Sub": [4, 1, 1], "Div": [1]}[kind],
                                   neutral, dtype=np.float32))
    inputs = [x, c] if order == "x_first" else [c, x]
    return b.node(kind, inputs, name="noop")


@pytest.mark.parametrize("op", ["Identity", "Dropout", "Cast", "Transpose", "Mul-x_first", "Mul-c_first",
                                "Add-x_first", "Add-c_first", "Sub-x_first", "Div-x_first"])
def test_remove_identities_removes(op):
    b = OnnxBuilder()
    x = b.input("x", [1, 4, 5, 5])
    y = b.node("Sigmoid", [_noop_between(op, b, b.node("Relu", [x], name="relu"))], name="sigmoid")
    model = b.model([y])
    graph, count = apply_pass(model, remove_identities, expect_fired=True)
    assert count == 1
    assert [n.name for n in graph.nodes] == ["relu", "sigmoid"]
    assert nodes_of(graph, "Sigmoid")[0].inputs == [nodes_of(graph, "Relu")[0].outputs[0]]
    assert_matches_ort(graph, model, b.feeds())


def test_remove_identities_keeps_public_output_name():
    b = OnnxBuilder()
    x = b.input("x", [2, 3])
    y = b.node("Identity", [b.node("Relu", [x], name="relu")], name="final_identity")
    model = b.model([y])
    graph, count = apply_pass(model, remove_identities, expect_fired=True)
    assert count == 1 and [n.name for n in graph.nodes] == ["relu"]
    assert graph.nodes[0].outputs == [y] and [o.name for o in graph.outputs] == [y]
    assert_matches_ort(graph, model, b.feeds())


@pytest.mark.parametrize("case", ["mul_one_broadcasts_larger", "mul_one_higher_rank", "sub_from_zero",
                                  "div_into_one", "mul_two", "cast_other_dtype", "transpose_perm",
                                  "identity_input_to_output", "identity_output_source_shared"])
def test_remove_identities_must_not_fire(case):
    b = OnnxBuilder()
    x = b.input("x", [1, 1, 5, 5])
    r = b.node("Relu", [x], name="relu")
    if case == "mul_one_broadcasts_larger":  # x * ones(1,4,1,1) has shape (1,4,5,5), not x's
        y = b.node("Mul", [r, b.const("ones", np.ones([1, 4, 1, 1], np.float32))], name="mul")
    elif case == "mul_one_higher_rank":
        y = b.node("Mul", [b.const("ones", np.ones([2, 1, 1, 1, 1], np.float32)), r], name="mul")
    elif case == "sub_from_zero":
        y = b.node("Sub", [b.scalar(0.0), r], name="sub")
    elif case == "div_into_one":
        y = b.node("Div", [b.scalar(1.0), b.node("Add", [r, b.scalar(1.0)], name="add_one")], name="div")
    elif case == "mul_two":
        y = b.node("Mul", [r, b.scalar(2.0)], name="mul")
    elif case == "cast_other_dtype":
        y = b.node("Cast", [b.node("Cast", [r], name="to_half", to=onnx.TensorProto.FLOAT16)], name="to_float",
                   to=onnx.TensorProto.FLOAT)
    elif case == "transpose_perm":
        y = b.node("Transpose", [r], name="transpose", perm=[0, 1, 3, 2])
    elif case == "identity_output_source_shared":
        # The Identity's output is public and Relu's output has another reader: neither can be renamed.
        y = b.node("Identity", [r], name="identity")
        model = b.model([y, b.node("Sigmoid", [r], name="sigmoid")])
        graph = assert_unchanged(model, remove_identities)
        assert [o.name for o in graph.outputs] == [y, "sigmoid_out"]
        return
    else:
        y = b.node("Identity", [x], name="identity")
    model = b.model([y])
    graph = assert_unchanged(model, remove_identities)
    assert [o.name for o in graph.outputs] == [y]
