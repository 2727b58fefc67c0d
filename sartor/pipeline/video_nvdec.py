"""NVDEC decoding of video files through PyNvVideoCodec (2.x `SimpleDecoder`): frames come out as
interleaved RGB in device memory and reach torch through DLPack without a copy to the host.

The CPU test suite runs this loop against a stand-in for PyNvVideoCodec's decoder
(tests/pipeline/test_video_nvdec.py); the PyAV path in `video.py` is the tested default, and the
two are checked against each other on the GPU machine."""
from __future__ import annotations

from collections.abc import Iterator

import torch

from .sources import FrameSource, frame_name

FRAMES_PER_CALL = 8  # frames asked of the decoder at a time: NVDEC works on several surfaces at once
# Frames PyNvVideoCodec's ThreadedDecoder decodes ahead on a thread of its own; 0: SimpleDecoder,
# which decodes in the calling thread. 0: read-ahead shortened the first pass but not the steady
# rate over 8 streams, and 32 of them ran out of device memory inside PyNvVideoCodec, which aborts the
# process (bench/nvdec_read_ahead.py; BENCHMARKS.md).
READ_AHEAD_FRAMES = 0


def nvdec_frames(path: str, label: str, device: torch.device) -> Iterator[FrameSource]:
    import PyNvVideoCodec as nvc

    gpu = device.index if device.index is not None else torch.cuda.current_device()
    read_ahead = READ_AHEAD_FRAMES
    try:
        if read_ahead:
            decoder = nvc.ThreadedDecoder(path, read_ahead, gpu_id=gpu, use_device_memory=True,
                                          output_color_type=nvc.OutputColorType.RGB)
            total = _frame_count(decoder)
            if not total:
                # Read-ahead is read up to the file's frame count, never past it: without one, the
                # decoder that says when the file ends.
                decoder.end()
                read_ahead = 0
        if not read_ahead:
            decoder = nvc.SimpleDecoder(path, gpu_id=gpu, use_device_memory=True,
                                        output_color_type=nvc.OutputColorType.RGB)
            total = _frame_count(decoder)
        rate = float(decoder.get_stream_metadata().average_fps or 0) or None
    except Exception as exc:  # noqa: BLE001 - PyNvVideoCodec raises plain exceptions for unreadable files
        yield FrameSource(label, error=f"video {label} is corrupt, truncated or not a video: {exc}")
        return
    try:
        yield from _frames(decoder, label, rate, total, min(FRAMES_PER_CALL, read_ahead or FRAMES_PER_CALL))
    finally:
        if read_ahead:
            decoder.end()  # stops its thread, also when the caller stops reading early


def _frame_count(decoder) -> int | None:
    """The frame count the decoder checks its indices against; None where the container records
    none (PyNvVideoCodec says 0)."""
    try:
        return len(decoder) or None
    except Exception:  # noqa: BLE001 - no count: read until the decoder returns nothing
        return None


def _frames(decoder, label: str, rate: float | None, total: int | None, per_call: int) -> Iterator[FrameSource]:
    index = 0
    while True:
        # Never past the count: the decoder prints a warning line to stdout for each index past
        # it, into the output of `sartor bench --json`.
        wanted = per_call if total is None else min(per_call, total - index)
        if wanted <= 0:
            return
        try:
            batch = decoder.get_batch_frames(wanted)
        except Exception as exc:  # noqa: BLE001 - as above, for a frame that fails
            yield FrameSource(frame_name(label, index, None),
                              error=f"video {label} is corrupt or truncated at frame {index}: {exc}")
            return
        if not batch:
            return
        # The decoder reuses its surfaces: keep copies on the device, not views of them. They are
        # made on this thread's stream, which the pipeline's streams do not follow: it waits for `ready`.
        copies = copied_frames(batch)  # H×W×3 uint8 (interleaved RGB)
        ready = None
        if copies[0].is_cuda:
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(copies[0].device))
        for pixels in copies:
            yield FrameSource(frame_name(label, index, index / rate if rate else None), frame=pixels, ready=ready)
            index += 1


def copied_frames(batch: list) -> list[torch.Tensor]:
    """Device copies of a call's decoded frames, made by one torch call where they share a shape.
    Every torch call releases the GIL and must take it back, which beside a thread running Python
    waits up to the switch interval; a clone a frame paid that wait a frame (decoder threads beside
    a busy Python thread: bench/nvdec_decode_only.py --gil-probe, figures in BENCHMARKS.md)."""
    views = [torch.from_dlpack(frame) for frame in batch]
    if all(v.shape == views[0].shape for v in views):
        return list(torch.stack(views).unbind(0))
    return [v.clone() for v in views]  # a resolution change inside the call
