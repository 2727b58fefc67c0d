"""The one-pass residual add + LayerNorm kernel against torch's Add and layer_norm, through Triton's
interpreter on the CPU (natively on a GPU): every row tile, channel counts that are not powers of
two, row counts that do not fill the last program, with and without a bias; and the op's tactics."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

# conftest.py switches Triton to its interpreter when there is no GPU.
triton = pytest.importorskip("triton")

from sartor.kernels.norm.add_layernorm import (  # noqa: E402
    ADD_LAYERNORM_TILES, AddLayerNormTile, add_layernorm, add_layernorm_supported)
from sartor.kernels.registry import TacticNameError, parse_tactic  # noqa: E402
from sartor.ops.norm import add_layer_norm, add_layernorm_tactics  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("tile", ADD_LAYERNORM_TILES, ids=lambda t: t.name)
@pytest.mark.parametrize("shape,dtype,with_bias", [((2, 7, 96), torch.float32, True), ((13, 384), torch.float16, True),
                                                   ((3, 5, 20), torch.float32, False), ((1, 1, 7), torch.float16, True)])
def test_kernel_matches_add_then_layer_norm(tile, shape, dtype, with_bias):
    generator = torch.Generator().manual_seed(0)
    a, b = (torch.randn(shape, generator=generator).to(DEVICE, dtype) for _ in range(2))
    channels = shape[-1]
    weight = (1 + 0.3 * torch.randn(channels, generator=generator)).to(DEVICE, dtype)
    bias = (0.2 * torch.randn(channels, generator=generator)).to(DEVICE, dtype) if with_bias else None
    total, normed = add_layernorm(a, b, weight, bias, 1e-5, tile.rows)
    expected_total = a + b
    assert torch.equal(total, expected_total)  # the Add's own rounding
    expected = F.layer_norm(expected_total.float(), (channels,), weight.float(), None if bias is None else bias.float(),
                            1e-5)
    tolerance = 2e-3 if dtype == torch.float16 else 1e-5
    torch.testing.assert_close(normed.float(), expected, rtol=tolerance, atol=tolerance)


def test_tile_names_parse_back_and_bad_ones_are_refused():
    assert [t.name for t in ADD_LAYERNORM_TILES] == ["add_layernorm.r1", "add_layernorm.r4", "add_layernorm.r16"]
    assert parse_tactic("add_layernorm.r4") == AddLayerNormTile(4)
    with pytest.raises(TacticNameError, match="not a add_layernorm tactic"):
        parse_tactic("add_layernorm.r3")


def test_the_kernel_is_offered_on_cuda_for_equal_contiguous_operands_only():
    a, weight = torch.randn(4, 8), torch.ones(8)
    assert add_layernorm_supported(a, a, weight, None)
    assert not add_layernorm_supported(a, a[:1], weight, None)  # broadcast
    assert not add_layernorm_supported(a, a.t().contiguous().t(), weight, None)  # not contiguous
    assert not add_layernorm_supported(a, a, torch.ones(4), None)  # scale over another axis
    assert add_layernorm_tactics([a, a, weight], {}) == ["torch"]  # a CPU tensor: the reference only
    if DEVICE == "cuda":
        assert add_layernorm_tactics([a.cuda(), a.cuda(), weight.cuda()], {})[1:] == [t.name for t in ADD_LAYERNORM_TILES]


def test_every_tactic_of_the_op_computes_the_reference():
    generator = torch.Generator().manual_seed(1)
    a, b = torch.randn(6, 32, generator=generator).to(DEVICE), torch.randn(6, 32, generator=generator).to(DEVICE)
    weight, bias = torch.rand(32, generator=generator).to(DEVICE), torch.randn(32, generator=generator).to(DEVICE)
    reference = add_layer_norm([a, b, weight, bias], {"epsilon": 1e-5, "tactic": "torch"})
    for tile in ADD_LAYERNORM_TILES:
        total, normed = add_layer_norm([a, b, weight, bias], {"epsilon": 1e-5, "tactic": tile.name})
        torch.testing.assert_close(total, reference[0])
        torch.testing.assert_close(normed, reference[1], rtol=1e-5, atol=1e-5)
