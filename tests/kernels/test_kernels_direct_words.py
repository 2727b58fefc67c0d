"""The dense INT8 convolution of few channels on the CUDA cores (`kernels/conv/direct_words.py`, tactic
`triton_direct_int8_words` and its forms that load each tap's words as tiles): the emulation's numbers
through Triton's interpreter on CPU (and natively on a GPU), channel slices in and out, where the
tactics are offered, and what they refuse."""
from __future__ import annotations

import pytest
import torch

# conftest.py switches Triton to its interpreter when there is no GPU.
triton = pytest.importorskip("triton")

from sartor.kernels.conv.direct_words import (  # noqa: E402
    DIRECT_WORDS_FORMS, MAX_IN_CHANNELS, MAX_WORD_STEPS, TRITON_DIRECT_INT8_WORDS, direct_int8_words_conv)
from sartor.ops import default_registry  # noqa: E402
from sartor.ops.conv import igemm_geometry  # noqa: E402
from sartor.ops.quantized import (  # noqa: E402
    direct_words_int8, qconv, qconv_into, qlayer_weight_for_tactic)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# (kernel, strides, pads (top, left, bottom, right), dilations)
GEOMETRIES = [
    ((3, 3), (1, 1), (1, 1, 1, 1), (1, 1)),
    ((3, 3), (2, 2), (1, 1, 1, 1), (1, 1)),
    ((1, 1), (1, 1), (0, 0, 0, 0), (1, 1)),
    ((3, 5), (2, 1), (0, 2, 1, 1), (1, 2)),  # asymmetric pads and a dilation
]
# (input channels, output channels): YOLO11n's C3k2 16 → 8 and 8 → 16, three words in and a ragged
# block of outputs, and the largest the tactic takes
CHANNELS = [(16, 8), (8, 16), (12, 12), (32, 32)]


def _attrs(kernel, strides, pads, dilations, **epilogue) -> dict:
    return dict({"kernel_shape": list(kernel), "strides": list(strides), "pads": list(pads),
                 "dilations": list(dilations), "group": 1}, **epilogue)


def _layer(cin, cout, kernel, strides, pads, dilations, generator, *, residual=False, int8_output=True,
           activation="Relu", size=(9, 8)):
    """A dense QConv's inputs (channels-last codes, int8 weight, int32 bias, residual codes, scales) and attrs."""
    attrs = _attrs(kernel, strides, pads, dilations, activation=activation, input_inv_scale=11.0, qmin=-127,
                   residual_scale=0.05)
    if int8_output:
        attrs["output_inv_scale"] = 7.0
    x = torch.randint(-127, 128, (2, cin, *size), dtype=torch.int8, generator=generator)
    wq = torch.randint(-127, 128, (cout, cin, *kernel), dtype=torch.int8, generator=generator)
    bias = torch.randint(-3000, 3000, (cout,), dtype=torch.int32, generator=generator)
    scale = torch.rand(cout, generator=generator) * 2e-4
    out_hw = [(s + lo + hi - d * (k - 1) - 1) // st + 1 for s, lo, hi, d, k, st in
              zip(size, pads[:2], pads[2:], dilations, kernel, strides)]
    res = torch.randint(-127, 128, (2, cout, *out_hw), dtype=torch.int8, generator=generator) if residual else None
    return [x.contiguous(memory_format=torch.channels_last), wq, bias, res, scale], attrs


def _on_device(layer: list) -> list:
    """The layer's inputs on the test's device, the weight stored as the tactic's layout stores it."""
    moved = [t.to(DEVICE) if t is not None else None for t in layer]
    moved[1] = qlayer_weight_for_tactic(moved[1], TRITON_DIRECT_INT8_WORDS)
    return moved


@pytest.mark.parametrize("kernel,strides,pads,dilations,cin,cout", [
    (*geometry, cin, cout) for geometry in GEOMETRIES for cin, cout in CHANNELS
    if geometry[0][0] * geometry[0][1] * cin // 4 <= MAX_WORD_STEPS])  # the 3×5 filter over 32 channels: too many
@pytest.mark.parametrize("residual,int8_output", [(False, True), (True, True), (False, False)])
def test_it_equals_the_emulation(kernel, strides, pads, dilations, cin, cout, residual, int8_output):
    """int32 sums of four products a word, then the INT8 epilogue: bit for bit the emulation's output,
    INT8 codes or float32, with a residual of codes."""
    generator = torch.Generator().manual_seed(31)
    layer, attrs = _layer(cin, cout, kernel, strides, pads, dilations, generator, residual=residual,
                          int8_output=int8_output)
    expected = qconv(layer, attrs)
    out = qconv(_on_device(layer), dict(attrs, tactic=TRITON_DIRECT_INT8_WORDS))
    assert out.dtype == (torch.int8 if int8_output else torch.float32)
    assert out.is_contiguous(memory_format=torch.channels_last)
    assert torch.equal(out.cpu(), expected), (kernel, strides, cin, cout)


@pytest.mark.parametrize("tactic", [name for name in DIRECT_WORDS_FORMS if DIRECT_WORDS_FORMS[name].tiles])
@pytest.mark.parametrize("kernel,strides,pads,dilations,cin,cout", [
    (*geometry, cin, cout) for geometry in GEOMETRIES for cin, cout in ((16, 8), (12, 12), (8, 16))])
def test_the_tile_forms_equal_the_emulation(tactic, kernel, strides, pads, dilations, cin, cout):
    """Each tap's words loaded as tiles (three words in a tile of four: the fourth masked) and
    taken out of them word by word: the same sums, bit for bit, with a residual of codes."""
    generator = torch.Generator().manual_seed(38)
    layer, attrs = _layer(cin, cout, kernel, strides, pads, dilations, generator, residual=True)
    out = qconv(_on_device(layer), dict(attrs, tactic=tactic))
    assert torch.equal(out.cpu(), qconv(layer, attrs)), (tactic, kernel, strides, cin, cout)


@pytest.mark.parametrize("tactic", list(DIRECT_WORDS_FORMS))
def test_it_ran_the_kernel_and_not_the_emulation(monkeypatch, tactic):
    """The tactic's result comes from the kernel: with the kernel's launch taken away, the layer
    would fail rather than quietly fall back."""
    from sartor.kernels.conv import direct_words
    generator = torch.Generator().manual_seed(32)
    layer, attrs = _layer(16, 8, (3, 3), (1, 1), (1, 1, 1, 1), (1, 1), generator)
    launched = []
    kernel = direct_words._direct_int8_words_kernel
    monkeypatch.setattr(direct_words, "_direct_int8_words_kernel",
                        type("Spy", (), {"__getitem__": lambda self, grid: (launched.append(grid), kernel[grid])[1]})())
    out = qconv(_on_device(layer), dict(attrs, tactic=tactic))
    assert launched and torch.equal(out.cpu(), qconv(layer, attrs))


def test_silu_is_within_one_code_of_the_emulation():
    """YOLO's convolutions end in SiLU, whose exponential may differ from torch's in its last ulp:
    held to one code step, as the implicit GEMM's SiLU is."""
    generator = torch.Generator().manual_seed(33)
    layer, attrs = _layer(16, 8, (3, 3), (1, 1), (1, 1, 1, 1), (1, 1), generator, activation="SiLU")
    expected = qconv(layer, attrs)
    out = qconv(_on_device(layer), dict(attrs, tactic=TRITON_DIRECT_INT8_WORDS)).cpu()
    assert int((out.int() - expected.int()).abs().max()) <= 1
    assert (out == expected).float().mean() > 0.99


def test_it_reads_a_split_half_and_writes_a_concat_slice():
    """A C2f block's second Split half in (16 channels starting 16 codes into each pixel), a slice of
    a Concat's buffer out: the same codes as the emulation, nothing else of the buffer touched."""
    generator = torch.Generator().manual_seed(34)
    layer, attrs = _layer(16, 8, (3, 3), (1, 1), (1, 1, 1, 1), (1, 1), generator)
    wide = torch.randint(-127, 128, (2, 32, 9, 8), dtype=torch.int8, generator=generator)
    wide = wide.contiguous(memory_format=torch.channels_last)
    expected = qconv([wide[:, 16:].contiguous()] + layer[1:], attrs)
    buffer = torch.zeros(2, 24, 9, 8, dtype=torch.int8, device=DEVICE).contiguous(memory_format=torch.channels_last)
    half = wide.to(DEVICE)[:, 16:]  # sliced on the device: a slice moved alone would arrive dense
    assert half.stride()[3] == 32
    written = qconv_into(_on_device([half] + layer[1:]), dict(attrs, tactic=TRITON_DIRECT_INT8_WORDS),
                         buffer[:, 8:16])
    assert written is not None and torch.equal(buffer[:, 8:16].cpu(), expected)
    assert not buffer[:, :8].any() and not buffer[:, 16:].any()


def test_which_layers_it_takes():
    """Dense INT8 layers of few channels whose codes come in whole words, with an epilogue the kernel
    knows; not float inputs, 18 channels or a slice two codes into a pixel (no whole words), wide
    layers, many word steps, groups or FP8."""
    def layer(cin=16, cout=8, kernel=(3, 3), dtype=torch.int8, start=0):
        x = torch.zeros(1, cin + start, 8, 8, dtype=dtype).contiguous(memory_format=torch.channels_last)[:, start:]
        return x, torch.zeros(cout, cin, *kernel, dtype=torch.int8)
    attrs = _attrs((3, 3), (1, 1), (1, 1, 1, 1), (1, 1), activation="SiLU")
    assert direct_words_int8(*layer(), attrs)
    assert direct_words_int8(*layer(32, 32), attrs)
    assert direct_words_int8(*layer(8, 16, kernel=(1, 1)), attrs)
    assert not direct_words_int8(*layer(dtype=torch.float16), attrs)
    assert not direct_words_int8(*layer(18, 8), attrs)
    assert not direct_words_int8(*layer(start=2), attrs)
    assert not direct_words_int8(*layer(MAX_IN_CHANNELS + 4, 8), attrs)
    assert not direct_words_int8(*layer(16, 64), attrs)
    assert not direct_words_int8(*layer(32, 8, kernel=(5, 5)), attrs)  # 200 word steps
    assert not direct_words_int8(*layer(), dict(attrs, group=2))
    assert not direct_words_int8(*layer(), dict(attrs, qformat="fp8e4m3"))
    assert not direct_words_int8(*layer(), dict(attrs, activation="Softplus"))


def test_the_weight_is_stored_channels_last_once_at_load():
    codes = torch.randint(-127, 128, (8, 16, 3, 3), dtype=torch.int8)
    stored = qlayer_weight_for_tactic(codes, TRITON_DIRECT_INT8_WORDS)
    assert torch.equal(stored, codes) and stored.is_contiguous(memory_format=torch.channels_last)


def test_cpu_layers_never_list_the_tactic():
    layer, attrs = _layer(16, 8, (3, 3), (1, 1), (1, 1, 1, 1), (1, 1), torch.Generator().manual_seed(35))
    assert not set(DIRECT_WORDS_FORMS) & set(default_registry()["QConv"].tactics(layer, attrs, 2))


@pytest.mark.skipif(DEVICE != "cuda", reason="the kernel tactics are listed for CUDA tensors")
def test_cuda_lists_the_tactic_beside_the_implicit_gemm_where_it_applies():
    qconv_tactics = default_registry()["QConv"].tactics
    for cin, cout, offered in ((16, 8, True), (64, 64, False)):
        layer, attrs = _layer(cin, cout, (3, 3), (1, 1), (1, 1, 1, 1), (1, 1), torch.Generator().manual_seed(36))
        names = qconv_tactics([t.cuda() if t is not None else None for t in layer], attrs, 2)
        assert all((name in names) == offered for name in DIRECT_WORDS_FORMS)
        assert any(n.startswith("igemm.") for n in names)


def test_a_layer_it_does_not_take_runs_the_emulation_under_its_name():
    """18 channels are no whole words: the tactic's runner declines, and the layer runs the emulation."""
    generator = torch.Generator().manual_seed(37)
    layer, attrs = _layer(18, 8, (3, 3), (1, 1), (1, 1, 1, 1), (1, 1), generator)
    out = qconv(_on_device(layer), dict(attrs, tactic=TRITON_DIRECT_INT8_WORDS))
    assert torch.equal(out.cpu(), qconv(layer, attrs))


def test_it_refuses_what_it_cannot_run():
    """One line each: a float weight, a float input, an input in no whole words; a residual of
    another shape; an output slice that cannot hold the result; a tactic that is not one of its forms."""
    x = torch.zeros(1, 16, 5, 5, dtype=torch.int8).contiguous(memory_format=torch.channels_last).to(DEVICE)
    wq = torch.zeros(8, 16, 3, 3, dtype=torch.int8, device=DEVICE)
    geometry = igemm_geometry(x, wq, _attrs((3, 3), (1, 1), (1, 1, 1, 1), (1, 1)), require_cuda=False)
    scale = torch.ones(8, device=DEVICE)
    run = lambda x, wq, **kw: direct_int8_words_conv(x, wq, None, geometry, dequant_scale=scale,  # noqa: E731
                                                      output_inv_scale=1.0, **kw)
    for bad_x, bad_w in ((x, wq.float()), (x.float(), wq), (x.contiguous(), wq)):
        with pytest.raises(ValueError, match="not a dense INT8 convolution"):
            run(bad_x, bad_w)
    with pytest.raises(ValueError, match="residual .* is not the output's shape"):
        run(x, wq, residual=torch.zeros(1, 8, 4, 4, dtype=torch.int8, device=DEVICE))
    wide = torch.empty(1, 16, 5, 5, dtype=torch.int8, device=DEVICE).contiguous(memory_format=torch.channels_last)
    with pytest.raises(ValueError, match="cannot hold"):
        run(x, wq, out=wide.narrow(1, 0, 7))
    with pytest.raises(ValueError, match="tactic 'igemm.64x16x64' is not one of triton_direct_int8_words, "):
        run(x, wq, tactic="igemm.64x16x64")
