"""2-D max pooling over channels-last tensors in Triton: padding by masks, one read of each window.

PyTorch pads explicitly (a padded copy of the whole tensor) and then runs its NHWC kernel, several
times what moving the tensor's bytes costs (docs/decisions/kernel-max-pool-tiles.md). Here each
program owns a block of output pixels × a block of channels; channel vectors are contiguous in NHWC,
so every tap is a coalesced load.

INT8 and FP8 (E4M3) tensors pool too (a pooling layer between two INT8 layers, see
`sartor/quant/quantize.py`): the codes are compared as float32 values, which holds every int8 and
e4m3 value exactly, and padded taps are left out by a select rather than by a fill value, so no
dtype needs an encoding of -inf (e4m3fn has none) and padding never wins the max, as ONNX says.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ClassVar

import torch

from ..common.cache_keys import settle_cache_keys
from ..common.pdl import launch_options
from ..pointwise.epilogue import (WORD_CODES, channels_last_output, code_words, pixel_stride, told_alignment,
                                  triton)
from ..registry import Flag, LayerFacts, Number, Tactic, register

if triton is not None:
    import triton.language as tl

    from ..common.pdl import await_previous_kernel
    from ..common.tile_steps import pixel_channel_tile, tap_pixels, window_origin
    from ..pointwise.epilogue import told_pixel_strides

    @triton.jit
    def _max_pool_nhwc_kernel(x_ptr, y_ptr, P, C, H, W, OH, OW, y_row, sxn, sxh, sxw, pad_h, pad_w,
                              KH: tl.constexpr, KW: tl.constexpr, SH: tl.constexpr, SW: tl.constexpr,
                              DH: tl.constexpr, DW: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr,
                              CODE_WORDS: tl.constexpr = False, PACKED_MAX: tl.constexpr = False,
                              CH_ALIGN: tl.constexpr = 1, PDL: tl.constexpr = False):
        """With CODE_WORDS, x and y are INT8 codes seen as int32 words of four channels each, and
        C, BLOCK_C and the strides count words (`_word_max`); PACKED_MAX: the device has the
        packed 16-bit maximum (sm_90 on) and the tile takes it (not loads_first). CH_ALIGN: a power
        of two dividing C and the strides (`told_alignment`), so that a channel mask of 24 words
        still loads vectors. PDL: launched with programmatic dependent launch (`kernels/common/pdl.py`)."""
        C, y_row, sxn, sxh, sxw = told_pixel_strides(C, y_row, sxn, sxh, sxw, CH_ALIGN)
        offs_p, offs_c, p_ok, c_ok, n, oh, ow = pixel_channel_tile(P, C, OH, OW, BLOCK_P, BLOCK_C)
        base, ih0, iw0 = window_origin(n, oh, ow, sxn, SH, SW, pad_h, pad_w)
        await_previous_kernel(PDL)  # every load below reads an activation
        # INT8 codes are compared as integers: converting each tap to float32 and back is bound by
        # Hopper's conversion rate (16 values per clock per SM; docs/decisions/kernel-max-pool-tiles.md).
        INTEGER: tl.constexpr = x_ptr.dtype.element_ty == tl.int8
        # Floats with an infinity compare in their own dtype, masked taps loaded as -inf: FP16 went
        # through float32 with a select per tap, three instructions per value and tap where the
        # packed half maximum takes half of one (docs/decisions/kernel-max-pool-tiles.md). E4M3 has
        # no infinity and keeps the select.
        ELEMENT: tl.constexpr = x_ptr.dtype.element_ty
        NATIVE: tl.constexpr = ELEMENT.is_fp16() or ELEMENT.is_bf16() or ELEMENT.is_fp32()
        if CODE_WORDS:
            even = tl.zeros((BLOCK_P, BLOCK_C), dtype=tl.int32)
            odd = tl.zeros((BLOCK_P, BLOCK_C), dtype=tl.int32)
        elif INTEGER:
            acc = tl.full((BLOCK_P, BLOCK_C), -128, dtype=tl.int8)
            # -128 for masked taps, computed rather than constant: Triton spreads a constant `other` over a
            # vector load's lanes sign-extended (0xFF80 for two codes), so the second lane read -1.
            lowest_code = ((P < 0).to(tl.int32) - 128).to(tl.int8)
        elif NATIVE:
            acc = tl.full((BLOCK_P, BLOCK_C), float("-inf"), dtype=x_ptr.dtype.element_ty)
        else:
            acc = tl.full((BLOCK_P, BLOCK_C), float("-inf"), dtype=tl.float32)
        for kh in tl.static_range(KH):
            for kw in tl.static_range(KW):
                pixels, ok = tap_pixels(base, ih0 + kh * DH, iw0 + kw * DW, p_ok, H, W, sxh, sxw)
                tap_ok = ok[:, None] & c_ok[None, :]
                taps = x_ptr + pixels[:, None] + offs_c[None, :]
                if CODE_WORDS:
                    even, odd = _word_max(even, odd, tl.load(taps, mask=tap_ok, other=WORD_BIAS), PACKED_MAX)
                elif INTEGER:
                    acc = tl.maximum(acc, tl.load(taps, mask=tap_ok, other=lowest_code))
                elif NATIVE:
                    acc = tl.maximum(acc, tl.load(taps, mask=tap_ok, other=float("-inf")),
                                     propagate_nan=tl.PropagateNan.ALL)
                else:
                    v = tl.where(tap_ok, tl.load(taps, mask=tap_ok).to(tl.float32), float("-inf"))
                    acc = tl.maximum(acc, v, propagate_nan=tl.PropagateNan.ALL)
        y_offsets = offs_p.to(tl.int64)[:, None] * y_row + offs_c[None, :]
        y_ok = p_ok[:, None] & c_ok[None, :]
        if CODE_WORDS:
            y = ((odd << 8) | even) ^ WORD_BIAS
        elif NATIVE:
            y = acc
        else:
            # Lanes outside the tensor hold -inf on the float path, which has no 8-bit value (INT8,
            # FP8): zero them before the cast.
            y = tl.where(y_ok, acc, 0).to(y_ptr.dtype.element_ty)
        tl.store(y_ptr + y_offsets, y, mask=y_ok)

    # Four codes of -128 (0x80808080): flipping each byte's sign bit maps the codes -128..127 to
    # 0..255 in order, and this word to 0, so masked taps never win.
    WORD_BIAS = tl.constexpr(-2139062144)
    LANE_BYTES = tl.constexpr(0x00FF00FF)

    @triton.jit
    def _lane_max(a, b, PACKED_MAX: tl.constexpr):
        """The maximum of each 16-bit half of two int32 words whose halves hold 0..255."""
        if PACKED_MAX:
            return tl.inline_asm_elementwise("max.u16x2 $0, $1, $2;", "=r,r,r", [a, b], dtype=tl.int32,
                                             is_pure=True, pack=1)
        return tl.maximum(a >> 16, b >> 16) << 16 | tl.maximum(a & 0xFFFF, b & 0xFFFF)

    @triton.jit
    def _word_max(even, odd, words, PACKED_MAX: tl.constexpr):
        """The running maxima of words of four INT8 codes: bytes 0 and 2 in `even`'s 16-bit halves,
        bytes 1 and 3 in `odd`'s, each as 0..255. The int8 maximum widened every byte with a byte
        permute or two (docs/decisions/kernel-max-pool-tiles.md); here a word of four codes takes a
        shift, two logic operations and two packed maxima."""
        biased = words ^ WORD_BIAS
        return (_lane_max(even, biased & LANE_BYTES, PACKED_MAX),
                _lane_max(odd, (biased >> 8) & LANE_BYTES, PACKED_MAX))


POOLED_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.int8, torch.float8_e4m3fn)


@register
@dataclass(frozen=True)
class PoolTile(Tactic):
    """MaxPool's Triton tactic: elements (pixels × channels) per program, the widest channel block,
    warps. Named e.g. "max_pool.elements4096.channels64.w4"; the first of POOL_TILES is what runs
    a pool that was not timed (a QConv's carried pool). `loads_first` ("loads-first"): INT8 words
    take the maximum of their 16-bit lanes as plain integer operations rather than PTX's packed
    instruction, which the compiler does not move loads across: on sm_90 the packed form issues
    each tap's load just before its maximum, one or two loads in flight, and a small pool's few
    programs wait out each load's latency in turn (docs/decisions/kernel-max-pool-tiles.md)."""
    elements: int
    max_block_c: int
    warps: int
    loads_first: bool = False

    FAMILY: ClassVar[str] = "max_pool"
    PROGRAMMATIC_LAUNCH: ClassVar[bool] = True
    SCHEME: ClassVar[tuple] = (Number("elements", "elements"), Number("max_block_c", "channels"), Number("warps", "w"),
                               Flag("loads_first", "loads-first"))

    def invalid(self) -> str | None:
        powers = all(v > 0 and v & (v - 1) == 0 for v in (self.elements, self.max_block_c, self.warps))
        return None if powers and self.elements >= self.max_block_c else "sizes are powers of 2, elements ≥ channels"

    def describe(self, layer: LayerFacts) -> str:
        loads = ", INT8 lanes compared in plain steps, every tap's load issued first" if self.loads_first else ""
        return (f"triton channels-last max pool (padding by masks), {self.elements} elements of up to "
                f"{self.max_block_c} channels per program, {self.warps} warps{loads}")

    def blocks(self, channels: int) -> tuple[int, int]:
        """(pixels, channels) per program for a tensor of `channels`."""
        block_c = min(self.max_block_c, triton.next_power_of_2(channels))
        return max(16, self.elements // block_c), block_c


# The first is the original tile; the rest, timed from the effort given in POOL_TILES_PER_EFFORT,
# give 8-bit tensors more bytes per thread and wider channel blocks. On sm_90 (Triton 3.6, ResNet-50's
# stem pool, 64 channels), with INT8 codes in words and FP16 compared as halves: INT8 takes 32–108
# registers and FP16 72–116, no spills; FP32 spills in the two 64-elements-per-thread tiles, which
# the builder's timing then passes over (docs/decisions/kernel-max-pool-tiles.md).
POOL_TILES = (PoolTile(4096, 64, 4), PoolTile(8192, 64, 4), PoolTile(16384, 128, 8), PoolTile(8192, 128, 8),
              PoolTile(2048, 64, 4), PoolTile(1024, 64, 4))
POOL_TILES_PER_EFFORT = {0: 1, 1: 3, 2: 3}
# A pool whose output fills fewer than SMALL_POOL_WAVES waves of the first tile's programs leaves SMs
# idle (ResNet-50's stem pool at batch 1: 49 programs for 132 SMs): from effort 1 on, the smallest
# tile is timed for it as well.
SMALL_POOL_TILE = POOL_TILES[-1]
SMALL_POOL_WAVES = 2
# For such a pool over INT8 words, the smallest tile with every tap's load issued first as well: there
# the programs are too few to hide a load's latency behind another's (YOLO's SPPF at batch 1: 50).
SMALL_POOL_LOADS_FIRST = replace(SMALL_POOL_TILE, loads_first=True)


def pool_tactics(effort: int, output_elements: int = 0, sms: int = 0, int8_words: bool = False) -> list[str]:
    """The tiles the builder times at this effort; for an output of `output_elements` on a device of
    `sms` multiprocessors that the first tile would not fill, the smallest tile too, and where the
    input is INT8 codes in whole words (`int8_words`), that tile with its loads first."""
    tiles = list(POOL_TILES[:POOL_TILES_PER_EFFORT.get(effort, len(POOL_TILES))])
    small = output_elements and output_elements < SMALL_POOL_WAVES * sms * POOL_TILES[0].elements
    if effort >= 1 and small and SMALL_POOL_TILE not in tiles:
        tiles.append(SMALL_POOL_TILE)
    if effort >= 1 and small and int8_words:
        tiles.append(SMALL_POOL_LOADS_FIRST)
    return [tile.name for tile in tiles]


def max_pool_nhwc_supported(x: torch.Tensor) -> bool:
    """Channels-last tensors and channel slices of them (pixels evenly spaced, channels contiguous)
    of a float, INT8 or FP8 dtype."""
    return triton is not None and x.dim() == 4 and x.dtype in POOLED_DTYPES and pixel_stride(x) is not None


def max_pool_nhwc(x: torch.Tensor, kernel: tuple[int, int], strides: tuple[int, int], pads: tuple[int, int],
                  dilations: tuple[int, int], out_hw: tuple[int, int], out: torch.Tensor | None = None,
                  tile: PoolTile | None = None, pdl: bool = False) -> torch.Tensor:
    """Max pool of a channels-last [N, C, H, W] tensor; `pads` are the top/left pads, `out_hw` the
    output size (which already accounts for bottom/right pads and ceil mode). `out`, when given,
    receives the result (a channel slice of a Concat's buffer). `tile`: POOL_TILES[0] by default. `pdl`:
    launched with programmatic dependent launch (CUDA tensors only)."""
    n, c, h, w = x.shape
    oh, ow = out_hw
    y = channels_last_output((n, c, oh, ow), x.dtype, x.device, out, "max_pool_nhwc")
    pixels = n * oh * ow
    tile = tile or POOL_TILES[0]
    block_p, block_c = tile.blocks(c)
    x_words, y_words = code_words(x), code_words(y)
    words = x_words is not None and y_words is not None
    if words:  # strides and channels in words of four codes (the kernel's CODE_WORDS)
        x_arg, y_arg, c, block_c = x_words, y_words, c // WORD_CODES, max(1, block_c // WORD_CODES)
        sxn, sxh, sxw, y_row = *x_words.stride()[:3], y_words.stride(2)
    else:
        x_arg, y_arg, y_row = x, y, pixel_stride(y)
        sxn, _, sxh, sxw = x.stride()
    grid = (triton.cdiv(pixels, block_p), triton.cdiv(c, block_c))
    _max_pool_nhwc_kernel[grid](x_arg, y_arg, pixels, c, h, w, oh, ow, y_row, sxn, sxh, sxw, pads[0], pads[1],
                                KH=kernel[0], KW=kernel[1], SH=strides[0], SW=strides[1], DH=dilations[0],
                                DW=dilations[1], BLOCK_P=block_p, BLOCK_C=block_c, CODE_WORDS=words,
                                PACKED_MAX=words and _has_packed_max(x.device) and not tile.loads_first,
                                CH_ALIGN=told_alignment(c, y_row, sxn, sxh, sxw), PDL=pdl, num_warps=tile.warps,
                                **launch_options(pdl))
    return y


def _has_packed_max(device: torch.device) -> bool:
    """Whether compiled kernels on `device` have PTX's packed 16-bit maximum (sm_90 on); the
    interpreter (CPU tensors) computes the lanes apart."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (9, 0)


settle_cache_keys(globals())  # last, once every Triton function above exists (common/cache_keys.py)
