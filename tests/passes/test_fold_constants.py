"""passes/fold_constants.py alone: it fires where it should (and the numbers still match ONNX Runtime),
and it leaves the graph alone where a rewrite would be wrong."""
from __future__ import annotations

import numpy as np

from passes_helpers import OnnxBuilder, assert_matches_ort, nodes_of, op_counts, apply_pass, assert_unchanged
from sartor.passes.fold_constants import fold_constants

import onnx


def test_fold_constants_folds_constant_subgraph_and_static_shape():
    b = OnnxBuilder()
    x = b.input("x", [2, 3, 4])
    c = b.node("Add", [b.weight("a", [3, 4]), b.weight("b", [3, 4])], name="const_add")
    c = b.node("Sqrt", [b.node("Abs", [c], name="const_abs")], name="const_sqrt")
    y = b.node("Mul", [x, c], name="mul")
    flat = b.node("Reshape", [y, b.const("flat", np.array([2, 12], dtype=np.int64))], name="flatten")
    back = b.node("Reshape", [flat, b.node("Shape", [x], name="shape_x")], name="unflatten")
    model = b.model([back])
    graph, count = apply_pass(model, fold_constants, expect_fired=True)
    assert count == 4  # Add, Abs, Sqrt, Shape
    assert op_counts(graph) == {"Mul": 1, "Reshape": 2}
    mul = nodes_of(graph, "Mul")[0]
    np.testing.assert_allclose(graph.initializers[mul.inputs[1]],
                               np.sqrt(np.abs(onnx.numpy_helper.to_array(model.graph.initializer[0])
                                              + onnx.numpy_helper.to_array(model.graph.initializer[1]))),
                               rtol=1e-6)
    assert graph.initializers[nodes_of(graph, "Reshape")[1].inputs[1]].tolist() == [2, 3, 4]
    assert "a" not in graph.initializers and "b" not in graph.initializers  # unused weights dropped
    assert_matches_ort(graph, model, b.feeds())


def test_fold_constants_leaves_dynamic_shapes_runtime_values_and_constant_outputs():
    b = OnnxBuilder()
    x = b.input("x", ["N", 3, 4])
    shape = b.node("Shape", [x], name="shape_dynamic")  # batch is symbolic: not foldable
    y = b.node("Reshape", [b.node("Relu", [x], name="relu"), shape], name="reshape")
    const_out = b.node("Neg", [b.weight("w", [3])], name="neg_const")  # feeds a graph output directly
    model = b.model([y, const_out])
    assert_unchanged(model, fold_constants, b.feeds(shapes={"x": [2, 3, 4]}))


def test_fold_constants_folds_the_static_dims_a_slice_or_gather_picks_from_a_dynamic_shape():
    # torch's exported attention scale: Shape(q) → Slice[-1:] → Cast → Sqrt, with a dynamic batch
    b = OnnxBuilder()
    x = b.input("x", ["N", 3, 4])
    shape = b.node("Shape", [x], name="shape_x")
    last = b.node("Slice", [shape, b.const("starts", np.array([-1], dtype=np.int64)),
                            b.const("ends", np.array([2**63 - 1], dtype=np.int64))], name="slice_last")
    scale = b.node("Sqrt", [b.node("Cast", [last], name="cast", to=onnx.TensorProto.FLOAT)], name="sqrt")
    middle = b.node("Gather", [shape, b.const("minus_two", np.array(-2, dtype=np.int64))], name="gather_middle")
    batch = b.node("Gather", [shape, b.const("zero", np.array(0, dtype=np.int64))], name="gather_batch")
    sized = b.node("Reshape", [x, b.node("Concat", [b.node("Unsqueeze", [batch, b.const("axes", np.array([0]))],
                                                                   name="unsqueeze_batch"),
                                                    b.const("rest", np.array([-1], dtype=np.int64))], name="concat",
                                         axis=0)], name="reshape")
    y = b.node("Mul", [b.node("Mul", [sized, scale], name="mul_scale"),
                       b.node("Cast", [middle], name="cast_middle", to=onnx.TensorProto.FLOAT)], name="mul_middle")
    model = b.model([y])
    graph, _ = apply_pass(model, fold_constants, expect_fired=True)
    assert {"Slice", "Sqrt", "Cast"}.isdisjoint(op_counts(graph))  # the head-dim chain is a constant
    assert [n.name for n in nodes_of(graph, "Gather")] == ["gather_batch"]  # the batch stays a run-time value
    np.testing.assert_allclose(graph.initializers[nodes_of(graph, "Mul")[0].inputs[1]], [2.0])
    assert_matches_ort(graph, model, b.feeds(shapes={"x": [2, 3, 4]}))
