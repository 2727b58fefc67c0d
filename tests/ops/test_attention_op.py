"""ops/attention.py: every tactic of the Attention layer equals the unfused matmul/softmax/matmul it
replaces, with and without a bias, at ranks 3 to 5, with broadcasting batch dims and biases; on
CUDA in FP16, eagerly and inside a CUDA graph capture. The one-kernel tile runs through Triton's
interpreter on the CPU (tests/kernels/test_kernels_attention_short.py has its own cases)."""
from __future__ import annotations

import pytest
import torch

from sartor.ops import default_registry
from sartor.ops.attention import SDPA, UNFUSED, attention_scores, attention_tactics

ATTENTION = default_registry()["Attention"]
SHORT_TILE = "attention.short.b16.w1"
TACTICS = (SDPA, UNFUSED, SHORT_TILE)


def unfused_graph(q, k_t, v, bias, scale):
    """What the exported graph computes: MatMul, Mul, Add, Softmax, MatMul in float64."""
    scores = torch.matmul(q.double(), k_t.double()) * scale
    if bias is not None:
        scores = scores + bias.double()
    return torch.matmul(torch.softmax(scores, -1), v.double())


def operands(q_shape, lk, dv, bias_shape, dtype=torch.float32, device="cpu", seed=0):
    generator = torch.Generator().manual_seed(seed)
    *batch, lq, d = q_shape

    def random(*shape, spread=1.0):
        return (torch.randn(*shape, generator=generator) * spread).to(device=device, dtype=dtype)
    q, k_t, v = random(*q_shape, spread=2.0), random(*batch, d, lk, spread=2.0), random(*batch, lk, dv)
    bias = random(*bias_shape, spread=3.0) if bias_shape is not None else None
    return [q, k_t, v] + ([bias] if bias is not None else [])


CASES = {
    "rank3": ((2, 7, 16), 9, 8, None),
    "rank3_bias": ((2, 7, 16), 9, 8, (7, 9)),
    "rank4": ((2, 3, 7, 16), 9, 8, None),
    "rank4_bias_per_head": ((2, 3, 7, 16), 9, 8, (3, 7, 9)),  # LeViT's attention biases
    "rank4_bias_per_key": ((2, 3, 7, 16), 9, 8, (1, 1, 1, 9)),  # a padding mask
    "rank5_bias_per_window": ((2, 4, 3, 7, 16), 9, 8, (4, 1, 7, 9)),  # Swin's window masks, batch flattened
}


@pytest.mark.parametrize("tactic", TACTICS)
@pytest.mark.parametrize("case", list(CASES))
def test_attention_tactics_match_the_unfused_graph_on_the_cpu(case, tactic):
    inputs = operands(*CASES[case])
    attrs = {"scale": 0.25}
    expected = unfused_graph(*inputs[:3], inputs[3] if len(inputs) > 3 else None, 0.25)
    reference = ATTENTION.impl(inputs, attrs)
    out = ATTENTION.impl(inputs, dict(attrs, tactic=tactic))
    assert reference.dtype == out.dtype == torch.float32 and out.shape == expected.shape
    torch.testing.assert_close(reference.double(), expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tactic", TACTICS)
def test_attention_tactics_broadcast_batch_dims_and_a_bias_larger_than_the_scores(tactic):
    # One head of keys shared by 3 query heads; a bias with a batch dim and rows that the scores
    # ([3, 1, 6]: one query row) broadcast up to, as the Add of the unfused graph does.
    generator = torch.Generator().manual_seed(3)
    q, k_t, v = torch.randn(3, 1, 8, generator=generator), torch.randn(1, 8, 6, generator=generator), \
        torch.randn(1, 6, 4, generator=generator)
    bias = torch.randn(2, 3, 5, 6, generator=generator)
    expected = unfused_graph(q, k_t, v, bias, 0.5)
    out = ATTENTION.impl([q, k_t, v, bias], {"scale": 0.5, "tactic": tactic})
    assert out.shape == expected.shape == (2, 3, 5, 4)
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)


def test_attention_offers_the_reference_first_and_runs_it_without_a_tactic():
    inputs = operands(*CASES["rank4_bias_per_head"])
    assert attention_tactics(inputs, {"scale": 0.25}) == ["torch", SDPA, UNFUSED]
    assert torch.equal(ATTENTION.impl(inputs, {"scale": 0.25}), ATTENTION.impl(inputs, {"scale": 0.25, "tactic": "torch"}))
    scores = attention_scores(inputs, {"scale": 0.25})
    assert scores.shape == (2, 3, 7, 9) and scores.dtype == torch.float32


def test_attention_fp16_reference_keeps_large_scores_finite():
    # q·k reaches ~1e5 before the 1/8 scale: FP16 products would be inf; every tactic scales first
    # or accumulates in float32.
    q = torch.full((1, 1, 4, 64), 40.0, dtype=torch.float16)
    k_t = torch.full((1, 1, 64, 4), 40.0, dtype=torch.float16)
    v = torch.randn(1, 1, 4, 8).to(torch.float16)
    for tactic in ("torch",) + TACTICS:
        out = ATTENTION.impl([q, k_t, v], {"scale": 0.125, "tactic": tactic})
        assert out.dtype == torch.float16 and torch.isfinite(out).all(), tactic
        torch.testing.assert_close(out.float(), v.float().mean(-2, keepdim=True).expand(1, 1, 4, 8), rtol=1e-2, atol=1e-2)


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@cuda
@pytest.mark.parametrize("tactic", TACTICS)
@pytest.mark.parametrize("case", ["rank3_bias", "rank4", "rank4_bias_per_head", "rank5_bias_per_window"])
def test_attention_tactics_in_fp16_on_cuda_eager_and_captured(case, tactic):
    q_shape, lk, dv, bias_shape = CASES[case]
    inputs = operands((*q_shape[:-2], 64, 64), 64, 64, bias_shape and (*bias_shape[:-2], 64, 64),
                      dtype=torch.float16, device="cuda")
    attrs = {"scale": 0.125, "tactic": tactic}
    expected = unfused_graph(*inputs[:3], inputs[3] if len(inputs) > 3 else None, 0.125)
    eager = ATTENTION.impl(inputs, attrs)
    assert eager.dtype == torch.float16
    torch.testing.assert_close(eager.double(), expected, rtol=2e-2, atol=2e-2)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        ATTENTION.impl(inputs, attrs)  # warm-up outside the capture (kernel selection, workspaces)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = ATTENTION.impl(inputs, attrs)
    for tensor in inputs:  # new values in the captured inputs: the replay must read them
        tensor.copy_(tensor.flip(-1))
    graph.replay()
    torch.cuda.synchronize()
    expected = unfused_graph(*inputs[:3], inputs[3] if len(inputs) > 3 else None, 0.125)
    torch.testing.assert_close(captured.double(), expected, rtol=2e-2, atol=2e-2)
