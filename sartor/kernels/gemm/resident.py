"""INT8 (FP8) 1×1 convolutions and GEMMs whose whole K is one block: the weight tile stays in the
program, which walks several row tiles with the layer's epilogue fused (tactics "resident.…").

Through the implicit-GEMM kernel, 1×1 layers over 64 channels did not speed up when their output
shrank (docs/decisions/kernel-resident-gemm.md): with K = 64 each of its programs loads one A tile
and one B tile, does one product and stores, and little of one program's memory latency hides
behind another's.
Here each program loads its BLOCK_N × K weight tile once and walks TILES consecutive row tiles, so
the software pipeline loads the next rows while this tile's products and epilogue run.

The arithmetic is `tile_steps`', step for step (`accumulate_dot`, `store_epilogue`): the output equals
the emulation's as the implicit-GEMM tiles' does.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ClassVar

import torch

from ..common.cache_keys import settle_cache_keys
from ..conv.igemm import NARROW_MAX_BLOCK_M, ConvGeometry, multiprocessors, narrow_block_n
from ..pointwise.epilogue import channels_last_output, pixel_stride, told_alignment, triton
from ..common.pdl import launch_options
from ..registry import PACKED_K_MAJOR, Choice, Dims, Flag, LayerFacts, Number, Tactic, register
from ..common.tile_steps import epilogue_arguments, residual_pixels

if triton is not None:
    import triton.language as tl

    from ..common.tile_steps import (accumulate_dot, load_column_halves, load_column_values, dequantize_tile, store_epilogue_halves,
                             store_epilogue_halves_given, store_epilogue_halves_loaded, load_residual_halves,
                             decode_codes_through_mma, int8_identity, load_residual_tile, pixel_coords)
    from ..common.pdl import await_previous_kernel
    from ..pointwise.epilogue import told_multiple

    @triton.jit
    def program_tiles(COUT, BLOCK_N: tl.constexpr, N_ADJACENT: tl.constexpr):
        """This program's (row group, column tile): with N_ADJACENT a 1-D grid in which one row
        group's column tiles run side by side (ResidentTile's "grouped"), else a (row groups, column
        tiles) grid."""
        if N_ADJACENT:
            column_tiles = tl.cdiv(COUT, BLOCK_N)
            row_group = tl.program_id(0) // column_tiles
            return row_group, tl.program_id(0) - row_group * column_tiles
        return tl.program_id(0), tl.program_id(1)

    @triton.jit
    def row_tile_run(row_group, M, COUT, TILES: tl.constexpr, BALANCED: tl.constexpr, N_ADJACENT: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        """(first row tile, how many) of this row group's run: TILES row tiles, or with BALANCED an
        equal share of all the layer's row tiles between the grid's row groups (the last runs may
        pass the end: their rows are masked)."""
        if BALANCED:
            groups = tl.num_programs(0)
            if N_ADJACENT:
                groups = groups // tl.cdiv(COUT, BLOCK_N)
            steps = tl.cdiv(tl.cdiv(M, BLOCK_M), groups)
            return row_group * steps, steps
        else:
            return row_group * TILES, TILES

    @triton.jit
    def _input_rows(offs_m, OH, OW, row, sn, sh, sw, STRIDED: tl.constexpr):
        """Where each output pixel's input row starts: `row` apart, or with STRIDED at pixel (n, oh·sh,
        ow·sw) of a strided 1×1 layer (sh, sw carry the stride)."""
        if STRIDED:
            n, oh, ow = pixel_coords(offs_m, OH, OW)
            return n.to(tl.int64) * sn + oh * sh + ow * sw
        return offs_m.to(tl.int64) * row

    @triton.jit
    def _projection_halves(p_ptr, pb, pbias_ptr, pscale_ptr, offs_m, m_ok, offs_n, n_ok, OH, OW, PK, p_row, spn,
                           sph, spw, p_inv_scale, qmin, INT8: tl.constexpr, FP8: tl.constexpr,
                           STRIDED: tl.constexpr, QUANTIZE_INPUT: tl.constexpr, HAS_BIAS: tl.constexpr,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_PK: tl.constexpr,
                           LOADED: tl.constexpr = False):
        """The projected residual of these rows, dequantized to float32 as the projection layer's own
        epilogue would give it before requantizing (see ops/quantized.py), in the two column halves
        the epilogue takes: the second product of a projected layer. LOADED: `pbias_ptr` and
        `pscale_ptr` hold the columns' values (`load_column_values`)."""
        offs_pk = tl.arange(0, BLOCK_PK)
        p_rows = _input_rows(offs_m, OH, OW, p_row, spn, sph, spw, STRIDED)
        a = tl.load(p_ptr + p_rows[:, None] + offs_pk[None, :], mask=m_ok[:, None] & (offs_pk < PK)[None, :],
                    other=0.0)
        if INT8:
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
        else:
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc = accumulate_dot(acc, a, pb, p_inv_scale, qmin, INT8, FP8, QUANTIZE_INPUT, BLOCK_PK)
        projected = dequantize_tile(acc, offs_n, n_ok, pbias_ptr, pscale_ptr, INT8, FP8, HAS_BIAS, LOADED)
        return tl.split(tl.permute(tl.reshape(projected, (BLOCK_M, 2, BLOCK_N // 2)), (0, 2, 1)))

    @triton.jit
    def _resident_gemm_kernel(
            x_ptr, w_ptr, bias_ptr, scale_ptr, res_ptr, y_ptr, p_ptr, pw_ptr, pbias_ptr, pscale_ptr,
            M, COUT, K, x_row, y_row, OH, OW, sxn, sxh, sxw, srn, src, srh, srw, PK, p_row, spn, sph, spw,
            in_inv_scale, p_inv_scale, res_scale, out_inv_scale, qmin, alpha, beta,
            INT8: tl.constexpr, FP8: tl.constexpr, QUANTIZE_INPUT: tl.constexpr, HAS_BIAS: tl.constexpr,
            HAS_RES: tl.constexpr, RES_QUANT: tl.constexpr, RES_AFTER: tl.constexpr, ACT: tl.constexpr,
            OUT_QUANT: tl.constexpr, TILES: tl.constexpr, RES_PREFETCH: tl.constexpr, N_ADJACENT: tl.constexpr,
            STRIDED: tl.constexpr,
            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr = False,
            HAS_PROJ: tl.constexpr = False, PROJ_STRIDED: tl.constexpr = False,
            PROJ_QUANTIZE_INPUT: tl.constexpr = False, PROJ_HAS_BIAS: tl.constexpr = False,
            BLOCK_PK: tl.constexpr = 32, COLUMNS_LOADED: tl.constexpr = False,
            PROJ_COLUMNS_LOADED: tl.constexpr = False, IN_ALIGN: tl.constexpr = 1, OUT_ALIGN: tl.constexpr = 1,
            BALANCED: tl.constexpr = False, RES_ALIGN: tl.constexpr = 1):
        # Channel counts and strides multiples of 8 that Triton cannot see (24, 40, 72 channels): told,
        # the input rows, the weight's rows and the epilogue's columns load and store as vectors.
        K = told_multiple(K, IN_ALIGN)
        x_row = told_multiple(x_row, IN_ALIGN)
        sxn = told_multiple(sxn, IN_ALIGN)
        sxh = told_multiple(sxh, IN_ALIGN)
        sxw = told_multiple(sxw, IN_ALIGN)
        COUT = told_multiple(COUT, OUT_ALIGN)
        y_row = told_multiple(y_row, OUT_ALIGN)
        srn, srh, srw = told_multiple(srn, RES_ALIGN), told_multiple(srh, RES_ALIGN), told_multiple(srw, RES_ALIGN)
        row_group, column_tile = program_tiles(COUT, BLOCK_N, N_ADJACENT)
        offs_n = column_tile * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        n_ok = offs_n < COUT
        k_ok = offs_k < K
        b = tl.load(w_ptr + offs_n.to(tl.int64)[None, :] * K + offs_k[:, None], mask=n_ok[None, :] & k_ok[:, None],
                    other=0.0)
        if HAS_PROJ:  # the projection's weight tile stays resident beside the layer's
            offs_pk = tl.arange(0, BLOCK_PK)
            pb = tl.load(pw_ptr + offs_n.to(tl.int64)[None, :] * PK + offs_pk[:, None],
                         mask=n_ok[None, :] & (offs_pk < PK)[:, None], other=0.0)
        first_tile, steps = row_tile_run(row_group, M, COUT, TILES, BALANCED, N_ADJACENT, BLOCK_M, BLOCK_N)
        first_column = column_tile * BLOCK_N
        if COLUMNS_LOADED:  # each half's bias and scale, once for all the program's row tiles
            bias_lo, scale_lo, bias_hi, scale_hi = load_column_halves(first_column, COUT, bias_ptr, scale_ptr, INT8, FP8,
                                                                  HAS_BIAS, BLOCK_N)
        if PROJ_COLUMNS_LOADED:  # and the projection's (proj-cols-loaded)
            pbias, pscale = load_column_values(offs_n, n_ok, pbias_ptr, pscale_ptr, INT8, FP8, PROJ_HAS_BIAS)
        else:
            pbias, pscale = pbias_ptr, pscale_ptr
        # Only now, with PDL, wait for the kernel before: the weight, bias and scale above are the
        # engine's constants, which no kernel writes, so they load while that kernel ends.
        await_previous_kernel(PDL)
        if RES_PREFETCH == 2:
            offs_m = first_tile * BLOCK_M + tl.arange(0, BLOCK_M)
            n_idx, oh, ow = pixel_coords(offs_m, OH, OW)
            res_lo, res_hi = load_residual_halves(res_ptr, first_column, COUT, offs_m < M, n_idx, oh, ow, srn, src, srh,
                                              srw, BLOCK_N)
        if RES_PREFETCH >= 3:
            identity = int8_identity(BLOCK_N)
        for t in range(steps):
            offs_m = (first_tile + t) * BLOCK_M + tl.arange(0, BLOCK_M)
            m_ok = offs_m < M
            if RES_PREFETCH >= 3:  # this tile's residual codes, through the tensor cores
                n_idx, oh, ow = pixel_coords(offs_m, OH, OW)
                codes = load_residual_tile(res_ptr, first_column, COUT, m_ok, n_idx, oh, ow, srn, src, srh, srw, BLOCK_N)
                res_lo, res_hi = decode_codes_through_mma(codes, identity, BLOCK_M, BLOCK_N, RES_PREFETCH == 4)
            if RES_PREFETCH == 1:  # this tile's residual, asked for before its product
                n_idx, oh, ow = pixel_coords(offs_m, OH, OW)
                res_lo, res_hi = load_residual_halves(res_ptr, first_column, COUT, m_ok, n_idx, oh, ow, srn, src, srh,
                                                  srw, BLOCK_N)
            if RES_PREFETCH == 2:  # the next tile's, used an iteration later
                next_m = offs_m + BLOCK_M
                next_n, next_oh, next_ow = pixel_coords(next_m, OH, OW)
                next_lo, next_hi = load_residual_halves(res_ptr, first_column, COUT, (next_m < M) & (t + 1 < steps),
                                                    next_n, next_oh, next_ow, srn, src, srh, srw, BLOCK_N)
            # Output pixel (n, oh, ow) of a strided layer reads input pixel (n, oh·sh, ow·sw).
            x_rows = _input_rows(offs_m, OH, OW, x_row, sxn, sxh, sxw, STRIDED)
            a = tl.load(x_ptr + x_rows[:, None] + offs_k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            if INT8:
                acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
            else:
                acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            acc = accumulate_dot(acc, a, b, in_inv_scale, qmin, INT8, FP8, QUANTIZE_INPUT, BLOCK_K)
            if HAS_PROJ:
                res_lo, res_hi = _projection_halves(p_ptr, pb, pbias, pscale, offs_m, m_ok, offs_n, n_ok, OH, OW, PK,
                                                    p_row, spn, sph, spw, p_inv_scale, qmin, INT8, FP8, PROJ_STRIDED,
                                                    PROJ_QUANTIZE_INPUT, PROJ_HAS_BIAS, BLOCK_M, BLOCK_N, BLOCK_PK,
                                                    PROJ_COLUMNS_LOADED)
            # In two halves of the columns (bench/kernel_asm.py: 110 → 72 registers for the 64×64
            # tile on layer1's conv3).
            if COLUMNS_LOADED:
                if RES_PREFETCH == 0 and not HAS_PROJ and HAS_RES:
                    n_idx, oh, ow = pixel_coords(offs_m, OH, OW)
                    res_lo, res_hi = load_residual_halves(res_ptr, first_column, COUT, m_ok, n_idx, oh, ow, srn, src,
                                                      srh, srw, BLOCK_N)
                elif not HAS_RES:
                    res_lo, res_hi = 0.0, 0.0
                store_epilogue_halves_loaded(acc, res_lo, res_hi, offs_m, first_column, COUT, m_ok, bias_lo, bias_hi,
                                              scale_lo, scale_hi, y_ptr, y_row, res_scale, out_inv_scale, qmin, alpha,
                                              beta, INT8, FP8, HAS_BIAS, HAS_RES, RES_QUANT, RES_AFTER, ACT, OUT_QUANT,
                                              BLOCK_M, BLOCK_N)
            elif RES_PREFETCH == 0 and not HAS_PROJ:
                n_idx, oh, ow = pixel_coords(offs_m, OH, OW)
                store_epilogue_halves(acc, offs_m, first_column, COUT, m_ok, n_idx, oh, ow, bias_ptr, scale_ptr,
                                       res_ptr, y_ptr, y_row, srn, src, srh, srw, res_scale, out_inv_scale, qmin,
                                       alpha, beta, INT8, FP8, HAS_BIAS, HAS_RES, RES_QUANT, RES_AFTER, ACT,
                                       OUT_QUANT, BLOCK_M, BLOCK_N)
            else:
                store_epilogue_halves_given(acc, res_lo, res_hi, offs_m, first_column, COUT, m_ok, bias_ptr,
                                             scale_ptr, y_ptr, y_row, res_scale, out_inv_scale, qmin, alpha, beta,
                                             INT8, FP8, HAS_BIAS, HAS_RES, RES_QUANT, RES_AFTER, ACT, OUT_QUANT,
                                             BLOCK_M, BLOCK_N)
            if RES_PREFETCH == 2:
                res_lo, res_hi = next_lo, next_hi

# When a row tile's residual is loaded (the kernel's RES_PREFETCH), by the word in the tactic's name.
# The halved epilogue otherwise waits a full memory latency for it after the product
# (docs/decisions/kernel-resident-gemm.md for the measurements behind each mode and its effort).
#   0 (no word): in the epilogue, after the product;
#   1 ("residual-early"): at the start of the tile's iteration, so that its latency overlaps the product;
#   2 ("residual-next"): one row tile ahead, carried to the next iteration (more registers, a layout
#      conversion more per half: bench/kernel_asm.py);
#   3 ("residual-mma"): INT8 codes only, at the start of the tile's iteration as a product's operand:
#      codes · I on the tensor cores (`decode_codes_through_mma`). Loaded into registers, the codes
#      made the compiler convert each half's float32 values through shared memory; this way only the
#      INT8 output is;
#   4 ("residual-mma-bits"): as 3, the sums decoded from their bits rather than converted (DECODE_BITS
#      of `decode_codes_through_mma`: 32 conversions a row tile fewer, 32 other instructions more);
#      it lost to 3, so it is timed from MMA_BITS_MIN_EFFORT only.
RESIDUAL_PREFETCH = {0: "", 1: "residual-early", 2: "residual-next", 3: "residual-mma", 4: "residual-mma-bits"}
MMA_RESIDUAL = (3, 4)
MMA_RESIDUAL_BITS = 4
MMA_BITS_MIN_EFFORT = 4
# The residual-mma tiles hold a BLOCK_N × BLOCK_N identity in shared memory: 64 KB at 256 columns,
# more than an SM's shared memory with the 64×256 tile's own buffers. Wider tiles are not offered them.
MMA_RESIDUAL_MAX_BLOCK_N = 128
# proj-cols-loaded (the projection's bias and scale held too) spills from 64 × 128 on: 136–232 bytes a thread
# (sm_90, Triton 3.6, layer1's projected conv3; bench/kernel_asm.py --layer layer1.projected).
PROJECTION_COLUMNS_MAX_BLOCK_N = 64
# One K block, held with the weight tile for all of a program's row tiles. 256 takes in the 1×1 layers
# of K = 256 (ResNet-50's layer3 conv3, far slower through the implicit GEMM than its traffic or its
# product: docs/decisions/kernel-resident-gemm.md). At 256, Triton 3.6 compiles every
# resident tile for sm_90 without spills; shared memory goes from 67.5 KB (64×64, 3 stages: three
# programs per SM) to 139 KB (128×128: one) (bench/kernel_asm.py --layer layer3.conv3).
MAX_RESIDENT_K = 256
MIN_BLOCK_K = 32  # the K step of 8-bit tensor-core products


@register
@dataclass(frozen=True)
class ResidentTile(Tactic):
    """Rows per tile, output channels per program, row tiles per program, warps, pipeline stages,
    when a row tile's residual is loaded (`RESIDUAL_PREFETCH`; layers without a residual run as
    the plain tile), and whether the programs of one row group's column tiles are launched side
    by side ("grouped"). Otherwise the column tiles of one row group lie a whole grid row apart, so
    where the input outgrows L2 each column tile may read the rows from memory again; grouped they
    share them in L2. "cols-loaded" (columns_loaded): the epilogue's bias and scale are loaded once
    per program, not per row tile (fewer loads, more registers). "proj-cols-loaded"
    (projection_columns_loaded, with cols-loaded): a projected layer's projection's bias and scale
    too, which cols-loaded leaves to each row tile; both are timed (PROJECTION_COLUMNS_MAX_BLOCK_N).
    "balanced": `tiles` programs per SM share all the layer's row tiles in equal runs (no last round of
    programs mostly empty; at batch 1 as many programs as the GPU holds where 8 row tiles a program
    left SMs idle). Named e.g. "resident.64x64.t8.w4.s3.residual-mma.cols-loaded.grouped"."""
    block_m: int
    block_n: int
    tiles: int
    warps: int
    stages: int
    residual_prefetch: int = 0
    n_adjacent: bool = False
    columns_loaded: bool = False
    projection_columns_loaded: bool = False
    balanced: bool = False

    FAMILY: ClassVar[str] = "resident"
    SCHEME: ClassVar[tuple] = (Dims(("block_m", "block_n")), Number("tiles", "t"), Number("warps", "w"),
                               Number("stages", "s"), Choice("residual_prefetch", RESIDUAL_PREFETCH),
                               Flag("columns_loaded", "cols-loaded"),
                               Flag("projection_columns_loaded", "proj-cols-loaded"), Flag("n_adjacent", "grouped"),
                               Flag("balanced", "balanced"))
    WEIGHT_LAYOUT: ClassVar[str] = PACKED_K_MAJOR
    PROGRAMMATIC_LAUNCH: ClassVar[bool] = True

    def __post_init__(self) -> None:
        if self.projection_columns_loaded and not self.columns_loaded:
            raise ValueError("ResidentTile: proj-cols-loaded (the projection's columns loaded once) comes with "
                             "cols-loaded")

    def invalid(self) -> str | None:
        return "the epilogue runs in two halves of the columns: block_n must be even" if self.block_n % 2 else None

    def describe(self, layer: LayerFacts) -> str:
        if layer.projected:
            return (f"{layer.codes} triton GEMM and its projection's, both weight tiles resident over row tiles "
                    f"{self.fields_text} + fused epilogue")
        return f"{layer.codes} triton GEMM, weight tile resident over row tiles {self.fields_text} + fused epilogue"

    def grid(self, rows: int, cout: int, sms: int = 0) -> tuple:
        """The launch grid over `rows` output rows and `cout` channels, as `program_tiles` reads it:
        (row groups, column tiles), or grouped one dimension holding both. Balanced, `tiles` row
        groups for each of `sms` multiprocessors (`balanced_row_groups`)."""
        row_groups = (balanced_row_groups(rows, self.block_m, self.tiles, sms) if self.balanced
                      else triton.cdiv(triton.cdiv(rows, self.block_m), self.tiles))
        column_tiles = triton.cdiv(cout, self.block_n)
        return (row_groups * column_tiles,) if self.n_adjacent else (row_groups, column_tiles)


# Best guesses first; the builder times as many as its effort allows (as for the igemm tiles). Ordered
# by what bench/kernel_asm.py reports for ResNet's layer1 conv3 on sm_90 (fewest registers per
# thread, so most programs per SM, first): 72, 117, 122, 130, 140 and 140 registers, no spills.
# The last two, timed from effort 4 and by the probe, ask what bounds layer1's conv3 (slower than its
# traffic alone: docs/decisions/kernel-resident-gemm.md): the 32-row tile holds 10 programs
# (40 warps) per SM where the first holds 7 (28 warps), at 48 registers and 10 KB of shared memory;
# 16 row tiles per program halve the weight loads.
RESIDENT_TILES = (ResidentTile(64, 64, 8, 4, 3), ResidentTile(128, 64, 8, 4, 3), ResidentTile(64, 256, 4, 8, 3),
                  ResidentTile(64, 128, 8, 4, 2), ResidentTile(64, 128, 4, 4, 3), ResidentTile(128, 128, 4, 8, 3),
                  ResidentTile(32, 64, 8, 4, 3), ResidentTile(64, 64, 16, 4, 3))


# A balanced tile's programs per SM (its `tiles`): the first tile with its columns loaded once, and its
# narrowed form, also walking balanced with this many programs an SM. Every program has the same
# work, so a count that is a multiple of what an SM holds fills whole rounds: 4 and 6 are multiples of
# 1 and 2, and of 4 or of 3 and 6 (docs/decisions/kernel-resident-gemm.md). The window stem's tiles
# take the same counts (window/resident.py).
BALANCED_PROGRAMS_PER_SM = (4, 6)
# The multiprocessors a balanced walk spreads over on the CPU (Triton's interpreter runs programs one
# after another): a few, so that runs cross row tiles in tests.
INTERPRETED_SMS = 2


def balanced_row_groups(rows: int, block_m: int, per_sm: int, sms: int) -> int:
    """A balanced walk's row groups over `rows` rows in tiles of `block_m`: `per_sm` programs for
    each of `sms` multiprocessors, never more than there are row tiles."""
    return min(triton.cdiv(rows, block_m), per_sm * sms)


# Builder effort -> how many resident tiles are timed: fewer than the igemm tiles, whose variants
# the same layers already time.
RESIDENT_PER_EFFORT = {1: 1, 2: 2, 3: 4}
# The early-residual variants lost to the plain tile on layer1's 1×1 layers and gained on weaker
# tiles only (docs/decisions/kernel-resident-gemm.md): timed from this effort on, where the search is
# wide anyway.
PREFETCH_MIN_EFFORT = 3


# Over K = 256 the 64×128 tile with 2 stages beat the first tile on ResNet-50's layer3 conv3 (six
# layers); it lost at K = 64 and K = 128 (docs/decisions/kernel-resident-gemm.md). Above WIDE_K it
# is timed at every effort.
WIDE_K_TILE = ResidentTile(64, 128, 8, 4, 2)
WIDE_K = 128


# Layers of few outputs (YOLOv8n's model.2 1×1 layers: 32): a 64-column tile masks half its columns
# (products, accumulator and epilogue, whose instruction issue bounds the small-channel layers:
# docs/decisions/kernel-resident-gemm.md), so up to NARROW_MAX_CHANNELS each tile is also offered as
# narrow as the outputs allow, its rows raised to keep block_m · block_n (`narrowed`), up to
# NARROW_MAX_BLOCK_M rows (the A tile's stages grow with them). The window stem's resident tiles
# narrow the same way (window/resident.py).
NARROW_MAX_CHANNELS = 32


def narrowed(tile: ResidentTile, out_channels: int) -> ResidentTile | None:
    """`tile` with `narrow_block_n(out_channels)` columns and as many more rows (as many accumulator
    registers a thread), its other fields kept; None for a layer of more than NARROW_MAX_CHANNELS
    outputs or a tile no wider than that already."""
    block_n = narrow_block_n(out_channels)
    if out_channels > NARROW_MAX_CHANNELS or tile.block_n <= block_n:
        return None
    return replace(tile, block_m=tile.block_m * tile.block_n // block_n, block_n=block_n)


def resident_tactics(effort: int, residual: bool = False, k_total: int = 0, residual_codes: bool = False,
                     out_channels: int | None = None) -> list[str]:
    """The candidates the builder times at this effort for a layer of `k_total` input channels:
    each tile (WIDE_K_TILE as well above WIDE_K), for a layer of up to NARROW_MAX_CHANNELS
    `out_channels` each also narrowed (`narrowed`), with its column tiles adjacent ("grouped"), and each
    of those with its columns' bias and scale loaded once ("cols-loaded": fewer loads, more registers,
    so timed); for a layer with a residual of INT8 codes (`residual_codes`), each of those up to
    MMA_RESIDUAL_MAX_BLOCK_N columns also with the codes through the tensor cores ("residual-mma" at
    every effort, "residual-mma-bits" from MMA_BITS_MIN_EFFORT); from PREFETCH_MIN_EFFORT, for a layer with a residual,
    each also with its residual loaded early (without one, these would be the same kernel); last the
    first tile with its columns loaded, and its narrowed form, walking balanced
    (BALANCED_PROGRAMS_PER_SM programs an SM)."""
    tiles = list(RESIDENT_TILES[:RESIDENT_PER_EFFORT.get(effort, len(RESIDENT_TILES))])
    if k_total > WIDE_K and WIDE_K_TILE not in tiles:
        tiles.append(WIDE_K_TILE)
    if out_channels is not None:
        narrow = [narrowed(tile, out_channels) for tile in tiles]
        tiles += [tile for tile in dict.fromkeys(narrow)
                  if tile is not None and tile.block_m <= NARROW_MAX_BLOCK_M and tile not in tiles]
    tiles = [variant for tile in tiles for variant in (tile, replace(tile, n_adjacent=True))]
    tiles += [replace(tile, columns_loaded=True) for tile in tiles]
    modes = []
    if residual and residual_codes:
        modes += [mode for mode in MMA_RESIDUAL if mode != MMA_RESIDUAL_BITS or effort >= MMA_BITS_MIN_EFFORT]
    if residual and effort >= PREFETCH_MIN_EFFORT:
        modes += [mode for mode in RESIDUAL_PREFETCH if mode and mode not in MMA_RESIDUAL]
    tiles += [replace(tile, residual_prefetch=mode) for tile in tiles for mode in modes
              if mode not in MMA_RESIDUAL or tile.block_n <= MMA_RESIDUAL_MAX_BLOCK_N]
    first = replace(RESIDENT_TILES[0], columns_loaded=True)
    firsts = [first] + ([narrowed(first, out_channels)] if out_channels is not None else [])
    tiles += [replace(tile, tiles=per_sm, balanced=True) for tile in firsts if tile is not None
              for per_sm in BALANCED_PROGRAMS_PER_SM]
    return [tile.name for tile in tiles]


def strided_out_hw(hw: tuple | torch.Size, strides: tuple) -> tuple:
    """The output size of an unpadded 1×1 convolution at these strides."""
    return tuple((size - 1) // stride + 1 for size, stride in zip(hw, strides))


def resident_applies(x: torch.Tensor, k_total: int, geometry: ConvGeometry | None = None) -> bool:
    """GEMMs (2-D x) and unpadded 1×1 convolutions (any stride: ResNet's stride-2 downsample reads
    every other pixel of every other row), of K ≤ MAX_RESIDENT_K, over inputs whose channels are
    contiguous and pixels evenly spaced (channels-last, or a channel slice of one)."""
    if x.dim() not in (2, 4) or k_total > MAX_RESIDENT_K or pixel_stride(x) is None:
        return False
    if geometry is None or x.dim() == 2:
        return True
    return (geometry.kernel == (1, 1) and geometry.pads == (0, 0)
            and tuple(geometry.out_hw) == strided_out_hw(x.shape[2:], geometry.strides))


@dataclass(frozen=True)
class Projection:
    """A residual computed beside the layer by a second product (ResNet's downsample, fused into its
    block's last 1×1 layer: `passes/fuse_projected_residual.py`): the unpadded 1×1 layer x · wᵀ at
    `strides`, its bias and dequant scale as a layer's own, dequantized to float32 and not
    requantized, then added as the layer's residual. Its output is never stored."""
    x: torch.Tensor
    weight: torch.Tensor  # [Cout, K(, 1, 1)], K-major
    bias: torch.Tensor | None
    dequant_scale: torch.Tensor
    strides: tuple = (1, 1)
    input_inv_scale: float | None = None  # for a float x, quantized on load


def resident_block_k(k_total: int) -> int:
    """The one K block of a resident product over `k_total` channels."""
    return max(MIN_BLOCK_K, triton.next_power_of_2(k_total))


def _projection_arguments(projection: Projection, batch: int, out_hw: tuple, cout: int, code: torch.dtype,
                          dummy: torch.Tensor) -> tuple[tuple, tuple, float, dict]:
    """The kernel's projection arguments, as it takes them: (pointers, sizes and strides, inverse
    scale, constexprs); dummies where there is no projection."""
    if projection is None:
        return (dummy, dummy, dummy, dummy), (0, 0, 0, 0, 0), 1.0, {}
    px, pw = projection.x, projection.weight
    k_total = pw.shape[1]
    if not resident_applies(px, k_total) or px.shape[1] != k_total or pw.shape[0] != cout or px.dim() != 4:
        raise ValueError(f"resident_gemm: projection input {tuple(px.shape)} strides {px.stride()} and weight "
                         f"{tuple(pw.shape)} are not {cout} outputs of {k_total} contiguous channels, K ≤ "
                         f"{MAX_RESIDENT_K}")
    if px.shape[0] != batch or strided_out_hw(px.shape[2:], projection.strides) != tuple(out_hw):
        raise ValueError(f"resident_gemm: projection input {tuple(px.shape)} at strides {projection.strides} does not "
                         f"give the layer's {batch} × {tuple(out_hw)} outputs")
    ps = px.stride()
    strided = tuple(projection.strides) != (1, 1)
    pointers = (px, pw, projection.bias if projection.bias is not None else pw, projection.dequant_scale)
    layout = (k_total, pixel_stride(px), ps[0], ps[2] * projection.strides[0], ps[3] * projection.strides[1])
    flags = dict(HAS_PROJ=True, PROJ_STRIDED=strided, PROJ_QUANTIZE_INPUT=px.dtype != code,
                 PROJ_HAS_BIAS=projection.bias is not None, BLOCK_PK=resident_block_k(k_total))
    return pointers, layout, float(projection.input_inv_scale or 1.0), flags


def resident_gemm(x: torch.Tensor, w_packed: torch.Tensor, bias: torch.Tensor | None, tile: ResidentTile, *,
                  dequant_scale: torch.Tensor, residual: torch.Tensor | None = None, activation: str | None = None,
                  alpha: float | None = None, beta: float | None = None, residual_after_activation: bool = False,
                  input_inv_scale: float | None = None, residual_scale: float | None = None,
                  output_inv_scale: float | None = None, qmin: int = -127,
                  accumulator_bound: int | None = None, fp8: bool = False, float_dtype: torch.dtype = torch.float32,
                  out: torch.Tensor | None = None, pdl: bool = False, strides: tuple = (1, 1),
                  projection: Projection | None = None) -> torch.Tensor:
    """The INT8 (FP8: `fp8`) layer y = epilogue(x · wᵀ) over x [N, K, H, W] channels-last (or a
    channel slice of one) or [N, K] row-major, w_packed [Cout, K(, 1, 1)] K-major, at `strides` (a
    1×1 convolution without padding); the epilogue's arguments are conv_igemm's (`pdl` and
    `float_dtype` too). With
    `projection` (no `residual` then) the residual is that second product's (`Projection`). Output
    channels-last (or into `out`)."""
    code = torch.float8_e4m3fn if fp8 else torch.int8
    k_total = w_packed.shape[1]
    if not resident_applies(x, k_total) or x.shape[1] != k_total:
        raise ValueError(f"resident_gemm: input {tuple(x.shape)} strides {x.stride()} is not {k_total} contiguous "
                         f"channels of evenly spaced pixels, K ≤ {MAX_RESIDENT_K}")
    if projection is not None and residual is not None:
        raise ValueError("resident_gemm: a layer with a projection has no other residual")
    if tile.residual_prefetch in MMA_RESIDUAL and residual is not None and residual.dtype != torch.int8:
        raise ValueError(f"resident_gemm: {tile.name} takes a residual of INT8 codes through the tensor cores, "
                         f"not {residual.dtype}")
    cout = w_packed.shape[0]
    strided = x.dim() == 4 and tuple(strides) != (1, 1)
    oh, ow = strided_out_hw(x.shape[2:], strides) if x.dim() == 4 else (1, 1)
    shape = (x.shape[0], cout, oh, ow) if x.dim() == 4 else (x.shape[0], cout)
    out_dtype = code if output_inv_scale is not None else float_dtype
    y = channels_last_output(shape, out_dtype, x.device, out, "resident_gemm")
    p_pointers, p_layout, p_inv_scale, p_flags = _projection_arguments(projection, x.shape[0], (oh, ow), cout, code,
                                                                       w_packed)
    rows = x.shape[0] * oh * ow
    xs = x.stride() if x.dim() == 4 else (0, 0, 0, 0)
    res4 = residual if residual is None or residual.dim() == 4 else residual.reshape(*residual.shape, 1, 1)
    rs = res4.stride() if res4 is not None else (0, 0, 0, 0)
    out_hw = (oh, ow)
    if not strided and not p_flags.get("PROJ_STRIDED"):  # no input row needs the output's coordinates
        out_hw, rs = residual_pixels(rs, x.shape[0], out_hw)
    scalars, flags = epilogue_arguments(
        quantized=True, fp8=fp8, bias=bias, residual=residual, activation=activation, alpha=alpha, beta=beta,
        residual_after_activation=residual_after_activation, residual_scale=residual_scale,
        output_inv_scale=output_inv_scale, qmin=qmin,
        accumulator_bound=accumulator_bound)
    if projection is not None:  # the epilogue adds the projection's float32 values as its residual
        flags.update(HAS_RES=True, RES_QUANT=False)
    sms = (multiprocessors(x.device) or INTERPRETED_SMS) if tile.balanced else 0
    _resident_gemm_kernel[tile.grid(rows, cout, sms)](
        x, w_packed, bias if bias is not None else w_packed, dequant_scale, res4 if res4 is not None else y, y,
        *p_pointers, rows, cout, k_total, pixel_stride(x), pixel_stride(y), *out_hw, xs[0], xs[2] * strides[0],
        xs[3] * strides[1], *rs, *p_layout, float(input_inv_scale or 1.0), p_inv_scale, *scalars,
        QUANTIZE_INPUT=x.dtype != code, **flags, TILES=tile.tiles,
        RES_PREFETCH=tile.residual_prefetch if residual is not None else 0, N_ADJACENT=tile.n_adjacent, STRIDED=strided,
        BLOCK_M=tile.block_m, BLOCK_N=tile.block_n, BLOCK_K=resident_block_k(k_total), PDL=pdl, **p_flags,
        COLUMNS_LOADED=tile.columns_loaded,
        PROJ_COLUMNS_LOADED=tile.projection_columns_loaded and projection is not None, **launch_options(pdl),
        IN_ALIGN=told_alignment(k_total, pixel_stride(x), *((xs[0], xs[2] * strides[0], xs[3] * strides[1])
                                                             if strided else ())),
        OUT_ALIGN=told_alignment(cout, pixel_stride(y)), RES_ALIGN=told_alignment(rs[0], rs[2], rs[3]),
        BALANCED=tile.balanced, num_warps=tile.warps,
        num_stages=tile.stages, enable_fp_fusion=False)  # round as the emulation does (see conv_igemm)
    return y


settle_cache_keys(globals())  # last, once every Triton function above exists (common/cache_keys.py)
