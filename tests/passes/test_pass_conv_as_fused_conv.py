"""conv_as_fused_conv: a plain 2-D Conv with constant weights becomes a FusedConv (so it gets
tactics and can store into a Concat's slice); fires, keeps the numbers, and leaves alone what it
must."""
from __future__ import annotations

from passes_helpers import OnnxBuilder, assert_matches_ort, import_graph

from sartor.ir import verify_graph
from sartor.passes.conv_as_fused_conv import conv_as_fused_conv
from sartor.passes.pipelines import optimize


def test_head_convs_before_a_concat_become_fused_and_keep_the_numbers():
    """A detection head's last 1x1 convs (bias, no activation) feeding a channel Concat."""
    b = OnnxBuilder()
    x = b.input("x", [2, 4, 6, 6])
    box = b.conv(x, 4, 8, "box", k=1)
    cls = b.conv(x, 4, 5, "cls", k=1)
    model = b.model([b.node("Concat", [box, cls], name="cat", axis=1)])
    graph = import_graph(model)
    assert conv_as_fused_conv(graph) == 2
    verify_graph(graph)
    assert [n.op_type for n in graph.nodes] == ["FusedConv", "FusedConv", "Concat"]
    assert all(not n.attrs.get("activation") for n in graph.nodes[:2])
    assert_matches_ort(graph, model, b.feeds())


def test_the_optimize_pipeline_promotes_and_still_fuses_activations_first():
    b = OnnxBuilder()
    x = b.input("x", [1, 4, 6, 6])
    h = b.node("Relu", [b.conv(x, 4, 4, "conv1")], name="relu")
    y = b.conv(h, 4, 4, "conv2")
    model = b.model([y])
    graph = import_graph(model)
    report = optimize(graph)
    assert report.rewrites.get("conv_as_fused_conv") == 1  # conv2 only: conv1 took its Relu
    assert [(n.op_type, n.attrs.get("activation")) for n in graph.nodes] == [("FusedConv", "Relu"),
                                                                              ("FusedConv", None)]
    assert_matches_ort(graph, model, b.feeds())


def test_does_not_fire_on_runtime_weights_1d_convs_or_before_batchnorm():
    b = OnnxBuilder()
    x = b.input("x", [1, 4, 6, 6])
    w = b.input("w", [4, 4, 3, 3])  # weights fed at run time
    dynamic = b.node("Conv", [x, w], name="dynamic", pads=[1, 1, 1, 1])
    seq = b.input("s", [1, 4, 9])
    conv1d = b.node("Conv", [seq, b.weight("w1d", [4, 4, 3])], name="conv1d", pads=[1, 1])
    bn = b.batchnorm(b.conv(x, 4, 4, "before_bn"), 4, "bn")
    model = b.model([dynamic, conv1d, bn])
    graph = import_graph(model)
    assert conv_as_fused_conv(graph) == 0
    assert sorted(n.op_type for n in graph.nodes) == ["BatchNormalization", "Conv", "Conv", "Conv"]
    assert_matches_ort(graph, model, b.feeds())
