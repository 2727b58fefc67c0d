"""Encoded images to uint8 RGB frames on the device that preprocesses them.

On CUDA, JPEGs go to nvJPEG in one batched call (`torchvision.io.decode_jpeg(..., device="cuda")`);
when that call fails, each JPEG is decoded alone, so one corrupt file fails only itself. Other
formats, and everything for a CPU engine, are decoded by libjpeg-turbo / libpng through
`torchvision.io.decode_image`, which gives the same pixels as Pillow for the same file (EXIF
orientation is not applied, as in `sartor.data.preprocess`)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import ConfigError
from .sources import FrameSource

JPEG_MAGIC = b"\xff\xd8\xff"
JPEG_END = b"\xff\xd9"
# nvJPEG decodes a truncated file without an error (its missing rows come out grey), so a JPEG
# for the GPU must hold its end-of-image marker: at the end, or followed by a little padding.
JPEG_END_SEARCH_BYTES = 1024


@dataclass
class DecodedFrame:
    """An item after decoding: `pixels` is 3×H×W uint8 RGB on the target device (channels first, the
    layout torch's resize reads; possibly a non-contiguous view), or None with `error` set."""
    name: str
    pixels: torch.Tensor | None
    error: str | None = None


def _is_jpeg(encoded: torch.Tensor) -> bool:
    return bytes(encoded[:3].tolist()) == JPEG_MAGIC


def _has_jpeg_end(encoded: torch.Tensor) -> bool:
    return JPEG_END in encoded[-JPEG_END_SEARCH_BYTES:].numpy().tobytes()


def _image_io():
    """torchvision.io, imported on first use: running engines needs no torchvision, decoding does."""
    try:
        import torchvision.io
    except ImportError as exc:
        raise ConfigError(f"decoding images needs torchvision ({exc}): pip install torchvision matching your "
                          f"torch, or pass decoded H×W×3 uint8 frames") from None
    return torchvision.io


def _decode_on_host(source: FrameSource) -> torch.Tensor:
    io = _image_io()
    return io.decode_image(source.encoded, mode=io.ImageReadMode.RGB, apply_exif_orientation=False)


def _failure(source: FrameSource, exc: Exception) -> DecodedFrame:
    reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return DecodedFrame(source.name, None, f"image {source.name} is corrupt, truncated or not an image: {reason}")


def decode_frames(sources: list[FrameSource], device: torch.device) -> list[DecodedFrame]:
    """One DecodedFrame per source, in order; failures carry their reason and never raise."""
    device = torch.device(device)
    decoded: list[DecodedFrame | None] = [None] * len(sources)
    gpu_jpegs = []
    for i, source in enumerate(sources):
        if source.error is not None:
            decoded[i] = DecodedFrame(source.name, None, source.error)
        elif source.frame is not None:
            decoded[i] = DecodedFrame(source.name, source.frame.to(device, non_blocking=True).permute(2, 0, 1))
        elif device.type == "cuda" and _is_jpeg(source.encoded):
            if _has_jpeg_end(source.encoded):
                gpu_jpegs.append(i)
            else:
                decoded[i] = DecodedFrame(source.name, None, f"image {source.name} is corrupt, truncated or not an "
                                                             f"image: no JPEG end-of-image marker (truncated)")
        else:
            try:
                decoded[i] = DecodedFrame(source.name, _decode_on_host(source).to(device, non_blocking=True))
            except RuntimeError as exc:
                decoded[i] = _failure(source, exc)
    if gpu_jpegs:
        _decode_jpegs_on_gpu([sources[i] for i in gpu_jpegs], device, gpu_jpegs, decoded)
    return decoded


def _decode_jpegs_on_gpu(sources: list[FrameSource], device: torch.device, slots: list[int],
                         decoded: list) -> None:
    io = _image_io()
    try:
        frames = io.decode_jpeg([s.encoded for s in sources], mode=io.ImageReadMode.RGB, device=device)
    except RuntimeError:
        frames = None  # one bad file fails the batched call: find it by decoding each alone
    for k, (slot, source) in enumerate(zip(slots, sources)):
        if frames is not None:
            decoded[slot] = DecodedFrame(source.name, frames[k])
            continue
        try:
            decoded[slot] = DecodedFrame(source.name, io.decode_jpeg(source.encoded, mode=io.ImageReadMode.RGB,
                                                                     device=device))
        except RuntimeError as exc:
            decoded[slot] = _failure(source, exc)
