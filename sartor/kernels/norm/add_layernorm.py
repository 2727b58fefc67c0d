"""A residual add and the LayerNorm that reads it, in one pass: s = a + b, y = LayerNorm(s) over the
last axis, both written.

A transformer block ends each of its two branches with `x = x + branch(x)` and starts the next with
`LayerNorm(x)`: two kernels, the sum written by one and read back by the other. This one reads a
and b once and writes s (the residual stream the block after reads) and y. The sum is rounded to
its dtype before the statistics, as the separate Add's output is; the statistics are FP32.

Tiles: ROWS rows of BLOCK_C (the channel count rounded up to a power of two) per program; the
builder times the row counts as tactics (`add_layernorm.r<ROWS>`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from ..common.cache_keys import settle_cache_keys
from ..registry import LayerFacts, Number, Tactic, register

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU runtime does not need Triton
    triton = None

MAX_CHANNELS = 16384  # one row's channels in registers


@register
@dataclass(frozen=True)
class AddLayerNormTile(Tactic):
    """AddLayerNorm's Triton tactic: rows per program. Named e.g. "add_layernorm.r4"."""
    rows: int

    FAMILY: ClassVar[str] = "add_layernorm"
    SCHEME: ClassVar[tuple] = (Number("rows", "r"),)

    def invalid(self) -> str | None:
        return None if 0 < self.rows <= 64 and self.rows & (self.rows - 1) == 0 else "rows: a power of 2 up to 64"

    def describe(self, layer: LayerFacts) -> str:
        return f"triton residual add + LayerNorm in one pass, {self.rows} row(s) per program"


# Few rows per program spread a batch-1 token grid over more of the GPU; more amortise the affine
# parameters' loads over a large batch.
ADD_LAYERNORM_TILES = (AddLayerNormTile(1), AddLayerNormTile(4), AddLayerNormTile(16))


if triton is not None:
    @triton.jit
    def _add_layernorm_kernel(a_ptr, b_ptr, w_ptr, bias_ptr, s_ptr, y_ptr, rows, channels, eps,
                              HAS_BIAS: tl.constexpr, ROWS: tl.constexpr, BLOCK_C: tl.constexpr):
        row = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)[:, None]
        col = tl.arange(0, BLOCK_C)[None, :]
        in_row = col < channels
        mask = (row < rows) & in_row
        offsets = row * channels + col
        a = tl.load(a_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        b = tl.load(b_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        s = (a + b).to(s_ptr.dtype.element_ty)
        tl.store(s_ptr + offsets, s, mask=mask)
        x = s.to(tl.float32)
        mean = tl.sum(x, axis=1) / channels
        centred = tl.where(mask, x - mean[:, None], 0.0)
        inv = 1.0 / tl.sqrt(tl.sum(centred * centred, axis=1) / channels + eps)
        y = centred * inv[:, None] * tl.load(w_ptr + col, mask=in_row, other=0.0).to(tl.float32)
        if HAS_BIAS:
            y += tl.load(bias_ptr + col, mask=in_row, other=0.0).to(tl.float32)
        tl.store(y_ptr + offsets, y.to(y_ptr.dtype.element_ty), mask=mask)


def add_layernorm_supported(a: torch.Tensor, b: torch.Tensor, weight: torch.Tensor,
                            bias: torch.Tensor | None) -> bool:
    """Whether the kernel takes these operands: equal shapes, both contiguous, a float dtype, the
    affine parameters one per channel of the last axis."""
    channels = a.shape[-1] if a.dim() else 0
    return (triton is not None and a.dim() >= 1 and a.shape == b.shape and a.dtype == b.dtype
            and a.dtype in (torch.float16, torch.bfloat16, torch.float32)
            and a.is_contiguous() and b.is_contiguous() and 0 < channels <= MAX_CHANNELS and a.numel() > 0
            and tuple(weight.shape) == (channels,) and (bias is None or tuple(bias.shape) == (channels,)))


def add_layernorm(a: torch.Tensor, b: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float,
                  rows_per_program: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """(a + b, LayerNorm(a + b) over the last axis) in one launch; see add_layernorm_supported."""
    channels = a.shape[-1]
    rows = a.numel() // channels
    s, y = torch.empty_like(a), torch.empty_like(a)
    has_bias = bias is not None
    weight = weight.to(device=a.device, dtype=a.dtype).contiguous()
    bias = bias.to(device=a.device, dtype=a.dtype).contiguous() if has_bias else weight  # unread
    block = triton.next_power_of_2(channels)
    warps = 8 if block * rows_per_program >= 8192 else 4 if block * rows_per_program >= 1024 else 1
    _add_layernorm_kernel[(triton.cdiv(rows, rows_per_program),)](
        a, b, weight, bias, s, y, rows, channels, float(eps), HAS_BIAS=has_bias,
        ROWS=rows_per_program, BLOCK_C=block, num_warps=warps)
    return s, y


settle_cache_keys(globals())
