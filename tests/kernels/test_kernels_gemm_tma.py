"""The TMA-fed dense GEMM for 1×1 stride-1 INT8 layers (`sartor/kernels/gemm/tma.py`): bit for bit
the INT8 emulation, through Triton's interpreter on CPU (which emulates the bulk copies and their
zero fill past the matrix) and natively on a GPU; where it applies; its tactic names; the op
running it by its tactic."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from int8_layers import (assert_fp8_conv_passes_the_builders_check, assert_qconv_runs_the_tactic,
                         assert_reads_and_writes_channel_slices, on_device, random_int8_conv, random_int8_gemm,
                         residual_view)

triton = pytest.importorskip("triton")

from sartor.kernels.registry import TacticNameError  # noqa: E402
from sartor.kernels.gemm import tma as gemm_tma  # noqa: E402
from sartor.kernels.conv.igemm import ConvGeometry, pack_weight  # noqa: E402
from sartor.kernels.gemm.tma import GemmTmaTile, gemm_tma as run_gemm_tma, gemm_tma_applies  # noqa: E402
from sartor.ops.conv import igemm_geometry  # noqa: E402
from sartor.ops.quantized import as_quantized, qconv, qgemm  # noqa: E402

pytestmark = pytest.mark.skipif(gemm_tma.TensorDescriptor is None, reason="Triton without host tensor descriptors")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SMALL = GemmTmaTile(16, 32, 32, 1, 1)
HALVES = GemmTmaTile(16, 32, 32, 1, 1, halves=True)
THROUGH_MMA = GemmTmaTile(16, 32, 32, 1, 1, halves=True, residual_mma=True)  # K = 64, 96: two, three K steps
ONE_BY_ONE = ConvGeometry((1, 1), (1, 1), (0, 0), (1, 1), (8, 8))


@pytest.mark.parametrize("channels,cout,hw", [(64, 40, (5, 7)), (96, 32, (4, 4))])
@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("int8_output", [True, False])
@pytest.mark.parametrize("tile", [SMALL, HALVES, THROUGH_MMA],
                         ids=["epilogue_whole", "epilogue_halves", "residual_through_mma"])
def test_gemm_tma_equals_the_emulation(channels, cout, hw, residual, int8_output, tile):
    """Rows and columns that the tile does not divide (70 pixels in tiles of 16, 40 outputs in tiles
    of 32) and ones that it does (32 pixels, 32 outputs); K of 2 and 3 steps; a residual; INT8 or
    float output; the epilogue over the whole tile or its two column halves in turn."""
    generator = torch.Generator().manual_seed(7)
    x, w, bias, res, scale, attrs = random_int8_conv(generator, channels, cout, kernel=1, hw=hw, residual=residual,
                                                     int8_output=int8_output, codes=True)
    expected = qconv([x, w, bias, res, scale], attrs)
    xd, wd = on_device(x, DEVICE), w.to(DEVICE)
    geometry = igemm_geometry(xd, wd, attrs, require_cuda=False)
    assert gemm_tma_applies(xd, tuple(wd.shape), geometry)
    out = run_gemm_tma(xd, pack_weight(wd), bias.to(DEVICE), geometry, tile, dequant_scale=scale.to(DEVICE),
                       residual=on_device(res, DEVICE), activation="Relu", residual_scale=attrs["residual_scale"],
                       output_inv_scale=attrs.get("output_inv_scale"))
    assert out.dtype == (torch.int8 if int8_output else torch.float32)
    assert torch.equal(out.cpu(), expected.contiguous(memory_format=torch.channels_last))


@pytest.mark.parametrize("tile", [
    GemmTmaTile(64, 32, 32, 4, 2, persistent=gemm_tma.PERSISTENT_FLAT),
    GemmTmaTile(64, 32, 32, 4, 2, halves=True, persistent=gemm_tma.PERSISTENT_FLAT, programs_per_sm=2),
    GemmTmaTile(64, 32, 32, 4, 2, persistent=gemm_tma.PERSISTENT_WS),
    GemmTmaTile(64, 32, 32, 4, 2, persistent=gemm_tma.PERSISTENT_WS, programs_per_sm=2)], ids=lambda t: t.name)
def test_persistent_gemm_tma_equals_the_emulation(tile):
    """Persistent programs walk the tiles between them: 226 tiles (7,200 pixels in 64-row tiles, 40
    outputs in 32-column ones, the last of each partial), more than the H200's 132 SMs hold with one
    program each, and about 75 per program under the interpreter (PERSISTENT_PROGRAMS_WITHOUT_GPU)."""
    x, w, bias, res, scale, attrs = random_int8_conv(torch.Generator().manual_seed(12), 64, 40, kernel=1, hw=(60, 60),
                                                     codes=True)
    expected = qconv([x, w, bias, res, scale], attrs)
    xd, wd = on_device(x, DEVICE), w.to(DEVICE)
    geometry = igemm_geometry(xd, wd, attrs, require_cuda=False)
    out = run_gemm_tma(xd, pack_weight(wd), bias.to(DEVICE), geometry, tile, dequant_scale=scale.to(DEVICE),
                       residual=on_device(res, DEVICE), activation="Relu", residual_scale=attrs["residual_scale"],
                       output_inv_scale=attrs["output_inv_scale"])
    assert torch.equal(out.cpu(), expected.contiguous(memory_format=torch.channels_last))


@pytest.mark.parametrize("view", ["cropped", "channel_slice", "nchw"])
def test_gemm_tma_reads_a_residual_view(view):
    """Residuals addressed by (n, oh, ow) and by row alone (`tile_steps.residual_pixels`)."""
    x, w, bias, res, scale, attrs = random_int8_conv(torch.Generator().manual_seed(32), 64, 40, kernel=1, hw=(7, 5),
                                                     codes=True)
    expected = qconv([x, w, bias, res, scale], attrs)
    xd, wd = on_device(x, DEVICE), w.to(DEVICE)
    geometry = igemm_geometry(xd, wd, attrs, require_cuda=False)
    out = run_gemm_tma(xd, pack_weight(wd), bias.to(DEVICE), geometry, SMALL,
                       dequant_scale=scale.to(DEVICE), residual=residual_view(res.to(DEVICE), view),
                       activation="Relu", residual_scale=attrs["residual_scale"],
                       output_inv_scale=attrs["output_inv_scale"])
    assert torch.equal(out.cpu(), expected.contiguous(memory_format=torch.channels_last))


def test_gemm_tma_reads_a_channel_slice_and_writes_into_one():
    """Input a channel slice of a wider buffer (a Split's output), output into a Concat's slice."""
    def run(source, w, bias, geometry, scale, attrs, out):
        run_gemm_tma(source, pack_weight(w), bias, geometry, SMALL, dequant_scale=scale, activation="Relu",
                     output_inv_scale=attrs["output_inv_scale"], out=out)
    assert_reads_and_writes_channel_slices(run, kernel=1, seed=8)


def test_gemm_tma_runs_a_gemm_layer():
    """A QGemm's [rows, K] codes against [Cout, K]: the emulation's numbers."""
    generator = torch.Generator().manual_seed(9)
    x, w, bias, scale, attrs = random_int8_gemm(generator, 37, 64, 48)
    expected = qgemm([x, w, bias, None, scale], attrs)
    codes = as_quantized(x, attrs).to(DEVICE)
    out = run_gemm_tma(codes, pack_weight(w.to(DEVICE)), bias.to(DEVICE), ConvGeometry.gemm(), SMALL,
                       dequant_scale=scale.to(DEVICE), output_inv_scale=attrs["output_inv_scale"], qmin=attrs["qmin"])
    assert torch.equal(out.cpu(), expected)


def test_where_the_gemm_kernel_applies():
    """1×1, stride 1, no padding, 8-bit codes, rows and K in 16-byte multiples: a 3×3, a strided or
    padded 1×1, float input, an NCHW input, 40 channels and a slice starting off alignment are
    refused, with a one-line reason from the kernel itself."""
    x = torch.zeros(1, 64, 8, 8, dtype=torch.int8).contiguous(memory_format=torch.channels_last)
    w_shape = (32, 64, 1, 1)
    assert gemm_tma_applies(x, w_shape, ONE_BY_ONE)
    assert not gemm_tma_applies(x, (32, 64, 3, 3), ConvGeometry((3, 3), (1, 1), (1, 1), (1, 1), (8, 8)))
    assert not gemm_tma_applies(x, w_shape, ConvGeometry((1, 1), (2, 2), (0, 0), (1, 1), (4, 4)))
    assert not gemm_tma_applies(x, w_shape, ConvGeometry((1, 1), (1, 1), (1, 1), (1, 1), (10, 10)))
    assert not gemm_tma_applies(x.float(), w_shape, ONE_BY_ONE)
    assert not gemm_tma_applies(x.contiguous(), w_shape, ONE_BY_ONE)  # NCHW
    forty = torch.zeros(1, 40, 8, 8, dtype=torch.int8).contiguous(memory_format=torch.channels_last)
    assert not gemm_tma_applies(forty, (32, 40, 1, 1), ONE_BY_ONE)
    wide = torch.zeros(1, 80, 8, 8, dtype=torch.int8).contiguous(memory_format=torch.channels_last)
    assert not gemm_tma_applies(wide[:, 8:72], w_shape, ONE_BY_ONE)  # base 8 bytes off a 16-byte boundary
    assert gemm_tma_applies(wide[:, 16:80], w_shape, ONE_BY_ONE)
    assert gemm_tma_applies(torch.zeros(5, 64, dtype=torch.int8), (32, 64), ConvGeometry.gemm())
    with pytest.raises(ValueError, match="takes a residual of INT8 codes through the tensor cores, not torch.float32"):
        run_gemm_tma(x, pack_weight(torch.zeros(w_shape, dtype=torch.int8)), None, ONE_BY_ONE, THROUGH_MMA,
                     dequant_scale=torch.ones(w_shape[0]),
                     residual=torch.zeros(1, w_shape[0], 8, 8).contiguous(memory_format=torch.channels_last))
    with pytest.raises(ValueError, match="gemm_tma: input"):
        run_gemm_tma(x.float(), pack_weight(torch.zeros(w_shape, dtype=torch.int8)), None, ONE_BY_ONE, SMALL,
                     dequant_scale=torch.ones(32))


def test_gemm_tma_tile_names_round_trip():
    """Every offered name parses back to its tile; the halved-epilogue variants come where the tile
    is wide (at least HALVES_MIN_BLOCK_N columns) or the layer has a residual."""
    x = torch.zeros(1, 64, 8, 8, dtype=torch.int8).contiguous(memory_format=torch.channels_last)
    wide = torch.zeros(1, 512, 8, 8, dtype=torch.int8).contiguous(memory_format=torch.channels_last)
    every = gemm_tma.gemm_tma_tactics(wide, (32, 512, 1, 1), ONE_BY_ONE, 5, residual=True)
    assert len([n for n in every if not GemmTmaTile.parse(n).persistent]) == 2 * len(gemm_tma.GEMM_TMA_TILES)
    for name in every:
        assert GemmTmaTile.parse(name).name == name
    first = [t.name for t in gemm_tma.GEMM_TMA_TILES[:2]]  # both 128 or more columns wide
    assert gemm_tma.gemm_tma_tactics(wide, (32, 512, 1, 1), ONE_BY_ONE, 1) == first + [n + ".halves" for n in first]
    narrow = [t for t in gemm_tma.GEMM_TMA_TILES if t.block_n < gemm_tma.HALVES_MIN_BLOCK_N]
    assert narrow and not any(GemmTmaTile.parse(n) == replace(t, halves=True)
                              for n in gemm_tma.gemm_tma_tactics(wide, (32, 512, 1, 1), ONE_BY_ONE, 5)
                              for t in narrow)
    assert gemm_tma.gemm_tma_tactics(x.float(), (32, 64, 1, 1), ONE_BY_ONE, 3) == []
    # K = 64: every tile's K step cut to 64, one pipeline stage (nothing to overlap), no tile twice;
    # a persistent tile keeps its stages, for the next tiles' copies.
    short = [GemmTmaTile.parse(n) for n in gemm_tma.gemm_tma_tactics(x, (32, 64, 1, 1), ONE_BY_ONE, 5)]
    assert {(t.block_k, t.stages) for t in short if not t.persistent} == {(64, 1)}
    assert {t.block_k for t in short} == {64} and min(t.stages for t in short if t.persistent) > 1
    assert len({t.name for t in short}) == len(short)
    deep = torch.zeros(1, 512, 4, 4, dtype=torch.int8).contiguous(memory_format=torch.channels_last)
    assert [GemmTmaTile.parse(n) for n in gemm_tma.gemm_tma_tactics(deep, (32, 512, 1, 1), ONE_BY_ONE, 1)][:2] \
        == list(gemm_tma.GEMM_TMA_TILES[:2])
    assert SMALL.name == "gemm_tma.16x32x32.w1.s1" and HALVES.name == "gemm_tma.16x32x32.w1.s1.halves"
    assert THROUGH_MMA.name == "gemm_tma.16x32x32.w1.s1.halves.residual-mma"
    assert GemmTmaTile.parse(THROUGH_MMA.name) == THROUGH_MMA
    # INT8 residual codes: from RESIDUAL_MMA_MIN_EFFORT the one-tile-per-program halved tiles also through the
    # tensor cores; not below it, nor without a residual
    effort = gemm_tma.RESIDUAL_MMA_MIN_EFFORT
    with_codes = gemm_tma.gemm_tma_tactics(wide, (32, 512, 1, 1), ONE_BY_ONE, effort, residual=True,
                                           residual_codes=True)
    halved = [n for n in with_codes if n.endswith(".halves")]
    assert halved and [n + ".residual-mma" for n in halved] == [n for n in with_codes if n.endswith(".residual-mma")]
    assert gemm_tma.gemm_tma_tactics(wide, (32, 512, 1, 1), ONE_BY_ONE, effort - 1, residual=True,
                                     residual_codes=True) == gemm_tma.gemm_tma_tactics(
        wide, (32, 512, 1, 1), ONE_BY_ONE, effort - 1, residual=True)
    assert gemm_tma.gemm_tma_tactics(wide, (32, 512, 1, 1), ONE_BY_ONE, effort, residual_codes=True) == \
        gemm_tma.gemm_tma_tactics(wide, (32, 512, 1, 1), ONE_BY_ONE, effort)
    assert not any(GemmTmaTile.parse(n).residual_mma and GemmTmaTile.parse(n).persistent for n in
                   gemm_tma.gemm_tma_tactics(wide, (32, 512, 1, 1), ONE_BY_ONE, 5, residual=True, residual_codes=True))
    assert GemmTmaTile.parse("gemm_tma.128x128x128.w8.s3.halves.persistent-flat.per-sm2") == replace(
        gemm_tma.GEMM_TMA_TILES[0], halves=True, persistent=gemm_tma.PERSISTENT_FLAT, programs_per_sm=2)
    for bad in ("gemm_tma.128x128.w8.s3", "gemm_tma.128x96x64.w8.s3", "gemm_tma.128x128x16.w8.s3",
                "gemm_tma.128x128x64.w8.s3.persistent-flat.per-sm0", "gemm_tma.128x128x64.w8.s3.per-sm2",
                "gemm_tma.128x128x64.w8.s3.persistent-flat.per-sm2.halves", "gemm_tma.128x128x64.8.s3",
                "gemm_tma.128x128x64.w8.s3.persistent", "gemm_tma.128x128x64.w8.s3.halves.halves",
                "gemm_tma.128x128x64.w8.s3.residual-mma", "gemm_tma.128x128x64.w8.s3.residual-mma.halves",
                "gemm_tma.128x128x64.w8.s3.halves.residual-mma.persistent-flat",
                "gemm_tma.128x128x64.w8.s3.persistent-flat.per-sm1", "tma.8x16x64x64.w4.s4", None,
                "gemm_tma_128x128x64_w8_s3"):
        with pytest.raises(TacticNameError):
            GemmTmaTile.parse(bad)


def test_persistent_variants_come_from_their_effort_and_only_where_specialized():
    """None below PERSISTENT_MIN_EFFORT (they lost on the H200); from it the first FLAT_TILES
    tiles flattened with and without halves, and WS_TILES warp-specialized without halves, each at
    every PROGRAMS_PER_SM."""
    wide = torch.zeros(1, 512, 8, 8, dtype=torch.int8).contiguous(memory_format=torch.channels_last)

    def persistent(effort: int) -> list[GemmTmaTile]:
        return [t for t in map(GemmTmaTile.parse, gemm_tma.gemm_tma_tactics(wide, (32, 512, 1, 1), ONE_BY_ONE, effort,
                                                                                residual=True)) if t.persistent]

    assert gemm_tma.PERSISTENT_MIN_EFFORT > 3 and persistent(gemm_tma.PERSISTENT_MIN_EFFORT - 1) == []
    flat = {replace(t, halves=False, persistent=0, programs_per_sm=1) for t in persistent(5)
            if t.persistent == gemm_tma.PERSISTENT_FLAT}
    assert flat == set(gemm_tma.GEMM_TMA_TILES[:gemm_tma.FLAT_TILES])
    specialized = [t for t in persistent(5) if t.persistent == gemm_tma.PERSISTENT_WS]
    assert {replace(t, persistent=0, programs_per_sm=1) for t in specialized} == set(gemm_tma.WS_TILES)
    assert not any(t.halves for t in specialized)
    assert {t.programs_per_sm for t in persistent(5)} == set(gemm_tma.PROGRAMS_PER_SM)
    assert len(persistent(gemm_tma.PERSISTENT_MIN_EFFORT)) == (2 * gemm_tma.FLAT_TILES + len(gemm_tma.WS_TILES)) * len(
        gemm_tma.PROGRAMS_PER_SM)


def test_qconv_runs_the_gemm_tactic_with_its_stored_weight():
    assert_qconv_runs_the_tactic(SMALL.name, kernel=1, seed=10)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the builder lists kernel tactics on CUDA only")
def test_cuda_one_by_one_int8_layers_offer_gemm_tiles():
    from sartor.ops import default_registry
    x = torch.zeros(2, 512, 16, 16, dtype=torch.int8, device="cuda").contiguous(memory_format=torch.channels_last)
    w = torch.zeros(64, 512, 1, 1, dtype=torch.int8, device="cuda")
    attrs = {"kernel_shape": [1, 1], "strides": [1, 1], "pads": [0, 0, 0, 0]}
    names = default_registry()["QConv"].tactics([x, w], attrs, 1)
    first = [t.name for t in gemm_tma.GEMM_TMA_TILES[:2]]  # K = 512: the tiles as listed
    assert [n for n in names if n.startswith("gemm_tma.")] == first + [n + ".halves" for n in first]
    strided = default_registry()["QConv"].tactics([x, w], dict(attrs, strides=[2, 2]), 1)
    assert not any(n.startswith("gemm_tma.") for n in strided)


@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.get_device_capability() < (8, 9),
                    reason="FP8 tl.dot needs compute capability 8.9+")
def test_gemm_tma_fp8_passes_the_builders_fp8_check():
    """FP8 codes in and out, a residual, held to the builder's FP8 criterion."""
    def run(x, w, bias, geometry, scale, residual, attrs):
        return run_gemm_tma(x, pack_weight(w), bias, geometry, SMALL, dequant_scale=scale, residual=residual,
                            activation="Relu", residual_scale=attrs["residual_scale"],
                            output_inv_scale=attrs["output_inv_scale"], fp8=True)
    assert_fp8_conv_passes_the_builders_check(run, 64, 24, kernel=1, seed=11)
