"""passes/bound_accumulators.py and the INT8 epilogue that decodes its int32 sums from their bits
(`kernels/common/tile_steps.py`, SUMS_DECODED): the bound is what the weights allow; it is recorded on
INT8 layers (their projection included), not on FP8 ones; kernels that decode give the emulation's
output bit for bit (Triton's interpreter on CPU, compiled on a GPU); where the sums reach 2^22
decoding goes wrong, so the bound is what keeps it exact; the timing identity tells the two
epilogues apart."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from int8_layers import on_device, random_int8_conv
from test_fuse_projected_residual import _fused_layer_inputs, _quantized, bottleneck

from sartor.kernels.conv.igemm import TileConfig
from sartor.kernels.conv.tma import TmaTile
from sartor.kernels.gemm.tma import GemmTmaTile
from sartor.kernels.gemm.resident import RESIDENT_TILES, ResidentTile, resident_gemm
from sartor.kernels.common.tile_steps import DECODABLE_SUM, SUMS_CONVERTED, SUMS_DECODED, epilogue_arguments
from sartor.ops import quantized
from sartor.ops.quantized import ACCUMULATOR_BOUND, _kernel_tactic, qconv, qlayer_weight_for_tactic
from sartor.passes.bound_accumulators import LARGEST_INPUT_CODE, bound_accumulators, product_bound
from sartor.ir.dtypes import QUANTIZED_LAYERS
from sartor.passes.fuse_projected_residual import fuse_projected_residual
from sartor.tactics.timing_cache import layer_signature

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def test_product_bound_is_the_largest_channel_sum():
    weight = np.array([[[[127]], [[-128]], [[0]]], [[[1]], [[2]], [[-3]]]], dtype=np.int8)  # [2, 3, 1, 1]
    assert product_bound(weight, None) == 255 * LARGEST_INPUT_CODE
    bias = np.array([5, -40000], dtype=np.int32)
    assert product_bound(weight, bias) == max(255 * 128 + 5, 6 * 128 + 40000)


def _layers(graph) -> dict:
    return {node.name: node for node in graph.nodes if node.op_type in QUANTIZED_LAYERS}


def test_records_every_int8_layer_and_covers_the_projection():
    graph, _ = _quantized(bottleneck())
    assert fuse_projected_residual(graph) == 1
    layers = _layers(graph)
    assert bound_accumulators(graph) == len(layers) == 4  # stem, c1, c2, c3 (the head stays float)
    for name, node in layers.items():
        own = product_bound(graph.constant(node.inputs[1]), graph.constant(node.inputs[2]))
        if name == "c3":  # the downsample's product runs in the same kernel, decoded the same way
            projection = product_bound(graph.constant(node.inputs[6]), graph.constant(node.inputs[7]))
            assert node.attrs[ACCUMULATOR_BOUND] == max(own, projection) and projection != own
        else:
            assert node.attrs[ACCUMULATOR_BOUND] == own


def test_no_bound_for_fp8_layers_and_no_stale_one():
    graph, _ = _quantized(bottleneck(), "fp8")
    for node in _layers(graph).values():
        node.attrs[ACCUMULATOR_BOUND] = 0  # as if left from before: FP8 sums are float32
    assert bound_accumulators(graph) == 0
    assert all(ACCUMULATOR_BOUND not in node.attrs for node in _layers(graph).values())


def test_epilogue_decodes_below_the_limit_only():
    def int8_sums(bound):
        return epilogue_arguments(quantized=True, fp8=False, bias=None, residual=None, activation=None, alpha=None,
                                  beta=None, residual_after_activation=False, residual_scale=None,
                                  output_inv_scale=None, qmin=-127, accumulator_bound=bound)[1]["INT8"]
    assert int8_sums(DECODABLE_SUM - 1) == SUMS_DECODED
    assert int8_sums(DECODABLE_SUM) == int8_sums(None) == SUMS_CONVERTED


SMALL_RESIDENT = ResidentTile(16, 32, 3, 1, 1)
SMALL_RESIDENT_LOADED = ResidentTile(16, 32, 3, 1, 1, n_adjacent=True, columns_loaded=True)  # bias once a program
SMALL_RESIDENT_CODES_MMA = ResidentTile(16, 32, 3, 1, 1, residual_prefetch=4)  # `_mb`: the residual decoded too
SMALL_IGEMM = TileConfig(16, 16, 32, 1, 1)
SMALL_IGEMM_SPLIT = TileConfig(16, 16, 32, 1, 1, split_k=2)  # sums of two shares decoded by the split-K epilogue
SMALL_TMA = TmaTile(4, 8, 32, 32, 1, 1)
SMALL_GEMM_TMA = GemmTmaTile(16, 32, 32, 1, 1, halves=True, residual_mma=True)
TMA_FED = (SMALL_TMA, SMALL_GEMM_TMA)  # INT8 codes in only


@pytest.mark.parametrize("tile,kernel", [(SMALL_RESIDENT, 1), (SMALL_RESIDENT_LOADED, 1), (SMALL_RESIDENT_CODES_MMA, 1),
                                         (SMALL_IGEMM, 3), (SMALL_IGEMM_SPLIT, 3), (SMALL_TMA, 3),
                                         (SMALL_GEMM_TMA, 1)], ids=lambda v: getattr(v, "name", str(v)))
@pytest.mark.parametrize("int8_output,with_bias", [(True, True), (False, True), (True, False)])
def test_decoding_kernels_equal_the_emulation(tile, kernel, int8_output, with_bias):
    channels = 64 if kernel == 1 else 32  # uniform random weights: K = 288 keeps 3×3 sums below 2^22
    x, wq, bias, res, scale, attrs = random_int8_conv(torch.Generator().manual_seed(7 + kernel), channels, 40,
                                                      kernel=kernel, hw=(7, 5), int8_output=int8_output,
                                                      codes=tile in TMA_FED)
    bias = bias if with_bias else None
    bound = product_bound(wq.numpy(), None if bias is None else bias.numpy())
    assert bound < DECODABLE_SUM
    attrs[ACCUMULATOR_BOUND] = bound
    expected = qconv([x, wq, bias, res, scale], attrs)
    got = _kernel_tactic(on_device(x, DEVICE), qlayer_weight_for_tactic(wq, tile.name).to(DEVICE),
                         None if bias is None else bias.to(DEVICE), on_device(res, DEVICE), scale.to(DEVICE),
                         dict(attrs, tactic=tile.name), gemm=False)
    assert got is not None, "the kernel did not run"
    assert torch.equal(got.cpu(), expected)


# the projection's bias and scale per row tile, or held
@pytest.mark.parametrize("columns", [".cols-loaded.grouped", ".cols-loaded.proj-cols-loaded.grouped"])
def test_projected_layer_decoding_both_products_equals_the_emulation(columns, monkeypatch):
    """The fused downsample's sums are decoded with the layer's own (`_projection_halves`)."""
    inputs, attrs = _fused_layer_inputs("int8")
    inputs = [t.to(DEVICE) if t is not None else None for t in inputs]
    bound = max(product_bound(inputs[1].cpu().numpy(), inputs[2].cpu().numpy()),
                product_bound(inputs[6].cpu().numpy(), inputs[7].cpu().numpy()))
    assert bound < DECODABLE_SUM
    attrs[ACCUMULATOR_BOUND] = bound
    reference = qconv(inputs, dict(attrs, tactic="torch"))
    launches = []
    monkeypatch.setattr(quantized, "resident_gemm", lambda *a, **k: launches.append(k) or resident_gemm(*a, **k))
    got = qconv(inputs, dict(attrs, tactic=RESIDENT_TILES[0].name + columns))
    assert len(launches) == 1 and launches[0]["projection"] is not None  # the fused kernel, not the emulation
    assert launches[0]["accumulator_bound"] == bound and torch.equal(got, reference)


def test_decoding_sums_beyond_the_limit_goes_wrong():
    """A 1×1 layer of K = 512 at full scale: every sum is 512 · 127² ≈ 8.3 million. Told a bound
    below 2^22, the kernel decodes and misses; told its own, it converts and is exact."""
    channels, cout = 512, 16
    x = torch.full((1, channels, 4, 4), 127, dtype=torch.int8)
    wq = torch.full((cout, channels, 1, 1), 127, dtype=torch.int8)
    scale = torch.full((cout,), 1e-6)
    attrs = {"kernel_shape": [1, 1], "strides": [1, 1], "pads": [0] * 4, "dilations": [1, 1],
             "input_inv_scale": 1.0, "qmin": -127}  # float32 output: no saturation hides an error
    expected = qconv([x, wq, None, None, scale], attrs)
    honest = product_bound(wq.numpy(), None)
    assert honest >= DECODABLE_SUM
    inputs = [on_device(x, DEVICE), qlayer_weight_for_tactic(wq, SMALL_IGEMM.name).to(DEVICE), None, None,
              scale.to(DEVICE)]
    for bound, exact in ((honest, True), (0, False)):
        got = qconv(inputs, dict(attrs, tactic=SMALL_IGEMM.name, **{ACCUMULATOR_BOUND: bound}))
        assert torch.equal(got.cpu(), expected) == exact, bound


def test_timing_identity_tells_the_epilogues_apart():
    x, wq, bias, res, scale, attrs = random_int8_conv(torch.Generator().manual_seed(3), 16, 8)
    inputs = [x, wq, bias, res, scale]
    plain = layer_signature("QConv", inputs, attrs, "int8", False)
    assert "sums=" not in plain
    assert layer_signature("QConv", inputs, dict(attrs, **{ACCUMULATOR_BOUND: DECODABLE_SUM}), "int8", False) == plain
    decoded = layer_signature("QConv", inputs, dict(attrs, **{ACCUMULATOR_BOUND: 1000}), "int8", False)
    assert decoded == plain + " sums=decoded"
