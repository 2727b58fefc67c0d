"""Video files (H.264/H.265 in MP4 and other containers) as a pipeline source: `VideoSource(path)`
yields one FrameSource per decoded frame, named `<file> frame <index> (<seconds> s)`, an H×W×3 uint8
RGB frame.

Decoders: PyAV (FFmpeg's software decoders on the CPU, on FFmpeg's own threads) is the default and
the tested path; NVDEC through PyNvVideoCodec when that package is importable and the engine is a
CUDA engine (`video_nvdec.py`, frames decoded straight into device memory). A file that cannot be
opened, or that is corrupt or truncated part way, ends its frames with one failed FrameSource naming
the file and the frame: the frames decoded before it are still yielded and run, and the pipeline's
`skip_bad` decides about the failure as for an image (docs/decisions/0030-video-sources.md)."""
from __future__ import annotations

import os
from collections.abc import Iterator

import torch

from ..errors import ConfigError
from .sources import FrameSource, frame_name

VIDEO_SUFFIXES = (".mp4", ".m4v", ".mov", ".mkv", ".webm", ".avi", ".ts", ".h264", ".264", ".h265", ".265", ".hevc")
VIDEO_DECODERS = ("auto", "pyav", "nvdec")


def is_video_path(item) -> bool:
    return isinstance(item, (str, os.PathLike)) and os.fspath(item).lower().endswith(VIDEO_SUFFIXES)


def pyav():
    """PyAV, imported on first use: only video sources need it."""
    try:
        import av
    except ImportError as exc:
        raise ConfigError(f"decoding video needs PyAV ({exc}): pip install 'sartor[video]'") from None
    return av


def nvdec_available() -> bool:
    try:
        import PyNvVideoCodec  # noqa: F401
    except ImportError:
        return False
    return True


def choose_video_decoder(decoder: str, device) -> str:
    """'pyav' or 'nvdec' for `decoder` ('auto': NVDEC for a CUDA engine when PyNvVideoCodec is there)."""
    if decoder not in VIDEO_DECODERS:
        raise ConfigError(f"video decoder {decoder!r} is not one of {', '.join(VIDEO_DECODERS)}")
    on_cuda = torch.device(device).type == "cuda"
    if decoder == "nvdec":
        if not on_cuda:
            raise ConfigError(f"video decoder 'nvdec' decodes into GPU memory: the engine's device is {device}")
        if not nvdec_available():
            raise ConfigError("video decoder 'nvdec' needs PyNvVideoCodec: pip install PyNvVideoCodec")
        return "nvdec"
    if decoder == "auto" and on_cuda and nvdec_available():
        return "nvdec"
    pyav()  # refuse now, not on a decoder thread, when PyAV is missing
    return "pyav"


def _reason(exc: BaseException) -> str:
    """FFmpeg's message without its errno and call site ('Invalid data found when processing input')."""
    text = getattr(exc, "strerror", None) or str(exc) or type(exc).__name__
    return " ".join(str(text).split())


class VideoSource:
    """The frames of one video file, in order, as FrameSources (RGB, on the host for PyAV, on the
    engine's device for NVDEC). `name` labels the frames (default: the path); `threads` is FFmpeg's
    decoder threads (0: as many as it likes)."""

    def __init__(self, path, *, device="cpu", decoder: str = "auto", name: str | None = None,
                 threads: int = 0) -> None:
        self.path = os.fspath(path)
        self.label = name or self.path
        self.device = torch.device(device)
        self.decoder = choose_video_decoder(decoder, self.device)
        self.threads = threads

    def __iter__(self) -> Iterator[FrameSource]:
        if not os.path.isfile(self.path):
            why = "is a directory, not a video file" if os.path.isdir(self.path) else "does not exist"
            yield FrameSource(self.label, error=f"video {self.label} {why}")
            return
        if self.decoder == "nvdec":
            from .video_nvdec import nvdec_frames
            yield from nvdec_frames(self.path, self.label, self.device)
        else:
            yield from self._pyav_frames()

    def _pyav_frames(self) -> Iterator[FrameSource]:
        av = pyav()
        try:
            container = av.open(self.path)
        except (av.FFmpegError, OSError) as exc:
            yield FrameSource(self.label, error=f"video {self.label} is corrupt, truncated or not a video: "
                                                f"{_reason(exc)}")
            return
        with container:
            if not container.streams.video:
                yield FrameSource(self.label, error=f"video {self.label} has no video stream (not a video, or "
                                                    f"truncated before its index)")
                return
            stream = container.streams.video[0]
            stream.thread_type = "AUTO"  # frame and slice threads: one decoder uses several cores
            stream.thread_count = self.threads
            listed, index = stream.frames, 0
            try:
                for frame in container.decode(stream):
                    pixels = torch.from_numpy(frame.to_ndarray(format="rgb24"))
                    yield FrameSource(frame_name(self.label, index, frame.time), frame=pixels)
                    index += 1
            except av.FFmpegError as exc:
                yield FrameSource(frame_name(self.label, index, None),
                                  error=f"video {self.label} is corrupt or truncated at frame {index}: {_reason(exc)}")
                return
            # An MP4 cut short can keep its whole index: the demuxer then stops early without an error.
            if listed and index < listed:
                yield FrameSource(frame_name(self.label, index, None),
                                  error=f"video {self.label} is truncated at frame {index}: its index lists "
                                        f"{listed} frames")
