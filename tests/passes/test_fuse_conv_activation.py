"""passes/fuse_conv_activation.py alone: it fires where it should (and the numbers still match ONNX Runtime),
and it leaves the graph alone where a rewrite would be wrong."""
from __future__ import annotations

import numpy as np
import pytest

from passes_helpers import OnnxBuilder, assert_matches_ort, import_graph, apply_pass, assert_unchanged
from sartor.ir import verify_graph
from sartor.passes.fuse_conv_activation import fuse_conv_activation


ACTIVATIONS = {
    # name: (opset, build(b, conv_out) -> (out, node names), expected (kind, alpha, beta))
    "Relu": (17, lambda b, c: (b.node("Relu", [c], name="act"), ["act"]), ("Relu", None, None)),
    "Relu6": (17, lambda b, c: (b.node("Clip", [c, b.scalar(0.0), b.scalar(6.0)], name="act"), ["act"]),
              ("Clip", 0.0, 6.0)),
    "ClipMaxOnly": (17, lambda b, c: (b.node("Clip", [c, "", b.scalar(0.5)], name="act"), ["act"]),
                    ("Clip", None, 0.5)),
    "Sigmoid": (17, lambda b, c: (b.node("Sigmoid", [c], name="act"), ["act"]), ("Sigmoid", None, None)),
    "SiLU": (17, lambda b, c: (b.node("Mul", [c, b.node("Sigmoid", [c], name="act_sigmoid")], name="act"),
                               ["act_sigmoid", "act"]), ("SiLU", None, None)),
    "SiLU_swapped": (17, lambda b, c: (b.node("Mul", [b.node("Sigmoid", [c], name="act_sigmoid"), c], name="act"),
                                       ["act_sigmoid", "act"]), ("SiLU", None, None)),
    "HardSwish": (17, lambda b, c: (b.node("HardSwish", [c], name="act"), ["act"]), ("HardSwish", None, None)),
    "HardSigmoid": (17, lambda b, c: (b.node("HardSigmoid", [c], name="act", alpha=0.3, beta=0.4), ["act"]),
                    ("HardSigmoid", 0.3, 0.4)),
    "HardSigmoidDefault": (17, lambda b, c: (b.node("HardSigmoid", [c], name="act"), ["act"]),
                           ("HardSigmoid", 0.2, 0.5)),
    "LeakyRelu": (17, lambda b, c: (b.node("LeakyRelu", [c], name="act", alpha=0.2), ["act"]),
                  ("LeakyRelu", 0.2, None)),
    "Gelu": (20, lambda b, c: (b.node("Gelu", [c], name="act"), ["act"]), ("Gelu", None, None)),
    "Tanh": (17, lambda b, c: (b.node("Tanh", [c], name="act"), ["act"]), ("Tanh", None, None)),
}


@pytest.mark.parametrize("name", list(ACTIVATIONS))
def test_fuse_conv_activation(name):
    opset, build, (kind, alpha, beta) = ACTIVATIONS[name]
    b = OnnxBuilder(opset=opset)
    x = b.input("x", ["N", 3, 7, 7])
    c = b.conv(x, 3, 5, "conv", strides=[2, 2])
    out, act_names = build(b, c)
    model = b.model([b.node("MaxPool", [out], name="pool", kernel_shape=[2, 2])])
    graph, count = apply_pass(model, fuse_conv_activation, expect_fired=True)
    assert count == 1
    assert [n.op_type for n in graph.nodes] == ["FusedConv", "MaxPool"]
    fused = graph.nodes[0]
    assert fused.attrs["activation"] == kind
    if alpha is None:
        assert fused.attrs["activation_alpha"] is None
    else:
        assert fused.attrs["activation_alpha"] == pytest.approx(alpha)
    if beta is None:
        assert fused.attrs["activation_beta"] is None
    else:
        assert fused.attrs["activation_beta"] == pytest.approx(beta)
    assert fused.origin == ["conv"] + act_names and fused.outputs == [out]
    assert fused.attrs["strides"] == [2, 2]  # the conv's own attributes survive
    assert_matches_ort(graph, model, b.feeds(shapes={"x": [2, 3, 7, 7]}))


def test_fuse_conv_activation_gemm():
    b = OnnxBuilder()
    x = b.input("x", ["N", 8])
    g = b.node("Gemm", [x, b.weight("w", [6, 8]), b.weight("gb", [6])], name="gemm", transB=1)
    y = b.node("Relu", [g], name="relu")
    model = b.model([y])
    graph, count = apply_pass(model, fuse_conv_activation, expect_fired=True)
    assert count == 1 and [n.op_type for n in graph.nodes] == ["FusedGemm"]
    assert graph.nodes[0].attrs["activation"] == "Relu" and graph.nodes[0].origin == ["gemm", "relu"]
    assert_matches_ort(graph, model, b.feeds(shapes={"x": [3, 8]}))


@pytest.mark.parametrize("case", ["conv_read_twice", "clip_bounds_not_constant", "clip_unbounded", "conv_is_output",
                                  "gelu_tanh", "silu_sigmoid_read_twice", "silu_mul_other",
                                  "act_reads_conv_second", "already_activated"])
def test_fuse_conv_activation_must_not_fire(case):
    b = OnnxBuilder(opset=20 if case == "gelu_tanh" else 17)
    x = b.input("x", [2, 3, 6, 6])
    c = b.conv(x, 3, 3, "conv")
    feeds_extra = {}
    outputs = []
    if case == "conv_read_twice":
        outputs += [b.node("Relu", [c], name="relu"), b.node("Add", [c, x], name="add")]
    elif case == "clip_bounds_not_constant":
        lo, hi = b.input("lo", []), b.input("hi", [])
        feeds_extra = {"lo": np.asarray(-0.5, np.float32), "hi": np.asarray(0.5, np.float32)}
        outputs.append(b.node("Clip", [c, lo, hi], name="clip"))
    elif case == "clip_unbounded":  # Clip without min and max is an identity, not an epilogue
        outputs.append(b.node("Clip", [c], name="clip"))
    elif case == "conv_is_output":
        outputs += [b.node("Relu", [c], name="relu"), c]
    elif case == "gelu_tanh":
        outputs.append(b.node("Gelu", [c], name="gelu", approximate="tanh"))
    elif case == "silu_sigmoid_read_twice":
        s = b.node("Sigmoid", [c], name="sigmoid")
        outputs += [b.node("Mul", [c, s], name="mul"), b.node("Neg", [s], name="neg")]
    elif case == "silu_mul_other":  # c * sigmoid(c) needs the same c on both sides
        s = b.node("Sigmoid", [c], name="sigmoid")
        outputs += [b.node("Mul", [b.node("Relu", [c], name="relu"), s], name="mul")]
    elif case == "act_reads_conv_second":  # PRelu(slope=conv) is not an activation of the conv
        outputs.append(b.node("PRelu", [x, c], name="prelu"))
    else:  # a conv already carrying an epilogue takes no second one
        outputs.append(b.node("Tanh", [b.node("Relu", [c], name="relu")], name="tanh"))
    model = b.model(outputs)
    if case == "already_activated":
        graph = import_graph(model)
        assert fuse_conv_activation(graph) == 1
        assert fuse_conv_activation(graph) == 0
        verify_graph(graph)
        assert [n.op_type for n in graph.nodes] == ["FusedConv", "Tanh"]
        assert_matches_ort(graph, model, b.feeds())
        return
    assert_unchanged(model, fuse_conv_activation, dict(b.feeds(), **feeds_extra))
