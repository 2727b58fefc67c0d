"""passes/fuse_window_attention.py: Swin's shifted-window blocks (scores + relative bias, viewed per
window, + the window mask, viewed back) become one Attention layer with `windows`, on a hand-made
graph and on timm's Swin as torch exports it, keeping ONNX Runtime's numbers; look-alikes where the
bias or mask would vary over the images, or the views do not split the leading dim, stay."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from passes_helpers import (OnnxBuilder, apply_pass, assert_matches_ort, assert_unchanged, import_graph, op_counts,
                            small_timm_swin)
from sartor.ops.attention import attention
from sartor.passes import optimize
from sartor.passes.fuse_window_attention import fuse_window_attention

WINDOWS, HEADS, TOKENS, HEAD_DIM = 3, 2, 4, 8


def windowed_block(b: OnnxBuilder, case: str = "") -> str:
    q = b.input("q", ["BW", HEADS, TOKENS, HEAD_DIM])
    k = b.input("k", ["BW", HEADS, TOKENS, HEAD_DIM])
    v = b.input("v", ["BW", HEADS, TOKENS, HEAD_DIM])
    scaled = b.node("Mul", [q, b.scalar(1 / math.sqrt(HEAD_DIM))], name="scale_q")
    scores = b.node("MatMul", [scaled, b.node("Transpose", [k], name="k_t", perm=[0, 1, 3, 2])], name="scores")
    if case != "no_relative_bias":
        scores = b.node("Add", [scores, b.weight("relative", [1, HEADS, TOKENS, TOKENS], scale=2.0)], name="add_rel")
    split = [-1, WINDOWS, HEADS, TOKENS, TOKENS] if case != "split_other_dim" else [-1, HEADS, WINDOWS, TOKENS, TOKENS]
    viewed = b.node("Reshape", [scores, b.const("split", np.array(split, np.int64))], name="view_windows")
    mask_shape = [2, WINDOWS, 1, TOKENS, TOKENS] if case == "mask_per_image" else [1, WINDOWS, 1, TOKENS, TOKENS]
    if case == "split_other_dim":
        mask_shape = [1, 1, WINDOWS, TOKENS, TOKENS]
    mask = (b.rng.random(mask_shape) < 0.3).astype(np.float32) * -100.0
    masked = b.node("Add", [viewed, b.const("mask", mask)], name="add_mask")
    merged = b.node("Reshape", [masked, b.const("merge", np.array([-1, HEADS, TOKENS, TOKENS], np.int64))],
                    name="view_back")
    return b.node("MatMul", [b.node("Softmax", [merged], name="softmax", axis=-1), v], name="weighted")


def feeds(b: OnnxBuilder, images: int = 2) -> dict:
    return b.feeds(shapes={name: [images * WINDOWS, *shape[1:]] for name, shape in b.input_shapes.items()})


@pytest.mark.parametrize("case", ["", "no_relative_bias"])
def test_fires_and_keeps_the_numbers(case):
    b = OnnxBuilder()
    model = b.model([windowed_block(b, case)])
    graph, count = apply_pass(model, fuse_window_attention, expect_fired=True)
    assert count == 1 and [n.op_type for n in graph.nodes] == ["Transpose", "Attention"]
    fused = graph.nodes[1]
    assert fused.attrs["windows"] == WINDOWS and fused.attrs["scale"] == pytest.approx(1 / math.sqrt(HEAD_DIM))
    assert graph.initializers[fused.inputs[3]].shape == (1, WINDOWS, HEADS if not case else 1, TOKENS, TOKENS)
    assert_matches_ort(graph, model, feeds(b))


@pytest.mark.parametrize("case", ["mask_per_image", "split_other_dim"])
def test_must_not_fire(case):
    b = OnnxBuilder()
    model = b.model([windowed_block(b, case)])
    assert_unchanged(model, fuse_window_attention, feeds(b, images=2 if case == "mask_per_image" else 1))


@pytest.mark.parametrize("tactic", ["torch", "sdpa", "unfused"])
def test_every_tactic_views_the_windows_out_of_the_batch(tactic):
    generator = torch.Generator().manual_seed(0)
    q, k_t, v = (torch.randn(shape, generator=generator) for shape in
                 ((2 * WINDOWS, HEADS, TOKENS, HEAD_DIM), (2 * WINDOWS, HEADS, HEAD_DIM, TOKENS),
                  (2 * WINDOWS, HEADS, TOKENS, HEAD_DIM)))
    bias = torch.randn(1, WINDOWS, HEADS, TOKENS, TOKENS, generator=generator)
    got = attention([q, k_t, v, bias], {"scale": 0.5, "windows": WINDOWS, "tactic": tactic})
    per_image = bias.expand(2, -1, -1, -1, -1).reshape(2 * WINDOWS, HEADS, TOKENS, TOKENS)  # image-major, as Swin's batch
    expected = torch.softmax(q @ k_t * 0.5 + per_image, -1) @ v
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_fires_on_every_shifted_block_of_timm_swin(tmp_path):
    onnx_model = small_timm_swin(tmp_path)
    graph = import_graph(onnx_model)
    report = optimize(graph, verify=True)
    assert report.rewrites.get("fuse_window_attention") == 2  # one shifted block a stage
    assert report.rewrites.get("fuse_attention") == 2 and op_counts(graph).get("Attention") == 4
    assert "Softmax" not in op_counts(graph)
    x = {"input": np.random.default_rng(0).standard_normal([2, 3, 112, 112]).astype(np.float32)}
    assert_matches_ort(graph, onnx_model, x, rtol=1e-4)
