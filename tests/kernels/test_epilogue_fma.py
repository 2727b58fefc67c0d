"""The INT8 epilogue's fused multiply-adds: a residual stored as codes is added with its scale in one
rounding, and the output is requantized from the exact product (ops/quantized.py, steps 4 and 5).
The emulation against exact rational arithmetic, and the kernels' epilogue (`tile_steps`, through
`accumulator_epilogue`: the interpreter's float64 path on CPU, the fma instruction on a GPU) against
the emulation, on rows where one rounding and two differ."""
from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest
import torch

from sartor.ops import quantized
from sartor.ops.quantized import fused_multiply_add, quantize, requantize

triton = pytest.importorskip("triton")

from sartor.kernels.conv.igemm import accumulator_epilogue  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _float32(value: float) -> float:
    return float(np.float32(value))


def _rounded_to_float32(exact: Fraction) -> float:
    """The float32 nearest to `exact`, ties to the even significand."""
    guess = np.float32(float(exact))
    neighbours = [np.nextafter(guess, np.float32(-np.inf)), guess, np.nextafter(guess, np.float32(np.inf))]
    return float(min(neighbours, key=lambda f: (abs(Fraction(float(f)) - exact),
                                                int(np.float32(f).view(np.uint32)) & 1)))


def test_fused_multiply_add_rounds_the_exact_value_once():
    generator = torch.Generator().manual_seed(0)
    codes = torch.randint(-128, 128, (3000,), generator=generator).float()
    # Addends across 60 binades, so that some exact sums need more than float64's 53 bits.
    addends = (torch.randn(3000, generator=generator)
               * torch.exp2(torch.randint(-30, 30, (3000,), generator=generator).float())).float()
    two_roundings_differ = 0
    for scale in (0.0123456789, 3.3e-7, 1234.5678):
        fused = fused_multiply_add(codes, scale, addends)
        two_roundings = codes * _float32(scale) + addends
        two_roundings_differ += int((fused != two_roundings).sum())
        for code, addend, result in zip(codes.tolist(), addends.tolist(), fused.tolist()):
            exact = Fraction(code) * Fraction(_float32(scale)) + Fraction(addend)
            assert result == _rounded_to_float32(exact), (code, scale, addend)
    assert two_roundings_differ > 100  # the cases where the definition matters were among them


def test_fused_multiply_add_does_not_round_twice_through_float64():
    """3 · (1 + 2^-23) = 3 + 2^-22 + 2^-23 lies halfway between two float32 values; an addend of
    ∓2^-60 decides the side. Its float64 sum rounds back to the halfway point, and a second rounding
    to float32 would go to the even neighbour whatever the addend's sign; one rounding does not."""
    code, scale = torch.tensor([3.0, 3.0]), 1 + 2.0 ** -23
    addends = torch.tensor([-(2.0 ** -60), 2.0 ** -60])
    fused = fused_multiply_add(code, scale, addends)
    assert fused.tolist() == [3 + 2.0 ** -22, 3 + 2.0 ** -21]
    through_float64 = (code.double() * scale + addends.double()).float()
    assert through_float64.tolist() == [3 + 2.0 ** -21, 3 + 2.0 ** -21]


def test_requantize_rounds_the_exact_product_half_to_even():
    generator = torch.Generator().manual_seed(1)
    values = torch.randn(200_000, generator=generator) * 40
    inv_scale = 0.7310001
    codes = requantize(values, inv_scale)
    exact = [max(-127, min(127, round(Fraction(v) * Fraction(_float32(inv_scale))))) for v in values.tolist()]
    assert codes.tolist() == exact  # Python rounds a Fraction half to even
    # `quantize` (a float layer input, as the packing kernels round it) rounds the float32 product
    # first: here that crosses a half for some values, so the two definitions differ.
    assert (quantize(values, inv_scale) != codes).any()
    assert requantize(torch.tensor([0.5, 1.5, 2.5, -0.5, -1.5, 1e9, -1e9]), 1.0).tolist() == [0, 2, 2, 0, -2, 127, -127]


RESIDUAL_SCALE, OUTPUT_INV_SCALE = 0.0371, 7.77


def _two_roundings(acc, dequant_scale, residual, activation, after):
    """What the epilogue computed before it was defined with fused multiply-adds."""
    y = acc.to(torch.float32) * dequant_scale
    scaled = residual.to(torch.float32) * _float32(RESIDUAL_SCALE)
    if not after:
        y = y + scaled
    if activation == "Relu":
        y = torch.relu(y)
    if after:
        y = y + scaled
    return quantize(y, OUTPUT_INV_SCALE)


def _rows_where_the_roundings_differ(activation: str | None, after: bool):
    """64 rows of a 16-channel layer where one rounding and two give a different code somewhere,
    then 64 others. Each accumulator is chosen so that its output lands near a half code, where
    the last bit of a rounding decides the code (about 6% of elements differ; at random about one
    in 10^6 does)."""
    generator = torch.Generator().manual_seed(2)
    count, channels, dequant = 8192, 16, _float32(1e-5)
    residual = torch.randint(-128, 128, (count,), generator=generator, dtype=torch.int32)
    # Above 40 codes when the ReLU comes before the residual: the layer's own value stays positive.
    lowest = 40 if after else 0 if activation == "Relu" else -100
    halves = torch.randint(lowest, 110, (count,), generator=generator).double() + 0.5
    target = halves / _float32(OUTPUT_INV_SCALE) - residual * _float32(RESIDUAL_SCALE)
    acc = torch.round(target / dequant).to(torch.int32).reshape(-1, channels)
    residual = residual.to(torch.int8).reshape(-1, channels)
    dequant_scale = torch.full((channels,), dequant)
    attrs = dict(residual_scale=RESIDUAL_SCALE, output_inv_scale=OUTPUT_INV_SCALE, activation=activation,
                 residual_after_activation=after)
    emulated = quantized._epilogue(quantized._dequantize(acc, None, dequant_scale, -1), residual, attrs)
    differing = (emulated != _two_roundings(acc, dequant_scale, residual, activation, after)).any(dim=1)
    assert int(differing.sum()) >= 64
    rows = torch.cat([differing.nonzero().flatten()[:64], (~differing).nonzero().flatten()[:64]])
    return acc[rows].contiguous(), residual[rows].contiguous(), dequant_scale, attrs


@pytest.mark.parametrize("activation,after", [("Relu", False), (None, False), ("Relu", True)])
def test_the_kernels_epilogue_equals_the_emulation_where_one_rounding_differs_from_two(activation, after):
    acc, residual, dequant_scale, attrs = _rows_where_the_roundings_differ(activation, after)
    expected = quantized._epilogue(quantized._dequantize(acc, None, dequant_scale, -1), residual, attrs)
    out = accumulator_epilogue(acc.to(DEVICE), tuple(acc.shape), None, dequant_scale=dequant_scale.to(DEVICE),
                               residual=residual.to(DEVICE), activation=activation,
                               residual_after_activation=after, residual_scale=RESIDUAL_SCALE,
                               output_inv_scale=OUTPUT_INV_SCALE)
    assert torch.equal(out.cpu(), expected)
    assert not torch.equal(out.cpu(), _two_roundings(acc, dequant_scale, residual, activation, after))


def test_the_kernels_residual_add_does_not_round_twice_through_float64():
    """The case above through the kernels' epilogue (float output): the layer's value ∓2^-60 plus
    code 3 at scale 1 + 2^-23 (interpreted: `_fma_round_to_odd`; on a GPU: the fma instruction)."""
    acc = torch.tensor([[-1], [1]], dtype=torch.int32)
    out = accumulator_epilogue(acc.to(DEVICE), (2, 1), None, dequant_scale=torch.tensor([2.0 ** -60]).to(DEVICE),
                               residual=torch.tensor([[3], [3]], dtype=torch.int8).to(DEVICE),
                               residual_scale=1 + 2.0 ** -23)
    assert out.cpu().flatten().tolist() == [3 + 2.0 ** -22, 3 + 2.0 ** -21]
