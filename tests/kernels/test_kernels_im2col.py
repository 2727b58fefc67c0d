"""The one-pass INT8/FP8 im2col of few-channel convolutions (`sartor/kernels/conv/im2col.py`) against the
columns PyTorch's unfold makes of the quantized input, through Triton's interpreter on CPU and
natively on a GPU."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

# conftest.py switches Triton to its interpreter when there is no GPU.
pytest.importorskip("triton")

from sartor.kernels.conv.im2col import im2col_codes  # noqa: E402
from sartor.ops.fp8 import quantize_fp8  # noqa: E402
from sartor.ops.quantized import quantize  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# (channels, kernel, strides, pads (top, left, bottom, right), dilations, K padded to)
GEOMETRIES = [
    (3, (7, 7), (2, 2), (3, 3, 3, 3), (1, 1), 160),  # ResNet's stem
    (3, (3, 3), (1, 1), (1, 1, 1, 1), (1, 1), 32),
    (5, (3, 2), (1, 2), (0, 1, 2, 1), (2, 1), 64),  # asymmetric pads, dilation, K 30 padded to 64
]


def reference_columns(codes: torch.Tensor, kernel, strides, pads, dilations, k_padded: int) -> torch.Tensor:
    """unfold of the codes (exact in float32), reordered (kh, kw, c) and padded with zero columns."""
    top, left, bottom, right = pads
    padded = F.pad(codes.float(), (left, right, top, bottom))
    unfolded = F.unfold(padded, kernel, dilation=dilations, stride=strides)  # [N, C·kh·kw, L], (c, kh, kw)
    n, c = codes.shape[:2]
    rows = unfolded.view(n, c, kernel[0] * kernel[1], -1).permute(0, 3, 2, 1).reshape(-1, c * kernel[0] * kernel[1])
    return F.pad(rows, (0, k_padded - rows.shape[1]))


def _out_hw(h, w, kernel, strides, pads, dilations):
    top, left, bottom, right = pads
    return ((h + top + bottom - dilations[0] * (kernel[0] - 1) - 1) // strides[0] + 1,
            (w + left + right - dilations[1] * (kernel[1] - 1) - 1) // strides[1] + 1)


@pytest.mark.parametrize("geometry", GEOMETRIES)
@pytest.mark.parametrize("layout", ["nchw", "nhwc"])
@pytest.mark.parametrize("code", [torch.int8, torch.float8_e4m3fn])
def test_float_input_is_quantized_into_the_columns(geometry, layout, code):
    c, kernel, strides, pads, dilations, k_padded = geometry
    x = torch.randn(2, c, 11, 9, generator=torch.Generator().manual_seed(3)) * 3
    if layout == "nhwc":
        x = x.contiguous(memory_format=torch.channels_last)
    inv_scale = 30.0
    codes = quantize(x, inv_scale) if code == torch.int8 else quantize_fp8(x, inv_scale)
    out_hw = _out_hw(11, 9, kernel, strides, pads, dilations)
    got = im2col_codes(x.to(DEVICE), kernel, strides, pads[:2], dilations, out_hw, k_padded, code, inv_scale)
    assert got.dtype == code and got.shape == (2 * out_hw[0] * out_hw[1], k_padded)
    expected = reference_columns(codes, kernel, strides, pads, dilations, k_padded)
    assert torch.equal(got.cpu().float(), expected)


def test_codes_are_copied_and_half_inputs_quantized_as_the_emulation_does():
    kernel, strides, pads, dilations = (3, 3), (2, 2), (1, 1, 1, 1), (1, 1)
    x = torch.randn(1, 3, 8, 8, generator=torch.Generator().manual_seed(4)) * 2
    out_hw = _out_hw(8, 8, kernel, strides, pads, dilations)
    codes = quantize(x, 50.0, -128)
    copied = im2col_codes(codes.to(DEVICE), kernel, strides, pads[:2], dilations, out_hw, 32, torch.int8)
    assert torch.equal(copied.cpu().float(), reference_columns(codes, kernel, strides, pads, dilations, 32))
    half = x.half()
    got = im2col_codes(half.to(DEVICE), kernel, strides, pads[:2], dilations, out_hw, 32, torch.int8, 50.0, -128)
    expected = reference_columns(quantize(half, 50.0, -128), kernel, strides, pads, dilations, 32)
    assert torch.equal(got.cpu().float(), expected)


def test_wrong_arguments_are_refused_with_their_reason():
    x = torch.randn(1, 3, 8, 8).to(DEVICE)
    with pytest.raises(ValueError, match="under the layer's K 27"):
        im2col_codes(x, (3, 3), (1, 1), (1, 1), (1, 1), (8, 8), 16, torch.int8)
    with pytest.raises(ValueError, match="int8 or float8_e4m3fn codes"):
        im2col_codes(x, (3, 3), (1, 1), (1, 1), (1, 1), (8, 8), 32, torch.uint8)
    with pytest.raises(ValueError, match="quantizes float inputs"):
        im2col_codes(x.to(torch.int32), (3, 3), (1, 1), (1, 1), (1, 1), (8, 8), 32, torch.int8)
