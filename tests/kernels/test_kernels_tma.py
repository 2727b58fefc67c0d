"""The TMA-fed convolution kernel (`sartor/kernels/conv/tma.py`): bit for bit the INT8 emulation,
through Triton's interpreter on CPU (which emulates the bulk copies, zero fill of the padding
included) and natively on a GPU; where it applies; its tactic names."""
from __future__ import annotations

import pytest
import torch
from int8_layers import (assert_fp8_conv_passes_the_builders_check, assert_qconv_runs_the_tactic,
                         assert_reads_and_writes_channel_slices, on_device, random_int8_conv)

triton = pytest.importorskip("triton")

from sartor.kernels.registry import TacticNameError  # noqa: E402
from sartor.kernels.conv import tma as conv_tma  # noqa: E402
from sartor.kernels.conv.igemm import ConvGeometry, pack_weight  # noqa: E402
from sartor.kernels.conv.tma import TmaTile, conv_tma as run_conv_tma, tma_applies  # noqa: E402
from sartor.ops.conv import igemm_geometry  # noqa: E402
from sartor.ops.quantized import qconv  # noqa: E402

pytestmark = pytest.mark.skipif(conv_tma.TensorDescriptor is None, reason="Triton without host tensor descriptors")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SMALL = TmaTile(4, 8, 32, 32, 1, 1)
PERSISTENT = TmaTile(4, 8, 32, 32, 1, 1, persistent=1)
PERSISTENT_3 = TmaTile(4, 8, 32, 32, 1, 1, persistent=3)


@pytest.mark.parametrize("kernel,hw", [(3, (9, 10)), (3, (8, 8)), (1, (5, 7))])
@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("int8_output", [True, False])
@pytest.mark.parametrize("tile", [SMALL, PERSISTENT, PERSISTENT_3], ids=["tile_per_program", "persistent",
                                                                         "persistent_3_per_sm"])
def test_tma_conv_equals_the_emulation(kernel, hw, residual, int8_output, tile):
    """Rectangles that overhang the image (9×10 with 4×8 ones), that tile it exactly (8×8) and a
    1×1; padding read as zeros from outside the image; the residual and INT8 or float output; one
    program per tile, and persistent programs that each walk several tiles."""
    generator = torch.Generator().manual_seed(3)
    x, w, bias, res, scale, attrs = random_int8_conv(generator, 64, 40, kernel=kernel, hw=hw, residual=residual,
                                                     int8_output=int8_output, codes=True)
    expected = qconv([x, w, bias, res, scale], attrs)
    xd, wd = on_device(x, DEVICE), w.to(DEVICE)
    geometry = igemm_geometry(xd, wd, attrs, require_cuda=False)
    assert tma_applies(xd, tuple(wd.shape), geometry, tile.block_k)
    out = run_conv_tma(xd, pack_weight(wd), bias.to(DEVICE), geometry, tile, dequant_scale=scale.to(DEVICE),
                       residual=on_device(res, DEVICE), activation="Relu", residual_scale=attrs["residual_scale"],
                       output_inv_scale=attrs.get("output_inv_scale"))
    assert out.dtype == (torch.int8 if int8_output else torch.float32)
    assert torch.equal(out.cpu(), expected.contiguous(memory_format=torch.channels_last))


@pytest.mark.parametrize("hw", [(9, 10), (8, 8)])
@pytest.mark.parametrize("tile", [SMALL, PERSISTENT], ids=["tile_per_program", "persistent"])
def test_strided_one_by_one_conv_equals_the_emulation(hw, tile):
    """A 1×1 stride-2 layer without padding (ResNet's downsample) as the stride-1 layer over a view
    of every other pixel: odd and even sizes, a residual, INT8 output, bit for bit the emulation."""
    generator = torch.Generator().manual_seed(13)
    x, w, bias, _, scale, attrs = random_int8_conv(generator, 64, 40, kernel=1, hw=hw, residual=False, codes=True)
    attrs = dict(attrs, strides=[2, 2])
    out_hw = tuple((d - 1) // 2 + 1 for d in hw)
    res = torch.randint(-127, 128, (2, 40, *out_hw), dtype=torch.int8, generator=generator)
    expected = qconv([x, w, bias, res, scale], attrs)
    xd, wd = on_device(x, DEVICE), w.to(DEVICE)
    geometry = igemm_geometry(xd, wd, attrs, require_cuda=False)
    assert geometry.strides == (2, 2) and tma_applies(xd, tuple(wd.shape), geometry, tile.block_k)
    out = run_conv_tma(xd, pack_weight(wd), bias.to(DEVICE), geometry, tile, dequant_scale=scale.to(DEVICE),
                       residual=on_device(res, DEVICE), activation="Relu", residual_scale=attrs["residual_scale"],
                       output_inv_scale=attrs["output_inv_scale"])
    assert torch.equal(out.cpu(), expected.contiguous(memory_format=torch.channels_last))


def test_tma_conv_writes_into_a_channel_slice_and_reads_one():
    """Input a channel slice of a wider buffer (a Split's output), output into a Concat's slice."""
    def run(source, w, bias, geometry, scale, attrs, out):
        run_conv_tma(source, pack_weight(w), bias, geometry, SMALL, dequant_scale=scale, activation="Relu",
                     output_inv_scale=attrs["output_inv_scale"], out=out)
    assert_reads_and_writes_channel_slices(run, kernel=3, seed=4)


def test_where_the_tma_kernel_applies():
    """Stride 1 and dilation 1, 8-bit codes, channels in whole K steps, 16-byte pixel strides: a
    strided conv, float input, 48 channels for a 32 step… 40 channels, an NCHW input and a slice
    starting off alignment are refused, with a one-line reason from the kernel itself."""
    x = torch.zeros(1, 64, 8, 8, dtype=torch.int8).contiguous(memory_format=torch.channels_last)
    w_shape = (32, 64, 3, 3)
    same = ConvGeometry((3, 3), (1, 1), (1, 1), (1, 1), (8, 8))
    assert tma_applies(x, w_shape, same, 32)
    assert not tma_applies(x, w_shape, ConvGeometry((3, 3), (2, 2), (1, 1), (1, 1), (4, 4)), 32)
    assert tma_applies(x, (32, 64, 1, 1), ConvGeometry((1, 1), (2, 2), (0, 0), (1, 1), (4, 4)), 32)
    assert not tma_applies(x, (32, 64, 1, 1), ConvGeometry((1, 1), (2, 2), (1, 1), (1, 1), (5, 5)), 32)  # padded
    assert not tma_applies(x, w_shape, ConvGeometry((3, 3), (1, 1), (2, 2), (2, 2), (8, 8)), 32)
    assert not tma_applies(x.float(), w_shape, same, 32)
    assert not tma_applies(x.contiguous(), w_shape, same, 32)  # NCHW
    forty = torch.zeros(1, 40, 8, 8, dtype=torch.int8).contiguous(memory_format=torch.channels_last)
    assert not tma_applies(forty, (32, 40, 3, 3), same, 32)
    wide = torch.zeros(1, 80, 8, 8, dtype=torch.int8).contiguous(memory_format=torch.channels_last)
    assert not tma_applies(wide[:, 8:72], w_shape, same, 32)  # base 8 bytes off a 16-byte boundary
    assert tma_applies(wide[:, 16:80], w_shape, same, 32)
    with pytest.raises(ValueError, match="conv_tma: input"):
        run_conv_tma(x.float(), pack_weight(torch.zeros(w_shape, dtype=torch.int8)), None, same, SMALL,
                     dequant_scale=torch.ones(32))


def test_tma_tile_names_round_trip():
    for tile in conv_tma.TMA_TILES:
        assert TmaTile.parse(tile.name) == tile
    x = torch.zeros(1, 64, 8, 8, dtype=torch.int8).contiguous(memory_format=torch.channels_last)
    same = ConvGeometry((3, 3), (1, 1), (1, 1), (1, 1), (8, 8))
    assert conv_tma.tma_tactics(x, (32, 64, 3, 3), same, 1) == [t.name for t in conv_tma.TMA_TILES[:2]]
    # Every one-tile rectangle before any persistent form, which lost on the H200 (sessions 22, 23).
    widest = [TmaTile.parse(n).persistent for n in conv_tma.tma_tactics(x, (32, 64, 3, 3), same, 3)]
    assert widest == [0] * 6 + [conv_tma.PERSISTENT_PROGRAMS_PER_SM] * 6
    assert [TmaTile.parse(n).persistent for n in conv_tma.tma_tactics(x, (32, 64, 3, 3), same, 1)] == [0, 0]
    assert conv_tma.tma_tactics(x.float(), (32, 64, 3, 3), same, 3) == []
    assert PERSISTENT.name == "tma.4x8x32x32.w1.s1.persistent1" and TmaTile.parse(PERSISTENT.name) == PERSISTENT
    assert TmaTile.parse("tma.8x16x64x64.w4.s4.persistent3") == TmaTile(8, 16, 64, 64, 4, 4, persistent=3)
    for bad in ("tma.8x16x64.w4.s4", "tma.8x12x64x64.w4.s4", "tma.8x16x64x64.4.s4", "igemm.64x64x64.w4.s4", None,
                "tma.8x16x64x64.w4.s4.q", "tma.8x16x64x64.w4.s4.persistent1.persistent1",
                "tma.8x16x64x64.w4.s4.persistent0", "tma.8x16x64x64.w4.s4.persistentx", "tma_8x16x64x64_w4_s4_p"):
        with pytest.raises(TacticNameError):
            TmaTile.parse(bad)


def test_qconv_runs_the_tma_tactic_with_its_stored_weight():
    assert_qconv_runs_the_tactic(SMALL.name, kernel=3, seed=5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the builder lists kernel tactics on CUDA only")
def test_cuda_int8_layers_of_stride_one_offer_tma_tiles():
    from sartor.ops import default_registry
    x = torch.zeros(2, 64, 16, 16, dtype=torch.int8, device="cuda").contiguous(memory_format=torch.channels_last)
    w = torch.zeros(64, 64, 3, 3, dtype=torch.int8, device="cuda")
    attrs = {"kernel_shape": [3, 3], "strides": [1, 1], "pads": [1, 1, 1, 1]}
    names = default_registry()["QConv"].tactics([x, w], attrs, 1)
    assert [n for n in names if n.startswith("tma.")] == [t.name for t in conv_tma.TMA_TILES[:2]]
    strided = default_registry()["QConv"].tactics([x, w], dict(attrs, strides=[2, 2]), 1)
    assert not any(n.startswith("tma.") for n in strided)


@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.get_device_capability() < (8, 9),
                    reason="FP8 tl.dot needs compute capability 8.9+")
def test_tma_conv_fp8_passes_the_builders_fp8_check():
    """FP8 codes in and out, a residual, held to the builder's FP8 criterion."""
    def run(x, w, bias, geometry, scale, residual, attrs):
        return run_conv_tma(x, pack_weight(w), bias, geometry, SMALL, dequant_scale=scale, residual=residual,
                            activation="Relu", residual_scale=attrs["residual_scale"],
                            output_inv_scale=attrs["output_inv_scale"], fp8=True)
    assert_fp8_conv_passes_the_builders_check(run, 32, 24, kernel=3, seed=6)
