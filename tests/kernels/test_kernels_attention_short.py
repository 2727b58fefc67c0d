"""The one-kernel short-sequence attention (kernels/attention/short.py) against the unfused graph in
float64, through Triton's interpreter on the CPU (natively on a GPU): no bias, a bias per head,
Swin's per-window bias through the Attention op's `windows`, sequences that are not powers of two,
head dims from 8 to 64, strided operands (q, k_t, v as views of one qkv tensor, as Swin's export
makes them); every tile; names; and where the tactic is offered and where not.

Tolerances: float32 1e-5 (both products in IEEE float32, as torch's matmul); float16 5e-3 absolute
and relative on outputs of a few units (the output and the unnormalised weights rounded to FP16,
2^-11 relative each, summed over up to 64 keys); bfloat16 (CUDA only) 3e-2, for its 2^-8."""
from __future__ import annotations

import pytest
import torch

# conftest.py switches Triton to its interpreter when there is no GPU.
triton = pytest.importorskip("triton")

import sartor.ops.attention as attention_op  # noqa: E402
from sartor.kernels.attention.short import (  # noqa: E402
    SHORT_TILES, ShortAttentionTile, short_attention, short_attention_fits, short_tiles_for)
from sartor.kernels.registry import TacticNameError, parse_tactic  # noqa: E402
from sartor.ops import default_registry  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ATTENTION = default_registry()["Attention"]
TOLERANCE = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 3e-2}
# Triton's interpreter computes tl.dot of bfloat16 operands wrongly (by 1e10 on a 16 × 16 product).
BFLOAT16 = pytest.param(torch.bfloat16, id="torch.bfloat16", marks=pytest.mark.skipif(
    DEVICE != "cuda", reason="Triton's interpreter multiplies bfloat16 tiles wrongly"))


def unfused_graph(q, k_t, v, bias, scale):
    """MatMul, Mul, Add, Softmax, MatMul in float64."""
    scores = torch.matmul(q.double(), k_t.double()) * scale
    if bias is not None:
        scores = scores + bias.double()
    return torch.matmul(torch.softmax(scores, -1), v.double())


def random(generator, *shape, spread=1.0, dtype=torch.float32):
    return (torch.randn(*shape, generator=generator) * spread).to(DEVICE, dtype)


def assert_matches(out, q, k_t, v, bias, scale):
    expected = unfused_graph(q, k_t, v, bias, scale)
    assert out.dtype == q.dtype and out.shape == expected.shape
    tolerance = TOLERANCE[q.dtype]
    torch.testing.assert_close(out.double(), expected, rtol=tolerance, atol=tolerance)


# (q shape [..., Lq, D], Lk, Dv, bias shape or None)
CASES = {
    "no_bias": ((2, 3, 9, 16), 9, 16, None),
    "bias_per_head": ((2, 3, 9, 16), 9, 16, (3, 9, 9)),
    "bias_per_key": ((2, 2, 5, 16), 12, 8, (2, 1, 1, 12)),  # a padding mask, broadcast over heads and rows
    "rank3": ((3, 7, 8), 11, 24, (7, 11)),
    "head_dim_24": ((1, 2, 6, 24), 6, 24, (2, 6, 6)),
    "head_dim_64": ((1, 2, 6, 64), 6, 64, None),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, BFLOAT16], ids=str)
@pytest.mark.parametrize("case", list(CASES))
def test_kernel_matches_the_unfused_graph(case, dtype):
    q_shape, lk, dv, bias_shape = CASES[case]
    generator = torch.Generator().manual_seed(0)
    *batch, lq, d = q_shape
    q, k_t = random(generator, *q_shape, spread=2.0, dtype=dtype), random(generator, *batch, d, lk, dtype=dtype)
    v = random(generator, *batch, lk, dv, dtype=dtype)
    bias = None if bias_shape is None else random(generator, *bias_shape, spread=3.0, dtype=dtype)
    assert short_attention_fits(q, k_t, v, bias)
    out = short_attention(q, k_t, v, bias, 0.3, short_tiles_for(lq)[0])
    assert_matches(out, q, k_t, v, bias, 0.3)


def test_kernel_broadcasts_leading_dims_by_period_or_by_a_copy():
    # Batch [2, 3, heads]: k_t and v repeat over the first dim (a period of 3), q over the second,
    # which no (period, stride) describes: q is copied out first.
    generator = torch.Generator().manual_seed(4)
    q, k_t = random(generator, 2, 1, 2, 5, 16, spread=2.0), random(generator, 1, 3, 2, 16, 7)
    v, bias = random(generator, 3, 2, 7, 8), random(generator, 2, 1, 1, 5, 7, spread=3.0)
    assert short_attention_fits(q, k_t, v, bias)
    assert_matches(short_attention(q, k_t, v, bias, 0.5, ShortAttentionTile(16, 1)), q, k_t, v, bias, 0.5)


@pytest.mark.parametrize("tile", SHORT_TILES[:3], ids=lambda t: t.name)
def test_every_tile_computes_49_tokens(tile):
    # Swin's 7×7 windows: 49 queries and keys padded to 64, the last row block partly empty.
    generator = torch.Generator().manual_seed(1)
    q, k_t, v = random(generator, 2, 1, 49, 16), random(generator, 2, 1, 16, 49), random(generator, 2, 1, 49, 16)
    bias = random(generator, 1, 49, 49, spread=3.0)
    assert_matches(short_attention(q, k_t, v, bias, 0.25, tile), q, k_t, v, bias, 0.25)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_kernel_reads_q_k_t_and_v_as_strided_views_of_one_qkv_tensor(dtype):
    # timm's Swin: qkv [B, N, 3, heads, d] permuted to [3, B, heads, N, d], k transposed: none contiguous.
    generator = torch.Generator().manual_seed(2)
    images, tokens, heads, d = 2, 9, 3, 16
    qkv = random(generator, images, tokens, 3, heads, d, dtype=dtype).permute(2, 0, 3, 1, 4)
    q, k, v = qkv[0], qkv[1], qkv[2]
    k_t = k.transpose(-1, -2)
    bias = random(generator, heads, tokens, tokens, dtype=torch.float32).transpose(-1, -2)  # a strided bias too
    assert not any(t.is_contiguous() for t in (q, k_t, v, bias))
    assert_matches(short_attention(q, k_t, v, bias, 0.25, ShortAttentionTile(16, 1)), q, k_t, v, bias, 0.25)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_op_runs_the_kernel_for_swin_windows_with_a_bias_per_window(dtype, monkeypatch):
    # fuse_window_attention's layer: images × W windows in q's first dim, bias [1, W, heads, L, L]
    # (relative-position bias + shifted-window mask), broadcast over the images.
    generator = torch.Generator().manual_seed(3)
    images, windows, heads, tokens, d = 2, 4, 2, 9, 16
    q = random(generator, images * windows, heads, tokens, d, spread=2.0, dtype=dtype)
    k_t = random(generator, images * windows, heads, d, tokens, dtype=dtype)
    v = random(generator, images * windows, heads, tokens, d, dtype=dtype)
    mask = torch.zeros(1, windows, 1, tokens, tokens)
    mask[:, 1:, :, :, tokens // 2:] = -100.0  # as Swin masks the shifted windows' foreign tokens
    bias = (random(generator, 1, 1, heads, tokens, tokens, spread=3.0) + mask.to(DEVICE)).to(dtype)
    calls = []
    monkeypatch.setattr(attention_op, "short_attention",
                        lambda *args, **kwargs: calls.append(1) or short_attention(*args, **kwargs))
    out = ATTENTION.impl([q, k_t, v, bias], {"scale": 0.25, "windows": windows, "tactic": "attention.short.b16.w1"})
    assert calls == [1]
    by_window = [t.reshape(images, windows, *t.shape[1:]) for t in (q, k_t, v)]
    expected = unfused_graph(*by_window, bias, 0.25).reshape(images * windows, heads, tokens, d)
    assert out.shape == expected.shape and out.dtype == dtype
    torch.testing.assert_close(out.double(), expected, rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype])


def test_tile_names_parse_back_and_bad_ones_are_refused():
    assert [t.name for t in SHORT_TILES] == ["attention.short.b16.w1", "attention.short.b32.w2",
                                             "attention.short.b64.w4", "attention.short.b128.w8"]
    assert parse_tactic("attention.short.b64.w4") == ShortAttentionTile(64, 4)
    for bad in ("attention.short.b48.w4", "attention.short.b64.w3", "attention.b64.w4", "attention.short.b256.w8"):
        with pytest.raises(TacticNameError):
            parse_tactic(bad)
    with pytest.raises(TacticNameError, match="not one of the Attention layer's"):
        ATTENTION.impl([torch.ones(1, 2, 16), torch.ones(1, 16, 2), torch.ones(1, 2, 16)],
                       {"scale": 1.0, "tactic": "layernorm.r4"})


def test_tiles_offered_span_the_padded_rows_down_to_a_quarter():
    assert [t.rows for t in short_tiles_for(49)] == [16, 32, 64]
    assert [t.rows for t in short_tiles_for(7)] == [16]
    assert [t.rows for t in short_tiles_for(128)] == [32, 64, 128]


def _fitting(**changes):
    shapes = dict(q=(2, 3, 49, 32), k_t=(2, 3, 32, 49), v=(2, 3, 49, 32), bias=(1, 3, 49, 49))
    dtype = changes.pop("dtype", torch.float16)
    shapes.update(changes)
    return [None if shape is None else torch.zeros(shape, dtype=dtype) for shape in shapes.values()]


def test_kernel_fits_short_sequences_and_small_head_dims_only():
    assert short_attention_fits(*_fitting())
    assert short_attention_fits(*_fitting(bias=None))
    assert short_attention_fits(*_fitting(q=(2, 3, 128, 32), k_t=(2, 3, 32, 128), v=(2, 3, 128, 32), bias=None))
    assert not short_attention_fits(*_fitting(q=(2, 3, 129, 32), bias=None))  # too many queries
    assert not short_attention_fits(*_fitting(k_t=(2, 3, 32, 197), v=(2, 3, 197, 32), bias=None))  # ViT's 197 keys
    assert not short_attention_fits(*_fitting(q=(2, 3, 49, 256), k_t=(2, 3, 256, 49)))  # head dim
    assert not short_attention_fits(*_fitting(dtype=torch.float64))
    assert not short_attention_fits(*_fitting(bias=(3, 60, 49)))  # the bias enlarges the scores' rows
    assert not short_attention_fits(*_fitting(bias=(5, 3, 49, 49)))  # batch dims that do not broadcast


def test_tactic_is_offered_on_cuda_where_the_shapes_fit_only():
    inputs = _fitting(dtype=torch.float32)
    attrs = {"scale": 0.25}
    assert ATTENTION.tactics(inputs, attrs) == ["torch", "sdpa", "unfused"]  # CPU tensors: never the kernel
    if DEVICE == "cuda":
        cuda = [t.cuda() for t in inputs]
        assert ATTENTION.tactics(cuda, attrs)[3:] == ["attention.short.b16.w1", "attention.short.b32.w2",
                                                     "attention.short.b64.w4"]
        long = _fitting(q=(2, 3, 197, 32), k_t=(2, 3, 32, 197), v=(2, 3, 197, 32), bias=None, dtype=torch.float32)
        assert ATTENTION.tactics([t.cuda() for t in long[:3]], attrs) == ["torch", "sdpa", "unfused"]
        windowed = [t.cuda() for t in _fitting(q=(8, 3, 49, 32), k_t=(8, 3, 32, 49), v=(8, 3, 49, 32),
                                               bias=(1, 4, 3, 49, 49))]
        assert ATTENTION.tactics(windowed, dict(attrs, windows=4))[3:] == [t.name for t in short_tiles_for(49)]
