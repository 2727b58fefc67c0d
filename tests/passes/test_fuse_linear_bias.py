"""passes/fuse_linear_bias.py alone: MatMul by a constant weight + the Add of a constant bias along
the last axis becomes one Linear layer with the same numbers as ONNX Runtime (2-D and 3-D inputs,
bias on either side of the Add); look-alikes stay. And the builder runs it for float builds only:
INT8 builds keep the bias-free MatMul the INT8 planner quantizes."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch

import sartor
from passes_helpers import OnnxBuilder, apply_pass, assert_matches_ort, assert_unchanged
from sartor.passes.fuse_linear_bias import fuse_linear_bias


@pytest.mark.parametrize("rank,bias_first,bias_shape", [(2, False, [6]), (3, False, [6]), (3, True, [1, 1, 6]),
                                                        (4, False, [6])])
def test_fuses_and_keeps_the_numbers(rank, bias_first, bias_shape):
    b = OnnxBuilder()
    x = b.input("x", ["N", 3, 2, 8][4 - rank:] if rank > 2 else ["N", 8])
    m = b.node("MatMul", [x, b.weight("w", [8, 6])], name="linear")
    bias = b.weight("b", bias_shape)
    y = b.node("Add", [bias, m] if bias_first else [m, bias], name="add_bias")
    model = b.model([b.node("Relu", [y], name="relu")])
    graph, count = apply_pass(model, fuse_linear_bias, expect_fired=True)
    assert count == 1 and [n.op_type for n in graph.nodes] == ["Linear", "Relu"]
    assert graph.nodes[0].origin == ["linear", "add_bias"]
    shape = [2, 3, 2, 8][4 - rank:] if rank > 2 else [2, 8]
    assert_matches_ort(graph, model, b.feeds(shapes={"x": shape}))


@pytest.mark.parametrize("case", ["per_row_bias", "bias_not_constant", "weight_not_constant", "product_read_twice",
                                  "product_is_output"])
def test_must_not_fire(case):
    b = OnnxBuilder()
    x = b.input("x", [4, 8])
    w = b.input("w", [8, 6]) if case == "weight_not_constant" else b.weight("w", [8, 6])
    m = b.node("MatMul", [x, w], name="linear")
    if case == "per_row_bias":
        bias = b.weight("b", [4, 1])
    elif case == "bias_not_constant":
        bias = b.input("b", [6])
    else:
        bias = b.weight("b", [6])
    outputs = [b.node("Add", [m, bias], name="add_bias")]
    if case == "product_read_twice":
        outputs.append(b.node("Sigmoid", [m], name="sigmoid"))
    if case == "product_is_output":
        outputs.append(m)
    assert_unchanged(b.model(outputs), fuse_linear_bias)


def _linear_model(path):
    b = OnnxBuilder()
    x = b.input("x", ["N", 8])
    y = b.node("Add", [b.node("MatMul", [x, b.weight("w", [8, 6])], name="linear"), b.weight("b", [6])], name="add_bias")
    onnx.save(b.model([b.node("Relu", [y], name="relu")]), path)


def test_builder_fuses_float_builds_only(tmp_path):
    _linear_model(tmp_path / "m.onnx")
    shapes = dict(min_shapes={"x": (1, 8)}, opt_shapes={"x": (4, 8)}, max_shapes={"x": (4, 8)})
    float_build = sartor.build(str(tmp_path / "m.onnx"), str(tmp_path / "f.plan"), device="cpu", precision="fp32", **shapes)
    assert [layer["op"] for layer in float_build.header["layers"]] == ["Linear", "Relu"]
    calib = np.random.default_rng(0).standard_normal((8, 8)).astype(np.float32)
    int8_build = sartor.build(str(tmp_path / "m.onnx"), str(tmp_path / "q.plan"), device="cpu", precision="int8",
                              calib=calib, **shapes)
    assert "Linear" not in [layer["op"] for layer in int8_build.header["layers"]]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_fp16_linear_matches_the_cpu_engine(tmp_path):
    _linear_model(tmp_path / "m.onnx")
    shapes = dict(min_shapes={"x": (1, 8)}, opt_shapes={"x": (4, 8)}, max_shapes={"x": (4, 8)})
    sartor.build(str(tmp_path / "m.onnx"), str(tmp_path / "c.plan"), device="cuda", precision="fp16", **shapes)
    sartor.build(str(tmp_path / "m.onnx"), str(tmp_path / "f.plan"), device="cpu", precision="fp32", **shapes)
    x = np.random.default_rng(1).standard_normal((4, 8)).astype(np.float32)
    got = sartor.load(str(tmp_path / "c.plan")).context().run({"x": x})
    expected = sartor.load(str(tmp_path / "f.plan")).context().run({"x": x})
    (name,) = expected
    np.testing.assert_allclose(got[name], expected[name], rtol=1e-2, atol=1e-2)
