"""The window tactic of few-channel INT8 (FP8) convolutions (a network's stem): tactics "window_"
+ a GEMM tile's name, offered beside the implicit-GEMM and im2col tiles of QConv.

The input is packed once into padded 4-byte pixels of codes (`sartor/kernels/pixel_pack.py`). In
that tensor the kw taps of one filter row, all channels, are kw·4 contiguous bytes, so a kh × kw
convolution over C ≤ 4 channels is a kh × 1 convolution over `window` "channels": overlapping
windows of `window` bytes (kw·4 rounded up to the tensor cores' 32-byte K step), read in place
through a strided view, one window per output pixel and filter row. The weight is laid out to
match: [Cout, window, kh, 1] with byte kw·4 + c of each window holding tap (kw, c), zero past the
kernel's width and channels. The implicit-GEMM kernel then walks K in whole 32-byte blocks of
contiguous loads, where im2col first wrote [N·OH·OW, K] columns byte by byte from the image's
planes (2.62 ms of ResNet-50's 3.46 ms INT8 stem at batch 256 on the H200, BENCHMARKS.md
session 13).

The products and their int32 sums are those of the emulation (zero codes add nothing), so the
output is the emulation's bit for bit, as for the other tiles.

Beside the implicit-GEMM tiles ("window_igemm_…"), resident-window tiles ("window_resident_…",
`sartor/kernels/window_resident.py`) run the GEMM over the same packed pixels and weight with the
weight block held in each program across several row tiles.
"""
from __future__ import annotations

import torch

from ..kernels.conv_igemm import TILES_PER_EFFORT, ConvGeometry, TileConfig, conv_igemm
from ..kernels.pixel_pack import PIXEL_BYTES, pack_pixels
from ..kernels.window_resident import WindowResidentTile, window_resident_conv, window_resident_tiles

WINDOW_PREFIX = "window_"
WINDOW_STEP = 32  # bytes: the K step of 8-bit tensor-core products, and the GEMM tiles' BLOCK_K
WINDOW_MAX_BYTES = 64  # kernels up to 16 taps wide
# Tiles whose BLOCK_K divides every window; output channels of stems are few (64 in ResNet).
WINDOW_TILES = (TileConfig(64, 64, 32, 4, 4), TileConfig(128, 64, 32, 4, 4), TileConfig(128, 128, 32, 8, 3),
                TileConfig(64, 128, 32, 4, 3), TileConfig(256, 64, 32, 8, 3), TileConfig(64, 32, 32, 4, 4))


def window_bytes(kernel_width: int) -> int:
    """Bytes of one window: the kernel's row of 4-byte pixels, rounded up to the K step."""
    return -(-kernel_width * PIXEL_BYTES // WINDOW_STEP) * WINDOW_STEP


def window_applies(x: torch.Tensor, wq: torch.Tensor, attrs: dict) -> bool:
    """Dense 2-D convolutions of up to 4 input channels, undilated along the width (a window is
    contiguous pixels), up to WINDOW_MAX_BYTES wide."""
    dilations = attrs.get("dilations") or [1, 1]
    return (x.dim() == 4 and wq.dim() == 4 and x.shape[1] <= PIXEL_BYTES and attrs.get("group", 1) == 1
            and len(dilations) == 2 and dilations[1] == 1 and window_bytes(wq.shape[3]) <= WINDOW_MAX_BYTES)


def window_tactics(effort: int) -> list[str]:
    """The implicit-GEMM window tiles, then the resident-window ones, as many as the effort allows."""
    tiles = [*WINDOW_TILES[:TILES_PER_EFFORT.get(effort, len(WINDOW_TILES))], *window_resident_tiles(effort)]
    return [WINDOW_PREFIX + tile.name for tile in tiles]


def window_tile(tactic: str | None) -> TileConfig | WindowResidentTile | None:
    """The tile a window tactic names: an implicit-GEMM tile or a resident-window one."""
    if not tactic or not tactic.startswith(WINDOW_PREFIX):
        return None
    name = tactic[len(WINDOW_PREFIX):]
    return TileConfig.parse(name) or WindowResidentTile.parse(name)


def window_resident_tile(tactic: str | None) -> WindowResidentTile | None:
    """The tile of a resident-window tactic; None for any other."""
    tile = window_tile(tactic)
    return tile if isinstance(tile, WindowResidentTile) else None


def window_weight(wq: torch.Tensor) -> torch.Tensor:
    """[Cout, C, kh, kw] codes → [Cout, window, kh, 1], packed for the kernel (K = (kh, window
    byte) fastest per output channel): byte kw·4 + c of row kh holds tap (kh, kw, c), the rest 0."""
    cout, c, kh, kw = wq.shape
    window = window_bytes(kw)
    rows = torch.zeros((cout, kh, window // PIXEL_BYTES, PIXEL_BYTES), dtype=torch.uint8, device=wq.device)
    rows[:, :, :kw, :c] = wq.view(torch.uint8).permute(0, 2, 3, 1)  # code 0 is byte 0 in INT8 and e4m3
    return rows.view(wq.dtype).reshape(cout, kh, 1, window).permute(0, 3, 1, 2)


def window_conv(x: torch.Tensor, w_window: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor | None,
                dequant_scale: torch.Tensor, geometry: ConvGeometry, tile: TileConfig | WindowResidentTile,
                code: torch.dtype, epilogue: dict, pdl: bool = False) -> torch.Tensor:
    """The convolution of `x` [N, C ≤ 4, H, W] (any strides; floats are quantized with the
    epilogue's input_inv_scale) with `geometry`, through packed pixels and windows; channels-last
    output, with the layer's epilogue. `pdl`: the resident-window kernel's launch (`kernels/pdl.py`)."""
    packed = window_pack(x, w_window, geometry, code, epilogue["input_inv_scale"], epilogue.get("qmin", -127))
    if isinstance(tile, WindowResidentTile):
        codes_epilogue = {name: value for name, value in epilogue.items() if name != "input_inv_scale"}
        return window_resident_conv(packed, w_window, bias, tile, geometry=geometry, dequant_scale=dequant_scale,
                                    residual=residual, pdl=pdl, **codes_epilogue)
    return windows_conv(packed, w_window, bias, residual, dequant_scale, geometry, tile, epilogue)


def window_pack(x: torch.Tensor, w_window: torch.Tensor, geometry: ConvGeometry, code: torch.dtype,
                input_inv_scale: float | None, qmin: int) -> torch.Tensor:
    """window_conv's first pass: `x` as padded 4-byte pixels, [N, padded H, padded W, 4], as
    many as the windows of `w_window` read at `geometry`."""
    pixels = w_window.shape[1] // PIXEL_BYTES
    (kh, _), (sh, sw), (dh, _) = geometry.kernel, geometry.strides, geometry.dilations
    oh, ow = geometry.out_hw
    padded_h = (oh - 1) * sh + (kh - 1) * dh + 1
    padded_w = -(-((ow - 1) * sw + pixels) // 4) * 4  # whole 16-byte rows: aligned window loads
    return pack_pixels(x, geometry.pads, (padded_h, padded_w), code, input_inv_scale, qmin)


def windows_conv(packed: torch.Tensor, w_window: torch.Tensor, bias: torch.Tensor | None,
                 residual: torch.Tensor | None, dequant_scale: torch.Tensor, geometry: ConvGeometry,
                 tile: TileConfig, epilogue: dict) -> torch.Tensor:
    """window_conv's second pass: the implicit GEMM over overlapping windows of `packed`
    (window_pack's), read in place through a strided view."""
    window = w_window.shape[1]
    pixels = window // PIXEL_BYTES
    (kh, _), (sh, sw), (dh, _) = geometry.kernel, geometry.strides, geometry.dilations
    n, padded_h, padded_w, _ = packed.shape
    windows = packed.as_strided((n, window, padded_h, padded_w - pixels + 1),
                                (padded_h * padded_w * PIXEL_BYTES, 1, padded_w * PIXEL_BYTES, PIXEL_BYTES))
    rows = ConvGeometry((kh, 1), (sh, sw), (0, 0), (dh, 1), geometry.out_hw)
    return conv_igemm(windows, w_window, bias, rows, tile, dequant_scale=dequant_scale, residual=residual,
                      **epilogue)
