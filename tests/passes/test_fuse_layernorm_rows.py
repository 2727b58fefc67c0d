"""passes/fuse_layernorm_rows.py: a RowGather folds into the LayerNorm beside it (a LayerNormalization
it reads, the AddLayerNorm whose output it reads, the AddLayerNorm it is the residual of), on hand-made
Swin-like blocks and on timm's Swin, with ONNX Runtime's numbers; a crop of an AddLayerNorm's output,
a LayerNorm read besides its gather, a LayerNorm whose statistics are read, stay."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from passes_helpers import OnnxBuilder, assert_matches_ort, import_graph, op_counts, small_timm_swin
from sartor.ir import verify_graph
from sartor.passes import optimize
from sartor.passes.fuse_add_layernorm import fuse_add_layernorm
from sartor.passes.fuse_layernorm_rows import fuse_layernorm_rows
from sartor.passes.gather_rows import gather_rows

SIDE, WINDOW, C = 8, 4, 6
GRID = SIDE // WINDOW


def _ints(b: OnnxBuilder, values) -> str:
    return b.const(b._fresh("k"), np.asarray(values, np.int64))


def _partition(b: OnnxBuilder, x: str) -> str:
    """[N, 8, 8, C] → [N·4, 16, C]: Swin's window partition."""
    split = b.node("Reshape", [x, _ints(b, [-1, GRID, WINDOW, GRID, WINDOW, C])])
    return b.node("Reshape", [b.node("Transpose", [split], perm=[0, 1, 3, 2, 4, 5]), _ints(b, [-1, WINDOW * WINDOW, C])])


def _reverse(b: OnnxBuilder, windows: str) -> str:
    """[N·4, 16, C] → [N, 8, 8, C]: the window reverse."""
    split = b.node("Reshape", [windows, _ints(b, [-1, GRID, GRID, WINDOW, WINDOW, C])])
    return b.node("Reshape", [b.node("Transpose", [split], perm=[0, 1, 3, 2, 4, 5]), _ints(b, [-1, SIDE, SIDE, C])])


def _layer_norm(b: OnnxBuilder, x: str, name: str, outputs: int = 1):
    return b.node("LayerNormalization", [x, b.weight(name + "_scale", [C], low=0.5), b.weight(name + "_bias", [C])],
                  name=name, outputs=outputs, axis=-1, epsilon=1e-5)


def _swin_block(b: OnnxBuilder, case: str = "") -> list[str]:
    """x → LN → windows → Linear → reverse → + x → LN → windows → Linear (+ the sum again)."""
    x = b.input("x", ["N", SIDE, SIDE, C])
    outputs = []
    if case == "stats_read":
        normed, mean = _layer_norm(b, x, "norm1", outputs=2)
        outputs.append(mean)
    else:
        normed = _layer_norm(b, x, "norm1")
    windows = b.node("MatMul", [_partition(b, normed), b.weight("w1", [C, C])], name="attn")
    total = b.node("Add", [x, _reverse(b, windows)], name="residual")
    normed2 = _layer_norm(b, total, "norm2")
    if case == "crop":  # the first 4 rows of each image's grid: not a permutation
        rows = b.node("Reshape", [normed2, _ints(b, [-1, SIDE * SIDE, C])])
        picked = b.node("Slice", [b.node("Transpose", [rows], perm=[1, 0, 2]), _ints(b, [0]), _ints(b, [4]),
                                  _ints(b, [0])])
        picked = b.node("Transpose", [picked], perm=[1, 0, 2])
    else:
        picked = _partition(b, normed2)
    mlp = b.node("MatMul", [picked, b.weight("w2", [C, C])], name="mlp")
    outputs.append(b.node("Add", [mlp, b.node("Reshape", [total, _ints(b, [-1, WINDOW * WINDOW, C])])]
                          if case != "crop" else [mlp, mlp]))
    return outputs


def _graph(model, passes=(fuse_add_layernorm, gather_rows, fuse_layernorm_rows)):
    graph = import_graph(model)
    counts = [rewrite(graph) for rewrite in passes]
    verify_graph(graph)
    return graph, counts


def _feeds(b: OnnxBuilder, batch: int) -> dict:
    return b.feeds(shapes={"x": [batch, SIDE, SIDE, C]})


def test_every_gather_of_a_swin_block_folds_into_its_layer_norms():
    b = OnnxBuilder()
    model = b.model(_swin_block(b))
    graph, (added, gathered, folded) = _graph(model)
    assert added == 1 and gathered == 3 and folded == 3
    counts = op_counts(graph)
    assert "RowGather" not in counts and counts["GatherLayerNorm"] == 1 and counts["AddLayerNorm"] == 1
    add_norm = next(n for n in graph.nodes if n.op_type == "AddLayerNorm")
    assert all(add_norm.inputs[4:6]) and add_norm.attrs["rows_in"] == SIDE * SIDE
    assert add_norm.attrs["b_rows_in"] == GRID * GRID * WINDOW * WINDOW
    for batch in (1, 3):
        assert_matches_ort(graph, model, _feeds(b, batch))


def test_a_crop_of_an_add_layernorm_output_stays_a_gather():
    """Every row of the sum must be written: an output table that is not a permutation stays apart."""
    b = OnnxBuilder()
    model = b.model(_swin_block(b, "crop"))
    graph, (_, gathered, folded) = _graph(model)
    assert gathered == 3 and folded == 2  # the partition and the residual fold; the crop stays
    crop = next(n for n in graph.nodes if n.op_type == "RowGather")
    assert len(graph.initializers[crop.inputs[1]]) == 4
    assert_matches_ort(graph, model, _feeds(b, 2))


def test_a_layer_norm_whose_statistics_are_read_keeps_its_gather():
    b = OnnxBuilder()
    model = b.model(_swin_block(b, "stats_read"))
    graph, (_, _, folded) = _graph(model)
    assert folded == 2 and op_counts(graph)["RowGather"] == 1 and "GatherLayerNorm" not in op_counts(graph)
    assert_matches_ort(graph, model, _feeds(b, 2))


def test_a_layer_norm_read_besides_its_gather_keeps_it():
    """The normalised rows in their own order are read too: the LayerNorm must still write them."""
    b = OnnxBuilder()
    x = b.input("x", ["N", SIDE, SIDE, C])
    normed = _layer_norm(b, x, "norm")
    model = b.model([b.node("MatMul", [_partition(b, normed), b.weight("w", [C, 3])]), b.node("Relu", [normed])])
    graph, (_, gathered, folded) = _graph(model)
    assert gathered == 1 and folded == 0
    assert_matches_ort(graph, model, _feeds(b, 2))


def test_timm_swin_keeps_no_row_gather(tmp_path):
    onnx_model = small_timm_swin(tmp_path)
    graph = import_graph(onnx_model)
    optimize(graph, verify=True)
    fuse_add_layernorm(graph)
    assert gather_rows(graph) == 8 and fuse_layernorm_rows(graph) == 8
    verify_graph(graph)
    counts = op_counts(graph)
    # Two partitions read a LayerNormalization (the stem's, the patch merger's), two an AddLayerNorm.
    assert "RowGather" not in counts and counts["GatherLayerNorm"] == 2
    x = {"input": np.random.default_rng(0).standard_normal([2, 3, 112, 112]).astype(np.float32)}
    assert_matches_ort(graph, onnx_model, x, rtol=1e-4)
