"""Each optimisation pass alone: it fires where it should (and the numbers still match ONNX
Runtime), and it leaves the graph alone where a rewrite would be wrong."""
from __future__ import annotations

import math

import numpy as np
import pytest

from passes_helpers import (OnnxBuilder, assert_matches_ort, import_graph, nodes_of, op_counts,
                            run_sartor)
from sartor.ir import verify_graph
from sartor.passes.cleanup_reshapes import cleanup_reshapes
from sartor.passes.eliminate_dead_nodes import eliminate_dead_nodes
from sartor.passes.fold_batchnorm import fold_batchnorm
from sartor.passes.fold_constants import fold_constants
from sartor.passes.fuse_activation_patterns import fuse_activation_patterns
from sartor.passes.fuse_conv_activation import fuse_conv_activation
from sartor.passes.fuse_residual_add import fuse_residual_add
from sartor.passes.pipelines import optimize
from sartor.passes.remove_identities import remove_identities

import onnx


def _apply(model, rewrite, expect_fired: bool):
    """Import, run one pass, check its count and the graph's structure; returns (graph, count)."""
    graph = import_graph(model)
    count = rewrite(graph)
    if expect_fired:
        assert count > 0, f"{rewrite.__name__} did not fire"
    else:
        assert count == 0, f"{rewrite.__name__} fired {count} time(s) where it must not"
    verify_graph(graph)
    return graph, count


def _unchanged(model, rewrite, feeds=None):
    """The pass must not fire; the graph keeps every node and still computes the same."""
    before = import_graph(model)
    graph, _ = _apply(model, rewrite, expect_fired=False)
    assert [n.op_type for n in graph.nodes] == [n.op_type for n in before.nodes]
    assert_matches_ort(graph, model, feeds if feeds is not None else _feeds_for(model))
    return graph


def _feeds_for(model, seed: int = 1) -> dict:
    rng = np.random.default_rng(seed)
    feeds = {}
    inits = {t.name for t in model.graph.initializer}
    for vi in model.graph.input:
        if vi.name in inits:
            continue
        shape = [d.dim_value if d.HasField("dim_value") else 2 for d in vi.type.tensor_type.shape.dim]
        feeds[vi.name] = rng.standard_normal(shape).astype(np.float32)
    return feeds


# ==== fold_constants ==========================================================================
def test_fold_constants_folds_constant_subgraph_and_static_shape():
    b = OnnxBuilder()
    x = b.input("x", [2, 3, 4])
    c = b.node("Add", [b.weight("a", [3, 4]), b.weight("b", [3, 4])], name="const_add")
    c = b.node("Sqrt", [b.node("Abs", [c], name="const_abs")], name="const_sqrt")
    y = b.node("Mul", [x, c], name="mul")
    flat = b.node("Reshape", [y, b.const("flat", np.array([2, 12], dtype=np.int64))], name="flatten")
    back = b.node("Reshape", [flat, b.node("Shape", [x], name="shape_x")], name="unflatten")
    model = b.model([back])
    graph, count = _apply(model, fold_constants, expect_fired=True)
    assert count == 4  # Add, Abs, Sqrt, Shape
    assert op_counts(graph) == {"Mul": 1, "Reshape": 2}
    mul = nodes_of(graph, "Mul")[0]
    np.testing.assert_allclose(graph.initializers[mul.inputs[1]],
                               np.sqrt(np.abs(onnx.numpy_helper.to_array(model.graph.initializer[0])
                                              + onnx.numpy_helper.to_array(model.graph.initializer[1]))),
                               rtol=1e-6)
    assert graph.initializers[nodes_of(graph, "Reshape")[1].inputs[1]].tolist() == [2, 3, 4]
    assert "a" not in graph.initializers and "b" not in graph.initializers  # unused weights dropped
    assert_matches_ort(graph, model, b.feeds())


def test_fold_constants_leaves_dynamic_shapes_runtime_values_and_constant_outputs():
    b = OnnxBuilder()
    x = b.input("x", ["N", 3, 4])
    shape = b.node("Shape", [x], name="shape_dynamic")  # batch is symbolic: not foldable
    y = b.node("Reshape", [b.node("Relu", [x], name="relu"), shape], name="reshape")
    const_out = b.node("Neg", [b.weight("w", [3])], name="neg_const")  # feeds a graph output directly
    model = b.model([y, const_out])
    _unchanged(model, fold_constants, b.feeds(shapes={"x": [2, 3, 4]}))


# ==== eliminate_dead_nodes ====================================================================
def test_eliminate_dead_nodes_removes_dead_branch_and_unused_weights():
    b = OnnxBuilder()
    x = b.input("x", [2, 3])
    live = b.node("Relu", [x], name="live")
    dead = b.node("Mul", [x, b.weight("dead_w", [3])], name="dead_mul")
    b.node("Sigmoid", [dead], name="dead_sigmoid")
    b.weight("never_used", [5])
    model = b.model([live])
    graph, count = _apply(model, eliminate_dead_nodes, expect_fired=True)
    assert count == 4  # two nodes + two weights
    assert [n.name for n in graph.nodes] == ["live"]
    assert not graph.initializers
    assert_matches_ort(graph, model, b.feeds())


def test_eliminate_dead_nodes_keeps_node_with_partly_used_outputs():
    b = OnnxBuilder()
    x = b.input("x", [2, 6])
    first, _unused = b.node("Split", [x, b.const("split", np.array([3, 3], dtype=np.int64))],
                            name="split", outputs=2, axis=1)
    y = b.node("Relu", [first], name="relu")
    model = b.model([y])
    _unchanged(model, eliminate_dead_nodes, b.feeds())


# ==== remove_identities =======================================================================
def _noop_between(op: str, b: OnnxBuilder, x: str) -> str:
    if op == "Identity":
        return b.node("Identity", [x], name="noop")
    if op == "Dropout":
        return b.node("Dropout", [x], name="noop")
    if op == "Cast":
        return b.node("Cast", [x], name="noop", to=onnx.TensorProto.FLOAT)
    if op == "Transpose":
        return b.node("Transpose", [x], name="noop", perm=[0, 1, 2, 3])
    kind, order = op.split("-")
    neutral = {"Mul": 1.0, "Div": 1.0, "Add": 0.0, "Sub": 0.0}[kind]
    # Neutral constants of several broadcast-compatible shapes (scalar, per-channel, full rank 1s).
    c = b.const("neutral", np.full({"Mul": [], "Add": [1, 4, 1, 1], "Sub": [4, 1, 1], "Div": [1]}[kind],
                                   neutral, dtype=np.float32))
    inputs = [x, c] if order == "x_first" else [c, x]
    return b.node(kind, inputs, name="noop")


@pytest.mark.parametrize("op", ["Identity", "Dropout", "Cast", "Transpose", "Mul-x_first", "Mul-c_first",
                                "Add-x_first", "Add-c_first", "Sub-x_first", "Div-x_first"])
def test_remove_identities_removes(op):
    b = OnnxBuilder()
    x = b.input("x", [1, 4, 5, 5])
    y = b.node("Sigmoid", [_noop_between(op, b, b.node("Relu", [x], name="relu"))], name="sigmoid")
    model = b.model([y])
    graph, count = _apply(model, remove_identities, expect_fired=True)
    assert count == 1
    assert [n.name for n in graph.nodes] == ["relu", "sigmoid"]
    assert nodes_of(graph, "Sigmoid")[0].inputs == [nodes_of(graph, "Relu")[0].outputs[0]]
    assert_matches_ort(graph, model, b.feeds())


def test_remove_identities_keeps_public_output_name():
    b = OnnxBuilder()
    x = b.input("x", [2, 3])
    y = b.node("Identity", [b.node("Relu", [x], name="relu")], name="final_identity")
    model = b.model([y])
    graph, count = _apply(model, remove_identities, expect_fired=True)
    assert count == 1 and [n.name for n in graph.nodes] == ["relu"]
    assert graph.nodes[0].outputs == [y] and [o.name for o in graph.outputs] == [y]
    assert_matches_ort(graph, model, b.feeds())


@pytest.mark.parametrize("case", ["mul_one_broadcasts_larger", "mul_one_higher_rank", "sub_from_zero",
                                  "div_into_one", "mul_two", "cast_other_dtype", "transpose_perm",
                                  "identity_input_to_output", "identity_output_source_shared"])
def test_remove_identities_must_not_fire(case):
    b = OnnxBuilder()
    x = b.input("x", [1, 1, 5, 5])
    r = b.node("Relu", [x], name="relu")
    if case == "mul_one_broadcasts_larger":  # x * ones(1,4,1,1) has shape (1,4,5,5), not x's
        y = b.node("Mul", [r, b.const("ones", np.ones([1, 4, 1, 1], np.float32))], name="mul")
    elif case == "mul_one_higher_rank":
        y = b.node("Mul", [b.const("ones", np.ones([2, 1, 1, 1, 1], np.float32)), r], name="mul")
    elif case == "sub_from_zero":
        y = b.node("Sub", [b.scalar(0.0), r], name="sub")
    elif case == "div_into_one":
        y = b.node("Div", [b.scalar(1.0), b.node("Add", [r, b.scalar(1.0)], name="add_one")], name="div")
    elif case == "mul_two":
        y = b.node("Mul", [r, b.scalar(2.0)], name="mul")
    elif case == "cast_other_dtype":
        y = b.node("Cast", [b.node("Cast", [r], name="to_half", to=onnx.TensorProto.FLOAT16)], name="to_float",
                   to=onnx.TensorProto.FLOAT)
    elif case == "transpose_perm":
        y = b.node("Transpose", [r], name="transpose", perm=[0, 1, 3, 2])
    elif case == "identity_output_source_shared":
        # The Identity's output is public and Relu's output has another reader: neither can be renamed.
        y = b.node("Identity", [r], name="identity")
        model = b.model([y, b.node("Sigmoid", [r], name="sigmoid")])
        graph = _unchanged(model, remove_identities)
        assert [o.name for o in graph.outputs] == [y, "sigmoid_out"]
        return
    else:
        y = b.node("Identity", [x], name="identity")
    model = b.model([y])
    graph = _unchanged(model, remove_identities)
    assert [o.name for o in graph.outputs] == [y]


# ==== cleanup_reshapes ========================================================================
def test_cleanup_reshapes_collapses_reshape_chains():
    b = OnnxBuilder()
    x = b.input("x", ["N", 3, 4, 2])
    r = b.node("Relu", [x], name="relu")
    flat = b.node("Flatten", [r], name="flatten", axis=1)
    first = b.node("Reshape", [flat, b.const("s1", np.array([-1, 6, 4], np.int64))], name="reshape1")
    second = b.node("Reshape", [first, b.const("s2", np.array([-1, 4, 6], np.int64))], name="reshape2")
    model = b.model([b.node("Sigmoid", [second], name="sigmoid")])
    graph, count = _apply(model, cleanup_reshapes, expect_fired=True)
    assert count == 2
    assert [n.op_type for n in graph.nodes] == ["Relu", "Reshape", "Sigmoid"]
    reshape = graph.nodes[1]
    assert reshape.inputs[0] == r and reshape.origin == ["flatten", "reshape1", "reshape2"]
    assert_matches_ort(graph, model, b.feeds(shapes={"x": [2, 3, 4, 2]}))


@pytest.mark.parametrize("perms", [([0, 2, 3, 1], [0, 3, 1, 2]), ([1, 0, 2, 3], [0, 2, 3, 1]),
                                   ([3, 2, 1, 0], [2, 0, 3, 1])])
def test_cleanup_reshapes_composes_transposes(perms):
    b = OnnxBuilder()
    x = b.input("x", [2, 3, 4, 5])
    t1 = b.node("Transpose", [b.node("Relu", [x], name="relu")], name="t1", perm=perms[0])
    t2 = b.node("Transpose", [t1], name="t2", perm=perms[1])
    model = b.model([b.node("Sigmoid", [t2], name="sigmoid")])
    graph, count = _apply(model, cleanup_reshapes, expect_fired=True)
    assert count == 1
    transposes = nodes_of(graph, "Transpose")
    assert len(transposes) == 1 and transposes[0].origin == ["t1", "t2"]
    assert_matches_ort(graph, model, b.feeds())


def test_cleanup_reshapes_drops_noop_reshape():
    b = OnnxBuilder()
    x = b.input("x", [2, 3, 4])
    r = b.node("Relu", [x], name="relu")
    same = b.node("Reshape", [r, b.const("same", np.array([2, -1, 4], np.int64))], name="reshape_same")
    model = b.model([b.node("Sigmoid", [same], name="sigmoid")])
    graph, count = _apply(model, cleanup_reshapes, expect_fired=True)
    assert count == 1 and [n.op_type for n in graph.nodes] == ["Relu", "Sigmoid"]
    assert_matches_ort(graph, model, b.feeds())


@pytest.mark.parametrize("case", ["second_shape_has_zero", "first_read_twice", "first_is_output",
                                  "transpose_read_twice", "dynamic_noop_candidate"])
def test_cleanup_reshapes_must_not_fire(case):
    b = OnnxBuilder()
    x = b.input("x", ["N", 3, 8] if case == "dynamic_noop_candidate" else [2, 3, 8])
    r = b.node("Relu", [x], name="relu")
    outputs = []
    if case == "second_shape_has_zero":  # 0 copies dim 0 of reshape1's output (3), not of x (2)
        first = b.node("Reshape", [r, b.const("s1", np.array([3, 16], np.int64))], name="reshape1")
        outputs.append(b.node("Reshape", [first, b.const("s2", np.array([0, 4, -1], np.int64))], name="reshape2"))
    elif case in ("first_read_twice", "first_is_output"):
        first = b.node("Reshape", [r, b.const("s1", np.array([6, 8], np.int64))], name="reshape1")
        outputs.append(b.node("Reshape", [first, b.const("s2", np.array([8, 6], np.int64))], name="reshape2"))
        outputs.append(first if case == "first_is_output" else b.node("Sigmoid", [first], name="sigmoid"))
    elif case == "transpose_read_twice":
        first = b.node("Transpose", [r], name="t1", perm=[0, 2, 1])
        outputs.append(b.node("Transpose", [first], name="t2", perm=[2, 1, 0]))
        outputs.append(b.node("Sigmoid", [first], name="sigmoid"))
    else:  # the input shape has a symbolic dim, so "same shape" cannot be proven
        reshaped = b.node("Reshape", [r, b.const("s", np.array([-1, 3, 8], np.int64))], name="reshape")
        outputs.append(b.node("Sigmoid", [reshaped], name="sigmoid"))
    model = b.model(outputs)
    _unchanged(model, cleanup_reshapes, b.feeds(shapes={"x": [2, 3, 8]}))


# ==== fold_batchnorm ==========================================================================
@pytest.mark.parametrize("conv_bias", [True, False])
@pytest.mark.parametrize("group", [1, 2])
def test_fold_batchnorm_into_conv(conv_bias, group):
    b = OnnxBuilder()
    x = b.input("x", ["N", 4, 6, 6])
    inputs = [x, b.weight("w", [6, 4 // group, 3, 3])] + ([b.weight("cb", [6], 0.1)] if conv_bias else [])
    c = b.node("Conv", inputs, name="conv", pads=[1, 1, 1, 1], group=group)
    y = b.node("Relu", [b.batchnorm(c, 6, "bn", epsilon=1e-3)], name="relu")
    model = b.model([y])
    graph, count = _apply(model, fold_batchnorm, expect_fired=True)
    assert count == 1 and [n.op_type for n in graph.nodes] == ["Conv", "Relu"]
    conv = graph.nodes[0]
    assert conv.origin == ["conv", "bn"] and len(conv.present_inputs()) == 3
    assert not any(name.startswith("bn_") for name in graph.initializers)  # BN weights dropped
    assert_matches_ort(graph, model, b.feeds(shapes={"x": [2, 4, 6, 6]}))


@pytest.mark.parametrize("trans_b,alpha,beta,bias_shape", [
    (0, 1.0, 1.0, [5]), (1, 1.0, 1.0, [5]), (1, 0.5, 2.0, [5]), (0, 1.5, 1.0, None),
    (1, 1.0, 1.0, [1, 5]), (0, 2.0, 0.5, [1, 1]), (0, 1.0, 3.0, [])])
def test_fold_batchnorm_into_gemm(trans_b, alpha, beta, bias_shape):
    b = OnnxBuilder()
    x = b.input("x", ["N", 8])
    w = b.weight("w", [5, 8] if trans_b else [8, 5])
    inputs = [x, w] + ([b.weight("gb", bias_shape, 0.1)] if bias_shape is not None else [])
    g = b.node("Gemm", inputs, name="gemm", transB=trans_b, alpha=alpha, beta=beta)
    y = b.batchnorm(g, 5, "bn")
    model = b.model([y])
    graph, count = _apply(model, fold_batchnorm, expect_fired=True)
    assert count == 1 and [n.op_type for n in graph.nodes] == ["Gemm"]
    gemm = graph.nodes[0]
    assert gemm.origin == ["gemm", "bn"] and gemm.outputs == [y]
    assert gemm.attrs["alpha"] == 1.0 and gemm.attrs["beta"] == 1.0
    assert_matches_ort(graph, model, b.feeds(shapes={"x": [3, 8]}))


def test_fold_batchnorm_must_not_fold_per_row_gemm_bias():
    """A Gemm bias of shape [M, 1] differs per row: the BN's per-column affine cannot absorb it."""
    b = OnnxBuilder()
    x = b.input("x", [5, 8])
    g = b.node("Gemm", [x, b.weight("w", [8, 5]), b.weight("gb", [5, 1])], name="gemm")
    model = b.model([b.batchnorm(g, 5, "bn")])
    _unchanged(model, fold_batchnorm)


@pytest.mark.parametrize("case", ["conv_output_is_graph_output", "conv_output_read_twice", "mean_not_constant",
                                  "producer_not_conv", "weight_not_constant"])
def test_fold_batchnorm_must_not_fire(case):
    b = OnnxBuilder()
    x = b.input("x", [2, 4, 6, 6])
    outputs = []
    if case == "weight_not_constant":
        w = b.input("w", [4, 4, 3, 3])
        c = b.node("Conv", [x, w], name="conv", pads=[1, 1, 1, 1])
    else:
        c = b.conv(x, 4, 4, "conv")
    if case == "producer_not_conv":
        c = b.node("Relu", [c], name="relu")
    if case == "mean_not_constant":
        mean = b.input("mean", [4])
        bn = b.node("BatchNormalization", [c, b.weight("s", [4], 1.0, 0.5), b.weight("bb", [4]), mean,
                                           b.weight("v", [4], 1.0, 0.5)], name="bn")
    else:
        bn = b.batchnorm(c, 4, "bn")
    outputs.append(bn)
    if case == "conv_output_is_graph_output":
        outputs.append(c)
    elif case == "conv_output_read_twice":
        outputs.append(b.node("Sigmoid", [c], name="sigmoid"))
    model = b.model(outputs)
    _unchanged(model, fold_batchnorm)


# ==== fuse_activation_patterns ================================================================
def _gelu(b: OnnxBuilder, x: str, order: str, x_operand_first: bool = True, scale_by: str = "Div") -> str:
    if scale_by == "Div":
        scaled = b.node("Div", [x, b.scalar(math.sqrt(2.0))], name="gelu_div")
    else:
        scaled = b.node("Mul", [x, b.scalar(1 / math.sqrt(2.0))], name="gelu_div")
    erf = b.node("Erf", [scaled], name="gelu_erf")
    one = b.node("Add", [erf, b.scalar(1.0)] if x_operand_first else [b.scalar(1.0), erf], name="gelu_add")
    if order == "x_then_half":  # (x * (1 + erf)) * 0.5, as torch.onnx exports F.gelu
        prod = b.node("Mul", [x, one] if x_operand_first else [one, x], name="gelu_mul_x")
        return b.node("Mul", [prod, b.scalar(0.5)] if x_operand_first else [b.scalar(0.5), prod], name="gelu_mul_half")
    half = b.node("Mul", [one, b.scalar(0.5)] if x_operand_first else [b.scalar(0.5), one], name="gelu_mul_half")
    return b.node("Mul", [half, x] if x_operand_first else [x, half], name="gelu_mul_x")


GELU_NAMES = ["gelu_div", "gelu_erf", "gelu_add", "gelu_mul_x", "gelu_mul_half"]


@pytest.mark.parametrize("order", ["x_then_half", "half_then_x"])
@pytest.mark.parametrize("x_operand_first", [True, False])
@pytest.mark.parametrize("scale_by", ["Div", "Mul"])
def test_fuse_activation_patterns_gelu(order, x_operand_first, scale_by):
    b = OnnxBuilder()
    x = b.input("x", ["N", 4, 5, 5])
    c = b.conv(x, 4, 4, "conv")
    y = b.node("Sigmoid", [_gelu(b, c, order, x_operand_first, scale_by)], name="sigmoid")
    model = b.model([y])
    graph, count = _apply(model, fuse_activation_patterns, expect_fired=True)
    assert count == 1
    assert [n.op_type for n in graph.nodes] == ["Conv", "Gelu", "Sigmoid"]
    gelu = graph.nodes[1]
    assert gelu.inputs == [c] and sorted(gelu.origin) == sorted(GELU_NAMES)
    assert_matches_ort(graph, model, b.feeds(shapes={"x": [2, 4, 5, 5]}))


def _hardswish(b: OnnxBuilder, x: str, divide: bool = True, bounds=(0.0, 6.0), clip_inputs=None,
               three_first: bool = False) -> str:
    added = b.node("Add", [b.scalar(3.0), x] if three_first else [x, b.scalar(3.0)], name="hs_add")
    bounds_in = clip_inputs or [b.scalar(bounds[0]), b.scalar(bounds[1])]
    clipped = b.node("Clip", [added] + bounds_in, name="hs_clip")
    prod = b.node("Mul", [x, clipped], name="hs_mul")
    if divide:
        return b.node("Div", [prod, b.scalar(6.0)], name="hs_scale")
    return b.node("Mul", [prod, b.scalar(1 / 6)], name="hs_scale")


@pytest.mark.parametrize("divide", [True, False])
@pytest.mark.parametrize("three_first", [True, False])
def test_fuse_activation_patterns_hardswish(divide, three_first):
    b = OnnxBuilder()
    x = b.input("x", [2, 4, 5, 5])
    c = b.node("Mul", [x, b.scalar(4.0)], name="spread")  # reach both sides of the [-3, 3] ramp
    y = b.node("Sigmoid", [_hardswish(b, c, divide, three_first=three_first)], name="sigmoid")
    model = b.model([y])
    graph, count = _apply(model, fuse_activation_patterns, expect_fired=True)
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
        outputs.append(_gelu(b, x, "x_then_half"))
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
        outputs.append(_hardswish(b, x, clip_inputs=[lo, hi]))
    elif case == "hardswish_clip_to_5":
        outputs.append(_hardswish(b, x, bounds=(0.0, 5.0)))
    elif case == "hardswish_clip_read_twice":
        outputs.append(_hardswish(b, x))
        outputs.append(b.node("Sigmoid", ["hs_clip_out"], name="other_reader"))
    else:
        added = b.node("Add", [x, b.scalar(3.0)], name="hs_add")
        clipped = b.node("Clip", [added, b.scalar(0.0), b.scalar(6.0)], name="hs_clip")
        outputs.append(b.node("Div", [b.node("Mul", [x, clipped], name="hs_mul"), b.scalar(7.0)], name="hs_scale"))
    model = b.model(outputs)
    feeds = b.feeds()
    if case == "hardswish_clip_bounds_not_constant":
        feeds.update(lo=np.asarray(0.0, np.float32), hi=np.asarray(6.0, np.float32))
    _unchanged(model, fuse_activation_patterns, feeds)


# ==== fuse_conv_activation ====================================================================
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
    graph, count = _apply(model, fuse_conv_activation, expect_fired=True)
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
    graph, count = _apply(model, fuse_conv_activation, expect_fired=True)
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
    _unchanged(model, fuse_conv_activation, dict(b.feeds(), **feeds_extra))


# ==== fuse_residual_add =======================================================================
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
    graph, count = _apply(model, fuse_residual_add, expect_fired=True)
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
    _unchanged(model, fuse_residual_add, b.feeds(shapes={"x": [2, 4, 8, 8]}))


def test_fuse_residual_add_reorders_when_residual_is_computed_later():
    b = OnnxBuilder()
    x = b.input("x", [2, 4, 6, 6])
    main = b.conv(x, 4, 4, "conv_main")  # listed first ...
    side = b.node("Relu", [b.conv(x, 4, 4, "conv_side")], name="relu_side")  # ... the residual after it
    model = b.model([b.node("Add", [main, side], name="add")])
    graph, count = _apply(model, fuse_residual_add, expect_fired=True)
    assert count == 1
    assert [n.name for n in graph.nodes][-1] == "conv_main"
    assert graph.nodes[-1].inputs[3] == side
    assert_matches_ort(graph, model, b.feeds())


def test_fuse_residual_add_no_bias_conv():
    b = OnnxBuilder()
    x = b.input("x", [2, 4, 6, 6])
    c = b.conv(x, 4, 4, "conv", bias=False)
    model = b.model([b.node("Add", [c, x], name="add")])
    graph, count = _apply(model, fuse_residual_add, expect_fired=True)
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
    _unchanged(model, fuse_residual_add)


# ==== the whole pipeline =====================================================================
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
    h = _gelu(b, b.conv(h, 8, 8, "gelu_conv"), "x_then_half")
    h = _hardswish(b, b.conv(h, 8, 8, "hs_conv"))
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
