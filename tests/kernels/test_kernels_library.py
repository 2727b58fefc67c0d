"""The library GEMM tactics of INT8/FP8 1×1 convolutions and GEMMs (`sartor/ops/quantized_library.py`):
torch._int_mm / torch._scaled_mm, then the Triton epilogue over their accumulators. Against the
emulation (INT8 bit for bit, FP8 within one e4m3 step), where they apply and where they must not.
On CPU tensors torch's own CPU GEMMs and Triton's interpreter run them; on a GPU, cuBLAS."""
from __future__ import annotations

import pytest
import torch
from int8_layers import on_device, random_int8_conv, random_int8_gemm

pytest.importorskip("triton")

from sartor.kernels.conv.igemm import ConvGeometry, accumulator_epilogue, pack_weight  # noqa: E402
from sartor.ops.fp8 import QFORMAT, code_distance, quantize_fp8  # noqa: E402
from sartor.ops.quantized import _qlayer_library, qconv, qconv_into, qgemm  # noqa: E402
from sartor.ops.quantized_library import INT_MM, SCALED_MM, library_applies  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FP8_GEMM = DEVICE == "cpu" or torch.cuda.get_device_capability() >= (8, 9)


@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("int8_output", [True, False])
@pytest.mark.parametrize("codes_in", [False, True])
def test_int_mm_conv_equals_the_emulation(residual, int8_output, codes_in):
    x, wq, bias, res, scale, attrs = random_int8_conv(torch.Generator().manual_seed(1), 32, 48, residual=residual,
                                                      int8_output=int8_output, codes=codes_in)
    expected = qconv([x, wq, bias, res, scale], attrs)
    out = _qlayer_library(on_device(x, DEVICE), pack_weight(wq).to(DEVICE), bias.to(DEVICE), on_device(res, DEVICE),
                          scale.to(DEVICE), attrs, INT_MM, gemm=False)
    assert out is not None, "the tactic did not apply"
    assert out.dtype == expected.dtype and out.is_contiguous(memory_format=torch.channels_last)
    assert torch.equal(out.cpu(), expected)
    through_the_op = qconv([on_device(x, DEVICE), pack_weight(wq).to(DEVICE), bias.to(DEVICE), on_device(res, DEVICE),
                            scale.to(DEVICE)], dict(attrs, tactic=INT_MM))
    assert torch.equal(through_the_op.cpu(), expected)


def test_int_mm_gemm_and_a_concat_slice_equal_the_emulation():
    generator = torch.Generator().manual_seed(2)
    x, wq, bias, scale, attrs = random_int8_gemm(generator, 40, 64, 32)
    expected = qgemm([x, wq, bias, None, scale], attrs)
    out = _qlayer_library(x.to(DEVICE), pack_weight(wq).to(DEVICE), bias.to(DEVICE), None, scale.to(DEVICE), attrs,
                          INT_MM, gemm=True)
    assert out is not None and torch.equal(out.cpu(), expected)
    xc, wc, bc, _, sc, conv_attrs = random_int8_conv(generator, 32, 48, residual=False)
    expected = qconv([xc, wc, bc, None, sc], conv_attrs)
    buffer = torch.full((2, 60, 5, 4), 9, dtype=torch.int8).contiguous(memory_format=torch.channels_last).to(DEVICE)
    into = buffer.narrow(1, 6, 48)
    written = qconv_into([on_device(xc, DEVICE), pack_weight(wc).to(DEVICE), bc.to(DEVICE), None, sc.to(DEVICE)],
                         dict(conv_attrs, tactic=INT_MM), into)
    assert written is not None and written.data_ptr() == into.data_ptr()
    assert torch.equal(buffer[:, 6:54].cpu(), expected) and (buffer[:, :6] == 9).all() and (buffer[:, 54:] == 9).all()


@pytest.mark.skipif(not FP8_GEMM, reason="FP8 GEMMs need compute capability 8.9+")
def test_scaled_mm_conv_matches_the_emulation_within_one_step():
    generator = torch.Generator().manual_seed(3)
    attrs = {"kernel_shape": [1, 1], "pads": [0, 0, 0, 0], "qformat": QFORMAT, "input_inv_scale": 20.0,
             "output_inv_scale": 8.0, "activation": "Relu"}
    x = torch.randn(2, 32, 5, 4, generator=generator)
    wq = quantize_fp8(torch.randn(48, 32, 1, 1, generator=generator), 100.0)
    bias, scale = torch.randn(48, generator=generator), torch.rand(48, generator=generator) * 1e-3
    expected = qconv([x, wq, bias, None, scale], attrs)
    out = _qlayer_library(on_device(x, DEVICE), pack_weight(wq).to(DEVICE), bias.to(DEVICE), None, scale.to(DEVICE),
                          attrs, SCALED_MM, gemm=False)
    assert out is not None and out.dtype == torch.float8_e4m3fn
    assert int(code_distance(out.cpu(), expected).max()) <= 1


def test_library_tactics_apply_to_dense_1x1_layers_of_library_shapes_only():
    one = ConvGeometry((1, 1), (1, 1), (0, 0), (1, 1), (8, 8))
    x = torch.zeros(2, 32, 8, 8).contiguous(memory_format=torch.channels_last)
    w = torch.zeros(48, 32, 1, 1, dtype=torch.int8)
    assert library_applies(x, w, one)
    assert library_applies(torch.zeros(17, 32), torch.zeros(48, 32, dtype=torch.int8), ConvGeometry.gemm())
    assert not library_applies(torch.zeros(16, 32), torch.zeros(48, 32, dtype=torch.int8), ConvGeometry.gemm())
    assert not library_applies(torch.zeros(2, 32, 8, 8), w, one)  # NCHW
    wide = torch.zeros(2, 40, 8, 8).contiguous(memory_format=torch.channels_last)
    assert not library_applies(wide[:, 4:36], w, one)  # a channel slice: pixels 40 apart, not 32
    assert not library_applies(torch.zeros(2, 24, 8, 8).contiguous(memory_format=torch.channels_last),
                               torch.zeros(48, 24, 1, 1, dtype=torch.int8), one)  # K not a multiple of 16
    assert not library_applies(x, torch.zeros(40, 32, 1, 1, dtype=torch.int8), one)  # Cout not a multiple of 16
    assert not library_applies(x, torch.zeros(48, 32, 3, 3, dtype=torch.int8),
                               ConvGeometry((3, 3), (1, 1), (1, 1), (1, 1), (8, 8)))
    assert not library_applies(x, w, ConvGeometry((1, 1), (2, 2), (0, 0), (1, 1), (4, 4)))
    with pytest.raises(ValueError, match="not row-major int32"):
        accumulator_epilogue(torch.zeros(4, 8, device=DEVICE), (4, 8), None, dequant_scale=torch.ones(8, device=DEVICE))
