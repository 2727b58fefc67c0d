"""passes/fuse_attention.py: attention blocks become one Attention layer (on hand-made graphs and on
timm's ViT and LeViT as torch exports them) and the numbers still match ONNX Runtime; look-alikes
where a rewrite would be wrong stay as they are."""
from __future__ import annotations

import math

import numpy as np
import onnx
import pytest
import torch

from passes_helpers import (OnnxBuilder, apply_pass, assert_matches_ort, assert_unchanged, import_graph, nodes_of,
                            op_counts)
from sartor.passes import optimize
from sartor.passes.fuse_attention import fuse_attention

HEADS, TOKENS, HEAD_DIM = 2, 6, 8


def attention_inputs(b: OnnxBuilder) -> tuple[str, str, str]:
    """q, k_t (k transposed by a Transpose node, as exporters write it) and v of [N, heads, tokens, dim]."""
    q = b.input("q", ["N", HEADS, TOKENS, HEAD_DIM])
    k = b.input("k", ["N", HEADS, TOKENS, HEAD_DIM])
    v = b.input("v", ["N", HEADS, TOKENS, HEAD_DIM])
    return q, b.node("Transpose", [k], name="k_t", perm=[0, 1, 3, 2]), v


def batch_of_two(b: OnnxBuilder) -> dict:
    """Random feeds for the builder's inputs, their symbolic batch N set to 2."""
    return b.feeds(shapes={name: [2 if d == "N" else d for d in shape] for name, shape in b.input_shapes.items()})


def block(b: OnnxBuilder, scaling: str, bias: str | None, axis: int = -1) -> str:
    """An attention block ending in MatMul(Softmax(...), v), its scale spelled as `scaling`."""
    q, k_t, v = attention_inputs(b)
    root = 1 / math.sqrt(math.sqrt(HEAD_DIM))
    if scaling == "q_and_k":  # torch's export of scaled_dot_product_attention
        q = b.node("Mul", [q, b.const("root_q", np.array([root], dtype=np.float32))], name="scale_q")
        k_t = b.node("Mul", [k_t, b.const("root_k", np.array([root], dtype=np.float32))], name="scale_k")
    scores = b.node("MatMul", [q, k_t], name="scores")
    if scaling == "mul_scores":
        scores = b.node("Mul", [scores, b.scalar(1 / math.sqrt(HEAD_DIM))], name="scale_scores")
    elif scaling == "div_scores":
        scores = b.node("Div", [scores, b.scalar(math.sqrt(HEAD_DIM))], name="scale_scores")
    if bias == "constant":  # LeViT's per-head attention biases
        scores = b.node("Add", [scores, b.weight("bias", [HEADS, TOKENS, TOKENS], scale=2.0)], name="add_bias")
    elif bias == "computed_first":  # a mask computed from an input, as the Add's first operand
        mask = b.node("Mul", [b.input("m", ["N", 1, 1, TOKENS]), b.scalar(-3.0)], name="mask")
        scores = b.node("Add", [mask, scores], name="add_bias")
    probabilities = b.node("Softmax", [scores], name="softmax", axis=axis)
    return b.node("MatMul", [probabilities, v], name="weighted")


@pytest.mark.parametrize("scaling,bias,scale", [
    ("q_and_k", None, 1 / math.sqrt(HEAD_DIM)),
    ("mul_scores", "constant", 1 / math.sqrt(HEAD_DIM)),
    ("div_scores", "computed_first", 1 / math.sqrt(HEAD_DIM)),
    ("none", "constant", 1.0),
])
def test_fuse_attention_fires_on_a_block_and_keeps_the_numbers(scaling, bias, scale):
    b = OnnxBuilder()
    y = b.node("Relu", [block(b, scaling, bias)], name="after")
    model = b.model([y])
    graph, count = apply_pass(model, fuse_attention, expect_fired=True)
    assert count == 1
    (attention,) = nodes_of(graph, "Attention")
    assert attention.inputs[:3] == ["q", "k_t_out", "v"]
    assert (len(attention.inputs) == 4) == (bias is not None)
    assert attention.attrs["scale"] == pytest.approx(scale, rel=1e-6)
    mask = {"Mul": 1} if bias == "computed_first" else {}
    assert op_counts(graph) == {"Transpose": 1, "Attention": 1, "Relu": 1, **mask}
    assert {"scores", "softmax", "weighted"} <= set(attention.origin)
    assert_matches_ort(graph, model, batch_of_two(b))


def look_alike(case: str) -> tuple[onnx.ModelProto, OnnxBuilder]:
    b = OnnxBuilder()
    if case == "softmax_over_another_axis":
        return b.model([block(b, "mul_scores", None, axis=2)]), b
    if case == "softmax_axis_1_of_opset_11":  # opset < 13: softmax over the flattened dims from axis 1
        b = OnnxBuilder(opset=11)
        return b.model([block(b, "mul_scores", None, axis=1)]), b
    if case == "scores_read_twice":
        y = block(b, "mul_scores", None)
        return b.model([y, b.node("Sigmoid", ["scores_out"], name="other_reader")]), b
    if case == "non_scalar_mul":
        q, k_t, v = attention_inputs(b)
        scores = b.node("Mul", [b.node("MatMul", [q, k_t], name="scores"), b.weight("per_key", [TOKENS])],
                        name="scale_per_key")
        return b.model([b.node("MatMul", [b.node("Softmax", [scores], name="softmax", axis=-1), v], name="weighted")]), b
    if case == "mul_after_bias":  # (q·k + bias)·s scales the bias too
        q, k_t, v = attention_inputs(b)
        scores = b.node("Add", [b.node("MatMul", [q, k_t], name="scores"), b.weight("bias", [TOKENS, TOKENS])],
                        name="add_bias")
        scores = b.node("Mul", [scores, b.scalar(0.3)], name="scale_scores")
        return b.model([b.node("MatMul", [b.node("Softmax", [scores], name="softmax", axis=-1), v], name="weighted")]), b
    if case == "softmax_is_a_graph_output":
        y = block(b, "mul_scores", None)
        return b.model([y, "softmax_out"]), b
    if case == "softmax_is_the_second_matmuls_right_operand":  # v^T @ softmax(q·k)
        q, k_t, _ = attention_inputs(b)
        v_t = b.input("v_t", ["N", HEADS, HEAD_DIM, TOKENS])
        probabilities = b.node("Softmax", [b.node("MatMul", [q, k_t], name="scores")], name="softmax", axis=-1)
        return b.model([b.node("MatMul", [v_t, probabilities], name="weighted")]), b
    raise AssertionError(case)


@pytest.mark.parametrize("case", ["softmax_over_another_axis", "softmax_axis_1_of_opset_11", "scores_read_twice",
                                  "non_scalar_mul", "mul_after_bias", "softmax_is_a_graph_output",
                                  "softmax_is_the_second_matmuls_right_operand"])
def test_fuse_attention_must_not_fire(case):
    model, b = look_alike(case)
    assert_unchanged(model, fuse_attention, batch_of_two(b))


def timm_export(name: str, path, **kwargs) -> onnx.ModelProto:
    """A timm model at a small input size, exported as torch.onnx does by default for a dynamic batch."""
    timm = pytest.importorskip("timm")
    size = kwargs["img_size"]
    torch.manual_seed(0)
    model = timm.create_model(name, num_classes=10, pretrained=False, **kwargs).eval()
    with torch.no_grad():
        for parameter_name, parameter in model.named_parameters():
            if "attention_biases" in parameter_name:  # LeViT's start at zero, which adds nothing
                parameter.normal_(std=2.0)
        torch.onnx.export(model, torch.randn(1, 3, size, size), str(path), opset_version=17, dynamo=False,
                          input_names=["input"], output_names=["output"], dynamic_axes={"input": {0: "b"}})
    return onnx.load(str(path))


@pytest.mark.parametrize("name,blocks", [("vit_tiny_patch16_224", 12), ("levit_128s", 11)])
def test_fuse_attention_fires_on_every_block_of_timm_exports(tmp_path, name, blocks):
    # ViT: q·√s and kᵀ·√s with √s from the head dim (Shape → Slice → … folded by fold_constants);
    # LeViT: scores · s + its gathered attention biases.
    model = timm_export(name, tmp_path / f"{name}.onnx", img_size=64)
    graph = import_graph(model)
    report = optimize(graph, verify=True)
    assert report.rewrites.get("fuse_attention") == blocks
    counts = op_counts(graph)
    assert counts.get("Attention") == blocks and "Softmax" not in counts
    if name == "levit_128s":
        # Its linear layers' BatchNorm1d folds into their weights first (fold_matmul_batchnorm).
        assert report.rewrites.get("fold_matmul_batchnorm") == 46 and counts.get("BatchNormalization", 0) <= 2
        assert all(len(n.inputs) == 4 and n.inputs[3] in graph.initializers for n in nodes_of(graph, "Attention"))
    feeds = {"input": np.random.default_rng(0).standard_normal([2, 3, 64, 64]).astype(np.float32)}
    assert_matches_ort(graph, model, feeds, rtol=1e-4)
