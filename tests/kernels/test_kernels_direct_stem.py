"""The INT8 stem on the CUDA cores (`kernels/conv/direct_stem.py`, tactics `triton_direct_stem_int8`,
its wide form and its quads form): a float image quantized as loaded, four taps' codes a word, equal to the emulation
through Triton's interpreter on CPU (and natively on a GPU); where the tactics are offered, and
what they refuse."""
from __future__ import annotations

import pytest
import torch

# conftest.py switches Triton to its interpreter when there is no GPU.
triton = pytest.importorskip("triton")

from sartor.kernels.conv.direct_stem import (  # noqa: E402
    DIRECT_STEM_FORMS, MAX_IN_CHANNELS, MAX_OUT_CHANNELS, MAX_TAPS, TRITON_DIRECT_STEM_INT8,
    TRITON_DIRECT_STEM_INT8_QUADS, direct_stem_conv, row_words, stem_forms, tap_words)
from sartor.ops import default_registry  # noqa: E402
from sartor.ops.conv import igemm_geometry  # noqa: E402
from sartor.ops.quantized import direct_stem_int8, qconv, qlayer_weight_for_tactic, quantize  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# (kernel, strides, pads (top, left, bottom, right), dilations)
GEOMETRIES = [
    ((3, 3), (2, 2), (1, 1, 1, 1), (1, 1)),  # YOLO's stem
    ((3, 3), (1, 1), (1, 1, 1, 1), (1, 1)),
    ((3, 5), (2, 1), (0, 2, 1, 1), (1, 2)),  # asymmetric pads and a dilation
]
# (input channels, output channels): YOLO's 3 → 16, a ragged block of outputs, the widest it takes
CHANNELS = [(3, 16), (1, 12), (MAX_IN_CHANNELS, MAX_OUT_CHANNELS)]


def _attrs(kernel, strides, pads, dilations, **epilogue) -> dict:
    return dict({"kernel_shape": list(kernel), "strides": list(strides), "pads": list(pads),
                 "dilations": list(dilations), "group": 1}, **epilogue)


def _layer(cin, cout, kernel, strides, pads, dilations, generator, *, int8_output=True, activation="Relu",
           dtype=torch.float32, channels_last=False, size=(11, 10)):
    """A stem QConv's inputs (a float image, int8 weight, int32 bias, no residual, scales) and attrs;
    the image spans about the codes' range, some of it beyond (clamped)."""
    attrs = _attrs(kernel, strides, pads, dilations, activation=activation, input_inv_scale=90.0, qmin=-127)
    if int8_output:
        attrs["output_inv_scale"] = 7.0
    x = (torch.randn(2, cin, *size, generator=generator) * 0.6).to(dtype)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    wq = torch.randint(-127, 128, (cout, cin, *kernel), dtype=torch.int8, generator=generator)
    bias = torch.randint(-3000, 3000, (cout,), dtype=torch.int32, generator=generator)
    scale = torch.rand(cout, generator=generator) * 2e-4
    return [x, wq, bias, None, scale], attrs


def _on_device(layer: list, tactic: str = TRITON_DIRECT_STEM_INT8) -> list:
    moved = [t.to(DEVICE) if t is not None else None for t in layer]
    moved[1] = qlayer_weight_for_tactic(moved[1], tactic)
    return moved


@pytest.mark.parametrize("kernel,strides,pads,dilations", GEOMETRIES)
@pytest.mark.parametrize("cin,cout", CHANNELS)
@pytest.mark.parametrize("int8_output", [True, False])
@pytest.mark.parametrize("tactic", [TRITON_DIRECT_STEM_INT8, TRITON_DIRECT_STEM_INT8_QUADS])
def test_it_equals_the_emulation(kernel, strides, pads, dilations, cin, cout, int8_output, tactic):
    """Quantized as the emulation quantizes, exact int32 sums of four products a word (the last word
    of 27, 9 or 15 taps padded; in the quads form a filter row's 3 taps a word, each of a quad's input
    values quantized once), then the INT8 epilogue: bit for bit the emulation's output, INT8 codes or
    float32. The outputs' 6 × 5 and 11 × 5 leave quads cut by the edges."""
    if tactic not in stem_forms(kernel, dilations, cout):
        pytest.skip("the quads form runs no dilated filter and at most 16 outputs (test_it_refuses_what_it_cannot_run)")
    generator = torch.Generator().manual_seed(41)
    layer, attrs = _layer(cin, cout, kernel, strides, pads, dilations, generator, int8_output=int8_output)
    expected = qconv(layer, attrs)
    assert expected.unique().numel() > 20  # the output tells the arithmetic apart
    out = qconv(_on_device(layer, tactic), dict(attrs, tactic=tactic))
    assert out.dtype == (torch.int8 if int8_output else torch.float32)
    assert out.is_contiguous(memory_format=torch.channels_last)
    assert torch.equal(out.cpu(), expected), (kernel, strides, cin, cout)


@pytest.mark.parametrize("tactic", list(DIRECT_STEM_FORMS))
@pytest.mark.parametrize("dtype,channels_last", [(torch.float16, False), (torch.float32, True),
                                                 (torch.bfloat16, False)])
def test_each_form_reads_each_image_dtype_and_layout(tactic, dtype, channels_last):
    """float16 and bfloat16 images, a channels-last float32 one (a camera's interleaved frame), by both
    forms: the emulation's codes, with SiLU (its exponential the kernel's own: within one code)."""
    generator = torch.Generator().manual_seed(42)
    layer, attrs = _layer(3, 16, (3, 3), (2, 2), (1, 1, 1, 1), (1, 1), generator, activation="SiLU", dtype=dtype,
                          channels_last=channels_last, size=(23, 17))
    expected = qconv(layer, attrs)
    out = qconv(_on_device(layer, tactic), dict(attrs, tactic=tactic)).cpu()
    assert int((out.int() - expected.int()).abs().max()) <= 1
    assert (out == expected).float().mean() > 0.99


@pytest.mark.parametrize("tactic", list(DIRECT_STEM_FORMS))
def test_each_form_reads_an_image_of_codes_as_they_are(tactic):
    """An image that arrives as its INT8 codes (the engine's copy of its input quantized it,
    docs/decisions/0068): the same output, bit for bit, as from the float image, codes at the clamp
    and padding (code 0) included, and the emulation's."""
    generator = torch.Generator().manual_seed(44)
    layer, attrs = _layer(3, 16, (3, 3), (2, 2), (1, 1, 1, 1), (1, 1), generator, size=(13, 9))
    expected = qconv(layer, attrs)
    codes = list(layer)
    codes[0] = quantize(layer[0], attrs["input_inv_scale"], attrs["qmin"])
    assert codes[0].abs().max() == 127 and (codes[0] == 0).any()
    from_codes = qconv(_on_device(codes, tactic), dict(attrs, tactic=tactic)).cpu()
    from_floats = qconv(_on_device(layer, tactic), dict(attrs, tactic=tactic)).cpu()
    assert torch.equal(from_codes, expected) and torch.equal(from_floats, expected)


def test_codes_at_the_clamp_and_halfway_between_round_as_the_emulation():
    """Values far beyond the codes' range saturate; values exactly halfway between two codes round to
    the even one. An image made of just those: any other rounding changes the sums."""
    generator = torch.Generator().manual_seed(43)
    layer, attrs = _layer(3, 16, (3, 3), (2, 2), (1, 1, 1, 1), (1, 1), generator, int8_output=False)
    halves = (torch.randint(-300, 300, layer[0].shape, generator=generator) + 0.5) / attrs["input_inv_scale"]
    layer[0] = torch.where(torch.rand(layer[0].shape, generator=generator) < 0.2, halves * 10, halves)
    out = qconv(_on_device(layer), dict(attrs, tactic=TRITON_DIRECT_STEM_INT8))
    assert torch.equal(out.cpu(), qconv(layer, attrs))


@pytest.mark.parametrize("int8_output", [True, False])
def test_sums_decoded_from_their_bits_where_the_layer_is_bounded(monkeypatch, int8_output):
    """With the layer's accumulator bound under 2^22 (`passes/bound_accumulators.py`), the epilogue
    takes the sums from their bits (SUMS_DECODED) rather than converting them: the same outputs."""
    from sartor.kernels.common.tile_steps import SUMS_DECODED
    from sartor.kernels.conv import direct_stem
    from sartor.ops.quantized import ACCUMULATOR_BOUND
    generator = torch.Generator().manual_seed(47)
    layer, attrs = _layer(3, 16, (3, 3), (2, 2), (1, 1, 1, 1), (1, 1), generator, int8_output=int8_output)
    attrs[ACCUMULATOR_BOUND] = 27 * 128 * 127 + 3000
    flags = []
    kernel = direct_stem._direct_stem_kernel
    monkeypatch.setattr(direct_stem, "_direct_stem_kernel", type("Spy", (), {"__getitem__": lambda self, grid: (
        lambda *args, **kwargs: (flags.append(kwargs["INT8"]), kernel[grid](*args, **kwargs))[1])})())
    out = qconv(_on_device(layer), dict(attrs, tactic=TRITON_DIRECT_STEM_INT8))
    assert flags == [SUMS_DECODED] and torch.equal(out.cpu(), qconv(layer, attrs))


@pytest.mark.parametrize("tactic", list(DIRECT_STEM_FORMS))
def test_it_ran_the_kernel_and_not_the_emulation(monkeypatch, tactic):
    """The tactic's result comes from the kernel: with the kernel's launch spied on, it was launched."""
    from sartor.kernels.conv import direct_stem
    generator = torch.Generator().manual_seed(44)
    layer, attrs = _layer(3, 16, (3, 3), (2, 2), (1, 1, 1, 1), (1, 1), generator)
    launched = []
    name = "_direct_stem_quads_kernel" if DIRECT_STEM_FORMS[tactic].quads else "_direct_stem_kernel"
    kernel = getattr(direct_stem, name)
    monkeypatch.setattr(direct_stem, name,
                        type("Spy", (), {"__getitem__": lambda self, grid: (launched.append(grid), kernel[grid])[1]})())
    out = qconv(_on_device(layer, tactic), dict(attrs, tactic=tactic))
    assert launched and torch.equal(out.cpu(), qconv(layer, attrs))


def test_which_layers_it_takes():
    """A float image (or its INT8 codes, which the engine's staged copy writes) of at most 4 channels
    into at most 32 INT8 outputs, at most 64 taps, with an epilogue the kernel knows; not wide layers,
    many taps, groups, a residual or FP8."""
    def inputs(cin=3, cout=16, kernel=(3, 3), dtype=torch.float32, residual=False):
        return [torch.zeros(1, cin, 8, 8, dtype=dtype), torch.zeros(cout, cin, *kernel, dtype=torch.int8), None,
                torch.zeros(1, cout, 8, 8, dtype=torch.int8) if residual else None, None]
    attrs = _attrs((3, 3), (2, 2), (1, 1, 1, 1), (1, 1), activation="SiLU")
    assert direct_stem_int8(inputs(), attrs)
    assert direct_stem_int8(inputs(dtype=torch.float16), attrs)
    assert direct_stem_int8(inputs(MAX_IN_CHANNELS, MAX_OUT_CHANNELS), attrs)
    assert direct_stem_int8(inputs(dtype=torch.int8), attrs)
    assert not direct_stem_int8(inputs(dtype=torch.int32), attrs)
    assert not direct_stem_int8(inputs(MAX_IN_CHANNELS + 1), attrs)
    assert not direct_stem_int8(inputs(cout=MAX_OUT_CHANNELS + 1), attrs)
    assert not direct_stem_int8(inputs(kernel=(7, 7)), attrs)  # 147 taps: ResNet's stem
    assert MAX_TAPS < 3 * 7 * 7
    assert not direct_stem_int8(inputs(residual=True), attrs)
    assert not direct_stem_int8(inputs(), dict(attrs, group=3))
    assert not direct_stem_int8(inputs(), dict(attrs, qformat="fp8e4m3"))
    assert not direct_stem_int8(inputs(), dict(attrs, activation="Softplus"))


def test_the_weight_is_stored_as_words_of_four_taps_once_at_load():
    """[words, Cout] int32: word j of output channel o holds taps 4j..4j+3 of o in (channel, row,
    column) order, byte i tap 4j+i; the 28th byte of 27 taps is 0."""
    codes = torch.randint(-127, 128, (16, 3, 3, 3), dtype=torch.int8)
    stored = qlayer_weight_for_tactic(codes, TRITON_DIRECT_STEM_INT8)
    assert stored.dtype == torch.int32 and tuple(stored.shape) == (7, 16) and stored.is_contiguous()
    assert torch.equal(stored, tap_words(codes))
    as_bytes = stored.t().contiguous().view(torch.int8)  # [Cout, 28]
    assert torch.equal(as_bytes[:, :27], codes.reshape(16, 27)) and not as_bytes[:, 27].any()


def test_the_quads_form_stores_a_word_a_filter_row():
    """[C·KH, Cout] int32: row c·KH + kh holds output channel o's taps (c, kh, 0..KW-1) in bytes 0..KW-1,
    the bytes past them 0; filters of more than four columns do not fit."""
    codes = torch.randint(-127, 128, (16, 3, 3, 3), dtype=torch.int8)
    stored = qlayer_weight_for_tactic(codes, TRITON_DIRECT_STEM_INT8_QUADS)
    assert stored.dtype == torch.int32 and tuple(stored.shape) == (9, 16) and stored.is_contiguous()
    assert torch.equal(stored, row_words(codes))
    as_bytes = stored.t().contiguous().view(torch.int8).reshape(16, 3, 3, 4)
    assert torch.equal(as_bytes[..., :3], codes) and not as_bytes[..., 3].any()
    with pytest.raises(ValueError, match="do not fit a word"):
        row_words(torch.zeros(16, 3, 5, 5, dtype=torch.int8))


def test_the_quads_form_is_listed_for_rows_of_at_most_four_taps_without_dilation_into_few_outputs():
    assert TRITON_DIRECT_STEM_INT8_QUADS in stem_forms((3, 3), (1, 1), 16)
    assert TRITON_DIRECT_STEM_INT8_QUADS in stem_forms((7, 4), [1, 1], 12)
    for kernel, dilations, cout in (((3, 5), (1, 1), 16), ((3, 3), (1, 2), 16), ((3, 3), (2, 1), 16),
                                    ((3, 3), (1, 1), 24)):
        forms = stem_forms(kernel, dilations, cout)
        assert TRITON_DIRECT_STEM_INT8_QUADS not in forms and TRITON_DIRECT_STEM_INT8 in forms


def test_cpu_layers_never_list_the_tactic():
    layer, attrs = _layer(3, 16, (3, 3), (2, 2), (1, 1, 1, 1), (1, 1), torch.Generator().manual_seed(45))
    assert not set(DIRECT_STEM_FORMS) & set(default_registry()["QConv"].tactics(layer, attrs, 2))


@pytest.mark.skipif(DEVICE != "cuda", reason="the kernel tactics are listed for CUDA tensors")
def test_cuda_lists_the_tactic_beside_the_windows_where_it_applies():
    qconv_tactics = default_registry()["QConv"].tactics
    for cin, cout, offered in ((3, 16, True), (3, 64, False)):
        layer, attrs = _layer(cin, cout, (3, 3), (2, 2), (1, 1, 1, 1), (1, 1), torch.Generator().manual_seed(46),
                              size=(64, 64))
        names = qconv_tactics([t.cuda() if t is not None else None for t in layer], attrs, 2)
        assert all((name in names) == offered for name in DIRECT_STEM_FORMS)
        assert any(n.startswith("igemm.") for n in names)


def test_it_refuses_what_it_cannot_run():
    """One line each: an integer image that is not INT8 codes, a weight not in tap words (as built, or
    words of another geometry), too many channels; a tactic that is not one of its forms."""
    x = torch.zeros(1, 3, 6, 6, device=DEVICE)
    wq = torch.zeros(16, 3, 3, 3, dtype=torch.int8, device=DEVICE)
    geometry = igemm_geometry(x, wq, _attrs((3, 3), (2, 2), (1, 1, 1, 1), (1, 1)), require_cuda=False)
    scale = torch.ones(16, device=DEVICE)
    run = lambda x, w, **kw: direct_stem_conv(x, w, None, geometry, dequant_scale=scale,  # noqa: E731
                                              input_inv_scale=1.0, output_inv_scale=1.0, **kw)
    words = tap_words(wq)
    wide = torch.zeros(1, 8, 6, 6, device=DEVICE), tap_words(torch.zeros(16, 8, 3, 3, dtype=torch.int8))
    for bad_x, bad_w in ((x.to(torch.int32), words), (x, wq), (x, words[:6]), wide):
        with pytest.raises(ValueError, match=r"not an image \(float or codes\) of at most"):
            run(bad_x, bad_w)
    with pytest.raises(ValueError, match="is not one of"):
        run(x, words, tactic="triton_direct_int8_words")
    quads = TRITON_DIRECT_STEM_INT8_QUADS
    with pytest.raises(ValueError, match="row words"):  # tap words for the quads form
        run(x, words, tactic=quads)
    dilated = igemm_geometry(x, wq, _attrs((3, 3), (2, 2), (1, 1, 1, 1), (2, 2)), require_cuda=False)
    with pytest.raises(ValueError, match="without dilation"):
        direct_stem_conv(x, row_words(wq), None, dilated, dequant_scale=scale, input_inv_scale=1.0,
                         output_inv_scale=1.0, tactic=quads)
    wide_out = torch.zeros(24, 3, 3, 3, dtype=torch.int8, device=DEVICE)
    with pytest.raises(ValueError, match="into at most 16 outputs"):
        direct_stem_conv(x, row_words(wide_out), None, geometry, dequant_scale=torch.ones(24, device=DEVICE),
                         input_inv_scale=1.0, output_inv_scale=1.0, tactic=quads)
