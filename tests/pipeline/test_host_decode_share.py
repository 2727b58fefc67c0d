"""A share of each batch's JPEGs decoded on the host while nvJPEG decodes the rest (`host_decode_share`):
which frames go where, that host frames come out as the fast host path makes them and in order,
that one corrupt file fails alone, and the refusals. On the CPU, nvJPEG's place is taken by
torchvision's host JPEG decoder (the same call, on the host); on a GPU the real one runs."""
from __future__ import annotations

import io
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
from PIL import Image

import sartor
from sartor.data.preprocess import parse_preprocess
from sartor.errors import ConfigError
from sartor.pipeline import Pipeline, decode_frames, read_sources
from sartor.pipeline import decode as decode_module
from sartor.pipeline import pipeline as pipeline_module
from sartor.pipeline.benchmark import end_to_end
from sartor.pipeline.decode import _pinned_host_frame, decode_on_host, split_for_host
from sartor.pipeline.pinned_slots import PinnedSlots

skimage_data = pytest.importorskip("skimage.data")
torchvision_io = pytest.importorskip("torchvision.io")
SPEC = parse_preprocess("letterbox=640,mean=0,std=255,rgb,nchw")
PHOTOS = ("astronaut", "coffee", "rocket", "chelsea")


def frame_bytes(name: str) -> bytes:
    image = Image.fromarray(getattr(skimage_data, name)()).resize((1280, 720), Image.Resampling.BICUBIC)
    buffer = io.BytesIO()
    image.save(buffer, "JPEG", quality=90)
    return buffer.getvalue()


@pytest.mark.parametrize("jpegs,share,on_host", [
    ([0, 1, 2, 3], 0.0, []),
    ([0, 1, 2, 3], 0.25, [3]),
    ([0, 2, 5, 6, 7, 9], 0.5, [6, 7, 9]),  # slots of the batch's JPEGs, not 0..n-1
    ([0, 1, 2, 3, 4, 5, 6], 0.3, [5, 6]),  # round(2.1)
    ([0, 1, 2], 1.0, [0, 1, 2]),
    ([], 0.5, []),
])
def test_the_last_share_of_the_jpegs_goes_to_the_host(jpegs, share, on_host):
    gpu, host = split_for_host(jpegs, share)
    assert host == on_host and gpu + host == jpegs


@pytest.fixture
def host_standing_in_for_nvjpeg(monkeypatch):
    """decode_frames takes the CPU for a device nvJPEG decodes on, and nvJPEG's batched call is run by
    torchvision's host decoder; the calls it gets are recorded."""
    calls = []

    def decode_as_nvjpeg_would(sources, device, slots, decoded):
        calls.append(list(slots))
        frames = torchvision_io.decode_jpeg([s.encoded for s in sources], mode=torchvision_io.ImageReadMode.RGB)
        for slot, source, frame in zip(slots, sources, frames):
            decoded[slot] = decode_module.DecodedFrame(source.name, frame)

    monkeypatch.setattr(decode_module, "nvjpeg_decodes", lambda device: True)
    monkeypatch.setattr(decode_module, "_decode_jpegs_on_gpu", decode_as_nvjpeg_would)
    return calls


def test_host_frames_come_out_as_the_fast_host_path_makes_them_and_in_order(host_standing_in_for_nvjpeg):
    items = [frame_bytes(name) for name in PHOTOS]
    with ThreadPoolExecutor(2) as pool:
        decoded = decode_frames(read_sources(items), torch.device("cpu"), SPEC, True, 0.5, pool)
    assert host_standing_in_for_nvjpeg == [[0, 1]]
    assert [d.name for d in decoded] == [s.name for s in read_sources(items)]
    for d in decoded[:2]:  # nvJPEG's: full size
        assert tuple(d.pixels.shape) == (3, 720, 1280) and d.size == (720, 1280)
    for d, data in zip(decoded[2:], items[2:]):  # the host's: at the DCT scale the letterbox allows
        pixels, size = decode_on_host(data, SPEC, fast=True)
        assert torch.equal(d.pixels, pixels) and d.size == size == (720, 1280)


def test_a_corrupt_jpeg_in_the_host_share_fails_alone(host_standing_in_for_nvjpeg):
    items = [frame_bytes(name) for name in PHOTOS]
    items[3] = items[3][:600] + b"\xff\xd9"  # its headers, then the end-of-image marker: no scan data
    with ThreadPoolExecutor(2) as pool:
        decoded = decode_frames(read_sources(items), torch.device("cpu"), SPEC, True, 0.5, pool)
    assert [d.error is None for d in decoded] == [True, True, True, False]
    assert decoded[3].error.startswith(f"image {decoded[3].name} is corrupt, truncated or not an image")


def test_without_a_pool_or_a_share_nvjpeg_takes_every_jpeg(host_standing_in_for_nvjpeg):
    items = [frame_bytes(name) for name in PHOTOS[:2]]
    decode_frames(read_sources(items), torch.device("cpu"), SPEC, True, 0.5, None)
    with ThreadPoolExecutor(2) as pool:
        decode_frames(read_sources(items), torch.device("cpu"), SPEC, True, 0.0, pool)
    assert host_standing_in_for_nvjpeg == [[0, 1], [0, 1]]


def test_pipeline_refuses_a_share_or_thread_count_out_of_range_and_a_cpu_engine_needs_no_pool(letterbox_plan):
    engine = sartor.load(letterbox_plan, device="cpu")
    with pytest.raises(ConfigError, match="host_decode_share 1.5 must be between 0 and 1"):
        Pipeline(engine, host_decode_share=1.5)
    with pytest.raises(ConfigError, match="host_decode_threads 0 must be at least 1"):
        Pipeline(engine, host_decode_share=0.5, host_decode_threads=0)
    pipeline = Pipeline(engine, host_decode_share=0.5)  # the CPU decodes every frame on the host already
    assert pipeline.host_decode_share == 0.0 and pipeline.host_pool is None
    assert len(pipeline.run([frame_bytes("astronaut")])) == 1


@pytest.mark.parametrize("workers", [2, 3])  # a CPU engine's, and a CUDA engine's on its two decoders
def test_auto_times_every_share_and_keeps_the_fastest(host_standing_in_for_nvjpeg, letterbox_plan, monkeypatch,
                                                      workers):
    # Only the share that sends nvJPEG nothing (1) avoids its cost per call, so auto must keep 1.
    calls = host_standing_in_for_nvjpeg
    nvjpeg_pays_per_call(monkeypatch, 0.1)
    monkeypatch.setattr(pipeline_module, "HOST_PREPARE_AHEAD", workers)
    engine = sartor.load(letterbox_plan, device="cpu")
    with pytest.raises(ConfigError, match="host_decode_share 'half' must be between 0 and 1, or 'auto'"):
        Pipeline(engine, host_decode_share="half")
    pipeline = Pipeline(engine, batch_size=4, host_decode_share="auto", host_decode_threads=2)
    assert pipeline.host_share_chosen is None and pipeline.prepare_ahead == workers
    items = [small_frame_bytes(k) for k in range(4 * 32)]  # five candidates of five batches, and more
    results = pipeline.run(items)
    assert [r.name for r in results] == [s.name for s in read_sources(items)]
    assert all(r.error is None for r in results)
    assert pipeline.host_share_chosen == 1.0
    assert set(pipeline.host_share_search.medians_ms()) == {"0", "0.25", "0.5", "0.75", "1"}
    calls.clear()
    pipeline.run(items[:8])
    assert calls == []  # the chosen share sends nvJPEG nothing


def test_auto_without_overlap_times_each_batch_alone_so_one_frame_a_call_chooses_too(host_standing_in_for_nvjpeg,
                                                                                      letterbox_plan, monkeypatch):
    nvjpeg_pays_per_call(monkeypatch, 0.05)
    pipeline = Pipeline(sartor.load(letterbox_plan, device="cpu"), batch_size=1, overlap=False,
                        host_decode_share="auto", host_decode_threads=1)
    for k in range(16):  # a camera's frames one call at a time: every stream is one batch
        assert pipeline.run([small_frame_bytes(k)])[0].error is None
    assert pipeline.host_share_search.candidates == (0.0, 1.0)  # the only two ways to split one frame
    assert pipeline.host_share_chosen == 1.0


def test_the_end_to_end_bench_warms_up_until_auto_has_chosen(host_standing_in_for_nvjpeg, letterbox_plan,
                                                               monkeypatch, tmp_path):
    # Far above what a loaded machine's host (pytest-xdist on two cores) takes for a batch of small
    # frames: only share 1 avoids it.
    nvjpeg_pays_per_call(monkeypatch, 0.2)
    files = []
    # six batches a pass, of which a stream's first (the workers' batches in flight) are not timed:
    # the search spans several passes, all of them warm-up
    for k in range(24):
        files.append(tmp_path / f"frame{k:02d}.jpg")
        files[-1].write_bytes(small_frame_bytes(k))
    engine = sartor.load(letterbox_plan, device="cpu")
    result = end_to_end(engine, files, batch=4, passes=2, host_decode_share="auto", host_decode_threads=3)
    assert result.host_decode_share == "auto" and result.host_share_chosen == 1.0, result.host_share_ms_per_frame
    assert result.host_decode_threads == 3
    assert set(result.host_share_ms_per_frame) == {"0", "0.25", "0.5", "0.75", "1"}
    with pytest.raises(ConfigError, match="--host-decode-share auto: no share chosen after 21 passes over 1 images"):
        end_to_end(engine, files[:1], batch=4, passes=2, host_decode_share="auto")  # one batch a stream: never timed


def test_two_batches_are_decoded_at_once_and_their_results_come_back_in_order(host_standing_in_for_nvjpeg,
                                                                              letterbox_plan, monkeypatch):
    # nvJPEG's call holds its thread for most of a decode: a second batch is prepared on another
    # worker meanwhile. Every call here waits until two are inside at once, which one worker never gets to.
    decode_as_nvjpeg_would = decode_module._decode_jpegs_on_gpu
    both_inside = threading.Barrier(2, timeout=10)

    def waits_for_another(*args):
        both_inside.wait()
        decode_as_nvjpeg_would(*args)
    monkeypatch.setattr(decode_module, "_decode_jpegs_on_gpu", waits_for_another)
    engine = sartor.load(letterbox_plan, device="cpu")
    items = [small_frame_bytes(k) for k in range(4 * 6)]
    results = Pipeline(engine, batch_size=4).run(items)
    assert len(host_standing_in_for_nvjpeg) == 6
    assert [r.name for r in results] == [s.name for s in read_sources(items)]
    assert all(r.error is None for r in results)
    monkeypatch.setattr(decode_module, "_decode_jpegs_on_gpu", decode_as_nvjpeg_would)
    alone = Pipeline(engine, batch_size=4, overlap=False).run(items)
    for result, reference in zip(results, alone):
        for name, value in reference.outputs.items():
            np.testing.assert_array_equal(result.outputs[name], value)


def nvjpeg_pays_per_call(monkeypatch, seconds: float) -> None:
    """The stand-in nvJPEG (already patched in) made to cost `seconds` a call, far above the host's decode
    of small frames: only a share that sends it nothing avoids that cost. As many calls at once as a
    device has decoders, for the pipeline's workers to take in turn."""
    decode_as_nvjpeg_would = decode_module._decode_jpegs_on_gpu
    decoders = threading.Semaphore(decode_module.DECODERS_PER_DEVICE)

    def slow(*args):
        with decoders:
            time.sleep(seconds)
            decode_as_nvjpeg_would(*args)
    monkeypatch.setattr(decode_module, "_decode_jpegs_on_gpu", slow)


def small_frame_bytes(seed: int) -> bytes:
    image = Image.fromarray(skimage_data.astronaut()).resize((128, 72 + seed % 3))
    buffer = io.BytesIO()
    image.save(buffer, "JPEG", quality=90)
    return buffer.getvalue()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="nvJPEG needs CUDA")
def test_on_a_gpu_the_host_share_lands_on_the_device_beside_nvjpegs_frames():
    items = [frame_bytes(name) for name in PHOTOS]
    device = torch.device("cuda")
    slots = PinnedSlots()
    with ThreadPoolExecutor(2) as pool:
        decoded = decode_frames(read_sources(items), device, SPEC, True, 0.5, pool, slots)
    assert all(d.error is None and d.pixels.device.type == "cuda" for d in decoded)
    assert [tuple(d.pixels.shape) for d in decoded] == [(3, 720, 1280)] * 2 + [(3, 360, 640)] * 2
    for d, data in zip(decoded[2:], items[2:]):
        assert torch.equal(d.pixels.cpu(), decode_on_host(data, SPEC, fast=True)[0])
    torch.cuda.synchronize()
    assert len(slots) == 2 and all(s.free() for s in slots._slots)  # the host frames' buffers, free again


@pytest.mark.skipif(not torch.cuda.is_available(), reason="page-locked memory needs CUDA")
def test_on_a_gpu_the_pool_leaves_its_frames_page_locked_for_an_asynchronous_upload():
    data = frame_bytes(PHOTOS[0])
    frame = _pinned_host_frame(read_sources([data])[0], SPEC, True)
    assert frame.pixels.is_pinned()
    assert torch.equal(frame.pixels, decode_on_host(data, SPEC, fast=True)[0])


def test_files_start_their_host_share_when_read_ahead_and_keep_their_order(host_standing_in_for_nvjpeg,
                                                                         letterbox_plan, tmp_path, monkeypatch):
    """With a share, a batch of files has its host frames submitted to the pool by the reader, batches
    before the worker decodes it; results are those of the share decoded in the batch's own turn."""
    files = []
    for k in range(12):
        files.append(tmp_path / f"frame{k:02d}.jpg")
        files[-1].write_bytes(small_frame_bytes(k))
    started_on = []
    start = decode_module.start_host_share

    def recorded(sources, *args, **kwargs):
        started_on.append((threading.current_thread().name, [s.name for s in sources]))
        return start(sources, *args, **kwargs)
    monkeypatch.setattr(pipeline_module, "start_host_share", recorded)
    engine = sartor.load(letterbox_plan, device="cpu")
    ahead = Pipeline(engine, batch_size=4, host_decode_share=0.5, host_decode_threads=2).run(files)
    assert [r.name for r in ahead] == [str(f) for f in files] and all(r.error is None for r in ahead)
    assert [names for _, names in started_on] == [[str(f) for f in files[k:k + 4]] for k in (0, 4, 8)]
    assert all(thread.startswith("sartor-read") for thread, _ in started_on)
    assert host_standing_in_for_nvjpeg == [[0, 1]] * 3  # each batch's first half went to nvJPEG
    alone = Pipeline(engine, batch_size=4, host_decode_share=0.5, host_decode_threads=2, overlap=False).run(files)
    for a, b in zip(ahead, alone):
        assert (a.outputs["logits"] == b.outputs["logits"]).all()


def test_a_stream_stopped_early_gives_the_buffers_read_ahead_back(tmp_path):
    """Chunks read ahead whose host frames sit in the pool's buffers, never handed on: closing the
    stream gives those buffers back; the chunk handed on keeps its own until uploaded."""
    from sartor.pipeline.read_ahead import Chunk, read_ahead

    files = []
    for k in range(16):
        files.append(tmp_path / f"frame{k:02d}.jpg")
        files[-1].write_bytes(small_frame_bytes(k))
    slots = PinnedSlots(pin_memory=False, new_event=lambda: None)

    def into_a_buffer(source):
        pixels, slot = slots.take((8, 8, 3))
        return decode_module.DecodedFrame(source.name, pixels.permute(2, 0, 1), pinned=slot)

    with ThreadPoolExecutor(2) as pool, ThreadPoolExecutor(1) as reader:
        def start(sources, share):  # the last `share` of each chunk into the pool's buffers
            on_host = range(len(sources) - round(len(sources) * share), len(sources))
            return {i: pool.submit(into_a_buffer, sources[i]) for i in on_host}
        stream = read_ahead((Chunk(files[k:k + 4], k) for k in range(0, 16, 4)), reader, "rgb",
                            lambda: 0.5, start, depth=2)
        first = next(stream)  # the two chunks after it are being read, their host halves decoded
        stream.close()  # waits for them
        held = [first.on_host[i].result().pinned for i in (2, 3)]
    assert sorted(first.on_host) == [2, 3] and len(slots) >= 4
    assert [s for s in slots._slots if s.taken] == held
