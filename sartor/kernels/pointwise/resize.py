"""Nearest upsampling by integer factors over channels-last tensors in Triton, into a new tensor or
straight into a channel slice of a Concat's buffer.

Detector necks upsample ×2 and concatenate the result with a backbone feature. PyTorch's
interpolate writes a tensor of its own that the Concat then copies: the upsampled bytes cross
memory twice more. Here each program owns a block of input pixels × a block of channels, loads it
once (channel vectors are contiguous in NHWC, so the load is coalesced) and stores it to each of
its FH × FW output pixels, through a pixel (row) stride so the output may be a Concat's slice.

INT8 and FP8 codes (a resize between two INT8 layers, see `sartor/quant/quantize.py`) are copied
too. The kernel only moves values, so 1-byte float dtypes travel as their uint8 bytes: exact, and
independent of which float8 types a Triton release can load and store.
"""
from __future__ import annotations

import torch

from ..common.cache_keys import settle_cache_keys
from ..common.pdl import launch_options
from .epilogue import channels_last_output, pixel_stride, told_alignment, triton

if triton is not None:
    import triton.language as tl

    from ..common.pdl import await_previous_kernel
    from ..common.tile_steps import pixel_channel_tile
    from .epilogue import told_pixel_strides

    @triton.jit
    def _upsample_nearest_nhwc_kernel(x_ptr, y_ptr, P, C, H, W, y_row, sxn, sxh, sxw,
                                      FH: tl.constexpr, FW: tl.constexpr,
                                      BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr, CH_ALIGN: tl.constexpr = 1,
                                      PDL: tl.constexpr = False):
        # CH_ALIGN: a power of two dividing C and the strides (`told_alignment`): vectors at 24 or 40 channels.
        # PDL: launched with programmatic dependent launch (`kernels/common/pdl.py`).
        C, y_row, sxn, sxh, sxw = told_pixel_strides(C, y_row, sxn, sxh, sxw, CH_ALIGN)
        # a program's input pixels (each stored FH × FW times) and channels
        offs_p, offs_c, p_ok, c_ok, n, ih, iw = pixel_channel_tile(P, C, H, W, BLOCK_P, BLOCK_C)
        mask = p_ok[:, None] & c_ok[None, :]
        n = n.to(tl.int64)
        await_previous_kernel(PDL)  # the load and the stores below touch activations
        v = tl.load(x_ptr + (n * sxn + ih * sxh + iw * sxw)[:, None] + offs_c[None, :], mask=mask)
        ow_base = iw * FW
        for dh in tl.static_range(FH):
            row = (n * H + ih) * FH + dh
            for dw in tl.static_range(FW):
                pixel = row * (W * FW) + ow_base + dw
                tl.store(y_ptr + (pixel * y_row)[:, None] + offs_c[None, :], v, mask=mask)


def upsample_nearest_nhwc_supported(x: torch.Tensor) -> bool:
    """4-D channels-last tensors and channel slices of them (pixels evenly spaced, channels
    contiguous) of a float dtype (FP8 included) or INT8."""
    return (triton is not None and x.dim() == 4 and (x.is_floating_point() or x.dtype == torch.int8)
            and pixel_stride(x) is not None)


def _as_moved(t: torch.Tensor) -> torch.Tensor:
    """`t` as the kernel loads and stores it: 1-byte floats (FP8) as their bytes, same strides."""
    return t.view(torch.uint8) if t.is_floating_point() and t.element_size() == 1 else t


def upsample_nearest_nhwc(x: torch.Tensor, factors: tuple[int, int], out: torch.Tensor | None = None,
                          pdl: bool = False) -> torch.Tensor:
    """y[n, c, i, j] = x[n, c, i // fh, j // fw] for a channels-last [N, C, H, W] tensor and integer
    factors (fh, fw) >= 1. `out`, when given, receives the result (a channel slice of a Concat's
    buffer); otherwise a new channels-last tensor does. `pdl`: launched with programmatic dependent launch
    (CUDA tensors only)."""
    fh, fw = (int(f) for f in factors)
    if fh < 1 or fw < 1 or (fh, fw) != tuple(factors):
        raise ValueError(f"upsample_nearest_nhwc: factors {factors} are not integers >= 1")
    n, c, h, w = x.shape
    shape = (n, c, h * fh, w * fw)
    y = channels_last_output(shape, x.dtype, x.device, out, "upsample_nearest_nhwc")
    pixels = n * h * w
    if pixels == 0 or c == 0:
        return y
    sxn, _, sxh, sxw = x.stride()
    block_c = min(64, triton.next_power_of_2(c))
    # Each loaded block is stored fh * fw times: fewer pixels per program for larger factors keeps
    # the grid wide enough to fill the GPU at the small feature maps of a detector's neck. (A power
    # of two: tl.arange takes no other size, so a product of 3 is taken as 4.)
    block_p = max(16, 4096 // block_c // triton.next_power_of_2(min(fh * fw, 4)))
    grid = (triton.cdiv(pixels, block_p), triton.cdiv(c, block_c))
    y_row = pixel_stride(y)
    _upsample_nearest_nhwc_kernel[grid](_as_moved(x), _as_moved(y), pixels, c, h, w, y_row, sxn, sxh, sxw,
                                        FH=fh, FW=fw, BLOCK_P=block_p, BLOCK_C=block_c,
                                        CH_ALIGN=told_alignment(c, y_row, sxn, sxh, sxw), PDL=pdl, num_warps=4,
                                        **launch_options(pdl))
    return y


settle_cache_keys(globals())  # last, once every Triton function above exists (common/cache_keys.py)
