"""The resident-weight kernel of INT8/FP8 1×1 convolutions and GEMMs of small K
(`sartor/kernels/gemm/resident.py`): equal to the emulation, into channel slices, where the tactic
is offered and where it must not be. Through Triton's interpreter on CPU and natively on a GPU."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from int8_layers import on_device, random_int8_conv, random_int8_gemm, residual_view

# conftest.py switches Triton to its interpreter when there is no GPU.
pytest.importorskip("triton")

from sartor.kernels.conv.igemm import NARROW_MAX_BLOCK_M, ConvGeometry, pack_weight  # noqa: E402
from sartor.kernels.registry import TacticNameError  # noqa: E402
from sartor.kernels.common.tile_steps import residual_pixels  # noqa: E402
from sartor.kernels.gemm.resident import (BALANCED_PROGRAMS_PER_SM, MAX_RESIDENT_K, MMA_BITS_MIN_EFFORT,  # noqa: E402
                                          MMA_RESIDUAL_MAX_BLOCK_N, NARROW_MAX_CHANNELS, RESIDENT_TILES, WIDE_K,
                                          WIDE_K_TILE, Projection, ResidentTile, narrowed, resident_applies,
                                          resident_gemm, resident_tactics)
from sartor.ops import default_registry  # noqa: E402
from sartor.ops.fp8 import QFORMAT, code_distance, quantize_fp8  # noqa: E402
from sartor.ops.quantized import (_qlayer_resident, qconv, qconv_into, qgemm, qlayer_weight_for_tactic,  # noqa: E402
                                  quantize)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FP8_KERNELS = DEVICE == "cpu" or torch.cuda.get_device_capability() >= (8, 9)
SMALL = ResidentTile(16, 32, 3, 1, 1)  # small enough for the interpreter; 3 row tiles per program
SMALL_EARLY, SMALL_AHEAD, SMALL_MMA, SMALL_MMA_BITS = (ResidentTile(16, 32, 3, 1, 1, residual_prefetch=mode)
                                                       for mode in (1, 2, 3, 4))
SMALL_ADJACENT = ResidentTile(16, 32, 3, 1, 1, n_adjacent=True)  # 40 or 33 channels: 2 column tiles
SMALL_COLUMNS = ResidentTile(16, 32, 3, 1, 1, columns_loaded=True)  # bias and scale loaded once per program
# The balanced walk: 2 programs for each of the interpreter's INTERPRETED_SMS share the row tiles in
# equal runs (70 pixels: 5 row tiles of 16 for 4 programs, 2 each, the last runs past the end).
SMALL_BALANCED = ResidentTile(16, 32, 2, 1, 1, columns_loaded=True, balanced=True)


@pytest.mark.parametrize("channels,cout", [(64, 40), (48, 16), (128, 33), (200, 24)])  # 200: K block 256
@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("int8_output", [True, False])
@pytest.mark.parametrize("tile", [SMALL, SMALL_EARLY, SMALL_AHEAD, SMALL_ADJACENT,
                                  replace(SMALL_AHEAD, n_adjacent=True), SMALL_COLUMNS,
                                  replace(SMALL_AHEAD, n_adjacent=True, columns_loaded=True), SMALL_MMA,
                                  replace(SMALL_MMA, n_adjacent=True, columns_loaded=True), SMALL_MMA_BITS,
                                  replace(SMALL_MMA_BITS, n_adjacent=True, columns_loaded=True), SMALL_BALANCED,
                                  replace(SMALL_BALANCED, n_adjacent=True), replace(SMALL_AHEAD, balanced=True)],
                         ids=lambda tile: tile.name)
def test_resident_conv_equals_the_emulation(channels, cout, residual, int8_output, tile):
    """70 output pixels in row tiles of 16, 3 per program: the second program's last tile (and,
    with the residual loaded a tile ahead, the tile after it) lies past the end."""
    x, wq, bias, res, scale, attrs = random_int8_conv(torch.Generator().manual_seed(channels + cout), channels, cout,
                                                      hw=(7, 5), residual=residual, int8_output=int8_output)
    expected = qconv([x, wq, bias, res, scale], attrs)
    xd, resd = on_device(x, DEVICE), on_device(res, DEVICE)
    out = _qlayer_resident(xd, qlayer_weight_for_tactic(wq, tile.name).to(DEVICE), bias.to(DEVICE), resd,
                           scale.to(DEVICE), attrs, tile, gemm=False)
    assert out is not None, "the kernel did not run"
    assert out.dtype == expected.dtype and out.is_contiguous(memory_format=torch.channels_last)
    through_the_op = qconv([xd, qlayer_weight_for_tactic(wq, tile.name).to(DEVICE), bias.to(DEVICE), resd,
                            scale.to(DEVICE)], dict(attrs, tactic=tile.name))
    assert torch.equal(through_the_op.cpu(), expected)
    assert torch.equal(out.cpu(), expected)


@pytest.mark.parametrize("cout", [16, 24])
def test_narrowed_tile_equals_the_emulation(cout):
    """A tile narrowed to 16 columns (`narrowed`, a layer of 16 outputs): one column tile, or a whole
    one and a part, bit for bit the emulation with a residual of codes."""
    tile = narrowed(ResidentTile(8, 64, 3, 1, 1), 16)
    assert (tile.block_m, tile.block_n) == (32, 16)
    x, wq, bias, res, scale, attrs = random_int8_conv(torch.Generator().manual_seed(cout), 48, cout, hw=(7, 5),
                                                      residual=True, int8_output=True)
    expected = qconv([x, wq, bias, res, scale], attrs)
    out = _qlayer_resident(on_device(x, DEVICE), qlayer_weight_for_tactic(wq, tile.name).to(DEVICE), bias.to(DEVICE),
                           on_device(res, DEVICE), scale.to(DEVICE), attrs, tile, gemm=False)
    assert out is not None and torch.equal(out.cpu(), expected)


def test_layers_of_few_outputs_are_offered_narrowed_tiles():
    """Up to NARROW_MAX_CHANNELS outputs, each tile also as narrow as the outputs allow, rows raised
    to keep its size, with the same variants; at most
    NARROW_MAX_BLOCK_M rows; none for wider layers, or without the layer's outputs."""
    tiles = lambda names: [ResidentTile.parse(name) for name in names]  # noqa: E731
    assert resident_tactics(1, out_channels=64) == resident_tactics(1)
    for cout, shape in ((32, (128, 32)), (20, (128, 32)), (16, (256, 16)), (3, (256, 16))):
        names = resident_tactics(1, out_channels=cout)
        narrow = [tile for tile in tiles(names) if tile.name not in resident_tactics(1)]
        assert names[0] == resident_tactics(1)[0] and set(resident_tactics(1)) < set(names)
        assert {(t.block_m, t.block_n) for t in narrow} == {shape}, cout
        # plain, grouped, cols-loaded, both
        assert {(t.n_adjacent, t.columns_loaded) for t in narrow} == {(a, c) for a in (0, 1) for c in (0, 1)}
    wide = tiles(resident_tactics(5, out_channels=16))
    assert max(t.block_m for t in wide) == NARROW_MAX_BLOCK_M and min(t.block_n for t in wide) == 16
    assert narrowed(ResidentTile(64, 64, 8, 4, 3), NARROW_MAX_CHANNELS + 1) is None
    assert narrowed(ResidentTile(64, 32, 8, 4, 3), 32) is None  # as narrow already


@pytest.mark.parametrize("hw,strides", [((9, 7), (2, 2)), ((8, 11), (2, 3))])
@pytest.mark.parametrize("residual,codes", [(False, True), (True, False)])
def test_strided_1x1_resident_conv_equals_the_emulation(hw, strides, residual, codes):
    """ResNet's downsample: a 1×1 convolution at stride 2 (and uneven strides), odd and even sizes,
    where output pixel (n, oh, ow) reads input pixel (n, oh·sh, ow·sw); INT8 codes in (as ResNet's)
    or floats quantized on load."""
    generator = torch.Generator().manual_seed(31 + strides[1])
    x, wq, bias, _, scale, attrs = random_int8_conv(generator, 48, 20, hw=hw, residual=False, codes=codes)
    attrs["strides"] = list(strides)
    out_hw = tuple((size - 1) // stride + 1 for size, stride in zip(hw, strides))
    res = torch.randint(-127, 128, (2, 20, *out_hw), dtype=torch.int8, generator=generator) if residual else None
    expected = qconv([x, wq, bias, res, scale], attrs)
    assert tuple(expected.shape[2:]) == out_hw
    xd = on_device(x, DEVICE)
    resd = on_device(res, DEVICE) if residual else None
    for tile in (SMALL, SMALL_ADJACENT):
        out = _qlayer_resident(xd, qlayer_weight_for_tactic(wq, tile.name).to(DEVICE), bias.to(DEVICE), resd,
                               scale.to(DEVICE), attrs, tile, gemm=False)
        assert out is not None, "the kernel did not run"
        assert out.is_contiguous(memory_format=torch.channels_last) and torch.equal(out.cpu(), expected), tile.name


def test_resident_gemm_and_codes_in_equal_the_emulation():
    generator = torch.Generator().manual_seed(11)
    x, wq, bias, scale, attrs = random_int8_gemm(generator, 37, 96, 20)
    expected = qgemm([x, wq, bias, None, scale], attrs)
    out = _qlayer_resident(x.to(DEVICE), pack_weight(wq).to(DEVICE), bias.to(DEVICE), None, scale.to(DEVICE), attrs,
                           SMALL, gemm=True)
    assert out is not None and torch.equal(out.cpu(), expected)
    codes = quantize(x, attrs["input_inv_scale"], attrs["qmin"])
    out = resident_gemm(codes.to(DEVICE), pack_weight(wq).to(DEVICE), bias.to(DEVICE), SMALL,
                        dequant_scale=scale.to(DEVICE), input_inv_scale=attrs["input_inv_scale"],
                        output_inv_scale=attrs["output_inv_scale"], qmin=attrs["qmin"])
    assert torch.equal(out.cpu(), expected)


@pytest.mark.parametrize("view", ["cropped", "channel_slice", "nchw"])
def test_resident_conv_reads_a_residual_view(view):
    """A residual whose pixels are not evenly spaced is addressed by (n, oh, ow); evenly spaced ones
    by their row alone (`tile_steps.residual_pixels`): both equal the emulation."""
    x, wq, bias, res, scale, attrs = random_int8_conv(torch.Generator().manual_seed(31), 48, 40, hw=(7, 5))
    expected = qconv([x, wq, bias, res, scale], attrs)
    out = _qlayer_resident(on_device(x, DEVICE), qlayer_weight_for_tactic(wq, SMALL.name).to(DEVICE),
                           bias.to(DEVICE), residual_view(res.to(DEVICE), view), scale.to(DEVICE), attrs, SMALL,
                           gemm=False)
    assert out is not None and torch.equal(out.cpu(), expected)


@pytest.mark.parametrize("strides,batch,out_hw,flat", [
    ((35 * 40, 1, 5 * 40, 40), 2, (7, 5), True),  # channels-last, whole
    ((35 * 49, 1, 5 * 49, 49), 2, (7, 5), True),  # a channel slice of 49 channels
    ((10 * 7 * 40, 1, 7 * 40, 40), 2, (7, 5), False),  # cropped out of 10 × 7 pixels
    ((40 * 35, 35, 5, 1), 2, (7, 5), False),  # NCHW, two images
    ((40 * 35, 35, 5, 1), 1, (7, 5), True),  # NCHW, one image: pixel m at m
    ((0, 0, 0, 0), 2, (7, 5), True),  # no residual
])
def test_residual_pixels_flattens_evenly_spaced_residuals_only(strides, batch, out_hw, flat):
    hw, flat_strides = residual_pixels(strides, batch, out_hw)
    assert (hw == (1, 1)) == flat
    if not flat:
        assert (hw, flat_strides) == (out_hw, strides)
    else:  # pixel (n, oh, ow) = row m sits where the strides put it
        for n in range(batch):
            for oh in range(out_hw[0]):
                for ow in range(out_hw[1]):
                    m = (n * out_hw[0] + oh) * out_hw[1] + ow
                    assert m * flat_strides[0] == n * strides[0] + oh * strides[2] + ow * strides[3]
        assert flat_strides[1] == strides[1]


def test_resident_conv_reads_a_channel_slice_and_writes_into_one():
    """A Split half in, a Concat's slice out: the other channels stay untouched."""
    generator = torch.Generator().manual_seed(12)
    x, wq, bias, _, scale, attrs = random_int8_conv(generator, 32, 24, hw=(7, 5), residual=False)
    source = torch.randn(2, 48, 7, 5, generator=generator).contiguous(memory_format=torch.channels_last)
    x = source[:, 8:40]
    expected = qconv([x.contiguous(), wq, bias, None, scale], attrs)
    buffer = torch.full((2, 60, 7, 5), 7, dtype=torch.int8).contiguous(memory_format=torch.channels_last).to(DEVICE)
    out = buffer.narrow(1, 10, 24)
    written = qconv_into([x.to(DEVICE), pack_weight(wq).to(DEVICE), bias.to(DEVICE), None, scale.to(DEVICE)],
                         dict(attrs, tactic=SMALL.name), out)
    assert written is not None and written.data_ptr() == out.data_ptr()
    assert torch.equal(buffer[:, 10:34].cpu(), expected)
    assert (buffer[:, :10] == 7).all() and (buffer[:, 34:] == 7).all()


@pytest.mark.skipif(not FP8_KERNELS, reason="FP8 tl.dot needs compute capability 8.9+")
def test_fp8_resident_conv_matches_the_emulation_within_one_step():
    generator = torch.Generator().manual_seed(13)
    attrs = {"kernel_shape": [1, 1], "pads": [0, 0, 0, 0], "qformat": QFORMAT, "input_inv_scale": 30.0,
             "output_inv_scale": 8.0, "activation": "Relu"}
    x = torch.randn(2, 64, 6, 5, generator=generator)
    wq = quantize_fp8(torch.randn(24, 64, 1, 1, generator=generator), 100.0)
    bias, scale = torch.randn(24, generator=generator), torch.rand(24, generator=generator) * 1e-3
    expected = qconv([x, wq, bias, None, scale], attrs)
    xd = x.contiguous(memory_format=torch.channels_last).to(DEVICE)
    out = _qlayer_resident(xd, pack_weight(wq).to(DEVICE), bias.to(DEVICE), None, scale.to(DEVICE), attrs, SMALL,
                           gemm=False)
    assert out is not None and out.dtype == torch.float8_e4m3fn and int(code_distance(out.cpu(), expected).max()) <= 1


def test_resident_applies_to_one_block_1x1_layers_only():
    nhwc = torch.zeros(2, 64, 8, 8).contiguous(memory_format=torch.channels_last)
    one_by_one = ConvGeometry((1, 1), (1, 1), (0, 0), (1, 1), (8, 8))
    assert resident_applies(nhwc, 64, one_by_one)
    assert resident_applies(torch.zeros(5, 128), 128)  # a GEMM
    assert resident_applies(torch.zeros(2, 256, 8, 8).contiguous(memory_format=torch.channels_last), 256,
                            one_by_one)  # K = MAX_RESIDENT_K: layer3's conv3
    assert not resident_applies(nhwc, MAX_RESIDENT_K * 2, one_by_one)  # K over one block
    assert not resident_applies(torch.zeros(2, 64, 8, 8), 64, one_by_one)  # NCHW: channels not contiguous
    assert not resident_applies(nhwc, 64, ConvGeometry((3, 3), (1, 1), (1, 1), (1, 1), (8, 8)))
    assert resident_applies(nhwc, 64, ConvGeometry((1, 1), (2, 2), (0, 0), (1, 1), (4, 4)))  # the downsample
    assert not resident_applies(nhwc, 64, ConvGeometry((1, 1), (2, 2), (0, 0), (1, 1), (5, 4)))  # not its output
    assert not resident_applies(nhwc, 64, ConvGeometry((1, 1), (1, 1), (1, 1), (1, 1), (10, 10)))  # padded
    with pytest.raises(ValueError, match="takes a residual of INT8 codes through the tensor cores, not torch.float32"):
        resident_gemm(torch.zeros(2, 64, 8, 8, device=DEVICE).contiguous(memory_format=torch.channels_last),
                      torch.zeros(8, 64, dtype=torch.int8, device=DEVICE), None, SMALL_MMA,
                      dequant_scale=torch.ones(8, device=DEVICE),
                      residual=torch.zeros(2, 8, 8, 8, device=DEVICE).contiguous(memory_format=torch.channels_last))
    with pytest.raises(ValueError, match="not 64 contiguous channels"):
        resident_gemm(torch.zeros(2, 64, 8, 8, device=DEVICE), torch.zeros(8, 64, dtype=torch.int8, device=DEVICE),
                      None, SMALL, dequant_scale=torch.ones(8, device=DEVICE))
    # Last, the first tile with its columns loaded (and narrowed, for few outputs) walking balanced.
    first_loaded = replace(RESIDENT_TILES[0], columns_loaded=True)
    assert [name for name in resident_tactics(1) if name.endswith(".balanced")] == [
        replace(first_loaded, tiles=per_sm, balanced=True).name for per_sm in BALANCED_PROGRAMS_PER_SM]
    assert [name for name in resident_tactics(2, out_channels=32) if name.endswith(".balanced")][2:] == [
        replace(narrowed(first_loaded, 32), tiles=per_sm, balanced=True).name for per_sm in BALANCED_PROGRAMS_PER_SM]
    assert all(name.endswith(".balanced") for name in resident_tactics(3)[-2:])

    def plain_tactics(*args, **kwargs) -> list[str]:
        return [name for name in resident_tactics(*args, **kwargs) if not name.endswith(".balanced")]
    assert 4 == len(plain_tactics(1)) < len(plain_tactics(3)) <= len(plain_tactics(5))
    assert len(plain_tactics(5)) == 4 * len(RESIDENT_TILES)
    first = RESIDENT_TILES[0].name
    g, c, e, r, m, mb = (".grouped", ".cols-loaded", ".residual-early", ".residual-next", ".residual-mma",
                         ".residual-mma-bits")
    assert plain_tactics(1) == [first, first + g, first + c, first + c + g]
    assert plain_tactics(1, residual=True) == plain_tactics(1)  # the early residual: from effort 3
    wide = WIDE_K_TILE.name
    assert plain_tactics(1, k_total=WIDE_K) == plain_tactics(1)  # layer1/2's K of 64 and 128
    assert plain_tactics(1, k_total=256) == [first, first + g, wide, wide + g, first + c, first + c + g,
                                                wide + c, wide + c + g]  # layer3's conv3
    assert plain_tactics(5, k_total=256) == plain_tactics(5)  # already among the tiles: not twice
    with_residual = plain_tactics(3, residual=True)
    assert with_residual[:2] == [first, first + g] and with_residual[-2:] == [RESIDENT_TILES[3].name + e + c + g,
                                                                           RESIDENT_TILES[3].name + r + c + g]
    with_residual = [name for name in with_residual if name.startswith(first)]
    assert with_residual == [first + suffix for suffix in ("", g, c, c + g, e, r, e + g, r + g, e + c, r + c,
                                                           e + c + g, r + c + g)]
    # INT8 residual codes: every tile also through the tensor cores (residual-mma), at every effort,
    # and with the residual's sums decoded (residual-mma-bits) from MMA_BITS_MIN_EFFORT; not without
    # a residual
    assert plain_tactics(1, residual=True, residual_codes=True) == plain_tactics(1) + [
        first + suffix for suffix in (m, m + g, m + c, m + c + g)]
    assert plain_tactics(1, residual_codes=True) == plain_tactics(1)
    variants = ("", g, c, c + g)
    for effort, modes in ((3, (m, e, r)), (MMA_BITS_MIN_EFFORT, (m, mb, e, r))):
        with_codes = [name for name in plain_tactics(effort, residual=True, residual_codes=True)
                      if name.startswith(first)]
        assert with_codes == [first + variant for variant in variants] + [
            first + mode + variant for variant in variants for mode in modes], effort
    widest = [tile for tile in RESIDENT_TILES if tile.block_n > MMA_RESIDUAL_MAX_BLOCK_N]  # 64×256: its identity
    assert widest and not any(ResidentTile.parse(name).residual_prefetch in (3, 4) and ResidentTile.parse(name).block_n
                              > MMA_RESIDUAL_MAX_BLOCK_N for name in plain_tactics(5, True, 256, True))
    assert any(ResidentTile.parse(name) == replace(widest[0], residual_prefetch=1)
               for name in plain_tactics(5, True, 256, True))  # the other modes still offered
    with pytest.raises(ValueError, match="comes with cols-loaded"):
        ResidentTile(64, 64, 8, 4, 3, projection_columns_loaded=True)
    assert ResidentTile.parse("resident.64x64.t8.w4.s3.cols-loaded.proj-cols-loaded.grouped") == ResidentTile(
        64, 64, 8, 4, 3, n_adjacent=True, columns_loaded=True, projection_columns_loaded=True)
    for tile in (*RESIDENT_TILES, SMALL_EARLY, SMALL_AHEAD, SMALL_ADJACENT, replace(SMALL_EARLY, n_adjacent=True),
                 SMALL_COLUMNS, SMALL_MMA, replace(SMALL_MMA, n_adjacent=True, columns_loaded=True), SMALL_MMA_BITS,
                 replace(SMALL_MMA_BITS, columns_loaded=True)):
        assert ResidentTile.parse(tile.name) == tile
    assert [ResidentTile.parse(name).residual_prefetch for name in with_residual] == [0, 0, 0, 0] + [1, 2] * 4
    assert [ResidentTile.parse(name).n_adjacent for name in with_residual] == [False, True] * 2 + [False, False,
                                                                                                 True, True] * 2
    assert [ResidentTile.parse(name).columns_loaded for name in with_residual] == [False, False, True, True] + [
        False] * 4 + [True] * 4
    for bad in ("resident.64x64.t4.w4", "resident.64x64.4.w4.s3", "resident.axb.t1.w1.s1", "igemm.64x64x64.w4.s4",
                "resident.64x33.t4.w4.s3", "resident.64x64.t4.w4.s3.x",
                "resident.64x64.t4.w4.s3.residual-next.residual-early",
                "resident.64x64.t4.w4.s3.grouped.residual-early", "resident.64x64.t4.w4.s3.grouped.cols-loaded",
                "resident.64x64.t4.w4.s3.cols-loaded.residual-early", "resident.64x64.t4.w4.s3.proj-cols-loaded",
                "resident_64x64_t4_w4_s3"):
        with pytest.raises(TacticNameError):
            ResidentTile.parse(bad)


@pytest.mark.skipif(DEVICE != "cuda", reason="the tactics list the kernels on CUDA tensors only")
def test_cuda_1x1_layers_offer_the_resident_tactic_and_3x3_layers_do_not():
    registry = default_registry()["QConv"]
    x = torch.zeros(1, 64, 8, 8, device="cuda").contiguous(memory_format=torch.channels_last)
    one = registry.tactics([x, torch.zeros(32, 64, 1, 1, dtype=torch.int8, device="cuda")], {}, 1)
    assert any(name.startswith("resident.") for name in one)
    three = registry.tactics([x, torch.zeros(32, 64, 3, 3, dtype=torch.int8, device="cuda")], {"pads": [1, 1, 1, 1]}, 1)
    assert three and not any(name.startswith("resident.") for name in three)
    # the residual through the tensor cores: for a residual of INT8 codes, not for a float one
    w, bias, scale = (torch.zeros(32, 64, 1, 1, dtype=torch.int8, device="cuda"),
                      torch.zeros(32, dtype=torch.int32, device="cuda"), torch.ones(32, device="cuda"))
    residual = torch.zeros(1, 32, 8, 8, device="cuda").contiguous(memory_format=torch.channels_last)
    for effort, modes in ((1, {3}), (MMA_BITS_MIN_EFFORT, {3, 4})):
        codes = registry.tactics([x, w, bias, residual.to(torch.int8), scale], {}, effort)
        floats = registry.tactics([x, w, bias, residual, scale], {}, effort)
        through = [ResidentTile.parse(name) for name in codes if name.startswith("resident.")]
        assert {tile.residual_prefetch for tile in through if tile.residual_prefetch >= 3} == modes
        assert not any(ResidentTile.parse(name).residual_prefetch >= 3 for name in floats if name.startswith("resident."))


def test_a_projection_that_does_not_fit_the_layer_is_refused():
    """resident_gemm's projection (kernels/gemm/resident.py, Projection): each misfit in one line."""
    x = torch.zeros(2, 64, 8, 8, dtype=torch.int8, device=DEVICE).contiguous(memory_format=torch.channels_last)
    w = torch.zeros(32, 64, dtype=torch.int8, device=DEVICE)
    scale = torch.ones(32, device=DEVICE)

    def run(px, pw, strides=(1, 1), residual=None):
        return resident_gemm(x, w, None, SMALL, dequant_scale=scale, residual=residual,
                             projection=Projection(px, pw, None, scale, strides))

    wide = torch.zeros(2, 64, 16, 16, dtype=torch.int8, device=DEVICE).contiguous(memory_format=torch.channels_last)
    with pytest.raises(ValueError, match=r"^resident_gemm: projection input \(2, 64, 16, 16\) at strides \(1, 1\) does "
                                         r"not give the layer's 2 × \(8, 8\) outputs$"):
        run(wide, w)
    with pytest.raises(ValueError, match=r"^resident_gemm: projection input \(2, 64, 8, 8\) .* are not 32 outputs"):
        run(torch.zeros(2, 64, 8, 8, dtype=torch.int8, device=DEVICE), w)  # NCHW
    with pytest.raises(ValueError, match="are not 32 outputs"):
        run(x, torch.zeros(16, 64, dtype=torch.int8, device=DEVICE))  # another number of outputs
    with pytest.raises(ValueError, match="^resident_gemm: a layer with a projection has no other residual$"):
        run(wide, w, (2, 2), residual=torch.zeros(2, 32, 8, 8, device=DEVICE))
    assert run(wide, w, (2, 2)).shape == (2, 32, 8, 8)  # the stride-2 projection fits
