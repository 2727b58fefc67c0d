"""The host decode pool's page-locked buffers (`pinned_slots.py`): a buffer is handed out again only
once the upload that read it has finished, never while taken or in flight; frames that grow get a
buffer that fits; past the limit a frame gets memory of its own; and the pool's frames lie in them.
Without a GPU the buffers are pageable and the events are stand-ins whose completion the test sets."""
from __future__ import annotations

import io

import pytest
import torch
from PIL import Image

from sartor.data.preprocess import parse_preprocess
from sartor.pipeline import read_sources
from sartor.pipeline.decode import _pinned_host_frame, _uploaded, decode_on_host
from sartor.pipeline.pinned_slots import ROUND_BYTES, PinnedSlots

skimage_data = pytest.importorskip("skimage.data")
SPEC = parse_preprocess("letterbox=640,mean=0,std=255,rgb,nchw")


class StandInEvent:
    """A CUDA event's two calls, with its completion set by the test."""
    done = False

    def record(self, stream=None) -> None:
        self.recorded = True

    def query(self) -> bool:
        return self.done


def slots(max_slots: int = 4) -> PinnedSlots:
    return PinnedSlots(max_slots, pin_memory=False, new_event=StandInEvent)


def test_a_buffer_comes_back_only_once_its_upload_has_run():
    pool = slots()
    first, slot = pool.take((360, 640, 3))
    assert slot.buffer.numel() == ROUND_BYTES and tuple(first.shape) == (360, 640, 3)
    second, other = pool.take((360, 640, 3))
    assert other is not slot and len(pool) == 2  # taken: never handed out twice
    slot.uploaded()  # the copy is queued, not yet run
    third, another = pool.take((360, 640, 3))
    assert another not in (slot, other)
    slot.event.done = True
    again, same = pool.take((360, 640, 3))
    assert same is slot and again.data_ptr() == first.data_ptr() and len(pool) == 3


def test_a_released_buffer_is_free_at_once():
    pool = slots()
    _, slot = pool.take((10, 10, 3))
    slot.release()
    assert pool.take((10, 10, 3))[1] is slot


def test_past_the_limit_a_frame_gets_memory_of_its_own_and_a_free_small_buffer_gives_way():
    pool = slots(max_slots=2)
    _, a = pool.take((10, 10, 3))
    _, b = pool.take((10, 10, 3))
    own, none = pool.take((10, 10, 3))
    assert none is None and tuple(own.shape) == (10, 10, 3) and len(pool) == 2
    a.release()
    big, c = pool.take((1000, 1000, 3))  # a is free but too small: replaced by one that fits
    assert c is not a and c.buffer.numel() >= 3_000_000 and len(pool) == 2 and b in pool._slots


def jpeg() -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(skimage_data.astronaut()).resize((1280, 720)).save(buffer, "JPEG", quality=90)
    return buffer.getvalue()


@pytest.mark.parametrize("simplejpeg", [True, False])
def test_the_pools_frames_lie_in_the_buffers_until_uploaded(monkeypatch, simplejpeg):
    if not simplejpeg:  # Pillow decodes, and the frame is copied into the buffer
        from sartor.pipeline import turbo_jpeg
        monkeypatch.setattr(turbo_jpeg, "simplejpeg", None)
    pool = slots()
    frame = _pinned_host_frame(read_sources([jpeg()])[0], SPEC, True, pool)
    assert frame.pinned is not None and frame.pinned.taken and len(pool) == 1
    assert frame.pixels.data_ptr() == frame.pinned.buffer.data_ptr()
    assert torch.equal(frame.pixels, decode_on_host(jpeg(), SPEC, fast=True)[0])
    slot = frame.pinned
    _uploaded(frame, torch.device("cpu"))
    assert frame.pinned is None and not slot.taken and slot.event.recorded


def test_a_failed_frame_leaves_its_buffer_free():
    pool = slots()
    frame = _pinned_host_frame(read_sources([jpeg()[:400]])[0], SPEC, True, pool)
    assert frame.error is not None and frame.pinned is None
    assert all(s.free() for s in pool._slots)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="page-locked memory needs CUDA")
def test_on_a_gpu_the_buffers_are_page_locked_and_free_after_the_upload_ran():
    pool = PinnedSlots()
    frame = _pinned_host_frame(read_sources([jpeg()])[0], SPEC, True, pool)
    slot = frame.pinned
    assert frame.pixels.is_pinned()
    uploaded = _uploaded(frame, torch.device("cuda"))
    torch.cuda.synchronize()
    assert slot.free() and torch.equal(uploaded.pixels.cpu(), decode_on_host(jpeg(), SPEC, fast=True)[0])
