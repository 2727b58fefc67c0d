"""The NVDEC reading loop (`video_nvdec.py`) against a stand-in for PyNvVideoCodec's SimpleDecoder
(the real one needs a GPU and runs in bench/video_h200.sh): every frame once, in order, named by
index and time; never a request past the decoder's frame count (each index past it is a warning
line on stdout, in `sartor bench --json`'s output); a decoder without a count read until it returns
nothing; a file it cannot open and a frame it cannot decode each one clear error."""
from __future__ import annotations

import sys
import types

import pytest
import torch

from sartor.pipeline import video_nvdec
from sartor.pipeline.video_nvdec import FRAMES_PER_CALL, nvdec_frames

GPU = torch.device("cuda:0")  # named only: the stand-in's frames are host tensors


class StandInDecoder:
    frames, rate, counted, fail_at, opened = 20, 10.0, True, None, True
    created: list = []  # every decoder opened, in order
    asks: list[int]

    def __init__(self, path, gpu_id, use_device_memory, output_color_type):
        if not self.opened:
            raise RuntimeError("cannot open the file")
        self.next, self.asks = 0, []
        StandInDecoder.last = self
        StandInDecoder.created.append(self)

    def get_stream_metadata(self):
        return types.SimpleNamespace(average_fps=self.rate)

    def __len__(self):
        if not self.counted:
            raise TypeError("no count")
        return self.frames

    def get_batch_frames(self, n):
        self.asks.append(n)
        if self.fail_at is not None and self.next + n > self.fail_at:
            raise RuntimeError("bitstream error")
        batch = [torch.full((2, 3, 3), i, dtype=torch.uint8) for i in range(self.next, min(self.next + n, self.frames))]
        self.next += len(batch)
        return batch


class StandInThreadedDecoder(StandInDecoder):
    """ThreadedDecoder's calls: a read-ahead buffer no request may exceed, and `end` to stop it."""

    def __init__(self, path, buffer_size, gpu_id, use_device_memory, output_color_type):
        super().__init__(path, gpu_id, use_device_memory, output_color_type)
        self.buffer_size, self.ended = buffer_size, False

    def get_batch_frames(self, n):
        assert n <= self.buffer_size and not self.ended
        return super().get_batch_frames(n)

    def end(self):
        self.ended = True


@pytest.fixture
def decoder(monkeypatch):
    class Decoder(StandInDecoder):
        pass

    class Threaded(StandInThreadedDecoder):
        pass
    monkeypatch.setitem(sys.modules, "PyNvVideoCodec", types.SimpleNamespace(
        SimpleDecoder=Decoder, ThreadedDecoder=Threaded, OutputColorType=types.SimpleNamespace(RGB="rgb")))
    Decoder.threaded = Threaded
    return Decoder


@pytest.mark.parametrize("read_ahead", [4, 32])
def test_read_ahead_reads_every_frame_within_its_buffer_and_ends_its_thread(decoder, monkeypatch, read_ahead):
    monkeypatch.setattr(video_nvdec, "READ_AHEAD_FRAMES", read_ahead)
    sources = list(nvdec_frames("clip.mp4", "clip.mp4", GPU))
    threaded = decoder.threaded.last
    assert [int(s.frame[0, 0, 0]) for s in sources] == list(range(20)) and threaded.ended
    assert max(threaded.asks) == min(read_ahead, FRAMES_PER_CALL)
    decoder.threaded.counted = decoder.counted = False  # no count: SimpleDecoder, which says when the file ends
    assert len(list(nvdec_frames("clip.mp4", "clip.mp4", GPU))) == 20
    ended, reader = StandInDecoder.created[-2:]
    assert isinstance(ended, decoder.threaded) and ended.ended and ended.asks == []
    assert type(reader) is decoder and sum(reader.asks) > 20
    decoder.threaded.counted = True
    early = nvdec_frames("clip.mp4", "clip.mp4", GPU)
    next(early)
    early.close()  # a caller that stops reading: the decoder's thread is ended all the same
    assert decoder.threaded.last.ended


@pytest.mark.parametrize("frames", [20, 16, 3, 1])
def test_every_frame_once_and_never_a_request_past_the_count(decoder, frames):
    decoder.frames = frames
    sources = list(nvdec_frames("clip.mp4", "clip.mp4", GPU))
    assert [int(s.frame[0, 0, 0]) for s in sources] == list(range(frames))
    assert sum(decoder.last.asks) == frames and all(0 < n <= FRAMES_PER_CALL for n in decoder.last.asks)
    assert all(s.error is None for s in sources)
    if frames:
        assert sources[-1].name == f"clip.mp4 frame {frames - 1} ({(frames - 1) / decoder.rate:.3f} s)"


@pytest.mark.parametrize("count", ["none", "zero"])  # zero: a container that records no count
def test_without_a_count_it_reads_until_the_decoder_returns_nothing(decoder, count):
    if count == "none":
        decoder.counted = False
    else:
        decoder.__len__ = lambda self: 0
    sources = list(nvdec_frames("clip.mp4", "clip.mp4", GPU))
    assert len(sources) == 20 and decoder.last.asks[-1] == FRAMES_PER_CALL and sum(decoder.last.asks) > 20


def test_a_file_it_cannot_open_and_a_frame_it_cannot_decode_are_one_error_each(decoder):
    decoder.opened = False
    (failed,) = nvdec_frames("clip.mp4", "clip.mp4", GPU)
    assert failed.error.startswith("video clip.mp4 is corrupt, truncated or not a video: cannot open")
    decoder.opened, decoder.fail_at = True, 12
    sources = list(nvdec_frames("clip.mp4", "clip.mp4", GPU))
    assert [s.error for s in sources[:-1]] == [None] * 8
    assert sources[-1].error == "video clip.mp4 is corrupt or truncated at frame 8: bitstream error"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="streams need CUDA")
def test_a_frame_written_on_another_threads_stream_is_read_once_it_is_whole():
    """A decoder thread's copy of its surface runs on that thread's stream; the pipeline reads it on
    its own, which does not follow that one: it waits for the frame's `ready` event."""
    from sartor.pipeline.decode import decode_frames
    from sartor.pipeline.sources import FrameSource

    device = torch.device("cuda")
    frame = torch.zeros(64, 64, 3, dtype=torch.uint8, device=device)
    writer = torch.cuda.Stream(device)
    writer.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(writer):
        torch.cuda._sleep(200_000_000)  # the copy still running when the reader starts
        frame.fill_(7)
    ready = torch.cuda.Event()
    ready.record(writer)
    reader = torch.cuda.Stream(device)
    with torch.cuda.stream(reader):
        (decoded,) = decode_frames([FrameSource("clip.mp4 frame 0", frame=frame, ready=ready)], device)
        seen = decoded.pixels.clone()
    reader.synchronize()
    assert (seen == 7).all()


def test_a_calls_frames_are_copied_off_the_decoders_surfaces_in_one_stack():
    """The decoder reuses its surfaces: each frame handed on is a copy, whichever way it was made
    (one stack for frames of one shape, a clone each where a call's frames differ in size)."""
    same = [torch.full((2, 3, 3), i, dtype=torch.uint8) for i in range(3)]
    mixed = [torch.full((2, 3, 3), 1, dtype=torch.uint8), torch.full((4, 5, 3), 2, dtype=torch.uint8)]
    for surfaces in (same, mixed):
        copies = video_nvdec.copied_frames(surfaces)
        for surface in surfaces:
            surface.fill_(255)
        assert [c.shape for c in copies] == [s.shape for s in surfaces]
        assert all(bool((c == k).all()) for c, k in zip(copies, ([0, 1, 2] if surfaces is same else [1, 2])))
