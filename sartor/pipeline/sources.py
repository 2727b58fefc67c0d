"""What a pipeline accepts, sorted into encoded bytes and raw frames, each with a name for errors.

Items: a path (str or os.PathLike) or the bytes of a JPEG/PNG/other image file (bytes, bytearray,
memoryview, or a 1-D uint8 numpy array or tensor) — *encoded*; an H×W×3 uint8 numpy array or torch
tensor, on the host or a device — a *raw frame*, in the channel order the pipeline is told
(`frame_order`, RGB unless said); or a FrameSource already made (a video's frames, `video.py`),
taken as it is. A path that cannot be read is a failed item, not an exception:
the rest of the batch still runs (see `Pipeline`)."""
from __future__ import annotations

import os
import stat
from dataclasses import dataclass, field

import numpy as np
import torch

from ..errors import ConfigError

FRAME_ORDERS = ("rgb", "bgr")
JPEG_MAGIC = b"\xff\xd8\xff"
JPEG_END = b"\xff\xd9"
# nvJPEG decodes a truncated file without an error (its missing rows come out grey), so a JPEG
# for the GPU must hold its end-of-image marker: at the end, or followed by a little padding.
JPEG_END_SEARCH_BYTES = 1024


def jpeg_marks(data) -> tuple[bool, bool]:
    """(starts with JPEG's marker, holds its end-of-image marker near the end) of encoded bytes:
    any buffer, e.g. a bytearray or a 1-D uint8 numpy array."""
    with memoryview(data) as view:  # raw bytes compared (tobytes), whatever the buffer's item format
        ends = view[-len(JPEG_END):].tobytes() == JPEG_END  # most files: no copy of the tail to search
        return (view[:len(JPEG_MAGIC)].tobytes() == JPEG_MAGIC,
                ends or JPEG_END in view[-JPEG_END_SEARCH_BYTES:].tobytes())


@dataclass
class FrameSource:
    """One item: `encoded` (a 1-D uint8 CPU tensor of file bytes) or `frame` (an H×W×3 uint8 tensor,
    RGB after `read_sources`), or `error` when it could not be read. `ready`: for a frame written on
    the device by another thread (a video decoder's), the event after which it is whole; a reader
    on another stream waits for it."""
    name: str
    encoded: torch.Tensor | None = None
    frame: torch.Tensor | None = None
    error: str | None = None
    ready: torch.cuda.Event | None = None
    # `jpeg_marks` of `encoded`: looked at where the file is read (a thread that reads ahead), so
    # that the thread handing batches to the decoder does not; None until looked at.
    marks: tuple[bool, bool] | None = field(default=None, repr=False)

    def jpeg_marks(self) -> tuple[bool, bool]:
        """(a JPEG, with its end-of-image marker) for `encoded`; see `jpeg_marks`."""
        if self.marks is None:
            self.marks = jpeg_marks(self.encoded.numpy())
        return self.marks


def frame_name(label: str, index: int, seconds: float | None) -> str:
    """A video frame's name: `clip.mp4 frame 12 (0.400 s)`, without the time when it is unknown."""
    return f"{label} frame {index}" + (f" ({seconds:.3f} s)" if seconds is not None else "")


def _read_file(path) -> np.ndarray:
    """The file's bytes as a 1-D uint8 array, read straight into it. Four system calls a file (open,
    fstat, readv, close): each releases Python's interpreter lock, and a thread back from one waits
    for it while the pipeline's other threads run Python, so `open()`'s buffered file and its extra
    calls (lseek, fstat, the read at the end) cost more than the bytes. The array is not zeroed
    first: its fresh pages are then first touched by the read, with the lock released, not by a
    fill with the lock held."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    try:
        status = os.fstat(fd)
        data = np.empty(status.st_size + 1, np.uint8)  # a byte over: a file that grew since fstat fills it
        filled = os.readv(fd, [data])  # a regular file comes whole in one read, short only at its end
        if filled > status.st_size or not stat.S_ISREG(status.st_mode):  # grown, or a pipe: on to its end
            pieces = [data[:filled]]
            while chunk := os.read(fd, 1 << 20):
                pieces.append(np.frombuffer(chunk, np.uint8))
            return np.concatenate(pieces)
    finally:
        os.close(fd)
    return data[:filled]


def read_source(item, index: int, frame_order: str = "rgb") -> FrameSource:
    """One item as a FrameSource; names are the path, else `item N` (N from 0)."""
    if frame_order not in FRAME_ORDERS:
        raise ConfigError(f"frame order {frame_order!r} is not one of {', '.join(FRAME_ORDERS)}")
    if isinstance(item, FrameSource):
        return item  # named and in RGB already (a video's frame)
    if isinstance(item, (str, os.PathLike)):
        name = str(item)
        try:
            data = _read_file(item)
        except IsADirectoryError:
            return FrameSource(name, error=f"image {name} is a directory, not an image file")
        except OSError as exc:
            return FrameSource(name, error=f"image {name} cannot be read: {exc.strerror or exc}")
        if not len(data):
            return FrameSource(name, error=f"image {name} is empty")
        return FrameSource(name, encoded=torch.from_numpy(data), marks=jpeg_marks(data))
    name = f"item {index}"
    if isinstance(item, (bytes, bytearray, memoryview)):
        if not len(item):
            return FrameSource(name, error=f"{name} is empty bytes")
        data = bytearray(item)
        return FrameSource(name, encoded=torch.frombuffer(data, dtype=torch.uint8), marks=jpeg_marks(data))
    if isinstance(item, np.ndarray):
        item = torch.from_numpy(np.ascontiguousarray(item))
    if isinstance(item, torch.Tensor):
        if item.dtype != torch.uint8:
            return FrameSource(name, error=f"{name} is a {item.dtype} tensor; frames are uint8")
        if item.dim() == 1:
            if item.device.type != "cpu":
                return FrameSource(name, error=f"{name}: encoded bytes must be in host memory")
            if not item.numel():
                return FrameSource(name, error=f"{name} is empty bytes")
            return FrameSource(name, encoded=item.contiguous())
        if item.dim() != 3 or item.shape[2] != 3 or min(item.shape[:2]) < 1:
            return FrameSource(name, error=f"{name} of shape {tuple(item.shape)} is not an H×W×3 frame")
        return FrameSource(name, frame=item.flip(-1) if frame_order == "bgr" else item)
    return FrameSource(name, error=f"{name} is a {type(item).__name__}: expected a path, image bytes or "
                                   f"an H×W×3 uint8 array")


def read_sources(items, frame_order: str = "rgb", first_index: int = 0) -> list[FrameSource]:
    """FrameSources of `items`, named from `item {first_index}` on where they have no path."""
    return [read_source(item, first_index + i, frame_order) for i, item in enumerate(items)]
