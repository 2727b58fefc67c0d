"""passes/fuse_activation_patterns.py alone: it fires where it should (and the numbers still match ONNX Runtime),
and it leaves the graph alone where a rewrite would be wrong."""
from __future__ import annotations

import numpy as np
import pytest

from passes_helpers import OnnxBuilder, assert_matches_ort, apply_pass, assert_unchanged, spelled_gelu, spelled_hardswish
from sartor.passes.fuse_activation_patterns import fuse_activation_patterns


GELU_NAMES = ["gelu_div", "gelu_erf", "gelu_add", "gelu_mul_x", "gelu_mul_half"]


@pytest.mark.parametrize("order", ["x_then_half", "half_then_x"])
@pytest.mark.parametrize("x_operand_first", [True, False])
@pytest.mark.parametrize("scale_by", ["Div", "Mul"])
def test_fuse_activation_patterns_gelu(order, x_operand_first, scale_by):
    b = OnnxBuilder()
    x = b.input("x", ["N", 4, 5, 5])
    c = b.conv(x, 4, 4, "conv")
    y = b.node("Sigmoid", [spelled_gelu(b, c, order, x_operand_first, scale_by)], name="sigmoid")
    model = b.model([y])
    graph, count = apply_pass(model, fuse_activation_patterns, expect_fired=True)
    assert count == 1
    assert [n.op_type for n in graph.nodes] == ["Conv", "Gelu", "Sigmoid"]
    gelu = graph.nodes[1]
    assert gelu.inputs == [c] and sorted(gelu.origin) == sorted(GELU_NAMES)
    assert_matches_ort(graph, model, b.feeds(shapes={"x": [2, 4, 5, 5]}))




@pytest.mark.parametrize("divide", [True, False])
@pytest.mark.parametrize("three_first", [True, False])
def test_fuse_activation_patterns_hardswish(divide, three_first):
    b = OnnxBuilder()
    x = b.input("x", [2, 4, 5, 5])
    c = b.node("Mul", [x, b.scalar(4.0)], name="spread")  # reach both sides of the [-3, 3] ramp
    y = b.node("Sigmoid", [spelled_hardswish(b, c, divide, three_first=three_first)], name="sigmoid")
    model = b.model([y])
    graph, count = apply_pass(model, fuse_activation_patterns, expect_fired=True)
    assert count == 1
    assert [n.op_type for n in graph.nodes] == ["Mul", "HardSwish", "Sigmoid"]
    hs = graph.nodes[1]
    assert hs.inputs == [c] and sorted(hs.origin) == sorted(["hs_add", "hs_clip", "hs_mul", "hs_scale"])
    assert_matches_ort(graph, model, b.feeds())


@pytest.mark.parametrize("case", ["gelu_wrong_scale", "gelu_add_read_twice", "gelu_scaled_x_read_twice",
                                  "gelu_inner_is_output", "gelu_other_x",
                                  "hardswish_clip_bounds_not_constant", "hardswish_clip_to_5",
                                  "hardswish_clip_read_twice", "hardswish_scale_by_7"])
def test_fuse_activation_patterns_must_not_fire(case):
    b = OnnxBuilder()
    x = b.input("x", [2, 4, 5, 5])
    x = b.node("Mul", [x, b.scalar(4.0)], name="spread")
    outputs = []
    if case == "gelu_wrong_scale":
        scaled = b.node("Div", [x, b.scalar(2.0)], name="gelu_div")
        one = b.node("Add", [b.node("Erf", [scaled], name="gelu_erf"), b.scalar(1.0)], name="gelu_add")
        outputs.append(b.node("Mul", [b.node("Mul", [x, one], name="gelu_mul_x"), b.scalar(0.5)], name="half"))
    elif case.startswith("gelu"):
        outputs.append(spelled_gelu(b, x, "x_then_half"))
        if case == "gelu_add_read_twice":
            outputs.append(b.node("Sigmoid", ["gelu_add_out"], name="other_reader"))
        elif case == "gelu_scaled_x_read_twice":
            outputs.append(b.node("Sigmoid", ["gelu_div_out"], name="other_reader"))
        elif case == "gelu_inner_is_output":
            outputs.append("gelu_erf_out")
        else:  # the x-side Mul reads a different tensor than the one fed to the erf
            other = b.node("Relu", [x], name="other_x")
            mul_x = next(n for n in b.nodes if n.name == "gelu_mul_x")
            mul_x.input[0] = other
            b.nodes.insert(b.nodes.index(mul_x), b.nodes.pop())
    elif case == "hardswish_clip_bounds_not_constant":
        lo, hi = b.input("lo", []), b.input("hi", [])
        outputs.append(spelled_hardswish(b, x, clip_inputs=[lo, hi]))
    elif case == "hardswish_clip_to_5":
        outputs.append(spelled_hardswish(b, x, bounds=(0.0, 5.0)))
    elif case == "hardswish_clip_read_twice":
        outputs.append(spelled_hardswish(b, x))
        outputs.append(b.node("Sigmoid", ["hs_clip_out"], name="other_reader"))
    else:
        added = b.node("Add", [x, b.scalar(3.0)], name="hs_add")
        clipped = b.node("Clip", [added, b.scalar(0.0), b.scalar(6.0)], name="hs_clip")
        outputs.append(b.node("Div", [b.node("Mul", [x, clipped], name="hs_mul"), b.scalar(7.0)], name="hs_scale"))
    model = b.model(outputs)
    feeds = b.feeds()
    if case == "hardswish_clip_bounds_not_constant":
        feeds.update(lo=np.asarray(0.0, np.float32), hi=np.asarray(6.0, np.float32))
    assert_unchanged(model, fuse_activation_patterns, feeds)
