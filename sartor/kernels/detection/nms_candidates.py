"""The in-engine NMS's candidate stage in Triton (`ops.nms.fused_candidates`, issue 30): each image's
K best (anchor, class) pairs over the threshold from a YOLO head [B, 4 + C, A], sorted by their
int64 key (score's float32 bits, then 2³² − 1 − (class · A + anchor)), decoded into corner boxes.

1. `_anchor_bits_kernel`, one read of the scores in [16 classes, 128 anchors] tiles: an anchor's
   best score's float32 bits when it is over the threshold and no class score of it is NaN, else 0.
2. `_anchor_floor_kernel`, one program per image: the K-th largest of those bits (bisection over
   the 31 bits; 0 when A < K), the image's floor.
3. `_collect_pairs_kernel`: the keys of the pairs over the threshold, of NaN-free anchors, with
   score bits at least the floor, appended to the image's buffer of `capacity` slots (an atomic
   count reserves each program's run; the order in the buffer does not matter, keys are distinct).
4. `_sort_candidates_kernel`, one program per image: a bitonic sort of the buffer (`tl.sort`), the
   first K decoded. Where more pairs than `capacity` qualified, the program finds the K-th key
   exactly (bisection over the 63 key bits, counting the qualifying pairs again) and collects
   exactly the K keys at or above it first: slow, but exact and still without a host read.
   Boxes are `corner_boxes`' arithmetic: w · 0.5 is w / 2 exactly, and no FMA (`enable_fp_fusion`).

**Exact.** The answer is the K largest keys among the pairs over the threshold of NaN-free anchors
(`two_level_candidates`'s). A floor above 0 is the bits of the K-th best anchor: K anchors hold a
pair at or above it (their best), so at least K qualifying pairs are collected and every pair left
out scores below all of them; a floor of 0 leaves out no pair over the threshold.
"""
from __future__ import annotations

import torch

from ..common.cache_keys import settle_cache_keys
from ..pointwise.epilogue import triton

INDEX_BITS = 32  # a key: score's float32 bits << INDEX_BITS | INDEX_MASK − index (ops/nms.py ranks by these too)
INDEX_MASK = (1 << INDEX_BITS) - 1  # a key of score 0 and index 0 fills the buffer: never valid
ANCHOR_BLOCK = 128
CLASS_BLOCK = 16  # a [16, 128] tile of scores a step
MIN_CAPACITY = 512
MAX_CAPACITY = 8192  # the buffer sorted in one program's registers

if triton is not None:
    import triton.language as tl

    @triton.jit
    def _anchor_bits_kernel(pred_ptr, bits_ptr, C, A, threshold, BLOCK_C: tl.constexpr, BLOCK_A: tl.constexpr):
        image = tl.program_id(0).to(tl.int64)
        anchor = tl.program_id(1) * BLOCK_A + tl.arange(0, BLOCK_A)
        inside = anchor < A
        head = pred_ptr + image * (C + 4) * A + 4 * A
        best = tl.zeros([BLOCK_A], dtype=tl.float32)
        nans = tl.zeros([BLOCK_A], dtype=tl.int32)
        for c0 in range(0, C, BLOCK_C):  # a tile of classes a step: many loads in flight
            cls = c0 + tl.arange(0, BLOCK_C)
            x = tl.load(head + cls[:, None] * A + anchor[None, :], mask=(cls[:, None] < C) & inside[None, :],
                        other=0.0).to(tl.float32)
            nans += tl.sum((x != x).to(tl.int32), axis=0)
            best = tl.maximum(best, tl.max(tl.where(x > threshold, x, 0.0), axis=0))
        bits = tl.where(nans > 0, 0, best.to(tl.int32, bitcast=True))
        tl.store(bits_ptr + image * A + anchor, bits, mask=inside)

    @triton.jit
    def _anchor_floor_kernel(bits_ptr, floor_ptr, A, K, BLOCK: tl.constexpr):
        image = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK)
        floor = tl.zeros([], dtype=tl.int32)
        for step in range(31):  # the largest value with at least K anchors at or above it
            trial = floor | (tl.full([], 1, tl.int32) << (30 - step))
            above = tl.zeros([], dtype=tl.int32)
            for start in range(0, A, BLOCK):
                bits = tl.load(bits_ptr + image * A + start + offs, mask=start + offs < A, other=0)
                above += tl.sum((bits >= trial).to(tl.int32), axis=0)
            floor = tl.where(above >= K, trial, floor)
        tl.store(floor_ptr + image, floor)

    @triton.jit
    def _pair_keys(pred_ptr, bits_ptr, floor, image, cls, anchor, C, A, threshold,
                   BLOCK_C: tl.constexpr, BLOCK_A: tl.constexpr):
        """(qualifies, key) [classes, anchors], flattened, of one image's pairs (`cls`, `anchor`)."""
        anchor_bits = tl.load(bits_ptr + image * A + anchor, mask=anchor < A, other=0)
        holds = (anchor_bits >= tl.maximum(floor, 1))[None, :] & (cls < C)[:, None]  # only those reach the floor
        x = tl.load(pred_ptr + image * (C + 4) * A + (4 + cls[:, None]) * A + anchor[None, :], mask=holds,
                    other=0.0).to(tl.float32)
        score_bits = x.to(tl.int32, bitcast=True)
        qualifies = holds & (x > threshold) & (score_bits >= floor)
        key = (score_bits.to(tl.int64) << 32) | (4294967295 - (cls[:, None] * A + anchor[None, :]).to(tl.int64))
        return tl.reshape(qualifies, [BLOCK_C * BLOCK_A]), tl.reshape(key, [BLOCK_C * BLOCK_A])

    @triton.jit
    def _collect_pairs_kernel(pred_ptr, bits_ptr, floor_ptr, keys_ptr, found_ptr, C, A, threshold,
                              CAPACITY: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_A: tl.constexpr):
        image = tl.program_id(0).to(tl.int64)
        anchor = tl.program_id(1) * BLOCK_A + tl.arange(0, BLOCK_A)
        floor = tl.load(floor_ptr + image)
        anchor_bits = tl.load(bits_ptr + image * A + anchor, mask=anchor < A, other=0)
        if tl.sum((anchor_bits >= tl.maximum(floor, 1)).to(tl.int32), axis=0) > 0:
            for c0 in range(0, C, BLOCK_C):
                qualifies, key = _pair_keys(pred_ptr, bits_ptr, floor, image, c0 + tl.arange(0, BLOCK_C), anchor,
                                            C, A, threshold, BLOCK_C, BLOCK_A)
                taken = qualifies.to(tl.int32)
                n = tl.sum(taken, axis=0)
                if n > 0:
                    slot = tl.atomic_add(found_ptr + image, n) + tl.cumsum(taken, axis=0) - 1
                    tl.store(keys_ptr + image * CAPACITY + slot, key, mask=qualifies & (slot < CAPACITY))

    @triton.jit
    def _sort_candidates_kernel(pred_ptr, bits_ptr, floor_ptr, keys_ptr, found_ptr,
                                boxes_ptr, scores_ptr, classes_ptr, count_ptr, C, A, K, threshold,
                                CAPACITY: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_A: tl.constexpr):
        image = tl.program_id(0).to(tl.int64)
        buffer = keys_ptr + image * CAPACITY
        found = tl.load(found_ptr + image)
        if found > CAPACITY:  # the buffer missed some: the K-th key exactly, then exactly K keys
            floor = tl.load(floor_ptr + image)
            lanes = tl.arange(0, BLOCK_A)
            classes = tl.arange(0, BLOCK_C)
            kth = tl.zeros([], dtype=tl.int64)
            for step in range(63):
                trial = kth | (tl.full([], 1, tl.int64) << (62 - step))
                above = tl.zeros([], dtype=tl.int32)
                for c0 in range(0, C, BLOCK_C):
                    for start in range(0, A, BLOCK_A):
                        qualifies, key = _pair_keys(pred_ptr, bits_ptr, floor, image, c0 + classes, start + lanes,
                                                    C, A, threshold, BLOCK_C, BLOCK_A)
                        above += tl.sum((qualifies & (key >= trial)).to(tl.int32), axis=0)
                kth = tl.where(above >= K, trial, kth)
            stored = tl.zeros([], dtype=tl.int32)
            for c0 in range(0, C, BLOCK_C):
                for start in range(0, A, BLOCK_A):
                    qualifies, key = _pair_keys(pred_ptr, bits_ptr, floor, image, c0 + classes, start + lanes,
                                                C, A, threshold, BLOCK_C, BLOCK_A)
                    taken = (qualifies & (key >= kth)).to(tl.int32)
                    tl.store(buffer + stored + tl.cumsum(taken, axis=0) - 1, key, mask=taken > 0)
                    stored += tl.sum(taken, axis=0)
            tl.debug_barrier()  # this program's stores, read back below
            found = stored
        offs = tl.arange(0, CAPACITY)
        keys = tl.load(buffer + offs, mask=offs < found, other=4294967295)
        keys = tl.sort(keys, descending=True)
        first = offs < K
        score_bits = (keys >> 32).to(tl.int32)
        index = 4294967295 - (keys & 4294967295)
        cls = index // A
        anchor = index - cls * A
        head = pred_ptr + image * (C + 4) * A + anchor
        cx = tl.load(head, mask=first, other=0.0).to(tl.float32)
        cy = tl.load(head + A, mask=first, other=0.0).to(tl.float32)
        half_w = tl.load(head + 2 * A, mask=first, other=0.0).to(tl.float32) * 0.5  # w / 2, exactly
        half_h = tl.load(head + 3 * A, mask=first, other=0.0).to(tl.float32) * 0.5
        slot = image * K + offs
        tl.store(boxes_ptr + slot * 4, cx - half_w, mask=first)
        tl.store(boxes_ptr + slot * 4 + 1, cy - half_h, mask=first)
        tl.store(boxes_ptr + slot * 4 + 2, cx + half_w, mask=first)
        tl.store(boxes_ptr + slot * 4 + 3, cy + half_h, mask=first)
        tl.store(scores_ptr + slot, tl.where(score_bits > 0, score_bits.to(tl.float32, bitcast=True), -1.0), mask=first)
        tl.store(classes_ptr + slot, cls.to(tl.int32), mask=first)
        tl.store(count_ptr + image, tl.minimum(found, K))


def buffer_capacity(k: int) -> int:
    """Slots for an image's qualifying pairs: four times K's power of two, within the sort's range."""
    return max(MIN_CAPACITY, min(4 * triton.next_power_of_2(k), MAX_CAPACITY))


def select_candidates_supported(pred: torch.Tensor, k: int) -> bool:
    return (triton is not None and pred.dim() == 3 and pred.shape[1] > 4
            and pred.dtype in (torch.float32, torch.float16, torch.bfloat16)
            and (pred.shape[1] - 4) * pred.shape[2] <= INDEX_MASK and pred.numel() < 2 ** 31
            and 1 <= k <= MAX_CAPACITY // 2)


def select_candidates(pred: torch.Tensor, threshold: float, k: int, capacity: int | None = None) -> tuple:
    """(boxes [B, K, 4] float32 x1y1x2y2, scores [B, K] float32, classes [B, K] int32, count [B] int32)
    of each image's K = `k` best pairs of `pred` [B, 4 + C, A] scoring over `threshold` (a value of
    pred's dtype), sorted by score, ties by class then anchor; the `count` valid ones come first,
    the others score −1 (class 0, anchor 0's box). Fixed shapes, no host read: graph-capturable."""
    batch, channels, anchors = pred.shape
    capacity = capacity or buffer_capacity(k)
    pred = pred.contiguous()
    anchor_bits, floor, keys, found = collect_pairs(pred, threshold, k, capacity)
    device = pred.device
    boxes = torch.empty((batch, k, 4), dtype=torch.float32, device=device)
    scores = torch.empty((batch, k), dtype=torch.float32, device=device)
    labels = torch.empty((batch, k), dtype=torch.int32, device=device)
    count = torch.empty((batch,), dtype=torch.int32, device=device)
    _sort_candidates_kernel[(batch,)](pred, anchor_bits, floor, keys, found, boxes, scores, labels, count,
                                      channels - 4, anchors, k, threshold, CAPACITY=capacity,
                                      BLOCK_C=CLASS_BLOCK, BLOCK_A=ANCHOR_BLOCK,
                                      num_warps=16 if capacity >= 8192 else 8, enable_fp_fusion=False)
    return boxes, scores, labels, count


def collect_pairs(pred: torch.Tensor, threshold: float, k: int, capacity: int) -> tuple:
    """The first three kernels: (anchor bits [B, A] int32, floor [B] int32, the buffer [B, capacity]
    int64 of keys, found [B] int32: the pairs that qualified, more than `capacity` where the sort
    takes the exact path)."""
    batch, channels, anchors = pred.shape
    assert k <= capacity and capacity & (capacity - 1) == 0, (k, capacity)
    device = pred.device
    anchor_bits = torch.empty((batch, anchors), dtype=torch.int32, device=device)
    floor = torch.zeros((batch,), dtype=torch.int32, device=device)
    keys = torch.empty((batch, capacity), dtype=torch.int64, device=device)
    found = torch.zeros((batch,), dtype=torch.int32, device=device)
    blocks = (batch, triton.cdiv(anchors, ANCHOR_BLOCK))
    _anchor_bits_kernel[blocks](pred, anchor_bits, channels - 4, anchors, threshold,
                                BLOCK_C=CLASS_BLOCK, BLOCK_A=ANCHOR_BLOCK)
    if anchors >= k:  # else every anchor is among the K best: floor 0
        block = min(triton.next_power_of_2(anchors), 16384)
        _anchor_floor_kernel[(batch,)](anchor_bits, floor, anchors, k, BLOCK=block,
                                       num_warps=16 if block >= 8192 else 4)
    _collect_pairs_kernel[blocks](pred, anchor_bits, floor, keys, found, channels - 4, anchors, threshold,
                                  CAPACITY=capacity, BLOCK_C=CLASS_BLOCK, BLOCK_A=ANCHOR_BLOCK)
    return anchor_bits, floor, keys, found


settle_cache_keys(globals())  # last, once every Triton function above exists (common/cache_keys.py)
