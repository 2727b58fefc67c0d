"""passes/fuse_residual_add.py alone: it fires where it should (and the numbers still match ONNX Runtime),
and it leaves the graph alone where a rewrite would be wrong."""
from __future__ import annotations

import pytest

from passes_helpers import OnnxBuilder, assert_matches_ort, import_graph, apply_pass, assert_unchanged
from sartor.ir import verify_graph
from sartor.passes.fuse_conv_activation import fuse_conv_activation
from sartor.passes.fuse_residual_add import fuse_residual_add


@pytest.mark.parametrize("conv_first", [True, False])
def test_fuse_residual_add_resnet_style(conv_first):
    """conv → Add(identity) → Relu: the residual adds before the activation, which still fuses."""
    b = OnnxBuilder()
    x = b.input("x", ["N", 4, 6, 6])
    h = b.node("Relu", [b.conv(x, 4, 4, "conv1")], name="relu1")
    c = b.conv(h, 4, 4, "conv2")
    s = b.node("Add", [c, x] if conv_first else [x, c], name="add")
    y = b.node("Relu", [s], name="relu2")
    model = b.model([y])
    feeds = b.feeds(shapes={"x": [2, 4, 6, 6]})
    graph, count = apply_pass(model, fuse_residual_add, expect_fired=True)
    assert count == 1
    assert [n.op_type for n in graph.nodes] == ["Conv", "Relu", "FusedConv", "Relu"]
    fused = graph.nodes[2]
    assert fused.inputs[3] == x and fused.origin == ["conv2", "add"]
    assert fused.attrs["residual_after_activation"] is False and not fused.attrs.get("activation")
    assert_matches_ort(graph, model, feeds)
    # The Relu after the Add still fuses, into act(conv + residual).
    assert fuse_conv_activation(graph) == 2
    verify_graph(graph)
    assert [n.op_type for n in graph.nodes] == ["FusedConv", "FusedConv"]
    assert graph.nodes[1].attrs["activation"] == "Relu" and graph.nodes[1].origin == ["conv2", "add", "relu2"]
    assert_matches_ort(graph, model, feeds)


def test_fuse_residual_add_yolo_style():
    """x + SiLU(conv(x)) (YOLO bottleneck): the residual adds after the conv's activation."""
    b = OnnxBuilder()
    x = b.input("x", ["N", 4, 6, 6])
    c = b.conv(x, 4, 4, "conv")
    act = b.node("Mul", [c, b.node("Sigmoid", [c], name="sigmoid")], name="silu_mul")
    y = b.node("Add", [x, act], name="add")
    model = b.model([b.node("MaxPool", [y], name="pool", kernel_shape=[2, 2])])
    feeds = b.feeds(shapes={"x": [2, 4, 6, 6]})
    graph = import_graph(model)
    assert fuse_conv_activation(graph) == 1
    count = fuse_residual_add(graph)
    assert count == 1
    verify_graph(graph)
    assert [n.op_type for n in graph.nodes] == ["FusedConv", "MaxPool"]
    fused = graph.nodes[0]
    assert fused.attrs["activation"] == "SiLU" and fused.attrs["residual_after_activation"] is True
    assert fused.inputs[3] == x and fused.origin == ["conv", "sigmoid", "silu_mul", "add"]
    assert_matches_ort(graph, model, feeds)


@pytest.mark.parametrize("second", ["3x3_pad1", "1x1", "same_upper", "5x5_dilated"])
def test_fuse_residual_add_dynamic_spatial_dims(second):
    """YOLO bottleneck with dynamic H and W: shape inference gives the conv outputs fresh unknown
    dims, so the pass proves the shapes equal through the shape-preserving convs."""
    b = OnnxBuilder()
    x = b.input("x", ["N", 4, "H", "W"])
    h = b.node("Relu", [b.conv(x, 4, 8, "cv1")], name="cv1_act")
    if second == "1x1":
        c = b.conv(h, 8, 4, "cv2", k=1)
    elif second == "same_upper":
        c = b.node("Conv", [h, b.weight("cv2_w", [4, 8, 2, 2])], name="cv2", auto_pad="SAME_UPPER")
    elif second == "5x5_dilated":
        c = b.conv(h, 8, 4, "cv2", k=5, pads=[4, 4, 4, 4], dilations=[2, 2])
    else:
        c = b.conv(h, 8, 4, "cv2")
    act = b.node("Mul", [c, b.node("Sigmoid", [c], name="cv2_sig")], name="cv2_silu")
    model = b.model([b.node("Add", [x, act], name="add")])
    graph = import_graph(model)
    assert graph.shape_of(c) != graph.shape_of(x)  # the premise: inference alone cannot tell
    fuse_conv_activation(graph)
    assert fuse_residual_add(graph) == 1
    verify_graph(graph)
    fused = graph.nodes[-1]
    assert fused.name == "cv2" and fused.inputs[3] == x and fused.attrs["residual_after_activation"] is True
    assert_matches_ort(graph, model, b.feeds(shapes={"x": [2, 4, 7, 9]}))


@pytest.mark.parametrize("case", ["stride2_no_proof", "broadcast_dynamic", "shrinking_conv"])
def test_fuse_residual_add_dynamic_must_not_fire(case):
    b = OnnxBuilder()
    x = b.input("x", ["N", 4, "H", "W"])
    if case == "broadcast_dynamic":  # [N, 4, 1, W] broadcasts along H
        c = b.conv(x, 4, 4, "conv")
        other = b.node("ReduceMean", [x], name="mean_h", axes=[2], keepdims=1)
    elif case == "stride2_no_proof":  # both sides halve H and W: equal, but not provable here
        c = b.conv(x, 4, 4, "conv", strides=[2, 2])
        other = b.node("MaxPool", [x], name="pool", kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1])
    else:  # a 3x3 conv without padding shrinks H and W by 2; so does the other side
        c = b.conv(x, 4, 4, "conv", pads=[0, 0, 0, 0])
        other = b.node("MaxPool", [x], name="pool", kernel_shape=[3, 3])
    model = b.model([b.node("Add", [c, other], name="add")])
    assert_unchanged(model, fuse_residual_add, b.feeds(shapes={"x": [2, 4, 8, 8]}))


def test_fuse_residual_add_reorders_when_residual_is_computed_later():
    b = OnnxBuilder()
    x = b.input("x", [2, 4, 6, 6])
    main = b.conv(x, 4, 4, "conv_main")  # listed first ...
    side = b.node("Relu", [b.conv(x, 4, 4, "conv_side")], name="relu_side")  # ... the residual after it
    model = b.model([b.node("Add", [main, side], name="add")])
    graph, count = apply_pass(model, fuse_residual_add, expect_fired=True)
    assert count == 1
    assert [n.name for n in graph.nodes][-1] == "conv_main"
    assert graph.nodes[-1].inputs[3] == side
    assert_matches_ort(graph, model, b.feeds())


def test_fuse_residual_add_no_bias_conv():
    b = OnnxBuilder()
    x = b.input("x", [2, 4, 6, 6])
    c = b.conv(x, 4, 4, "conv", bias=False)
    model = b.model([b.node("Add", [c, x], name="add")])
    graph, count = apply_pass(model, fuse_residual_add, expect_fired=True)
    fused = graph.nodes[0]
    assert fused.inputs[2] == "" and fused.inputs[3] == x
    assert_matches_ort(graph, model, b.feeds())


@pytest.mark.parametrize("case", ["broadcast_operand", "broadcast_conv_side", "conv_read_twice", "constant_operand",
                                  "conv_is_output", "already_has_residual", "not_a_conv"])
def test_fuse_residual_add_must_not_fire(case):
    b = OnnxBuilder()
    x = b.input("x", [2, 4, 6, 6])
    c = b.conv(x, 4, 4, "conv")
    outputs = []
    if case == "broadcast_operand":  # the other operand is [2, 4, 1, 1]: the Add broadcasts it
        pooled = b.node("GlobalAveragePool", [x], name="gap")
        outputs.append(b.node("Add", [c, pooled], name="add"))
    elif case == "broadcast_conv_side":  # the conv output is the one that broadcasts
        small = b.conv(b.node("GlobalAveragePool", [x], name="gap"), 4, 4, "conv_small", k=1)
        outputs.append(b.node("Add", [small, x], name="add"))
        c_unused = c
        outputs.append(c_unused)
    elif case == "conv_read_twice":
        outputs += [b.node("Add", [c, x], name="add"), b.node("Relu", [c], name="relu")]
    elif case == "constant_operand":
        outputs.append(b.node("Add", [c, b.weight("bias_map", [2, 4, 6, 6])], name="add"))
    elif case == "conv_is_output":
        outputs += [b.node("Add", [c, x], name="add"), c]
    elif case == "already_has_residual":
        outputs.append(b.node("Add", [b.node("Add", [c, x], name="add1"), x], name="add2"))
    else:
        outputs.append(b.node("Add", [b.node("Relu", [c], name="relu"), x], name="add"))
    model = b.model(outputs)
    if case == "already_has_residual":
        graph = import_graph(model)
        assert fuse_residual_add(graph) == 1
        assert fuse_residual_add(graph) == 0
        verify_graph(graph)
        assert [n.op_type for n in graph.nodes] == ["FusedConv", "Add"]
        assert_matches_ort(graph, model, b.feeds())
        return
    assert_unchanged(model, fuse_residual_add)
