"""passes/fold_matmul_batchnorm.py alone: a BatchNormalization after a MatMul with a constant weight
(LeViT's Linear + BatchNorm1d over the flattened tokens) folds into the weight and one Add, and the
numbers still match ONNX Runtime; look-alikes where the channels are not the MatMul's columns, a
value is read twice or the statistics are not constants stay as they are."""
from __future__ import annotations

import pytest

from passes_helpers import OnnxBuilder, apply_pass, assert_matches_ort, assert_unchanged
from sartor.passes.fold_matmul_batchnorm import fold_matmul_batchnorm


def _levit_linear(b: OnnxBuilder, flatten: bool):
    """x [N, T, 8] @ W [8, 6] → Flatten(axis=2) → [N·T, 6] → BatchNormalization (or 2-D without Flatten)."""
    x = b.input("x", ["N", 5, 8] if flatten else ["N", 8])
    m = b.node("MatMul", [x, b.weight("w", [8, 6])], name="linear")
    if flatten:
        shape = b.node("Shape", [m], name="shape")  # LeViT's reshape_as reads the product's shape
        m = b.node("Flatten", [m], name="flatten", axis=2)
        return b.node("Reshape", [b.batchnorm(m, 6, "bn"), shape], name="unflatten")
    return b.batchnorm(m, 6, "bn")


@pytest.mark.parametrize("flatten", [True, False])
def test_folds_and_keeps_the_numbers(flatten):
    b = OnnxBuilder()
    y = b.node("Relu", [_levit_linear(b, flatten)], name="relu")
    model = b.model([y])
    graph, count = apply_pass(model, fold_matmul_batchnorm, expect_fired=True)
    assert count == 1
    assert [n.op_type for n in graph.nodes if n.op_type != "Shape"] == (
        ["MatMul", "Add", "Flatten", "Reshape", "Relu"] if flatten else ["MatMul", "Add", "Relu"])
    assert graph.nodes[0].origin == ["linear", "bn"]
    assert not {"bn_scale", "bn_bias", "bn_mean", "bn_var"} & set(graph.initializers)  # statistics dropped
    assert_matches_ort(graph, model, b.feeds(shapes={"x": [3, 5, 8] if flatten else [3, 8]}))


@pytest.mark.parametrize("case", ["channels_not_columns", "product_read_twice", "flattened_product_read_twice", "weight_not_constant",
                                  "mean_not_constant", "flatten_mixes_last_dim"])
def test_must_not_fire(case):
    b = OnnxBuilder()
    outputs = []
    if case == "channels_not_columns":
        # BatchNorm1d over [N, C, L]: its channels are the MatMul's rows of tokens, not its columns.
        x = b.input("x", [2, 6, 8])
        m = b.node("MatMul", [x, b.weight("w", [8, 8])], name="linear")
        outputs.append(b.batchnorm(m, 6, "bn"))
    elif case == "flattened_product_read_twice":
        x = b.input("x", [2, 5, 8])
        m = b.node("MatMul", [x, b.weight("w", [8, 6])], name="linear")
        f = b.node("Flatten", [m], name="flatten", axis=2)
        outputs += [b.batchnorm(f, 6, "bn"), b.node("Sigmoid", [m], name="sigmoid")]
    elif case == "flatten_mixes_last_dim":
        x = b.input("x", [2, 3, 4])
        m = b.node("MatMul", [x, b.weight("w", [4, 4])], name="linear")
        f = b.node("Flatten", [m], name="flatten", axis=1)  # [2, 12]: channels of 3x4
        outputs.append(b.batchnorm(f, 12, "bn"))
    else:
        x = b.input("x", [4, 8])
        w = b.input("w", [8, 6]) if case == "weight_not_constant" else b.weight("w", [8, 6])
        m = b.node("MatMul", [x, w], name="linear")
        if case == "mean_not_constant":
            bn = b.node("BatchNormalization", [m, b.weight("s", [6], 1.0, 0.5), b.weight("bb", [6]), b.input("mean", [6]),
                                               b.weight("v", [6], 1.0, 0.5)], name="bn")
        else:
            bn = b.batchnorm(m, 6, "bn")
        outputs.append(bn)
        if case == "product_read_twice":
            outputs.append(b.node("Sigmoid", [m], name="sigmoid"))
    assert_unchanged(b.model(outputs), fold_matmul_batchnorm)
