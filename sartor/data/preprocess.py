"""Image preprocessing: a spec in one line of text, and the function that applies it.

`letterbox=320,mean=0,std=255,rgb,nchw` reads: keep the aspect ratio, scale the image to fit 320×320,
pad it (centered, with 114 as Ultralytics does), keep RGB order, compute (x - 0) / 255, lay it out
channels first, as float32. Every image comes back with an `ImageMeta` that maps boxes found in the
network input back to the original image.

`resize=256,crop=224` is torchvision's ImageNet evaluation: the shorter side scaled to 256 (aspect
kept, the longer side truncated as `transforms.Resize(256)` does), then the centre 224×224 cut out.

Images are resized with Pillow's bilinear filter (antialiased when shrinking: torchvision's PIL
path), or with `resampler=cv2` OpenCV's `INTER_LINEAR` (no antialiasing: Ultralytics' `LetterBox`),
and are not rotated by their EXIF orientation: annotation files give boxes in stored-pixel
coordinates. OpenCV is optional: imported only when a spec asks for it.
"""
from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from PIL import Image, UnidentifiedImageError

from ..errors import ConfigError, DataError, MissingDependencyError

RESIZE_MODES = ("letterbox", "resize", "crop", "none")  # "crop": the shorter side resized, then a centre crop
RESAMPLERS = ("pillow", "cv2")
_RESAMPLER_ALIASES = {"pil": "pillow", "opencv": "cv2"}
CHANNELS = ("rgb", "bgr")
LAYOUTS = ("nchw", "nhwc")
DTYPES = ("float32", "float16", "uint8")
_DTYPE_ALIASES = {"fp32": "float32", "float": "float32", "fp16": "float16", "half": "float16", "u8": "uint8"}
SYNTAX = ("letterbox=H[xW] | resize=HxW | resize=N,crop=H[xW] | none, mean=M or M1:M2:M3, std=S or S1:S2:S3, "
          "rgb | bgr, nchw | nhwc, dtype=float32|float16|uint8, pad=0..255, resampler=pillow|cv2, "
          "max_downscale=X|any")
BUCKET_SEPARATOR = "|"  # letterbox=320|480|640: one resolution bucket per size (sartor/data/buckets.py)


@dataclass(frozen=True)
class PreprocessSpec:
    resize: str = "none"  # letterbox | resize | crop | none
    size: tuple[int, int] = (0, 0)  # (H, W) of the network input (the crop's with "crop"); (0, 0) with "none"
    mean: tuple[float, float, float] = (0.0, 0.0, 0.0)  # per channel, in the output channel order
    std: tuple[float, float, float] = (1.0, 1.0, 1.0)
    channels: str = "rgb"  # rgb | bgr
    layout: str = "nchw"  # nchw | nhwc
    dtype: str = "float32"  # float32 | float16 | uint8
    pad_value: int = 114  # letterbox padding, in 0..255 pixel units (before mean/std)
    shorter_side: int = 0  # with resize "crop": the shorter side's length before the centre crop
    resampler: str = "pillow"  # pillow (bilinear, antialiased) | cv2 (cv2.INTER_LINEAR, no antialiasing)
    # The most a frame may be shrunk to fit (its longer side over the input's, as the resize mode
    # measures it: sartor/data/buckets.py); None: any. A pipeline refuses a frame it would shrink
    # more (docs/decisions/0037-resolution-buckets.md); the preprocessing itself never reads it.
    max_downscale: float | None = None

    def __post_init__(self) -> None:
        if self.resize not in RESIZE_MODES:
            raise ConfigError(f"preprocess resize {self.resize!r} is not one of {', '.join(RESIZE_MODES)}")
        if self.channels not in CHANNELS:
            raise ConfigError(f"preprocess channels {self.channels!r} is not one of {', '.join(CHANNELS)}")
        if self.layout not in LAYOUTS:
            raise ConfigError(f"preprocess layout {self.layout!r} is not one of {', '.join(LAYOUTS)}")
        if self.dtype not in DTYPES:
            raise ConfigError(f"preprocess dtype {self.dtype!r} is not one of {', '.join(DTYPES)}")
        size = tuple(int(v) for v in self.size)
        if len(size) != 2 or (self.resize != "none" and min(size) <= 0):
            raise ConfigError(f"preprocess size {self.size!r} must be two positive integers (H, W)")
        mean, std = _triple(self.mean, "mean"), _triple(self.std, "std")
        if any(s == 0 for s in std):
            raise ConfigError("preprocess std must not be 0")
        if not 0 <= int(self.pad_value) <= 255:
            raise ConfigError(f"preprocess pad {self.pad_value} must be in 0..255")
        if self.resampler not in RESAMPLERS:
            raise ConfigError(f"preprocess resampler {self.resampler!r} is not one of {', '.join(RESAMPLERS)}")
        shorter = int(self.shorter_side)
        if self.resize == "crop" and shorter < max(size):
            raise ConfigError(f"preprocess resize={shorter},crop={size[0]}x{size[1]}: the shorter side must be at "
                              f"least the crop's height and width")
        if self.resize != "crop" and shorter:
            raise ConfigError(f"preprocess shorter_side {shorter} goes only with resize 'crop'")
        object.__setattr__(self, "max_downscale", _check_max_downscale(self.max_downscale))
        object.__setattr__(self, "shorter_side", shorter)
        object.__setattr__(self, "size", size)
        object.__setattr__(self, "mean", mean)
        object.__setattr__(self, "std", std)
        object.__setattr__(self, "pad_value", int(self.pad_value))

    @property
    def height(self) -> int:
        return self.size[0]

    @property
    def width(self) -> int:
        return self.size[1]

    def input_shape(self, batch: int = 1) -> tuple[int, ...] | None:
        """The network input shape this spec produces, or None when "none" keeps image sizes."""
        if self.resize == "none":
            return None
        h, w = self.size
        return (batch, 3, h, w) if self.layout == "nchw" else (batch, h, w, 3)

    def to_json(self) -> dict:
        return {"resize": self.resize, "size": list(self.size), "mean": list(self.mean), "std": list(self.std),
                "channels": self.channels, "layout": self.layout, "dtype": self.dtype, "pad_value": self.pad_value,
                "shorter_side": self.shorter_side, "resampler": self.resampler, "max_downscale": self.max_downscale,
                "text": self.describe()}

    @staticmethod
    def from_json(d: dict) -> PreprocessSpec:
        try:
            return PreprocessSpec(resize=d["resize"], size=tuple(d["size"]), mean=tuple(d["mean"]),
                                  std=tuple(d["std"]), channels=d["channels"], layout=d["layout"],
                                  dtype=d["dtype"], pad_value=d.get("pad_value", 114),
                                  # records from before these fields meant no crop and Pillow's resize
                                  shorter_side=d.get("shorter_side", 0), resampler=d.get("resampler", "pillow"),
                                  # records from before resolution buckets shrink any frame, as they did
                                  max_downscale=d.get("max_downscale"))
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError(f"preprocess record {d!r} is malformed: {exc}") from None

    def size_text(self) -> str:
        """The size as the resize token writes it: 640 (a square letterbox), 384x640, 256x256 (resize)."""
        h, w = self.size
        return f"{h}" + (f"x{w}" if (w != h or self.resize == "resize") else "")

    def describe(self, sizes: str | None = None, policy: bool = True) -> str:
        """The canonical text form; parse_preprocess(spec.describe()) == spec. `sizes` replaces the
        resize token's size (a bucket list, "320|640"); `policy=False` leaves max_downscale out."""
        parts = []
        if self.resize == "none":
            parts.append("none")
        elif self.resize == "crop":
            h, w = self.size
            parts.append(f"resize={self.shorter_side}")
            parts.append(f"crop={h}" + (f"x{w}" if w != h else ""))
        else:
            parts.append(f"{self.resize}={sizes or self.size_text()}")
        parts.append(f"mean={_fmt_triple(self.mean)}")
        parts.append(f"std={_fmt_triple(self.std)}")
        parts += [self.channels, self.layout]
        if self.dtype != "float32":
            parts.append(f"dtype={self.dtype}")
        if self.resize == "letterbox" and self.pad_value != 114:
            parts.append(f"pad={self.pad_value}")
        if self.resampler != "pillow":  # the default is left out: older specs' text stays as it was
            parts.append(f"resampler={self.resampler}")
        if policy and self.max_downscale is not None:  # likewise: no policy is any shrink, as before
            parts.append(f"max_downscale={format_number(self.max_downscale)}")
        return ",".join(parts)

    def __str__(self) -> str:
        return self.describe()


def _triple(value, name: str) -> tuple[float, float, float]:
    if isinstance(value, (int, float)):
        value = (value,)
    values = tuple(float(v) for v in value)
    if len(values) == 1:
        values = values * 3
    if len(values) != 3:
        raise ConfigError(f"preprocess {name} needs 1 or 3 values, got {len(values)}")
    return values  # type: ignore[return-value]


def _check_max_downscale(value) -> float | None:
    if value is None:
        return None
    try:
        factor = float(value)
    except (TypeError, ValueError):
        factor = float("nan")
    if not 1.0 <= factor < float("inf"):  # also refuses NaN
        raise ConfigError(f"preprocess max_downscale {value!r} must be a number ≥ 1 (1: never shrink a frame) or "
                          f"'any'")
    return factor


def parse_max_downscale(value: str, what: str = "max_downscale") -> float | None:
    """'2', '1.5' → the factor; 'any' (or 'inf') → None, no limit. `what` names the option."""
    text = str(value).strip().lower()
    if text in ("any", "inf"):
        return None
    try:
        return _check_max_downscale(float(text))
    except (ValueError, ConfigError):
        raise ConfigError(f"{what} {value!r} must be a number ≥ 1 (1: never shrink a frame) or 'any'") from None


def format_number(v: float) -> str:
    return f"{v:g}" if float(f"{v:g}") == v else repr(float(v))


def _fmt_triple(values: tuple[float, float, float]) -> str:
    if values[0] == values[1] == values[2]:
        return format_number(values[0])
    return ":".join(format_number(v) for v in values)


def _parse_size(token: str, value: str, square_ok: bool) -> tuple[int, int]:
    parts = value.lower().split("x")
    try:
        dims = [int(p) for p in parts]
    except ValueError:
        dims = []
    if len(dims) == 1 and square_ok:
        dims = dims * 2
    if len(dims) != 2 or min(dims) <= 0:
        form = "N or HxW" if square_ok else "HxW"
        raise ConfigError(f"preprocess token {token!r}: size must be {form} with positive integers")
    return dims[0], dims[1]


def parse_preprocess(text: str) -> PreprocessSpec:
    """`letterbox=320,mean=0,std=255,rgb,nchw` → PreprocessSpec (see SYNTAX). One size: a spec naming
    several (`letterbox=320|640`, resolution buckets) is read by `sartor.data.buckets.parse_buckets`."""
    if isinstance(text, str) and BUCKET_SEPARATOR in text:
        raise ConfigError(f"preprocess spec {text!r} names several sizes (resolution buckets): only `sartor build "
                          f"--preprocess` takes them; give one size here")
    if not isinstance(text, str) or not text.strip():
        raise ConfigError(f"preprocess spec is empty: expected {SYNTAX}")
    fields: dict = {}
    seen: dict[str, str] = {}

    def set_field(key: str, value, token: str) -> None:
        if key in seen:
            raise ConfigError(f"preprocess token {token!r} sets {key} again (already {seen[key]!r})")
        seen[key] = token
        fields[key] = value

    for raw in text.split(","):
        token = raw.strip()
        if not token:
            raise ConfigError(f"preprocess spec {text!r} has an empty token")
        key, sep, value = token.partition("=")
        key, value = key.strip().lower(), value.strip()
        if sep and not value:
            raise ConfigError(f"preprocess token {token!r} has no value")
        if key in ("letterbox", "resize") and sep:
            if key == "resize" and value.lower() == "none":
                set_field("resize", "none", token)
                continue
            set_field("resize", key, token)
            fields["size"] = _parse_size(token, value, square_ok=True)
        elif key == "crop" and sep:
            set_field("crop", _parse_size(token, value, square_ok=True), token)
        elif key == "resampler" and sep:
            resampler = _RESAMPLER_ALIASES.get(value.lower(), value.lower())
            if resampler not in RESAMPLERS:
                raise ConfigError(f"preprocess token {token!r}: resampler must be one of {', '.join(RESAMPLERS)}")
            set_field("resampler", resampler, token)
        elif key == "none" and not sep:
            set_field("resize", "none", token)
        elif key in ("mean", "std") and sep:
            try:
                values = tuple(float(v) for v in value.split(":"))
            except ValueError:
                raise ConfigError(f"preprocess token {token!r}: {key} must be a number or three numbers "
                                  f"separated by ':'") from None
            if len(values) not in (1, 3):
                raise ConfigError(f"preprocess token {token!r}: {key} needs 1 or 3 values, got {len(values)}")
            if key == "std" and any(v == 0 for v in values):
                raise ConfigError(f"preprocess token {token!r}: std must not be 0")
            set_field(key, values, token)
        elif key in CHANNELS and not sep:
            set_field("channels", key, token)
        elif key in LAYOUTS and not sep:
            set_field("layout", key, token)
        elif key == "dtype" and sep:
            dtype = _DTYPE_ALIASES.get(value.lower(), value.lower())
            if dtype not in DTYPES:
                raise ConfigError(f"preprocess token {token!r}: dtype must be one of {', '.join(DTYPES)}")
            set_field("dtype", dtype, token)
        elif key in ("pad", "pad_value") and sep:
            try:
                pad = int(value)
            except ValueError:
                pad = -1
            if not 0 <= pad <= 255:
                raise ConfigError(f"preprocess token {token!r}: pad must be an integer in 0..255")
            set_field("pad_value", pad, token)
        elif key == "max_downscale" and sep:
            set_field("max_downscale", parse_max_downscale(value, f"preprocess token {token!r}: max_downscale"), token)
        else:
            raise ConfigError(f"preprocess token {token!r} is not understood: expected {SYNTAX}")
    if "crop" in fields:
        crop = fields.pop("crop")
        resize_token = seen.get("resize", "")
        if fields.get("resize") != "resize" or "x" in resize_token.lower():
            # One number is torchvision's Resize(N), the shorter side; HxW or a letterbox has no centre
            # crop in the evaluation recipes this follows, so it is refused rather than guessed.
            raise ConfigError(f"preprocess token {seen['crop']!r} needs resize=N (the shorter side before the "
                              f"centre crop, as torchvision's Resize(N) + CenterCrop), not "
                              f"{resize_token or 'no resize'!r}")
        fields.update(resize="crop", shorter_side=fields["size"][0], size=crop)
    return PreprocessSpec(**fields)


# ---- images ----------------------------------------------------------------------------------------

@dataclass
class ImageMeta:
    path: str
    orig_size: tuple[int, int]  # (H, W) of the original image
    scale: tuple[float, float]  # (y, x) factors applied: input pixel = original pixel * scale + pad
    pad: tuple[int, int]  # (top, left) padding added, in input pixels
    input_size: tuple[int, int] | None = None  # (H, W) of the network input

    def to_original(self, boxes_xyxy: np.ndarray, clip: bool = True) -> np.ndarray:
        """Boxes (N×4 x1 y1 x2 y2) in network-input pixels → original-image pixels, clipped to the
        image unless `clip` is False."""
        boxes = np.asarray(boxes_xyxy, dtype=np.float32).reshape(-1, 4).copy()
        top, left = self.pad
        sy, sx = self.scale
        h, w = self.orig_size
        boxes[:, [0, 2]] = (boxes[:, [0, 2]] - left) / sx
        boxes[:, [1, 3]] = (boxes[:, [1, 3]] - top) / sy
        if clip:
            boxes[:, [0, 2]] = np.clip(boxes[:, [0, 2]], 0, w)
            boxes[:, [1, 3]] = np.clip(boxes[:, [1, 3]], 0, h)
        return boxes

    def to_input(self, boxes_xyxy: np.ndarray) -> np.ndarray:
        """Original-image boxes → network-input pixels (the inverse of to_original, without clipping)."""
        boxes = np.asarray(boxes_xyxy, dtype=np.float32).reshape(-1, 4).copy()
        top, left = self.pad
        sy, sx = self.scale
        boxes[:, [0, 2]] = boxes[:, [0, 2]] * sx + left
        boxes[:, [1, 3]] = boxes[:, [1, 3]] * sy + top
        return boxes


def load_image(path: str | os.PathLike) -> Image.Image:
    """Open and fully decode an image as RGB; a missing or unreadable file is a DataError naming it."""
    path = str(path)
    if not os.path.exists(path):
        raise DataError(f"image {path} does not exist")
    if os.path.isdir(path):
        raise DataError(f"image {path} is a directory, not an image file")
    try:
        with Image.open(path) as im:
            im.load()
            return im.convert("RGB")
    except (UnidentifiedImageError, ImportError):
        # ImportError: format plugins that other libraries patch into Image.open (ultralytics adds
        # a HEIF fallback) fail that way on bytes no reader recognises.
        raise DataError(f"image {path} is not an image Pillow can read (corrupt or another file type)") from None
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as exc:
        raise DataError(f"image {path} is corrupt or truncated: {exc}") from None


def _letterbox_geometry(h: int, w: int, out_h: int, out_w: int) -> tuple[int, int, int, int]:
    """(new_h, new_w, top, left) exactly as Ultralytics' LetterBox(auto=False, center=True)."""
    r = min(out_h / h, out_w / w)
    new_w, new_h = round(w * r), round(h * r)
    dw, dh = (out_w - new_w) / 2, (out_h - new_h) / 2
    top, left = round(dh - 0.1), round(dw - 0.1)
    return new_h, new_w, top, left


@dataclass(frozen=True)
class Placement:
    """Where an h×w image lands in the network input: resized to `resized` (H, W), its top-left
    corner at `pad` (top, left) of an `input_size` canvas."""
    resized: tuple[int, int]
    pad: tuple[int, int]
    input_size: tuple[int, int]

    def meta(self, path: str, orig_size: tuple[int, int]) -> ImageMeta:
        (new_h, new_w), (h, w) = self.resized, orig_size
        return ImageMeta(path=path, orig_size=(h, w), scale=(new_h / h, new_w / w), pad=self.pad,
                         input_size=self.input_size)


def _shorter_side_crop_geometry(h: int, w: int, shorter: int, crop_h: int, crop_w: int) -> tuple[int, int, int, int]:
    """(new_h, new_w, top, left) as torchvision's Resize(shorter) then CenterCrop((crop_h, crop_w)):
    the longer side truncated (`int(shorter * long / short)`), the crop's corner rounded half to
    even (`int(round((new - crop) / 2))`); top and left are the crop's offset inside the resized image.
    The crop always fits: both resized sides are at least `shorter`, which the spec keeps ≥ the crop."""
    if h <= w:
        new_h, new_w = shorter, int(shorter * w / h)
    else:
        new_h, new_w = int(shorter * h / w), shorter
    return new_h, new_w, int(round((new_h - crop_h) / 2.0)), int(round((new_w - crop_w) / 2.0))


def placement(h: int, w: int, spec: PreprocessSpec) -> Placement:
    """The spec's geometry for one h×w image; the CPU and GPU preprocessing both follow it. A centre
    crop is a placement with a negative pad: the resized image's corner lies above and left of the
    input's, and what falls outside the input is dropped."""
    if spec.resize == "crop":
        new_h, new_w, top, left = _shorter_side_crop_geometry(h, w, spec.shorter_side, *spec.size)
        return Placement((new_h, new_w), (-top, -left), spec.size)
    if spec.resize == "letterbox":
        new_h, new_w, top, left = _letterbox_geometry(h, w, *spec.size)
        return Placement((new_h, new_w), (top, left), spec.size)
    if spec.resize == "resize":
        return Placement(spec.size, (0, 0), spec.size)
    return Placement((h, w), (0, 0), (h, w))


def import_cv2():
    """OpenCV, for `resampler=cv2` only: it is not a dependency of sartor."""
    try:
        import cv2
    except ImportError as exc:
        raise MissingDependencyError(f"preprocess resampler=cv2 needs OpenCV, which does not import here ({exc}): "
                                     f"pip install opencv-python-headless") from None
    return cv2


def resize_pixels(pixels: np.ndarray, w: int, h: int, resampler: str) -> np.ndarray:
    """An H×W×3 uint8 array resized to h×w by the spec's resampler: Pillow's bilinear (antialiased
    when shrinking) or cv2.resize with INTER_LINEAR, the call Ultralytics' LetterBox makes."""
    if pixels.shape[:2] == (h, w):
        return pixels
    if resampler == "cv2":
        cv2 = import_cv2()
        return cv2.resize(np.ascontiguousarray(pixels), (w, h), interpolation=cv2.INTER_LINEAR)
    return np.asarray(Image.fromarray(np.ascontiguousarray(pixels)).resize((w, h), Image.Resampling.BILINEAR))


def _resize(image: Image.Image, w: int, h: int, resampler: str = "pillow") -> np.ndarray:
    if resampler == "cv2":
        return resize_pixels(np.asarray(image), w, h, resampler)
    if image.size == (w, h):
        return np.asarray(image)
    return np.asarray(image.resize((w, h), Image.Resampling.BILINEAR))


def preprocess_image(image: Image.Image | np.ndarray | str | os.PathLike,
                     spec: PreprocessSpec, path: str | None = None) -> tuple[np.ndarray, ImageMeta]:
    """One image (PIL RGB, an H×W×3 uint8 RGB array, or a path) → (array without batch dim, ImageMeta)."""
    if isinstance(image, (str, os.PathLike)):
        path = str(image) if path is None else path
        image = load_image(image)
    elif isinstance(image, np.ndarray):
        if image.ndim != 3 or image.shape[2] != 3:
            raise DataError(f"image array of shape {image.shape} is not H×W×3 RGB")
        image = Image.fromarray(np.ascontiguousarray(image.astype(np.uint8, copy=False)))
    elif image.mode != "RGB":
        image = image.convert("RGB")
    path = path if path is not None else (getattr(image, "filename", "") or "<image>")
    w, h = image.size
    place = placement(h, w, spec)
    (new_h, new_w), (top, left) = place.resized, place.pad
    if spec.resize == "letterbox":
        out_h, out_w = spec.size
        pixels = np.full((out_h, out_w, 3), spec.pad_value, dtype=np.uint8)
        pixels[top:top + new_h, left:left + new_w] = _resize(image, new_w, new_h, spec.resampler)
    elif spec.resize == "crop":
        out_h, out_w = spec.size
        pixels = _resize(image, new_w, new_h, spec.resampler)[-top:-top + out_h, -left:-left + out_w]
    else:
        pixels = _resize(image, new_w, new_h, spec.resampler)
    if spec.channels == "bgr":
        pixels = pixels[..., ::-1]
    array = _normalize(pixels, spec)
    if spec.layout == "nchw":
        array = array.transpose(2, 0, 1)
    return np.ascontiguousarray(array), place.meta(str(path), (h, w))


def _normalize(pixels: np.ndarray, spec: PreprocessSpec) -> np.ndarray:
    identity = spec.mean == (0.0, 0.0, 0.0) and spec.std == (1.0, 1.0, 1.0)
    if spec.dtype == "uint8" and identity:
        return pixels.astype(np.uint8, copy=True)
    x = pixels.astype(np.float32)
    if not identity:
        x = (x - np.asarray(spec.mean, np.float32)) / np.asarray(spec.std, np.float32)
    if spec.dtype == "uint8":
        return np.clip(np.rint(x), 0, 255).astype(np.uint8)
    return x.astype(np.float16) if spec.dtype == "float16" else x


def preprocess_batch(items: Sequence[Image.Image | np.ndarray | str | os.PathLike],
                     spec: PreprocessSpec) -> tuple[np.ndarray, list[ImageMeta]]:
    """Several images → (batch array N×…, one ImageMeta each). With resize "none" they must share a size."""
    if not len(items):
        raise DataError("preprocess_batch got no images")
    arrays, metas = [], []
    for item in items:
        array, meta = preprocess_image(item, spec)
        arrays.append(array)
        metas.append(meta)
    shapes = {a.shape for a in arrays}
    if len(shapes) > 1:
        sizes = ", ".join(f"{m.path} {m.orig_size[0]}x{m.orig_size[1]}" for m in metas[:5])
        raise DataError(f"images of different sizes cannot share a batch with preprocess "
                        f"{spec.describe()!r} ({sizes}): use letterbox= or resize=")
    return np.stack(arrays), metas
