"""What the GPU gives JPEG decode and the engine together, with as little Python around them as a
host can manage (issue 30: is the 80% bar held by the Pipeline's host work or by the GPU?). One call.

Every figure is frames/s of 720p JPEGs → the engine's outputs, batch B, in one process:
- engine: the engine's CUDA graph replayed back to back, its input in place;
- decode: W threads, each with an nvJPEG decoder (sartor's binding, the hardware JPEG engines) and a
  stream of its own, decoding a batch from bytes in memory and letterboxing it into a staging buffer
  of its own, back to back: the Pipeline's decode and preprocessing with none of its bookkeeping;
- decode beside engine: those threads while the calling thread replays the engine back to back on
  another input: the two at once, each as fast as it goes (the engine's share and the decode's);
- joint: the same W threads feeding the engine on the calling thread, each batch's staging buffer
  handed over with an event and given back after the engine's run; nothing crosses to the host.
  This is files → boxes without reads, results or per-frame Python beyond the binding's: the
  rate a Pipeline whose own host work cost nothing would reach;
- pipeline (files) and pipeline (bytes): `benchmark.steady_state` of the Pipeline over the files,
  and over their bytes held in memory, as `sartor bench --end-to-end` measures it.
Each of the calling thread's figures runs with its current stream the legacy default stream (what a
user's thread has) and a stream of its own (`--engine-streams`).
Rounds alternate the figures, so a machine's drift shows as spread, not as a difference.

    PYTHONPATH=. python bench/joint_ceiling.py ENGINE.plan --images DIR [--workers 2,3] [--rounds 3]
"""
from __future__ import annotations

import argparse
import json
import queue
import sys
import threading
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import sartor  # noqa: E402
from sartor.data.preprocess import placement  # noqa: E402
from sartor.kernels.preprocess.letterbox import letterbox_frames  # noqa: E402
from sartor.pipeline.benchmark import bench_pipeline, image_files, steady_state  # noqa: E402
from sartor.pipeline.nvjpeg_batched import NvjpegBatched  # noqa: E402
from sartor.pipeline.prepare import input_tensor  # noqa: E402


class Feeder:
    """One decode thread's decoder, streams and two staging buffers; `prepare(encoded, slot)` decodes
    a batch and letterboxes it into staging buffer `slot` on the preparation stream, returning the
    event after which the buffer holds it."""

    def __init__(self, device: torch.device, spec, batch: int, size: tuple[int, int]) -> None:
        self.binding = NvjpegBatched(device)
        self.decode_stream, self.stream = torch.cuda.Stream(device), torch.cuda.Stream(device)
        self.spec, self.place = spec, placement(*size, spec)
        self.staging = [input_tensor(spec, batch, device) for _ in range(2)]
        self.freed: list[torch.cuda.Event | None] = [None, None]
        self.free = [threading.Semaphore(1), threading.Semaphore(1)]  # the engine has launched its run of the slot

    def prepare(self, encoded: list, slot: int) -> torch.cuda.Event:
        with torch.cuda.stream(self.stream):
            if self.freed[slot] is not None:
                self.stream.wait_event(self.freed[slot])
            jpegs = self.binding.decode_batch(encoded, self.decode_stream)
            decoded = torch.cuda.Event()
            decoded.record(self.decode_stream)
            self.stream.wait_event(decoded)
            jpegs.batch.record_stream(self.stream)
            letterbox_frames(jpegs.batch.permute(0, 3, 1, 2), "chw", "rgb", self.spec, self.place.resized,
                             self.place.pad, self.staging[slot])
            ready = torch.cuda.Event()
            ready.record(self.stream)
        return ready


def decode_alone(feeders: list[Feeder], encoded: list, batches: int, stop: threading.Event | None = None) -> float:
    """Frames/s of the feeders decoding back to back (each waits for its own batch before the next but
    one), `batches` each, or until `stop` is set."""
    done = [0] * len(feeders)

    def loop(k: int) -> None:
        feeder = feeders[k]
        for j in range(batches):
            if stop is not None and stop.is_set():
                break
            ready = feeder.prepare(encoded, j % 2)
            feeder.freed[j % 2] = ready  # the slot is free again once its letterbox is written
            done[k] += 1
        feeder.stream.synchronize()
    threads = [threading.Thread(target=loop, args=(k,)) for k in range(len(feeders))]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(done) * len(encoded) / (time.perf_counter() - start)


def engine_alone(context, name: str, feed: torch.Tensor, batches: int) -> float:
    stream = torch.cuda.current_stream()
    context.run({name: feed})
    stream.synchronize()
    start = time.perf_counter()
    for _ in range(batches):
        context.run({name: feed})
    stream.synchronize()
    return batches * feed.shape[0] / (time.perf_counter() - start)


def beside(feeders: list[Feeder], encoded: list, context, name: str, feed: torch.Tensor,
           seconds: float) -> dict:
    """The feeders decoding and the engine replaying, both back to back for `seconds`."""
    stop = threading.Event()
    decoded: dict = {}
    thread = threading.Thread(target=lambda: decoded.setdefault("fps", decode_alone(feeders, encoded, 10 ** 6, stop)))
    stream = torch.cuda.current_stream()
    thread.start()
    start, runs = time.perf_counter(), 0
    while time.perf_counter() - start < seconds:
        context.run({name: feed})
        runs += 1
        if runs % 8 == 0:
            stream.synchronize()
    stream.synchronize()
    engine_fps = runs * feed.shape[0] / (time.perf_counter() - start)
    stop.set()
    thread.join()
    return {"engine": engine_fps, "decode": decoded["fps"]}


def joint(feeders: list[Feeder], encoded: list, context, name: str, batches: int) -> float:
    """Frames/s of the feeders' batches through the engine on this thread, `batches` in all."""
    handed: queue.Queue = queue.Queue()
    each = [batches // len(feeders) + (k < batches % len(feeders)) for k in range(len(feeders))]

    def loop(k: int) -> None:
        feeder = feeders[k]
        for j in range(each[k]):
            feeder.free[j % 2].acquire()
            handed.put((feeder, j % 2, feeder.prepare(encoded, j % 2)))
    threads = [threading.Thread(target=loop, args=(k,)) for k in range(len(feeders))]
    stream = torch.cuda.current_stream()
    start = time.perf_counter()
    for t in threads:
        t.start()
    for _ in range(batches):
        feeder, slot, ready = handed.get()
        stream.wait_event(ready)
        context.run({name: feeder.staging[slot]})
        freed = torch.cuda.Event()
        freed.record(stream)
        feeder.freed[slot] = freed
        feeder.free[slot].release()
    stream.synchronize()
    seconds = time.perf_counter() - start
    for t in threads:
        t.join()
    return batches * len(encoded) / seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("engine")
    parser.add_argument("--images", required=True)
    parser.add_argument("--workers", default="2")
    parser.add_argument("--engine-streams", default="default,own", help="the calling thread's stream: default, own")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batches", type=int, default=160, help="batches each timed figure runs")
    parser.add_argument("--json", help="write every round's figures here")
    args = parser.parse_args()

    engine = sartor.load(args.engine)
    pipeline = bench_pipeline(engine, None, "auto")[0]
    batch, device, spec = pipeline.batch_size, pipeline.device, pipeline.spec
    files = image_files(args.images)
    encoded = [f.read_bytes() for f in files[:batch]]
    size = tuple(NvjpegBatched(device).decode_batch(encoded[:1], torch.cuda.current_stream()).frames[0].shape[:2])
    context = engine.context(pipeline.bucket_profile(0)[1])
    name = pipeline.input_name
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, batch {batch}, frames {size[1]}x{size[0]}, "
          f"{len(files)} files", flush=True)
    workers = [int(w) for w in args.workers.split(",")]
    feeders = {w: [Feeder(device, spec, batch, size) for _ in range(w)] for w in workers}
    first = feeders[workers[0]][0]
    first.prepare(encoded, 0).synchronize()
    feed = first.staging[0].clone()  # the engine alone runs real frames: its NMS keeps what the Pipeline's keeps
    engine_alone(context, name, feed, 20)  # the engine's graph captured before any other thread runs
    for w in workers:  # warm-up: kernels loaded, decoders' buffers sized
        decode_alone(feeders[w], encoded, 4)
        joint(feeders[w], encoded, context, name, 8)
    whole = list(files) * 8
    bytes_items = [f.read_bytes() for f in whole]
    steady_state(pipeline, list(files), batch)
    # The calling thread's engine work on the legacy default stream (a user's thread as it starts), or
    # on a stream of its own, which does not take part in the default stream's implicit synchronisation.
    streams = {"default": torch.cuda.default_stream(device), "own": torch.cuda.Stream(device)}
    rounds = []
    for r in range(1, args.rounds + 1):
        row: dict = {}
        for label in args.engine_streams.split(","):
            with torch.cuda.stream(streams[label]):
                row[f"engine ({label})"] = engine_alone(context, name, feed, args.batches)
                for w in workers:
                    both = beside(feeders[w], encoded, context, name, feed, 2.0)
                    row[f"beside w{w} ({label}): engine"] = both["engine"]
                    row[f"beside w{w} ({label}): decode"] = both["decode"]
                    row[f"joint w{w} ({label})"] = joint(feeders[w], encoded, context, name, args.batches)
                row[f"pipeline files ({label})"] = steady_state(pipeline, whole, batch)[0]
                row[f"pipeline bytes ({label})"] = steady_state(pipeline, bytes_items, batch)[0]
        for w in workers:
            row[f"decode w{w}"] = decode_alone(feeders[w], encoded, args.batches // w)
        ceiling = min(max(v for k, v in row.items() if k.startswith("engine")),
                      max(row[f"decode w{w}"] for w in workers))
        row["ceiling"] = ceiling
        rounds.append(row)
        print(f"round {r}: " + ", ".join(f"{k} {v:,.0f}" for k, v in row.items())
              + " | shares of the ceiling: " + ", ".join(f"{k} {row[k] / ceiling:.3f}" for k in row
                                                          if k.startswith(("joint", "pipeline"))), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                                               "batch": batch, "rounds": rounds}, indent=1))


if __name__ == "__main__":
    main()
