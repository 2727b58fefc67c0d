"""The window convolution of a network's stem with the weight resident in each program (tactics
"window_resident.…", `sartor/ops/quantized_window.py`).

The window tactic packs the few-channel image into 4-byte pixels and runs the implicit GEMM over
overlapping windows of them as a kh × 1 convolution: bound neither by memory nor by the tensor
cores, each program walking 7 K steps with the general implicit-GEMM index math for one row tile
(docs/decisions/kernel-window-resident-tiles.md). Here, as in the resident kernel of 1×1 layers
(`gemm/resident.py`), each program loads
its weight block [K, BLOCK_N] once (K = kh · window: 7 · 32 = 224 for the stem) and walks TILES row
tiles, gathering each tile's K in one step: kh rows of `window` contiguous bytes per output pixel.
Two forms: one product over K padded to a power of two (the weight's padding rows are zero), or
("kh-steps") one product per filter row, the kh weight blocks held as a tuple, nothing padded.

The products and their sums are `tile_steps`' (`accumulate_dot`, `store_epilogue_halves`): the output
equals the emulation's as the other window tiles' does.

A stem carrying its 3 × 3 / 2 max pool (`passes/fuse_stem_max_pool.py`) has pooled tiles ("max-pool",
`_window_pooled_pairs`): the pool is computed from the tiles of output rows in registers, and only
the pooled codes are stored.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import ClassVar

import torch

from ..common.cache_keys import settle_cache_keys
from ..conv.igemm import ConvGeometry, multiprocessors
from ..pointwise.epilogue import channels_last_output, pixel_stride, told_alignment, triton
from ..common.pdl import launch_options
from ..common.tile_steps import epilogue_arguments
from .pixel_pack import PIXEL_BYTES
from ..registry import Flag, Inline, Tactic
from ..gemm.resident import (BALANCED_PROGRAMS_PER_SM, INTERPRETED_SMS, NARROW_MAX_CHANNELS, ResidentTile,
                             balanced_row_groups, narrowed)

if triton is not None:
    import triton.language as tl

    from ..common.tile_steps import (accumulate_dot, load_column_halves, load_column_values, epilogue_output, store_epilogue_halves,
                             store_epilogue_halves_loaded, requantize_int8, load_residual_halves, odometer_step,
                             pixel_coords)
    from ..common.pdl import await_previous_kernel
    from ..pointwise.epilogue import told_multiple
    from ..gemm.resident import program_tiles, row_tile_run

    @triton.jit
    def _window_resident_kernel(
            p_ptr, w_ptr, bias_ptr, scale_ptr, res_ptr, y_ptr,
            M, COUT, OH, OW, image_bytes, row_bytes, y_row, srn, src, srh, srw,
            res_scale, out_inv_scale, qmin, alpha, beta,
            KH: tl.constexpr, WINDOW: tl.constexpr, STRIDE_H: tl.constexpr, PIXEL_STEP: tl.constexpr,
            DIL_H: tl.constexpr, INT8: tl.constexpr, FP8: tl.constexpr, HAS_BIAS: tl.constexpr,
            HAS_RES: tl.constexpr, RES_QUANT: tl.constexpr, RES_AFTER: tl.constexpr, ACT: tl.constexpr,
            OUT_QUANT: tl.constexpr, KH_STEPS: tl.constexpr, TILES: tl.constexpr, N_ADJACENT: tl.constexpr,
            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, K_PAD: tl.constexpr, PDL: tl.constexpr = False,
            COLUMNS_LOADED: tl.constexpr = False, OUTPUT_ROWS: tl.constexpr = 1, WINDOW_ALIGN: tl.constexpr = None,
            MAX_POOL: tl.constexpr = False, BALANCED: tl.constexpr = False, OUT_ALIGN: tl.constexpr = 1):
        COUT = told_multiple(COUT, OUT_ALIGN)  # 24 or 40 outputs: stored as vectors once told
        y_row = told_multiple(y_row, OUT_ALIGN)
        row_group, column_tile = program_tiles(COUT, BLOCK_N, N_ADJACENT)
        first_column = column_tile * BLOCK_N
        offs_n = first_column + tl.arange(0, BLOCK_N)
        n_ok = offs_n < COUT
        w_col = offs_n.to(tl.int64)[None, :] * (KH * WINDOW)
        if KH_STEPS:
            offs_k = tl.arange(0, WINDOW)
            weights = ()
            for kh in tl.static_range(KH):
                weights = weights + (tl.load(w_ptr + w_col + (kh * WINDOW + offs_k)[:, None], mask=n_ok[None, :],
                                             other=0.0),)
        else:
            # K index kh · WINDOW + byte, padded to K_PAD: the padding's rows of the weight are zero
            # and its A columns masked, so neither reads past its tensor.
            offs_k = tl.arange(0, K_PAD)
            filter_row = offs_k // WINDOW
            k_ok = filter_row < KH
            k_offsets = filter_row * (DIL_H * row_bytes) + offs_k % WINDOW
            weight = tl.load(w_ptr + w_col + offs_k[:, None], mask=n_ok[None, :] & k_ok[:, None], other=0.0)
        if COLUMNS_LOADED and not MAX_POOL:  # each half's bias and scale, once for all its row tiles (cols-loaded)
            bias_lo, scale_lo, bias_hi, scale_hi = load_column_halves(first_column, COUT, bias_ptr, scale_ptr, INT8, FP8,
                                                                  HAS_BIAS, BLOCK_N)
        else:
            bias_lo, scale_lo, bias_hi, scale_hi = 0.0, 0.0, 0.0, 0.0
        # Only now, with PDL, wait for the kernel before (the pixel packing): the weight, bias and
        # scale above are the engine's constants, which no kernel writes.
        await_previous_kernel(PDL)
        if MAX_POOL:
            _window_pooled_pairs(p_ptr, weights, bias_ptr, scale_ptr, y_ptr, row_group, first_column, offs_k, M, COUT,
                                 OH, OW, image_bytes, row_bytes, y_row, out_inv_scale, qmin, alpha, beta, KH, STRIDE_H,
                                 DIL_H, PIXEL_STEP, INT8, HAS_BIAS, ACT, TILES, BALANCED, BLOCK_M, BLOCK_N, WINDOW,
                                 WINDOW_ALIGN)
        elif OUTPUT_ROWS == 2:
            _window_row_pairs(p_ptr, weights, bias_ptr, scale_ptr, res_ptr, y_ptr, bias_lo, scale_lo, bias_hi,
                              scale_hi, row_group, first_column, offs_k, M, COUT, OH, OW, image_bytes, row_bytes,
                              y_row, srn, src, srh, srw, res_scale, out_inv_scale, qmin, alpha, beta, KH, STRIDE_H,
                              DIL_H, PIXEL_STEP, INT8, FP8, HAS_BIAS, HAS_RES, RES_QUANT, RES_AFTER, ACT, OUT_QUANT, TILES,
                              BALANCED, BLOCK_M, BLOCK_N, WINDOW, COLUMNS_LOADED, WINDOW_ALIGN)
        else:
            first, steps = row_tile_run(row_group, M, COUT, TILES, BALANCED, N_ADJACENT, BLOCK_M, BLOCK_N)
            for t in range(steps):
                offs_m = (first + t) * BLOCK_M + tl.arange(0, BLOCK_M)
                m_ok = offs_m < M
                n_idx, oh, ow = pixel_coords(offs_m, OH, OW)
                window_start = _window_starts(n_idx, oh, ow, image_bytes, row_bytes, STRIDE_H, PIXEL_STEP,
                                              WINDOW_ALIGN)
                if KH_STEPS:
                    acc = _window_row_products(p_ptr, weights, window_start, m_ok, offs_k, row_bytes, KH, DIL_H, INT8,
                                               FP8, BLOCK_M, BLOCK_N, WINDOW)
                else:
                    acc = _zero_accumulator(INT8, BLOCK_M, BLOCK_N)
                    a = tl.load(p_ptr + window_start[:, None] + k_offsets[None, :], mask=m_ok[:, None] & k_ok[None, :],
                                other=0.0)
                    # FP8 sums move to the float32 accumulator after each window, as the window
                    # tiles' K steps of 32-byte windows do.
                    acc = accumulate_dot(acc, a, weight, 1.0, -127.0, INT8, FP8, False, WINDOW)
                _window_tile_store(acc, offs_m, m_ok, n_idx, oh, ow, first_column, COUT, bias_lo, scale_lo, bias_hi,
                                   scale_hi, bias_ptr, scale_ptr, res_ptr, y_ptr, y_row, srn, src, srh, srw, res_scale,
                                   out_inv_scale, qmin, alpha, beta, INT8, FP8, HAS_BIAS, HAS_RES, RES_QUANT, RES_AFTER,
                                   ACT, OUT_QUANT, BLOCK_M, BLOCK_N, COLUMNS_LOADED)

    @triton.jit
    def _window_starts(n_idx, oh, ow, image_bytes, row_bytes, STRIDE_H: tl.constexpr, PIXEL_STEP: tl.constexpr,
                       WINDOW_ALIGN: tl.constexpr):
        """Where the window of output pixel (n, oh, ow) and filter row 0 starts: padded pixel
        (oh·sh, ow·sw), a multiple of WINDOW_ALIGN bytes (`window_alignment`)."""
        return tl.multiple_of(n_idx.to(tl.int64) * image_bytes + (oh * STRIDE_H) * row_bytes + ow * PIXEL_STEP,
                              [WINDOW_ALIGN])

    @triton.jit
    def _window_tile_store(acc, offs_m, m_ok, n_idx, oh, ow, first_column, COUT, bias_lo, scale_lo, bias_hi, scale_hi,
                           bias_ptr, scale_ptr, res_ptr, y_ptr, y_row, srn, src, srh, srw, res_scale, out_inv_scale,
                           qmin, alpha, beta, INT8: tl.constexpr, FP8: tl.constexpr, HAS_BIAS: tl.constexpr,
                           HAS_RES: tl.constexpr, RES_QUANT: tl.constexpr, RES_AFTER: tl.constexpr, ACT: tl.constexpr,
                           OUT_QUANT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                           COLUMNS_LOADED: tl.constexpr):
        """One row tile's epilogue: with the columns' bias and scale given (cols-loaded) or loaded here."""
        if COLUMNS_LOADED:
            res_lo, res_hi = 0.0, 0.0
            if HAS_RES:
                res_lo, res_hi = load_residual_halves(res_ptr, first_column, COUT, m_ok, n_idx, oh, ow, srn, src,
                                                  srh, srw, BLOCK_N)
            store_epilogue_halves_loaded(acc, res_lo, res_hi, offs_m, first_column, COUT, m_ok, bias_lo, bias_hi,
                                          scale_lo, scale_hi, y_ptr, y_row, res_scale, out_inv_scale, qmin, alpha,
                                          beta, INT8, FP8, HAS_BIAS, HAS_RES, RES_QUANT, RES_AFTER, ACT, OUT_QUANT,
                                          BLOCK_M, BLOCK_N)
        else:
            store_epilogue_halves(acc, offs_m, first_column, COUT, m_ok, n_idx, oh, ow, bias_ptr, scale_ptr,
                                   res_ptr, y_ptr, y_row, srn, src, srh, srw, res_scale, out_inv_scale, qmin,
                                   alpha, beta, INT8, FP8, HAS_BIAS, HAS_RES, RES_QUANT, RES_AFTER, ACT,
                                   OUT_QUANT, BLOCK_M, BLOCK_N)

    @triton.jit
    def _window_row_pairs(p_ptr, weights, bias_ptr, scale_ptr, res_ptr, y_ptr, bias_lo, scale_lo, bias_hi, scale_hi,
                          row_group, first_column, offs_k, M, COUT, OH, OW, image_bytes, row_bytes, y_row, srn, src,
                          srh, srw, res_scale, out_inv_scale, qmin, alpha, beta, KH: tl.constexpr,
                          STRIDE_H: tl.constexpr, DIL_H: tl.constexpr, PIXEL_STEP: tl.constexpr,
                          INT8: tl.constexpr, FP8: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, RES_QUANT: tl.constexpr,
                          RES_AFTER: tl.constexpr, ACT: tl.constexpr, OUT_QUANT: tl.constexpr, TILES: tl.constexpr,
                          BALANCED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, WINDOW: tl.constexpr,
                          COLUMNS_LOADED: tl.constexpr, WINDOW_ALIGN: tl.constexpr):
        """The row-pairs walk: each row tile is BLOCK_M pixels of output rows 2p and 2p + 1 at once (M
        counts such pairs). The lower row's filter row i reads the packed row that the upper row's
        filter row i + STRIDE_H / DIL_H reads: undilated, the pair loads STRIDE_H + KH rows of windows
        for 2 · KH products, where two tiles would load 2 · KH (the stem's space-to-depth form: 5
        for 8)."""
        pair_rows = (OH + 1) // 2
        first, steps = row_tile_run(row_group, M, COUT, TILES, BALANCED, False, BLOCK_M, BLOCK_N)
        for t in range(steps):
            offs_p = (first + t) * BLOCK_M + tl.arange(0, BLOCK_M)
            p_ok = offs_p < M
            n_idx, pair, ow = pixel_coords(offs_p, pair_rows, OW)
            oh = pair * 2
            lower_ok = p_ok & (oh + 1 < OH)
            window_start = _window_starts(n_idx, oh, ow, image_bytes, row_bytes, STRIDE_H, PIXEL_STEP, WINDOW_ALIGN)
            upper, lower = _window_pair_products(p_ptr, weights, window_start, p_ok, lower_ok, offs_k, row_bytes, KH,
                                                 STRIDE_H, DIL_H, INT8, FP8, BLOCK_M, BLOCK_N, WINDOW)
            offs_m = (n_idx * OH + oh) * OW + ow
            _window_tile_store(upper, offs_m, p_ok, n_idx, oh, ow, first_column, COUT, bias_lo, scale_lo, bias_hi,
                               scale_hi, bias_ptr, scale_ptr, res_ptr, y_ptr, y_row, srn, src, srh, srw, res_scale,
                               out_inv_scale, qmin, alpha, beta, INT8, FP8, HAS_BIAS, HAS_RES, RES_QUANT, RES_AFTER,
                               ACT, OUT_QUANT, BLOCK_M, BLOCK_N, COLUMNS_LOADED)
            _window_tile_store(lower, offs_m + OW, lower_ok, n_idx, oh + 1, ow, first_column, COUT, bias_lo, scale_lo,
                               bias_hi, scale_hi, bias_ptr, scale_ptr, res_ptr, y_ptr, y_row, srn, src, srh, srw,
                               res_scale, out_inv_scale, qmin, alpha, beta, INT8, FP8, HAS_BIAS, HAS_RES, RES_QUANT,
                               RES_AFTER, ACT, OUT_QUANT, BLOCK_M, BLOCK_N, COLUMNS_LOADED)

    @triton.jit
    def _zero_accumulator(INT8: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        """A tile's empty sums: int32 for INT8 products, float32 for FP8 ones."""
        # One return: Triton 3.6 refuses returns of two types, constexpr branches or not.
        if INT8:
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
        else:
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        return acc

    @triton.jit
    def _window_row_products(p_ptr, weights, window_start, ok, offs_k, row_bytes, KH: tl.constexpr,
                             DIL_H: tl.constexpr, INT8: tl.constexpr, FP8: tl.constexpr, BLOCK_M: tl.constexpr,
                             BLOCK_N: tl.constexpr, WINDOW: tl.constexpr):
        """One output row's sums, a product per filter row (kh-steps): the window of filter row kh
        starts kh · DIL_H packed rows below `window_start`. Pixels not `ok` read nothing."""
        acc = _zero_accumulator(INT8, BLOCK_M, BLOCK_N)
        for kh in tl.static_range(KH):
            a = tl.load(p_ptr + window_start[:, None] + (kh * DIL_H * row_bytes + offs_k)[None, :], mask=ok[:, None],
                        other=0.0)
            acc = accumulate_dot(acc, a, weights[kh], 1.0, -127.0, INT8, FP8, False, WINDOW)
        return acc

    @triton.jit
    def _window_pair_products(p_ptr, weights, window_start, upper_ok, lower_ok, offs_k, row_bytes, KH: tl.constexpr,
                              STRIDE_H: tl.constexpr, DIL_H: tl.constexpr, INT8: tl.constexpr, FP8: tl.constexpr,
                              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, WINDOW: tl.constexpr):
        """The sums of output rows 2p (upper) and 2p + 1 (lower) over the same pixels, the upper
        row's windows starting at `window_start`: each packed row is loaded once for both rows' products."""
        upper = _zero_accumulator(INT8, BLOCK_M, BLOCK_N)
        lower = _zero_accumulator(INT8, BLOCK_M, BLOCK_N)
        for r in tl.static_range(STRIDE_H + (KH - 1) * DIL_H + 1):
            # Packed row r of the pair: filter row r / DIL_H of the upper output row, and
            # (r - STRIDE_H) / DIL_H of the lower, where those are whole filter rows.
            # (Conditions written out in each `if`: Triton 3.6 neither reassigns a constexpr in an
            # unrolled loop nor keeps `&` of two constexprs one.)
            if r % DIL_H == 0 and r // DIL_H < KH:
                a = tl.load(p_ptr + window_start[:, None] + (r * row_bytes + offs_k)[None, :],
                            mask=upper_ok[:, None], other=0.0)
                upper = accumulate_dot(upper, a, weights[r // DIL_H], 1.0, -127.0, INT8, FP8, False, WINDOW)
                if r >= STRIDE_H and (r - STRIDE_H) % DIL_H == 0 and (r - STRIDE_H) // DIL_H < KH:
                    lower = accumulate_dot(lower, a, weights[(r - STRIDE_H) // DIL_H], 1.0, -127.0, INT8, FP8, False,
                                        WINDOW)
            elif r >= STRIDE_H and (r - STRIDE_H) % DIL_H == 0 and (r - STRIDE_H) // DIL_H < KH:
                a = tl.load(p_ptr + window_start[:, None] + (r * row_bytes + offs_k)[None, :],
                            mask=lower_ok[:, None], other=0.0)
                lower = accumulate_dot(lower, a, weights[(r - STRIDE_H) // DIL_H], 1.0, -127.0, INT8, FP8, False,
                                    WINDOW)
        return upper, lower

    _LOWEST_FLOAT32 = tl.constexpr(-3.4028234663852886e38)

    @triton.jit
    def _pool_values(acc, ok, offs_n, n_ok, bias, scale, alpha, beta, INT8: tl.constexpr, HAS_BIAS: tl.constexpr,
                     ACT: tl.constexpr):
        """One row tile's values as the max pool compares them: the layer's epilogue up to its
        activation (no residual), float32's lowest where the pixel lies outside the output (the pool's
        padding: finite, so that a pooled row made of padding alone, which is never stored, rounds to
        no NaN).
        Requantizing is monotonic (a rounding of v · out_inv_scale, out_inv_scale > 0, then a
        clamp), so the codes of the max are the max of the codes: the pool requantizes each pooled
        value once, where the layer would requantize four."""
        values = epilogue_output(acc, 0.0, offs_n, n_ok, bias, scale, 1.0, 1.0, -127.0, alpha, beta, INT8, False,
                                  HAS_BIAS, False, False, False, ACT, False, LOADED=True)
        return tl.where(ok[:, None], values, _LOWEST_FLOAT32)

    @triton.jit
    def _max_of_column_triples(values, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        """[BLOCK_M / 2, BLOCK_N]: row j is the max of rows 2j, 2j + 1 and 2j + 2 of `values` (the last
        row's third is 2j + 1's again: BLOCK_M / 2 - 1 rows are whole). With the rows split into even
        and odd ones, 2j + 2 is the next even row, which `tl.gather` moves in (warp shuffles on sm_90)."""
        even, odd = tl.split(tl.permute(tl.reshape(values, (BLOCK_M // 2, 2, BLOCK_N)), (0, 2, 1)))
        half = tl.arange(0, BLOCK_M // 2)
        following = tl.minimum(half + 1, BLOCK_M // 2 - 1)
        next_even = tl.gather(even, tl.broadcast_to(following[:, None], (BLOCK_M // 2, BLOCK_N)), 0)
        return tl.maximum(tl.maximum(even, odd), next_even)

    @triton.jit
    def _strip_columns(strip, OW, BLOCK_M: tl.constexpr):
        """The output columns of strip `strip` (from 2·strip·Q - 1, Q = BLOCK_M / 2 - 1 pooled columns
        a strip) and which lie inside the output."""
        ow = strip * (BLOCK_M - 2) - 1 + tl.arange(0, BLOCK_M)
        return ow, (ow >= 0) & (ow < OW)

    @triton.jit
    def _row_above(p_ptr, weights, n_idx, strip, pair, ok, offs_k, offs_n, n_ok, bias, scale, OW, image_bytes,
                   row_bytes, alpha, beta, KH: tl.constexpr, STRIDE_H: tl.constexpr, DIL_H: tl.constexpr,
                   PIXEL_STEP: tl.constexpr, INT8: tl.constexpr, HAS_BIAS: tl.constexpr, ACT: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, WINDOW: tl.constexpr, WINDOW_ALIGN: tl.constexpr):
        """The pooled walks' `previous` before their first pair: the values of output row 2·pair - 1 (none
        above an image's top: the pool's padding)."""
        ow, column_ok = _strip_columns(strip, OW, BLOCK_M)
        above_ok = column_ok & ok & (pair > 0)
        above = _window_row_products(p_ptr, weights, _window_starts(n_idx, 2 * pair - 1, ow, image_bytes, row_bytes,
                                                                    STRIDE_H, PIXEL_STEP, WINDOW_ALIGN),
                                     above_ok, offs_k, row_bytes, KH, DIL_H, INT8, False, BLOCK_M, BLOCK_N, WINDOW)
        return _pool_values(above, above_ok, offs_n, n_ok, bias, scale, alpha, beta, INT8, HAS_BIAS, ACT)

    @triton.jit
    def _pooled_pair(p_ptr, weights, y_ptr, previous, n_idx, strip, pair, ok, offs_k, offs_n, n_ok, bias, scale, OH,
                     OW, image_bytes, row_bytes, y_row, out_inv_scale, qmin, alpha, beta, KH: tl.constexpr,
                     STRIDE_H: tl.constexpr, DIL_H: tl.constexpr, PIXEL_STEP: tl.constexpr, INT8: tl.constexpr,
                     HAS_BIAS: tl.constexpr, ACT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     WINDOW: tl.constexpr, WINDOW_ALIGN: tl.constexpr):
        """One step of the pooled walks (max-pool): pair `pair` of strip `strip` of image `n_idx` (nothing
        where not `ok`), its pooled row stored from the max of its two rows and `previous` (the values
        of the row above), pooled 3 to 1 along the row. Returns the pair's lower row's values, the
        next pair's `previous`.

        Pooled row p is the max over output rows 2p - 1, 2p and 2p + 1. A strip is BLOCK_M output
        columns from 2·s·Q - 1, Q = BLOCK_M / 2 - 1, giving pooled columns s·Q … s·Q + Q - 1: strips
        overlap by one column each side, which are computed twice (ResNet-50's 112 columns: 2 strips
        of 64, 128 computed)."""
        STRIP: tl.constexpr = BLOCK_M // 2 - 1
        pairs = (OH + 1) // 2
        pooled_w = (OW + 1) // 2
        ow, column_ok = _strip_columns(strip, OW, BLOCK_M)
        column_ok = column_ok & ok
        oh = 2 * pair
        upper_ok = column_ok & (oh < OH)
        lower_ok = column_ok & (oh + 1 < OH)
        window_start = _window_starts(n_idx, oh, ow, image_bytes, row_bytes, STRIDE_H, PIXEL_STEP, WINDOW_ALIGN)
        upper, lower = _window_pair_products(p_ptr, weights, window_start, upper_ok, lower_ok, offs_k, row_bytes, KH,
                                             STRIDE_H, DIL_H, INT8, False, BLOCK_M, BLOCK_N, WINDOW)
        lower_values = _pool_values(lower, lower_ok, offs_n, n_ok, bias, scale, alpha, beta, INT8, HAS_BIAS, ACT)
        rows_max = tl.maximum(tl.maximum(previous, lower_values),
                              _pool_values(upper, upper_ok, offs_n, n_ok, bias, scale, alpha, beta, INT8, HAS_BIAS,
                                           ACT))
        pooled = requantize_int8(_max_of_column_triples(rows_max, BLOCK_M, BLOCK_N), out_inv_scale, qmin)
        pooled_j = tl.arange(0, BLOCK_M // 2)
        pooled_q = strip * STRIP + pooled_j
        pooled_ok = (pooled_j < STRIP) & (pooled_q < pooled_w) & ok & (pair < pairs)
        y_pixels = ((n_idx * pairs + pair) * pooled_w + pooled_q).to(tl.int64) * y_row
        tl.store(y_ptr + y_pixels[:, None] + offs_n[None, :], pooled, mask=pooled_ok[:, None] & n_ok[None, :])
        return lower_values

    @triton.jit
    def _window_pooled_pairs(p_ptr, weights, bias_ptr, scale_ptr, y_ptr, row_group, first_column, offs_k, M, COUT,
                             OH, OW, image_bytes, row_bytes, y_row, out_inv_scale, qmin, alpha, beta, KH: tl.constexpr,
                             STRIDE_H: tl.constexpr, DIL_H: tl.constexpr, PIXEL_STEP: tl.constexpr,
                             INT8: tl.constexpr, HAS_BIAS: tl.constexpr, ACT: tl.constexpr, TILES: tl.constexpr,
                             BALANCED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                             WINDOW: tl.constexpr, WINDOW_ALIGN: tl.constexpr):
        """The max-pool walks: the layer's output codes max-pooled 3 × 3 at stride 2, padding 1, inside
        the kernel; only the pooled codes are stored (`y_ptr`: [N, ⌈OH/2⌉, ⌈OW/2⌉] pixels). A program
        walks pairs of output rows down strips of an image (`_pooled_pair`), keeping each pair's lower
        row for the next; the row above its first pair it computes first.

        Banded: row group → (image, band of TILES pairs, strip), strips fastest. BALANCED ("balanced"):
        the grid's programs share the walk's M steps, all (image, strip, pair)s with pairs fastest, in
        equal runs that cross strips and images (a pair 0 starts from the padding), so that no last
        round of programs runs mostly empty (docs/decisions/kernel-window-resident-tiles.md)."""
        STRIP: tl.constexpr = BLOCK_M // 2 - 1
        pairs = (OH + 1) // 2
        strips = tl.cdiv((OW + 1) // 2, STRIP)
        offs_n = first_column + tl.arange(0, BLOCK_N)
        n_ok = offs_n < COUT
        bias, scale = load_column_values(offs_n, n_ok, bias_ptr, scale_ptr, INT8, False, HAS_BIAS)
        if BALANCED:
            steps = tl.cdiv(M, tl.num_programs(0))
            first = row_group * steps
            # (image, strip, pair) divided out of the first step, then carried: no divisions inside the walk.
            sequence = first // pairs
            n_idx = sequence // strips
            pair = first - sequence * pairs
            strip = sequence - n_idx * strips
            previous = _row_above(p_ptr, weights, n_idx, strip, pair, first < M, offs_k, offs_n, n_ok, bias, scale, OW,
                                  image_bytes, row_bytes, alpha, beta, KH, STRIDE_H, DIL_H, PIXEL_STEP, INT8, HAS_BIAS,
                                  ACT, BLOCK_M, BLOCK_N, WINDOW, WINDOW_ALIGN)
            for t in range(steps):
                previous = tl.where(pair == 0, _LOWEST_FLOAT32, previous)  # a strip's first pair: padding above
                previous = _pooled_pair(p_ptr, weights, y_ptr, previous, n_idx, strip, pair, first + t < M, offs_k,
                                        offs_n, n_ok, bias, scale, OH, OW, image_bytes, row_bytes, y_row,
                                        out_inv_scale, qmin, alpha, beta, KH, STRIDE_H, DIL_H, PIXEL_STEP, INT8,
                                        HAS_BIAS, ACT, BLOCK_M, BLOCK_N, WINDOW, WINDOW_ALIGN)
                pair, strip, n_idx = odometer_step(pair, strip, n_idx, pairs, strips)
        else:
            per_image = tl.cdiv(pairs, TILES) * strips
            n_idx = row_group // per_image
            band = (row_group - n_idx * per_image) // strips
            strip = row_group - n_idx * per_image - band * strips
            first_pair = band * TILES
            previous = _row_above(p_ptr, weights, n_idx, strip, first_pair, True, offs_k, offs_n, n_ok, bias, scale,
                                  OW, image_bytes, row_bytes, alpha, beta, KH, STRIDE_H, DIL_H, PIXEL_STEP, INT8,
                                  HAS_BIAS, ACT, BLOCK_M, BLOCK_N, WINDOW, WINDOW_ALIGN)
            for t in range(TILES):
                previous = _pooled_pair(p_ptr, weights, y_ptr, previous, n_idx, strip, first_pair + t, True, offs_k,
                                        offs_n, n_ok, bias, scale, OH, OW, image_bytes, row_bytes, y_row,
                                        out_inv_scale, qmin, alpha, beta, KH, STRIDE_H, DIL_H, PIXEL_STEP, INT8,
                                        HAS_BIAS, ACT, BLOCK_M, BLOCK_N, WINDOW, WINDOW_ALIGN)

# The max pool a "max-pool" tile computes (ONNX MaxPool attributes; `passes/fuse_stem_max_pool.py`).
FUSED_POOL_KERNEL, FUSED_POOL_STRIDES, FUSED_POOL_PADS = (3, 3), (2, 2), (1, 1, 1, 1)


@dataclass(frozen=True)
class WindowResidentTile(Tactic):
    """A resident tile (its residual is loaded in the epilogue: `residual_prefetch` 0), whether K
    is walked one filter row at a time ("kh-steps") rather than in one product over K padded to a
    power of two, and, walking by filter rows, whether each row tile covers the same pixels of two
    output rows ("row-pairs", `_window_row_pairs`): each output pixel reads 4 windows of 64 bytes
    through L2, and a pair of rows shares 3 of its 4. "max-pool" (row pairs only): the layer's
    3 × 3 / 2 max pool in the kernel (`_window_pooled_pairs`), `resident.tiles` row pairs a
    program; "balanced": `resident.tiles` programs per SM share the walk in equal runs (of pooled
    row pairs, or of row tiles), however many row tiles the layer has: no last round of programs
    mostly empty, and at batch 1 as many programs as the GPU holds where a run of 8 row tiles a
    program left most SMs idle. Spelled inline in the window tactics (`ops/quantized_window.py`), e.g.
    "window_resident.64x64.t8.w4.s2.kh-steps.row-pairs"."""
    resident: ResidentTile
    kh_steps: bool = False
    row_pairs: bool = False
    max_pool: bool = False
    balanced: bool = False

    SCHEME: ClassVar[tuple] = (Inline("resident", ResidentTile), Flag("kh_steps", "kh-steps"),
                               Flag("row_pairs", "row-pairs"), Flag("max_pool", "max-pool"),
                               Flag("balanced", "balanced"))

    def __post_init__(self):
        if self.row_pairs and not self.kh_steps:
            raise ValueError("WindowResidentTile: row pairs walk K by filter rows (kh_steps)")
        if self.max_pool and not self.row_pairs:
            raise ValueError("WindowResidentTile: the max pool walks row pairs")
        if self.balanced and self.resident.n_adjacent:
            raise ValueError("WindowResidentTile: the balanced walk runs on a 2-D grid (row groups, column tiles)")

    def invalid(self) -> str | None:
        if self.resident.residual_prefetch:
            return "the window tiles load the residual in the epilogue"
        return "the pooled walk needs row tiles of 4 rows or more" if self.max_pool and self.resident.block_m < 4 \
            else None

    @property
    def output_rows(self) -> int:
        """Output rows per row tile."""
        return 2 if self.row_pairs else 1


# Fastest first as timed over pre-packed pixels (docs/decisions/kernel-window-resident-tiles.md).
# bench/kernel_asm.py --layer stem (sm_90, Triton 3.6): 54–84 registers, 44–84 KiB of shared memory
# per program, no spills.
# The stem's 64 output channels are one column tile.
WINDOW_RESIDENT_TILES = (WindowResidentTile(ResidentTile(64, 64, 8, 4, 2), kh_steps=True),
                         WindowResidentTile(ResidentTile(64, 64, 8, 4, 2)),
                         WindowResidentTile(ResidentTile(64, 64, 8, 4, 3)),
                         WindowResidentTile(ResidentTile(64, 64, 8, 4, 3), kh_steps=True),
                         WindowResidentTile(ResidentTile(128, 64, 8, 8, 2)),
                         WindowResidentTile(ResidentTile(64, 64, 8, 8, 3)))
# Builder effort -> how many are timed (beside the implicit-GEMM window tiles): both forms from the start.
WINDOW_RESIDENT_PER_EFFORT = {1: 2, 2: 4}
# The pooled tiles ("max-pool"), `tiles` being row pairs a program, or programs an SM for the
# balanced walk ("balanced": equal runs where bands leave a last partial round of programs;
# docs/decisions/kernel-window-resident-tiles.md). bench/kernel_asm.py --layer stem (sm_90, Triton 3.6):
# 160–203 registers (the pair's two accumulators, the row kept from the pair above and the rows'
# values), no spills; 8 warps on 64 × 64 or 128 × 64 kept as many registers a thread, one program an SM.
POOLED_TILES = (WindowResidentTile(ResidentTile(64, 64, 3, 4, 2), True, True, True, balanced=True),
                WindowResidentTile(ResidentTile(64, 64, 8, 4, 2), True, True, True),
                WindowResidentTile(ResidentTile(64, 64, 4, 4, 2), True, True, True),
                WindowResidentTile(ResidentTile(64, 64, 2, 4, 2), True, True, True, balanced=True),
                WindowResidentTile(ResidentTile(64, 64, 2, 4, 2), True, True, True),
                WindowResidentTile(ResidentTile(64, 64, 8, 4, 3), True, True, True))
POOLED_PER_EFFORT = {1: 3, 2: 4}
# Stems of few output channels (YOLOv8n's 16): a 64-column tile would mask 3/4 of its columns (products,
# accumulator, epilogue), so up to NARROW_MAX_CHANNELS (gemm/resident.py) each candidate is also offered
# as narrow as the channels allow, its rows raised to keep the accumulator's size (`narrow_tiles`;
# what they compile to: docs/decisions/kernel-window-resident-tiles.md).
# Up to this many output channels, below effort NARROW_ONLY_BELOW_EFFORT, the narrow tiles replace the
# 64-column ones they come from (the pooled tiles excepted): on YOLOv8n's 16-channel stem every narrow
# tile beat every wide one (docs/decisions/kernel-window-resident-tiles.md), which only cost build time.
NARROW_ONLY_MAX_CHANNELS = 16
NARROW_ONLY_BELOW_EFFORT = 3


def window_resident_tiles(effort: int, max_pool: bool = False,
                          out_channels: int | None = None) -> list[WindowResidentTile]:
    """The candidates the builder times at this effort, each also with its columns' bias and scale
    loaded once per program (ResidentTile's cols-loaded), then those walking by filter rows also over
    row pairs, then the first tile with its columns loaded (and over row pairs) also balanced
    (BALANCED_PROGRAMS_PER_SM); with `max_pool` (a layer whose 3 × 3 / 2 max pool is fused in) the
    pooled tiles after them, the others then storing the output for the pool to run after. For a layer of
    `out_channels` up to NARROW_MAX_CHANNELS, each of those narrowed (`narrow_tiles`) after them all;
    up to NARROW_ONLY_MAX_CHANNELS below effort NARROW_ONLY_BELOW_EFFORT, the unpooled ones narrowed
    only."""
    tiles = list(WINDOW_RESIDENT_TILES[:WINDOW_RESIDENT_PER_EFFORT.get(effort, len(WINDOW_RESIDENT_TILES))])
    tiles += [replace(tile, resident=replace(tile.resident, columns_loaded=True)) for tile in tiles]
    tiles += [replace(tile, row_pairs=True) for tile in tiles if tile.kh_steps]
    first = WINDOW_RESIDENT_TILES[0]
    tiles += [replace(tile, balanced=True, resident=replace(tile.resident, tiles=per_sm)) for tile in tiles
              if tile.resident == replace(first.resident, columns_loaded=True) and tile.kh_steps == first.kh_steps
              for per_sm in BALANCED_PROGRAMS_PER_SM]
    pooled = list(POOLED_TILES[:POOLED_PER_EFFORT.get(effort, len(POOLED_TILES))]) if max_pool else []
    if out_channels is None or out_channels > NARROW_MAX_CHANNELS:
        return tiles + pooled
    if out_channels <= NARROW_ONLY_MAX_CHANNELS and effort < NARROW_ONLY_BELOW_EFFORT:
        return narrow_tiles(tiles, out_channels) + pooled + narrow_tiles(pooled, out_channels)
    return tiles + pooled + narrow_tiles(tiles + pooled, out_channels)


def narrow_tiles(tiles: list[WindowResidentTile], out_channels: int) -> list[WindowResidentTile]:
    """For a layer of up to NARROW_MAX_CHANNELS output channels, each of `tiles` wider than
    `conv.igemm.narrow_block_n` with that many columns and as many more rows (gemm/resident.py
    `narrowed`), its other fields and flags kept; none for wider layers."""
    narrow = []
    for tile in tiles:
        resident = narrowed(tile.resident, out_channels)
        if resident is not None:
            candidate = replace(tile, resident=resident)
            if candidate not in narrow and candidate not in tiles:
                narrow.append(candidate)
    return narrow


def pooled_size(out_hw: tuple[int, int]) -> tuple[int, int]:
    """The output size of the fused 3 × 3 / 2 max pool (padding 1) over `out_hw`: ⌈OH/2⌉ × ⌈OW/2⌉."""
    return (out_hw[0] + 1) // 2, (out_hw[1] + 1) // 2


def pooled_steps(tile: WindowResidentTile, batch: int, out_hw: tuple[int, int]) -> int:
    """The pooled walk's steps: pairs of output rows over every strip of every image."""
    pairs, pooled_w = pooled_size(out_hw)
    return batch * pairs * -(-pooled_w // (tile.resident.block_m // 2 - 1))


def pooled_row_groups(tile: WindowResidentTile, batch: int, out_hw: tuple[int, int], sms: int) -> int:
    """The programs of one column tile of a max-pool tile: image × band of `tiles` pairs × strip; balanced,
    `tiles` a multiprocessor of `sms` (never more than there are steps)."""
    steps = pooled_steps(tile, batch, out_hw)
    if tile.balanced:
        return min(steps, sms * tile.resident.tiles)
    pairs = pooled_size(out_hw)[0]
    return steps // pairs * -(-pairs // tile.resident.tiles)


def window_alignment(pixel_step: int, row_bytes: int, image_bytes: int) -> int:
    """The largest power of two, up to 16, dividing every window's first byte: windows start
    `pixel_step` bytes apart in rows of `row_bytes` and images of `image_bytes`. Stated to the kernel
    because Triton 3.6 proved the row-pair walk's windows 16-byte aligned where the 4-byte form's
    start every 8 bytes, and copied them 16 bytes at a time: a misaligned address on the GPU
    (docs/decisions/kernel-window-resident-tiles.md)."""
    return math.gcd(pixel_step, row_bytes, image_bytes, 16)


def window_resident_conv(packed: torch.Tensor, w_window: torch.Tensor, bias: torch.Tensor | None,
                         tile: WindowResidentTile, *, geometry: ConvGeometry, dequant_scale: torch.Tensor,
                         residual: torch.Tensor | None = None, activation: str | None = None,
                         alpha: float | None = None, beta: float | None = None,
                         residual_after_activation: bool = False, residual_scale: float | None = None,
                         output_inv_scale: float | None = None, qmin: int = -127,
                         accumulator_bound: int | None = None, fp8: bool = False,
                         float_dtype: torch.dtype = torch.float32, out: torch.Tensor | None = None,
                         pdl: bool = False) -> torch.Tensor:
    """The convolution of the packed pixels `packed` [N, HP, WP, 4] (`window_pack`'s codes) with
    `w_window` [Cout, window, kh, 1] (`window_weight`'s: [Cout, kh, window] in memory) at
    `geometry` (the layer's, whose pads the packing applied), with the epilogue of resident_gemm's
    arguments (`float_dtype` too). Output channels-last [N, Cout, OH, OW] (or into `out`)."""
    if tile.max_pool and (fp8 or residual is not None or output_inv_scale is None):
        raise ValueError(f"window_resident_conv: {tile.name} pools INT8 output codes of a layer without residual")
    code = torch.float8_e4m3fn if fp8 else torch.int8
    cout, window, kh, _ = w_window.shape
    if packed.dtype != code or packed.dim() != 4 or packed.shape[3] != PIXEL_BYTES or not packed.is_contiguous():
        raise ValueError(f"window_resident_conv: packed {tuple(packed.shape)} {packed.dtype} is not contiguous "
                         f"[N, HP, WP, {PIXEL_BYTES}] {code} pixels")
    if w_window.dtype != code or not w_window.permute(0, 2, 1, 3).is_contiguous():
        raise ValueError(f"window_resident_conv: weight {tuple(w_window.shape)} is not window_weight's layout")
    n, _, padded_w, _ = packed.shape
    oh, ow = geometry.out_hw
    out_hw = pooled_size((oh, ow)) if tile.max_pool else (oh, ow)
    y = channels_last_output((n, cout, *out_hw), code if output_inv_scale is not None else float_dtype,
                             packed.device, out, "window_resident_conv")
    rs = residual.stride() if residual is not None else (0, 0, 0, 0)
    rows = n * -(-oh // tile.output_rows) * ow  # row pairs count once
    resident = tile.resident
    grid = resident.grid(rows, cout)
    sms = multiprocessors(packed.device) or INTERPRETED_SMS
    if tile.max_pool:
        rows = pooled_steps(tile, n, (oh, ow))  # the balanced walk's length (M)
        groups, columns = pooled_row_groups(tile, n, (oh, ow), sms), triton.cdiv(cout, resident.block_n)
        grid = (groups * columns,) if resident.n_adjacent else (groups, columns)
    elif tile.balanced:
        grid = (balanced_row_groups(rows, resident.block_m, resident.tiles, sms),
                triton.cdiv(cout, resident.block_n))
    scalars, flags = epilogue_arguments(
        quantized=True, fp8=fp8, bias=bias, residual=residual, activation=activation, alpha=alpha, beta=beta,
        residual_after_activation=residual_after_activation, residual_scale=residual_scale,
        output_inv_scale=output_inv_scale, qmin=qmin,
        accumulator_bound=accumulator_bound)
    _window_resident_kernel[grid](
        packed, w_window, bias if bias is not None else w_window, dequant_scale,
        residual if residual is not None else y, y, rows, cout, oh, ow, packed.stride(0), padded_w * PIXEL_BYTES,
        pixel_stride(y), *rs, *scalars, KH=kh, WINDOW=window, STRIDE_H=geometry.strides[0],
        PIXEL_STEP=geometry.strides[1] * PIXEL_BYTES, DIL_H=geometry.dilations[0], **flags, KH_STEPS=tile.kh_steps,
        TILES=resident.tiles, N_ADJACENT=resident.n_adjacent, BLOCK_M=resident.block_m, BLOCK_N=resident.block_n,
        K_PAD=triton.next_power_of_2(kh * window), PDL=pdl, COLUMNS_LOADED=resident.columns_loaded,
        OUTPUT_ROWS=tile.output_rows, MAX_POOL=tile.max_pool, BALANCED=tile.balanced,
        WINDOW_ALIGN=window_alignment(geometry.strides[1] * PIXEL_BYTES, padded_w * PIXEL_BYTES, packed.stride(0)),
        OUT_ALIGN=told_alignment(cout, pixel_stride(y)), **launch_options(pdl), num_warps=resident.warps,
        num_stages=resident.stages, enable_fp_fusion=False)  # round as the emulation does (see conv_igemm)
    return y


settle_cache_keys(globals())  # last, once every Triton function above exists (common/cache_keys.py)
