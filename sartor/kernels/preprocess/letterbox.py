"""uint8 frames to an engine's input in one Triton launch: Pillow's antialiased bilinear resize
(its fixed-point taps and its rounding to uint8 after each pass, `taps.py`), the letterbox's pad
bands, channel order, (x - mean) / std, NCHW or NHWC, float32, float16 or uint8 levels, or the
INT8 codes of those values that the INT8 layer reading them would make (its input scale).

Each program owns a run of output pixels along one row of one frame, all three channels: the
row's vertical taps are scalars (a tap of weight 0 is skipped), the tap counts compile-time
constants (unrolled loops; past MAX_UNROLLED_TAPS the vertical taps are a loop), and a row of a
pad band reads nothing. An output pixel inside the image sums its vertical taps of horizontally
filtered rows, each row sum rounded to uint8 as Pillow's first pass stores it, then rounds the
vertical sum as its second pass; a pixel in a pad band stores the normalised pad value. The
frames are read through their strides, so 3×H×W (decoders) and H×W×3 (cameras, OpenCV) frames
are both read in place; the output too, so it may be the engine's bound input buffer or a slice
of it. The taps live on the device, made once
per (input size, output size): a batch touches no host data.

One launch rather than a horizontal then a vertical kernel: the two-pass form writes and reads an
intermediate image the size of the frame's rows at the output width, for fewer multiply-adds per
pixel (2k against k², k = 5 at a 2× shrink); the taps of one block overlap, so the k² loads are
cache hits (docs/decisions/0024-preprocessing-kernel.md)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from ...data.preprocess import PreprocessSpec
from ...ir.dtypes import INT8_QMAX
from ..common.cache_keys import settle_cache_keys
from ..pointwise.epilogue import triton
from ..registry import LayerFacts, Number, Tactic, register
from .taps import device_row_groups, device_taps, used_taps

if triton is not None:
    import triton.language as tl

    from ..common.tile_steps import quantize_int8

    @triton.jit
    def _clip8(acc):
        """Pillow's clip8: a fixed-point sum (rounding half already added) to 0..255."""
        return tl.minimum(tl.maximum(acc >> 22, 0), 255)

    @triton.jit
    def _rounded_sums(BLOCK: tl.constexpr):
        """A row of BLOCK pixels' three channel sums, started at Pillow's rounding: half of
        taps.PRECISION_BITS (22), as _clip8 shifts by it."""
        half = 1 << 21
        return tl.full((BLOCK,), half, tl.int32), tl.full((BLOCK,), half, tl.int32), tl.full((BLOCK,), half, tl.int32)

    @triton.jit
    def _normalised(level, mean, std, IDENTITY: tl.constexpr, LEVELS: tl.constexpr):
        """(level - mean) / std in float32 (IEEE division, as numpy's); with LEVELS rounded half to
        even and clamped to 0..255, as the CPU reference's np.rint and clip."""
        x = level.to(tl.float32)
        if not IDENTITY:
            x = tl.math.div_rn(x - mean, std)
            if LEVELS:
                low = tl.floor(x)
                frac = x - low
                odd = (low - 2.0 * tl.floor(low * 0.5)) == 1.0
                x = tl.where((frac > 0.5) | ((frac == 0.5) & odd), low + 1.0, low)
                x = tl.minimum(tl.maximum(x, 0.0), 255.0)
        return x

    @triton.jit
    def _output(level, mean, std, inv_scale, qmin, IDENTITY: tl.constexpr, LEVELS: tl.constexpr,
                CODES: tl.constexpr, HALF: tl.constexpr):
        """One channel's output: the normalised value (float32), or with CODES its INT8 code as the
        layer reading it quantizes its float input (quantize_int8: round(x · inv_scale) half to
        even, saturated to [qmin, 127]); with HALF first rounded to the float16 that input held."""
        x = _normalised(level, mean, std, IDENTITY, LEVELS)
        if CODES:  # one return: Triton 3.6 refuses a function whose returns differ in type
            if HALF:
                x = x.to(tl.float16).to(tl.float32)
            x = quantize_int8(x, inv_scale, qmin)
        return x

    @triton.jit
    def _add_tap_row(v0, v1, v2, frame, row_weight_ptr, col_weight_ptr, iy, i, ky, y0, x0, ix, inside, H, W,
                     sxh, sxw, sxc, KX: tl.constexpr, BLOCK: tl.constexpr):
        """An output row's vertical sums plus its i-th vertical tap: that input row filtered
        horizontally (three channels, rounded to uint8 as Pillow's first pass stores it) at the
        tap's weight; a tap of weight 0 (past the row's own taps) reads nothing."""
        wy = tl.load(row_weight_ptr + iy * ky + i)
        if wy != 0:
            row = frame + tl.minimum(y0 + i, H - 1).to(tl.int64) * sxh
            h0, h1, h2 = _rounded_sums(BLOCK)
            for j in tl.static_range(KX):
                wx = tl.load(col_weight_ptr + ix * KX + j)
                pixel = row + tl.minimum(x0 + j, W - 1).to(tl.int64) * sxw
                h0 += tl.load(pixel, mask=inside, other=0).to(tl.int32) * wx
                h1 += tl.load(pixel + sxc, mask=inside, other=0).to(tl.int32) * wx
                h2 += tl.load(pixel + 2 * sxc, mask=inside, other=0).to(tl.int32) * wx
            v0 += _clip8(h0) * wy
            v1 += _clip8(h1) * wy
            v2 += _clip8(h2) * wy
        return v0, v1, v2

    @triton.jit
    def _letterbox_kernel(x_ptr, y_ptr, row_start_ptr, row_weight_ptr, col_start_ptr, col_weight_ptr,
                          H, W, new_h, new_w, top, left, OW, ky,
                          sxn, sxc, sxh, sxw, syn, syc, syh, syw,
                          mean0, mean1, mean2, std0, std1, std2, pad, inv_scale, qmin,
                          KY: tl.constexpr, KX: tl.constexpr, SWAP: tl.constexpr, IDENTITY: tl.constexpr,
                          LEVELS: tl.constexpr, CODES: tl.constexpr, HALF: tl.constexpr, BLOCK: tl.constexpr):
        """One output row's run of BLOCK pixels. The vertical taps are unrolled (KY of them, = ky)
        or, with KY = 0, a loop of ky steps: the compile time grows with the KY × KX taps unrolled,
        and a large shrink has thousands (`unrolled_rows`)."""
        n = tl.program_id(2).to(tl.int64)
        oy = tl.program_id(1)
        ox = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        valid = ox < OW
        out = y_ptr + n * syn + oy.to(tl.int64) * syh + ox.to(tl.int64) * syw
        padded = tl.zeros((BLOCK,), tl.int32) + pad
        iy = oy - top
        if (iy >= 0) & (iy < new_h):
            ix = ox - left
            inside = valid & (ix >= 0) & (ix < new_w)
            ix = tl.minimum(tl.maximum(ix, 0), new_w - 1)
            x0 = tl.load(col_start_ptr + ix)
            y0 = tl.load(row_start_ptr + iy)  # the program's one output row: its vertical taps are scalars
            frame = x_ptr + n * sxn
            v0, v1, v2 = _rounded_sums(BLOCK)
            if KY == 0:
                for i in range(ky):
                    v0, v1, v2 = _add_tap_row(v0, v1, v2, frame, row_weight_ptr, col_weight_ptr, iy, i, ky, y0, x0,
                                              ix, inside, H, W, sxh, sxw, sxc, KX, BLOCK)
            else:
                for i in tl.static_range(KY):
                    v0, v1, v2 = _add_tap_row(v0, v1, v2, frame, row_weight_ptr, col_weight_ptr, iy, i, KY, y0, x0,
                                              ix, inside, H, W, sxh, sxw, sxc, KX, BLOCK)
        else:  # a row of the pad band: no frame pixel to read, every pixel the pad value
            inside = valid & (ox < 0)
            v0 = tl.zeros((BLOCK,), tl.int32)
            v1 = tl.zeros((BLOCK,), tl.int32)
            v2 = tl.zeros((BLOCK,), tl.int32)
        _store_pixels(out, v0, v1, v2, inside, padded, valid, syc, mean0, mean1, mean2, std0, std1, std2,
                      inv_scale, qmin, SWAP, IDENTITY, LEVELS, CODES, HALF)


    @triton.jit
    def _add_row(v0, v1, v2, c0, c1, c2, w):
        """One output row's vertical sums plus one filtered input row (its three channels) at weight w."""
        return v0 + c0 * w, v1 + c1 * w, v2 + c2 * w

    @triton.jit
    def _store_pixels(out, v0, v1, v2, inside, padded, mask, syc, mean0, mean1, mean2, std0, std1, std2,
                      inv_scale, qmin, SWAP: tl.constexpr, IDENTITY: tl.constexpr, LEVELS: tl.constexpr,
                      CODES: tl.constexpr, HALF: tl.constexpr):
        """An output row's pixels from its vertical sums: each rounded as Pillow's second pass rounds,
        the frames' channels in the engine's order, the pad value outside the image (`inside`),
        normalised and stored where `mask` holds. Both kernels end here."""
        dtype: tl.constexpr = out.dtype.element_ty
        r1 = _clip8(v1)
        if SWAP:
            r0 = _clip8(v2)
            r2 = _clip8(v0)
        else:
            r0 = _clip8(v0)
            r2 = _clip8(v2)
        r0 = tl.where(inside, r0, padded)
        r1 = tl.where(inside, r1, padded)
        r2 = tl.where(inside, r2, padded)
        tl.store(out, _output(r0, mean0, std0, inv_scale, qmin, IDENTITY, LEVELS, CODES, HALF).to(dtype), mask=mask)
        tl.store(out + syc, _output(r1, mean1, std1, inv_scale, qmin, IDENTITY, LEVELS, CODES, HALF).to(dtype),
                 mask=mask)
        tl.store(out + 2 * syc, _output(r2, mean2, std2, inv_scale, qmin, IDENTITY, LEVELS, CODES, HALF).to(dtype),
                 mask=mask)

    @triton.jit
    def _letterbox_rows_kernel(x_ptr, y_ptr, group_row_ptr, group_used_ptr, group_weight_ptr, col_start_ptr,
                               col_weight_ptr, H, W, new_w, left, OW, OH, body_top, body_rows, groups,
                               sxn, sxc, sxh, sxw, syn, syc, syh, syw,
                               mean0, mean1, mean2, std0, std1, std2, pad, inv_scale, qmin,
                               KX: tl.constexpr, KX_STRIDE: tl.constexpr, SPAN: tl.constexpr, ROWS: tl.constexpr,
                               SWAP: tl.constexpr, IDENTITY: tl.constexpr, LEVELS: tl.constexpr, CODES: tl.constexpr,
                               HALF: tl.constexpr, BLOCK: tl.constexpr):
        """ROWS consecutive output rows per program sharing their horizontally filtered input rows:
        each of the group's SPAN input rows from Y0 is filtered once (three channels, rounded to
        uint8) and added to every output row of the group at that row's own weight for it (0 where
        the row does not read it). Programs 0..groups-1 own the rows inside the image (output rows
        body_top..body_top+body_rows-1); the rest own the pad bands' rows, ROWS each: the band
        above (body_top rows) then the band below."""
        n = tl.program_id(2).to(tl.int64)
        g = tl.program_id(1)
        ox = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        valid = ox < OW
        base = y_ptr + n * syn + ox.to(tl.int64) * syw
        padded = tl.zeros((BLOCK,), tl.int32) + pad
        if g < groups:
            ix = ox - left
            inside = valid & (ix >= 0) & (ix < new_w)
            ix = tl.minimum(tl.maximum(ix, 0), new_w - 1)
            x0 = tl.load(col_start_ptr + ix)
            y0 = tl.load(group_row_ptr + g)
            used = tl.load(group_used_ptr + g)
            taps = group_weight_ptr + g * (SPAN * ROWS)
            frame = x_ptr + n * sxn
            v00, v01, v02 = _rounded_sums(BLOCK)
            v10, v11, v12 = _rounded_sums(BLOCK)
            if ROWS > 2:
                v20, v21, v22 = _rounded_sums(BLOCK)
                v30, v31, v32 = _rounded_sums(BLOCK)
            for k in tl.static_range(SPAN):
                if k < used:  # the group's last rows may read fewer input rows than SPAN
                    row = frame + tl.minimum(y0 + k, H - 1).to(tl.int64) * sxh
                    h0, h1, h2 = _rounded_sums(BLOCK)
                    for j in tl.static_range(KX):
                        wx = tl.load(col_weight_ptr + ix * KX_STRIDE + j)  # the same for every k: loaded once (CSE)
                        pixel = row + tl.minimum(x0 + j, W - 1).to(tl.int64) * sxw
                        h0 += tl.load(pixel, mask=inside, other=0).to(tl.int32) * wx
                        h1 += tl.load(pixel + sxc, mask=inside, other=0).to(tl.int32) * wx
                        h2 += tl.load(pixel + 2 * sxc, mask=inside, other=0).to(tl.int32) * wx
                    c0 = _clip8(h0)  # Pillow's first pass stores its rows as uint8
                    c1 = _clip8(h1)
                    c2 = _clip8(h2)
                    v00, v01, v02 = _add_row(v00, v01, v02, c0, c1, c2, tl.load(taps + k * ROWS))
                    v10, v11, v12 = _add_row(v10, v11, v12, c0, c1, c2, tl.load(taps + k * ROWS + 1))
                    if ROWS > 2:
                        v20, v21, v22 = _add_row(v20, v21, v22, c0, c1, c2, tl.load(taps + k * ROWS + 2))
                        v30, v31, v32 = _add_row(v30, v31, v32, c0, c1, c2, tl.load(taps + k * ROWS + 3))
            first = g * ROWS
            out = base + (body_top + first).to(tl.int64) * syh
            _store_pixels(out, v00, v01, v02, inside, padded, valid & (first < body_rows), syc,
                          mean0, mean1, mean2, std0, std1, std2, inv_scale, qmin, SWAP, IDENTITY, LEVELS, CODES, HALF)
            _store_pixels(out + syh, v10, v11, v12, inside, padded, valid & (first + 1 < body_rows), syc,
                          mean0, mean1, mean2, std0, std1, std2, inv_scale, qmin, SWAP, IDENTITY, LEVELS, CODES, HALF)
            if ROWS > 2:
                _store_pixels(out + 2 * syh, v20, v21, v22, inside, padded, valid & (first + 2 < body_rows), syc,
                              mean0, mean1, mean2, std0, std1, std2, inv_scale, qmin, SWAP, IDENTITY, LEVELS, CODES,
                              HALF)
                _store_pixels(out + 3 * syh, v30, v31, v32, inside, padded, valid & (first + 3 < body_rows), syc,
                              mean0, mean1, mean2, std0, std1, std2, inv_scale, qmin, SWAP, IDENTITY, LEVELS, CODES,
                              HALF)
        else:  # rows of the pad bands: no frame pixel to read
            dtype: tl.constexpr = y_ptr.dtype.element_ty
            p0 = _output(padded, mean0, std0, inv_scale, qmin, IDENTITY, LEVELS, CODES, HALF).to(dtype)
            p1 = _output(padded, mean1, std1, inv_scale, qmin, IDENTITY, LEVELS, CODES, HALF).to(dtype)
            p2 = _output(padded, mean2, std2, inv_scale, qmin, IDENTITY, LEVELS, CODES, HALF).to(dtype)
            for r in tl.static_range(ROWS):
                q = (g - groups) * ROWS + r  # the q-th pad row: above the image, then below it
                oy = q + body_rows * (q >= body_top).to(tl.int32)
                out = base + oy.to(tl.int64) * syh
                mask = valid & (oy < OH)
                tl.store(out, p0, mask=mask)
                tl.store(out + syc, p1, mask=mask)
                tl.store(out + 2 * syc, p2, mask=mask)


@register
@dataclass(frozen=True)
class PreprocessTile(Tactic):
    """The preprocessing kernel's tactic: output pixels per program, warps, and output rows per
    program, named e.g. "preprocess.pixels256.w4" (one row) or "preprocess.pixels128.w4.rows4"
    (`_letterbox_rows_kernel`: the rows share their filtered input rows)."""
    pixels: int
    warps: int
    rows: int = 1

    FAMILY: ClassVar[str] = "preprocess"
    SCHEME: ClassVar[tuple] = (Number("pixels", "pixels"), Number("warps", "w"), Number("rows", "rows", omit=1))

    def invalid(self) -> str | None:
        powers = all(v > 0 and v & (v - 1) == 0 for v in (self.pixels, self.warps))
        if not (powers and self.pixels >= 32 * self.warps):
            return "powers of 2, pixels ≥ 32 · warps"
        return None if self.rows in ROW_GROUPS else f"rows one of {ROW_GROUPS}"

    def describe(self, layer: LayerFacts) -> str:
        rows = "one row" if self.rows == 1 else f"{self.rows} rows sharing their filtered input rows"
        return (f"triton fused preprocessing (Pillow bilinear taps, letterbox, normalise, layout), "
                f"{self.pixels} pixels of {rows} per program, {self.warps} warps")


ROW_GROUPS = (1, 2, 4)  # output rows per program the kernels are written for

# The first runs where nothing was timed (the pipeline's prepare step); the builder times them all.
# A tile is a run of output pixels along one row, or along 2 or 4 rows that read their filtered
# input rows once (the one-row kernel runs for them where a group would filter too many input
# rows: taps.MAX_SPAN).
PREPROCESS_TILES = (PreprocessTile(128, 4), PreprocessTile(256, 4), PreprocessTile(64, 2), PreprocessTile(512, 4),
                    PreprocessTile(128, 4, 4), PreprocessTile(64, 2, 4), PreprocessTile(256, 8, 4),
                    PreprocessTile(128, 4, 2))

FRAME_LAYOUTS = ("chw", "hwc")

# The most taps (input rows × columns) a program unrolls: the compile time grows with them, so past
# it (shrinks beyond about 6×) the one-row kernel loops over its vertical taps.
MAX_UNROLLED_TAPS = 192


def unrolled_rows(ky: int, kx: int) -> bool:
    """Whether the one-row kernel unrolls its ky vertical taps of kx columns each, or loops over them."""
    return ky * kx <= MAX_UNROLLED_TAPS


@dataclass(frozen=True)
class InputCodes:
    """The input quantization of the INT8 layer that reads the output: the kernel then writes its
    codes (`letterbox_frames`), and the layer skips its own quantization."""
    inv_scale: float  # float32-exact, as the layer stores it
    qmin: int = -INT8_QMAX  # -128 for layers folded from Q/DQ models


def preprocess_kernel_available() -> bool:
    return triton is not None


def kernel_supports(spec: PreprocessSpec) -> bool:
    """Whether this kernel computes `spec`: its taps are Pillow's, so resampler=cv2 is left to the
    torch path (cv2's 2-tap fixed-point INTER_LINEAR would be another tap table and rounding)."""
    return spec.resampler == "pillow"


def letterbox_frames(frames: torch.Tensor, frame_layout: str, frame_order: str, spec: PreprocessSpec,
                     resized: tuple[int, int], pad: tuple[int, int], out: torch.Tensor,
                     tile: PreprocessTile | None = None, codes: InputCodes | None = None) -> torch.Tensor:
    """N frames of one size (N×3×H×W for `frame_layout` "chw", N×H×W×3 for "hwc", uint8, any
    strides, channels in `frame_order`) → `out` (N images as `spec` lays them out), each frame
    resized to `resized` (h, w) with its top-left corner at `pad` (top, left) and the rest of the
    canvas the spec's pad value. A negative `pad` is a centre crop: the output pixel (y, x) reads
    the resized image's (y - top, x - left), all inside it. Pillow's filter only: `resampler=cv2`
    runs the torch path (`kernel_supports`). With `codes`, `out` is int8 and holds the INT8 codes
    of the values the spec makes (of their float16 values for dtype=float16): bit for bit what the
    layer reading a float input would quantize it to, so that layer reads them as they are."""
    if not kernel_supports(spec):
        raise ValueError(f"letterbox_frames: preprocess {spec.describe()!r} resamples with OpenCV's filter, which "
                         f"this kernel does not compute: use the torch path")
    if frame_layout not in FRAME_LAYOUTS:
        raise ValueError(f"letterbox_frames: frame layout {frame_layout!r} is not one of {FRAME_LAYOUTS}")
    if frames.dtype != torch.uint8 or frames.dim() != 4:
        raise ValueError(f"letterbox_frames: frames must be 4-D uint8, not {tuple(frames.shape)} {frames.dtype}")
    if (codes is not None) != (out.dtype == torch.int8):
        raise ValueError(f"letterbox_frames: INT8 codes go to an int8 output and only there, not {out.dtype} "
                         f"({'with' if codes is not None else 'without'} an input scale)")
    n = frames.shape[0]
    if frame_layout == "chw":
        _, _, h, w = frames.shape
        sxn, sxc, sxh, sxw = frames.stride()
    else:
        _, h, w, _ = frames.shape
        sxn, sxh, sxw, sxc = frames.stride()
    if spec.layout == "nchw":
        _, _, oh, ow = out.shape
        syn, syc, syh, syw = out.stride()
    else:
        _, oh, ow, _ = out.shape
        syn, syh, syw, syc = out.stride()
    (new_h, new_w), (top, left) = resized, pad
    row_start, row_weight, ky = device_taps(int(h), int(new_h), frames.device)
    col_start, col_weight, kx = device_taps(int(w), int(new_w), frames.device)
    identity = spec.mean == (0.0, 0.0, 0.0) and spec.std == (1.0, 1.0, 1.0)
    tile = tile or PREPROCESS_TILES[0]
    grid = (triton.cdiv(ow, tile.pixels), oh, n)
    if n == 0:
        return out
    inv_scale, qmin = (codes.inv_scale, codes.qmin) if codes is not None else (1.0, -INT8_QMAX)
    flags = dict(SWAP=frame_order != spec.channels, IDENTITY=identity, LEVELS=spec.dtype == "uint8",
                 CODES=codes is not None, HALF=spec.dtype == "float16", BLOCK=tile.pixels, num_warps=tile.warps,
                 # quantize_int8 rounds x · inv_scale to float32 before its rounding add, as the
                 # layer's own quantization does: no fused multiply-add
                 enable_fp_fusion=False)
    # Output rows inside the image: body_top.. (a crop starts inside it, at resized row -top).
    body_top = max(top, 0)
    body_rows = max(min(top + new_h, oh) - body_top, 0)
    columns = used_taps(int(w), int(new_w))
    groups = (device_row_groups(int(h), int(new_h), body_top - top, body_rows, tile.rows, frames.device)
              if tile.rows > 1 and body_rows > 0 else None)
    if groups is not None and unrolled_rows(groups[3], columns):
        group_row, group_used, group_weight, span = groups
        count = group_row.shape[0]
        grid = (triton.cdiv(ow, tile.pixels), count + triton.cdiv(oh - body_rows, tile.rows), n)
        _letterbox_rows_kernel[grid](frames, out, group_row, group_used, group_weight, col_start, col_weight,
                                     h, w, new_w, left, ow, oh, body_top, body_rows, count,
                                     sxn, sxc, sxh, sxw, syn, syc, syh, syw,
                                     *spec.mean, *spec.std, spec.pad_value, float(inv_scale), float(qmin),
                                     KX=columns, KX_STRIDE=kx, SPAN=span, ROWS=tile.rows,
                                     **flags)
        return out
    _letterbox_kernel[grid](frames, out, row_start, row_weight, col_start, col_weight,
                            h, w, new_h, new_w, top, left, ow, ky,
                            sxn, sxc, sxh, sxw, syn, syc, syh, syw,
                            *spec.mean, *spec.std, spec.pad_value, float(inv_scale), float(qmin),
                            KY=ky if unrolled_rows(ky, kx) else 0, KX=kx, **flags)
    return out


settle_cache_keys(globals())  # last, once every Triton function above exists (common/cache_keys.py)
