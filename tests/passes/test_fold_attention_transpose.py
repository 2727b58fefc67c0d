"""passes/fold_attention_transpose.py: the Transpose that moves the heads after the rows (before the
Reshape merging them into the channels) folds into the Attention layer, which then writes that
layout; the numbers still match ONNX Runtime, on a hand-made block and on timm's Swin; look-alikes
(another permutation, a second reader of the attention output, the output a graph output) stay."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from passes_helpers import OnnxBuilder, assert_matches_ort, import_graph, nodes_of, op_counts, small_timm_swin
import sartor.ops.attention as attention_op
from sartor.ir.verify import verify_graph
from sartor.kernels.attention.short import short_attention
from sartor.kernels.common.interpreter import kernel_runs_on
from sartor.passes import optimize
from sartor.passes.fold_attention_transpose import fold_attention_transpose
from sartor.passes.fuse_attention import fuse_attention

HEADS, TOKENS, HEAD_DIM = 2, 6, 8
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # CPU: the kernel through Triton's interpreter


def attention_block(b: OnnxBuilder, perm=(0, 2, 1, 3)) -> tuple[str, str]:
    """An exported attention block with a bias, then the Transpose (perm) of its output: (the
    attention output, the transposed value)."""
    q = b.input("q", ["N", HEADS, TOKENS, HEAD_DIM])
    k_t = b.node("Transpose", [b.input("k", ["N", HEADS, TOKENS, HEAD_DIM])], name="k_t", perm=[0, 1, 3, 2])
    v = b.input("v", ["N", HEADS, TOKENS, HEAD_DIM])
    scores = b.node("Mul", [b.node("MatMul", [q, k_t], name="scores"), b.scalar(1 / math.sqrt(HEAD_DIM))], name="scale")
    scores = b.node("Add", [scores, b.weight("bias", [HEADS, TOKENS, TOKENS], scale=2.0)], name="add_bias")
    out = b.node("MatMul", [b.node("Softmax", [scores], name="softmax", axis=-1), v], name="weighted")
    return out, b.node("Transpose", [out], name="heads_after_rows", perm=list(perm))


def merged_heads(b: OnnxBuilder, transposed: str) -> str:
    return b.node("Reshape", [transposed, b.const("merged", np.array([0, TOKENS, HEADS * HEAD_DIM]))], name="merge")


def feeds(b: OnnxBuilder) -> dict:
    return b.feeds(shapes={name: [2 if d == "N" else d for d in shape] for name, shape in b.input_shapes.items()})


def fused(model) -> tuple:
    graph = import_graph(model)
    assert fuse_attention(graph) == 1
    before = [n.op_type for n in graph.nodes]
    count = fold_attention_transpose(graph)
    verify_graph(graph)
    return graph, count, before


def test_fires_on_the_heads_transpose_and_keeps_the_numbers():
    b = OnnxBuilder()
    _, transposed = attention_block(b)
    model = b.model([merged_heads(b, transposed)])
    graph, count, _ = fused(model)
    assert count == 1 and op_counts(graph) == {"Transpose": 1, "Attention": 1, "Reshape": 1}  # k's Transpose stays
    (attention,) = nodes_of(graph, "Attention")
    assert attention.attrs["rows_before_heads"] == 1 and attention.outputs == [transposed]
    assert "heads_after_rows" in attention.origin
    assert_matches_ort(graph, model, feeds(b))


@pytest.mark.parametrize("tactic", ["torch", "sdpa", "unfused", "attention.short.b16.w1"])
def test_every_tactic_writes_rows_before_heads(tactic):
    # The kernel writes the layout itself (through Triton's interpreter on the CPU); the others transpose.
    generator = torch.Generator().manual_seed(0)
    q, k_t, v = (torch.randn(shape, generator=generator).to(DEVICE) for shape in
                 ((3, HEADS, TOKENS, HEAD_DIM), (3, HEADS, HEAD_DIM, TOKENS), (3, HEADS, TOKENS, HEAD_DIM)))
    bias = torch.randn(HEADS, TOKENS, TOKENS, generator=generator).to(DEVICE)
    plain = attention_op.attention([q, k_t, v, bias], {"scale": 0.3, "tactic": "torch"})
    out = attention_op.attention([q, k_t, v, bias], {"scale": 0.3, "tactic": tactic, "rows_before_heads": 1})
    assert out.shape == (3, TOKENS, HEADS, HEAD_DIM)
    tolerance = 1e-5 if DEVICE == "cpu" else 1e-4  # CUDA's SDPA kernels order their float32 sums otherwise
    torch.testing.assert_close(out, plain.transpose(1, 2), rtol=tolerance, atol=tolerance)
    if tactic.startswith("attention.short"):
        assert out.is_contiguous()  # the Reshape merging the heads is then a view


def look_alike(case: str):
    b = OnnxBuilder()
    if case == "another_permutation":  # rows and features swapped: not the heads merge
        _, transposed = attention_block(b, perm=(0, 1, 3, 2))
        return b.model([transposed]), b
    if case == "output_read_twice":
        out, transposed = attention_block(b)
        return b.model([merged_heads(b, transposed), b.node("Relu", [out], name="other_reader")]), b
    if case == "output_is_a_graph_output":
        out, transposed = attention_block(b)
        return b.model([merged_heads(b, transposed), out]), b
    raise AssertionError(case)


@pytest.mark.parametrize("case", ["another_permutation", "output_read_twice", "output_is_a_graph_output"])
def test_must_not_fire(case):
    model, b = look_alike(case)
    graph, count, before = fused(model)
    assert count == 0 and [n.op_type for n in graph.nodes] == before
    assert not any(n.attrs.get("rows_before_heads") for n in nodes_of(graph, "Attention"))
    assert_matches_ort(graph, model, feeds(b))


def test_fires_on_every_attention_layer_of_timm_swin_and_the_kernel_reads_the_exports_views(tmp_path, monkeypatch):
    # Then every layer on the one-kernel tactic (Triton's interpreter on the CPU): q, k_t and v are
    # the views the export makes of the qkv projection, the output written rows before heads.
    onnx_model = small_timm_swin(tmp_path)
    graph = import_graph(onnx_model)
    report = optimize(graph, verify=True)
    assert report.rewrites.get("fold_attention_transpose") == 4
    assert all(n.attrs.get("rows_before_heads") == 1 for n in nodes_of(graph, "Attention"))
    x = {"input": np.random.default_rng(0).standard_normal([2, 3, 112, 112]).astype(np.float32)}
    assert_matches_ort(graph, onnx_model, x, rtol=1e-4)
    if not kernel_runs_on(torch.empty(0)):
        return  # a GPU machine runs no Triton on CPU tensors; tests/kernels covers the kernel there
    strided = []
    monkeypatch.setattr(attention_op, "short_attention", lambda q, k_t, v, *rest, **kwargs: strided.append(
        not any(t.is_contiguous() for t in (q, k_t, v))) or short_attention(q, k_t, v, *rest, **kwargs))
    for node in nodes_of(graph, "Attention"):
        node.attrs["tactic"] = "attention.short.b64.w4"
    assert_matches_ort(graph, onnx_model, x, rtol=1e-4)
    assert strided == [True] * 4
