"""The space-to-depth form of the window tactic (`sartor/ops/quantized_window.py`, tactics
"….space-to-depth"): block pixels are the 4-byte pixels in 2 × 2 blocks, the weight puts each tap where
the blocks hold its pixel, the convolution equals the emulation bit for bit through the
implicit-GEMM and the resident-window tiles, and the form is offered for INT8 stride-2 layers only.
Through Triton's interpreter on CPU and natively on a GPU."""
from __future__ import annotations

import pytest
import torch

# conftest.py switches Triton to its interpreter when there is no GPU.
pytest.importorskip("triton")

from sartor.builder.pipeline import _tactic  # noqa: E402
from sartor.ir.graph import Node  # noqa: E402
from sartor.kernels.window.pixel_pack import pack_pixels  # noqa: E402
from sartor.kernels.gemm.resident import ResidentTile  # noqa: E402
from sartor.kernels.registry import TacticNameError, tactic_for  # noqa: E402
from sartor.kernels.window.resident import WindowResidentTile, window_resident_tiles  # noqa: E402
from sartor.ops.fp8 import QFORMAT  # noqa: E402
from sartor.ops.quantized import own_kernel_tactic, qconv, qlayer_weight_for_tactic, quantize  # noqa: E402
from sartor.ops.quantized_window import (WINDOW_TACTICS, WINDOW_TILES, space_to_depth_applies,  # noqa: E402
                                         window_tactic, window_tactics, window_weight)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# Small enough for the interpreter (see test_kernels_window.py): K of 4 rows of 64 bytes in one
# product or by rows, 16-pixel row tiles, 2 per program.
TILES = [WINDOW_TILES[0], WindowResidentTile(ResidentTile(16, 32, 2, 1, 1)),
         WindowResidentTile(ResidentTile(16, 16, 3, 1, 1, n_adjacent=True, columns_loaded=True), kh_steps=True),
         WindowResidentTile(ResidentTile(16, 16, 3, 1, 1, n_adjacent=True, columns_loaded=True), kh_steps=True,
                            row_pairs=True)]

# (channels, kernel, pads (top, left, bottom, right)), all at stride 2
GEOMETRIES = [
    pytest.param((3, (7, 7), (3, 3, 3, 3)), id="resnet-stem"),
    pytest.param((3, (3, 3), (1, 1, 1, 1)), id="yolo-stem"),
    pytest.param((4, (5, 8), (2, 3, 1, 4)), id="four-channels-uneven"),
]


@pytest.mark.parametrize("source", ["float", "channels-last float", "codes"])
@pytest.mark.parametrize("block_w", [256, 8])  # 8: a row of blocks over two programs, the second ragged
def test_block_pixels_are_the_4_byte_pixels_in_2x2_blocks(source, block_w):
    """Each program writes whole 16-byte blocks of one block row (`_pack_blocks_kernel`): the
    4-byte pixels' bytes, block by block, padding and the fourth byte zero."""
    x = torch.randn(2, 3, 9, 11, generator=torch.Generator().manual_seed(1)) * 3
    if source == "channels-last float":
        x = x.contiguous(memory_format=torch.channels_last)
    elif source == "codes":
        x = quantize(x, 20.0)
    plain = pack_pixels(x.to(DEVICE), (3, 2), (16, 18), torch.int8, 20.0).cpu()
    blocks = pack_pixels(x.to(DEVICE), (3, 2), (16, 18), torch.int8, 20.0, space_to_depth=True,
                         block_w=block_w).cpu()
    assert blocks.shape == (2, 8, 36, 4)
    assert torch.equal(blocks, plain.view(2, 8, 2, 9, 2, 4).permute(0, 1, 3, 2, 4, 5).reshape(2, 8, 36, 4))
    with pytest.raises(ValueError, match="even padded size"):
        pack_pixels(x.to(DEVICE), (3, 2), (15, 18), torch.int8, 20.0, space_to_depth=True)


def test_the_weight_puts_each_tap_where_the_blocks_hold_its_pixel():
    wq = torch.randint(-127, 128, (5, 3, 7, 7), dtype=torch.int8, generator=torch.Generator().manual_seed(2))
    w = window_weight(wq, space_to_depth=True)
    assert w.shape == (5, 64, 4, 1) and w.permute(0, 2, 1, 3).is_contiguous()
    expected = torch.zeros(5, 64, 4, dtype=torch.int8)
    for i in range(4):
        for j in range(4):
            for dy in range(2):
                for dx in range(2):
                    if 2 * i + dy < 7 and 2 * j + dx < 7:
                        expected[:, j * 16 + (dy * 2 + dx) * 4:j * 16 + (dy * 2 + dx) * 4 + 3, i] = \
                            wq[:, :, 2 * i + dy, 2 * j + dx]
    assert torch.equal(w[..., 0], expected)


def _layer(geometry, generator, cout: int = 16):
    c, kernel, pads = geometry
    attrs = {"kernel_shape": list(kernel), "strides": [2, 2], "pads": list(pads), "dilations": [1, 1],
             "input_inv_scale": 40.0, "activation": "Relu", "qmin": -127}
    x = torch.randn(2, c, 13, 11, generator=generator)
    wq = quantize(torch.randn(cout, c, *kernel, generator=generator), 60.0)
    bias = torch.randint(-3000, 3000, (cout,), dtype=torch.int32, generator=generator)
    return x, wq, bias, torch.rand(cout, generator=generator) * 1e-3, attrs


@pytest.mark.parametrize("geometry", GEOMETRIES)
@pytest.mark.parametrize("tile", TILES, ids=lambda tile: tile.name)
def test_space_to_depth_window_tactic_equals_the_emulation(geometry, tile):
    """Batch 2 of 13×11 images (odd: the blocks past the image are zero), INT8 out; the tactic
    through the op, its weight as the builder stores it."""
    x, wq, bias, scale, attrs = _layer(geometry, torch.Generator().manual_seed(5))
    attrs["output_inv_scale"] = 3.0
    expected = qconv([x, wq, bias, None, scale], attrs)
    tactic = window_tactic(tile, space_to_depth=True).name
    w = qlayer_weight_for_tactic(wq, tactic)
    assert torch.equal(w, window_weight(wq, space_to_depth=True))
    out = qconv([t.to(DEVICE) for t in (x, w, bias)] + [None, scale.to(DEVICE)], dict(attrs, tactic=tactic))
    assert out.shape == expected.shape and out.dtype == expected.dtype
    assert torch.equal(out.cpu(), expected)


def test_space_to_depth_window_tactic_with_codes_a_residual_and_float_output_equals_the_emulation():
    generator = torch.Generator().manual_seed(6)
    x, wq, bias, scale, attrs = _layer(GEOMETRIES[0].values[0], generator, cout=8)
    attrs.update(residual_scale=0.05, qmin=-128)
    codes = quantize(x, 40.0, -128)
    residual = torch.randint(-128, 128, qconv([codes, wq, bias, None, scale], attrs).shape, dtype=torch.int8,
                             generator=generator)
    expected = qconv([codes, wq, bias, residual, scale], attrs)
    tactic = window_tactic(TILES[1], space_to_depth=True).name
    inputs = [t.to(DEVICE) for t in (codes, qlayer_weight_for_tactic(wq, tactic), bias, residual, scale)]
    out = qconv(inputs, dict(attrs, tactic=tactic))
    assert out.dtype == torch.float32 and torch.equal(out.cpu(), expected)


def test_space_to_depth_is_offered_for_stride_2_windows_only():
    x, w = torch.zeros(1, 3, 16, 16), torch.zeros(8, 3, 7, 7, dtype=torch.int8)
    assert space_to_depth_applies(x, w, {"strides": [2, 2]})
    assert not space_to_depth_applies(x, w, {"strides": [1, 1]})
    assert not space_to_depth_applies(x, w, {"strides": [2, 2], "qformat": QFORMAT})  # FP8 sums in float32
    assert not space_to_depth_applies(x, w, {"strides": [2, 2], "dilations": [2, 1]})
    assert not space_to_depth_applies(x, torch.zeros(8, 3, 7, 9, dtype=torch.int8), {"strides": [2, 2]})  # 80 bytes
    assert not space_to_depth_applies(torch.zeros(1, 8, 16, 16), torch.zeros(8, 8, 3, 3, dtype=torch.int8),
                                      {"strides": [2, 2]})
    plain, both = window_tactics(1), window_tactics(1, space_to_depth=True)
    assert both[:len(plain)] == plain and [n.removesuffix(".space-to-depth") for n in both[len(plain):]] == plain
    for name in both:
        tactic = tactic_for(name)
        assert isinstance(tactic, WINDOW_TACTICS) and tactic.space_to_depth == name.endswith(".space-to-depth")
        assert own_kernel_tactic(name) == own_kernel_tactic(name.removesuffix(".space-to-depth"))
    with pytest.raises(TacticNameError):
        tactic_for(window_tactic(WINDOW_TILES[0], space_to_depth=True).name + ".space-to-depth")
    for tile in TILES:  # `sartor inspect` says which form runs
        tactic = window_tactic(tile, space_to_depth=True)
        described = _tactic(Node("QConv", "stem", ["x"], ["y"], {"tactic": tactic.name}), torch.device("cpu"))
        assert "16-byte pixels of 2x2 blocks" in described and tactic.tile.fields_text in described


@pytest.mark.skipif(DEVICE == "cpu", reason="alignment faults exist on the GPU only; the interpreter reads any byte")
@pytest.mark.parametrize("form", [False, True], ids=["window", "space_to_depth"])
def test_row_pair_tiles_at_resnets_stem_size_equal_the_emulation_on_the_gpu(form):
    """The builder's own row-pair tiles over a 224 × 224 image, whose 112 output columns Triton
    proves a multiple of 16: there Triton 3.6 copied the 4-byte form's 8-byte-aligned windows 16
    bytes at a time (a misaligned address, session 25) until the kernel was told their alignment.
    The small images above do not reach that specialization."""
    generator = torch.Generator().manual_seed(7)
    attrs = {"kernel_shape": [7, 7], "strides": [2, 2], "pads": [3, 3, 3, 3], "dilations": [1, 1],
             "input_inv_scale": 40.0, "activation": "Relu", "qmin": -127, "output_inv_scale": 3.0}
    x = torch.randn(2, 3, 224, 224, generator=generator)
    wq = quantize(torch.randn(64, 3, 7, 7, generator=generator), 60.0)
    bias = torch.randint(-3000, 3000, (64,), dtype=torch.int32, generator=generator)
    scale = torch.rand(64, generator=generator) * 1e-3
    expected = qconv([x, wq, bias, None, scale], attrs)
    for tile in window_resident_tiles(1):
        if tile.row_pairs:
            tactic = window_tactic(tile, space_to_depth=form).name
            inputs = [t.to(DEVICE) for t in (x, qlayer_weight_for_tactic(wq, tactic), bias)]
            out = qconv(inputs + [None, scale.to(DEVICE)], dict(attrs, tactic=tactic))
            assert torch.equal(out.cpu(), expected), tactic
