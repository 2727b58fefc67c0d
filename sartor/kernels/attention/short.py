"""Attention over short sequences in one kernel: softmax(scale · q @ k_t + bias) @ v, the scores kept
in registers (float32) and never written out.

Swin's window attention has 49 tokens (7×7 windows) and head dims of 32: the scores of one
(window, head) are a 64×64 tile once padded, so one program holds a block of query rows against
every key, with no loop over keys and no running maximum (flash attention's online softmax is for
sequences that do not fit). The unfused layer writes and reads the scores five times (product,
scale, bias, softmax, product); this reads q, k_t, v and the bias once and writes the output once.

Operands are [outer, heads, rows, cols] in strides, read where they lie: q [., ., Lq, D], k_t
[., ., D, Lk], v [., ., Lk, Dv], bias [., ., Lq, Lk] (any of its dims of stride 0: broadcast), the
output [., ., Lq, Dv]. An operand's outer offset is (o mod period) · stride: Swin's per-window
bias [1, W, heads, L, L] read by [images · W] windows has period W, a broadcast operand period 1.

Tiles (`attention.short.b<rows>.w<warps>`): a program computes `rows` query rows (a power of two,
16 to 128) of one (outer, head) pair with `warps` warps; keys and head dims are padded to powers of
two (at least 16, tl.dot's least) and masked.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from ..common.cache_keys import settle_cache_keys
from ..registry import Choice, LayerFacts, Number, Tactic, register

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU runtime does not need Triton
    triton = None

MAX_TOKENS = 128  # Lq and Lk: the scores of a program's rows against every key stay in registers
MAX_HEAD_DIM = 128
DOT_MIN = 16  # tl.dot's least extent in every dim
KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
SHORT = "short"


@register
@dataclass(frozen=True)
class ShortAttentionTile(Tactic):
    """The Attention layer's Triton tactic for sequences of up to 128 tokens: query rows per
    program and warps. Named e.g. "attention.short.b64.w4"."""
    rows: int
    warps: int
    form: str = SHORT

    FAMILY: ClassVar[str] = "attention"
    SCHEME: ClassVar[tuple] = (Choice("form", {SHORT: SHORT}), Number("rows", "b"), Number("warps", "w"))

    def invalid(self) -> str | None:
        if not (DOT_MIN <= self.rows <= MAX_TOKENS and self.rows & (self.rows - 1) == 0):
            return f"rows: a power of 2 from {DOT_MIN} to {MAX_TOKENS}"
        return None if self.warps in (1, 2, 4, 8) else "warps: 1, 2, 4 or 8"

    def describe(self, layer: LayerFacts) -> str:
        return (f"triton attention in one pass (scores in registers), {self.rows} query rows per program, "
                f"{self.warps} warp(s)")


# One warp per 16 query rows: each warp then owns one tl.dot row block of the scores.
SHORT_TILES = (ShortAttentionTile(16, 1), ShortAttentionTile(32, 2), ShortAttentionTile(64, 4),
               ShortAttentionTile(128, 8))


def padded(extent: int) -> int:
    """An extent as the kernel's tiles hold it: the next power of two, at least tl.dot's least."""
    return max(DOT_MIN, 1 << max(0, math.ceil(math.log2(max(1, extent)))))


def short_tiles_for(query_rows: int) -> list[ShortAttentionTile]:
    """The tiles worth timing for `query_rows` rows: those within the padded rows, down to a quarter of
    them (smaller blocks only repeat the loads of k_t, v and the bias per block)."""
    rows = padded(query_rows)
    return [tile for tile in SHORT_TILES if rows // 4 <= tile.rows <= rows]


if triton is not None:
    @triton.jit
    def _short_attention_kernel(q_ptr, k_ptr, v_ptr, bias_ptr, out_ptr, heads, row_blocks, lq, lk, dim, dim_v,
                                scale,
                                q_period, q_so, q_sh, q_sm, q_sd,
                                k_period, k_so, k_sh, k_sd, k_sn,
                                v_period, v_so, v_sh, v_sn, v_sd,
                                b_period, b_so, b_sh, b_sm, b_sn,
                                o_so, o_sh, o_sm, o_sd,
                                HAS_BIAS: tl.constexpr, PRECISION: tl.constexpr, ROWS: tl.constexpr,
                                BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr):
        # One flat grid axis (its limit is 2^31, the others' 65535): row block fastest, then head.
        pid = tl.program_id(0)
        block = pid % row_blocks
        pair = pid // row_blocks
        head = (pair % heads).to(tl.int64)
        outer = (pair // heads).to(tl.int64)
        m = block * ROWS + tl.arange(0, ROWS)
        n = tl.arange(0, BLOCK_N)
        d = tl.arange(0, BLOCK_D)
        e = tl.arange(0, BLOCK_DV)
        live_m, live_n = m < lq, n < lk

        q_base = q_ptr + (outer % q_period) * q_so + head * q_sh
        q = tl.load(q_base + m[:, None] * q_sm + d[None, :] * q_sd, mask=live_m[:, None] & (d[None, :] < dim),
                    other=0.0)
        k_base = k_ptr + (outer % k_period) * k_so + head * k_sh
        k = tl.load(k_base + d[:, None] * k_sd + n[None, :] * k_sn, mask=(d[:, None] < dim) & live_n[None, :],
                    other=0.0)
        scores = tl.dot(q, k, input_precision=PRECISION) * scale
        if HAS_BIAS:
            b_base = bias_ptr + (outer % b_period) * b_so + head * b_sh
            scores += tl.load(b_base + m[:, None] * b_sm + n[None, :] * b_sn,
                              mask=live_m[:, None] & live_n[None, :], other=0.0).to(tl.float32)
        scores = tl.where(live_n[None, :], scores, float("-inf"))
        # Padded query rows see finite scores (zeros), so no row of exponentials is all NaN.
        weights = tl.exp(scores - tl.max(scores, axis=1)[:, None])
        total = tl.sum(weights, axis=1)

        v_base = v_ptr + (outer % v_period) * v_so + head * v_sh
        v = tl.load(v_base + n[:, None] * v_sn + e[None, :] * v_sd, mask=live_n[:, None] & (e[None, :] < dim_v),
                    other=0.0)
        # Unnormalised weights are at most 1, so they hold in v's dtype; the sum divides the output.
        out = tl.dot(weights.to(v.dtype), v, input_precision=PRECISION) / total[:, None]
        o_base = out_ptr + outer * o_so + head * o_sh
        tl.store(o_base + m[:, None] * o_sm + e[None, :] * o_sd, out.to(out_ptr.dtype.element_ty),
                 mask=live_m[:, None] & (e[None, :] < dim_v))


@dataclass(frozen=True)
class Operand:
    """An operand as the kernel reads it: [outer, heads, rows, cols] with the outer index taken
    modulo `period` (1 where the operand broadcasts over every outer index)."""
    tensor: torch.Tensor
    period: int
    strides: tuple  # outer, head, row, column

    def args(self) -> tuple:
        return (self.period,) + self.strides


def _outer_period_stride(shape: tuple, strides: tuple) -> tuple[int, int] | None:
    """(period, stride) such that outer index o (flat over `shape`) is at (o mod period) · stride,
    or None: leading broadcast dims (stride 0) give the period, the rest must merge into one stride."""
    dims = [(size, stride) for size, stride in zip(shape, strides) if size != 1]
    while dims and dims[0][1] == 0:
        dims.pop(0)
    if not dims:
        return 1, 0
    for (_, outer_stride), (size, inner_stride) in zip(dims, dims[1:]):
        if outer_stride != inner_stride * size:
            return None
    return math.prod(size for size, _ in dims), dims[-1][1]


def as_operand(t: torch.Tensor, batch: tuple, tail: tuple) -> Operand:
    """`t` broadcast to batch + tail (a view), as the kernel reads it; an operand whose outer dims
    do not merge into one (period, stride) is copied first."""
    expanded = t.reshape((1,) * (len(batch) + len(tail) - t.dim()) + tuple(t.shape)).expand(batch + tail)
    outer_shape = batch[:-1]
    head_stride = expanded.stride(len(batch) - 1) if batch else 0
    found = _outer_period_stride(outer_shape, expanded.stride()[:len(outer_shape)])
    if found is None:
        expanded = expanded.contiguous()
        found = _outer_period_stride(outer_shape, expanded.stride()[:len(outer_shape)])
    period, outer_stride = found
    return Operand(expanded, period, (outer_stride, head_stride) + tuple(expanded.stride()[len(batch):]))


def short_attention_fits(q: torch.Tensor, k_t: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether the kernel computes this attention: q, k_t and v of one float dtype it reads, sequences
    of at most MAX_TOKENS, head dims of at most MAX_HEAD_DIM, leading dims that broadcast, and a bias
    broadcasting to the scores without enlarging their rows or columns."""
    if triton is None or min(q.dim(), k_t.dim(), v.dim()) < 2 or q.dtype not in KERNEL_DTYPES \
            or k_t.dtype != q.dtype or v.dtype != q.dtype:
        return False
    (lq, dim), (dim_k, lk), (lv, dim_v) = q.shape[-2:], k_t.shape[-2:], v.shape[-2:]
    if dim != dim_k or lv != lk or not (0 < lq <= MAX_TOKENS and 0 < lk <= MAX_TOKENS) \
            or not (0 < dim <= MAX_HEAD_DIM and 0 < dim_v <= MAX_HEAD_DIM):
        return False
    shapes = [q.shape[:-2], k_t.shape[:-2], v.shape[:-2]]
    if bias is not None:
        if not bias.dtype.is_floating_point or bias.dtype == torch.float64:
            return False
        rows, cols = ((1, 1) + tuple(bias.shape))[-2:]
        if rows not in (1, lq) or cols not in (1, lk):
            return False
        shapes.append(bias.shape[:-2])
    try:
        batch = torch.broadcast_shapes(*shapes)
    except RuntimeError:
        return False
    return math.prod(batch) > 0


def short_attention(q: torch.Tensor, k_t: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None, scale: float,
                    tile: ShortAttentionTile, rows_before_heads: bool = False) -> torch.Tensor:
    """softmax(scale · q @ k_t + bias) @ v in q's dtype, [batch..., heads, Lq, Dv] (contiguous), or
    with `rows_before_heads` [batch..., Lq, heads, Dv] (heads: the last batch dim), the layout a
    Transpose merging the heads into the channels wants; see short_attention_fits. Operands may be
    strided views."""
    lq, dim = q.shape[-2:]
    lk, dim_v = v.shape[-2:]
    shapes = [q.shape[:-2], k_t.shape[:-2], v.shape[:-2]] + ([bias.shape[:-2]] if bias is not None else [])
    full_batch = tuple(torch.broadcast_shapes(*shapes))
    if rows_before_heads and not full_batch:
        raise ValueError("rows_before_heads needs a heads dim before the rows")
    batch = full_batch or (1,)
    operands = [as_operand(q, batch, (lq, dim)), as_operand(k_t, batch, (dim, lk)), as_operand(v, batch, (lk, dim_v))]
    bias_operand = as_operand(bias if bias.dim() >= 2 else bias.reshape((1,) * (2 - bias.dim()) + tuple(bias.shape)),
                              batch, (lq, lk)) if bias is not None else operands[0]  # unread without a bias
    heads, outer = batch[-1], math.prod(batch[:-1])
    if rows_before_heads:
        out = torch.empty(batch[:-1] + (lq, heads, dim_v), dtype=q.dtype, device=q.device)
        out_strides = (lq * heads * dim_v, dim_v, heads * dim_v, 1)  # outer, head, row, column
    else:
        out = torch.empty(batch + (lq, dim_v), dtype=q.dtype, device=q.device)
        out_strides = (heads * lq * dim_v, lq * dim_v, dim_v, 1)
    rows = min(tile.rows, padded(lq))
    row_blocks = triton.cdiv(lq, rows)
    _short_attention_kernel[(outer * heads * row_blocks,)](
        operands[0].tensor, operands[1].tensor, operands[2].tensor, bias_operand.tensor, out,
        heads, row_blocks, lq, lk, dim, dim_v, float(scale),
        *operands[0].args(), *operands[1].args(), *operands[2].args(), *bias_operand.args(),
        *out_strides,
        HAS_BIAS=bias is not None, PRECISION="ieee" if q.dtype == torch.float32 else "tf32", ROWS=rows,
        BLOCK_N=padded(lk), BLOCK_D=padded(dim), BLOCK_DV=padded(dim_v), num_warps=tile.warps)
    return out if rows_before_heads else out.reshape(full_batch + (lq, dim_v))


settle_cache_keys(globals())
