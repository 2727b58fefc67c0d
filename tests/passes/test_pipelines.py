"""The whole pass pipeline (passes/pipelines.py, `optimize`) on a small net: valid, exact, idempotent."""
from __future__ import annotations

import numpy as np

from passes_helpers import OnnxBuilder, assert_matches_ort, import_graph, run_sartor, spelled_gelu, spelled_hardswish
from sartor.ir import verify_graph
from sartor.passes.pipelines import optimize


def _small_net() -> tuple:
    """Conv-BN-ReLU stem, a ResNet block, a YOLO-style SiLU bottleneck, a spelled-out GELU,
    HardSwish and a classifier head with Flatten → Reshape, Identity and Dropout in it."""
    b = OnnxBuilder(seed=3)
    x = b.input("x", ["N", 3, 16, 16])
    h = b.node("Relu", [b.batchnorm(b.conv(x, 3, 8, "stem", strides=[2, 2]), 8, "stem_bn")], name="stem_relu")
    r = b.node("Relu", [b.batchnorm(b.conv(h, 8, 8, "block_a", bias=False), 8, "block_a_bn")], name="block_a_relu")
    r = b.batchnorm(b.conv(r, 8, 8, "block_b", bias=False), 8, "block_b_bn")
    h = b.node("Relu", [b.node("Add", [r, h], name="block_add")], name="block_relu")
    c = b.conv(h, 8, 8, "bottleneck")
    s = b.node("Mul", [c, b.node("Sigmoid", [c], name="bottleneck_sig")], name="bottleneck_silu")
    h = b.node("Add", [h, s], name="bottleneck_add")
    h = spelled_gelu(b, b.conv(h, 8, 8, "gelu_conv"), "x_then_half")
    h = spelled_hardswish(b, b.conv(h, 8, 8, "hs_conv"))
    h = b.node("Identity", [b.node("GlobalAveragePool", [h], name="gap")], name="identity")
    h = b.node("Reshape", [b.node("Flatten", [h], name="flatten"), b.const("shape", np.array([-1, 8], np.int64))],
               name="reshape")
    h = b.node("Dropout", [h], name="dropout")
    logits = b.node("Gemm", [h, b.weight("fc_w", [10, 8]), b.weight("fc_b", [10])], name="fc", transB=1)
    y = b.node("Mul", [logits, b.node("Add", [b.scalar(0.5), b.scalar(0.5)], name="const_one")], name="times_one")
    return b, b.model([y])


def test_optimize_keeps_small_net_valid_and_exact():
    b, model = _small_net()
    graph = import_graph(model)
    onnx_nodes = len(graph.nodes)
    report = optimize(graph, verify=True)
    verify_graph(graph)
    for name in ("fold_constants", "remove_identities", "cleanup_reshapes", "fold_batchnorm",
                 "fuse_activation_patterns", "fuse_conv_activation", "fuse_residual_add"):
        assert report.rewrites.get(name, 0) > 0, f"{name} did not fire: {report.rewrites}"
    assert [n.op_type for n in graph.nodes] == ["FusedConv"] * 6 + ["GlobalAveragePool", "Reshape", "Gemm"]
    assert len(graph.nodes) < onnx_nodes
    acts = [(n.attrs.get("activation"), n.attrs.get("residual_after_activation")) for n in graph.nodes[:6]]
    assert acts == [("Relu", None), ("Relu", None), ("Relu", False), ("SiLU", True), ("Gelu", None),
                    ("HardSwish", None)]
    origins = [o for n in graph.nodes for o in n.origin]
    for name in ("stem", "stem_bn", "stem_relu", "block_add", "bottleneck_add", "gelu_erf", "hs_clip"):
        assert name in origins
    assert len(origins) == len(set(origins))
    assert_matches_ort(graph, model, b.feeds(shapes={"x": [2, 3, 16, 16]}))
    # A second run finds nothing left to do.
    assert optimize(graph, verify=True).total() == 0


def test_optimize_is_idempotent_on_executor_results():
    b, model = _small_net()
    feeds = b.feeds(shapes={"x": [1, 3, 16, 16]}, seed=7)
    plain = run_sartor(import_graph(model), feeds)
    graph = import_graph(model)
    optimize(graph, verify=True)
    optimized = run_sartor(graph, feeds)
    for name, value in plain.items():
        np.testing.assert_allclose(optimized[name], value, rtol=1e-4, atol=1e-5)
