"""passes/gather_rows.py: a chain of data-movement ops that keeps the last axis (Swin's cyclic shift
and window partition) becomes one RowGather, on hand-made graphs and on timm's Swin, with ONNX
Runtime's numbers at batches other than those the pass ran; chains that move the last axis, mix
images, pad, or depend on data stay. Also the RowGather op alone and batch_runs' shape rewriting."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from passes_helpers import (OnnxBuilder, apply_pass, assert_matches_ort, assert_unchanged, import_graph, op_counts,
                            small_timm_swin)
from sartor.errors import InputError
from sartor.ops.rows import gather_rows as gather
from sartor.passes import optimize
from sartor.passes.batch_runs import run_batches
from sartor.passes.fuse_add_layernorm import fuse_add_layernorm
from sartor.passes.gather_rows import gather_rows

SIDE, WINDOW, C = 8, 4, 6  # an 8×8 grid of 6 channels, 4×4 windows
GRID = SIDE // WINDOW


def _ints(b: OnnxBuilder, values) -> str:
    return b.const(b._fresh("k"), np.asarray(values, np.int64))


def _roll(b: OnnxBuilder, x: str, shift: int, axis: int) -> str:
    """torch.roll as the exporter writes it: two Slices and a Concat."""
    tail = b.node("Slice", [x, _ints(b, [-shift]), _ints(b, [SIDE]), _ints(b, [axis])])
    head = b.node("Slice", [x, _ints(b, [0]), _ints(b, [-shift]), _ints(b, [axis])])
    return b.node("Concat", [tail, head], axis=axis)


def _windows(b: OnnxBuilder, x: str, case: str = "") -> str:
    """[N, 8, 8, C] → roll → (pad) → [N·4, 16, C] windows, Swin's partition."""
    rolled = _roll(b, _roll(b, x, 2, 1), 2, 2)
    if case == "pad":
        rolled = b.node("Pad", [rolled, _ints(b, [0, 1, 1, 0, 0, 0, 0, 0])], name="pad")
        side = SIDE + 1
        return b.node("Reshape", [rolled, _ints(b, [-1, side * side, C])], name="flat")
    split = b.node("Reshape", [rolled, _ints(b, [-1, GRID, WINDOW, GRID, WINDOW, C])], name="split")
    perm = [0, 1, 3, 2, 4, 5] if case != "moves_last_axis" else [0, 1, 3, 2, 5, 4]
    moved = b.node("Transpose", [split], name="partition", perm=perm)
    return b.node("Reshape", [moved, _ints(b, [-1, WINDOW * WINDOW, C])], name="windows")


def _block(b: OnnxBuilder, case: str = "", batch="N") -> str:
    x = b.input("x", [batch, SIDE, SIDE, C])
    windows = _windows(b, x, case)
    return b.node("MatMul", [windows, b.weight("w", [C, 5])], name="linear")


def _feeds(b: OnnxBuilder, batch: int) -> dict:
    return b.feeds(shapes={"x": [batch, SIDE, SIDE, C]})


def test_swin_partition_becomes_one_row_gather():
    b = OnnxBuilder()
    model = b.model([_block(b)])
    graph, count = apply_pass(model, gather_rows, expect_fired=True)
    assert count == 1 and [n.op_type for n in graph.nodes] == ["RowGather", "MatMul"]
    node = graph.nodes[0]
    assert node.attrs == {"rows_in": SIDE * SIDE, "shape": [GRID * GRID, WINDOW * WINDOW, C], "batch_axis": 0}
    table = graph.initializers[node.inputs[1]]
    assert sorted(table) == list(range(SIDE * SIDE))  # a permutation of one image's rows
    assert len(node.origin) == 9  # 3 per roll axis, the partition's 3
    for batch in (1, 4, 5):  # batch 1 and others than the pass ran
        assert_matches_ort(graph, model, _feeds(b, batch))


def test_a_static_batch_makes_one_table_for_the_whole_tensor():
    b = OnnxBuilder()
    model = b.model([_block(b, batch=2)])
    graph, _ = apply_pass(model, gather_rows, expect_fired=True)
    node = graph.nodes[0]
    assert node.attrs["rows_in"] == 2 * SIDE * SIDE and node.attrs["shape"] == [2 * GRID * GRID, WINDOW * WINDOW, C]
    assert_matches_ort(graph, model, _feeds(b, 2))


def test_shape_reads_of_removed_values_become_functions_of_the_batch():
    """The window count read back from the rolled grid's shape (as Swin computes its window
    reverse) survives the chain's removal: Shape(rolled)[0] becomes batch · 1 + 0, folded where
    it can be."""
    b = OnnxBuilder()
    x = b.input("x", ["N", SIDE, SIDE, C])
    rolled = _roll(b, x, 3, 1)
    split = b.node("Reshape", [rolled, _ints(b, [-1, 2, 4, SIDE, C])])
    moved = b.node("Transpose", [split], perm=[0, 2, 1, 3, 4])
    windows = b.node("Reshape", [moved, _ints(b, [-1, SIDE, C])])
    mixed = b.node("MatMul", [windows, b.weight("w", [C, C])], name="linear")
    images = b.node("Gather", [b.node("Shape", [rolled], name="shape"), _ints(b, 0)], axis=0)
    target = b.node("Concat", [b.node("Unsqueeze", [images, _ints(b, [0])]), _ints(b, [-1])], axis=0)
    model = b.model([b.node("Reshape", [mixed, target], name="per_image")])
    graph, _ = apply_pass(model, gather_rows, expect_fired=True)
    assert op_counts(graph).get("RowGather") == 1 and "Slice" not in op_counts(graph)
    shape_reads = [n.inputs[0] for n in graph.nodes if n.op_type == "Shape"]
    assert shape_reads == ["x"]  # the batch, from the graph's input
    for batch in (1, 3):
        assert_matches_ort(graph, model, _feeds(b, batch))


def test_a_chain_that_leaves_the_rows_in_order_becomes_a_reshape():
    b = OnnxBuilder()
    x = b.input("x", ["N", SIDE, SIDE, C])
    padded = b.node("Pad", [x, _ints(b, [0] * 8)], name="pad_by_zero")
    flat = b.node("Reshape", [padded, _ints(b, [-1, SIDE * SIDE, C])], name="flat")
    model = b.model([b.node("MatMul", [flat, b.weight("w", [C, 3])], name="linear")])
    graph, _ = apply_pass(model, gather_rows, expect_fired=True)
    assert [n.op_type for n in graph.nodes] == ["Reshape", "MatMul"]
    assert_matches_ort(graph, model, _feeds(b, 3))


@pytest.mark.parametrize("case", ["moves_last_axis", "pad"])
def test_must_not_fire(case):
    b = OnnxBuilder()
    model = b.model([_block(b, case)])
    assert_unchanged(model, gather_rows, _feeds(b, 2))


def test_must_not_fire_where_images_mix():
    """[N, 4, C] → [4, N, C] → [4·N, C]: at batch 1 a permutation of rows, at batch 2 images
    interleaved: no per-image table."""
    b = OnnxBuilder()
    x = b.input("x", ["N", 4, C])
    swapped = b.node("Transpose", [x], name="swap", perm=[1, 0, 2])
    rows = b.node("Reshape", [swapped, _ints(b, [-1, C])], name="rows")
    model = b.model([b.node("MatMul", [rows, b.weight("w", [C, 3])], name="linear")])
    assert_unchanged(model, gather_rows, b.feeds(shapes={"x": [3, 4, C]}))


def test_must_not_fire_where_the_chain_depends_on_data():
    b = OnnxBuilder()
    x = b.input("x", ["N", SIDE, C])
    start = b.input("start", [1], elem_type=7)  # int64, a value only known at run time
    cut = b.node("Slice", [x, start, _ints(b, [SIDE]), _ints(b, [1])], name="cut")
    model = b.model([b.node("MatMul", [b.node("Transpose", [cut], perm=[1, 0, 2]), b.weight("w", [C, 3])])])
    feeds = b.feeds(shapes={"x": [2, SIDE, C]})
    feeds["start"] = np.array([2], np.int64)
    assert_unchanged(model, gather_rows, feeds)


def test_dynamic_dims_other_than_the_batch_leave_the_graph_alone():
    b = OnnxBuilder()
    b.input("x", ["N", "H", SIDE, C])
    graph = import_graph(b.model([_windows(b, "x")]))
    assert run_batches(graph) is None and gather_rows(graph) == 0


def test_row_gather_op_takes_any_number_of_whole_images():
    x = torch.arange(2 * 3 * 4, dtype=torch.float32).reshape(2, 3, 4)
    table = torch.tensor([2, 0, 0])
    got = gather(x, table, rows_in=3, shape=[1, 3, 4], batch_axis=0)
    torch.testing.assert_close(got, x[:, [2, 0, 0]])
    with pytest.raises(InputError, match="not whole images of 4 rows"):
        gather(x, table, rows_in=4, shape=[1, 3, 4], batch_axis=0)


def test_timm_swin_windows_become_row_gathers(tmp_path):
    onnx_model = small_timm_swin(tmp_path)
    graph = import_graph(onnx_model)
    optimize(graph, verify=True)
    fuse_add_layernorm(graph)
    before = op_counts(graph)
    # Each block's partition (after its roll in shifted blocks) and its reverse, 4 blocks.
    assert gather_rows(graph) == 8
    after = op_counts(graph)
    assert after["RowGather"] == 8 and before["Transpose"] - after["Transpose"] >= 8
    runs = run_batches(graph)  # no roll left: no Slice or Concat of device tensors
    assert not [n for n in graph.nodes if n.op_type in ("Slice", "Concat") and runs.on_device(n.inputs[0])]
    assert len(graph.nodes) < sum(before.values()) // 2  # and most of the shape arithmetic folded
    x = {"input": np.random.default_rng(0).standard_normal([3, 3, 112, 112]).astype(np.float32)}
    assert_matches_ort(graph, onnx_model, x, rtol=1e-4)
