"""A few-channel image as padded 4-byte pixels of INT8 (FP8) codes, in one pass: what the window
convolution of a network's stem reads (`sartor/ops/quantized_window.py`, tactics "window_igemm.…", "window_resident.…").

ResNet-50's INT8 stem (7×7, stride 2, 3 FP32 channels in NCHW) spent most of its time in the
im2col kernel (docs/decisions/kernel-stem-im2col-and-pixel-windows.md): each column gathers single
bytes from three planes. Packed as [N, HP, WP, 4] (channel 3 and the padding are code 0), a
row of kw taps of one filter row is a run of contiguous bytes, so the convolution needs no columns:
it reads overlapping 32-byte windows of this tensor in place.

The kernel reads the input once (any strides: NCHW or NHWC; float, quantized as loaded, or codes
the producer already stored) and writes every packed pixel once, padding included.
"""
from __future__ import annotations

import torch

from ..common.cache_keys import settle_cache_keys
from ..pointwise.epilogue import triton
from ..conv.im2col import CODE_DTYPES, code_source

PIXEL_BYTES = 4  # up to 4 channels of one pixel in one 32-bit word

if triton is not None:
    import triton.language as tl

    from ..common.tile_steps import stored_codes

    @triton.jit
    def _pack_pixels_kernel(x_ptr, p_ptr, C, H, W, HP, WP, sxn, sxc, sxh, sxw, pad_h, pad_w, in_inv_scale, qmin,
                            QUANTIZE: tl.constexpr, FP8: tl.constexpr, BLOCK_W: tl.constexpr):
        row = tl.program_id(0)  # n · HP + padded row
        n = row // HP
        padded_row = row - n * HP
        ih = padded_row - pad_h
        pw = tl.program_id(1) * BLOCK_W + tl.arange(0, BLOCK_W)
        iw = pw - pad_w
        c = tl.arange(0, 4)
        inside = (((iw >= 0) & (iw < W))[:, None] & (c < C)[None, :]) & ((ih >= 0) & (ih < H))
        offsets = n.to(tl.int64) * sxn + ih * sxh + iw[:, None] * sxw + c[None, :] * sxc
        v = stored_codes(tl.load(x_ptr + offsets, mask=inside, other=0), in_inv_scale, qmin, QUANTIZE, FP8)
        stored = (pw < WP)[:, None] & (c < 4)[None, :]
        tl.store(p_ptr + row.to(tl.int64) * (WP * 4) + pw[:, None] * 4 + c[None, :], v, mask=stored)

    @triton.jit
    def _pack_blocks_kernel(x_ptr, p_ptr, C, H, W, HB, WB, sxn, sxc, sxh, sxw, pad_h, pad_w, in_inv_scale, qmin,
                            QUANTIZE: tl.constexpr, FP8: tl.constexpr, BLOCK_W: tl.constexpr):
        """The space-to-depth form: each program writes BLOCK_W whole 16-byte block pixels of one
        block row (byte (dy·2 + dx)·4 + c holds channel c of pixel (2·row + dy, 2·column + dx)), so
        every block is one 16-byte store rather than two 8-byte halves from two programs."""
        block_row = tl.program_id(0)  # n · HB + block row
        n = block_row // HB
        hb = block_row - n * HB
        wb = tl.program_id(1) * BLOCK_W + tl.arange(0, BLOCK_W)
        byte = tl.arange(0, 16)
        dy, dx, c = byte // 8, (byte // 4) % 2, byte % 4
        ih = (2 * hb + dy - pad_h)[None, :]
        iw = 2 * wb[:, None] + dx[None, :] - pad_w
        inside = (ih >= 0) & (ih < H) & (iw >= 0) & (iw < W) & (c < C)[None, :]
        v = stored_codes(tl.load(x_ptr + (n.to(tl.int64) * sxn + ih * sxh + iw * sxw + c[None, :] * sxc), mask=inside,
                                 other=0), in_inv_scale, qmin, QUANTIZE, FP8)
        # Whole blocks of 16 bytes from a 16-byte aligned row start (HB·WB blocks an image).
        first = tl.multiple_of(block_row.to(tl.int64) * (WB * 16), 16)
        tl.store(p_ptr + first + wb[:, None] * 16 + byte[None, :], v, mask=(wb < WB)[:, None])


# Padded pixels of one row per program: the fastest width of both forms on ResNet-50's stem, whose
# rows of 229–232 padded pixels took two programs at 128, the second mostly masked
# (docs/decisions/kernel-stem-im2col-and-pixel-windows.md).
BLOCK_W = 256
PACK_WARPS = 4


def pack_pixels(x: torch.Tensor, pads: tuple[int, int], padded_hw: tuple[int, int], code: torch.dtype,
                inv_scale: float = 1.0, qmin: float = -127.0, space_to_depth: bool = False,
                block_w: int = BLOCK_W, warps: int = PACK_WARPS) -> torch.Tensor:
    """[N, HP, WP, 4] codes of `x` [N, C ≤ 4, H, W] (any strides): pixel (h, w) of `x` at
    (h + pads[0], w + pads[1]); code 0 (zero in INT8 and in e4m3 alike) in channels past C and
    wherever the padded image lies outside `x`. A float `x` is quantized as loaded (`inv_scale`,
    `qmin`: the layer's input quantization); an `x` already in `code` is copied. With
    `space_to_depth` (HP, WP even) each 2 × 2 block of those pixels is one 16-byte pixel instead,
    [N, HP/2, WP/2, 16] (byte (dy·2 + dx)·4 + c), returned as its [N, HP/2, WP·2, 4] view.
    `block_w` (a power of two) and `warps`: the launch's shape (bench/pack_probe.py times them)."""
    if triton is None:
        raise RuntimeError("pack_pixels needs Triton")
    x, quantize = code_source(x, code, "pack_pixels")
    n, c, h, w = x.shape
    if c > PIXEL_BYTES:
        raise ValueError(f"pack_pixels packs up to {PIXEL_BYTES} channels, not {c}")
    hp, wp = padded_hw
    if min(pads) < 0:
        raise ValueError(f"pack_pixels pads the image, it does not crop it: pads {pads}")
    if space_to_depth and (hp % 2 or wp % 2):
        raise ValueError(f"pack_pixels: 2 × 2 blocks need an even padded size, not {hp} × {wp}")
    shape = (n, hp // 2, wp * 2, PIXEL_BYTES) if space_to_depth else (n, hp, wp, PIXEL_BYTES)
    packed = torch.empty(shape, dtype=code if quantize else torch.uint8, device=x.device)
    # Quantize as the emulation does, one rounding per operation (no fused multiply-add).
    if space_to_depth:
        blocks_w = max(block_w // 2, 1)  # as many bytes a program as the 4-byte form's
        _pack_blocks_kernel[(n * (hp // 2), triton.cdiv(wp // 2, blocks_w))](
            x, packed, c, h, w, hp // 2, wp // 2, *x.stride(), pads[0], pads[1], float(inv_scale), float(qmin),
            QUANTIZE=quantize, FP8=CODE_DTYPES[code], BLOCK_W=blocks_w, num_warps=warps, enable_fp_fusion=False)
    else:
        _pack_pixels_kernel[(n * hp, triton.cdiv(wp, block_w))](
            x, packed, c, h, w, hp, wp, *x.stride(), pads[0], pads[1], float(inv_scale), float(qmin),
            QUANTIZE=quantize, FP8=CODE_DTYPES[code], BLOCK_W=block_w, num_warps=warps, enable_fp_fusion=False)
    return packed if quantize else packed.view(code)


settle_cache_keys(globals())  # last, once every Triton function above exists (common/cache_keys.py)
