"""The one-pass residual add + LayerNorm kernel against torch's Add and layer_norm, through Triton's
interpreter on the CPU (natively on a GPU): every row tile, channel counts that are not powers of
two, row counts that do not fill the last program, with and without a bias; and the op's tactics.
The same kernel without the add (LayerNormalization's tactic, with its statistics), with rows read
or written through per-image row tables, and the ops that carry those tables (GatherLayerNorm,
AddLayerNorm's), every tactic against the reference."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

# conftest.py switches Triton to its interpreter when there is no GPU.
triton = pytest.importorskip("triton")

from sartor.kernels.norm.add_layernorm import (  # noqa: E402
    ADD_LAYERNORM_APART, ADD_LAYERNORM_TILES, LAYERNORM_APART, LAYERNORM_TILES, AddLayerNormTile, LayerNormTile,
    RowTable, add_layernorm, add_layernorm_supported, layernorm, layernorm_supported)
from sartor.kernels.registry import TacticNameError, parse_tactic  # noqa: E402
from sartor.ops.norm import (  # noqa: E402
    add_layer_norm, add_layernorm_tactics, gather_layer_norm, gather_layer_norm_tactics, layer_norm, layer_norm_tactics)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("tile", ADD_LAYERNORM_TILES, ids=lambda t: t.name)
@pytest.mark.parametrize("shape,dtype,with_bias", [((2, 7, 96), torch.float32, True), ((13, 384), torch.float16, True),
                                                   ((3, 5, 20), torch.float32, False), ((1, 1, 7), torch.float16, True)])
def test_kernel_matches_add_then_layer_norm(tile, shape, dtype, with_bias):
    generator = torch.Generator().manual_seed(0)
    a, b = (torch.randn(shape, generator=generator).to(DEVICE, dtype) for _ in range(2))
    channels = shape[-1]
    weight = (1 + 0.3 * torch.randn(channels, generator=generator)).to(DEVICE, dtype)
    bias = (0.2 * torch.randn(channels, generator=generator)).to(DEVICE, dtype) if with_bias else None
    total, normed = add_layernorm(a, b, weight, bias, 1e-5, tile.rows)
    expected_total = a + b
    assert torch.equal(total, expected_total)  # the Add's own rounding
    expected = F.layer_norm(expected_total.float(), (channels,), weight.float(), None if bias is None else bias.float(),
                            1e-5)
    tolerance = 2e-3 if dtype == torch.float16 else 1e-5
    torch.testing.assert_close(normed.float(), expected, rtol=tolerance, atol=tolerance)


def test_tile_names_parse_back_and_bad_ones_are_refused():
    assert [t.name for t in ADD_LAYERNORM_TILES] == ["add_layernorm.r1", "add_layernorm.r4", "add_layernorm.r16"]
    assert parse_tactic("add_layernorm.r4") == AddLayerNormTile(4)
    with pytest.raises(TacticNameError, match="not a add_layernorm tactic"):
        parse_tactic("add_layernorm.r3")


def test_the_kernel_is_offered_on_cuda_for_equal_contiguous_operands_only():
    a, weight = torch.randn(4, 8), torch.ones(8)
    assert add_layernorm_supported(a, a, weight, None)
    assert not add_layernorm_supported(a, a[:1], weight, None)  # broadcast
    assert not add_layernorm_supported(a, a.t().contiguous().t(), weight, None)  # not contiguous
    assert not add_layernorm_supported(a, a, torch.ones(4), None)  # scale over another axis
    assert add_layernorm_tactics([a, a, weight], {}) == ["torch"]  # a CPU tensor: the reference only
    if DEVICE == "cuda":
        assert add_layernorm_tactics([a.cuda(), a.cuda(), weight.cuda()], {})[1:] == [t.name for t in ADD_LAYERNORM_TILES]


def test_every_tactic_of_the_op_computes_the_reference():
    generator = torch.Generator().manual_seed(1)
    a, b = torch.randn(6, 32, generator=generator).to(DEVICE), torch.randn(6, 32, generator=generator).to(DEVICE)
    weight, bias = torch.rand(32, generator=generator).to(DEVICE), torch.randn(32, generator=generator).to(DEVICE)
    reference = add_layer_norm([a, b, weight, bias], {"epsilon": 1e-5, "tactic": "torch"})
    for tile in ADD_LAYERNORM_TILES:
        total, normed = add_layer_norm([a, b, weight, bias], {"epsilon": 1e-5, "tactic": tile.name})
        torch.testing.assert_close(total, reference[0])
        torch.testing.assert_close(normed, reference[1], rtol=1e-5, atol=1e-5)


# ---- LayerNorm without the add, and rows through tables ------------------------------------------
def _affine(channels: int, dtype, generator, with_bias: bool = True):
    weight = (1 + 0.3 * torch.randn(channels, generator=generator)).to(DEVICE, dtype)
    bias = (0.2 * torch.randn(channels, generator=generator)).to(DEVICE, dtype) if with_bias else None
    return weight, bias


def _reference_layer_norm(x, weight, bias):
    return F.layer_norm(x.float(), (x.shape[-1],), weight.float(), None if bias is None else bias.float(), 1e-5)


@pytest.mark.parametrize("tile", LAYERNORM_TILES, ids=lambda t: t.name)
@pytest.mark.parametrize("shape,dtype,with_bias", [((2, 7, 96), torch.float32, True), ((13, 384), torch.float16, True),
                                                   ((3, 5, 20), torch.float32, False)])
def test_layernorm_kernel_matches_torch_with_its_statistics(tile, shape, dtype, with_bias):
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=generator).to(DEVICE, dtype)
    weight, bias = _affine(shape[-1], dtype, generator, with_bias)
    y, mean, inv = layernorm(x, weight, bias, 1e-5, tile.rows)
    tolerance = 2e-3 if dtype == torch.float16 else 1e-5
    torch.testing.assert_close(y.view(shape).float(), _reference_layer_norm(x, weight, bias), rtol=tolerance,
                               atol=tolerance)
    rows = x.float().reshape(-1, shape[-1])
    torch.testing.assert_close(mean, rows.mean(-1), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(inv, torch.rsqrt(rows.var(-1, unbiased=False) + 1e-5), rtol=1e-4, atol=1e-4)


def test_layernorm_op_offers_the_kernel_on_cuda_over_the_last_axis_only():
    x, weight = torch.randn(4, 8), torch.ones(8)
    assert layer_norm_tactics([x, weight], {"axis": -1}) == ["torch"]  # a CPU tensor: the reference only
    assert [t.name for t in LAYERNORM_TILES] == ["layernorm.r1", "layernorm.r4", "layernorm.r16"]
    if DEVICE == "cuda":
        assert layer_norm_tactics([x.cuda(), weight.cuda()], {"axis": -1})[1:] == [t.name for t in LAYERNORM_TILES]
        assert layer_norm_tactics([x.cuda(), torch.ones(4, 8).cuda()], {"axis": 0}) == ["torch"]


def test_every_layernorm_tactic_of_the_op_computes_the_reference():
    generator = torch.Generator().manual_seed(2)
    x = torch.randn(2, 6, 32, generator=generator).to(DEVICE)
    weight, bias = _affine(32, torch.float32, generator)
    attrs = {"axis": -1, "epsilon": 1e-5, "stash_type": 1}
    reference = layer_norm([x, weight, bias], dict(attrs, tactic="torch"))
    for tile in LAYERNORM_TILES:
        got = layer_norm([x, weight, bias], dict(attrs, tactic=tile.name))
        for out, expected in zip(got, reference):
            assert out.shape == expected.shape and out.dtype == expected.dtype
            torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def _table(rows_out: int, rows_in: int, generator, permutation: bool) -> RowTable:
    table = torch.randperm(rows_in, generator=generator) if permutation else \
        torch.randint(0, rows_in, (rows_out,), generator=generator)
    return RowTable(table.to(DEVICE), rows_in)


def _through(x: torch.Tensor, table: RowTable) -> torch.Tensor:
    """x's rows through the table, per image, as torch would gather them."""
    rows = x.reshape(-1, table.rows_in, x.shape[-1])
    return rows[:, table.table.long()].reshape(-1, x.shape[-1])


@pytest.mark.parametrize("tile", [LAYERNORM_TILES[0], LAYERNORM_TILES[1]], ids=lambda t: t.name)
def test_layernorm_reads_its_rows_through_a_table(tile):
    generator = torch.Generator().manual_seed(3)
    images, rows_in, channels = 3, 10, 24
    x = torch.randn(images * rows_in, channels, generator=generator).to(DEVICE)
    weight, bias = _affine(channels, torch.float32, generator)
    table = _table(7, rows_in, generator, permutation=False)  # a crop with repeats: any table
    assert layernorm_supported(x, weight, bias, table)
    y, _, _ = layernorm(x, weight, bias, 1e-5, tile.rows, rows=table)
    assert y.shape == (images * 7, channels)
    torch.testing.assert_close(y, _reference_layer_norm(_through(x, table), weight, bias), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("gathered", ["output", "residual", "both"])
def test_add_layernorm_permutes_its_output_and_gathers_its_residual(gathered):
    generator = torch.Generator().manual_seed(4)
    images, rows_in, channels = 2, 12, 20
    a = torch.randn(images, rows_in, channels, generator=generator).to(DEVICE)
    weight, bias = _affine(channels, torch.float32, generator)
    rows = _table(rows_in, rows_in, generator, permutation=True) if gathered != "residual" else None
    b_rows = _table(rows_in, 9, generator, permutation=False) if gathered != "output" else None
    b = torch.randn(images * (9 if b_rows else rows_in), channels, generator=generator).to(DEVICE)
    if b_rows is None:
        b = b.view(a.shape)
    assert add_layernorm_supported(a, b, weight, bias, rows, b_rows)
    total, normed = add_layernorm(a, b, weight, bias, 1e-5, 4, rows=rows, b_rows=b_rows)
    expected_total = a + (_through(b, b_rows).view(a.shape) if b_rows else b)
    assert total.shape == a.shape and torch.equal(total, expected_total)
    expected = _reference_layer_norm(expected_total, weight, bias).reshape(-1, channels)
    if rows is not None:
        expected = _through(expected, rows)
    torch.testing.assert_close(normed.reshape(-1, channels), expected, rtol=1e-5, atol=1e-5)


def test_add_layernorm_refuses_an_output_table_that_is_not_a_permutation():
    generator = torch.Generator().manual_seed(5)
    a = torch.randn(2, 6, 8, generator=generator)
    crop = RowTable(torch.arange(4), 6)  # rows 4 and 5 of the sum would never be written
    assert not add_layernorm_supported(a, a, torch.ones(8), None, rows=crop)
    assert not add_layernorm_supported(a, a, torch.ones(8), None, b_rows=RowTable(torch.arange(4), 5))


# ---- the ops with row tables (passes/fuse_layernorm_rows.py) -------------------------------------
def _window_table(generator) -> torch.Tensor:
    return torch.randperm(16, generator=generator).to(DEVICE)


def test_apart_tiles_parse_back():
    assert [t.name for t in ADD_LAYERNORM_APART] == ["add_layernorm.r1.apart", "add_layernorm.r4.apart",
                                                     "add_layernorm.r16.apart"]
    assert parse_tactic("layernorm.r4.apart") == LayerNormTile(4, apart=True)


def test_every_gather_layer_norm_tactic_computes_the_reference():
    generator = torch.Generator().manual_seed(6)
    x = torch.randn(3, 4, 4, 8, generator=generator).to(DEVICE)  # 3 images of 16 rows
    weight, bias = _affine(8, torch.float32, generator)
    table = torch.randint(0, 16, (12,), generator=generator).to(DEVICE)
    attrs = {"epsilon": 1e-5, "rows_in": 16, "shape": [3, 4, 8], "batch_axis": 0}
    reference = gather_layer_norm([x, weight, bias, table], dict(attrs, tactic="torch"))
    assert reference.shape == (9, 4, 8)
    expected = F.layer_norm(x.reshape(3, 16, 8)[:, table.long()], (8,), weight, bias, 1e-5).reshape(9, 4, 8)
    torch.testing.assert_close(reference, expected, rtol=1e-5, atol=1e-5)
    tactics = gather_layer_norm_tactics([x, weight, bias, table], attrs)
    if DEVICE == "cuda":
        assert tactics[1:] == [t.name for t in LAYERNORM_TILES + LAYERNORM_APART]
    for tactic in [t.name for t in LAYERNORM_TILES + LAYERNORM_APART]:
        got = gather_layer_norm([x, weight, bias, table], dict(attrs, tactic=tactic))
        torch.testing.assert_close(got, reference, rtol=1e-5, atol=1e-5)


def test_every_add_layernorm_tactic_with_row_tables_computes_the_reference():
    generator = torch.Generator().manual_seed(7)
    a = torch.randn(2, 4, 4, 8, generator=generator).to(DEVICE)  # 2 images of 16 rows
    windows = torch.randn(8, 4, 8, generator=generator).to(DEVICE)  # their 4 windows of 4 rows each
    weight, bias = _affine(8, torch.float32, generator)
    rows, b_rows = _window_table(generator), _window_table(generator)
    attrs = {"epsilon": 1e-5, "rows_in": 16, "shape": [4, 4, 8], "batch_axis": 0,
             "b_rows_in": 16, "b_shape": [1, 4, 4, 8], "b_batch_axis": 0}
    inputs = [a, windows, weight, bias, rows, b_rows]
    total, normed = add_layer_norm(inputs, dict(attrs, tactic="torch"))
    residual = windows.reshape(2, 16, 8)[:, b_rows.long()].reshape(a.shape)
    torch.testing.assert_close(total, a + residual)
    expected = F.layer_norm(a + residual, (8,), weight, bias, 1e-5).reshape(2, 16, 8)[:, rows.long()]
    torch.testing.assert_close(normed, expected.reshape(8, 4, 8), rtol=1e-5, atol=1e-5)
    tactics = add_layernorm_tactics(inputs, attrs)
    if DEVICE == "cuda":
        assert tactics[1:] == [t.name for t in ADD_LAYERNORM_TILES + ADD_LAYERNORM_APART]
    for tactic in [t.name for t in ADD_LAYERNORM_TILES + ADD_LAYERNORM_APART]:
        got_total, got_normed = add_layer_norm(inputs, dict(attrs, tactic=tactic))
        torch.testing.assert_close(got_total, total)
        torch.testing.assert_close(got_normed, normed, rtol=1e-5, atol=1e-5)
