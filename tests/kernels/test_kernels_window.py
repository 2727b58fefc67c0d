"""The window tactic of few-channel INT8/FP8 convolutions (`sartor/ops/quantized_window.py`): the
pixel packing against PyTorch's padding of the quantized input, the whole convolution against the
emulation bit for bit, where the tactic is offered and where it must not be, and the kernel's row
alignment hint; the same for the resident-window tiles (`sartor/kernels/window/resident.py`), with
their names. Through Triton's interpreter on CPU and natively on a GPU."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

# conftest.py switches Triton to its interpreter when there is no GPU.
pytest.importorskip("triton")

from sartor.builder.pipeline import _tactic  # noqa: E402
from sartor.ir.graph import Node  # noqa: E402
from sartor.kernels.conv.igemm import ConvGeometry, row_alignment  # noqa: E402
from sartor.kernels.window.pixel_pack import pack_pixels  # noqa: E402
from sartor.kernels.gemm.resident import ResidentTile  # noqa: E402
from sartor.kernels.common.tile_steps import DECODABLE_SUM  # noqa: E402
from sartor.kernels.window.resident import (WINDOW_RESIDENT_TILES, WindowResidentTile,  # noqa: E402
                                            narrow_tiles, window_alignment, window_resident_conv,
                                            window_resident_tiles)
from sartor.ops import default_registry, quantized  # noqa: E402
from sartor.ops.conv import igemm_geometry  # noqa: E402
from sartor.ops.fp8 import QFORMAT, code_distance, quantize_fp8  # noqa: E402
from sartor.ops.quantized import _window_conv, own_kernel_tactic, qconv, qlayer_weight_for_tactic, quantize  # noqa: E402
from sartor.kernels.registry import TacticNameError, tactic_for  # noqa: E402
from sartor.ops.quantized_window import (WINDOW_TILES, WindowIgemm, WindowResident, window_applies,  # noqa: E402
                                         window_pack, window_tactic, window_tactics, window_weight)
from sartor.passes.bound_accumulators import product_bound  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FP8_KERNELS = DEVICE == "cpu" or torch.cuda.get_device_capability() >= (8, 9)
TILE = WINDOW_TILES[0]


@pytest.mark.parametrize("channels", [1, 3, 4])
@pytest.mark.parametrize("layout", ["nchw", "nhwc"])
@pytest.mark.parametrize("code", [torch.int8, torch.float8_e4m3fn])
def test_pixels_are_quantized_padded_and_packed(channels, layout, code):
    x = torch.randn(2, channels, 5, 7, generator=torch.Generator().manual_seed(1)) * 3
    if layout == "nhwc":
        x = x.contiguous(memory_format=torch.channels_last)
    codes = quantize(x, 30.0) if code == torch.int8 else quantize_fp8(x, 30.0)
    packed = pack_pixels(x.to(DEVICE), (2, 1), (9, 12), code, 30.0)
    assert packed.dtype == code and packed.shape == (2, 9, 12, 4)
    expected = F.pad(codes.float(), (1, 12 - 7 - 1, 2, 9 - 5 - 2)).permute(0, 2, 3, 1)
    assert torch.equal(packed[..., :channels].cpu().float(), expected)
    assert not packed[..., channels:].cpu().view(torch.uint8).any()


def test_codes_are_copied_and_bad_arguments_refused():
    codes = quantize(torch.randn(1, 3, 4, 4, generator=torch.Generator().manual_seed(2)), 20.0, -128)
    packed = pack_pixels(codes.to(DEVICE), (0, 0), (4, 4), torch.int8)
    assert torch.equal(packed[..., :3].cpu(), codes.permute(0, 2, 3, 1))
    with pytest.raises(ValueError, match="up to 4 channels, not 5"):
        pack_pixels(torch.zeros(1, 5, 4, 4, device=DEVICE), (0, 0), (4, 4), torch.int8)
    with pytest.raises(ValueError, match="int8 or float8_e4m3fn codes"):
        pack_pixels(torch.zeros(1, 3, 4, 4, device=DEVICE), (0, 0), (4, 4), torch.uint8)
    with pytest.raises(ValueError, match="quantizes float inputs"):
        pack_pixels(torch.zeros(1, 3, 4, 4, dtype=torch.int32, device=DEVICE), (0, 0), (4, 4), torch.int8)
    with pytest.raises(ValueError, match="does not crop"):
        pack_pixels(torch.zeros(1, 3, 4, 4, device=DEVICE), (-1, 0), (4, 4), torch.int8)


# (channels, kernel, strides, pads (top, left, bottom, right), dilations)
GEOMETRIES = [
    pytest.param((3, (7, 7), (2, 2), (3, 3, 3, 3), (1, 1)), id="resnet-stem"),
    pytest.param((3, (3, 3), (2, 2), (1, 1, 1, 1), (1, 1)), id="yolo-stem"),
    pytest.param((1, (3, 3), (1, 1), (2, 1, 2, 1), (2, 1)), id="one-channel-dilated-rows"),
    pytest.param((4, (5, 9), (1, 2), (0, 4, 1, 3), (1, 1)), id="four-channels-64-byte-window"),
]


def _layer(geometry, generator, cout: int = 16, fp8: bool = False):
    c, kernel, strides, pads, dilations = geometry
    attrs = {"kernel_shape": list(kernel), "strides": list(strides), "pads": list(pads),
             "dilations": list(dilations), "input_inv_scale": 40.0, "activation": "Relu", "qmin": -127}
    x = torch.randn(2, c, 13, 11, generator=generator)
    w = torch.randn(cout, c, *kernel, generator=generator)
    if fp8:
        attrs["qformat"] = QFORMAT
        wq, bias = quantize_fp8(w, 60.0), torch.randn(cout, generator=generator)
    else:
        wq, bias = quantize(w, 60.0), torch.randint(-3000, 3000, (cout,), dtype=torch.int32, generator=generator)
    return x, wq, bias, torch.rand(cout, generator=generator) * 1e-3, attrs


@pytest.mark.parametrize("geometry", GEOMETRIES)
@pytest.mark.parametrize("int8_output", [True, False])
def test_window_tactic_equals_the_emulation(geometry, int8_output):
    x, wq, bias, scale, attrs = _layer(geometry, torch.Generator().manual_seed(5))
    if int8_output:
        attrs["output_inv_scale"] = 3.0
    expected = qconv([x, wq, bias, None, scale], attrs)
    w_window = qlayer_weight_for_tactic(wq, window_tactic(TILE).name)
    assert w_window.shape[1] % 32 == 0 and w_window.shape[2:] == (wq.shape[2], 1)
    out = _window_conv(x.to(DEVICE), w_window.to(DEVICE), bias.to(DEVICE), None, scale.to(DEVICE), attrs, TILE)
    assert out.shape == expected.shape and out.is_contiguous(memory_format=torch.channels_last)
    assert out.dtype == expected.dtype and torch.equal(out.cpu(), expected)


def test_window_tactic_with_codes_in_and_a_residual_equals_the_emulation():
    generator = torch.Generator().manual_seed(6)
    x, wq, bias, scale, attrs = _layer(GEOMETRIES[1].values[0], generator, cout=8)
    attrs.update(output_inv_scale=4.0, residual_scale=0.05, qmin=-128)
    codes = quantize(x, 40.0, -128)
    expected_shape = qconv([codes, wq, bias, None, scale], attrs).shape
    residual = torch.randint(-128, 128, expected_shape, dtype=torch.int8, generator=generator)
    expected = qconv([codes, wq, bias, residual, scale], attrs)
    out = _window_conv(codes.to(DEVICE), qlayer_weight_for_tactic(wq, window_tactic(TILE).name).to(DEVICE),
                       bias.to(DEVICE), residual.to(DEVICE), scale.to(DEVICE), attrs, TILE)
    assert torch.equal(out.cpu(), expected)


@pytest.mark.skipif(not FP8_KERNELS, reason="FP8 tl.dot needs compute capability 8.9+")
def test_fp8_window_tactic_matches_the_emulation_within_one_step():
    """FP8 products are summed in float32 by the kernel (float64 in the emulation): one e4m3 step."""
    x, wq, bias, scale, attrs = _layer(GEOMETRIES[0].values[0], torch.Generator().manual_seed(7), fp8=True)
    attrs["output_inv_scale"] = 8.0
    expected = qconv([x, wq, bias, None, scale], attrs)
    w_window = qlayer_weight_for_tactic(wq, window_tactic(TILE).name)
    assert w_window.dtype == torch.float8_e4m3fn
    out = _window_conv(x.to(DEVICE), w_window.to(DEVICE), bias.to(DEVICE), None, scale.to(DEVICE), attrs, TILE)
    assert out.dtype == torch.float8_e4m3fn and int(code_distance(out.cpu(), expected).max()) <= 1


def test_window_applies_to_few_channels_only():
    w = torch.zeros(8, 3, 7, 7, dtype=torch.int8)
    assert window_applies(torch.zeros(1, 3, 9, 9), w, {})
    assert not window_applies(torch.zeros(1, 5, 9, 9), torch.zeros(8, 5, 7, 7, dtype=torch.int8), {})
    assert not window_applies(torch.zeros(1, 3, 9, 9), w, {"dilations": [1, 2]})  # a window is contiguous
    assert not window_applies(torch.zeros(1, 3, 9, 9), w, {"group": 3})
    assert not window_applies(torch.zeros(1, 3, 9, 9), torch.zeros(8, 3, 1, 17, dtype=torch.int8), {})
    assert len(window_tactics(1)) < len(window_tactics(3))


@pytest.mark.skipif(DEVICE != "cuda", reason="the tactics list the kernels on CUDA tensors only")
def test_cuda_stem_layers_offer_the_window_tactic_and_wide_layers_do_not():
    registry = default_registry()["QConv"]
    stem = registry.tactics([torch.zeros(1, 3, 16, 16, device="cuda"),
                             torch.zeros(8, 3, 7, 7, dtype=torch.int8, device="cuda")], {"pads": [3, 3, 3, 3]}, 1)
    assert any(name.startswith("window_igemm.") for name in stem)
    wide = registry.tactics([torch.zeros(1, 8, 16, 16, device="cuda"),
                             torch.zeros(8, 8, 3, 3, dtype=torch.int8, device="cuda")], {"pads": [1, 1, 1, 1]}, 1)
    assert wide and not any(name.startswith("window_") for name in wide)


def test_row_alignment_is_what_every_row_offset_is_a_multiple_of():
    nhwc = torch.zeros(2, 64, 8, 8).contiguous(memory_format=torch.channels_last)
    same = ConvGeometry((3, 3), (1, 1), (1, 1), (1, 1), (8, 8))
    assert row_alignment(nhwc, same) == 16
    assert row_alignment(torch.zeros(2, 64, 8, 8), same) == 1  # NCHW: channels are not contiguous
    packed = torch.zeros(2, 9, 12, 4, dtype=torch.int8)
    windows = packed.as_strided((2, 32, 9, 5), (9 * 12 * 4, 1, 12 * 4, 4))
    assert row_alignment(windows, ConvGeometry((7, 1), (2, 2), (0, 0), (1, 1), (2, 3))) == 8
    assert row_alignment(windows, ConvGeometry((7, 1), (1, 1), (0, 0), (1, 1), (3, 5))) == 4
    assert row_alignment(windows, ConvGeometry((7, 1), (2, 2), (0, 1), (1, 1), (2, 3))) == 4  # odd pad
    gemm = torch.zeros(5, 24).reshape(5, 24, 1, 1)
    assert row_alignment(gemm, ConvGeometry.gemm()) == 8  # only the row stride counts for 1×1 pixels


def test_kernel_quantization_rounds_and_saturates_as_the_emulation_does():
    """The kernels' quantization (`quantize_int8`: one float32 add of 1.5·2^23, the code as the low byte) on ties,
    values next to 2^22 where that trick stops being exact, huge values and infinities."""
    values = [0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 126.5, 127.5, -126.5, -127.5, -128.5, 0.49999997, -0.49999997,
              4194303.5, 4194304.5, -4194303.5, -4194304.5, 8388607.0, 12582911.0, -12582913.0, 3.0e9, -3.0e9,
              3.0e38, -3.0e38, float("inf"), float("-inf"), 0.0, -0.0, 63.5, 64.5]
    x = torch.tensor(values, dtype=torch.float32).reshape(1, 1, 1, -1)
    for qmin in (-127, -128):
        packed = pack_pixels(x.to(DEVICE), (0, 0), (1, len(values)), torch.int8, 1.0, qmin)
        assert torch.equal(packed[0, 0, :, 0].cpu(), quantize(x, 1.0, qmin).reshape(-1)), qmin


# Small enough for the interpreter: row tiles of 16 output pixels, 2 per program, the weight block
# 32 channels wide (the layers' 16 channels mask half of it); K in one product and by filter rows.
RESIDENT = WindowResidentTile(ResidentTile(16, 32, 2, 1, 1))
RESIDENT_KH = WindowResidentTile(ResidentTile(16, 32, 2, 1, 1), kh_steps=True)
# 40 channels in 3 column tiles of 16 (the last one partial), launched side by side; 3 row tiles
# per program.
RESIDENT_COLUMNS = WindowResidentTile(ResidentTile(16, 16, 3, 1, 1, n_adjacent=True), kh_steps=True)
# The columns' bias and scale loaded once per program (`_c`), over the same column tiles.
RESIDENT_LOADED = WindowResidentTile(ResidentTile(16, 16, 3, 1, 1, n_adjacent=True, columns_loaded=True),
                                     kh_steps=True)
# Each row tile over the same pixels of two output rows (`_o2`): the geometries' 7 and 13 output rows
# leave the last pair's lower row outside the image, the 64-byte window's 10 do not.
RESIDENT_PAIRS = WindowResidentTile(ResidentTile(16, 32, 2, 1, 1), kh_steps=True, row_pairs=True)
RESIDENT_PAIRS_LOADED = WindowResidentTile(ResidentTile(16, 16, 3, 1, 1, n_adjacent=True, columns_loaded=True),
                                           kh_steps=True, row_pairs=True)
# The balanced walk ("balanced", 2 programs for each of the interpreter's INTERPRETED_SMS): the row
# tiles shared in equal runs, the last run passing the end (84 output pixels: 6 row tiles of 16 for
# 4 programs, 2 each; 42 row pairs: 3 row tiles for 4 programs, the last program without one).
RESIDENT_BALANCED = WindowResidentTile(ResidentTile(16, 32, 2, 1, 1, columns_loaded=True), kh_steps=True,
                                       balanced=True)
RESIDENT_PAIRS_BALANCED = WindowResidentTile(ResidentTile(16, 32, 2, 1, 1, columns_loaded=True), kh_steps=True,
                                             row_pairs=True, balanced=True)


def _resident_window_run(x, wq, bias, residual, scale, attrs, tile):
    """The layer through _window_conv and through the op with the tile's tactic: both results."""
    tactic = window_tactic(tile).name
    w_window = qlayer_weight_for_tactic(wq, tactic)
    assert torch.equal(w_window, window_weight(wq))
    args = [t.to(DEVICE) if t is not None else None for t in (x, w_window, bias, residual, scale)]
    direct = _window_conv(*args[:4], args[4], attrs, tactic_for(tactic).tile)
    through_the_op = qconv(args, dict(attrs, tactic=tactic))
    return direct, through_the_op


@pytest.mark.parametrize("with_bias", [True, False])
@pytest.mark.parametrize("tile", [RESIDENT_PAIRS, RESIDENT_PAIRS_LOADED], ids=lambda tile: tile.name)
def test_resident_window_tactic_decoding_its_sums_equals_the_emulation(with_bias, tile):
    """The stem's sums decoded from their bits (passes/bound_accumulators.py): the bias and
    0x4B400000 added per column, loaded per row tile or once per program (`_c`), or 0x4B400000
    alone without a bias."""
    x, wq, bias, scale, attrs = _layer(GEOMETRIES[0].values[0], torch.Generator().manual_seed(17))
    bias = bias if with_bias else None
    attrs.update(output_inv_scale=3.0, accumulator_bound=product_bound(wq.numpy(), None if bias is None else
                                                                       bias.numpy()))
    assert attrs["accumulator_bound"] < DECODABLE_SUM
    expected = qconv([x, wq, bias, None, scale], attrs)
    for out in _resident_window_run(x, wq, bias, None, scale, attrs, tile):
        assert out.dtype == torch.int8 and torch.equal(out.cpu(), expected)


@pytest.mark.parametrize("geometry", GEOMETRIES)
@pytest.mark.parametrize("int8_output", [True, False])
@pytest.mark.parametrize("tile", [RESIDENT, RESIDENT_KH, RESIDENT_LOADED, RESIDENT_PAIRS, RESIDENT_PAIRS_LOADED,
                                  RESIDENT_BALANCED, RESIDENT_PAIRS_BALANCED], ids=lambda tile: tile.name)
def test_resident_window_tactic_equals_the_emulation(geometry, int8_output, tile):
    """Batch 2 of 13×11 images: the ResNet stem's 7×7 stride 2 padded by 3 gives 84 output pixels,
    6 row tiles of 16 whose last is partial; the 64-byte windows' K of 320 pads to 512."""
    x, wq, bias, scale, attrs = _layer(geometry, torch.Generator().manual_seed(15))
    if int8_output:
        attrs["output_inv_scale"] = 3.0
    expected = qconv([x, wq, bias, None, scale], attrs)
    for out in _resident_window_run(x, wq, bias, None, scale, attrs, tile):
        assert out.shape == expected.shape and out.is_contiguous(memory_format=torch.channels_last)
        assert out.dtype == expected.dtype and torch.equal(out.cpu(), expected)


@pytest.mark.parametrize("tile", [RESIDENT_COLUMNS, RESIDENT_LOADED, RESIDENT_PAIRS_LOADED], ids=lambda tile: tile.name)
def test_resident_window_without_bias_or_activation_over_column_tiles_equals_the_emulation(tile):
    x, wq, _, scale, attrs = _layer(GEOMETRIES[0].values[0], torch.Generator().manual_seed(16), cout=40)
    del attrs["activation"]
    expected = qconv([x, wq, None, None, scale], attrs)
    for out in _resident_window_run(x, wq, None, None, scale, attrs, tile):
        assert out.dtype == torch.float32 and torch.equal(out.cpu(), expected)


@pytest.mark.parametrize("tile", [RESIDENT, RESIDENT_KH, RESIDENT_LOADED, RESIDENT_PAIRS, RESIDENT_PAIRS_LOADED,
                                  RESIDENT_BALANCED, RESIDENT_PAIRS_BALANCED], ids=lambda tile: tile.name)
def test_resident_window_with_codes_in_and_a_residual_equals_the_emulation(tile):
    generator = torch.Generator().manual_seed(17)
    x, wq, bias, scale, attrs = _layer(GEOMETRIES[1].values[0], generator, cout=8)
    attrs.update(output_inv_scale=4.0, residual_scale=0.05, qmin=-128, residual_after_activation=True)
    codes = quantize(x, 40.0, -128)
    expected_shape = qconv([codes, wq, bias, None, scale], attrs).shape
    residual = torch.randint(-128, 128, expected_shape, dtype=torch.int8, generator=generator)
    expected = qconv([codes, wq, bias, residual, scale], attrs)
    for out in _resident_window_run(codes, wq, bias, residual, scale, attrs, tile):
        assert torch.equal(out.cpu(), expected)


@pytest.mark.skipif(not FP8_KERNELS, reason="FP8 tl.dot needs compute capability 8.9+")
@pytest.mark.parametrize("tile", [RESIDENT, RESIDENT_KH, RESIDENT_PAIRS], ids=lambda tile: tile.name)
def test_fp8_resident_window_matches_the_emulation_within_one_step(tile):
    x, wq, bias, scale, attrs = _layer(GEOMETRIES[0].values[0], torch.Generator().manual_seed(18), fp8=True)
    attrs["output_inv_scale"] = 8.0
    expected = qconv([x, wq, bias, None, scale], attrs)
    for out in _resident_window_run(x, wq, bias, None, scale, attrs, tile):
        assert out.dtype == torch.float8_e4m3fn and int(code_distance(out.cpu(), expected).max()) <= 1


def test_resident_window_refuses_what_is_not_packed_pixels_and_window_weight():
    w_window = window_weight(torch.zeros(8, 3, 3, 3, dtype=torch.int8)).to(DEVICE)
    geometry = ConvGeometry((3, 3), (1, 1), (1, 1), (1, 1), (4, 4))
    packed = window_pack(torch.zeros(1, 3, 4, 4, device=DEVICE), w_window, geometry, torch.int8, 1.0, -127)
    scale = torch.ones(8, device=DEVICE)
    with pytest.raises(ValueError, match="is not contiguous"):
        window_resident_conv(packed.view(torch.uint8), w_window, None, RESIDENT, geometry=geometry,
                             dequant_scale=scale)
    with pytest.raises(ValueError, match="is not contiguous"):  # FP8 codes asked of INT8 pixels
        window_resident_conv(packed, w_window, None, RESIDENT, geometry=geometry, dequant_scale=scale, fp8=True)
    with pytest.raises(ValueError, match="not window_weight's layout"):
        window_resident_conv(packed, w_window.contiguous(), None, RESIDENT, geometry=geometry, dequant_scale=scale)


def test_resident_window_tactic_names_round_trip_and_malformed_ones_are_refused():
    for tile in (*WINDOW_RESIDENT_TILES, RESIDENT, RESIDENT_KH, RESIDENT_COLUMNS, RESIDENT_LOADED, RESIDENT_PAIRS,
                 RESIDENT_PAIRS_LOADED):
        tactic = window_tactic(tile).name
        assert tactic.startswith("window_resident.") and tactic_for(tactic) == WindowResident(tile)
        assert own_kernel_tactic(tactic) and "weight resident over row tiles" in _tactic(
            Node("QConv", "stem", ["x"], ["y"], {"tactic": tactic}), torch.device("cpu"))
    assert tactic_for(window_tactic(TILE).name) == WindowIgemm(TILE)
    assert not own_kernel_tactic(window_tactic(TILE).name)  # the implicit-GEMM windows launch as before
    for bad in ("window_resident.64x64.t8.w4", "window_resident.64x64.t8.w4.s3.residual-early",
                "window_resident.64x64.t8.w4.s3.residual-next", "window_resident.64x64.t8.w4.s3.kh-steps.grouped",
                "window_resident.64x64.t8.w4.s3.kh-steps.kh-steps", "window_resident.64x64.t8.w4.s3.x",
                "window_resident.64x33.t8.w4.s3", "window_resident.axb.t1.w1.s1", "window.64x64.t8.w4.s3",
                "window_resident", "window_resident.64x64.t8.w4.s3.", "window_resident.64x64.t8.w4.s3.row-pairs",
                "window_resident.64x64.t8.w4.s3.row-pairs.kh-steps",
                "window_resident.64x64.t8.w4.s3.kh-steps.row-pairs.row-pairs",
                "window_resident.64x64.t8.w4.s3.cols-loaded.row-pairs", "window_resident_64x64_t8_w4_s2_kh"):
        with pytest.raises(TacticNameError):
            tactic_for(bad)
    assert tactic_for("window_resident.64x64.t8.w4.s2.kh-steps").tile == WINDOW_RESIDENT_TILES[0]
    assert tactic_for("window_resident.64x64.t8.w4.s2.kh-steps.row-pairs").tile.row_pairs
    described = _tactic(Node("QConv", "stem", ["x"], ["y"], {"tactic": window_tactic(RESIDENT_PAIRS).name}),
                        torch.device("cpu"))
    assert "two output rows per row tile" in described and "two output rows" not in _tactic(
        Node("QConv", "stem", ["x"], ["y"], {"tactic": window_tactic(RESIDENT_KH).name}), torch.device("cpu"))
    with pytest.raises(ValueError, match="walk K by filter rows"):
        WindowResidentTile(ResidentTile(64, 64, 8, 4, 2), row_pairs=True)
    with pytest.raises(TacticNameError):  # the 1×1 kernel does not take the windows' walk
        ResidentTile.parse("resident.64x64.t8.w4.s3.kh-steps")


def test_resident_window_tiles_are_offered_for_stems_and_not_for_wide_layers(monkeypatch):
    """QConv lists kernel tactics for CUDA tensors only; here the geometry check lets CPU ones
    through, as the interpreter runs the kernels."""
    monkeypatch.setattr(quantized, "_igemm_geometry",
                        lambda x, w, attrs, gemm: igemm_geometry(x, w, attrs, require_cuda=False))
    registry = default_registry()["QConv"]
    stem = registry.tactics([torch.zeros(1, 3, 16, 16), torch.zeros(64, 3, 7, 7, dtype=torch.int8)],
                            {"pads": [3, 3, 3, 3], "strides": [2, 2]}, 1)  # ResNet's 64 channels: no narrow tiles
    offered = [name for name in stem if name.startswith("window_resident.") and not name.endswith(".space-to-depth")]
    first_two = [window_tactic(tile).name for tile in WINDOW_RESIDENT_TILES[:2]]
    loaded = [name.replace(".s2", ".s2.cols-loaded") for name in first_two]  # the columns' bias and scale once
    by_rows = [name + ".row-pairs" for name in first_two + loaded if name.endswith(".kh-steps")]  # over row pairs
    # The first tile with its columns loaded, with and without row pairs, shared by 4 and 6 programs an SM.
    balanced = [name.replace(".t8.", f".t{per_sm}.") + ".balanced" for name in (loaded[0], by_rows[1])
                for per_sm in (4, 6)]
    assert offered == first_two + loaded + by_rows + balanced and len(by_rows) == 2
    assert offered == window_tactics(1)[-10:] and len(window_tactics(3)) > len(window_tactics(1))
    wide = registry.tactics([torch.zeros(1, 8, 16, 16), torch.zeros(8, 8, 3, 3, dtype=torch.int8)],
                            {"pads": [1, 1, 1, 1]}, 1)
    assert any(name.startswith("igemm.") for name in wide)
    assert not any(name.startswith("window_") for name in wide)


def test_window_alignment_is_what_every_window_start_is_a_multiple_of():
    """Stated to the resident-window kernel (Triton 3.6 proved too much for the row pairs)."""
    plain = (232 * 4, 229 * 232 * 4)  # ResNet's stem, 4-byte pixels: rows of 928 bytes, and images
    assert window_alignment(2 * 4, *plain) == 8 and window_alignment(4, *plain) == 4
    assert window_alignment(12, *plain) == 4
    blocks = (460 * 4, 115 * 460 * 4)  # its space-to-depth form: windows 16 bytes apart
    assert window_alignment(16, *blocks) == 16
    assert window_alignment(16, 6 * 4, 5 * 6 * 4) == 8  # rows of 24 bytes


def _yolo_stem(cout: int, generator):
    """YOLOv8n's stem, 3 → `cout` channels 3 × 3 / 2 padded by 1, on batch 2 of 18 × 20 images (9 × 10
    output pixels each), INT8 codes out."""
    attrs = {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1], "dilations": [1, 1],
             "input_inv_scale": 40.0, "activation": "Relu", "qmin": -127, "output_inv_scale": 3.0}
    x = torch.randn(2, 3, 18, 20, generator=generator)
    wq = quantize(torch.randn(cout, 3, 3, 3, generator=generator), 60.0)
    bias = torch.randint(-3000, 3000, (cout,), dtype=torch.int32, generator=generator)
    return x, wq, bias, torch.rand(cout, generator=generator) * 1e-3, attrs


def _tactic_output(x, wq, bias, scale, attrs, tile, space_to_depth):
    tactic = window_tactic(tile, space_to_depth).name
    inputs = [t.to(DEVICE) for t in (x, qlayer_weight_for_tactic(wq, tactic), bias)] + [None, scale.to(DEVICE)]
    return qconv(inputs, dict(attrs, tactic=tactic)).cpu()


@pytest.mark.parametrize("space_to_depth", [False, True], ids=["window", "space_to_depth"])
@pytest.mark.parametrize("cout", [16, 24])
def test_narrow_resident_window_tiles_equal_the_wide_ones_and_the_emulation(cout, space_to_depth):
    """The builder's narrow tiles (effort 1: 256 × 16 for 16 channels, 128 × 32 for 24, whose last 8
    columns are masked) and a small one (8 × 64 narrowed to 32 × 16 or 16 × 32), whose 100 row pairs
    take several row tiles over several programs, give the codes of the 64-wide tile each was
    narrowed from, and the emulation's."""
    x, wq, bias, scale, attrs = _yolo_stem(cout, torch.Generator().manual_seed(21))
    expected = qconv([x, wq, bias, None, scale], attrs)
    assert expected.dtype == torch.int8 and expected.shape == (2, cout, 9, 10)
    wide = window_resident_tiles(1) + [WindowResidentTile(ResidentTile(8, 64, 2, 1, 1), kh_steps=True,
                                                          row_pairs=True)]
    narrow = narrow_tiles(wide, cout)
    assert len(narrow) == len(wide) and all(tile.resident.block_n == (16 if cout == 16 else 32) for tile in narrow)
    for wide_tile, tile in zip(wide, narrow):
        out = _tactic_output(x, wq, bias, scale, attrs, tile, space_to_depth)
        assert torch.equal(out, expected), tile.name
        assert torch.equal(out, _tactic_output(x, wq, bias, scale, attrs, wide_tile, space_to_depth)), tile.name


def test_narrow_tiles_are_offered_for_few_output_channels_only(monkeypatch):
    """Up to 32 output channels (YOLOv8n's stem: 16) each resident-window candidate is also offered
    narrowed, its other fields and flags kept; ResNet's 64-channel stem is offered what it was."""
    monkeypatch.setattr(quantized, "_igemm_geometry",
                        lambda x, w, attrs, gemm: igemm_geometry(x, w, attrs, require_cuda=False))
    registry = default_registry()["QConv"]
    attrs = {"pads": [1, 1, 1, 1], "strides": [2, 2]}

    def offered(cout: int, effort: int = 1) -> list[str]:
        return registry.tactics([torch.zeros(1, 3, 16, 16), torch.zeros(cout, 3, 3, 3, dtype=torch.int8)], attrs,
                                effort)

    plain = window_tactics(1, space_to_depth=True)
    assert [name for name in offered(64) if name.startswith("window_")] == plain
    for effort in range(6):
        assert window_tactics(effort, True, True, out_channels=64) == window_tactics(effort, True, True)
    wide_resident = [name for name in plain if name.startswith("window_resident.")]
    for cout, block_n in ((16, 16), (3, 16), (17, 32), (32, 32)):
        names = [name for name in offered(cout) if name.startswith("window_")]
        narrow = [name for name in names if name not in plain]
        kept = wide_resident if cout > 16 else []  # up to 16 channels at effort 1, the narrow tiles only
        assert [name for name in names if name in plain] == [n for n in plain if n not in wide_resident or n in kept]
        assert len(narrow) == 20 and all(tactic_for(name).tile.resident.block_n == block_n for name in narrow)
    # From effort 3 the wide tiles are timed beside the narrow ones whatever the channels.
    assert set(window_tactics(3, out_channels=64)) < set(window_tactics(3, out_channels=16))
    sixteen = [name for name in offered(16) if name.startswith("window_resident.256x16.")]
    assert sixteen[:6] == ["window_resident.256x16.t8.w4.s2.kh-steps", "window_resident.256x16.t8.w4.s2",
                           "window_resident.256x16.t8.w4.s2.cols-loaded.kh-steps",
                           "window_resident.256x16.t8.w4.s2.cols-loaded",
                           "window_resident.256x16.t8.w4.s2.kh-steps.row-pairs",
                           "window_resident.256x16.t8.w4.s2.cols-loaded.kh-steps.row-pairs"]
    assert "window_resident.128x32.t8.w4.s2.cols-loaded.kh-steps.row-pairs" in offered(32)
    assert "window_resident.512x16.t8.w8.s2" in window_tactics(5, out_channels=16)
    pooled = window_tactics(1, max_pool=True, out_channels=16)
    assert pooled[-1] == "window_resident.256x16.t4.w4.s2.kh-steps.row-pairs.max-pool"
    for name in pooled:
        assert tactic_for(name).name == name
