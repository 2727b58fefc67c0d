"""Shared by the INT8 kernel tests (library GEMMs, resident weights, TMA): random INT8 convolution
and GEMM layers as QConv and QGemm take them, and moving tensors to the test device in the layout
the kernels read."""
from __future__ import annotations

import torch

from sartor.ops.quantized import quantize


def random_int8_conv(generator: torch.Generator, channels: int, cout: int, *, kernel: int = 1,
                     hw: tuple[int, int] = (5, 4), residual: bool = True, int8_output: bool = True,
                     codes: bool = False) -> tuple:
    """(x, INT8 weight, int32 bias, INT8 residual or None, per-channel dequant scales, QConv attrs)
    for a stride-1, same-padded kernel × kernel convolution of a batch of 2 with ReLU. x is float
    (quantized by the layer on entry), or with `codes` already INT8 codes."""
    pad = kernel // 2
    attrs = {"kernel_shape": [kernel, kernel], "strides": [1, 1], "pads": [pad] * 4, "dilations": [1, 1],
             "input_inv_scale": 20.0, "activation": "Relu", "qmin": -127, "residual_scale": 0.03}
    if int8_output:
        attrs["output_inv_scale"] = 5.0
    x = torch.randn(2, channels, *hw, generator=generator) * 3
    if codes:
        x = quantize(x, attrs["input_inv_scale"])
    wq = torch.randint(-127, 128, (cout, channels, kernel, kernel), dtype=torch.int8, generator=generator)
    bias = torch.randint(-4000, 4000, (cout,), dtype=torch.int32, generator=generator)
    scale = torch.rand(cout, generator=generator) * 1e-3
    res = torch.randint(-127, 128, (2, cout, *hw), dtype=torch.int8, generator=generator) if residual else None
    return x, wq, bias, res, scale, attrs


def random_fp8_conv(generator: torch.Generator, channels: int, cout: int, *, kernel: int,
                    hw: tuple[int, int] = (7, 6)) -> tuple:
    """(x, weight, float32 bias, residual, per-channel dequant scales, QConv attrs) as FP8 codes
    for a stride-1, same-padded kernel × kernel convolution of a batch of 2 with ReLU, an FP8
    residual and FP8 output."""
    from sartor.ops import fp8
    pad = kernel // 2
    attrs = {"kernel_shape": [kernel, kernel], "strides": [1, 1], "pads": [pad] * 4, "dilations": [1, 1],
             "qformat": fp8.QFORMAT, "input_inv_scale": 50.0, "residual_scale": 0.02, "activation": "Relu",
             "output_inv_scale": 12.0}
    x = fp8.quantize_fp8(torch.randn(2, channels, *hw, generator=generator) * 2, 50.0)
    w = fp8.quantize_fp8(torch.randn(cout, channels, kernel, kernel, generator=generator), 100.0)
    bias = torch.randn(cout, generator=generator)
    scale = torch.rand(cout, generator=generator) * 1e-3 + 1e-4
    residual = fp8.quantize_fp8(torch.randn(2, cout, *hw, generator=generator), 50.0)
    return x, w, bias, residual, scale, attrs


def random_int8_gemm(generator: torch.Generator, rows: int, k: int, cout: int) -> tuple:
    """(x float [rows, k], INT8 weight [cout, k], int32 bias, per-channel dequant scales, QGemm attrs
    saturating at -128 as layers folded from Q/DQ do)."""
    attrs = {"input_inv_scale": 25.0, "output_inv_scale": 6.0, "qmin": -128}
    x = torch.randn(rows, k, generator=generator)
    wq = torch.randint(-127, 128, (cout, k), dtype=torch.int8, generator=generator)
    bias = torch.randint(-2000, 2000, (cout,), dtype=torch.int32, generator=generator)
    scale = torch.rand(cout, generator=generator) * 1e-3
    return x, wq, bias, scale, attrs


def residual_view(res: torch.Tensor, view: str) -> torch.Tensor:
    """`res` [N, C, H, W] stored as a view: cropped out of a larger channels-last tensor (pixels not
    evenly spaced), a channel slice of a wider one (evenly spaced), or NCHW."""
    n, c, h, w = res.shape
    if view == "cropped":
        larger = torch.zeros(n, c, h + 3, w + 2, dtype=res.dtype, device=res.device)
        larger = larger.contiguous(memory_format=torch.channels_last)
        larger[:, :, 1:h + 1, 2:w + 2] = res
        return larger[:, :, 1:h + 1, 2:w + 2]
    if view == "channel_slice":
        wider = torch.zeros(n, c + 9, h, w, dtype=res.dtype, device=res.device)
        wider = wider.contiguous(memory_format=torch.channels_last)
        wider[:, 4:c + 4] = res
        return wider[:, 4:c + 4]
    return res.contiguous()


def on_device(t: torch.Tensor | None, device: str) -> torch.Tensor | None:
    """`t` on `device`, channels-last when it is 4-D (as the kernels read activations)."""
    if t is None:
        return None
    return t.to(device).contiguous(memory_format=torch.channels_last) if t.dim() == 4 else t.to(device)


def assert_reads_and_writes_channel_slices(run, kernel: int, seed: int) -> None:
    """A kernel's INT8 conv reading a channel slice of a wider buffer (a Split's output) and writing
    into a Concat's slice gives the emulation's codes there and writes nothing outside it.
    `run(source, weight, bias, geometry, dequant_scale, attrs, out)` runs the kernel on the device
    tensors it is given (weight unpacked, on the device)."""
    from sartor.ops.conv import igemm_geometry
    from sartor.ops.quantized import qconv
    device = "cuda" if torch.cuda.is_available() else "cpu"
    generator = torch.Generator().manual_seed(seed)
    x, w, bias, _, scale, attrs = random_int8_conv(generator, 32, 24, kernel=kernel, hw=(6, 8), residual=False,
                                                   codes=True)
    wide = torch.zeros(2, 96, 6, 8, dtype=torch.int8).contiguous(memory_format=torch.channels_last)
    wide[:, 32:64] = x
    expected = qconv([x, w, bias, None, scale], attrs)
    source = wide.to(device)[:, 32:64]
    buffer = torch.zeros(2, 64, 6, 8, dtype=torch.int8, device=device).contiguous(memory_format=torch.channels_last)
    geometry = igemm_geometry(source, w, attrs, require_cuda=False)
    run(source, w.to(device), bias.to(device), geometry, scale.to(device), attrs, buffer[:, 16:40])
    assert torch.equal(buffer[:, 16:40].cpu(), expected)
    assert not buffer[:, :16].any() and not buffer[:, 40:].any()


def assert_fp8_conv_passes_the_builders_check(run, channels: int, cout: int, kernel: int, seed: int) -> None:
    """A kernel's FP8 conv (codes in and out, a residual) is held to the builder's own FP8
    criterion against the emulation (one e4m3 step): the tensor cores accumulate in float32 where
    the emulation is exact. `run(x, weight, bias, geometry, dequant_scale, residual, attrs)` runs the
    kernel on the device tensors it is given (weight unpacked) and returns its output."""
    from sartor.ops import fp8
    from sartor.ops.conv import igemm_geometry
    from sartor.ops.quantized import qconv
    from sartor.tactics.select import _mismatch
    device = "cuda" if torch.cuda.is_available() else "cpu"
    x, w, bias, residual, scale, attrs = random_fp8_conv(torch.Generator().manual_seed(seed), channels, cout,
                                                         kernel=kernel)
    reference = qconv([x, w, bias, residual, scale], attrs)
    xd = on_device(x, device)
    geometry = igemm_geometry(xd, w, attrs, require_cuda=False)
    y = run(xd, w.to(device), bias.to(device), geometry, scale.to(device), on_device(residual, device), attrs).cpu()
    assert y.dtype == fp8.DTYPE and _mismatch(y, reference) is None


def assert_qconv_runs_the_tactic(tactic: str, kernel: int, seed: int) -> None:
    """The op as the engine runs it: the weight stored for the tactic, the tactic in the attributes,
    and straight into a Concat's slice too, gives the emulation's codes; a float input (the producer
    was not INT8) is not the kernel's, and the emulation runs instead, with the same codes."""
    from sartor.ops.quantized import qconv, qconv_into, qlayer_weight_for_tactic
    device = "cuda" if torch.cuda.is_available() else "cpu"
    generator = torch.Generator().manual_seed(seed)
    x, w, bias, res, scale, attrs = random_int8_conv(generator, 64, 32, kernel=kernel, hw=(7, 9), codes=True)
    expected = qconv([x, w, bias, res, scale], attrs)
    stored = qlayer_weight_for_tactic(w.to(device), tactic)
    inputs = [on_device(x, device), stored, bias.to(device), on_device(res, device), scale.to(device)]
    assert torch.equal(qconv(inputs, dict(attrs, tactic=tactic)).cpu(), expected)
    buffer = torch.zeros(2, 64, 7, 9, dtype=torch.int8, device=device).contiguous(memory_format=torch.channels_last)
    assert qconv_into(inputs, dict(attrs, tactic=tactic), buffer[:, 32:]) is not None
    assert torch.equal(buffer[:, 32:].cpu(), expected)
    assert torch.equal(qconv([x.float().to(device) / attrs["input_inv_scale"], *inputs[1:]],
                             dict(attrs, tactic=tactic)).cpu(), expected)
