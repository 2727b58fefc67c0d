"""builder/precision.py and the Attention layer: the FP16 overflow guard measures an attention
layer's scaled scores, which the unfused graph's MatMul wrote out and the fused layer never does."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from passes_helpers import OnnxBuilder, import_graph, nodes_of
from sartor.builder.config import BuildConfig
from sartor.builder.precision import overflowing_layers, plan_precision
from sartor.ir.dtypes import FP16_MAX
from sartor.passes.fuse_attention import fuse_attention


def attention_graph():
    """One Attention layer (scale 1/8) over q, k, v of [N, 1, 4, 64]."""
    b = OnnxBuilder()
    q, k, v = (b.input(name, ["N", 1, 4, 64]) for name in ("q", "k", "v"))
    scores = b.node("Mul", [b.node("MatMul", [q, b.node("Transpose", [k], perm=[0, 1, 3, 2])], name="scores"),
                            b.scalar(0.125)], name="scale")
    b.node("MatMul", [b.node("Softmax", [scores], name="softmax", axis=-1), v], name="weighted")
    graph = import_graph(b.model(["weighted_out"]))
    assert fuse_attention(graph) == 1
    return graph


@pytest.mark.parametrize("magnitude,overflows", [(20.0, False), (150.0, True)])
def test_overflow_guard_keeps_attention_fp32_when_its_scaled_scores_exceed_fp16(magnitude, overflows):
    # Scaled scores of 64·m²/8: 3200 for m = 20, 180000 (> 65504) for m = 150; the layer's output,
    # a mean of v, stays small either way.
    graph = attention_graph()
    (attention,) = nodes_of(graph, "Attention")
    feeds = {"q": torch.full((1, 1, 4, 64), magnitude), "k": torch.full((1, 1, 4, 64), magnitude),
             "v": torch.from_numpy(np.random.default_rng(0).standard_normal((1, 1, 4, 64)).astype(np.float32))}
    overflow = overflowing_layers(graph, {}, [feeds], FP16_MAX, torch.device("cpu"))
    assert (attention.name in overflow) == overflows
    plan = plan_precision(graph, BuildConfig("model.onnx", "model.plan", precision="fp16"), overflow)
    assert plan.layers[attention.name] == ("fp32" if overflows else "fp16")
    if overflows:
        assert overflow[attention.name] == pytest.approx(64 * magnitude ** 2 / 8, rel=1e-6)
        assert "overflow" in plan.reasons[attention.name]
