"""The copy of a float tensor into its INT8 codes (`kernels/pointwise/quantize.py`, through
`ops.quantized.quantize_into`): bit for bit `quantize`'s codes, ties and saturation included, through
Triton's interpreter on CPU (and natively on a GPU); PyTorch's ops where the layouts differ."""
from __future__ import annotations

import pytest
import torch

# conftest.py switches Triton to its interpreter when there is no GPU.
triton = pytest.importorskip("triton")

from sartor.kernels.pointwise import quantize as kernel  # noqa: E402
from sartor.ops.quantized import quantize, quantize_into  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _values(shape, inv_scale: float, generator) -> torch.Tensor:
    """Values over the codes' range and beyond it, a fifth exactly halfway between two codes."""
    x = torch.randn(shape, generator=generator) * 60 / inv_scale
    halves = (torch.randint(-140, 140, shape, generator=generator) + 0.5) / inv_scale
    return torch.where(torch.rand(shape, generator=generator) < 0.2, halves, x)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("qmin", [-127, -128])
@pytest.mark.parametrize("channels_last", [False, True])
def test_the_kernel_writes_the_emulations_codes(dtype, qmin, channels_last):
    """A power-of-two scale keeps the halfway values exact (ties to even); 2·3·37·29 values leave the
    last program partly masked."""
    generator = torch.Generator().manual_seed(50)
    inv_scale = 4.0
    x = _values((2, 3, 37, 29), inv_scale, generator).to(dtype)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    expected = quantize(x, inv_scale, qmin)
    assert expected.min() == qmin and expected.max() == 127  # saturated at both ends
    on_device = x.to(DEVICE)
    out = torch.empty_like(on_device, dtype=torch.int8)
    assert kernel.quantize_kernel_applies(on_device, out)
    assert quantize_into(on_device, out, inv_scale, qmin) is out
    assert torch.equal(out.cpu(), expected)


def test_the_codes_of_an_unround_scale_round_the_float32_product():
    """An engine's scale (1/0.0157): the product is rounded to float32 before the rounding add, as
    `quantize` rounds it (no fused multiply-add)."""
    generator = torch.Generator().manual_seed(51)
    inv_scale = 1 / 0.0157
    x = _values((4, 3, 16, 16), inv_scale, generator).to(DEVICE)
    out = torch.empty_like(x, dtype=torch.int8)
    quantize_into(x, out, inv_scale, -127)
    assert torch.equal(out.cpu(), quantize(x.cpu(), inv_scale, -127))


@pytest.mark.parametrize("source", ["channels_last", "sliced"])
def test_the_kernel_reads_any_4d_source_by_its_strides_into_nchw(source):
    """A channels-last image (a camera's interleaved frames seen as NCHW) and a cut of a wider one
    (gaps between its rows) into a contiguous NCHW buffer: the codes at their places."""
    generator = torch.Generator().manual_seed(53)
    if source == "channels_last":
        on_device = _values((2, 3, 11, 13), 4.0, generator).to(DEVICE).contiguous(memory_format=torch.channels_last)
    else:
        on_device = _values((2, 3, 11, 20), 4.0, generator).to(DEVICE)[..., 3:16]
    x = on_device.cpu()
    out = torch.empty(on_device.shape, dtype=torch.int8, device=DEVICE)
    assert kernel.quantize_kernel_applies(on_device, out) and not kernel.same_layout(on_device, out)
    assert torch.equal(quantize_into(on_device, out, 4.0, -127).cpu(), quantize(x, 4.0, -127))


def test_other_layouts_and_devices_take_pytorchs_ops(monkeypatch):
    """A buffer in another layout than the kernel writes (channels-last codes of an NCHW source), a
    source that is not 4-D in another layout, and a source on the CPU without the interpreter:
    `quantize`'s codes all the same, by PyTorch's ops."""
    generator = torch.Generator().manual_seed(52)
    x = _values((2, 3, 8, 8), 4.0, generator).to(DEVICE)
    out = torch.empty(x.shape, dtype=torch.int8, device=DEVICE).contiguous(memory_format=torch.channels_last)
    assert not kernel.quantize_kernel_applies(x, out)
    assert torch.equal(quantize_into(x, out, 4.0).cpu(), quantize(x.cpu(), 4.0))
    flat = x.reshape(6, 64).t()
    assert not kernel.quantize_kernel_applies(flat, torch.empty(flat.shape, dtype=torch.int8, device=DEVICE))
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    cpu = x.cpu().contiguous()
    assert not kernel.quantize_kernel_applies(cpu, torch.empty_like(cpu, dtype=torch.int8))


def test_it_refuses_a_buffer_it_cannot_fill():
    x = torch.zeros(2, 3, 4, 4)
    with pytest.raises(ValueError, match=r"writes int8 codes of shape \(2, 3, 4, 4\); got a torch.float32 buffer"):
        quantize_into(x, torch.empty_like(x), 1.0)
    with pytest.raises(ValueError, match=r"got a torch.int8 buffer of shape \(2, 3, 4\)"):
        quantize_into(x, torch.empty(2, 3, 4, dtype=torch.int8), 1.0)
