"""JPEGs decoded on the host by libjpeg-turbo through simplejpeg, the fast host path's first choice
(docs/decisions/0059-host-jpegs-through-simplejpeg.md).

Pillow decodes with the same libjpeg-turbo, but handing its pixels out (`np.asarray(image)`, which
packs Pillow's 4-byte pixels to 3 in `Image.tobytes`) holds the GIL for every frame, so a pool of
threads decoding with Pillow stops at the GIL however many threads it has (figures in the decision).
simplejpeg releases the GIL for the whole decode and writes straight into a numpy array,
or into a caller's buffer.

The frames are Pillow's: the same DCT scale that `Image.draft` picks (1/2, 1/4 or 1/8: the largest
that keeps the frame at least the target's size), the same IDCT and upsampling, equal bit for bit
(tests/pipeline/test_turbo_jpeg.py). What this path does not take, Pillow still does: a JPEG it
cannot read (corrupt or truncated, so that the error is Pillow's one line as before), CMYK and YCCK
JPEGs (Pillow's conversion to RGB), images over Pillow's decompression-bomb limit (its warning and
error), and everything when simplejpeg is not installed."""
from __future__ import annotations

from collections.abc import Callable

import numpy as np
from PIL import Image

try:
    import simplejpeg
except ImportError:  # an optional speed-up: Pillow decodes everything without it
    simplejpeg = None

DRAFT_SCALES = (8, 4, 2, 1)  # the DCT scales Pillow's draft chooses among, largest first
COLORSPACES = ("RGB", "YCbCr", "Gray")  # converted to RGB by libjpeg-turbo as Pillow converts them


def header(data: bytes) -> tuple[int, int] | None:
    """(H, W) of a JPEG this path decodes, or None when Pillow should take it (see the module)."""
    if simplejpeg is None:
        return None
    try:
        height, width, colorspace, _ = simplejpeg.decode_jpeg_header(data)
    except ValueError:
        return None
    if colorspace not in COLORSPACES or width * height > Image.MAX_IMAGE_PIXELS:
        return None
    return height, width


def draft_size(height: int, width: int, target: tuple[int, int] | None) -> tuple[int, int]:
    """(H, W) of the frame as `Image.draft` sizes it for a target of (H, W) (None: full size): the
    largest of 1/8, 1/4, 1/2 and 1 whose frame still covers the target, rounded up."""
    if target is None:
        return height, width
    ratio = min(width // max(1, target[1]), height // max(1, target[0]))
    scale = next(s for s in DRAFT_SCALES if ratio >= s or s == 1)
    return -(-height // scale), -(-width // scale)


def decode(data: bytes, size: tuple[int, int],
           allocate: Callable[[tuple[int, int, int]], np.ndarray] | None = None) -> np.ndarray | None:
    """The JPEG as an H×W×3 uint8 RGB array of `size` (a `draft_size`), written into
    `allocate(shape)` when given; None when libjpeg-turbo refuses it (Pillow then says why)."""
    out = allocate((size[0], size[1], 3)) if allocate is not None else None
    try:
        pixels = simplejpeg.decode_jpeg(data, "RGB", min_height=size[0], min_width=size[1], buffer=out)
    except ValueError:
        return None
    # libjpeg-turbo picks its scale from eighths: the smallest covering `size` is Pillow's, checked here.
    return pixels if pixels.shape[:2] == tuple(size) else None
