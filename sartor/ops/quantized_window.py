"""The window tactics of few-channel INT8 (FP8) convolutions (a network's stem): "window_igemm.…"
(an implicit-GEMM tile's fields) and "window_resident.…" (a resident-window tile's), offered beside
the implicit-GEMM and im2col tiles of QConv.

The input is packed once into padded 4-byte pixels of codes (`sartor/kernels/window/pixel_pack.py`). In
that tensor the kw taps of one filter row, all channels, are kw·4 contiguous bytes, so a kh × kw
convolution over C ≤ 4 channels is a kh × 1 convolution over `window` "channels": overlapping
windows of `window` bytes (kw·4 rounded up to the tensor cores' 32-byte K step), read in place
through a strided view, one window per output pixel and filter row. The weight is laid out to
match: [Cout, window, kh, 1] with byte kw·4 + c of each window holding tap (kw, c), zero past the
kernel's width and channels. The implicit-GEMM kernel then walks K in whole 32-byte blocks of
contiguous loads, where im2col first wrote [N·OH·OW, K] columns byte by byte from the image's
planes (docs/decisions/kernel-stem-im2col-and-pixel-windows.md).

The products and their int32 sums are those of the emulation (zero codes add nothing), so the
output is the emulation's bit for bit, as for the other tiles.

Beside the implicit-GEMM tiles ("window_igemm.…"), resident-window tiles ("window_resident.…",
`sartor/kernels/window/resident.py`) run the GEMM over the same packed pixels and weight with the
weight block held in each program across several row tiles.

A stride-2 INT8 stem has a space-to-depth form of each (flag "space-to-depth"): the image packed into
16-byte pixels, each a 2 × 2 block of 4-byte ones, makes the 7 × 7 stride-2 convolution a 4 × 4
stride-1 one over them (the kernel zero-padded to 8 × 8). A window is then 4 whole 16-byte pixels,
64 bytes starting every 16, where the 4-byte form's 32-byte windows start every 8 bytes: the GEMM
gathers its rows in fewer loads, of 16 aligned bytes rather than 8
(docs/decisions/kernel-stem-im2col-and-pixel-windows.md). K is 4 · 64 = 256
against 7 · 32 = 224. The products are the same and their int32 sums exact, so the output is the
emulation's bit for bit; FP8, which sums in float32 window by window, keeps the 4-byte form.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from ..kernels.conv.igemm import TILES_PER_EFFORT, ConvGeometry, TileConfig, conv_igemm
from ..kernels.window.pixel_pack import PIXEL_BYTES, pack_pixels
from ..kernels.registry import PIXEL_WINDOWS, Flag, Inline, LayerFacts, Tactic, register
from ..kernels.window.resident import WindowResidentTile, window_resident_conv, window_resident_tiles
from .fp8 import is_fp8

BLOCK_PIXEL_BYTES = 4 * PIXEL_BYTES  # a 2 × 2 block of 4-byte pixels
WINDOW_STEP = 32  # bytes: the K step of 8-bit tensor-core products, and the GEMM tiles' BLOCK_K
WINDOW_MAX_BYTES = 64  # kernels up to 16 taps wide
# Tiles whose BLOCK_K divides every window; output channels of stems are few (64 in ResNet).
WINDOW_TILES = (TileConfig(64, 64, 32, 4, 4), TileConfig(128, 64, 32, 4, 4), TileConfig(128, 128, 32, 8, 3),
                TileConfig(64, 128, 32, 4, 3), TileConfig(256, 64, 32, 8, 3), TileConfig(64, 32, 32, 4, 4))


def window_bytes(kernel_width: int) -> int:
    """Bytes of one window: the kernel's row of 4-byte pixels, rounded up to the K step."""
    return -(-kernel_width * PIXEL_BYTES // WINDOW_STEP) * WINDOW_STEP


def space_to_depth_window_bytes(kernel_width: int) -> int:
    """Bytes of one space-to-depth window: the kernel row's 16-byte block pixels (half its width,
    rounded up), rounded up to the K step."""
    blocks = -(-kernel_width // 2)
    return -(-blocks * BLOCK_PIXEL_BYTES // WINDOW_STEP) * WINDOW_STEP


def window_applies(x: torch.Tensor, wq: torch.Tensor, attrs: dict) -> bool:
    """Dense 2-D convolutions of up to 4 input channels, undilated along the width (a window is
    contiguous pixels), up to WINDOW_MAX_BYTES wide."""
    return x.dim() == 4 and window_applies_to_weight(tuple(wq.shape), attrs)


def window_applies_to_weight(weight_shape: tuple, attrs: dict) -> bool:
    """window_applies by the weight's shape [Cout, C, kh, kw] alone (C is the input's channels of a
    dense convolution): what a graph pass knows before any tensor exists."""
    dilations = attrs.get("dilations") or [1, 1]
    return (len(weight_shape) == 4 and weight_shape[1] <= PIXEL_BYTES and attrs.get("group", 1) == 1
            and len(dilations) == 2 and dilations[1] == 1 and window_bytes(weight_shape[3]) <= WINDOW_MAX_BYTES)


def space_to_depth_applies(x: torch.Tensor, wq: torch.Tensor, attrs: dict) -> bool:
    """INT8 window convolutions of stride 2 × 2, undilated, whose space-to-depth window fits
    WINDOW_MAX_BYTES (kernels up to 8 taps wide)."""
    dilations = attrs.get("dilations") or [1, 1]
    return (not is_fp8(attrs) and window_applies(x, wq, attrs) and list(attrs.get("strides") or [1, 1]) == [2, 2]
            and list(dilations) == [1, 1] and space_to_depth_window_bytes(wq.shape[3]) <= WINDOW_MAX_BYTES)


def _pixels_words(space_to_depth: bool) -> str:
    return "16-byte pixels of 2x2 blocks, stride 1" if space_to_depth else "4-byte pixels"


@register
@dataclass(frozen=True)
class WindowIgemm(Tactic):
    """Packed pixels, then an implicit-GEMM tile over their windows, e.g. "window_igemm.64x64x32.w4.s4"
    (".space-to-depth": through block pixels)."""
    tile: TileConfig
    space_to_depth: bool = False

    FAMILY: ClassVar[str] = "window_igemm"
    SCHEME: ClassVar[tuple] = (Inline("tile", TileConfig), Flag("space_to_depth", "space-to-depth"))
    WEIGHT_LAYOUT: ClassVar[str] = PIXEL_WINDOWS

    def describe(self, layer: LayerFacts) -> str:
        return (f"{layer.codes} {_pixels_words(self.space_to_depth)} + triton implicit GEMM over pixel windows "
                f"{self.tile.fields_text} + fused epilogue")


@register
@dataclass(frozen=True)
class WindowResident(Tactic):
    """Packed pixels, then a resident-window tile over their windows, e.g.
    "window_resident.64x64.t8.w4.s2.kh-steps.row-pairs" (".space-to-depth": through block pixels;
    ".max-pool": the layer's carried max pool in the kernel)."""
    tile: WindowResidentTile
    space_to_depth: bool = False

    FAMILY: ClassVar[str] = "window_resident"
    SCHEME: ClassVar[tuple] = (Inline("tile", WindowResidentTile), Flag("space_to_depth", "space-to-depth"))
    WEIGHT_LAYOUT: ClassVar[str] = PIXEL_WINDOWS
    PROGRAMMATIC_LAUNCH: ClassVar[bool] = True  # its GEMM kernel; the pixel packing launches as usual

    @property
    def fuses_max_pool(self) -> bool:
        return self.tile.max_pool

    def describe(self, layer: LayerFacts) -> str:
        rows = ", two output rows per row tile" if self.tile.row_pairs else ""
        return (f"{layer.codes} {_pixels_words(self.space_to_depth)} + triton GEMM over pixel windows, weight "
                f"resident over row tiles {self.tile.fields_text}{rows} + fused epilogue")


WINDOW_TACTICS = (WindowIgemm, WindowResident)


def window_tactic(tile: TileConfig | WindowResidentTile, space_to_depth: bool = False) -> WindowIgemm | WindowResident:
    """The window tactic running `tile` (an implicit-GEMM or a resident-window tile) over packed pixels."""
    return (WindowResident if isinstance(tile, WindowResidentTile) else WindowIgemm)(tile, space_to_depth)


def window_tactics(effort: int, space_to_depth: bool = False, max_pool: bool = False,
                   out_channels: int | None = None) -> list[str]:
    """The implicit-GEMM window tiles, then the resident-window ones, as many as the effort allows;
    with `space_to_depth` each in that form too; with `max_pool` (a layer carrying the 3 × 3 / 2 max
    pool the pooled tiles compute) the pooled resident-window tiles too; for a layer of few
    `out_channels`, the resident-window tiles' narrow variants too (`window_resident_tiles`)."""
    tiles = [*WINDOW_TILES[:TILES_PER_EFFORT.get(effort, len(WINDOW_TILES))],
             *window_resident_tiles(effort, max_pool=max_pool, out_channels=out_channels)]
    forms = (False, True) if space_to_depth else (False,)
    return [window_tactic(tile, form).name for form in forms for tile in tiles]


def window_weight(wq: torch.Tensor, space_to_depth: bool = False) -> torch.Tensor:
    """[Cout, C, kh, kw] codes → [Cout, window, kh, 1], packed for the kernel (K = (kh, window
    byte) fastest per output channel): byte kw·4 + c of row kh holds tap (kh, kw, c), the rest 0.
    With `space_to_depth`, [Cout, window, ⌈kh/2⌉, 1]: byte j·16 + (dy·2 + dx)·4 + c of row i holds
    tap (2i + dy, 2j + dx, c), as the block pixels hold the image."""
    cout, c, kh, kw = wq.shape
    if not space_to_depth:
        window = window_bytes(kw)
        rows = torch.zeros((cout, kh, window // PIXEL_BYTES, PIXEL_BYTES), dtype=torch.uint8, device=wq.device)
        rows[:, :, :kw, :c] = wq.view(torch.uint8).permute(0, 2, 3, 1)  # code 0 is byte 0 in INT8 and e4m3
        return rows.view(wq.dtype).reshape(cout, kh, 1, window).permute(0, 3, 1, 2)
    window, kh2, kw2 = space_to_depth_window_bytes(kw), -(-kh // 2), -(-kw // 2)
    taps = torch.zeros((cout, 2 * kh2, 2 * kw2, PIXEL_BYTES), dtype=torch.uint8, device=wq.device)
    taps[:, :kh, :kw, :c] = wq.view(torch.uint8).permute(0, 2, 3, 1)
    blocks = taps.view(cout, kh2, 2, kw2, 2, PIXEL_BYTES).permute(0, 1, 3, 2, 4, 5).reshape(cout, kh2, -1)
    rows = torch.zeros((cout, kh2, window), dtype=torch.uint8, device=wq.device)
    rows[:, :, :blocks.shape[2]] = blocks
    return rows.view(wq.dtype).reshape(cout, kh2, 1, window).permute(0, 3, 1, 2)


def window_conv(x: torch.Tensor, w_window: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor | None,
                dequant_scale: torch.Tensor, geometry: ConvGeometry, tile: TileConfig | WindowResidentTile,
                code: torch.dtype, epilogue: dict, pdl: bool = False, space_to_depth: bool = False) -> torch.Tensor:
    """The convolution of `x` [N, C ≤ 4, H, W] (any strides; floats are quantized with the
    epilogue's input_inv_scale) with `geometry`, through packed pixels and windows; channels-last
    output, with the layer's epilogue. `pdl`: the resident-window kernel's launch (`kernels/common/pdl.py`).
    `space_to_depth`: through block pixels, `w_window` being window_weight's of that form."""
    if space_to_depth:
        packed, geometry = space_to_depth_pack(x, w_window, geometry, code, epilogue["input_inv_scale"],
                                               epilogue.get("qmin", -127))
    else:
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


def space_to_depth_pack(x: torch.Tensor, w_window: torch.Tensor, geometry: ConvGeometry, code: torch.dtype,
                        input_inv_scale: float | None, qmin: int) -> tuple[torch.Tensor, ConvGeometry]:
    """window_conv's first pass in the space-to-depth form: `x` as block pixels (as the [N, HB,
    WB·4, 4] view of 4-byte pixels the window kernels read), and the geometry over them: a
    ⌈kh/2⌉ × 1 convolution at stride 1, a window starting every 4 of those 4-byte pixels."""
    window, rows = w_window.shape[1], w_window.shape[2]
    oh, ow = geometry.out_hw
    blocks_h, blocks_w = oh + rows - 1, ow - 1 + window // BLOCK_PIXEL_BYTES
    packed = pack_pixels(x, geometry.pads, (2 * blocks_h, 2 * blocks_w), code, input_inv_scale, qmin,
                         space_to_depth=True)
    return packed, ConvGeometry((rows, 1), (1, BLOCK_PIXEL_BYTES // PIXEL_BYTES), (0, 0), (1, 1), (oh, ow))


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
