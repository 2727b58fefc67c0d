"""ONNX import: opset conversion into 11–21, Constant nodes as weights, symbolic dims."""
from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

from sartor.errors import UnsupportedModelError
from sartor.frontend import import_model_proto
from sartor.frontend.onnx import MAX_OPSET, MIN_OPSET, OLD_OPSET_TARGET
from sartor.ops.util import tensor_from_numpy
from sartor.runtime.executor import Executor


def _model(opset: int, nodes: list, inits: list, out_shape: list, ir_version: int = 7) -> onnx.ModelProto:
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 3, 8, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, out_shape)], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=ir_version)


def _run(graph, x):
    weights = {k: tensor_from_numpy(v) for k, v in graph.initializers.items()}
    return Executor(graph, weights, torch.device("cpu")).run({"x": torch.from_numpy(x)})["y"].numpy()


def _conv_relu_softmax(opset: int) -> onnx.ModelProto:
    rng = np.random.default_rng(0)
    w = numpy_helper.from_array(rng.standard_normal((4, 3, 3, 3)).astype(np.float32), "w")
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c"], ["r"]),
             helper.make_node("Flatten", ["r"], ["f"], axis=1),
             helper.make_node("Softmax", ["f"], ["y"], axis=1)]
    return _model(opset, nodes, [w], ["batch", 256])


@pytest.mark.parametrize("opset", [9, 10])
def test_older_opsets_are_converted_and_match_onnxruntime(opset):
    model = _conv_relu_softmax(opset)
    graph = import_model_proto(model)
    assert graph.opset == OLD_OPSET_TARGET
    x = np.random.default_rng(1).random((2, 3, 8, 8), dtype=np.float32)
    expected = ort.InferenceSession(model.SerializeToString()).run(None, {"x": x})[0]
    np.testing.assert_allclose(_run(graph, x), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("opset", [MIN_OPSET, 13, 17, MAX_OPSET])
def test_supported_opsets_import_as_they_are(opset):
    graph = import_model_proto(_conv_relu_softmax(opset))
    assert graph.opset == opset


def test_softmax_before_opset_13_flattens_trailing_dims():
    nodes = [helper.make_node("Softmax", ["x"], ["y"], axis=1)]
    model = _model(11, nodes, [], ["batch", 3, 8, 8])
    x = np.random.default_rng(2).random((2, 3, 8, 8), dtype=np.float32)
    expected = ort.InferenceSession(model.SerializeToString()).run(None, {"x": x})[0]
    np.testing.assert_allclose(_run(import_model_proto(model), x), expected, rtol=1e-5, atol=1e-7)


def test_constant_nodes_become_weights_and_symbolic_dims_survive():
    value = numpy_helper.from_array(np.full((1, 3, 1, 1), 2.0, np.float32), "k")
    nodes = [helper.make_node("Constant", [], ["k"], value=value), helper.make_node("Mul", ["x", "k"], ["y"])]
    graph = import_model_proto(_model(17, nodes, [], ["batch", 3, 8, 8]))
    assert "k" in graph.initializers and [n.op_type for n in graph.nodes] == ["Mul"]
    assert graph.inputs[0].shape == ("batch", 3, 8, 8)


def test_every_unsupported_node_is_listed_at_once():
    nodes = [helper.make_node("Relu", ["x"], ["a"], name="fine"),
             helper.make_node("Foo", ["a"], ["b"], name="first_bad", domain="custom.domain"),
             helper.make_node("Bar", ["b"], ["y"], name="second_bad", domain="custom.domain")]
    model = helper.make_model(
        helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 3, 8, 8])]),
        opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("custom.domain", 1)])
    with pytest.raises(UnsupportedModelError) as info:
        import_model_proto(model)
    message = str(info.value)
    assert "first_bad" in message and "second_bad" in message and "\n" not in message
