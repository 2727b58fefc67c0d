"""An INT8 layer's float output stored in its readers' float16 (`ops.registry.FLOAT_OUTPUT`, set by
runtime/float_outputs.py): every kernel family QConv runs stores the emulation's float32 values
rounded to float16, bit for bit what the reader's conversion made of them; into a float16 Concat
slice too. Through Triton's interpreter on CPU and natively on a GPU."""
from __future__ import annotations

import pytest
import torch
from int8_layers import on_device, random_int8_conv

pytest.importorskip("triton")

from sartor.kernels.conv.depthwise import TRITON_DEPTHWISE_INT8  # noqa: E402
from sartor.kernels.conv.igemm import TileConfig  # noqa: E402
from sartor.kernels.conv.tma import TensorDescriptor, TmaTile  # noqa: E402
from sartor.kernels.gemm.resident import ResidentTile  # noqa: E402
from sartor.kernels.gemm.tma import GemmTmaTile  # noqa: E402
from sartor.ops.quantized import Im2colIgemm, qconv, qconv_into, qlayer_weight_for_tactic  # noqa: E402
from sartor.ops.registry import FLOAT_OUTPUT  # noqa: E402
from sartor.ops import quantized  # noqa: E402
from sartor.ops.quantized_library import INT_MM  # noqa: E402
from sartor.ops.quantized_window import WINDOW_TILES, WindowResident, window_tactic  # noqa: E402
from sartor.kernels.window.resident import WindowResidentTile  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
HALF = {FLOAT_OUTPUT: "float16"}

# (tactic, kernel size, input codes, depthwise): one of each family QConv runs as its own kernel.
# The TMA families read codes; the depthwise kernel, a depthwise layer; the pixel windows a 3-channel
# stem; cuBLAS takes multiples of 16 outputs (48), the others 24 (a partial column tile).
WINDOWS = (window_tactic(WINDOW_TILES[0]).name,
           WindowResident(WindowResidentTile(ResidentTile(16, 32, 2, 1, 1), kh_steps=True)).name)
FAMILIES = [
    (TileConfig(16, 16, 32, 1, 1).name, 3, False, False),
    (TileConfig(16, 16, 32, 1, 1, split_k=2).name, 3, False, False),
    (ResidentTile(16, 32, 3, 1, 1).name, 1, False, False),
    (INT_MM, 1, True, False),
    (Im2colIgemm(TileConfig(16, 16, 32, 1, 1)).name, 3, False, False),
    (TRITON_DEPTHWISE_INT8, 3, True, True),
    (WINDOWS[0], 3, False, False),
    (WINDOWS[1], 3, False, False),
]
if TensorDescriptor is not None:
    FAMILIES += [(TmaTile(4, 8, 32, 32, 1, 1).name, 3, True, False), (GemmTmaTile(16, 32, 32, 1, 1).name, 1, True, False)]


def _emulation_refused(*args):
    raise AssertionError("the layer fell back to the emulation: its tactic did not apply")


def _layer(kernel: int, codes: bool, depthwise: bool, residual: bool, library: bool = False, stem: bool = False):
    """A random INT8 layer writing floats (no output scale): 32 channels in (a stem: 3), 32 out
    when depthwise, else 48 for cuBLAS, 24 for the others."""
    channels = 3 if stem else 32
    cout = channels if depthwise else 48 if library else 24
    x, wq, bias, res, scale, attrs = random_int8_conv(torch.Generator().manual_seed(kernel + 10 * codes), channels,
                                                      cout, kernel=kernel, hw=(7, 6),
                                                      residual=residual, int8_output=False, codes=codes)
    if depthwise:
        wq = wq[:, :1].contiguous()
        attrs["group"] = channels
    return x, wq, bias, res, scale, attrs


@pytest.mark.parametrize("tactic,kernel,codes,depthwise", FAMILIES, ids=[f[0] for f in FAMILIES])
@pytest.mark.parametrize("residual", [False, True])
def test_float16_output_is_the_emulation_rounded(tactic, kernel, codes, depthwise, residual, monkeypatch):
    if residual and (tactic == Im2colIgemm(TileConfig(16, 16, 32, 1, 1)).name):
        pytest.skip("im2col runs layers without a residual")
    x, wq, bias, res, scale, attrs = _layer(kernel, codes, depthwise, residual, library=tactic == INT_MM,
                                            stem=tactic in WINDOWS)
    expected = qconv([x, wq, bias, res, scale], attrs).to(torch.float16)
    assert qconv([x, wq, bias, res, scale], dict(attrs, **HALF)).dtype == torch.float16  # the emulation's own
    inputs = [on_device(x, DEVICE), qlayer_weight_for_tactic(wq, tactic).to(DEVICE), bias.to(DEVICE),
              on_device(res, DEVICE), scale.to(DEVICE)]
    monkeypatch.setattr(quantized, "int8_conv_accumulate", _emulation_refused)  # the kernel, not the fallback
    out = qconv(inputs, dict(attrs, tactic=tactic, **HALF))
    assert out.dtype == torch.float16 and out.is_contiguous(memory_format=torch.channels_last)
    assert torch.equal(out.cpu(), expected)


def test_float16_output_into_a_concat_slice():
    tactic, kernel = TileConfig(16, 16, 32, 1, 1).name, 3
    x, wq, bias, res, scale, attrs = _layer(kernel, False, False, True)
    expected = qconv([x, wq, bias, res, scale], attrs).to(torch.float16)
    buffer = torch.full((2, 40, 7, 6), 5.0, dtype=torch.float16).contiguous(memory_format=torch.channels_last)
    buffer = buffer.to(DEVICE)
    inputs = [on_device(x, DEVICE), qlayer_weight_for_tactic(wq, tactic).to(DEVICE), bias.to(DEVICE),
              on_device(res, DEVICE), scale.to(DEVICE)]
    assert qconv_into(inputs, dict(attrs, tactic=tactic), buffer.narrow(1, 8, 24)) is None  # float32 is not its dtype
    written = qconv_into(inputs, dict(attrs, tactic=tactic, **HALF), buffer.narrow(1, 8, 24))
    assert written is not None
    assert torch.equal(buffer[:, 8:32].cpu(), expected)
    assert (buffer[:, :8] == 5).all() and (buffer[:, 32:] == 5).all()
