"""passes/fold_batchnorm.py alone: it fires where it should (and the numbers still match ONNX Runtime),
and it leaves the graph alone where a rewrite would be wrong."""
from __future__ import annotations

import pytest

from passes_helpers import OnnxBuilder, assert_matches_ort, apply_pass, assert_unchanged
from sartor.passes.fold_batchnorm import fold_batchnorm


@pytest.mark.parametrize("conv_bias", [True, False])
@pytest.mark.parametrize("group", [1, 2])
def test_fold_batchnorm_into_conv(conv_bias, group):
    b = OnnxBuilder()
    x = b.input("x", ["N", 4, 6, 6])
    inputs = [x, b.weight("w", [6, 4 // group, 3, 3])] + ([b.weight("cb", [6], 0.1)] if conv_bias else [])
    c = b.node("Conv", inputs, name="conv", pads=[1, 1, 1, 1], group=group)
    y = b.node("Relu", [b.batchnorm(c, 6, "bn", epsilon=1e-3)], name="relu")
    model = b.model([y])
    graph, count = apply_pass(model, fold_batchnorm, expect_fired=True)
    assert count == 1 and [n.op_type for n in graph.nodes] == ["Conv", "Relu"]
    conv = graph.nodes[0]
    assert conv.origin == ["conv", "bn"] and len(conv.present_inputs()) == 3
    assert not any(name.startswith("bn_") for name in graph.initializers)  # BN weights dropped
    assert_matches_ort(graph, model, b.feeds(shapes={"x": [2, 4, 6, 6]}))


@pytest.mark.parametrize("trans_b,alpha,beta,bias_shape", [
    (0, 1.0, 1.0, [5]), (1, 1.0, 1.0, [5]), (1, 0.5, 2.0, [5]), (0, 1.5, 1.0, None),
    (1, 1.0, 1.0, [1, 5]), (0, 2.0, 0.5, [1, 1]), (0, 1.0, 3.0, [])])
def test_fold_batchnorm_into_gemm(trans_b, alpha, beta, bias_shape):
    b = OnnxBuilder()
    x = b.input("x", ["N", 8])
    w = b.weight("w", [5, 8] if trans_b else [8, 5])
    inputs = [x, w] + ([b.weight("gb", bias_shape, 0.1)] if bias_shape is not None else [])
    g = b.node("Gemm", inputs, name="gemm", transB=trans_b, alpha=alpha, beta=beta)
    y = b.batchnorm(g, 5, "bn")
    model = b.model([y])
    graph, count = apply_pass(model, fold_batchnorm, expect_fired=True)
    assert count == 1 and [n.op_type for n in graph.nodes] == ["Gemm"]
    gemm = graph.nodes[0]
    assert gemm.origin == ["gemm", "bn"] and gemm.outputs == [y]
    assert gemm.attrs["alpha"] == 1.0 and gemm.attrs["beta"] == 1.0
    assert_matches_ort(graph, model, b.feeds(shapes={"x": [3, 8]}))


def test_fold_batchnorm_must_not_fold_per_row_gemm_bias():
    """A Gemm bias of shape [M, 1] differs per row: the BN's per-column affine cannot absorb it."""
    b = OnnxBuilder()
    x = b.input("x", [5, 8])
    g = b.node("Gemm", [x, b.weight("w", [8, 5]), b.weight("gb", [5, 1])], name="gemm")
    model = b.model([b.batchnorm(g, 5, "bn")])
    assert_unchanged(model, fold_batchnorm)


@pytest.mark.parametrize("case", ["conv_output_is_graph_output", "conv_output_read_twice", "mean_not_constant",
                                  "producer_not_conv", "weight_not_constant"])
def test_fold_batchnorm_must_not_fire(case):
    b = OnnxBuilder()
    x = b.input("x", [2, 4, 6, 6])
    outputs = []
    if case == "weight_not_constant":
        w = b.input("w", [4, 4, 3, 3])
        c = b.node("Conv", [x, w], name="conv", pads=[1, 1, 1, 1])
    else:
        c = b.conv(x, 4, 4, "conv")
    if case == "producer_not_conv":
        c = b.node("Relu", [c], name="relu")
    if case == "mean_not_constant":
        mean = b.input("mean", [4])
        bn = b.node("BatchNormalization", [c, b.weight("s", [4], 1.0, 0.5), b.weight("bb", [4]), mean,
                                           b.weight("v", [4], 1.0, 0.5)], name="bn")
    else:
        bn = b.batchnorm(c, 4, "bn")
    outputs.append(bn)
    if case == "conv_output_is_graph_output":
        outputs.append(c)
    elif case == "conv_output_read_twice":
        outputs.append(b.node("Sigmoid", [c], name="sigmoid"))
    model = b.model(outputs)
    assert_unchanged(model, fold_batchnorm)
