"""The fused epilogue kernel against torch, through Triton's interpreter on CPU (and natively on a GPU)."""
from __future__ import annotations

import pytest
import torch

# conftest.py switches Triton to its interpreter when there is no GPU.
triton = pytest.importorskip("triton")

from sartor.kernels.pointwise.epilogue import ACTIVATION_CODES, fused_epilogue  # noqa: E402
from sartor.ops.elementwise import apply_activation  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
PARAMS = {"Clip": (0.0, 6.0), "HardSigmoid": (0.2, 0.5), "LeakyRelu": (0.1, None)}


@pytest.mark.parametrize("activation", [a for a in ACTIVATION_CODES if a is not None] + [None])
@pytest.mark.parametrize("residual_mode", ["none", "before", "after"])
def test_epilogue_matches_torch(activation, residual_mode):
    generator = torch.Generator().manual_seed(0)
    y = torch.randn(2, 5, 3, 4, generator=generator).contiguous(memory_format=torch.channels_last).to(DEVICE)
    bias = torch.randn(5, generator=generator).to(DEVICE)
    residual = torch.randn(2, 5, 3, 4, generator=generator).contiguous(memory_format=torch.channels_last).to(DEVICE)
    alpha, beta = PARAMS.get(activation, (None, None))
    expected = y + bias.view(1, -1, 1, 1)
    if residual_mode == "before":
        expected = expected + residual
    if activation:
        expected = apply_activation(expected, activation, alpha, beta)
    if residual_mode == "after":
        expected = expected + residual
    out = fused_epilogue(y.clone(), bias, None if residual_mode == "none" else residual, activation, alpha, beta,
                         residual_after_activation=residual_mode == "after")
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_epilogue_on_row_major_gemm_output():
    y = torch.randn(3, 7).to(DEVICE)
    bias = torch.randn(7).to(DEVICE)
    out = fused_epilogue(y.clone(), bias, None, "Relu", None, None)
    torch.testing.assert_close(out, torch.relu(y + bias), rtol=1e-6, atol=1e-6)


def test_epilogue_into_a_channel_slice_with_a_sliced_residual():
    """The Triton-epilogue tactic writing a Concat input in place: out and residual are channel
    slices of wider channels-last buffers; channels outside the slice are left as they were."""
    from sartor.kernels.pointwise.epilogue import pixel_stride
    generator = torch.Generator().manual_seed(2)
    y = torch.randn(2, 6, 3, 4, generator=generator).contiguous(memory_format=torch.channels_last).to(DEVICE)
    bias = torch.randn(6, generator=generator).to(DEVICE)
    wide = torch.randn(2, 10, 3, 4, generator=generator).contiguous(memory_format=torch.channels_last).to(DEVICE)
    residual = wide[:, 3:9]
    buffer = torch.zeros(2, 15, 3, 4).contiguous(memory_format=torch.channels_last).to(DEVICE)
    out = buffer.narrow(1, 5, 6)
    assert pixel_stride(out) == 15 and pixel_stride(residual) == 10
    expected = torch.nn.functional.silu(y + bias.view(1, -1, 1, 1) + residual)
    written = fused_epilogue(y.clone(), bias, residual, "SiLU", None, None, out=out)
    assert written.data_ptr() == out.data_ptr()
    torch.testing.assert_close(buffer[:, 5:11], expected, rtol=1e-5, atol=1e-5)
    assert (buffer[:, :5] == 0).all() and (buffer[:, 11:] == 0).all()


def test_pixel_stride_tells_channel_slices_from_other_layouts():
    from sartor.kernels.pointwise.epilogue import pixel_stride
    nhwc = torch.empty(2, 10, 5, 7).contiguous(memory_format=torch.channels_last)
    assert pixel_stride(nhwc) == 10
    assert pixel_stride(nhwc[:, 3:6]) == 10
    assert pixel_stride(nhwc[:, :, 1:3]) is None  # rows cut: pixels no longer evenly spaced
    assert pixel_stride(torch.empty(2, 10, 5, 7)) is None  # NCHW: channels are not the fastest
    assert pixel_stride(torch.empty(4, 6)[:, :3]) == 6
