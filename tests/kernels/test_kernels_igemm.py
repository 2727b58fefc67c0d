"""The implicit-GEMM convolution kernel: float path against torch's conv2d, INT8 path against the
exact emulation of `sartor/ops/quantized.py` (bit for bit), through Triton's interpreter on CPU and
natively on a GPU."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

# conftest.py switches Triton to its interpreter when there is no GPU.
triton = pytest.importorskip("triton")
from sartor.kernels.conv import igemm  # noqa: E402
from sartor.kernels.conv.igemm import (  # noqa: E402
    NARROW_MAX_BLOCK_M, ConvGeometry, TileConfig, candidate_tiles, conv_igemm, is_packed, pack_weight)
from sartor.kernels.registry import TacticNameError, tactic_for  # noqa: E402
from sartor.ops import default_registry  # noqa: E402
from sartor.ops.conv import igemm_geometry  # noqa: E402
from sartor.ops.quantized import qconv, qgemm, quantize  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SMALL_TILE = TileConfig(16, 16, 32, 1, 1)

# (in channels, kernel, strides, pads (top, left, bottom, right), dilations): the blocked walk over
# K (channels a multiple of BLOCK_K) and the gather walk (3 channels, 48 channels), asymmetric pads.
GEOMETRIES = [
    (32, (3, 3), (1, 1), (1, 1, 1, 1), (1, 1)),
    (32, (3, 3), (2, 2), (1, 1, 1, 1), (1, 1)),
    (64, (1, 1), (1, 1), (0, 0, 0, 0), (1, 1)),
    (3, (7, 7), (2, 2), (3, 3, 3, 3), (1, 1)),
    (48, (3, 3), (1, 2), (0, 1, 2, 1), (2, 1)),
    (32, (3, 3), (1, 1), (2, 1, 2, 1), (2, 1)),  # dilated, through the blocked walk (48 channels gather)
    # The blocked walk's tap bits: 49 taps (an int64 of them), and 81, past MAX_BLOCKED_TAPS (the gather walk).
    (32, (7, 7), (1, 1), (3, 2, 3, 4), (1, 1)),
    (32, (9, 9), (1, 1), (4, 4, 4, 4), (1, 1)),
]


def _geometry(x: torch.Tensor, w: torch.Tensor, attrs: dict) -> ConvGeometry:
    """igemm_geometry's arithmetic, on any device (it declines CPU tensors outside tests)."""
    from sartor.ops.conv import conv_geometry
    strides, dilations, begin, end = conv_geometry(x, w, attrs)
    out = tuple((s + lo + hi - d * (k - 1) - 1) // st + 1
                for s, lo, hi, d, k, st in zip(x.shape[2:], begin, end, dilations, w.shape[2:], strides))
    return ConvGeometry(tuple(w.shape[2:]), tuple(strides), tuple(begin), tuple(dilations), out)


def _attrs(kernel, strides, pads, dilations) -> dict:
    return {"kernel_shape": list(kernel), "strides": list(strides), "pads": list(pads), "dilations": list(dilations)}


def _reference_conv(x, w, b, attrs):
    top, left, bottom, right = attrs["pads"]
    return F.conv2d(F.pad(x, [left, right, top, bottom]), w, b, attrs["strides"], 0, attrs["dilations"])


@pytest.mark.parametrize("channels,kernel,strides,pads,dilations", GEOMETRIES)
@pytest.mark.parametrize("layout", ["nchw", "nhwc"])
def test_float_conv_matches_torch(channels, kernel, strides, pads, dilations, layout):
    generator = torch.Generator().manual_seed(1)
    attrs = _attrs(kernel, strides, pads, dilations)
    dtype = torch.float16 if DEVICE == "cuda" else torch.float32
    x = torch.randn(2, channels, 11, 10, generator=generator)
    w = torch.randn(24, channels, *kernel, generator=generator) / (channels * kernel[0] * kernel[1]) ** 0.5
    b = torch.randn(24, generator=generator)
    expected = _reference_conv(x, w, b, attrs)
    residual = torch.randn(expected.shape, generator=generator)
    expected = torch.relu(expected + residual)
    x, w, b, residual = (t.to(DEVICE, dtype) for t in (x, w, b, residual))
    if layout == "nhwc":
        x = x.contiguous(memory_format=torch.channels_last)
    out = conv_igemm(x, pack_weight(w), b, _geometry(x, w, attrs), SMALL_TILE, residual=residual, activation="Relu")
    assert out.is_contiguous(memory_format=torch.channels_last) and out.dtype == dtype
    tolerance = 2e-2 if dtype == torch.float16 else 1e-4
    torch.testing.assert_close(out.float().cpu(), expected, rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("channels,kernel,strides,pads,dilations", GEOMETRIES)
@pytest.mark.parametrize("int8_input", [True, False])
@pytest.mark.parametrize("int8_output", [True, False])
def test_int8_conv_equals_emulation(channels, kernel, strides, pads, dilations, int8_input, int8_output):
    generator = torch.Generator().manual_seed(2)
    attrs = dict(_attrs(kernel, strides, pads, dilations), input_inv_scale=21.0, residual_scale=0.03,
                 activation="Relu", qmin=-127)
    if int8_output:
        attrs["output_inv_scale"] = 9.5
    x = torch.randint(-127, 128, (2, channels, 11, 10), dtype=torch.int8, generator=generator)
    if not int8_input:
        x = torch.randn(2, channels, 11, 10, generator=generator) * 3
    out = _assert_int8_conv_is_the_emulation(x, kernel, attrs, 24, SMALL_TILE, generator)
    assert out.dtype == (torch.int8 if int8_output else torch.float32)


def _to_device(t: torch.Tensor) -> torch.Tensor:
    """`t` on DEVICE with its strides and storage offset kept: a channel slice stays a slice of a wider
    buffer, as far from a 16-byte boundary as it was (`.to()` would make it a dense tensor of its own)."""
    if t.device.type == DEVICE:
        return t
    whole = torch.empty(0, dtype=t.dtype).set_(t.untyped_storage()).to(DEVICE)
    return whole.as_strided(t.shape, t.stride(), t.storage_offset())


def _assert_int8_conv_is_the_emulation(x, kernel, attrs: dict, cout: int, tile: TileConfig, generator,
                                       with_residual: bool = True, residual: torch.Tensor | None = None):
    """INT8 weights, int32 bias, per-channel scales and (with_residual) an INT8 residual drawn from
    `generator`, or the `residual` given: the kernel's output with `tile` equals the emulation's bit
    for bit. Returns the output."""
    wq = torch.randint(-127, 128, (cout, x.shape[1], *kernel), dtype=torch.int8, generator=generator)
    bias = torch.randint(-4000, 4000, (cout,), dtype=torch.int32, generator=generator)
    scale = torch.rand(cout, generator=generator) * 1e-3
    geometry = _geometry(x, wq, attrs)
    if residual is None and with_residual:
        residual = torch.randint(-127, 128, (x.shape[0], cout, *geometry.out_hw), dtype=torch.int8,
                                 generator=generator)
    expected = qconv([x, wq, bias, None if residual is None else residual.contiguous(), scale], attrs)
    x, residual = _to_device(x), None if residual is None else _to_device(residual)
    wq, bias, scale = (t.to(DEVICE) for t in (wq, bias, scale))
    out = conv_igemm(x, pack_weight(wq), bias, geometry, tile, dequant_scale=scale, residual=residual,
                     activation=attrs["activation"], input_inv_scale=attrs["input_inv_scale"],
                     residual_scale=attrs["residual_scale"], output_inv_scale=attrs.get("output_inv_scale"),
                     residual_after_activation=attrs.get("residual_after_activation", False))
    assert torch.equal(out.cpu(), expected.contiguous(memory_format=torch.channels_last))
    return out


@pytest.mark.parametrize("activation,after", [("SiLU", False), (None, True), ("Clip", False)])
def test_int8_epilogue_variants(activation, after):
    """Float residual, residual after the activation, Q/DQ-style saturation at -128; SiLU may move
    a value across a rounding boundary by its last ulp, so it is held to one step."""
    generator = torch.Generator().manual_seed(3)
    attrs = {"kernel_shape": [3, 3], "pads": [1, 1, 1, 1], "input_inv_scale": 1.0, "output_inv_scale": 30.0,
             "activation": activation, "activation_alpha": 0.0 if activation == "Clip" else None,
             "activation_beta": 2.0 if activation == "Clip" else None, "residual_after_activation": after,
             "qmin": -128}
    x = torch.randint(-128, 128, (1, 32, 6, 7), dtype=torch.int8, generator=generator)
    wq = torch.randint(-127, 128, (16, 32, 3, 3), dtype=torch.int8, generator=generator)
    scale = torch.rand(16, generator=generator) * 1e-4
    residual = torch.randn(1, 16, 6, 7, generator=generator)
    expected = qconv([x, wq, None, residual, scale], attrs)
    out = conv_igemm(x.to(DEVICE), pack_weight(wq).to(DEVICE), None, _geometry(x, wq, attrs), SMALL_TILE,
                     dequant_scale=scale.to(DEVICE), residual=residual.to(DEVICE), activation=activation,
                     alpha=attrs["activation_alpha"], beta=attrs["activation_beta"], residual_after_activation=after,
                     input_inv_scale=1.0, output_inv_scale=30.0, qmin=-128).cpu()
    assert int(out.int().min()) >= -128
    limit = 1 if activation == "SiLU" else 0
    assert int((out.int() - expected.int()).abs().max()) <= limit


def test_output_codes_drop_the_lower_clamp_only_where_it_cannot_bind():
    """CODES_ABOVE_FLOOR where the last step is an activation whose least value rounds to qmin or
    above at the output's scale; CODES for no activation, LeakyReLU, a residual after the
    activation, or a scale so fine that SiLU's -0.2785 lies below -127.5 codes."""
    from sartor.kernels.common.tile_steps import CODES, CODES_ABOVE_FLOOR, output_codes
    assert output_codes("Relu", None, False, 1e6, -127) == CODES_ABOVE_FLOOR
    assert output_codes("SiLU", None, False, 30.0, -128) == CODES_ABOVE_FLOOR
    assert output_codes("SiLU", None, False, 457.0, -127) == CODES_ABOVE_FLOOR  # -127.26 rounds to -127
    assert output_codes("SiLU", None, False, 458.0, -127) == CODES  # -127.54: the clamp binds
    assert output_codes("Clip", 0.0, False, 50.0, -127) == CODES_ABOVE_FLOOR
    assert output_codes("Clip", -6.0, False, 50.0, -127) == CODES
    assert output_codes("Tanh", None, False, 127.0, -127) == CODES_ABOVE_FLOOR
    assert output_codes("Tanh", None, False, 128.0, -127) == CODES
    for activation in (None, "LeakyRelu"):
        assert output_codes(activation, 0.1, False, 1.0, -127) == CODES
    assert output_codes("Relu", None, True, 1.0, -127) == CODES  # the residual comes after


@pytest.mark.parametrize("output_inv_scale", [30.0, 2000.0])
def test_silu_codes_at_a_fine_scale_keep_their_lower_clamp(output_inv_scale):
    """At 2,000 codes a unit SiLU's values down to -0.2785 would be codes down to -557: the lower
    clamp stays (`output_codes`) and saturates them at qmin, as the emulation does; at 30 it is
    dropped and never needed. Within one code of the emulation (SiLU's last ulp) either way."""
    generator = torch.Generator().manual_seed(31)
    attrs = {"kernel_shape": [1, 1], "pads": [0, 0, 0, 0], "input_inv_scale": 1.0,
             "output_inv_scale": output_inv_scale, "activation": "SiLU", "qmin": -127}
    x = torch.randint(-127, 128, (1, 32, 8, 8), dtype=torch.int8, generator=generator)
    wq = torch.randint(-127, 128, (16, 32, 1, 1), dtype=torch.int8, generator=generator)
    scale = torch.full((16,), 2e-4)  # sums of ±10,000 become values of ±2: SiLU's minimum is among them
    expected = qconv([x, wq, None, None, scale], attrs)
    out = conv_igemm(x.to(DEVICE), pack_weight(wq).to(DEVICE), None, _geometry(x, wq, attrs), SMALL_TILE,
                     dequant_scale=scale.to(DEVICE), activation="SiLU", input_inv_scale=1.0,
                     output_inv_scale=output_inv_scale, qmin=-127).cpu()
    if output_inv_scale > 1000:
        assert int(expected.int().min()) == -127 and int((expected == -127).sum()) > 10  # saturated below
    assert int(out.int().min()) >= -127
    assert int((out.int() - expected.int()).abs().max()) <= 1


@pytest.mark.parametrize("activation", [None, "Relu"])
def test_int8_residual_codes_and_saturation_over_the_whole_range(activation):
    """Every INT8 residual code, -128 included (`_codes_to_float` reads it by bit pattern), scaled by
    1.5 so that half of them tie and the ends saturate at -128 and 127 (`quantize_int8`; after
    ReLU, `_requantize_code_above_floor` without the lower clamp): codes equal the emulation's."""
    codes = torch.arange(-128, 128, dtype=torch.int8).reshape(1, 1, 16, 16)
    attrs = {"kernel_shape": [1, 1], "pads": [0, 0, 0, 0], "input_inv_scale": 1.0, "output_inv_scale": 3.0,
             "residual_scale": 0.5, "activation": activation, "qmin": -128}
    x = torch.zeros(1, 8, 16, 16, dtype=torch.int8)  # the product adds nothing: the residual decides
    wq = torch.ones(1, 8, 1, 1, dtype=torch.int8)
    scale = torch.ones(1)
    expected = qconv([x, wq, None, codes, scale], attrs)
    assert int(expected.min()) == (0 if activation else -128) and int(expected.max()) == 127
    out = conv_igemm(x.to(DEVICE), pack_weight(wq).to(DEVICE), None, _geometry(x, wq, attrs), SMALL_TILE,
                     dequant_scale=scale.to(DEVICE), residual=codes.to(DEVICE), activation=activation,
                     input_inv_scale=1.0, residual_scale=0.5, output_inv_scale=3.0, qmin=-128).cpu()
    assert torch.equal(out, expected.contiguous(memory_format=torch.channels_last))


def test_int8_gemm_equals_emulation():
    generator = torch.Generator().manual_seed(4)
    attrs = {"input_inv_scale": 13.0, "activation": None}
    x = torch.randn(5, 96, generator=generator)
    wq = torch.randint(-127, 128, (40, 96), dtype=torch.int8, generator=generator)
    bias = torch.randint(-500, 500, (40,), dtype=torch.int32, generator=generator)
    scale = torch.rand(40, generator=generator) * 1e-2
    expected = qgemm([x, wq, bias, None, scale], attrs)
    out = conv_igemm(x.to(DEVICE), pack_weight(wq).to(DEVICE), bias.to(DEVICE), ConvGeometry.gemm(), SMALL_TILE,
                     dequant_scale=scale.to(DEVICE), input_inv_scale=13.0)
    assert out.shape == (5, 40)
    assert torch.equal(out.cpu(), expected)


def test_input_quantization_rounds_half_to_even():
    """Ties and the float32 value just below one half: floor(v + 0.5) would get these wrong."""
    values = torch.tensor([0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 0.49999997, 126.5, 127.5, -127.5, 300.0, -300.0])
    channels = values.numel()
    eye = torch.eye(channels, dtype=torch.int8)
    out = conv_igemm(values.reshape(1, -1).to(DEVICE), eye.to(DEVICE), None, ConvGeometry.gemm(), SMALL_TILE,
                     dequant_scale=torch.ones(channels, device=DEVICE), input_inv_scale=1.0).cpu()
    assert out.flatten().tolist() == quantize(values, 1.0).float().tolist()
    assert out.flatten()[:7].tolist() == [0, 2, 2, -0, -2, -2, 0]


def test_unpacked_weight_is_refused():
    w = torch.zeros(8, 16, 3, 3)
    assert not is_packed(w) and is_packed(pack_weight(w))
    with pytest.raises(ValueError, match="packed"):
        conv_igemm(torch.zeros(1, 16, 4, 4), w, None, ConvGeometry((3, 3), (1, 1), (1, 1), (1, 1), (4, 4)),
                   SMALL_TILE)


def test_tile_names_round_trip_and_effort_widens_the_search():
    for tile in candidate_tiles(int8=True, effort=5) + candidate_tiles(int8=False, effort=5):
        assert TileConfig.parse(tile.name) == tile
    split = TileConfig(64, 64, 64, 4, 4, split_k=4)
    assert split.name == "igemm.64x64x64.w4.s4.split4" and TileConfig.parse(split.name) == split
    for bad in ("cudnn_fused", "igemm.bad", "igemm.64x64x64.w4.s4.x4", "igemm.64x64x64.w4.s4.split4.split2",
                "igemm.64x64x64.w4.s4.split0", "igemm.64x64x64.w4.s4.split1", "igemm.64x64x64.4.s4",
                "igemm_64x64x64_w4_s4", "igemm.64x64x64.w4.s4.last-reduces",
                "igemm.128x128x64.w8.s3.split4.last-reduces"):
        with pytest.raises(TacticNameError):
            TileConfig.parse(bad)


def test_split_k_is_offered_where_the_tile_grid_leaves_the_gpu_idle():
    """Batch 1's 7×7 stage (49 rows, 512 channels, K = 4,608) on 132 SMs gets split variants that
    fill the GPU without shares under 4 K blocks; a layer of 800k rows gets none."""
    from sartor.kernels.conv.igemm import MIN_K_BLOCKS_PER_SHARE, split_k_tiles
    tiles = candidate_tiles(int8=True, effort=2)
    variants = split_k_tiles(tiles, 49, 512, 4608, 132)
    assert variants and all(v.split_k > 1 for v in variants)
    # Each split both ways, the epilogue kernel after and the tile's last share running it, but
    # where the last share would hold more slot values a thread than fit its registers.
    reducing = {replace(v, last_reduces=False) for v in variants if v.last_reduces}
    ending = {v for v in variants if not v.last_reduces}
    assert reducing == {v for v in ending
                        if v.accumulators_per_thread * v.split_k <= igemm.MAX_SLOT_VALUES_AT_ONCE}
    assert reducing and reducing != ending
    for v in variants:
        grid = -(-49 // v.block_m) * -(-512 // v.block_n)
        assert grid * v.split_k <= 132 and (4608 // v.block_k) // v.split_k >= MIN_K_BLOCKS_PER_SHARE
        assert TileConfig.parse(v.name) == v
    assert split_k_tiles(tiles, 802816, 256, 64, 132) == []
    assert split_k_tiles(tiles, 49, 512, 4608, 0) == []  # no GPU: nothing to fill


def test_one_stage_variants_are_offered_where_k_is_one_block_only():
    """ResNet's 1×1 layers over 64 channels (K = 64) get one-stage variants of the tiles whose
    BLOCK_K holds all of K; a 3×3 layer (K = 576) gets none, and the kernel's result is the same."""
    from sartor.kernels.conv.igemm import single_pass_tiles
    tiles = candidate_tiles(int8=True, effort=3)
    variants = single_pass_tiles(tiles, 64)
    assert variants and all(v.stages == 1 and v.block_k >= 64 for v in variants)
    assert len(variants) == sum(1 for t in tiles if t.block_k >= 64 and t.stages > 1)
    assert all(TileConfig.parse(v.name) == v for v in variants)
    assert single_pass_tiles(tiles, 576) == []
    generator = torch.Generator().manual_seed(9)
    x = torch.randint(-127, 128, (2, 64, 5, 6), dtype=torch.int8, generator=generator)
    w = torch.randint(-127, 128, (32, 64, 1, 1), dtype=torch.int8, generator=generator)
    scale = torch.rand(32, generator=generator) * 1e-3
    geometry = ConvGeometry((1, 1), (1, 1), (0, 0), (1, 1), (5, 6))
    x_dev = x.to(DEVICE).contiguous(memory_format=torch.channels_last)
    tiles = (TileConfig(64, 64, 64, 4, 4), TileConfig(64, 64, 64, 4, 1))
    runs = [conv_igemm(x_dev, pack_weight(w.to(DEVICE)), None, geometry, tile, dequant_scale=scale.to(DEVICE),
                       output_inv_scale=4.0).cpu() for tile in tiles]
    assert torch.equal(runs[0], runs[1])


SPLIT_GEOMETRIES = [  # the blocked walk (64 channels, 9 taps), the gather walk (3 channels), a 1×1
    (64, (3, 3), (1, 1), (1, 1, 1, 1)),
    (3, (7, 7), (2, 2), (3, 3, 3, 3)),
    (96, (1, 1), (1, 1), (0, 0, 0, 0)),
]


@pytest.mark.parametrize("channels,kernel,strides,pads", SPLIT_GEOMETRIES)
@pytest.mark.parametrize("split_k", [2, 3])
@pytest.mark.parametrize("last_reduces", [False, True], ids=["epilogue-kernel", "last-reduces"])
def test_split_k_int8_equals_the_emulation(channels, kernel, strides, pads, split_k, last_reduces):
    """K shared between programs (int32 partial sums, then one epilogue kernel, or the epilogue run
    by each tile's last share): bit for bit the emulation, residual and INT8 output included, for
    shares that do not divide K evenly too."""
    generator = torch.Generator().manual_seed(6)
    attrs = dict(_attrs(kernel, strides, pads, (1, 1)), input_inv_scale=17.0, residual_scale=0.05,
                 activation="Relu", qmin=-127, output_inv_scale=7.0)
    x = torch.randn(2, channels, 9, 8, generator=generator) * 2
    tile = TileConfig(16, 16, 32, 1, 1, split_k=split_k, last_reduces=last_reduces)
    _assert_int8_conv_is_the_emulation(x, kernel, attrs, 40, tile, generator)


def _float_split_case(seed: int):
    """A float 3×3 layer (64 → 24 channels over 6×5 pixels, FP16 on a GPU): x, packed w, b, geometry."""
    generator = torch.Generator().manual_seed(seed)
    dtype = torch.float16 if DEVICE == "cuda" else torch.float32
    attrs = _attrs((3, 3), (1, 1), (1, 1, 1, 1), (1, 1))
    x = torch.randn(1, 64, 6, 5, generator=generator).to(DEVICE, dtype)
    w = (torch.randn(24, 64, 3, 3, generator=generator) / 24).to(DEVICE, dtype)
    b = torch.randn(24, generator=generator).to(DEVICE, dtype)
    return x, pack_weight(w), b, _geometry(x, w, attrs)


def _assert_split_gemm_is_the_emulation(tile: TileConfig, seed: int) -> None:
    """An INT8 GEMM (3 × 160 by 160 → 20) split as `tile` says: bit for bit qgemm's emulation."""
    generator = torch.Generator().manual_seed(seed)
    xg = torch.randn(3, 160, generator=generator)
    wg = torch.randint(-127, 128, (20, 160), dtype=torch.int8, generator=generator)
    sg = torch.rand(20, generator=generator) * 1e-2
    expected = qgemm([xg, wg, None, None, sg], {"input_inv_scale": 9.0, "activation": None})
    got = conv_igemm(xg.to(DEVICE), pack_weight(wg).to(DEVICE), None, ConvGeometry.gemm(), tile,
                     dequant_scale=sg.to(DEVICE), input_inv_scale=9.0)
    assert torch.equal(got.cpu(), expected)


def test_last_reduces_is_the_epilogue_kernels_bits_and_leaves_its_counters_at_zero():
    """Float split-K ended in the kernel adds the shares in the epilogue kernel's order: the same
    bits, run after run (the counters it took, the context's for its layer, back at zero each
    time); a GEMM too. Without its counters at zero no share would be last and nothing written."""
    from sartor.kernels.common.arrival_counters import ArrivalCounters, bound, reset_launch_site, set_launch_site
    x, w, b, geometry = _float_split_case(8)
    two_kernels = conv_igemm(x, w, b, geometry, TileConfig(16, 16, 32, 1, 1, split_k=4), activation="SiLU")
    counters = ArrivalCounters()
    tile = TileConfig(16, 16, 32, 1, 1, split_k=4, last_reduces=True)
    assert tile.name == "igemm.16x16x32.w1.s1.split4.last-reduces" and TileConfig.parse(tile.name) == tile
    with bound(counters):
        site = set_launch_site("conv")
        try:
            for _ in range(3):
                one_kernel = conv_igemm(x, w, b, geometry, tile, activation="SiLU")
                assert torch.equal(one_kernel.cpu(), two_kernels.cpu())
                taken = counters.take("conv", 2 * 2, DEVICE)  # 30 rows × 24 channels in 16×16 tiles
                assert counters.words == taken.numel() and not taken.any()
                taken.fill_(4)  # counters left off zero: no share of their tiles is last, nothing is written
                unwritten = torch.full_like(two_kernels, float("nan"))
                conv_igemm(x, w, b, geometry, tile, activation="SiLU", out=unwritten)
                assert unwritten.isnan().all() and taken.tolist() == [8] * 4
                taken.zero_()
        finally:
            reset_launch_site(site)
    _assert_split_gemm_is_the_emulation(TileConfig(16, 16, 32, 1, 1, split_k=3, last_reduces=True), 9)


def test_split_k_float_and_gemm_match_the_single_pass():
    """Float layers and GEMMs through split-K: the same result as one program per tile, up to the
    order of the float32 sums."""
    x, w, b, geometry = _float_split_case(7)
    one = conv_igemm(x, w, b, geometry, SMALL_TILE, activation="Relu")
    four = conv_igemm(x, w, b, geometry, TileConfig(16, 16, 32, 1, 1, split_k=4), activation="Relu")
    tolerance = 2e-3 if x.dtype == torch.float16 else 1e-5
    torch.testing.assert_close(four.float().cpu(), one.float().cpu(), rtol=tolerance, atol=tolerance)
    _assert_split_gemm_is_the_emulation(TileConfig(16, 16, 32, 1, 1, split_k=3), 7)
    assert len(candidate_tiles(int8=True, effort=1)) < len(candidate_tiles(int8=True, effort=3))
    for int8 in (True, False):  # the deep-K 128×128 tile at every effort, once
        for effort in range(1, 6):
            tiles = candidate_tiles(int8=int8, effort=effort)
            assert tiles.count(igemm.DEEP_K_TILES[int8]) == 1 and len(set(tiles)) == len(tiles)
        assert candidate_tiles(int8=int8, effort=1)[-1] == igemm.DEEP_K_TILES[int8]


def test_cpu_layers_offer_only_their_reference():
    """On the CPU the implicit-GEMM kernel is not a candidate: INT8 layers keep the emulation."""
    registry = default_registry()
    x = torch.zeros(1, 16, 8, 8)
    w = torch.zeros(8, 16, 3, 3, dtype=torch.int8)
    assert registry["QConv"].tactics([x, w], {}, 2) == ["torch"]
    assert igemm_geometry(x, w, {}) is None
    assert registry["QConv"].weight_for_tactic(w, "torch") is w
    assert is_packed(registry["QConv"].weight_for_tactic(w, candidate_tiles(True, 1)[0].name))


@pytest.mark.skipif(DEVICE != "cuda", reason="the tactic lists the kernel on CUDA tensors only")
def test_cuda_layers_offer_the_kernel():
    x = torch.zeros(1, 16, 8, 8, device="cuda").contiguous(memory_format=torch.channels_last)
    w = torch.zeros(8, 16, 3, 3, dtype=torch.int8, device="cuda")
    names = default_registry()["QConv"].tactics([x.to(torch.int8), w], {}, 2)
    # other families (TMA, im2col, direct, windows) are offered beside the tiles: each must parse
    assert names[0] == "torch" and any(n.startswith("igemm.") for n in names[1:])
    assert all(tactic_for(n).name == n for n in names)
    float_names = default_registry()["FusedConv"].tactics([x.half(), w.half()], {}, 2)
    assert any(n.startswith("igemm.") for n in float_names)



@pytest.mark.parametrize("int8_output", [True, False])
@pytest.mark.parametrize("tile", [SMALL_TILE, TileConfig(16, 16, 64, 1, 1)], ids=["block_k32", "block_k64"])
def test_im2col_tactic_equals_emulation(int8_output, tile):
    """The 3-channel stem's tactic: INT8 columns with K = 147 padded to a multiple of 32 and of the
    tile's BLOCK_K (160, or 192 for BLOCK_K 64, so that the GEMM walks whole K blocks), then the
    GEMM kernel."""
    from sartor.ops.quantized import Im2colIgemm, _im2col_conv, qlayer_weight_for_tactic
    generator = torch.Generator().manual_seed(5)
    attrs = {"kernel_shape": [7, 7], "strides": [2, 2], "pads": [3, 3, 3, 3], "input_inv_scale": 40.0,
             "activation": "Relu", "qmin": -127}
    if int8_output:
        attrs["output_inv_scale"] = 3.0
    x = torch.randn(2, 3, 15, 13, generator=generator)
    wq = torch.randint(-127, 128, (16, 3, 7, 7), dtype=torch.int8, generator=generator)
    bias = torch.randint(-3000, 3000, (16,), dtype=torch.int32, generator=generator)
    scale = torch.rand(16, generator=generator) * 1e-3
    expected = qconv([x, wq, bias, None, scale], attrs)
    tactic = Im2colIgemm(tile).name
    flat = qlayer_weight_for_tactic(wq, tactic)
    assert flat.shape == (16, 160 if tile.block_k == 32 else 192) and not flat[:, 147:].any()
    out = _im2col_conv(x.to(DEVICE), flat.to(DEVICE), bias.to(DEVICE), scale.to(DEVICE), attrs, tile)
    assert out.shape == expected.shape and out.is_contiguous(memory_format=torch.channels_last)
    assert torch.equal(out.cpu(), expected)


def test_output_into_a_channel_slice_with_a_sliced_input_and_residual():
    """A Concat's producer writes its channels into a slice of the Concat's buffer, reading a Split
    half (a channel slice) and a residual that is one too; the other channels stay untouched."""
    generator = torch.Generator().manual_seed(3)
    attrs = _attrs((3, 3), (1, 1), (1, 1, 1, 1), (1, 1))
    dtype = torch.float16 if DEVICE == "cuda" else torch.float32
    source = torch.randn(2, 40, 9, 8, generator=generator).contiguous(memory_format=torch.channels_last)
    x = source[:, 8:40]  # 32 channels, pixel stride 40
    w = torch.randn(24, 32, 3, 3, generator=generator) / (32 * 9) ** 0.5
    b = torch.randn(24, generator=generator)
    residual = source[:, 16:40]
    expected = torch.relu(_reference_conv(x.contiguous(), w, b, attrs) + residual)
    buffer = torch.full((2, 56, 9, 8), 7.0).contiguous(memory_format=torch.channels_last).to(DEVICE, dtype)
    on_device = source.to(DEVICE, dtype)  # whole, then sliced: slices moved alone would arrive dense
    x, residual = on_device[:, 8:40], on_device[:, 16:40]
    w, b = (t.to(DEVICE, dtype) for t in (w, b))
    assert x.stride()[3] == 40 and residual.stride()[3] == 40
    out = buffer.narrow(1, 20, 24)
    written = conv_igemm(x, pack_weight(w), b, _geometry(x, w, attrs), SMALL_TILE, residual=residual,
                         activation="Relu", out=out)
    assert written.data_ptr() == out.data_ptr()
    tolerance = 2e-2 if dtype == torch.float16 else 1e-4
    torch.testing.assert_close(buffer[:, 20:44].float().cpu(), expected, rtol=tolerance, atol=tolerance)
    assert (buffer[:, :20] == 7).all() and (buffer[:, 44:] == 7).all()


def test_output_slice_of_the_wrong_shape_is_refused():
    x = torch.randn(1, 32, 5, 5).to(DEVICE)
    w = torch.randn(8, 32, 1, 1).to(DEVICE)
    attrs = _attrs((1, 1), (1, 1), (0, 0, 0, 0), (1, 1))
    out = torch.empty(1, 16, 5, 5).contiguous(memory_format=torch.channels_last).to(DEVICE).narrow(1, 0, 7)
    with pytest.raises(ValueError, match="cannot hold"):
        conv_igemm(x, pack_weight(w), None, _geometry(x, w, attrs), SMALL_TILE, out=out)


@pytest.mark.parametrize("channels_last", [True, False])
def test_emulation_hands_on_the_layout_it_was_given(channels_last):
    """The emulation wins the timing of tiny layers on a GPU: its output keeps the input's layout,
    so a Concat it feeds next to kernel outputs stays one channels-last buffer. (The CPU's float64
    convolution keeps the layout by itself; the GPU's did not.)"""
    generator = torch.Generator().manual_seed(8)
    attrs = {"kernel_shape": [3, 3], "strides": [1, 1], "pads": [1, 1, 1, 1], "input_inv_scale": 20.0,
             "output_inv_scale": 4.0, "qmin": -127}
    x = torch.randn(2, 5, 6, 7, generator=generator).to(DEVICE)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    wq = torch.randint(-127, 128, (4, 5, 3, 3), dtype=torch.int8, generator=generator).to(DEVICE)
    scale = torch.full((4,), 1e-3, device=DEVICE)
    out = qconv([x, wq, None, None, scale], attrs)
    assert out.dtype == torch.int8
    assert out.is_contiguous(memory_format=torch.channels_last) == channels_last and out.is_contiguous() != channels_last
    assert torch.equal(out, qconv([x.contiguous(), wq, None, None, scale], attrs))


@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("int8_output", [True, False])
def test_epilogue_in_halves_gives_the_same_output(residual, int8_output):
    """The halved epilogue (columns in two halves, fewer registers live) computes what the whole-tile
    epilogue does, for INT8 with and without a residual and requantization, columns not a multiple
    of the tile included, also with the residual loaded before the K loop; its variants are named,
    parsed and offered for unsplit tiles only, the early residual only where there is one."""
    from sartor.kernels.conv.igemm import halved_epilogue_tiles
    generator = torch.Generator().manual_seed(10)
    x = torch.randint(-127, 128, (2, 64, 5, 6), dtype=torch.int8, generator=generator)
    w = torch.randint(-127, 128, (40, 64, 3, 3), dtype=torch.int8, generator=generator)
    bias = torch.randint(-3000, 3000, (40,), dtype=torch.int32, generator=generator)
    scale = torch.rand(40, generator=generator) * 1e-3
    res = torch.randint(-127, 128, (2, 40, 5, 6), dtype=torch.int8, generator=generator) if residual else None
    attrs = {"kernel_shape": [3, 3], "strides": [1, 1], "pads": [1, 1, 1, 1], "input_inv_scale": 1.0,
             "activation": "Relu", "qmin": -127, "residual_scale": 0.02}
    if int8_output:
        attrs["output_inv_scale"] = 4.0
    expected = qconv([x, w, bias, res, scale], attrs)
    tile = TileConfig(16, 32, 64, 1, 1)
    halved = halved_epilogue_tiles([tile, TileConfig(16, 32, 64, 1, 1, split_k=2)], residual=True)
    assert halved == [TileConfig(16, 32, 64, 1, 1, epilogue_halves=True),
                      TileConfig(16, 32, 64, 1, 1, epilogue_halves=True, residual_early=True)]
    # Without a residual only wide tiles get the variant: narrow ones keep their registers anyway.
    assert halved_epilogue_tiles([tile], residual=False) == []
    wide = TileConfig(128, 128, 64, 8, 3)
    assert halved_epilogue_tiles([wide], residual=False) == [replace(wide, epilogue_halves=True)]
    assert TileConfig.parse(halved[0].name) == halved[0] and halved[0].name.endswith(".halves")
    assert TileConfig.parse(halved[1].name) == halved[1] and halved[1].name.endswith(".halves.residual-early")
    with pytest.raises(TacticNameError):
        TileConfig.parse("igemm.16x32x64.w1.s1.split2.halves")  # split-K has its own epilogue kernel
    with pytest.raises(TacticNameError):
        TileConfig.parse("igemm.16x32x64.w1.s1.residual-early")  # the early residual goes with the halves
    assert TileConfig.parse("igemm.16x32x64.w1.s1.halves.residual-early.padded-taps").residual_early
    to_dev = lambda t: None if t is None else t.to(DEVICE).contiguous(memory_format=torch.channels_last)  # noqa: E731
    for variant in halved:
        out = conv_igemm(to_dev(x), pack_weight(w.to(DEVICE)), bias.to(DEVICE),
                         igemm_geometry(x.to(DEVICE), w.to(DEVICE), attrs, require_cuda=False), variant,
                         dequant_scale=scale.to(DEVICE), residual=to_dev(res), activation="Relu", residual_scale=0.02,
                         output_inv_scale=attrs.get("output_inv_scale"), input_inv_scale=1.0)
        assert torch.equal(out.cpu(), expected), variant.name


# Channel counts no multiple of the K block (the sample detector's 24, 40, 48, 80), strided and
# padded, and a 1×1 (one tap: the channel cut alone).
PADDED_TAP_GEOMETRIES = [
    (24, (3, 3), (1, 1), (1, 1, 1, 1)),
    (40, (3, 3), (2, 2), (1, 1, 1, 1)),
    (80, (1, 1), (1, 1), (0, 0, 0, 0)),
]


@pytest.mark.parametrize("channels,kernel,strides,pads", PADDED_TAP_GEOMETRIES)
@pytest.mark.parametrize("residual", [False, True])
def test_padded_taps_int8_equals_the_emulation(channels, kernel, strides, pads, residual):
    """The tap by tap walk with each tap's channels cut at C: bit for bit the emulation, with INT8
    and float inputs, INT8 output and a residual."""
    generator = torch.Generator().manual_seed(11)
    attrs = dict(_attrs(kernel, strides, pads, (1, 1)), input_inv_scale=13.0, residual_scale=0.04,
                 activation="Relu", qmin=-127, output_inv_scale=6.0)
    tile = TileConfig(16, 32, 32, 1, 1, padded_taps=True)
    assert channels % tile.block_k  # the walk this test is for, not the blocked one
    for x in (torch.randint(-127, 128, (2, channels, 9, 8), dtype=torch.int8, generator=generator),
              torch.randn(2, channels, 9, 8, generator=generator) * 2):
        x = x.contiguous(memory_format=torch.channels_last)
        _assert_int8_conv_is_the_emulation(x, kernel, attrs, 24, tile, generator, with_residual=residual)


@pytest.mark.parametrize("channels,kernel,strides,pads", PADDED_TAP_GEOMETRIES)
def test_padded_taps_float_matches_torch(channels, kernel, strides, pads):
    generator = torch.Generator().manual_seed(12)
    attrs = _attrs(kernel, strides, pads, (1, 1))
    dtype = torch.float16 if DEVICE == "cuda" else torch.float32
    x = torch.randn(2, channels, 9, 8, generator=generator)
    w = torch.randn(24, channels, *kernel, generator=generator) / (channels * kernel[0] * kernel[1]) ** 0.5
    b = torch.randn(24, generator=generator)
    expected = torch.relu(_reference_conv(x, w, b, attrs))
    x, w, b = (t.to(DEVICE, dtype) for t in (x, w, b))
    x = x.contiguous(memory_format=torch.channels_last)
    tile = TileConfig(16, 32, 16, 1, 1, padded_taps=True)
    out = conv_igemm(x, pack_weight(w), b, _geometry(x, w, attrs), tile, activation="Relu")
    tolerance = 2e-2 if dtype == torch.float16 else 1e-4
    torch.testing.assert_close(out.float().cpu(), expected, rtol=tolerance, atol=tolerance)


def test_padded_tap_variants_are_offered_where_channels_miss_the_k_block():
    """24 channels: variants with a 32-wide K block, N narrowed to the 24 outputs' 32, named and
    parsed; 64 channels (a multiple of every K block) and 27 channels (rows too ragged to load as
    vectors) get none."""
    from sartor.kernels.conv.igemm import padded_tap_tiles
    tiles = candidate_tiles(int8=True, effort=2)
    variants = padded_tap_tiles(tiles, 24, 24, eight_bit=True)
    assert variants and all(v.padded_taps and v.block_k == 32 and v.block_n == 32 for v in variants)
    assert all(TileConfig.parse(v.name) == v and v.name.endswith(".padded-taps") for v in variants)
    assert len(set(variants)) == len(variants)
    assert {v.block_k for v in padded_tap_tiles(tiles, 80, 256, eight_bit=True)} == {32}  # 96 pads less than 128
    assert {v.block_k for v in padded_tap_tiles(tiles, 48, 256, eight_bit=True)} == {64}
    assert {v.block_k for v in padded_tap_tiles(candidate_tiles(int8=False, effort=2), 40, 64,
                                                eight_bit=False)} == {16}
    assert padded_tap_tiles(tiles, 64, 64, eight_bit=True) == []
    assert padded_tap_tiles(tiles, 27, 64, eight_bit=True) == []
    assert TileConfig.parse("igemm.64x64x32.w4.s4.halves.padded-taps").epilogue_halves
    with pytest.raises(TacticNameError):
        TileConfig.parse("igemm.64x64x32.w4.s4.padded-taps.halves")  # one spelling: the declared order


WEIGHT_TMA_TILES = [TileConfig(16, 16, 32, 1, 1, weight_tma=True),
                    TileConfig(16, 32, 32, 1, 1, epilogue_halves=True, weight_tma=True),
                    TileConfig(16, 16, 32, 1, 1, split_k=3, weight_tma=True)]


NO_DESCRIPTORS = pytest.mark.skipif(igemm.TensorDescriptor is None, reason="Triton without host tensor descriptors")


@NO_DESCRIPTORS
@pytest.mark.parametrize("tile", WEIGHT_TMA_TILES, ids=["plain", "halves", "split_k"])
@pytest.mark.parametrize("strides,cout", [((1, 1), 40), ((2, 2), 24)])
def test_weight_tma_tiles_equal_the_emulation(tile, strides, cout):
    """The weight's boxes by bulk copies (zero-filled past the last output channel: 40 in tiles of
    16 and 32) with the activations gathered as in the plain tile: bit for bit the emulation, with
    the halved epilogue, split K and a stride too."""
    generator = torch.Generator().manual_seed(12)
    attrs = dict(_attrs((3, 3), strides, (1, 1, 1, 1), (1, 1)), input_inv_scale=17.0, residual_scale=0.05,
                 activation="Relu", qmin=-127, output_inv_scale=7.0)
    x = quantize(torch.randn(2, 64, 9, 8, generator=generator) * 2, 17.0)
    _assert_int8_conv_is_the_emulation(x.contiguous(memory_format=torch.channels_last), (3, 3), attrs, cout, tile,
                                       generator)


@NO_DESCRIPTORS
def test_weight_tma_variants_are_named_offered_and_refused_where_they_cannot_load():
    """Named ".weight-tma" last, parsed back; offered for multi-tap layers whose channels are whole K blocks
    (not for 1×1 layers, which have gemm_tma, nor for a tap-padded or gathered walk); a tile that
    would gather K is refused with a one-line reason rather than run."""
    for tile in WEIGHT_TMA_TILES + [TileConfig(64, 64, 64, 4, 4, epilogue_halves=True, residual_early=True,
                                               weight_tma=True)]:
        assert tile.name.endswith(".weight-tma") and TileConfig.parse(tile.name) == tile
    for bad in ("igemm.16x16x32.w1.s1.weight-tma.halves",
                "igemm.16x16x32.w1.s1.padded-taps.weight-tma"):  # the padded walk loads by threads
        with pytest.raises(TacticNameError):
            TileConfig.parse(bad)
    tiles = candidate_tiles(int8=True, effort=1)
    whole_blocks = [t for t in tiles if 64 % t.block_k == 0]  # not the deep-K tile's 128-channel K step
    assert 0 < len(whole_blocks) < len(tiles)
    assert igemm.weight_tma_tiles(tiles, 64, (64, 64, 3, 3), 1) == [replace(t, weight_tma=True) for t in whole_blocks]
    assert igemm.weight_tma_tiles(tiles, 64, (64, 64, 1, 1), 1) == []
    assert igemm.weight_tma_tiles(tiles, 48, (64, 48, 3, 3), 1) == []  # 48 channels: no whole 64-blocks
    padded = replace(tiles[0], padded_taps=True, block_k=32)
    assert igemm.weight_tma_tiles([padded], 48, (64, 48, 3, 3), 1) == []
    x = torch.randint(-127, 128, (1, 48, 5, 5), dtype=torch.int8).to(DEVICE)
    w = torch.randint(-127, 128, (16, 48, 3, 3), dtype=torch.int8).to(DEVICE)
    attrs = dict(_attrs((3, 3), (1, 1), (1, 1, 1, 1), (1, 1)))
    with pytest.raises(ValueError, match="conv_igemm: tile igemm.16x16x32.w1.s1.weight-tma copies the weight"):
        conv_igemm(x, pack_weight(w), None, _geometry(x, w, attrs), replace(SMALL_TILE, block_k=32, weight_tma=True),
                   dequant_scale=torch.ones(16, device=DEVICE), input_inv_scale=1.0)


# Few channels, a multiple of 8, with several taps a row: a filter row a K step. 16 and 8 channels
# (YOLO's 3×3 layers and their strided downsamples), asymmetric pads, dilation, a 3×5 filter; 24
# and 40 (the sample detector's, not powers of two: a tap's channels start mid-vector of 16), whose
# 72- and 120-column rows take the 128-wide K block, with a stride and dilation.
ROW_TAP_GEOMETRIES = [
    (16, (3, 3), (1, 1), (1, 1, 1, 1), (1, 1)),
    (8, (3, 3), (2, 2), (1, 1, 1, 1), (1, 1)),
    (16, (3, 5), (1, 2), (0, 2, 2, 1), (2, 1)),
    (16, (3, 3), (1, 1), (1, 2, 1, 2), (1, 2)),
    (24, (3, 3), (1, 1), (1, 1, 1, 1), (1, 1)),
    (24, (3, 3), (2, 1), (1, 2, 1, 2), (1, 2)),
    (40, (3, 3), (1, 1), (1, 1, 1, 1), (1, 1)),
    (40, (3, 3), (2, 2), (1, 1, 1, 1), (1, 1)),
]


@pytest.mark.parametrize("channels,kernel,strides,pads,dilations", ROW_TAP_GEOMETRIES)
@pytest.mark.parametrize("residual", [False, True])
def test_row_taps_int8_equals_the_emulation(channels, kernel, strides, pads, dilations, residual):
    """A filter row a K step: bit for bit the emulation, with INT8 and float inputs, INT8 output
    and a residual."""
    generator = torch.Generator().manual_seed(13)
    attrs = dict(_attrs(kernel, strides, pads, dilations), input_inv_scale=13.0, residual_scale=0.04,
                 activation="Relu", qmin=-127, output_inv_scale=6.0)
    block_k = max(32, 1 << (kernel[1] * channels - 1).bit_length())
    tile = TileConfig(16, 32, block_k, 1, 1, row_taps=True)
    for x in (torch.randint(-127, 128, (2, channels, 9, 8), dtype=torch.int8, generator=generator),
              torch.randn(2, channels, 9, 8, generator=generator) * 2):
        x = x.contiguous(memory_format=torch.channels_last)
        _assert_int8_conv_is_the_emulation(x, kernel, attrs, 24, tile, generator, with_residual=residual)


@pytest.mark.parametrize("cout", [16, 24])
@pytest.mark.parametrize("walk", ["row_taps", "padded_taps"])
def test_tiles_sixteen_columns_wide_equal_the_emulation(walk, cout):
    """The N block of 16 that layers of 16 outputs or fewer take (YOLOv8n's model.2 3×3 layers):
    one column tile, or a whole one and a half-empty one, bit for bit the emulation with a
    residual."""
    generator = torch.Generator().manual_seed(16)
    attrs = dict(_attrs((3, 3), (1, 1), (1, 1, 1, 1), (1, 1)), input_inv_scale=13.0, residual_scale=0.04,
                 activation="Relu", qmin=-127, output_inv_scale=6.0)
    channels = 16 if walk == "row_taps" else 24
    tile = TileConfig(16, 16, 64 if walk == "row_taps" else 32, 1, 1, **{walk: True})
    x = torch.randint(-127, 128, (2, channels, 9, 8), dtype=torch.int8, generator=generator)
    _assert_int8_conv_is_the_emulation(x.contiguous(memory_format=torch.channels_last), (3, 3), attrs, cout, tile,
                                       generator, with_residual=True)


@pytest.mark.parametrize("channels", [16, 24])
def test_row_taps_read_a_channel_slice_of_a_wider_buffer(channels):
    """A Split's half (16 of 32 channels of one channels-last buffer, or 24 of 48): pixels 32 (48)
    codes apart, each pixel's channels read as a run; equal to the emulation on the slice made
    contiguous."""
    generator = torch.Generator().manual_seed(14)
    attrs = dict(_attrs((3, 3), (1, 1), (1, 1, 1, 1), (1, 1)), input_inv_scale=9.0, residual_scale=0.04,
                 activation="SiLU", qmin=-127, output_inv_scale=5.0)
    wide = torch.randint(-127, 128, (2, 2 * channels, 7, 9), dtype=torch.int8, generator=generator)
    half = wide.contiguous(memory_format=torch.channels_last)[:, channels:]
    assert half.stride()[3] == 2 * channels
    tile = TileConfig(16, 32, max(32, 1 << (3 * channels - 1).bit_length()), 1, 1, row_taps=True)
    _assert_int8_conv_is_the_emulation(half, (3, 3), attrs, 16, tile, generator, with_residual=False)


@pytest.mark.parametrize("walk", ["padded_taps", "row_taps"])
def test_a_split_half_off_a_16_byte_boundary_equals_the_emulation(walk):
    """The second half of 40 channels of codes starts 40 bytes into each pixel, 8 past a 16-byte
    boundary: the kernel reads it from the boundary before (`aligned_start`), through both walks
    the builder offers for it, equal to the emulation on the slice."""
    generator = torch.Generator().manual_seed(16)
    attrs = dict(_attrs((3, 3), (1, 1), (1, 1, 1, 1), (1, 1)), input_inv_scale=9.0, residual_scale=0.04,
                 activation="SiLU", qmin=-127, output_inv_scale=5.0)
    wide = torch.randint(-127, 128, (2, 80, 7, 9), dtype=torch.int8, generator=generator)
    half = wide.contiguous(memory_format=torch.channels_last)[:, 40:]
    assert half.data_ptr() % 16 == 8
    tile = TileConfig(16, 32, 32, 1, 1, padded_taps=True) if walk == "padded_taps" else \
        TileConfig(16, 32, 128, 1, 1, row_taps=True)
    _assert_int8_conv_is_the_emulation(half, (3, 3), attrs, 24, tile, generator, with_residual=False)


@pytest.mark.parametrize("tile", [TileConfig(16, 32, 32, 1, 1, padded_taps=True),
                                  TileConfig(16, 32, 32, 1, 1, padded_taps=True, epilogue_halves=True,
                                             residual_early=True),
                                  TileConfig(16, 32, 32, 1, 1, split_k=2)],
                         ids=["padded-taps", "halves-residual-early", "split-k"])
def test_a_residual_that_is_a_split_half_off_a_boundary_equals_the_emulation(tile):
    """The bottleneck's shortcut: its second 3×3 adds the Split half its first one read (channels
    40–79 of codes in the C2f's 120-channel Concat buffer, 8 bytes past a 16-byte boundary). The
    kernel and the split-K epilogue kernel read the residual from the boundary before it
    (RES_SHIFT), its strides told as multiples of 8 (RES_ALIGN), which a wrong factor would shrink.
    Bit for bit the emulation."""
    assert tile.invalid() is None
    generator = torch.Generator().manual_seed(17)
    attrs = dict(_attrs((3, 3), (1, 1), (1, 1, 1, 1), (1, 1)), input_inv_scale=9.0, residual_scale=0.04,
                 activation="SiLU", qmin=-127, output_inv_scale=5.0, residual_after_activation=True)
    x = torch.randint(-127, 128, (2, 40, 7, 9), dtype=torch.int8, generator=generator)
    wide = torch.randint(-127, 128, (2, 120, 7, 9), dtype=torch.int8, generator=generator)
    residual = wide.contiguous(memory_format=torch.channels_last)[:, 40:80]
    assert residual.data_ptr() % 16 == 8 and residual.stride()[2:] == (9 * 120, 120)
    _assert_int8_conv_is_the_emulation(x.contiguous(memory_format=torch.channels_last), (3, 3), attrs, 40, tile,
                                       generator, residual=residual)


def test_aligned_start_shifts_only_a_start_off_a_16_byte_boundary():
    from sartor.kernels.conv.igemm import aligned_start, row_alignment
    codes = torch.zeros(2, 48, 5, 5, dtype=torch.int8).contiguous(memory_format=torch.channels_last)
    half = codes[:, 24:]
    base, shift = aligned_start(half)
    assert (half.data_ptr() % 16, base.data_ptr() % 16, shift) == (8, 0, 8)
    assert base.data_ptr() + shift == half.data_ptr() and base.stride() == half.stride() and base.shape == half.shape
    same = ConvGeometry((3, 3), (1, 1), (1, 1), (1, 1), (5, 5))
    assert (row_alignment(half, same), row_alignment(half, same, shift)) == (16, 8)  # pixels 48 apart, 8 in
    whole = codes[:, 16:]  # 16 bytes in: a boundary
    assert aligned_start(whole)[0] is whole and aligned_start(whole)[1] == 0
    halves = torch.zeros(1, 40, 3, 3, dtype=torch.float16).contiguous(memory_format=torch.channels_last)[:, 20:]
    assert aligned_start(halves)[1] == 4  # 40 bytes in: 4 halves past a boundary


@pytest.mark.parametrize("channels", [16, 24])
def test_row_taps_float_matches_torch(channels):
    generator = torch.Generator().manual_seed(15)
    attrs = _attrs((3, 3), (2, 2), (1, 1, 1, 1), (1, 1))
    dtype = torch.float16 if DEVICE == "cuda" else torch.float32
    x = torch.randn(2, channels, 9, 8, generator=generator)
    w = torch.randn(24, channels, 3, 3, generator=generator) / 12
    b = torch.randn(24, generator=generator)
    expected = torch.relu(_reference_conv(x, w, b, attrs))
    x, w, b = (t.to(DEVICE, dtype) for t in (x, w, b))
    x = x.contiguous(memory_format=torch.channels_last)
    tile = TileConfig(16, 32, max(16, 1 << (3 * channels - 1).bit_length()), 1, 1, row_taps=True)
    out = conv_igemm(x, pack_weight(w), b, _geometry(x, w, attrs), tile, activation="Relu")
    tolerance = 2e-2 if dtype == torch.float16 else 1e-4
    torch.testing.assert_close(out.float().cpu(), expected, rtol=tolerance, atol=tolerance)


def test_told_alignment_tells_only_what_triton_cannot_see():
    """A multiple of 8 (or 4, 2) shared by the outputs and their pixel stride; 1 where both are
    multiples of 16 (Triton proves those itself) or either is odd."""
    from sartor.kernels.pointwise.epilogue import told_alignment
    assert [told_alignment(cout, row) for cout, row in ((24, 24), (40, 40), (24, 48), (40, 120), (20, 20),
                                                          (24, 36), (16, 16), (32, 48), (64, 64), (3, 3),
                                                          (24, 27), (16, 24))] == [8, 8, 8, 8, 4, 4, 1, 1, 1, 1, 1, 8]


def test_row_tap_variants_are_offered_for_few_channels_only():
    """16 channels, 3×3: a 64-wide K block (the row's 48), N narrowed to the outputs' 16 (each also
    with taller rows), named and
    parsed; 32 channels: 128, and 24 and 40 (72 and 120 columns a row) too; 8-bit or not: 16
    channels at FP16 take 64 too. None for 64 or 48 channels (192 or 144 columns a row), 12 (not a
    multiple of 8), 1×1 or one tap a row; a tile that cannot run the layer is refused with its
    reason."""
    from sartor.kernels.conv.igemm import row_tap_tiles
    tiles = candidate_tiles(int8=True, effort=2)
    variants = row_tap_tiles(tiles, 16, (3, 3), 16, eight_bit=True)
    assert variants and all(v.row_taps and v.block_k == 64 and v.block_n == 16 for v in variants)
    assert {v.block_n for v in row_tap_tiles(tiles, 16, (3, 3), 24, eight_bit=True)} == {32}
    # each narrowed tile also with the rows it lost in columns, up to NARROW_MAX_BLOCK_M: 64×64 → 64×16
    # and 256×16; 128×128 → 128×16 and 256×16
    shapes = {(v.block_m, v.block_n, v.warps) for v in variants}
    assert {(64, 16, 4), (256, 16, 4), (128, 16, 8), (256, 16, 8)} <= shapes
    assert max(v.block_m for v in variants) == NARROW_MAX_BLOCK_M
    assert all(v.block_m <= 128 for v in row_tap_tiles(tiles, 32, (3, 3), 256, eight_bit=True))  # not narrowed
    assert all(TileConfig.parse(v.name) == v and v.name.endswith(".row-taps") for v in variants)
    assert len(set(variants)) == len(variants)
    for channels in (32, 24, 40):
        assert {v.block_k for v in row_tap_tiles(tiles, channels, (3, 3), 64, eight_bit=True)} == {128}, channels
    assert {v.block_k for v in row_tap_tiles(candidate_tiles(int8=False, effort=2), 16, (3, 3), 32,
                                             eight_bit=False)} == {64}
    for channels, kernel in ((64, (3, 3)), (48, (3, 3)), (12, (3, 3)), (16, (1, 1)), (16, (3, 1))):
        assert row_tap_tiles(tiles, channels, kernel, 64, eight_bit=True) == [], (channels, kernel)
    for bad in ("igemm.16x32x64.w1.s1.split2.row-taps", "igemm.16x32x64.w1.s1.padded-taps.row-taps"):
        with pytest.raises(TacticNameError):
            TileConfig.parse(bad)
    attrs = _attrs((3, 3), (1, 1), (1, 1, 1, 1), (1, 1))
    for channels in (12, 48):  # not a multiple of 8; a row of 144 columns in a K block of 128
        x = torch.randint(-127, 128, (1, channels, 5, 5), dtype=torch.int8).to(DEVICE)
        w = torch.randint(-127, 128, (16, channels, 3, 3), dtype=torch.int8).to(DEVICE)
        with pytest.raises(ValueError, match=f"walks K a filter row at a time.*{channels} channels, 3 taps a row"):
            conv_igemm(x, pack_weight(w), None, _geometry(x, w, attrs),
                       TileConfig(16, 32, 128, 1, 1, row_taps=True), dequant_scale=torch.ones(16, device=DEVICE),
                       input_inv_scale=1.0)
