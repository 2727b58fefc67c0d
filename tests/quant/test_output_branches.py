"""The output-branch rule of the INT8 plan (`sartor.quant.plan.output_branches`, decision 0045): the
conv/gemm layers inside a branch that feeds only one output head stay at the higher precision with
it; the branch's entry (it reads the shared features) runs INT8; a fork, a graph output or a
layer of another kind on the way ends the branch."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from conftest import IMAGE, cosine, gaussian_images, initializer_makers, make_model, save
from onnx import TensorProto, helper

import sartor
from sartor.frontend import import_onnx
from sartor.ir import Node, ValueInfo
from sartor.passes import optimize
from sartor.quant.plan import int8_decisions

SHAPES = {"min": {"images": (1, 3, IMAGE, IMAGE)}, "opt": {"images": (2, 3, IMAGE, IMAGE)},
          "max": {"images": (4, 3, IMAGE, IMAGE)}}


def _conv(name, x, out, relu=True):
    nodes = [helper.make_node("Conv", [x, f"{name}.w", f"{name}.b"], [out + ("_c" if relu else "")], name=name,
                              pads=[1, 1, 1, 1])]
    if relu:
        nodes.append(helper.make_node("Relu", [out + "_c"], [out], name=f"{name}_relu"))
    return nodes


def two_branch_detector(seed: int = 0, pool_before_head: bool = False, second_head: bool = True,
                        residual: bool = False) -> onnx.ModelProto:
    """trunk → neck, which forks into a three-conv branch to output "a" and a one-conv head to output
    "b" (a YOLO head's box and class branches in small). With `pool_before_head` a MaxPool sits
    between the branch's second conv and its head; without `second_head` there is no "b" and no
    fork; with `residual` a2 adds neck's output to its own (a ResNet block's join)."""
    w, b = initializer_makers(np.random.default_rng(seed))
    shapes = {"trunk": (8, 3), "neck": (8, 8), "a1": (8, 8), "a2": (8, 8), "a_out": (4, 8), "b_out": (2, 8)}
    inits = [x for name, (o, i) in shapes.items() for x in (w(f"{name}.w", o, i, 3, 3), b(f"{name}.b", o))]
    nodes = _conv("trunk", "images", "t") + _conv("neck", "t", "n") + _conv("a1", "n", "x1")
    if residual:
        nodes += _conv("a2", "x1", "x2s", relu=False) + [helper.make_node("Add", ["x2s", "n"], ["x2"], name="join")]
    else:
        nodes += _conv("a2", "x1", "x2")
    head_input = "x2"
    if pool_before_head:
        nodes.append(helper.make_node("MaxPool", ["x2"], ["x2p"], name="pool", kernel_shape=[3, 3],
                                      pads=[1, 1, 1, 1]))
        head_input = "x2p"
    nodes += _conv("a_out", head_input, "a", relu=False)
    if second_head:
        nodes += _conv("b_out", "n", "b", relu=False)
    else:
        inits = [i for i in inits if not i.name.startswith("b_out.")]
    outputs = [helper.make_tensor_value_info(name, TensorProto.FLOAT, ["batch", c, IMAGE, IMAGE])
               for name, c in (("a", 4), ("b", 2)) if second_head or name == "a"]
    model = make_model(nodes, [helper.make_tensor_value_info("images", TensorProto.FLOAT, ["batch", 3, IMAGE, IMAGE])],
                       outputs, inits, name="two_branch_detector")
    onnx.checker.check_model(model)
    return model


def _decisions(model: onnx.ModelProto, tmp_path: Path) -> dict:
    graph = import_onnx(save(model, tmp_path / "m.onnx")).graph
    optimize(graph)
    return int8_decisions(graph, "fp32")


def test_inside_a_private_branch_stays_float_with_its_head(tmp_path):
    """a_out's branch is a1 → a2 (neck forks to b_out too): a2 is inside and stays float; a1, the
    entry, reads neck's codes as b_out's branch would, and runs INT8."""
    decisions = _decisions(two_branch_detector(), tmp_path)
    assert {name: precision for name, (precision, _) in decisions.items()} == {
        "trunk": "int8", "neck": "int8", "a1": "int8", "a2": "fp32", "a_out": "fp32", "b_out": "fp32"}
    assert decisions["a2"][1].startswith("output branch") and "'a_out'" in decisions["a2"][1]
    assert "--layer-precision a2=int8" in decisions["a2"][1]
    assert decisions["a_out"][1].startswith("output head") and decisions["a1"][1] == ""


def _decoded(model: onnx.ModelProto, tmp_path: Path, box: str) -> dict:
    """The decisions with outputs "a" and "b" read by a YoloDecode as one scale's box logits (`box`)
    and class logits (the other): the graph a YOLO head's fused decode leaves."""
    graph = import_onnx(save(model, tmp_path / "m.onnx")).graph
    optimize(graph)
    logits = [box, "b" if box == "a" else "a"]
    graph.nodes.append(Node("YoloDecode", "decode", logits, ["detections"], {"reg_max": 1, "strides": [8]}))
    graph.outputs = [ValueInfo("detections", "float32", None)]
    return int8_decisions(graph, "fp32")


def test_a_box_head_s_branch_runs_int8(tmp_path):
    """a_out writes the decode's box logits, which the DFL averages over its bins: its branch (a2)
    runs INT8, the head itself stays float."""
    decisions = _decoded(two_branch_detector(), tmp_path, box="a")
    assert {name: precision for name, (precision, _) in decisions.items()} == {
        "trunk": "int8", "neck": "int8", "a1": "int8", "a2": "int8", "a_out": "fp32", "b_out": "fp32"}
    assert decisions["a_out"][1].startswith("output head")


def test_a_class_head_s_branch_stays_float(tmp_path):
    """a_out writes the class logits, ranked as they are: its branch's inner layer stays float."""
    decisions = _decoded(two_branch_detector(), tmp_path, box="b")
    assert decisions["a2"][0] == "fp32" and decisions["a2"][1].startswith("output branch")
    assert decisions["a1"] == ("int8", "")


def test_a_layer_on_the_way_ends_the_branch(tmp_path):
    """Only conv/gemm layers feeding the head directly join: a MaxPool between a2 and the head keeps
    a2 and a1 INT8 (the head's input then comes from a layer the plan does not decide)."""
    decisions = _decisions(two_branch_detector(pool_before_head=True), tmp_path)
    assert {name: precision for name, (precision, _) in decisions.items()} == {
        "trunk": "int8", "neck": "int8", "a1": "int8", "a2": "int8", "a_out": "fp32", "b_out": "fp32"}


def test_a_chain_without_a_fork_is_the_trunk(tmp_path):
    """Without "b" nothing forks: trunk → neck → a1 → a2 → a_out is a plain network, not a head's
    branch, and only the head stays float."""
    decisions = _decisions(two_branch_detector(second_head=False), tmp_path)
    assert {name: precision for name, (precision, _) in decisions.items()} == {
        "trunk": "int8", "neck": "int8", "a1": "int8", "a2": "int8", "a_out": "fp32"}


def test_a_join_is_not_a_private_branch(tmp_path):
    """a2 adds neck's output (fused as its residual): two paths from the fork meet there, so the
    layers before the head are a block of the trunk, not a private branch."""
    decisions = _decisions(two_branch_detector(residual=True), tmp_path)
    assert {name: precision for name, (precision, _) in decisions.items()} == {
        "trunk": "int8", "neck": "int8", "a1": "int8", "a2": "int8", "a_out": "fp32", "b_out": "fp32"}


def test_a_fork_or_a_graph_output_is_not_private(tmp_path):
    """With a1's output also a graph output, a1 is an output head itself: a_out's branch is a2
    alone, its entry, so INT8. neck, the fork, stays INT8 as before."""
    model = two_branch_detector()
    model.graph.output.append(helper.make_tensor_value_info("x1", TensorProto.FLOAT, ["batch", 8, IMAGE, IMAGE]))
    decisions = _decisions(model, tmp_path)
    assert decisions["neck"][0] == "int8" and decisions["trunk"][0] == "int8"
    assert decisions["a1"][1].startswith("output head")
    assert decisions["a2"] == ("int8", "")


@pytest.mark.parametrize("pool_before_head", [False, True])
def test_the_engine_keeps_the_float_numbers(tmp_path, pool_before_head):
    """The plan with the branch float builds and its outputs track FP32 (cosine ≥ 0.99, as the other
    INT8 build tests); the build log and header give each branch layer its reason."""
    model = save(two_branch_detector(pool_before_head=pool_before_head), tmp_path / "m.onnx")
    calib = tmp_path / "calib.npy"
    np.save(calib, gaussian_images(10, 16))
    images = gaussian_images(11, 4)
    sartor.build(model, tmp_path / "fp32.plan", device="cpu", profiles=[SHAPES])
    result = sartor.build(model, tmp_path / "int8.plan", device="cpu", profiles=[SHAPES], precision="int8",
                          calib=calib)
    layers = {layer["name"]: layer for layer in result.header["layers"]}
    assert layers["neck"]["precision"] == "int8" and layers["a1"]["precision"] == "int8"
    assert layers["a2"]["precision"] == ("int8" if pool_before_head else "fp32")
    if not pool_before_head:
        assert layers["a2"]["reason"].startswith("output branch")
    fp32 = sartor.load(tmp_path / "fp32.plan", device="cpu").context().run({"images": images})
    int8 = sartor.load(tmp_path / "int8.plan", device="cpu").context().run({"images": images})
    for name in ("a", "b"):
        assert cosine(fp32[name], int8[name]) >= 0.99, name
