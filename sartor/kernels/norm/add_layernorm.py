"""LayerNorm over the last axis in one pass, with or without a residual add before it, and with its
rows read or written through a row table.

A transformer block ends each of its two branches with `x = x + branch(x)` and starts the next with
`LayerNorm(x)`: two kernels, the sum written by one and read back by the other. `add_layernorm` reads
a and b once and writes s (the residual stream the block after reads) and y. The sum is rounded to
its dtype before the statistics, as the separate Add's output is; the statistics are FP32.
`layernorm` is the same kernel without the add (the stem's and the patch mergers' LayerNorms), and
writes the mean and inverse deviation ONNX's LayerNormalization also returns.

Row tables (`RowTable`, made by passes/gather_rows.py and folded in by passes/fuse_layernorm_rows.py):
Swin's shifted windows move whole rows of C channels, so the kernel can read its input rows, or its
residual operand's rows, through a per-image table instead of a copy doing it first. Row r of an
image reads input row `table[r]` of the same image; each row is C contiguous channels, so the loads
stay coalesced.

Tiles: ROWS rows of BLOCK_C (the channel count rounded up to a power of two) per program; the
builder times the row counts as tactics (`add_layernorm.r<ROWS>`, `layernorm.r<ROWS>`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from ..common.cache_keys import settle_cache_keys
from ..registry import Flag, LayerFacts, Number, Tactic, register

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU runtime does not need Triton
    triton = None

MAX_CHANNELS = 16384  # one row's channels in registers
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _valid_rows(rows: int) -> str | None:
    return None if 0 < rows <= 64 and rows & (rows - 1) == 0 else "rows: a power of 2 up to 64"


def _rows_text(tile) -> str:
    apart = ", the row gather apart (torch index_select)" if tile.apart else ""
    return f"{tile.rows} row(s) per program{apart}"


@register
@dataclass(frozen=True)
class AddLayerNormTile(Tactic):
    """AddLayerNorm's Triton tactic: rows per program, and for a layer with row tables whether the
    rows are gathered apart first rather than by the kernel. Named e.g. "add_layernorm.r4",
    "add_layernorm.r4.apart"."""
    rows: int
    apart: bool = False

    FAMILY: ClassVar[str] = "add_layernorm"
    SCHEME: ClassVar[tuple] = (Number("rows", "r"), Flag("apart", "apart"))

    def invalid(self) -> str | None:
        return _valid_rows(self.rows)

    def describe(self, layer: LayerFacts) -> str:
        return f"triton residual add + LayerNorm in one pass, {_rows_text(self)}"


@register
@dataclass(frozen=True)
class LayerNormTile(Tactic):
    """LayerNormalization's and GatherLayerNorm's Triton tactic (see AddLayerNormTile). Named e.g.
    "layernorm.r4", "layernorm.r4.apart"."""
    rows: int
    apart: bool = False

    FAMILY: ClassVar[str] = "layernorm"
    SCHEME: ClassVar[tuple] = (Number("rows", "r"), Flag("apart", "apart"))

    def invalid(self) -> str | None:
        return _valid_rows(self.rows)

    def describe(self, layer: LayerFacts) -> str:
        return f"triton LayerNorm over the last axis, {_rows_text(self)}"


# Few rows per program spread a batch-1 token grid over more of the GPU; more amortise the affine
# parameters' loads over a large batch.
ADD_LAYERNORM_TILES = (AddLayerNormTile(1), AddLayerNormTile(4), AddLayerNormTile(16))
LAYERNORM_TILES = (LayerNormTile(1), LayerNormTile(4), LayerNormTile(16))
# A layer with row tables also times the gather apart: the fused form reads (or writes) rows out
# of order, which may cost more than one more copy does.
ADD_LAYERNORM_APART = tuple(AddLayerNormTile(tile.rows, apart=True) for tile in ADD_LAYERNORM_TILES)
LAYERNORM_APART = tuple(LayerNormTile(tile.rows, apart=True) for tile in LAYERNORM_TILES)


@dataclass(frozen=True)
class RowTable:
    """Rows of a [images · rows_in, C] operand through a table: row r of image i (r < len(table)) is
    operand row i · rows_in + table[r]."""
    table: torch.Tensor  # int64, on the operand's device
    rows_in: int

    @property
    def rows_out(self) -> int:
        return int(self.table.numel())


if triton is not None:
    @triton.jit
    def _source_rows(row, table_ptr, live, rows_out, rows_in):
        """The operand rows that `row` reads through a per-image table."""
        image = row // rows_out
        return image * rows_in + tl.load(table_ptr + (row - image * rows_out), mask=live, other=0)

    @triton.jit
    def _add_layernorm_kernel(a_ptr, b_ptr, w_ptr, bias_ptr, s_ptr, y_ptr, mean_ptr, rstd_ptr, table_ptr,
                              b_table_ptr, rows, channels, eps, table_out, table_in, b_table_out, b_table_in,
                              HAS_B: tl.constexpr, HAS_BIAS: tl.constexpr, STATS: tl.constexpr,
                              GATHER: tl.constexpr, GATHER_B: tl.constexpr,
                              ROWS: tl.constexpr, BLOCK_C: tl.constexpr):
        # `row` counts output rows; `src` the rows of a (and of the sum) they normalise.
        row = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
        live = row < rows
        if GATHER:
            src = _source_rows(row, table_ptr, live, table_out, table_in)
        else:
            src = row
        col = tl.arange(0, BLOCK_C)[None, :]
        in_row = col < channels
        mask = live[:, None] & in_row
        x = tl.load(a_ptr + src[:, None] * channels + col, mask=mask, other=0.0).to(tl.float32)
        if HAS_B:
            if GATHER_B:
                b_src = _source_rows(src, b_table_ptr, live, b_table_out, b_table_in)
            else:
                b_src = src
            b = tl.load(b_ptr + b_src[:, None] * channels + col, mask=mask, other=0.0).to(tl.float32)
            s = (x + b).to(s_ptr.dtype.element_ty)
            tl.store(s_ptr + src[:, None] * channels + col, s, mask=mask)
            x = s.to(tl.float32)
        mean = tl.sum(x, axis=1) / channels
        centred = tl.where(mask, x - mean[:, None], 0.0)
        inv = 1.0 / tl.sqrt(tl.sum(centred * centred, axis=1) / channels + eps)
        y = centred * inv[:, None] * tl.load(w_ptr + col, mask=in_row, other=0.0).to(tl.float32)
        if HAS_BIAS:
            y += tl.load(bias_ptr + col, mask=in_row, other=0.0).to(tl.float32)
        tl.store(y_ptr + row[:, None] * channels + col, y.to(y_ptr.dtype.element_ty), mask=mask)
        if STATS:
            tl.store(mean_ptr + row, mean, mask=live)
            tl.store(rstd_ptr + row, inv, mask=live)


def _affine_fits(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    channels = x.shape[-1] if x.dim() else 0
    return (x.dtype in FLOAT_DTYPES and x.is_contiguous() and 0 < channels <= MAX_CHANNELS and x.numel() > 0
            and tuple(weight.shape) == (channels,) and (bias is None or tuple(bias.shape) == (channels,)))


def table_output_rows(table: RowTable, operand: torch.Tensor) -> int | None:
    """The rows `table` makes of `operand` ([images · rows_in, C]); None where the operand is not
    whole images of rows_in rows."""
    operand_rows = operand.numel() // operand.shape[-1] if operand.dim() else 0
    if table.rows_out <= 0 or table.rows_in <= 0 or operand_rows % table.rows_in:
        return None
    return operand_rows // table.rows_in * table.rows_out


def add_layernorm_supported(a: torch.Tensor, b: torch.Tensor, weight: torch.Tensor,
                            bias: torch.Tensor | None, rows: RowTable | None = None,
                            b_rows: RowTable | None = None) -> bool:
    """Whether the kernel takes these operands: a float dtype, contiguous, the affine parameters one
    per channel of the last axis; b of a's shape, or of a's rows through `b_rows`; `rows` (the output
    rows) a permutation of each image's rows, for every row of the sum is written once (the caller
    checks that the table is one)."""
    if triton is None or a.dim() < 1 or not _affine_fits(a, weight, bias) or b.dtype != a.dtype \
            or not b.is_contiguous() or b.dim() < 1 or b.shape[-1] != a.shape[-1]:
        return False
    a_rows = a.numel() // a.shape[-1]
    if b_rows is None:
        if b.shape != a.shape:
            return False
    elif table_output_rows(b_rows, b) != a_rows:
        return False
    return rows is None or (rows.rows_out == rows.rows_in and table_output_rows(rows, a) == a_rows)


def layernorm_supported(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                        rows: RowTable | None = None) -> bool:
    """Whether `layernorm` takes these operands (see add_layernorm_supported)."""
    if triton is None or x.dim() < 1 or not _affine_fits(x, weight, bias):
        return False
    return rows is None or table_output_rows(rows, x) is not None


def _warps(block: int, rows_per_program: int) -> int:
    return 8 if block * rows_per_program >= 8192 else 4 if block * rows_per_program >= 1024 else 1


def _launch(a, b, weight, bias, s, y, mean, rstd, rows: int, eps: float, rows_per_program: int,
            table: RowTable | None, b_table: RowTable | None) -> None:
    channels = a.shape[-1]
    has_bias = bias is not None
    weight = weight.to(device=a.device, dtype=a.dtype).contiguous()
    bias = bias.to(device=a.device, dtype=a.dtype).contiguous() if has_bias else weight  # unread
    block = triton.next_power_of_2(channels)
    unused = weight  # a pointer for the arguments a variant does not read
    _add_layernorm_kernel[(triton.cdiv(rows, rows_per_program),)](
        a, unused if b is None else b, weight, bias, unused if s is None else s, y,
        unused if mean is None else mean, unused if rstd is None else rstd,
        unused if table is None else table.table, unused if b_table is None else b_table.table,
        rows, channels, float(eps),
        1 if table is None else table.rows_out, 1 if table is None else table.rows_in,
        1 if b_table is None else b_table.rows_out, 1 if b_table is None else b_table.rows_in,
        HAS_B=b is not None, HAS_BIAS=has_bias, STATS=mean is not None, GATHER=table is not None,
        GATHER_B=b_table is not None, ROWS=rows_per_program, BLOCK_C=block,
        num_warps=_warps(block, rows_per_program))


def add_layernorm(a: torch.Tensor, b: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float,
                  rows_per_program: int = 4, rows: RowTable | None = None,
                  b_rows: RowTable | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(s, y) = (a + b, LayerNorm(a + b) over the last axis) in one launch; see add_layernorm_supported.
    With `b_rows`, b's rows are read through it; with `rows`, y's row r is the sum's row through
    `rows` (y is then [rows, C], for the caller to shape). s has a's shape."""
    channels = a.shape[-1]
    count = a.numel() // channels
    s = torch.empty_like(a)
    y = torch.empty_like(a) if rows is None else torch.empty((count, channels), dtype=a.dtype, device=a.device)
    _launch(a, b, weight, bias, s, y, None, None, count, eps, rows_per_program, rows, b_rows)
    return s, y


def layernorm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float,
              rows_per_program: int = 4, rows: RowTable | None = None,
              stats: bool = True) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """(y, mean, inverse deviation) of LayerNorm over the last axis in one launch, the statistics in
    FP32 ([rows], or None without `stats`). With `rows`, output row r normalises x's row through
    `rows`; y is [rows, C] for the caller to shape."""
    channels = x.shape[-1]
    count = x.numel() // channels if rows is None else table_output_rows(rows, x)
    y = torch.empty((count, channels), dtype=x.dtype, device=x.device)
    mean, rstd = (torch.empty(count, dtype=torch.float32, device=x.device) for _ in range(2)) if stats else (None, None)
    _launch(x, None, weight, bias, None, y, mean, rstd, count, eps, rows_per_program, rows, None)
    return y, mean, rstd


settle_cache_keys(globals())
