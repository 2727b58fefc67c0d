"""Implicit-GEMM convolution in Triton, NHWC, with the whole epilogue fused.

One kernel serves these cases, chosen by constexpr flags:
- INT8 (QConv/QGemm): int8 × int8 products accumulated in int32 on the tensor cores, + the int32
  bias, dequantized in float32 with the per-channel scale, then residual, activation and, when the
  next layers read INT8, requantization (round half to even, saturate) so INT8 goes straight to
  them. Float inputs are quantized as they are loaded. The arithmetic is the one documented in
  `sartor/ops/quantized.py`, step for step, so the output equals the exact emulation's.
- FP8 E4M3 (QConv/QGemm with qformat fp8e4m3; `tl.float8e4nv`, sm_89 and newer): e4m3 × e4m3
  products accumulated in float32, dequantized with the per-channel scale, + the float32 bias, the
  same epilogue, and requantization to e4m3 when the next layers read FP8. The rounding to e4m3
  (clamp to ±448, nearest, ties to even) is the hardware's conversion in compiled kernels and
  float32 arithmetic under Triton's interpreter, which does not round fp32 → fp8 to nearest even
  (`tile_steps.FP8_HARDWARE_ROUNDING`); the packing kernels and float-input A tiles use the arithmetic. Equal
  to the emulation up to float32 accumulation order: on Hopper the tensor cores' FP8 accumulation
  is promoted into the float32 accumulator after every BLOCK_K products
  (`max_num_imprecise_acc`), not kept in their narrower internal accumulator for the whole K.
- FP16/BF16 (FusedConv): products accumulated in float32, bias, residual, activation, one store.

The GEMM is [output pixels, K] × [K, output channels] with K = kh·kw·C ordered (kh, kw, c): the
weight is packed once at load as [output channels, K], K fastest ("K-major"), the layout the
tensor cores read fastest. Two ways of walking K: channel blocks inside each filter tap when C is
a multiple of BLOCK_K (each row's taps inside the image found once as bits, contiguous channel
loads; up to MAX_BLOCKED_TAPS taps), or a flat gather over
(kh, kw, c) for small or ragged C (the 3-channel stem). The activation input may have any strides
(NCHW or NHWC); the output is written channels-last.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import ClassVar

import torch

from ..common.arrival_counters import take_counters
from ..common.cache_keys import settle_cache_keys
from ..pointwise.epilogue import channels_last_output, pixel_stride, told_alignment, triton
from ..common.pdl import launch_options
from ..registry import PACKED_K_MAJOR, Dims, Flag, LayerFacts, Number, Tactic, register
from ..common.tile_steps import epilogue_arguments

try:  # host-side descriptors: Triton 3.4 and newer
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - older Triton, or none: no TMA-fed tiles
    TensorDescriptor = None
TMA_ALIGNMENT = 16  # bytes: a bulk tensor copy's base address and every stride but the innermost
# The blocked walk over K keeps which of a row's taps fall inside the image as one bit per tap in an
# int64: larger filters (9×9 and up) take the gather walk.
MAX_BLOCKED_TAPS = 64

if triton is not None:
    import triton.language as tl

    from ..common.pdl import await_previous_kernel
    from ..pointwise.epilogue import told_multiple
    BLOCKED_TAPS_BOUND = tl.constexpr(MAX_BLOCKED_TAPS)  # the kernel's view of the host's bound
    from ..common.tile_steps import (accumulate_dot, store_epilogue, store_epilogue_halves, store_epilogue_halves_given,
                             load_residual_halves, grouped_tile, next_k_step, pixel_coords)

    @triton.jit
    def _conv_igemm_kernel(
            x_ptr, w_ptr, w_desc, bias_ptr, scale_ptr, res_ptr, y_ptr, ws_ptr, arrivals_ptr,
            M, COUT, C, H, W, OH, OW, y_row,
            sxn, sxc, sxh, sxw, x_shift, srn, src, srh, srw,
            pad_h, pad_w, dil_h, dil_w,
            in_inv_scale, res_scale, out_inv_scale, qmin, alpha, beta,
            KH: tl.constexpr, KW: tl.constexpr, STRIDE_H: tl.constexpr, STRIDE_W: tl.constexpr,
            INT8: tl.constexpr, FP8: tl.constexpr, QUANTIZE_INPUT: tl.constexpr, HAS_BIAS: tl.constexpr,
            HAS_RES: tl.constexpr, RES_QUANT: tl.constexpr, RES_AFTER: tl.constexpr, ACT: tl.constexpr,
            OUT_QUANT: tl.constexpr, K_GATHER: tl.constexpr, SPLIT_K: tl.constexpr, ROW_ALIGN: tl.constexpr,
            EPILOGUE_HALVES: tl.constexpr, RES_EARLY: tl.constexpr, CHANNEL_TAIL: tl.constexpr,
            WEIGHT_TMA: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
            GROUP_M: tl.constexpr, PDL: tl.constexpr = False, ROW_TAPS: tl.constexpr = 0,
            OUT_ALIGN: tl.constexpr = 1, ONE_COLUMN: tl.constexpr = False, LAST_REDUCES: tl.constexpr = False,
            RES_SHIFT: tl.constexpr = 0, RES_ALIGN: tl.constexpr = 1):
        # Outputs and pixel stride multiples of 8 that Triton cannot see (24 or 40 channels): told,
        # the epilogue's bias and scale loads and its stores go as vectors, not a word or a byte at a time.
        COUT = told_multiple(COUT, OUT_ALIGN)
        y_row = told_multiple(y_row, OUT_ALIGN)
        # The residual starts RES_SHIFT elements past the aligned pointer given (`aligned_start`): a
        # constant, so its loads keep the alignment the two share; its strides are told (RES_ALIGN).
        res_ptr = res_ptr + RES_SHIFT
        srn, srh, srw = told_multiple(srn, RES_ALIGN), told_multiple(srh, RES_ALIGN), told_multiple(srw, RES_ALIGN)
        pid_m, pid_n = grouped_tile(tl.program_id(0), M, COUT, BLOCK_M, BLOCK_N, GROUP_M, ONE_COLUMN)

        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        m_ok = offs_m < M
        n_ok = offs_n < COUT
        n_idx, oh, ow = pixel_coords(offs_m, OH, OW)
        ih0 = oh * STRIDE_H - pad_h
        iw0 = ow * STRIDE_W - pad_w
        x_row = n_idx.to(tl.int64) * sxn + x_shift  # x_ptr is 16-byte aligned; the input starts x_shift after
        k_total = KH * KW * C
        w_col = offs_n.to(tl.int64) * k_total

        if INT8:
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
        else:
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        # With PDL, the wait for the kernel before comes after the tile's index arithmetic (no memory
        # access above), which runs while that kernel ends.
        await_previous_kernel(PDL)
        if RES_EARLY:  # (halves, no split-K, a residual: see TileConfig)
            res_lo, res_hi = load_residual_halves(res_ptr, pid_n * BLOCK_N, COUT, m_ok, n_idx, oh, ow, srn, src, srh, srw,
                                              BLOCK_N)

        # Split-K: program (tile, pid_k) walks its share of the K blocks and leaves its partial sum
        # in the workspace; _splitk_epilogue_kernel adds the shares and runs the epilogue, or, with
        # LAST_REDUCES, the tile's last share to finish does (reduce_shares_in_place).
        pid_k = tl.program_id(1)
        if ROW_TAPS > 0:
            # One K step per filter row: its KW taps' ROW_TAPS (= C, a multiple of 8) channels side by
            # side in one K block, so a row of few channels takes 1 step where the tap walk took KW.
            # Which tap and channel a K column holds is fixed for the whole loop; each run of C
            # columns is one pixel's contiguous channels, loaded as vectors.
            tap_w = offs_k // ROW_TAPS
            k_ok = offs_k < KW * ROW_TAPS
            iw = iw0[:, None] + (tap_w * dil_w)[None, :]
            row_cols_ok = m_ok[:, None] & k_ok[None, :] & (iw >= 0) & (iw < W)
            row_cols = x_row[:, None] + iw * sxw + ((offs_k - tap_w * ROW_TAPS) * sxc)[None, :]
            # Triton proves the runs of C columns aligned by itself only for C a power of two from 16
            # whose pixels are 16 elements apart (it sees a stride as a multiple of 16 or of nothing).
            # Otherwise (24 or 40 channels, or pixels 8 apart) it is told: every run of ROW_VECTOR
            # columns, the largest power of two dividing both C and every pixel's offset (ROW_ALIGN),
            # is contiguous from a multiple of ROW_VECTOR; and the weight's rows are KH·KW·C apart
            # as a constant, whose factor 8 it sees, not as the argument C, of unknown alignment.
            ROW_VECTOR: tl.constexpr = ROW_ALIGN if ROW_ALIGN < (ROW_TAPS & -ROW_TAPS) else (ROW_TAPS & -ROW_TAPS)
            ROW_TOLD: tl.constexpr = ROW_TAPS % 16 != 0 or ROW_TAPS & (ROW_TAPS - 1) != 0 or ROW_ALIGN < 16
            if ROW_TOLD:
                w_row = (offs_n.to(tl.int64) * (KH * KW * ROW_TAPS))[None, :] + offs_k[:, None]
            else:
                w_row = w_col[None, :] + offs_k[:, None]
            w_ok = n_ok[None, :] & k_ok[:, None]
            for tap_h in range(KH):
                ih = ih0 + tap_h * dil_h
                if ROW_TOLD and ROW_VECTOR > 1:
                    a_cols = tl.multiple_of(row_cols + (ih * sxh)[:, None], [1, ROW_VECTOR])
                    a = tl.load(x_ptr + tl.max_contiguous(a_cols, [1, ROW_VECTOR]),
                                mask=row_cols_ok & ((ih >= 0) & (ih < H))[:, None], other=0.0)
                else:
                    a = tl.load(x_ptr + row_cols + (ih * sxh)[:, None],
                                mask=row_cols_ok & ((ih >= 0) & (ih < H))[:, None], other=0.0)
                b = tl.load(w_ptr + w_row + tap_h * (KW * ROW_TAPS), mask=w_ok, other=0.0)
                acc = accumulate_dot(acc, a, b, in_inv_scale, qmin, INT8, FP8, QUANTIZE_INPUT, BLOCK_K)
        elif K_GATHER:
            k_share = tl.cdiv(tl.cdiv(k_total, BLOCK_K), SPLIT_K) * BLOCK_K
            k_begin = pid_k * k_share
            k_end = tl.minimum(k_begin + k_share, k_total)
            for k0 in range(k_begin, k_end, BLOCK_K):
                kk = k0 + offs_k
                tap = kk // C
                c = kk - tap * C
                kh = tap // KW
                kw = tap - kh * KW
                ih = ih0[:, None] + (kh * dil_h)[None, :]
                iw = iw0[:, None] + (kw * dil_w)[None, :]
                a_mask = m_ok[:, None] & (kk < k_total)[None, :] & (ih >= 0) & (ih < H) & (iw >= 0) & (iw < W)
                a = tl.load(x_ptr + x_row[:, None] + ih * sxh + iw * sxw + c[None, :] * sxc, mask=a_mask, other=0.0)
                b = tl.load(w_ptr + w_col[None, :] + kk[:, None], mask=n_ok[None, :] & (kk < k_total)[:, None],
                            other=0.0)
                acc = accumulate_dot(acc, a, b, in_inv_scale, qmin, INT8, FP8, QUANTIZE_INPUT, BLOCK_K)
        else:
            c_blocks = tl.cdiv(C, BLOCK_K)
            steps = KH * KW * c_blocks
            step_share = tl.cdiv(steps, SPLIT_K)
            step_begin = pid_k * step_share
            # Once per program: where each row's window starts and, as one bit per tap, which of its
            # taps fall inside the image. A step then adds its tap's offset (the same for every row)
            # and tests a bit, where it recomputed each row's position and four bounds; and the walk's
            # place (tap kh, kw and channel block cb) is carried from step to step, not divided out of
            # the step's number. The K loop of the 128×128×64 tile on a 3×3 layer issued 139
            # instructions a step, 2 of them products (bench/kernel_asm.py --loop-mix).
            tl.static_assert(KH * KW <= BLOCKED_TAPS_BOUND, "larger filters take the gather walk (MAX_BLOCKED_TAPS)")
            window = x_row + ih0 * sxh + iw0 * sxw
            if KH * KW <= 32:
                taps_ok = tl.zeros((BLOCK_M,), dtype=tl.int32)
            else:
                taps_ok = tl.zeros((BLOCK_M,), dtype=tl.int64)
            for tap_h in tl.static_range(KH):
                for tap_w in tl.static_range(KW):
                    ih = ih0 + tap_h * dil_h
                    iw = iw0 + tap_w * dil_w
                    inside = m_ok & (ih >= 0) & (ih < H) & (iw >= 0) & (iw < W)
                    taps_ok = taps_ok | (inside.to(taps_ok.dtype) << (tap_h * KW + tap_w))
            tap = step_begin // c_blocks
            cb = step_begin - tap * c_blocks
            kh = tap // KW
            kw = tap - kh * KW
            for step in range(step_begin, tl.minimum(step_begin + step_share, steps)):
                tap = kh * KW + kw
                c0 = cb * BLOCK_K
                row_ok = ((taps_ok >> tap) & 1) != 0
                cc = c0 + offs_k
                row = window + (kh * dil_h * sxh + kw * dil_w * sxw)
                if ROW_ALIGN > 1:  # strides Triton does not see as multiples of 16 (see row_alignment)
                    row = tl.multiple_of(row, [ROW_ALIGN])
                if CHANNEL_TAIL > 0:
                    # C is not a multiple of BLOCK_K: each tap's last block is cut at C (the
                    # constant, so the cut's alignment is known and the rows still load as vectors).
                    # The weight's rows too are addressed through the constant (KH·KW·C apart), whose
                    # factors of 2 Triton sees, where the argument C would load them byte by byte.
                    c_ok = cc < CHANNEL_TAIL
                    a = tl.load(x_ptr + row[:, None] + cc[None, :] * sxc, mask=row_ok[:, None] & c_ok[None, :],
                                other=0.0)
                    w_tail_col = offs_n.to(tl.int64) * (KH * KW * CHANNEL_TAIL)
                    b = tl.load(w_ptr + w_tail_col[None, :] + (tap * CHANNEL_TAIL + cc)[:, None],
                                mask=n_ok[None, :] & c_ok[:, None], other=0.0)
                else:
                    a = tl.load(x_ptr + row[:, None] + cc[None, :] * sxc, mask=row_ok[:, None], other=0.0)
                    if WEIGHT_TMA:  # one bulk copy of the [BLOCK_N, BLOCK_K] weight box (see TileConfig)
                        b = tl.trans(w_desc.load([pid_n * BLOCK_N, tap * C + c0]))
                    else:
                        b = tl.load(w_ptr + w_col[None, :] + (tap * C + cc)[:, None], mask=n_ok[None, :], other=0.0)
                acc = accumulate_dot(acc, a, b, in_inv_scale, qmin, INT8, FP8, QUANTIZE_INPUT, BLOCK_K)
                kh, kw, cb = next_k_step(kh, kw, cb, c_blocks, KW)

        if RES_EARLY:
            store_epilogue_halves_given(acc, res_lo, res_hi, offs_m, pid_n * BLOCK_N, COUT, m_ok, bias_ptr, scale_ptr,
                                         y_ptr, y_row, res_scale, out_inv_scale, qmin, alpha, beta, INT8, FP8,
                                         HAS_BIAS, HAS_RES, RES_QUANT, RES_AFTER, ACT, OUT_QUANT, BLOCK_M, BLOCK_N)
        elif SPLIT_K == 1 and EPILOGUE_HALVES:
            store_epilogue_halves(acc, offs_m, pid_n * BLOCK_N, COUT, m_ok, n_idx, oh, ow, bias_ptr, scale_ptr,
                                   res_ptr, y_ptr, y_row, srn, src, srh, srw, res_scale, out_inv_scale, qmin, alpha,
                                   beta, INT8, FP8, HAS_BIAS, HAS_RES, RES_QUANT, RES_AFTER, ACT, OUT_QUANT,
                                   BLOCK_M, BLOCK_N)
        elif SPLIT_K == 1:
            store_epilogue(acc, offs_m, offs_n, m_ok, n_ok, n_idx, oh, ow, bias_ptr, scale_ptr, res_ptr, y_ptr,
                            y_row, srn, src, srh, srw, res_scale, out_inv_scale, qmin, alpha, beta,
                            INT8, FP8, HAS_BIAS, HAS_RES, RES_QUANT, RES_AFTER, ACT, OUT_QUANT)
        elif LAST_REDUCES:
            acc, last = reduce_shares_in_place(acc, ws_ptr, arrivals_ptr + tl.program_id(0), pid_k, offs_m, offs_n,
                                               m_ok, n_ok, M, COUT, SPLIT_K)
            if last:
                store_epilogue(acc, offs_m, offs_n, m_ok, n_ok, n_idx, oh, ow, bias_ptr, scale_ptr, res_ptr, y_ptr,
                                y_row, srn, src, srh, srw, res_scale, out_inv_scale, qmin, alpha, beta,
                                INT8, FP8, HAS_BIAS, HAS_RES, RES_QUANT, RES_AFTER, ACT, OUT_QUANT)
        else:
            tl.store(ws_ptr + _share_slot(pid_k, M, offs_m, offs_n, COUT), acc, mask=m_ok[:, None] & n_ok[None, :])

    @triton.jit
    def _share_slot(k, M, offs_m, offs_n, COUT):
        """Where split-K share k's partial sums of these rows and columns lie in the workspace
        ([shares, M, COUT])."""
        return (k * M + offs_m).to(tl.int64)[:, None] * COUT + offs_n[None, :]

    @triton.jit
    def reduce_shares_in_place(acc, ws_ptr, arrival_ptr, pid_k, offs_m, offs_n, m_ok, n_ok, M, COUT,
                               SPLIT_K: tl.constexpr):
        """Split-K without a second kernel: each share stores its partial sum in its workspace slot and
        counts itself in at the tile's arrival counter; the share that arrives last gets (the sum of
        every share, True), the others (acc, False). The last adds the slots in share order, as
        _splitk_epilogue_kernel does, so the sum is the same bits whichever share is last (float too),
        and sets the counter back to zero for the next launch."""
        mask = m_ok[:, None] & n_ok[None, :]
        tl.store(ws_ptr + _share_slot(pid_k, M, offs_m, offs_n, COUT), acc, mask=mask)
        # Every thread's stores before the count (one thread's atomic, whose release covers them).
        tl.debug_barrier()
        arrived = tl.atomic_add(arrival_ptr, 1, sem="acq_rel", scope="gpu")
        last = arrived == SPLIT_K - 1
        total = acc
        if last:
            # Past the acquire, the other shares' slots are read from L2 (.cg), never a stale L1 line;
            # this share's own sum is its registers. Unrolled: every slot's load in flight at once
            # (see _splitk_epilogue_kernel), which TileConfig.invalid keeps within a thread's registers.
            for k in tl.static_range(SPLIT_K):
                share = tl.load(ws_ptr + _share_slot(k, M, offs_m, offs_n, COUT), mask=mask & (pid_k != k), other=0,
                                cache_modifier=".cg")
                share = tl.where(pid_k == k, acc, share)
                if k == 0:
                    total = share
                else:
                    total += share
            tl.atomic_xchg(arrival_ptr, 0, sem="relaxed", scope="gpu")
        return total, last

    @triton.jit
    def _splitk_epilogue_kernel(
            ws_ptr, bias_ptr, scale_ptr, res_ptr, y_ptr, M, COUT, OH, OW, y_row, srn, src, srh, srw,
            res_scale, out_inv_scale, qmin, alpha, beta,
            INT8: tl.constexpr, FP8: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr,
            RES_QUANT: tl.constexpr, RES_AFTER: tl.constexpr, ACT: tl.constexpr, OUT_QUANT: tl.constexpr,
            SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, RES_SHIFT: tl.constexpr = 0,
            RES_ALIGN: tl.constexpr = 1):
        """The shares of a split-K convolution added (int32: exactly), then the layer's epilogue; the
        residual as `_conv_igemm_kernel` takes it (RES_SHIFT, RES_ALIGN)."""
        res_ptr = res_ptr + RES_SHIFT
        srn, srh, srw = told_multiple(srn, RES_ALIGN), told_multiple(srh, RES_ALIGN), told_multiple(srw, RES_ALIGN)
        offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        m_ok = offs_m < M
        n_ok = offs_n < COUT
        mask = m_ok[:, None] & n_ok[None, :]
        acc = tl.load(ws_ptr + _share_slot(0, M, offs_m, offs_n, COUT), mask=mask, other=0)
        # Unrolled, so that every share's load is in flight at once: as a loop, each waited for the
        # last (docs/decisions/kernel-split-k-epilogue-unrolled.md).
        for k in tl.static_range(1, SPLIT_K):
            acc += tl.load(ws_ptr + _share_slot(k, M, offs_m, offs_n, COUT), mask=mask, other=0)
        n_idx, oh, ow = pixel_coords(offs_m, OH, OW)
        store_epilogue(acc, offs_m, offs_n, m_ok, n_ok, n_idx, oh, ow, bias_ptr, scale_ptr, res_ptr, y_ptr,
                        y_row, srn, src, srh, srw, res_scale, out_inv_scale, qmin, alpha, beta,
                        INT8, FP8, HAS_BIAS, HAS_RES, RES_QUANT, RES_AFTER, ACT, OUT_QUANT)


@register
@dataclass(frozen=True)
class TileConfig(Tactic):
    """One kernel configuration: the tile, the warps, the software-pipeline depth, how many programs
    share each tile's K (split-K: partial sums in a workspace, then one epilogue kernel, or the
    epilogue in the kernel, run by each tile's last share to finish: "last-reduces", one launch
    where the epilogue kernel made two, its sum the same bits), whether the epilogue runs in two
    halves of the tile's columns (fewer registers live), and whether K is walked tap by tap with
    each tap's channels cut at C ("padded taps": for C not a multiple of BLOCK_K, which otherwise
    gathers K element by element), and, with halves, whether the residual's tile is asked for before
    the K loop, so that its memory latency hides behind the products rather than stalling the
    epilogue ("residual early"), and whether the weight's tile comes by one TMA bulk copy per K step
    rather than by every thread's loads ("weight TMA": no per-thread addresses, and the copy writes
    shared memory in the layout the tensor cores read; blocked K walks only), and whether each K
    step is one filter row with its taps' channels side by side ("row taps": for few channels, a
    multiple of 8, where the tap walk's steps are mostly padding). Named e.g.
    "igemm.128x128x64.w8.s3.split4", "igemm.64x64x64.w4.s4.split4.last-reduces" or
    "igemm.64x64x64.w4.s4.halves.residual-early"."""
    block_m: int
    block_n: int
    block_k: int
    warps: int
    stages: int
    split_k: int = 1
    epilogue_halves: bool = False
    padded_taps: bool = False
    residual_early: bool = False
    weight_tma: bool = False
    row_taps: bool = False
    last_reduces: bool = False

    FAMILY: ClassVar[str] = "igemm"
    SCHEME: ClassVar[tuple] = (Dims(("block_m", "block_n", "block_k")), Number("warps", "w"), Number("stages", "s"),
                               Number("split_k", "split", omit=1), Flag("epilogue_halves", "halves"),
                               Flag("residual_early", "residual-early"), Flag("padded_taps", "padded-taps"),
                               Flag("weight_tma", "weight-tma"), Flag("row_taps", "row-taps"),
                               Flag("last_reduces", "last-reduces"))
    WEIGHT_LAYOUT: ClassVar[str] = PACKED_K_MAJOR
    PROGRAMMATIC_LAUNCH: ClassVar[bool] = True

    def invalid(self) -> str | None:
        if self.split_k < 1 or (self.epilogue_halves and (self.split_k > 1 or self.block_n % 2)):
            return "split-K shares its epilogue whole; halves need an even block_n"
        if self.last_reduces and self.split_k < 2:
            return "last-reduces is a way of ending split-K: it needs split2 or more"
        if self.last_reduces and self.accumulators_per_thread * self.split_k > MAX_SLOT_VALUES_AT_ONCE:
            return (f"last-reduces holds every share's slot at once: at most {MAX_SLOT_VALUES_AT_ONCE} values a "
                    f"thread (tile elements × shares ÷ threads), where this tile would spill")
        if self.residual_early and not self.epilogue_halves:
            return "residual-early comes with halves"
        if self.row_taps and (self.padded_taps or self.weight_tma or self.split_k > 1):
            return "row-taps is its own K walk, in one pass: no padded taps, weight TMA or split-K"
        return "weight-tma walks blocked K, not padded taps" if self.weight_tma and self.padded_taps else None

    @property
    def accumulators_per_thread(self) -> int:
        return self.block_m * self.block_n // (32 * self.warps)

    def describe(self, layer: LayerFacts) -> str:
        kind = "int8 tensor cores, int32 accumulate" if layer.op_type in ("QConv", "QGemm") else "fp32 accumulate"
        kind = "fp8 e4m3 tensor cores, fp32 accumulate" if layer.fp8 else kind
        epilogue = "fused epilogue in two column halves" if self.epilogue_halves else "fused epilogue"
        epilogue += ", run by each tile's last split-K share" if self.last_reduces else ""
        epilogue += ", residual loaded before the K loop" if self.residual_early else ""
        return f"triton implicit-GEMM {self.fields_text} ({kind}) + {epilogue}"


# Candidate tiles, best guesses first: the builder times the first few at low effort and more at
# higher effort. 8-bit inputs take a deeper K tile (the tensor-core K step is 32 bytes).
_INT8_TILES = (TileConfig(128, 128, 64, 8, 3), TileConfig(64, 64, 64, 4, 4), TileConfig(128, 64, 128, 4, 3),
               TileConfig(64, 128, 128, 4, 3), TileConfig(128, 256, 64, 8, 3), TileConfig(64, 32, 128, 4, 4),
               TileConfig(256, 128, 64, 8, 3), TileConfig(128, 128, 128, 8, 3), TileConfig(32, 64, 128, 4, 4),
               TileConfig(64, 64, 128, 4, 3))
_FLOAT_TILES = (TileConfig(128, 128, 32, 8, 3), TileConfig(64, 64, 32, 4, 4), TileConfig(128, 64, 64, 4, 3),
                TileConfig(64, 128, 64, 4, 3), TileConfig(128, 256, 32, 8, 3), TileConfig(64, 32, 64, 4, 4),
                TileConfig(256, 128, 32, 8, 3), TileConfig(128, 128, 64, 8, 3), TileConfig(32, 64, 64, 4, 4),
                TileConfig(64, 64, 64, 4, 3))
# Builder effort -> how many candidate tiles are timed.
TILES_PER_EFFORT = {1: 2, 2: 6, 3: 8, 4: 10, 5: 10}
# Timed at every effort: the 128×128 tile with the deeper K step, which won ResNet-50's later 3×3 and
# strided 1×1 layers over the effort-1 tiles (docs/decisions/kernel-igemm-deep-k-tile.md).
DEEP_K_TILES = {True: TileConfig(128, 128, 128, 8, 3), False: TileConfig(128, 128, 64, 8, 3)}


def candidate_tiles(int8: bool, effort: int) -> list[TileConfig]:
    """The implicit-GEMM tiles the builder times at this effort, best guesses first, with the
    deep-K tile (DEEP_K_TILES) at every effort."""
    tiles = _INT8_TILES if int8 else _FLOAT_TILES
    chosen = list(tiles[:TILES_PER_EFFORT.get(effort, len(tiles))])
    deep = DEEP_K_TILES[int8]
    return chosen if deep in chosen else chosen + [deep]


GROUP_M = 8  # row tiles that walk the column tiles together (tile_steps.grouped_tile)
MIN_K_BLOCKS_PER_SHARE = 4  # a split-K share shorter than this spends its time on the workspace
MAX_SPLIT_K = 16
# A last-reduces tile's last share holds every other share's slot in registers at once (their
# loads in flight together: one by one, each waits for the last). Under this many values a
# thread, tile elements × shares ÷ threads, it does not spill on Hopper: the 64×64 tile of 4 warps
# split 4 ways holds 128, and 128×64 split 4 ways 256 spill (bench/kernel_asm.py --split-k).
MAX_SLOT_VALUES_AT_ONCE = 128


def split_k_tiles(tiles: list[TileConfig], rows: int, cout: int, k_total: int, sms: int) -> list[TileConfig]:
    """Split-K variants of `tiles` for a layer whose tile grid leaves most of the GPU's `sms`
    multiprocessors idle (the 7×7 and 14×14 stages at batch 1: ResNet-50's last 3×3 layers give
    8 tiles of 64×64 for 132 SMs, each walking K = 4,608): the tile's K shared by as many
    programs as fill the GPU, each share at least MIN_K_BLOCKS_PER_SHARE blocks long, each
    split ended both ways (the epilogue kernel, or last-reduces). Only candidates: the builder
    times them against the single-pass tiles."""
    variants = []
    for tile in tiles:
        grid = -(-rows // tile.block_m) * -(-cout // tile.block_n)
        k_blocks = -(-k_total // tile.block_k)
        split = 1
        while (split * 2 * grid <= sms and k_blocks // (split * 2) >= MIN_K_BLOCKS_PER_SHARE
               and split * 2 <= MAX_SPLIT_K):
            split *= 2
        if split > 1:
            variants.append(replace(tile, split_k=split))
            reduced = replace(tile, split_k=split, last_reduces=True)
            if reduced.invalid() is None:
                variants.append(reduced)
    return variants


def single_pass_tiles(tiles: list[TileConfig], k_total: int) -> list[TileConfig]:
    """One-stage variants of `tiles` for a layer whose whole K fits one of their K blocks (ResNet's
    1×1 layers over 64 channels): the software pipeline has nothing to overlap there, and its
    buffers (stages × the A and B tiles, in shared memory) only limit how many programs an SM
    holds. Only candidates: the builder times them against the tiles."""
    return [replace(tile, stages=1) for tile in tiles
            if tile.stages > 1 and tile.split_k == 1 and k_total <= tile.block_k]


# The narrowest N block of the tap and row walks: a layer of 16 outputs (YOLO's model.2 3×3 layers)
# in 32 columns spent half its products and half its epilogue, the part its time is bound by, on
# columns it masks off (docs/decisions/kernel-igemm-row-taps.md).
# Not tl.dot's limit (Triton 3.6 pads 8-bit products of fewer rows or columns; only K must be 32 or
# more): at 16, each half of an epilogue still stores 8 bytes a pixel. The resident GEMMs and the
# window stem narrow to the same (gemm/resident.py `narrowed`).
NARROW_MIN_BLOCK_N = 16


def narrow_block_n(out_channels: int) -> int:
    """The columns of a tile narrowed to a layer's outputs: the power of two holding `out_channels`,
    NARROW_MIN_BLOCK_N at least."""
    return max(NARROW_MIN_BLOCK_N, 1 << (out_channels - 1).bit_length())


# A tile narrowed to few outputs is offered as well with its rows raised to keep block_m · block_n,
# up to this many: a thread's address work before the K walk and its epilogue are spread over more
# outputs (docs/decisions/kernel-igemm-row-taps.md). The narrowed tile stays too: at batch 1 the
# taller ones leave multiprocessors idle.
NARROW_MAX_BLOCK_M = 256


def narrowed_variants(tile: TileConfig, cout: int, **changes) -> list[TileConfig]:
    """`tile` with `changes` and its N block narrowed to `narrow_block_n(cout)` (no wider than it
    was), then the same with as many more rows as columns it lost, up to NARROW_MAX_BLOCK_M."""
    block_n = min(tile.block_n, narrow_block_n(cout))
    narrow = replace(tile, block_n=block_n, **changes)
    taller = replace(narrow, block_m=min(NARROW_MAX_BLOCK_M, tile.block_m * tile.block_n // block_n))
    return [narrow] + ([taller] if taller.block_m > narrow.block_m else [])


PADDED_TAPS_CHANNEL_MULTIPLE = 8  # rows of 8 elements or more load as vectors; others stay gathered


def padded_tap_tiles(tiles: list[TileConfig], channels: int, cout: int, eight_bit: bool) -> list[TileConfig]:
    """Variants of `tiles` that walk K tap by tap, each tap's channels in blocks cut at `channels`,
    for a convolution whose channel count is no multiple of the tiles' BLOCK_K (24, 40, 48, 80
    channels: otherwise each K element is gathered alone, with a division per element;
    docs/decisions/kernel-igemm-padded-taps.md). The K block is
    the tensor-core step (32 bytes of 8-bit codes, 16 halves) or twice it, whichever pads less, and
    the N block no wider than the layer's outputs need (`narrowed_variants`: also with taller rows).
    Only candidates: timed against the gather."""
    if channels % PADDED_TAPS_CHANNEL_MULTIPLE:
        return []
    step = 32 if eight_bit else 16
    block_k = min((2 * step, step), key=lambda k: -(-channels // k) * k)
    variants = []
    for tile in tiles:
        if tile.split_k == 1 and not tile.padded_taps and channels % tile.block_k and channels % block_k:
            for variant in narrowed_variants(tile, cout, block_k=block_k, padded_taps=True, epilogue_halves=False):
                if variant not in variants:
                    variants.append(variant)
    return variants


ROW_TAPS_MIN_CHANNELS = 8  # C a multiple of this: each 8 of a pixel's channels load as one vector (8 bytes)
ROW_TAPS_MAX_BLOCK_K = 128


def row_block(channels: int, kernel: tuple[int, int], eight_bit: bool) -> int:
    """The K columns of one filter row when K is walked a row at a time (its KW taps' channels side by
    side), else 0: for several taps a row over a multiple of 8 channels whose row, rounded up to a
    power of two of at least the tensor cores' K step, fits ROW_TAPS_MAX_BLOCK_K (16 and 32 channels
    at 3×3: 64 and 128 columns in 8 bits)."""
    kw = kernel[1]
    if kw < 2 or channels < ROW_TAPS_MIN_CHANNELS or channels % ROW_TAPS_MIN_CHANNELS:
        return 0
    columns = max(32 if eight_bit else 16, 1 << (kw * channels - 1).bit_length())
    return columns if columns <= ROW_TAPS_MAX_BLOCK_K else 0


def row_tap_tiles(tiles: list[TileConfig], channels: int, kernel: tuple[int, int], cout: int,
                  eight_bit: bool) -> list[TileConfig]:
    """Variants of `tiles` whose K steps are whole filter rows (`row_taps`), for a convolution of
    several taps a row over few channels, a multiple of 8: YOLO's 16- and 32-channel 3×3 layers
    walk 3 steps of 48 or 96 columns instead of 9 taps each padded to the tensor-core step, the
    sample detector's 24- and 40-channel ones 3 steps of 72 or 120. The K block is the row's KW·C
    columns rounded up to a power of two, at least the tensor-core step, at most
    ROW_TAPS_MAX_BLOCK_K (so not 48 channels a 3-tap row: 144 columns); the N block no wider than
    the outputs need (`narrowed_variants`: also with taller rows). Only candidates, timed against
    the tap walks."""
    block_k = row_block(channels, kernel, eight_bit)
    if not block_k:
        return []
    variants = []
    for tile in tiles:
        if tile.split_k == 1 and not (tile.padded_taps or tile.weight_tma or tile.row_taps):
            for variant in narrowed_variants(tile, cout, block_k=block_k, row_taps=True, epilogue_halves=False,
                                             residual_early=False):
                if variant not in variants:
                    variants.append(variant)
    return variants


def row_taps_apply(channels: int, kernel: tuple[int, int], tile: TileConfig) -> bool:
    """Whether `tile`'s row-taps walk can run this convolution: a channel count that is a multiple
    of 8 or a power of two, whose filter rows fit one K block."""
    shaped = channels >= 1 and (channels % ROW_TAPS_MIN_CHANNELS == 0 or not channels & (channels - 1))
    return tile.row_taps and shaped and kernel[1] * channels <= tile.block_k and tile.split_k == 1


def weight_tma_tiles(tiles: list[TileConfig], channels: int, w_shape: tuple, element_size: int) -> list[TileConfig]:
    """Weight-TMA variants of `tiles` for a convolution with more than one filter tap whose
    channels are whole K blocks: no per-thread addresses for the weight, and shared memory written in
    the layout the tensor cores read (docs/decisions/kernel-igemm-weight-tma.md). 1×1 layers
    have `kernels/gemm/tma.py`. Only candidates: timed against the tiles they vary."""
    if math.prod(w_shape[2:]) < 2:
        return []
    return [replace(tile, weight_tma=True) for tile in tiles
            if not tile.weight_tma and not tile.padded_taps and channels % tile.block_k == 0
            and weight_tma_applies(w_shape, element_size, tile.block_k)]


HALVES_MIN_BLOCK_N = 128  # without a residual, narrower tiles keep their registers (kernel_asm: 64 → 62)


def halved_epilogue_tiles(tiles: list[TileConfig], residual: bool) -> list[TileConfig]:
    """Variants of `tiles` whose epilogue runs in two halves of the columns, where the epilogue
    holds much at once: with a residual (ResNet's layer1 conv3: 96 → 61 registers in the 64×64
    tile), or in tiles HALVES_MIN_BLOCK_N wide or more (128×128: 128 → 116 without one). Fewer
    registers live, so more programs fit on an SM (bench/kernel_asm.py). With a residual, each also
    with the residual loaded before the K loop (`residual_early`). Only candidates, timed;
    elsewhere they would only add build time."""
    halved = [replace(tile, epilogue_halves=True) for tile in tiles
              if tile.split_k == 1 and not tile.epilogue_halves and tile.block_n >= 32
              and (residual or tile.block_n >= HALVES_MIN_BLOCK_N)]
    return halved + ([replace(tile, residual_early=True) for tile in halved] if residual else [])


def multiprocessors(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 0


# The SMs a persistent launch fills off the GPU (under the interpreter): few, so that each program
# walks several tiles.
PERSISTENT_PROGRAMS_WITHOUT_GPU = 3


@dataclass(frozen=True)
class ConvGeometry:
    """A 2-D convolution's (or a GEMM's, as a 1×1 conv over 1×1 pixels) shape parameters."""
    kernel: tuple[int, int]
    strides: tuple[int, int]
    pads: tuple[int, int]  # top, left; the output size already accounts for the bottom/right pads
    dilations: tuple[int, int]
    out_hw: tuple[int, int]

    @classmethod
    def gemm(cls) -> "ConvGeometry":
        return cls((1, 1), (1, 1), (0, 0), (1, 1), (1, 1))


def pack_weight(w: torch.Tensor) -> torch.Tensor:
    """The weight with K = (kh, kw, c) fastest per output channel: a 4-D [Cout, C, kh, kw] weight in
    channels-last memory (its shape kept, so the geometry still reads from it), a GEMM's [Cout, K]
    row-major."""
    return w.contiguous(memory_format=torch.channels_last) if w.dim() == 4 else w.contiguous()


def is_packed(w: torch.Tensor) -> bool:
    return w.permute(0, 2, 3, 1).is_contiguous() if w.dim() == 4 else w.is_contiguous()


def row_alignment(x4: torch.Tensor, geometry: ConvGeometry, shift: int = 0) -> int:
    """The largest power of two, up to 16, dividing (in elements) every pixel's offset that the
    kernel's blocked K walk reads channels from, when channels are contiguous; else 1. `shift`: the
    input's start past the aligned pointer the kernel is given (`aligned_start`), part of every offset.

    Triton proves a stride a multiple of 16 only when it is one; the window convolution's pixels
    are 4 bytes apart (`kernels/window/pixel_pack.py`), so without this hint its 32-byte rows load byte by
    byte. A row starts at n·sxn + ih·sxh + iw·sxw, where ih = oh·stride - pad + kh·dilation (and
    iw alike): a term whose every factor is zero (one output row, one tap, no pad) drops out."""
    sxn, sxc, sxh, sxw = x4.stride()
    if sxc != 1 and x4.shape[1] > 1:
        return 1
    (kh, kw), (sh, sw), (ph, pw), (dh, dw) = geometry.kernel, geometry.strides, geometry.pads, geometry.dilations
    oh, ow = geometry.out_hw
    height_step = math.gcd(sh if oh > 1 else 0, ph, dh if kh > 1 else 0)
    width_step = math.gcd(sw if ow > 1 else 0, pw, dw if kw > 1 else 0)
    common = math.gcd(sxn, sxh * height_step, sxw * width_step, shift, 16)
    return common & -common


def aligned_start(x4: torch.Tensor) -> tuple[torch.Tensor, int]:
    """`x4` as a view that starts at the 16-byte boundary at or before its first element, and how many
    elements before that element the boundary lies. Triton takes a pointer as 16-byte aligned only
    when it is: a Split's second half of 24 or 40 INT8 channels starts 8 bytes past one, and the
    kernel's loads of it went byte by byte, however aligned their offsets were told to be. Given the
    aligned view, it adds the shift to every offset (`row_alignment` counts it); a residual's shift is
    a constant added to its pointer (RES_SHIFT), whose alignment Triton then derives."""
    shift = x4.data_ptr() % 16 // x4.element_size()
    if not shift or x4.data_ptr() % x4.element_size() or x4.storage_offset() < shift:
        return x4, 0
    return x4.as_strided(x4.shape, x4.stride(), x4.storage_offset() - shift), shift


def as_nchw_view(x: torch.Tensor) -> torch.Tensor:
    return x if x.dim() == 4 else x.reshape(x.shape[0], x.shape[1], 1, 1)


# The split-K epilogue's tile: small, so that a layer split for want of programs (M = 49 rows at
# batch 1 in ResNet-50's layer4) gets many here too: 32 for that layer's 49 × 512 outputs.
SPLIT_K_EPILOGUE_TILE = (16, 64)


def residual_arguments(res4: torch.Tensor | None, y: torch.Tensor) -> tuple[torch.Tensor, tuple, int, int]:
    """How the kernels take a residual [N, C, H, W] view (None: none, `y` standing in for the
    pointer): the pointer at the 16-byte boundary before it, its strides, RES_SHIFT (its start past
    that pointer, `aligned_start`) and RES_ALIGN (what divides its image, row and pixel strides:
    a Split half of a 72-channel Concat buffer is read in 8-byte vectors, not bytes)."""
    if res4 is None:
        return y, (0, 0, 0, 0), 0, 1
    base, shift = aligned_start(res4)
    strides = res4.stride()
    return base, strides, shift, told_alignment(strides[0], strides[2], strides[3])


def _accumulators_to_output(workspace: torch.Tensor, shares: int, bias_arg: torch.Tensor, scale_arg: torch.Tensor,
                            res4: torch.Tensor | None, y: torch.Tensor, m: int, cout: int,
                            out_hw: tuple[int, int], scalars: tuple, flags: dict, block_m: int, block_n: int,
                            fusion: bool) -> None:
    """`_splitk_epilogue_kernel`: the `shares` [M, Cout] partial sums in `workspace` added, then the
    epilogue, stored into `y`."""
    res_base, res_strides, res_shift, res_align = residual_arguments(res4, y)
    _splitk_epilogue_kernel[(triton.cdiv(m, block_m), triton.cdiv(cout, block_n))](
        workspace, bias_arg, scale_arg, res_base, y, m, cout, *out_hw, pixel_stride(y), *res_strides, *scalars,
        SPLIT_K=shares, **flags, BLOCK_M=block_m, BLOCK_N=block_n, RES_SHIFT=res_shift, RES_ALIGN=res_align,
        num_warps=4, enable_fp_fusion=fusion)


def weight_tma_applies(w_packed_shape: tuple, element_size: int, block_k: int) -> bool:
    """Whether a weight box of the tile can be one bulk copy: host tensor descriptors (Triton 3.4 and
    newer), the weight's rows (kh·kw·C elements) a 16-byte multiple, and the blocked K walk (C a
    multiple of BLOCK_K, checked by the caller)."""
    k_total = math.prod(w_packed_shape[1:])
    return (TensorDescriptor is not None and (k_total * element_size) % TMA_ALIGNMENT == 0
            and block_k * element_size >= TMA_ALIGNMENT)


def _weight_descriptor(w_packed: torch.Tensor, tile: "TileConfig", gathered: bool):
    """The weight as [Cout, kh·kw·C] for the tile's bulk copies, or None where the tile loads it by
    threads. Refuses a weight-TMA tile whose K walk gathers (the copy needs whole channel blocks)."""
    if not tile.weight_tma:
        return None
    if gathered or not weight_tma_applies(tuple(w_packed.shape), w_packed.element_size(), tile.block_k):
        raise ValueError(f"conv_igemm: tile {tile.name} copies the weight's [{tile.block_n}, {tile.block_k}] boxes "
                         f"by TMA, which needs whole channel blocks and 16-byte weight rows; weight "
                         f"{tuple(w_packed.shape)}")
    return packed_weight_descriptor(w_packed, tile.block_n, tile.block_k)


def packed_weight_descriptor(w_packed: torch.Tensor, block_n: int, block_k: int):
    """A weight packed by `pack_weight` as the [Cout, kh·kw·C] row-major matrix it is in memory (a
    view), for bulk copies of [block_n, block_k] boxes; the TMA-fed kernels' B operand."""
    cout = w_packed.shape[0]
    k_total = math.prod(w_packed.shape[1:])
    flat = w_packed.permute(0, 2, 3, 1).reshape(cout, k_total) if w_packed.dim() == 4 else w_packed
    return TensorDescriptor(flat, [cout, k_total], [k_total, 1], [block_n, block_k])


def conv_igemm(x: torch.Tensor, w_packed: torch.Tensor, bias: torch.Tensor | None, geometry: ConvGeometry,
               tile: TileConfig, *, dequant_scale: torch.Tensor | None = None, residual: torch.Tensor | None = None,
               activation: str | None = None, alpha: float | None = None, beta: float | None = None,
               residual_after_activation: bool = False, input_inv_scale: float | None = None,
               residual_scale: float | None = None, output_inv_scale: float | None = None, qmin: int = -127,
               accumulator_bound: int | None = None,
               fp8: bool = False, float_dtype: torch.dtype = torch.float32, out: torch.Tensor | None = None,
               pdl: bool = False) -> torch.Tensor:
    """Run one convolution (x: [N, C, H, W] any strides, or a GEMM's [N, C]) with its epilogue.
    `pdl`: launch it with programmatic dependent launch (`kernels/common/pdl.py`; CUDA tensors only).

    INT8 when `dequant_scale` is given: x int8 (or float, quantized with `input_inv_scale` on load),
    w_packed int8, bias int32; the output is int8 when `output_inv_scale` is given, else
    `float_dtype` (float32, or the float16 its readers compute in: the store rounds).
    FP8 when `dequant_scale` is given with `fp8`: the same with float8_e4m3fn for int8 and a
    float32 bias. Otherwise x and w_packed share a float dtype and the output has it too. 4-D outputs are
    channels-last, 2-D ones row-major; `out`, when given, receives the result: the output's shape
    and dtype, channels fastest, pixels evenly spaced (a channel slice of a wider buffer)."""
    if not is_packed(w_packed):
        raise ValueError("conv_igemm needs the weight packed by pack_weight")
    quantized = dequant_scale is not None
    int8, fp8 = quantized and not fp8, quantized and fp8
    code_dtype = torch.float8_e4m3fn if fp8 else torch.int8
    quantize_input = quantized and x.dtype != code_dtype
    x4 = as_nchw_view(x)
    n, c, h, w_in = x4.shape
    x_base, x_shift = aligned_start(x4)
    oh, ow = geometry.out_hw
    cout = w_packed.shape[0]
    out_dtype = (code_dtype if output_inv_scale is not None else float_dtype) if quantized else x.dtype
    shape = (n, cout, oh, ow) if x.dim() == 4 else (n, cout)
    y = channels_last_output(shape, out_dtype, x.device, out, "conv_igemm")
    res4 = as_nchw_view(residual) if residual is not None else None
    res_base, rs, res_shift, res_align = residual_arguments(res4, y)
    m = n * oh * ow
    many_taps = geometry.kernel[0] * geometry.kernel[1] > MAX_BLOCKED_TAPS
    row_taps = c if tile.row_taps else 0
    if row_taps and not row_taps_apply(c, geometry.kernel, tile):
        raise ValueError(f"conv_igemm: tile {tile.name} walks K a filter row at a time, which needs a channel "
                         f"count that is a multiple of 8 or a power of two whose row fits its K block; {c} "
                         f"channels, {geometry.kernel[1]} taps a row")
    channel_tail = c if tile.padded_taps and c % tile.block_k and not many_taps else 0
    k_gather = not row_taps and (many_taps or (c % tile.block_k != 0 and not channel_tail))
    split_k = max(1, tile.split_k)
    # The shares' partial sums: int32 for INT8 (their sum is exact), float32 otherwise.
    workspace = (torch.empty((split_k, m, cout), dtype=torch.int32 if int8 else torch.float32, device=x.device)
                 if split_k > 1 else y)
    tiles = triton.cdiv(m, tile.block_m) * triton.cdiv(cout, tile.block_n)
    last_reduces = split_k > 1 and tile.last_reduces
    arrivals = take_counters(tiles, x.device) if last_reduces else workspace
    bias_arg = bias if bias is not None else w_packed
    scale_arg = dequant_scale if quantized else w_packed
    scalars, epilogue = epilogue_arguments(
        quantized=quantized, fp8=fp8, bias=bias, residual=residual, activation=activation, alpha=alpha, beta=beta,
        residual_after_activation=residual_after_activation, residual_scale=residual_scale,
        output_inv_scale=output_inv_scale, qmin=qmin,
        accumulator_bound=accumulator_bound)
    # INT8 and FP8 must round as the emulation does: a fused multiply-add (acc·scale + residual in
    # one rounding) can move a value across a quantization boundary.
    fusion = not quantized
    grid = (tiles, split_k)
    _conv_igemm_kernel[grid](
        x_base, w_packed, _weight_descriptor(w_packed, tile, k_gather or channel_tail), bias_arg, scale_arg,
        res_base, y,
        workspace, arrivals,
        m, cout, c, h, w_in, oh, ow, pixel_stride(y), *x4.stride(), x_shift, *rs,
        geometry.pads[0], geometry.pads[1], geometry.dilations[0], geometry.dilations[1],
        float(input_inv_scale or 1.0), *scalars,
        KH=geometry.kernel[0], KW=geometry.kernel[1], STRIDE_H=geometry.strides[0], STRIDE_W=geometry.strides[1],
        QUANTIZE_INPUT=quantize_input, K_GATHER=k_gather, SPLIT_K=split_k,
        ROW_ALIGN=1 if k_gather else row_alignment(x4, geometry, x_shift), EPILOGUE_HALVES=tile.epilogue_halves,
        RES_EARLY=tile.residual_early and residual is not None and split_k == 1,
        CHANNEL_TAIL=channel_tail, WEIGHT_TMA=tile.weight_tma, **epilogue,
        BLOCK_M=tile.block_m, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k, GROUP_M=GROUP_M, PDL=pdl, ROW_TAPS=row_taps,
        OUT_ALIGN=told_alignment(cout, pixel_stride(y)), ONE_COLUMN=cout <= tile.block_n, LAST_REDUCES=last_reduces,
        RES_SHIFT=res_shift, RES_ALIGN=res_align,
        num_warps=tile.warps,
        num_stages=tile.stages,
        enable_fp_fusion=fusion, **launch_options(pdl))
    if split_k > 1 and not last_reduces:
        _accumulators_to_output(workspace, split_k, bias_arg, scale_arg, res4, y, m, cout, (oh, ow), scalars,
                                epilogue, *SPLIT_K_EPILOGUE_TILE, fusion)
    return y


def accumulator_epilogue(acc: torch.Tensor, out_shape: tuple, bias: torch.Tensor | None, *,
                         dequant_scale: torch.Tensor, residual: torch.Tensor | None = None,
                         activation: str | None = None, alpha: float | None = None, beta: float | None = None,
                         residual_after_activation: bool = False, residual_scale: float | None = None,
                         output_inv_scale: float | None = None, qmin: int = -127,
                         accumulator_bound: int | None = None, fp8: bool = False,
                         float_dtype: torch.dtype = torch.float32, out: torch.Tensor | None = None) -> torch.Tensor:
    """An INT8 (FP8) layer's epilogue over accumulators a library GEMM computed: `acc` [M, Cout]
    row-major, int32 (FP8: float32), for the M = N·OH·OW output pixels of `out_shape` [N, Cout,
    OH, OW] (or [M, Cout]). The arithmetic is conv_igemm's epilogue (the split-K epilogue kernel
    with one share); the output is channels-last (or `out`)."""
    code_dtype = torch.float8_e4m3fn if fp8 else torch.int8
    if acc.dim() != 2 or not acc.is_contiguous() or acc.dtype != (torch.float32 if fp8 else torch.int32):
        raise ValueError(f"accumulator_epilogue: acc {tuple(acc.shape)} {acc.dtype} is not row-major "
                         f"{'float32' if fp8 else 'int32'} [pixels, channels]")
    m, cout = acc.shape
    y = channels_last_output(out_shape, code_dtype if output_inv_scale is not None else float_dtype, acc.device,
                             out, "accumulator_epilogue")
    res4 = as_nchw_view(residual) if residual is not None else None
    scalars, flags = epilogue_arguments(
        quantized=True, fp8=fp8, bias=bias, residual=residual, activation=activation, alpha=alpha, beta=beta,
        residual_after_activation=residual_after_activation, residual_scale=residual_scale,
        output_inv_scale=output_inv_scale, qmin=qmin,
        accumulator_bound=accumulator_bound)
    # One share; INT8 and FP8 round as the emulation does (see conv_igemm), so no FMA contraction.
    out_hw = (out_shape[2], out_shape[3]) if len(out_shape) == 4 else (1, 1)
    _accumulators_to_output(acc, 1, bias if bias is not None else acc, dequant_scale, res4, y, m, cout, out_hw,
                            scalars, flags, 64, 64, fusion=False)
    return y


settle_cache_keys(globals())  # last, once every Triton function above exists (common/cache_keys.py)
