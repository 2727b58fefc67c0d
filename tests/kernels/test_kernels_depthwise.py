"""The channels-last depthwise convolution kernel and its FusedConv tactic: against F.conv2d with
groups = C plus the torch epilogue, through Triton's interpreter on CPU (and natively on a GPU);
and where the tactic is offered."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

# conftest.py switches Triton to its interpreter when there is no GPU.
triton = pytest.importorskip("triton")

from sartor.errors import TacticNameError  # noqa: E402
from sartor.kernels.conv.depthwise import (  # noqa: E402
    DEPTHWISE_TILES, DEPTHWISE_WORDS_TILES, NAMED_DEPTHWISE_TILES, ORIGINAL_DEPTHWISE_TILE, DepthwiseTile,
    depthwise_conv_nhwc, depthwise_tile_for, depthwise_tiles, pack_depthwise_weight)
from sartor.kernels.registry import parse_tactic  # noqa: E402
from sartor.kernels.pointwise.epilogue import code_words  # noqa: E402
from sartor.ops import default_registry  # noqa: E402
from sartor.ops.conv import (  # noqa: E402
    _conv_depthwise, applicable_conv_tactics, conv_weight_for_tactic, depthwise_geometry, fused_conv,
    fused_conv_into)
from sartor.ops.elementwise import FUSABLE_ACTIVATIONS, apply_activation  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ACTIVATION_ARGS = {"Clip": (-0.5, 0.7), "HardSigmoid": (0.2, 0.5), "LeakyRelu": (0.1, None)}

# (kernel, strides, pads (top, left, bottom, right), dilations)
GEOMETRIES = [
    ((3, 3), (1, 1), (1, 1, 1, 1), (1, 1)),
    ((3, 3), (2, 2), (1, 1, 1, 1), (1, 1)),
    ((5, 5), (1, 1), (2, 2, 2, 2), (1, 1)),
    ((5, 5), (2, 2), (2, 2, 2, 2), (1, 1)),
    ((3, 3), (1, 1), (2, 2, 2, 2), (2, 2)),
    ((3, 5), (2, 1), (0, 2, 1, 1), (1, 2)),  # asymmetric pads, as SAME_UPPER with stride 2 gives
]


def _attrs(kernel, strides, pads, dilations, channels, **epilogue) -> dict:
    return dict({"kernel_shape": list(kernel), "strides": list(strides), "pads": list(pads),
                 "dilations": list(dilations), "group": channels}, **epilogue)


def _reference(x, w, b, residual, attrs):
    """F.conv2d(groups=C) on an explicitly padded copy, then the FusedConv epilogue, in float32."""
    top, left, bottom, right = attrs["pads"]
    y = F.conv2d(F.pad(x.float(), [left, right, top, bottom]), w.float(), None if b is None else b.float(),
                 attrs["strides"], 0, attrs["dilations"], groups=x.shape[1])
    after = attrs.get("residual_after_activation", False)
    if residual is not None and not after:
        y = y + residual.float()
    if attrs.get("activation"):
        y = apply_activation(y, attrs["activation"], attrs.get("activation_alpha"), attrs.get("activation_beta"))
    if residual is not None and after:
        y = y + residual.float()
    return y


def _inputs(channels, kernel, attrs, dtype, generator, residual=False, size=(9, 8)):
    x = torch.randn(2, channels, *size, generator=generator)
    w = torch.randn(channels, 1, *kernel, generator=generator) / (kernel[0] * kernel[1]) ** 0.5
    b = torch.randn(channels, generator=generator) * 0.1
    out_shape = _reference(x, w, None, None, dict(attrs, activation=None)).shape
    r = torch.randn(out_shape, generator=generator) if residual else None
    x, w, b = (t.to(DEVICE, dtype) for t in (x, w, b))
    r = r.to(DEVICE, dtype) if r is not None else None
    return x.contiguous(memory_format=torch.channels_last), w, b, r


def _tolerance(dtype):
    return {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 5e-2}[dtype]


def _check(out, x, w, b, residual, attrs):
    expected = _reference(x, w, b, residual, attrs)
    assert out.dtype == x.dtype and out.shape == expected.shape
    tolerance = _tolerance(x.dtype)
    torch.testing.assert_close(out.float().cpu(), expected.cpu(), rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("kernel,strides,pads,dilations", GEOMETRIES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_geometries_match_grouped_conv2d(kernel, strides, pads, dilations, dtype):
    generator = torch.Generator().manual_seed(1)
    channels = 20  # less than one channel block: masked channel lanes
    attrs = _attrs(kernel, strides, pads, dilations, channels, activation="SiLU")
    x, w, b, _ = _inputs(channels, kernel, attrs, dtype, generator)
    out = _conv_depthwise(x, conv_weight_for_tactic(w, "triton_depthwise"), b, None, attrs, require_cuda=False)
    assert out is not None and out.is_contiguous(memory_format=torch.channels_last)
    _check(out, x, w, b, None, attrs)


@pytest.mark.parametrize("activation", FUSABLE_ACTIVATIONS + (None,))
@pytest.mark.parametrize("after", [False, True])
def test_every_activation_with_the_residual_before_or_after(activation, after):
    generator = torch.Generator().manual_seed(2)
    alpha, beta = ACTIVATION_ARGS.get(activation, (None, None))
    attrs = _attrs((3, 3), (1, 1), (1, 1, 1, 1), (1, 1), 16, activation=activation, activation_alpha=alpha,
                   activation_beta=beta, residual_after_activation=after)
    x, w, b, residual = _inputs(16, (3, 3), attrs, torch.float32, generator, residual=True, size=(5, 6))
    out = _conv_depthwise(x, pack_depthwise_weight(w), b, residual, attrs, require_cuda=False)
    _check(out, x, w, b, residual, attrs)


def test_fp16_residual_more_channels_than_one_block_and_an_unpacked_weight():
    """Two channel blocks (the second ragged), an NCHW-ordered weight (read through its strides),
    no bias, a residual after HardSwish."""
    generator = torch.Generator().manual_seed(3)
    attrs = _attrs((5, 5), (2, 2), (2, 2, 2, 2), (1, 1), 72, activation="HardSwish", residual_after_activation=True)
    x, w, _, residual = _inputs(72, (5, 5), attrs, torch.float16, generator, residual=True, size=(7, 7))
    assert w.is_contiguous()
    out = _conv_depthwise(x, w, None, residual, attrs, require_cuda=False)
    _check(out, x, w, None, residual, attrs)


def test_channel_slice_input_and_output():
    """A Split half in, a Concat's slice out (YOLO's C2PSA / DWConv feeding a Concat): both pixel
    strides wider than the channels; the buffer's other channels stay untouched."""
    generator = torch.Generator().manual_seed(4)
    dtype = torch.float16
    attrs = _attrs((3, 3), (1, 1), (1, 1, 1, 1), (1, 1), 24, activation="SiLU")
    source = torch.randn(2, 40, 6, 7, generator=generator).to(DEVICE, dtype).contiguous(
        memory_format=torch.channels_last)
    x = source[:, 8:32]
    residual = source[:, 16:40]  # a sliced residual too
    w = (torch.randn(24, 1, 3, 3, generator=generator) / 3).to(DEVICE, dtype)
    b = (torch.randn(24, generator=generator) * 0.1).to(DEVICE, dtype)
    buffer = torch.full((2, 56, 6, 7), 7.0, dtype=dtype, device=DEVICE).contiguous(memory_format=torch.channels_last)
    out = buffer.narrow(1, 20, 24)
    written = _conv_depthwise(x, pack_depthwise_weight(w), b, residual, attrs, out=out, require_cuda=False)
    assert written.data_ptr() == out.data_ptr()
    _check(buffer[:, 20:44], x, w, b, residual, attrs)
    assert (buffer[:, :20] == 7).all() and (buffer[:, 44:] == 7).all()


@pytest.mark.parametrize("tile", DEPTHWISE_TILES, ids=lambda tile: tile.name)
def test_every_block_tile_equals_the_original_bit_for_bit(tile):
    """Other elements a program and warps change which program sums an output, not the order of its taps:
    two images of 64 FP16 channels at 11 × 13 (ragged pixel blocks), SiLU after a residual."""
    generator = torch.Generator().manual_seed(11)
    attrs = _attrs((3, 3), (1, 1), (1, 1, 1, 1), (1, 1), 64, activation="SiLU")
    x, w, b, residual = _inputs(64, (3, 3), attrs, torch.float16, generator, residual=True, size=(11, 13))
    packed = pack_depthwise_weight(w)
    original = _conv_depthwise(x, packed, b, residual, attrs, require_cuda=False)
    out = _conv_depthwise(x, packed, b, residual, attrs, require_cuda=False, tile=tile)
    assert torch.equal(out, original)
    _check(out, x, w, b, residual, attrs)


def test_block_tiles_are_named_parsed_and_offered_by_effort():
    for tile in DEPTHWISE_TILES + DEPTHWISE_WORDS_TILES + (ORIGINAL_DEPTHWISE_TILE,):
        assert parse_tactic(tile.name) == tile and depthwise_tile_for(tile.name) == tile
    assert DEPTHWISE_TILES[1].name == "depthwise.elements2048.w8"
    assert DEPTHWISE_WORDS_TILES[0].name == "depthwise.elements2048.channels128.w8.words"
    assert depthwise_tile_for("triton_depthwise") == ORIGINAL_DEPTHWISE_TILE == DepthwiseTile(4096, 4)
    assert depthwise_tile_for("triton_depthwise_int8_words") == DepthwiseTile(4096, 4, 128, words=True)
    assert set(NAMED_DEPTHWISE_TILES) == {"triton_depthwise", "triton_depthwise_int8", "triton_depthwise_int8_lines",
                                          "triton_depthwise_int8_words"}
    assert depthwise_tile_for("triton_epilogue") is None and depthwise_tile_for(None) is None
    for bad in ("depthwise.elements3000.w8", "depthwise.elements1024.channels128.w8"):  # 8 pixels of 128 channels
        with pytest.raises(TacticNameError):
            DepthwiseTile.parse(bad)
    assert len(depthwise_tiles(1)) < len(depthwise_tiles(2)) < len(depthwise_tiles(3)) == len(DEPTHWISE_TILES)
    assert len(depthwise_tiles(1, words=True)) < len(depthwise_tiles(2, words=True)) == len(DEPTHWISE_WORDS_TILES)
    w = torch.randn(12, 1, 3, 3)
    assert torch.equal(conv_weight_for_tactic(w, DEPTHWISE_TILES[0].name), pack_depthwise_weight(w))
    assert conv_weight_for_tactic(w, DEPTHWISE_TILES[0].name).permute(2, 3, 0, 1).is_contiguous()


@pytest.mark.skipif(DEVICE != "cuda", reason="the tactic runs the kernel on CUDA tensors only")
@pytest.mark.parametrize("tactic", ["triton_depthwise", DEPTHWISE_TILES[1].name])
def test_the_tactic_runs_through_fused_conv_and_into_a_slice(tactic):
    generator = torch.Generator().manual_seed(5)
    attrs = _attrs((3, 3), (2, 2), (1, 1, 1, 1), (1, 1), 32, activation="Relu", tactic=tactic)
    x, w, b, _ = _inputs(32, (3, 3), attrs, torch.float16, generator, size=(12, 12))
    stored = conv_weight_for_tactic(w, tactic)
    _check(fused_conv([x, stored, b], attrs), x, w, b, None, attrs)
    buffer = torch.zeros(2, 48, 6, 6, dtype=x.dtype, device=DEVICE).contiguous(memory_format=torch.channels_last)
    assert fused_conv_into([x, stored, b], attrs, buffer[:, 16:]) is not None
    _check(buffer[:, 16:], x, w, b, None, attrs)


def test_packed_weight_keeps_its_shape_and_orders_taps_outermost():
    w = torch.randn(12, 1, 5, 3)
    packed = conv_weight_for_tactic(w, "triton_depthwise")
    assert packed.shape == w.shape and torch.equal(packed, w)
    assert packed.permute(2, 3, 0, 1).is_contiguous()
    dense = torch.randn(8, 4, 3, 3)
    assert conv_weight_for_tactic(dense, "triton_depthwise") is dense  # not a depthwise weight


def test_a_float_layer_never_runs_a_words_tile():
    """Words are INT8 codes: the FusedConv runs torch's conv for such a tactic, the kernel refuses it."""
    generator = torch.Generator().manual_seed(12)
    attrs = _attrs((3, 3), (1, 1), (1, 1, 1, 1), (1, 1), 16, activation="Relu")
    x, w, b, _ = _inputs(16, (3, 3), attrs, torch.float32, generator, size=(5, 6))
    words = DEPTHWISE_WORDS_TILES[0]
    out = torch.empty(2, 16, 5, 6, device=DEVICE).contiguous(memory_format=torch.channels_last)
    assert fused_conv_into([x, pack_depthwise_weight(w), b], dict(attrs, tactic=words.name), out) is None
    with pytest.raises(ValueError, match="reads INT8 codes as words; a float layer has none"):
        depthwise_conv_nhwc(x, pack_depthwise_weight(w), b, depthwise_geometry(x, w, attrs, require_cuda=False),
                            tile=words)


def test_the_tactic_falls_back_to_torch_where_the_kernel_does_not_apply():
    """On the CPU (or for a dense conv) the "triton_depthwise" attribute runs torch's conv."""
    generator = torch.Generator().manual_seed(6)
    x = torch.randn(1, 8, 6, 6, generator=generator).contiguous(memory_format=torch.channels_last)
    w = torch.randn(8, 1, 3, 3, generator=generator)
    attrs = _attrs((3, 3), (1, 1), (1, 1, 1, 1), (1, 1), 8, activation="Relu")
    expected = fused_conv([x, w], dict(attrs, tactic="torch"))
    torch.testing.assert_close(fused_conv([x, pack_depthwise_weight(w)], dict(attrs, tactic="triton_depthwise")),
                               expected)
    assert fused_conv_into([x, w], dict(attrs, tactic="triton_depthwise"), torch.empty_like(expected)) is None


def test_which_convolutions_the_kernel_takes():
    x = torch.zeros(1, 16, 8, 8).contiguous(memory_format=torch.channels_last)
    depthwise = _attrs((3, 3), (1, 1), (1, 1, 1, 1), (1, 1), 16)
    w = torch.zeros(16, 1, 3, 3)
    assert depthwise_geometry(x, w, depthwise, require_cuda=False) is not None
    assert depthwise_geometry(x, w, depthwise) is None  # a CPU tensor outside tests
    assert depthwise_geometry(x.half(), w.half(), depthwise, require_cuda=False) is not None
    # a dense conv, a grouped one (4 channels a group), a channel multiplier of 2
    assert depthwise_geometry(x, torch.zeros(16, 16, 3, 3), dict(depthwise, group=1), require_cuda=False) is None
    assert depthwise_geometry(x, torch.zeros(16, 4, 3, 3), dict(depthwise, group=4), require_cuda=False) is None
    assert depthwise_geometry(x, torch.zeros(32, 1, 3, 3), depthwise, require_cuda=False) is None
    # NCHW input, integer input, 1-D conv, an unknown activation
    assert depthwise_geometry(x.contiguous(), w, depthwise, require_cuda=False) is None
    assert depthwise_geometry(x.to(torch.int8), w, depthwise, require_cuda=False) is None
    assert depthwise_geometry(torch.zeros(1, 16, 8), torch.zeros(16, 1, 3), depthwise, require_cuda=False) is None
    assert depthwise_geometry(x, w, dict(depthwise, activation="Elu"), require_cuda=False) is None


def test_cpu_layers_never_list_the_tactic():
    x = torch.zeros(1, 16, 8, 8).contiguous(memory_format=torch.channels_last)
    attrs = _attrs((3, 3), (1, 1), (1, 1, 1, 1), (1, 1), 16)
    assert applicable_conv_tactics([x, torch.zeros(16, 1, 3, 3)], attrs) == ["torch", "channels_last"]
    assert default_registry()["FusedConv"].tactics([x, torch.zeros(16, 1, 3, 3)], attrs, 2) == ["torch", "channels_last"]


@pytest.mark.skipif(DEVICE != "cuda", reason="the tactic is listed for CUDA tensors only")
def test_cuda_lists_the_tactic_for_depthwise_convs_only():
    x = torch.zeros(1, 16, 8, 8, device="cuda", dtype=torch.float16).contiguous(memory_format=torch.channels_last)
    attrs = _attrs((3, 3), (1, 1), (1, 1, 1, 1), (1, 1), 16)
    w = torch.zeros(16, 1, 3, 3, device="cuda", dtype=torch.float16)
    assert "triton_depthwise" in applicable_conv_tactics([x, w], attrs)
    assert set(t.name for t in depthwise_tiles(2)) < set(applicable_conv_tactics([x, w], attrs, effort=2))
    assert "triton_depthwise" in applicable_conv_tactics([x[:, :8], w[:8]], dict(attrs, group=8))  # a Split half
    assert "triton_depthwise" not in applicable_conv_tactics([x, torch.zeros(16, 16, 3, 3, device="cuda", dtype=torch.float16)],
                                                             dict(attrs, group=1))
    assert "triton_depthwise" not in applicable_conv_tactics([x, torch.zeros(32, 1, 3, 3, device="cuda", dtype=torch.float16)], attrs)


def test_bfloat16_keeps_its_dtype():
    generator = torch.Generator().manual_seed(7)
    attrs = _attrs((3, 3), (2, 2), (0, 0, 1, 1), (1, 1), 16, activation="Gelu")
    x, w, b, residual = _inputs(16, (3, 3), attrs, torch.bfloat16, generator, residual=True, size=(6, 5))
    out = _conv_depthwise(x, pack_depthwise_weight(w), b, residual, attrs, require_cuda=False)
    _check(out, x, w, b, residual, attrs)


def test_wrong_outputs_and_inputs_are_refused():
    x = torch.zeros(1, 8, 5, 5).contiguous(memory_format=torch.channels_last).to(DEVICE)
    w = torch.zeros(8, 1, 3, 3, device=DEVICE)
    geometry = depthwise_geometry(x, w, _attrs((3, 3), (1, 1), (1, 1, 1, 1), (1, 1), 8), require_cuda=False)
    wide = torch.empty(1, 16, 5, 5, device=DEVICE).contiguous(memory_format=torch.channels_last)
    with pytest.raises(ValueError, match="cannot hold"):
        depthwise_conv_nhwc(x, w, None, geometry, out=wide.narrow(1, 0, 7))
    with pytest.raises(ValueError, match="cannot hold"):
        depthwise_conv_nhwc(x, w, None, geometry, out=wide.narrow(1, 0, 8).half())
    with pytest.raises(ValueError, match="residual"):
        depthwise_conv_nhwc(x, w, None, geometry, residual=torch.zeros(1, 8, 4, 4, device=DEVICE))
    with pytest.raises(ValueError, match="not a channels-last depthwise"):
        depthwise_conv_nhwc(x.contiguous(), w, None, geometry)


# ---- INT8 depthwise (a QConv of group = C): the emulation's numbers from the kernel ----------------

def _int8_layer(channels, kernel, strides, pads, dilations, generator, *, residual=False, int8_output=True,
                activation="Relu"):
    """A depthwise QConv's inputs (codes, int8 weight, int32 bias, residual codes, scales) and attrs."""
    from sartor.ops.quantized import qconv
    attrs = _attrs(kernel, strides, pads, dilations, channels, activation=activation, input_inv_scale=11.0,
                   qmin=-127, residual_scale=0.05)
    if int8_output:
        attrs["output_inv_scale"] = 7.0
    x = torch.randint(-127, 128, (2, channels, 9, 8), dtype=torch.int8, generator=generator)
    wq = torch.randint(-127, 128, (channels, 1, *kernel), dtype=torch.int8, generator=generator)
    bias = torch.randint(-3000, 3000, (channels,), dtype=torch.int32, generator=generator)
    scale = torch.rand(channels, generator=generator) * 1e-3
    out_hw = [(s + lo + hi - d * (k - 1) - 1) // st + 1 for s, lo, hi, d, k, st in
              zip((9, 8), pads[:2], pads[2:], dilations, kernel, strides)]
    res = (torch.randint(-127, 128, (2, channels, *out_hw), dtype=torch.int8, generator=generator)
           if residual else None)
    return qconv, [x, wq, bias, res, scale], attrs


@pytest.mark.parametrize("kernel,strides,pads,dilations", GEOMETRIES)
@pytest.mark.parametrize("residual,int8_output", [(False, True), (True, True), (False, False)])
@pytest.mark.parametrize("tactic", ["triton_depthwise_int8", "triton_depthwise_int8_lines",
                                    "triton_depthwise_int8_words", DEPTHWISE_WORDS_TILES[0].name,
                                    DEPTHWISE_TILES[1].name])
def test_int8_depthwise_equals_the_emulation(kernel, strides, pads, dilations, residual, int8_output, tactic):
    """int32 sums of int8 taps, then the INT8 epilogue: bit for bit the emulation's output, INT8
    codes or float32, with a residual of codes, over every geometry, with 80 channels (two channel
    blocks of 64, the second ragged; one ragged block of 128 for the lines and words tactics, the
    words' lanes summed apart); float32 and float16 inputs are quantized on load as the emulation
    quantizes them, their codes summed in float32 (the words tactic then reads code by code). The
    other blocks (DepthwiseTile: words, and the float layers' blocks run on codes) too."""
    generator = torch.Generator().manual_seed(21)
    qconv, inputs, attrs = _int8_layer(80, kernel, strides, pads, dilations, generator, residual=residual,
                                       int8_output=int8_output)
    floats = torch.randn(2, 80, 9, 8, generator=generator) * 4
    for x in (inputs[0], floats, floats.half()):
        layer = [x.contiguous(memory_format=torch.channels_last)] + inputs[1:]
        expected = qconv(layer, attrs)
        on_device = [t.to(DEVICE) if t is not None else None for t in layer]
        on_device[1] = pack_depthwise_weight(on_device[1])
        out = qconv(on_device, dict(attrs, tactic=tactic))
        assert out.dtype == (torch.int8 if int8_output else torch.float32)
        assert out.is_contiguous(memory_format=torch.channels_last)
        assert torch.equal(out.cpu(), expected), (kernel, strides, x.dtype)


def test_int8_depthwise_sums_a_float_inputs_codes_in_int32_past_the_float32_bound(monkeypatch):
    """Past FLOAT_SUM_TAPS taps a float input's codes are converted and summed in int32, as before float32
    sums: the emulation's codes bit for bit too (the bound lowered here, so a 3×3 filter goes past it)."""
    from sartor.kernels.conv import depthwise
    generator = torch.Generator().manual_seed(24)
    qconv, inputs, attrs = _int8_layer(80, (3, 3), (1, 1), (1, 1, 1, 1), (1, 1), generator)
    layer = [(torch.randn(2, 80, 9, 8, generator=generator) * 4).contiguous(memory_format=torch.channels_last)]
    expected = qconv(layer + inputs[1:], attrs)
    on_device = [t.to(DEVICE) if t is not None else None for t in layer + inputs[1:]]
    on_device[1] = pack_depthwise_weight(on_device[1])
    launched = []
    launch = depthwise._launch
    monkeypatch.setattr(depthwise, "_launch", lambda *args, **kwargs: launched.append(args[9]["FLOAT_SUMS"])
                        or launch(*args, **kwargs))
    monkeypatch.setattr(depthwise, "FLOAT_SUM_TAPS", 8)
    out = qconv(on_device, dict(attrs, tactic="triton_depthwise_int8"))
    assert launched == [False] and torch.equal(out.cpu(), expected)


def test_int8_depthwise_silu_is_within_one_code_of_the_emulation():
    """YOLO11's depthwise layers end in SiLU, whose exponential may differ from torch's in its last
    ulp and so move a value across a rounding boundary: held to one code step, as the implicit
    GEMM's SiLU is."""
    from sartor.kernels.conv.depthwise import TRITON_DEPTHWISE_INT8
    generator = torch.Generator().manual_seed(23)
    qconv, inputs, attrs = _int8_layer(48, (3, 3), (1, 1), (1, 1, 1, 1), (1, 1), generator, activation="SiLU")
    layer = [inputs[0].contiguous(memory_format=torch.channels_last)] + inputs[1:]
    expected = qconv(layer, attrs)
    on_device = [t.to(DEVICE) if t is not None else None for t in layer]
    on_device[1] = pack_depthwise_weight(on_device[1])
    out = qconv(on_device, dict(attrs, tactic=TRITON_DEPTHWISE_INT8)).cpu()
    assert int((out.int() - expected.int()).abs().max()) <= 1
    assert (out == expected).float().mean() > 0.99


@pytest.mark.parametrize("tactic", ["triton_depthwise_int8", "triton_depthwise_int8_words"])
def test_int8_depthwise_reads_and_writes_channel_slices(tactic):
    """A Split half in, a Concat's slice out (`write_into`): the same codes as the emulation."""
    from sartor.ops.quantized import qconv_into
    generator = torch.Generator().manual_seed(22)
    qconv, inputs, attrs = _int8_layer(16, (3, 3), (1, 1), (1, 1, 1, 1), (1, 1), generator)
    wide = torch.randint(-127, 128, (2, 32, 9, 8), dtype=torch.int8, generator=generator)
    wide = wide.contiguous(memory_format=torch.channels_last)
    expected = qconv([wide[:, 16:].contiguous()] + inputs[1:], attrs)
    buffer = torch.zeros(2, 48, 9, 8, dtype=torch.int8, device=DEVICE).contiguous(memory_format=torch.channels_last)
    half = wide.to(DEVICE)[:, 16:]  # sliced on the device: a slice moved alone would arrive dense
    assert half.stride()[3] == 32
    layer = [half, pack_depthwise_weight(inputs[1].to(DEVICE)), inputs[2].to(DEVICE), None,
             inputs[4].to(DEVICE)]
    written = qconv_into(layer, dict(attrs, tactic=tactic), buffer[:, 8:24])
    assert written is not None and torch.equal(buffer[:, 8:24].cpu(), expected)
    assert not buffer[:, :8].any() and not buffer[:, 24:].any()


def test_int8_depthwise_tactic_is_offered_for_cuda_depthwise_qconvs_only():
    """Offered (beside the emulation, with its word variant where the codes are whole words of four
    channels: the implicit GEMM runs no grouped layer) for a depthwise QConv on CUDA; never on the
    CPU, for a dense or a grouped-but-not-depthwise layer, or FP8."""
    from sartor.kernels.conv.depthwise import TRITON_DEPTHWISE_INT8, TRITON_DEPTHWISE_INT8_WORDS
    from sartor.ops.quantized import depthwise_int8_geometry
    qconv_tactics = default_registry()["QConv"].tactics
    x = torch.zeros(1, 16, 8, 8, dtype=torch.int8).contiguous(memory_format=torch.channels_last)
    wq = torch.zeros(16, 1, 3, 3, dtype=torch.int8)
    attrs = _attrs((3, 3), (1, 1), (1, 1, 1, 1), (1, 1), 16, input_inv_scale=1.0, output_inv_scale=1.0)
    scale, bias = torch.ones(16), torch.zeros(16, dtype=torch.int32)
    assert qconv_tactics([x, wq, bias, None, scale], attrs, 2) == ["torch"]
    assert depthwise_int8_geometry(x, wq, attrs, require_cuda=False) is not None
    assert depthwise_int8_geometry(x, wq, dict(attrs, qformat="fp8e4m3"), require_cuda=False) is None
    assert depthwise_int8_geometry(x, torch.zeros(16, 16, 3, 3, dtype=torch.int8), dict(attrs, group=1),
                                   require_cuda=False) is None
    assert depthwise_int8_geometry(x, torch.zeros(16, 2, 3, 3, dtype=torch.int8), dict(attrs, group=8),
                                   require_cuda=False) is None
    # 15 channels: a depthwise layer whose codes are not whole words of four
    odd_layer = [torch.zeros(1, 15, 8, 8, dtype=torch.int8).contiguous(memory_format=torch.channels_last),
                 wq[:15], bias[:15], None, scale[:15]]
    assert depthwise_int8_geometry(odd_layer[0], odd_layer[1], dict(attrs, group=15), require_cuda=False) is not None
    assert code_words(odd_layer[0]) is None and code_words(x) is not None
    # The executor stores the weight in the tactic's layout once, at load: [KH, KW, C] in memory.
    from sartor.ops.quantized import qlayer_weight_for_tactic
    codes = torch.randint(-127, 128, (16, 1, 3, 3), dtype=torch.int8)
    stored = qlayer_weight_for_tactic(codes, TRITON_DEPTHWISE_INT8)
    assert torch.equal(stored, codes) and stored.stride() == pack_depthwise_weight(codes).stride() != codes.stride()
    if DEVICE == "cuda":
        # 16 channels: one block, so no line tactic; INT8 codes in whole words, so the word tactic too
        on = [t.cuda() if t is not None else None for t in (x, wq, bias, None, scale)]
        assert qconv_tactics(on, attrs, 2) == ["torch", TRITON_DEPTHWISE_INT8, *(t.name for t in depthwise_tiles(2)),
                                               TRITON_DEPTHWISE_INT8_WORDS,
                                               *(t.name for t in depthwise_tiles(2, words=True))]
        odd = [t.cuda() if t is not None else None for t in odd_layer]
        assert qconv_tactics(odd, dict(attrs, group=15), 2) == ["torch", TRITON_DEPTHWISE_INT8,
                                                                *(t.name for t in depthwise_tiles(2))]


@pytest.mark.skipif(DEVICE != "cuda", reason="the depthwise tactics are listed for CUDA tensors")
def test_the_lines_tactic_is_offered_beside_the_first_above_64_channels_only():
    """The 128-channel blocks are timed only where they differ from the 64-channel ones; the words
    tactic wherever the codes come in words of four channels."""
    from sartor.kernels.conv.depthwise import (TRITON_DEPTHWISE_INT8, TRITON_DEPTHWISE_INT8_LINES,
                                               TRITON_DEPTHWISE_INT8_WORDS)
    qconv_tactics = default_registry()["QConv"].tactics
    blocks = [t.name for t in depthwise_tiles(2)]
    words = [TRITON_DEPTHWISE_INT8_WORDS] + [t.name for t in depthwise_tiles(2, words=True)]
    both = [TRITON_DEPTHWISE_INT8, TRITON_DEPTHWISE_INT8_LINES, *blocks, *words]
    for channels, offered in ((64, [TRITON_DEPTHWISE_INT8, *blocks, *words]), (128, both),
                              (18, [TRITON_DEPTHWISE_INT8, *blocks])):
        x = torch.zeros(1, channels, 8, 8, dtype=torch.int8, device="cuda")
        x = x.contiguous(memory_format=torch.channels_last)
        layer = [x, torch.zeros(channels, 1, 3, 3, dtype=torch.int8, device="cuda"),
                 torch.zeros(channels, dtype=torch.int32, device="cuda"), None, torch.ones(channels, device="cuda")]
        attrs = _attrs((3, 3), (1, 1), (1, 1, 1, 1), (1, 1), channels, input_inv_scale=1.0, output_inv_scale=1.0)
        assert qconv_tactics(layer, attrs, 2) == ["torch", *offered]


def test_the_lines_tactic_takes_128_channel_blocks():
    from sartor.kernels.conv.depthwise import (LINE_BLOCK_C, NAMED_DEPTHWISE_TILES, TRITON_DEPTHWISE_INT8_LINES,
                                               _block_sizes)
    assert NAMED_DEPTHWISE_TILES[TRITON_DEPTHWISE_INT8_LINES].max_block_c == LINE_BLOCK_C == 128
    assert _block_sizes(32 * 20 * 20, 128, 264, LINE_BLOCK_C) == (32, 128)  # YOLO11n's attention pe
    assert _block_sizes(32 * 20 * 20, 128, 264) == (64, 64)


def test_the_words_tactic_reads_words_where_it_can_and_codes_where_it_cannot(monkeypatch):
    """Codes in words of four channels take the dp4a kernel; 18 channels (no whole words) or a slice
    starting two codes into a pixel take the code-by-code kernel, to the same result."""
    from sartor.kernels.conv import depthwise
    launched, launch_words, launch = [], depthwise._launch_words, depthwise._launch
    monkeypatch.setattr(depthwise, "_launch_words", lambda *a, **k: (launched.append("words"), launch_words(*a, **k)))
    monkeypatch.setattr(depthwise, "_launch", lambda *a, **k: (launched.append("codes"), launch(*a, **k)))
    generator = torch.Generator().manual_seed(24)
    for channels, start, way in ((16, 0, "words"), (18, 0, "codes"), (16, 2, "codes")):
        qconv, inputs, attrs = _int8_layer(channels, (3, 3), (1, 1), (1, 1, 1, 1), (1, 1), generator)
        wide = torch.randint(-127, 128, (2, channels + start, 9, 8), dtype=torch.int8, generator=generator)
        wide = wide.contiguous(memory_format=torch.channels_last)
        expected = qconv([wide[:, start:].contiguous()] + inputs[1:], attrs)
        layer = [wide.to(DEVICE)[:, start:], pack_depthwise_weight(inputs[1].to(DEVICE)), inputs[2].to(DEVICE), None,
                 inputs[4].to(DEVICE)]
        launched.clear()
        out = qconv(layer, dict(attrs, tactic="triton_depthwise_int8_words"))
        assert launched == [way] and torch.equal(out.cpu(), expected), (channels, start)


def test_int8_depthwise_refuses_what_it_cannot_run():
    """One line each: float weights or a dense weight, an NCHW input, a residual of another shape,
    an output slice that cannot hold the result."""
    from sartor.kernels.conv.depthwise import depthwise_qconv_nhwc
    x = torch.zeros(1, 8, 5, 5, dtype=torch.int8).contiguous(memory_format=torch.channels_last).to(DEVICE)
    wq = torch.zeros(8, 1, 3, 3, dtype=torch.int8, device=DEVICE)
    geometry = depthwise_geometry(x.float(), wq.float(), _attrs((3, 3), (1, 1), (1, 1, 1, 1), (1, 1), 8),
                                  require_cuda=False)
    scale = torch.ones(8, device=DEVICE)
    run = lambda x, wq, **kw: depthwise_qconv_nhwc(x, wq, None, geometry, dequant_scale=scale,  # noqa: E731
                                                    input_inv_scale=1.0, output_inv_scale=1.0, **kw)
    for bad_x, bad_w in ((x, wq.float()), (x, torch.zeros(8, 8, 3, 3, dtype=torch.int8, device=DEVICE)),
                         (x.contiguous(), wq)):
        with pytest.raises(ValueError, match="not a channels-last INT8 depthwise convolution"):
            run(bad_x, bad_w)
    with pytest.raises(ValueError, match="residual .* is not the output's shape"):
        run(x, wq, residual=torch.zeros(1, 8, 4, 4, dtype=torch.int8, device=DEVICE))
    wide = torch.empty(1, 16, 5, 5, dtype=torch.int8, device=DEVICE).contiguous(memory_format=torch.channels_last)
    with pytest.raises(ValueError, match="cannot hold"):
        run(x, wq, out=wide.narrow(1, 0, 7))
