"""Batches decoded ahead of the engine (`pipeline/prefetch.py`, `Pipeline(overlap=True)`): results in
order and equal to the run without the worker, failed items named and skipped as without it, the
worker's exceptions raised in the caller, and the worker stopped when the caller stops early. On a
GPU machine the same file runs a CUDA engine with YoloNms through both, and frames made on the
caller's stream."""
from __future__ import annotations

import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import MAX_SHAPES, MIN_SHAPES, OPT_SHAPES

import sartor
from sartor.errors import DataError
from sartor.pipeline import Pipeline
from sartor.pipeline.pipeline import PREFETCH_BATCHES
from sartor.pipeline.prefetch import Prefetcher

SPEC = "letterbox=16,mean=0,std=255,rgb,nchw"
WORKER = "sartor-pipeline-decode"
requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")


def workers_alive() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == WORKER]


@pytest.fixture(scope="module")
def engine(tmp_path_factory, tiny_onnx):
    out = tmp_path_factory.mktemp("prefetch") / "tiny_letterbox.plan"
    sartor.build(tiny_onnx, out, device="cpu", min_shapes=MIN_SHAPES, opt_shapes=OPT_SHAPES, max_shapes=MAX_SHAPES,
                 preprocess=SPEC)
    return sartor.load(out, device="cpu")


def frames(count: int, seed: int = 0) -> list[np.ndarray]:
    """Raw H×W×3 frames of varied sizes (decoded, so the tests time no JPEG decode)."""
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, (20 + 3 * (i % 4), 30 - 2 * (i % 3), 3), dtype=np.uint8) for i in range(count)]


# ---- the prefetcher alone -----------------------------------------------------------------------

def test_the_prefetcher_returns_jobs_in_order_and_never_lends_a_slot_twice():
    held, lent, overlaps = set(), [], []
    lock = threading.Lock()

    def prepare(index, slot):
        with lock:
            if slot in held:
                overlaps.append((index, slot))
            held.add(slot)
        lent.append(slot)
        time.sleep(0.001 * (index % 3))  # uneven decode times
        return index

    prefetch = Prefetcher(prepare, depth=2)
    got = []
    try:
        for index in range(12):
            while prefetch.pending >= prefetch.depth:
                value, slot = prefetch.take()
                got.append(value)
                with lock:
                    held.discard(slot)
                prefetch.release(slot)
            prefetch.submit(index)
        while prefetch.pending:
            value, slot = prefetch.take()
            got.append(value)
            with lock:
                held.discard(slot)
            prefetch.release(slot)
    finally:
        prefetch.close()
    assert got == list(range(12))
    assert overlaps == [] and set(lent) == {0, 1, 2}  # depth 2: two waiting, one being launched
    assert not prefetch.alive


def test_the_prefetchers_worker_exception_is_raised_at_its_batch_and_stops_it():
    def prepare(index, slot):
        if index == 2:
            raise RuntimeError("decoder broke at 2")
        return index

    prefetch = Prefetcher(prepare, depth=2)
    for index in range(4):
        prefetch.submit(index)
    assert prefetch.take()[0] == 0 and prefetch.take()[0] == 1
    with pytest.raises(RuntimeError, match="decoder broke at 2"):
        prefetch.take()
    prefetch._thread.join(timeout=5)
    assert not prefetch.alive  # the jobs after the failure are not prepared
    prefetch.close()


# ---- through the pipeline -----------------------------------------------------------------------

def test_overlap_on_and_off_give_the_same_results_in_order(engine):
    items = frames(11)  # batches of 2: six, more than the worker's slots, so slots are reused
    ahead = Pipeline(engine, batch_size=2, overlap=True).run(items)
    plain = Pipeline(engine, batch_size=2, overlap=False).run(items)
    assert [r.name for r in ahead] == [r.name for r in plain] == [f"item {i}" for i in range(11)]
    for a, b in zip(ahead, plain):
        np.testing.assert_array_equal(a.outputs["logits"], b.outputs["logits"])
        assert a.meta == b.meta


def test_overlapped_runs_count_their_batches_and_time_their_stages(engine):
    pipeline = Pipeline(engine, batch_size=2)
    pipeline.run(frames(7))
    times = pipeline.times
    assert times.batches == 4 and times.prepare_s > 0 and times.finish_s > 0
    assert set(times.to_json()) == {"batches", "prepare_s", "waited_s", "launch_s", "finish_s"}
    assert times.per_batch_ms()["prepare"] == pytest.approx(times.prepare_s * 1e3 / 4, abs=1e-3)
    alone = Pipeline(engine, batch_size=2, overlap=False)
    alone.run(frames(3))
    assert alone.times.batches == 2 and alone.times.prepare_s > 0


@pytest.mark.parametrize("overlap", [True, False])
def test_a_bad_item_batches_ahead_is_named_after_the_batches_before_it_came_back(engine, overlap):
    items = frames(9)
    items[6] = b"\xff\xd8\xff\xe0 truncated"  # batch 3 of 2-item batches
    seen = []
    with pytest.raises(DataError, match=r"1 of 2 images failed: image item 6 is corrupt, truncated or not an image"):
        for result in Pipeline(engine, batch_size=2, overlap=overlap).stream(items):
            seen.append(result.name)
    assert seen == [f"item {i}" for i in range(6)]
    assert workers_alive() == []
    skipped = Pipeline(engine, batch_size=2, overlap=overlap, skip_bad=True).run(items)
    assert [r.error is not None for r in skipped] == [i == 6 for i in range(9)]
    assert skipped[6].error.startswith("image item 6 is corrupt")


def test_an_exception_on_the_worker_reaches_the_caller_and_stops_the_worker(engine, monkeypatch):
    pipeline = Pipeline(engine, batch_size=2)
    original = pipeline._prepare

    def failing(chunk, first, handed_over, slot):
        if first == 4:
            raise RuntimeError("reading item 4 broke")
        return original(chunk, first, handed_over, slot)

    monkeypatch.setattr(pipeline, "_prepare", failing)
    seen = []
    with pytest.raises(RuntimeError, match="reading item 4 broke"):
        for result in pipeline.stream(frames(9)):
            seen.append(result.name)
    assert seen == ["item 0", "item 1", "item 2", "item 3"]
    assert workers_alive() == []


def test_closing_the_stream_early_stops_the_worker(engine):
    def endless():
        rng = np.random.default_rng(1)
        while True:
            yield rng.integers(0, 256, (24, 24, 3), dtype=np.uint8)

    stream = Pipeline(engine, batch_size=2).stream(endless())
    assert next(stream).name == "item 0"
    assert len(workers_alive()) == 1
    stream.close()
    assert workers_alive() == []


def test_a_decoder_that_raises_stops_the_worker(engine):
    def broken(outputs, metas):
        raise ValueError("decoder says no")

    with pytest.raises(ValueError, match="decoder says no"):
        Pipeline(engine, batch_size=2, decoder=broken).run(frames(9))
    assert workers_alive() == []


def test_the_worker_prepares_at_most_the_prefetch_depth_ahead(engine):
    taken = []

    def counted():
        for i, frame in enumerate(frames(40)):
            taken.append(i)
            yield frame

    stream = Pipeline(engine, batch_size=2).stream(counted())
    next(stream)
    # the first batch, and PREFETCH_BATCHES more handed to the worker (read in the caller's thread)
    assert len(taken) == 2 * (1 + PREFETCH_BATCHES)
    stream.close()


def test_a_prepared_batch_is_launched_before_the_source_is_asked_for_more(engine, monkeypatch):
    """A live source (a camera) blocks until its next frames exist: the batch in hand must not wait
    for them. The first batch is launched once its own items are read."""
    log = []
    pipeline = Pipeline(engine, batch_size=2)
    launch = pipeline._launch

    def logged_launch(prepared, slot):
        log.append(f"launch {prepared.names[0]}")
        return launch(prepared, slot)

    monkeypatch.setattr(pipeline, "_launch", logged_launch)

    def camera():
        for i, frame in enumerate(frames(8)):
            log.append(f"read {i}")
            yield frame

    pipeline.run(camera())
    assert log.index("launch item 0") < log.index("read 2")
    assert log.index("launch item 2") < log.index("read 6")


# ---- detections, and CUDA ------------------------------------------------------------------------

ROOT = Path(__file__).resolve().parents[2]
DETECTOR = ROOT / "samples" / "detector" / "sample_detector.onnx"
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.fixture(scope="module", params=DEVICES)
def detector(request, tmp_path_factory):
    plan = tmp_path_factory.mktemp("detector") / f"{request.param}.plan"
    shapes = lambda b: {"images": (b, 3, 320, 320)}  # noqa: E731
    sartor.build(DETECTOR, plan, device=request.param, preprocess="letterbox=320,mean=0,std=255,rgb,nchw",
                 builder_effort=0, min_shapes=shapes(1), opt_shapes=shapes(4), max_shapes=shapes(4))
    return sartor.load(plan, device=request.param)


def scenes(count: int) -> list[np.ndarray]:
    """Frames with shapes a detector finds: bright rectangles on a dark, noisy ground."""
    rng = np.random.default_rng(5)
    out = []
    for i in range(count):
        frame = rng.integers(0, 40, (240 + 8 * (i % 3), 320, 3), dtype=np.uint8)
        for _ in range(3):
            y, x, h, w = rng.integers(10, 150), rng.integers(10, 220), rng.integers(30, 80), rng.integers(30, 90)
            frame[y:y + h, x:x + w] = rng.integers(150, 255, 3, dtype=np.uint8)
        out.append(frame)
    return out


def test_overlap_on_and_off_give_the_same_detections(detector):
    from sartor.pipeline import YoloNms
    device = torch.device(detector.device)
    items = [torch.from_numpy(f).to(device) for f in scenes(10)]  # batches of 4: 4, 4, 2
    decoder = YoloNms(conf=0.01, iou=0.5)
    ahead = Pipeline(detector, batch_size=4, decoder=decoder, host_outputs=False).run(items)
    plain = Pipeline(detector, batch_size=4, decoder=decoder, host_outputs=False, overlap=False).run(items)
    assert [r.name for r in ahead] == [r.name for r in plain] == [f"item {i}" for i in range(10)]
    assert sum(len(r.detections) for r in plain) > 0
    for a, b in zip(ahead, plain):
        np.testing.assert_array_equal(a.detections.boxes, b.detections.boxes)
        np.testing.assert_array_equal(a.detections.scores, b.detections.scores)
        np.testing.assert_array_equal(a.detections.classes, b.detections.classes)


@requires_cuda
def test_on_cuda_frames_made_on_the_callers_stream_are_read_after_it(detector):
    """Each frame is written on the caller's stream behind a long sleep kernel: a worker that read
    it without waiting for that stream would read the frame before it is written."""
    if detector.device.type != "cuda":
        pytest.skip("the CUDA engine's case")
    sources = [torch.from_numpy(f).cuda() for f in scenes(8)]

    def made_late():
        for source in sources:
            torch.cuda._sleep(20_000_000)  # some milliseconds of device time before the frame exists
            frame = torch.zeros_like(source)
            frame.copy_(source)
            yield frame

    ahead = Pipeline(detector, batch_size=4, host_outputs=True).run(made_late())
    plain = Pipeline(detector, batch_size=4, host_outputs=True, overlap=False).run(sources)
    for a, b in zip(ahead, plain):
        for name in b.outputs:
            np.testing.assert_array_equal(a.outputs[name], b.outputs[name])
