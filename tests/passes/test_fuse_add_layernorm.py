"""passes/fuse_add_layernorm.py alone: a residual Add and the LayerNormalization reading it become one
AddLayerNorm layer writing both the sum and the normalised value, with ONNX Runtime's numbers (the
sum read again as a residual, or a graph output); look-alikes stay. The builder runs it for float
builds only."""
from __future__ import annotations

import numpy as np
import onnx
import pytest

import sartor
from passes_helpers import OnnxBuilder, apply_pass, assert_matches_ort, assert_unchanged
from sartor.passes.fuse_add_layernorm import fuse_add_layernorm


def _block(b: OnnxBuilder, case: str = "") -> list[str]:
    """x + branch(x) → LayerNorm → Linear → + the sum again (a transformer block's residual stream)."""
    x = b.input("x", ["N", 5, 8])
    branch = b.node("Tanh", [x], name="branch")
    total = b.node("Add", [x, b.weight("pos", [5, 8]) if case == "constant_addend" else branch], name="residual")
    scale = b.input("scale", [8]) if case == "scale_not_constant" else b.weight("scale", [8], low=0.5)
    inputs = [total, scale] if case == "no_bias" else [total, scale, b.weight("bias", [8])]
    axis = 1 if case == "axis_not_last" else -1
    if case == "axis_not_last":
        inputs = [total, b.weight("scale2", [5, 8], low=0.5)]
    if case == "mean_read":
        normed, mean = b.node("LayerNormalization", inputs, name="norm", outputs=2, axis=axis, epsilon=1e-6)
    else:
        normed, mean = b.node("LayerNormalization", inputs, name="norm", axis=axis, epsilon=1e-6), None
    out = b.node("Add", [b.node("MatMul", [normed, b.weight("w", [8, 8])], name="linear"), total], name="residual2")
    return [out] + ([mean] if mean else [])


@pytest.mark.parametrize("case", ["", "no_bias"])
def test_fuses_and_keeps_the_numbers(case):
    b = OnnxBuilder()
    model = b.model(_block(b, case))
    graph, count = apply_pass(model, fuse_add_layernorm, expect_fired=True)
    assert count == 1 and [n.op_type for n in graph.nodes] == ["Tanh", "AddLayerNorm", "MatMul", "Add"]
    fused = graph.nodes[1]
    assert fused.origin == ["residual", "norm"] and fused.outputs == ["residual_out", "norm_out"]
    assert fused.attrs == {"epsilon": pytest.approx(1e-6)}  # ONNX stores it as a float32
    assert_matches_ort(graph, model, b.feeds(shapes={"x": [2, 5, 8]}))


def test_the_sum_may_be_a_graph_output():
    b = OnnxBuilder()
    x = b.input("x", [3, 8])
    total = b.node("Add", [x, b.node("Relu", [x], name="branch")], name="residual")
    normed = b.node("LayerNormalization", [total, b.weight("scale", [8], low=0.5)], name="norm")
    model = b.model([normed, total])
    graph, _ = apply_pass(model, fuse_add_layernorm, expect_fired=True)
    assert [n.op_type for n in graph.nodes] == ["Relu", "AddLayerNorm"]
    assert_matches_ort(graph, model, b.feeds())


@pytest.mark.parametrize("case", ["constant_addend", "scale_not_constant", "axis_not_last", "mean_read"])
def test_must_not_fire(case):
    b = OnnxBuilder()
    model = b.model(_block(b, case))
    feeds = b.feeds(shapes={"x": [2, 5, 8]})
    assert_unchanged(model, fuse_add_layernorm, feeds)


def test_must_not_fire_on_a_layernorm_of_anything_but_an_add():
    b = OnnxBuilder()
    x = b.input("x", [3, 8])
    normed = b.node("LayerNormalization", [b.node("Mul", [x, x], name="square"), b.weight("scale", [8], low=0.5)],
                    name="norm")
    assert_unchanged(b.model([normed]), fuse_add_layernorm)


def test_builder_fuses_float_builds_only(tmp_path):
    b = OnnxBuilder()
    onnx.save(b.model(_block(b)), tmp_path / "m.onnx")
    shapes = dict(min_shapes={"x": (1, 5, 8)}, opt_shapes={"x": (2, 5, 8)}, max_shapes={"x": (2, 5, 8)})
    float_build = sartor.build(str(tmp_path / "m.onnx"), str(tmp_path / "f.plan"), device="cpu", **shapes)
    assert "AddLayerNorm" in [layer["op"] for layer in float_build.header["layers"]]
    assert "pass fuse_add_layernorm: 1 rewrite(s)" in float_build.log
    calib = np.random.default_rng(0).standard_normal((8, 5, 8)).astype(np.float32)
    int8_build = sartor.build(str(tmp_path / "m.onnx"), str(tmp_path / "q.plan"), device="cpu", precision="int8",
                              calib=calib, **shapes)
    assert "AddLayerNorm" not in [layer["op"] for layer in int8_build.header["layers"]]


def _viewed(b: OnnxBuilder, target: list[int]) -> list[str]:
    """Swin's form: a [N, 4, 6, 8] sum viewed as `target` before its LayerNorm, the view read again."""
    x = b.input("x", ["N", 4, 6, 8])
    total = b.node("Add", [x, b.node("Tanh", [x], name="branch")], name="residual")
    viewed = b.node("Reshape", [total, b.const("shape", np.array(target, np.int64))], name="view")
    normed = b.node("LayerNormalization", [viewed, b.weight("scale", [target[-1]], low=0.5),
                                           b.weight("bias", [target[-1]])], name="norm")
    return [b.node("Add", [normed, viewed], name="residual2")]


def test_fuses_through_a_reshape_that_keeps_the_last_axis():
    b = OnnxBuilder()
    model = b.model(_viewed(b, [-1, 24, 8]))
    graph, count = apply_pass(model, fuse_add_layernorm, expect_fired=True)
    assert count == 1 and [n.op_type for n in graph.nodes] == ["Tanh", "AddLayerNorm", "Reshape", "Reshape", "Add"]
    assert_matches_ort(graph, model, b.feeds(shapes={"x": [2, 4, 6, 8]}))


def test_must_not_fire_through_a_reshape_that_moves_the_last_axis():
    b = OnnxBuilder()
    assert_unchanged(b.model(_viewed(b, [-1, 12, 16])), fuse_add_layernorm, b.feeds(shapes={"x": [2, 4, 6, 8]}))
