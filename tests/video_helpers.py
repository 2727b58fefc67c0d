"""Small video clips encoded in the test's own temp folder with PyAV (libx264/libx265 ship in its
wheels), from smooth synthetic frames that survive 4:2:0 chroma closely. Not a test module."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

av = pytest.importorskip("av")

WIDTH, HEIGHT, FPS = 64, 48, 30


def clip_frames(count: int, height: int = HEIGHT, width: int = WIDTH) -> list[np.ndarray]:
    """Gradients that move by a few levels a frame: every frame differs, nothing is sharp."""
    y, x = np.mgrid[0:height, 0:width].astype(np.float64)
    frames = []
    for i in range(count):
        r = 40 + 150 * x / width + 2 * i
        g = 60 + 120 * y / height
        b = 200 - 100 * (x + y) / (width + height) - i
        frames.append(np.clip(np.stack([r, g, b], -1), 0, 255).round().astype(np.uint8))
    return frames


def write_clip(path: Path, frames: list[np.ndarray], codec: str = "libx264", faststart: bool = False) -> Path:
    """`frames` (H×W×3 RGB) encoded as an MP4 at FPS; `faststart` puts the index first, so a
    truncated copy still opens and lists every frame."""
    with av.open(str(path), "w", options={"movflags": "faststart"} if faststart else {}) as out:
        stream = out.add_stream(codec, rate=FPS)
        stream.width, stream.height, stream.pix_fmt = frames[0].shape[1], frames[0].shape[0], "yuv420p"
        stream.options = {"crf": "12", "x265-params": "log-level=error"} if codec == "libx265" else {"crf": "12"}
        for pixels in frames:
            for packet in stream.encode(av.VideoFrame.from_ndarray(pixels, format="rgb24")):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    return path


def truncated_copy(clip: Path, target: Path, fraction: float) -> Path:
    data = clip.read_bytes()
    target.write_bytes(data[:int(len(data) * fraction)])
    return target


def write_audio_only(path: Path) -> Path:
    """An MP4 holding one second of silence and no video stream."""
    with av.open(str(path), "w") as out:
        stream = out.add_stream("aac", rate=8000)
        frame = av.AudioFrame.from_ndarray(np.zeros((1, 8000), dtype=np.float32), format="fltp", layout="mono")
        frame.sample_rate = 8000
        for packet in stream.encode(frame):
            out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    return path
