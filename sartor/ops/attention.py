"""Attention: softmax(scale · q @ k_t + bias, last axis) @ v as one layer, made by
`passes/fuse_attention.py` from the MatMul, Mul, Add, Softmax, MatMul that exporters write.

Inputs (q, k_t, v, bias?): q [..., Lq, D]; k_t [..., D, Lk], the key already transposed as the
first MatMul read it; v [..., Lk, Dv]; bias (relative-position bias, masks) broadcastable to the
scores [..., Lq, Lk]. Leading dims broadcast as MatMul's do, at any rank. Attribute `scale`.
With attribute `windows` W (Swin's shifted windows, passes/fuse_window_attention.py), q, k_t and v
have their images × W windows in the first dim, and the bias [1, W, heads, Lq, Lk] is per window:
the layer views them as [images, W, ...] (a view), the bias broadcasting over the images.
With attribute `rows_before_heads` (passes/fold_attention_transpose.py) the output is [..., Lq,
heads, Dv], the dim before the rows moved after them, as the Transpose that merges the heads into
the channels reads it: the one-kernel tactic writes it so, the others transpose their result.

Tactics: `torch` (the reference: float32 math, the unfused graph's result), `sdpa`
(torch's scaled_dot_product_attention: flash or memory-efficient kernels on CUDA, which keep the
scores in float32 registers and never write them out), `unfused` (matmul, softmax, matmul in the
layer's dtype, q scaled first so that FP16 scores hold the scaled values only) and, on CUDA for
sequences of up to 128 tokens, `attention.short.*` (kernels/attention/short.py: the whole layer in
one Triton kernel, which adds a per-window bias where SDPA takes only a mask it must expand).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..kernels.attention.short import ShortAttentionTile, short_attention, short_attention_fits, short_tiles_for
from ..kernels.common.interpreter import kernel_runs_on
from ..kernels.registry import REFERENCE, TacticNameError, fixed_tactic, parse_tactic
from .registry import OpTable

OPS = OpTable("attention")

SDPA = "sdpa"
UNFUSED = "unfused"
fixed_tactic(SDPA, "torch scaled_dot_product_attention (flash / memory-efficient kernels on CUDA)")
fixed_tactic(UNFUSED, "torch matmul, softmax, matmul")

SDPA_RANK = 4  # [batch, heads, tokens, dim]: the rank the fused CUDA kernels take


def attention_tactics(inputs: list, attrs: dict, effort: int = 2) -> list[str]:
    """The reference, SDPA and the unfused kernels everywhere; on CUDA, where the sequences are short
    enough, the one-kernel tiles too."""
    tactics = [REFERENCE, SDPA, UNFUSED]
    q, k_t, v, bias = _operands(_by_window(inputs, attrs))
    if q.is_cuda and short_attention_fits(q, k_t, v, bias):
        tactics += [tile.name for tile in short_tiles_for(q.shape[-2])]
    return tactics


def _operands(inputs: list) -> tuple:
    q, k_t, v = inputs[0], inputs[1], inputs[2]
    bias = inputs[3] if len(inputs) > 3 else None
    return q, k_t, v, bias


def _by_window(inputs: list, attrs: dict) -> list:
    """q, k_t and v with the windows split out of their first dim, when the layer has `windows`."""
    windows = attrs.get("windows")
    if not windows:
        return inputs
    return [t.reshape(-1, windows, *t.shape[1:]) for t in inputs[:3]] + list(inputs[3:])


def attention_scores(inputs: list, attrs: dict) -> torch.Tensor:
    """scale · q @ k_t + bias in float32 (float64 stays float64): the values the softmax reads, which
    the precision planner's FP16 overflow guard measures (they are never a layer's output)."""
    q, k_t, _, bias = _operands(_by_window(inputs, attrs))
    compute = torch.promote_types(q.dtype, torch.float32)
    scores = torch.matmul(q.to(compute), k_t.to(compute)) * attrs["scale"]
    return scores if bias is None else scores + bias.to(compute)


def _reference(inputs: list, attrs: dict) -> torch.Tensor:
    q, _, v, _ = _operands(inputs)
    probabilities = torch.softmax(attention_scores(inputs, attrs), -1)
    return torch.matmul(probabilities, v.to(probabilities.dtype)).to(q.dtype)


def _unfused(inputs: list, attrs: dict) -> torch.Tensor:
    q, k_t, v, bias = _operands(inputs)
    # Scaling q (Lq·D values) before the product rather than the scores (Lq·Lk) after it: FP16
    # scores then only ever hold scaled values, which is where the unfused graph's would overflow.
    scores = torch.matmul(q * attrs["scale"], k_t.to(q.dtype))
    if bias is not None:
        scores = scores + bias.to(scores.dtype)
    # torch's softmax accumulates half-precision inputs in float32, as the reference does.
    return torch.matmul(torch.softmax(scores, -1), v.to(scores.dtype))


def _as_rank4(t: torch.Tensor, batch: tuple, tail: tuple) -> torch.Tensor:
    """`t`, broadcast to batch + tail, as the 4-D tensor SDPA's fused kernels take: leading dims of
    one prepended, or the leading batch dims flattened into one (a view when `t` does not broadcast
    over them, else one copy)."""
    rank = len(batch) + len(tail)
    if rank <= SDPA_RANK:
        return t.reshape((1,) * (SDPA_RANK - t.dim()) + tuple(t.shape))
    padded = t.reshape((1,) * (rank - t.dim()) + tuple(t.shape))
    flattened = rank - SDPA_RANK + 1  # the leading dims that become one
    if all(d == 1 for d in padded.shape[:flattened]):
        return padded.reshape((1,) + tuple(padded.shape[flattened:]))
    return padded.expand(batch + tail).reshape((-1,) + tuple(batch[flattened:]) + tail)


def _sdpa(inputs: list, attrs: dict) -> torch.Tensor:
    q, k_t, v, bias = _operands(inputs)
    k, v = k_t.transpose(-1, -2).to(q.dtype), v.to(q.dtype)
    if bias is not None:  # a bias of rank < 2 broadcasts over the scores' rows and columns as the Add did
        bias = bias.to(q.dtype).reshape((1,) * max(0, 2 - bias.dim()) + tuple(bias.shape))
    # The Add broadcasts the scores up to the bias's rows, columns and batch dims where those are
    # larger; expanding q's rows and k's columns (views) gives SDPA the same scores.
    rows, cols = (1, 1) if bias is None else tuple(bias.shape[-2:])
    lq = torch.broadcast_shapes((q.shape[-2],), (rows,))[0]
    lk = torch.broadcast_shapes((k.shape[-2],), (cols,))[0]
    shapes = [q.shape[:-2], k.shape[:-2], v.shape[:-2]] + ([bias.shape[:-2]] if bias is not None else [])
    batch = tuple(torch.broadcast_shapes(*shapes))
    q4 = _as_rank4(q.expand(batch + (lq, q.shape[-1])), batch, (lq, q.shape[-1]))
    k4 = _as_rank4(k.expand(batch + (lk, k.shape[-1])), batch, (lk, k.shape[-1]))
    v4 = _as_rank4(v.expand(batch + tuple(v.shape[-2:])), batch, tuple(v.shape[-2:]))
    mask = None if bias is None else _as_rank4(bias.expand(bias.shape[:-2] + (lq, lk)), batch, (lq, lk))
    # The fused CUDA kernels read rows of contiguous features; given anything else SDPA falls back
    # to its unfused math, which is slower than one copy (k_t made by a MatMul rather than a view).
    q4, k4, v4 = (t if t.stride(-1) == 1 else t.contiguous() for t in (q4, k4, v4))
    out = F.scaled_dot_product_attention(q4, k4, v4, attn_mask=mask, scale=attrs["scale"])
    return out.reshape(batch + (lq, v.shape[-1]))


def _short(inputs: list, attrs: dict) -> torch.Tensor:
    """The one-kernel tile the layer chose; the reference where the kernel cannot run (a CPU tensor
    outside Triton's interpreter) or does not fit (shapes other than those it was chosen at)."""
    q, k_t, v, bias = _operands(inputs)
    rows_first = bool(attrs.get("rows_before_heads"))
    if not (kernel_runs_on(q) and short_attention_fits(q, k_t, v, bias)):
        out = _reference(inputs, attrs)
        return out.transpose(-3, -2) if rows_first else out
    return short_attention(q, k_t, v, bias, attrs["scale"], parse_tactic(attrs["tactic"]), rows_before_heads=rows_first)


_TACTICS = {REFERENCE: _reference, SDPA: _sdpa, UNFUSED: _unfused}


def _tactic(name: str):
    if name in _TACTICS:
        return _TACTICS[name]
    if isinstance(parse_tactic(name), ShortAttentionTile):
        return _short
    raise TacticNameError(f"tactic {name!r} is not one of the Attention layer's")


@OPS.internal("Attention", tactics=attention_tactics, eager_tactic=SDPA)
def attention(inputs, attrs):
    tactic = _tactic(attrs.get("tactic") or REFERENCE)
    out = tactic(_by_window(inputs, attrs), dict(attrs, windows=None))
    if attrs.get("rows_before_heads") and tactic is not _short:  # the kernel writes that layout itself
        out = out.transpose(-3, -2)
    return out.reshape(-1, *out.shape[2:]) if attrs.get("windows") else out
