"""Where a batch's time goes in JPEG files → boxes (issue 30): each thread's host spans and each
stream's GPU spans, batch by batch, at steady state.

JPEG files → boxes ran near the decode's time plus the engine's, though beside each other the two
keep most of their rates (BENCHMARKS.md, "Frames to boxes"): something puts them in turn.
Here the Pipeline runs the files as `sartor bench --end-to-end` does, with its steps wrapped:
- host (perf_counter, per thread): the worker's `_prepare`, inside it the binding's wait for an
  earlier decode and its call into nvJPEG; the calling thread's `_launch` and `_finish`;
- GPU (CUDA events on the stream each runs on): the decode (on the stream the variant gives it),
  the letterbox on the stream it is launched on, and the engine's run on the calling thread's stream.
Host and GPU clocks share an origin (an event recorded on an idle device at a known host time).
Printed per variant: medians of each span, the period (engine start to engine start), the share of
the engine's GPU time a decode ran beside, and a few steady batches' spans in time order.
Variants (`--variants STATES:STREAM[:WORKERS[:DECODERS]],...`): the binding's decode states (1 waits
for the last decode before handing the next to nvJPEG, 2 for the one before it), the stream it
decodes on (`caller`: the preparation stream; `own`: a stream of the decoder's, the default;
`own-high`: that stream at high priority), the batches prepared at once on worker threads
(`pipeline.PREPARE_AHEAD`) and the nvJPEG decoders they share (`decode.DECODERS_PER_DEVICE`); the
last two default to the Pipeline's own, so session 49's two-field variants still run.
Session 49 tried two workers on one decoder (code 6ae74f9): slower (decision 0063).
`--sources files,bytes` runs each variant from the paths and from the files' bytes held in memory (no
reads), `--switch-intervals-ms 5,0.5` every variant at each of Python's thread switch intervals: a thread
back from native code waits up to the interval for the interpreter lock while another runs Python.

    PYTHONPATH=. python bench/pipeline_timeline.py ENGINE.plan --images DIR [--variants 2:own:1:1,2:own:2:2]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.append(str(ROOT))  # after PYTHONPATH: PYTHONPATH=OLD_CHECKOUT times that checkout's Pipeline

import sartor  # noqa: E402
from sartor.pipeline import decode as decode_module  # noqa: E402
from sartor.pipeline import pipeline as pipeline_module  # noqa: E402
from sartor.pipeline.benchmark import bench_pipeline, image_files  # noqa: E402
try:
    from sartor.pipeline.benchmark import steady_state  # noqa: E402
except ImportError:
    steady_state = None
from sartor.pipeline.nvjpeg_batched import NvjpegBatched  # noqa: E402


class Recorder:
    """Host spans (label, thread, start s, end s) and GPU spans (label, start event, end event)."""

    def __init__(self) -> None:
        self.host: list[tuple[str, str, float, float]] = []
        self.gpu: list[tuple[str, torch.cuda.Event, torch.cuda.Event]] = []
        self.lock = threading.Lock()
        torch.cuda.synchronize()
        self.origin_event = torch.cuda.Event(enable_timing=True)
        self.origin_event.record()
        self.origin = time.perf_counter()
        torch.cuda.synchronize()

    def host_span(self, label: str, start: float, end: float) -> None:
        with self.lock:
            self.host.append((label, threading.current_thread().name, start, end))

    def event(self, stream: torch.cuda.Stream) -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)
        event.record(stream)
        return event

    def gpu_span(self, label: str, start: torch.cuda.Event, end: torch.cuda.Event) -> None:
        with self.lock:
            self.gpu.append((label, start, end))

    def spans_ms(self) -> list[tuple[float, float, str, str]]:
        """Every span as (start ms, end ms, where, label), in time order from the origin."""
        torch.cuda.synchronize()
        spans = [((s - self.origin) * 1e3, (e - self.origin) * 1e3, thread, label)
                 for label, thread, s, e in self.host]
        spans += [(self.origin_event.elapsed_time(s), self.origin_event.elapsed_time(e), "gpu", label)
                  for label, s, e in self.gpu]
        return sorted(spans)


def instrument(recorder: Recorder) -> None:
    """Wrap the binding's decode and the Pipeline's prepare, launch and finish with spans."""
    decode = getattr(NvjpegBatched, DECODE)
    prepare_batch = pipeline_module.prepare_batch
    prepare, launch, finish = (pipeline_module.Pipeline._prepare, pipeline_module.Pipeline._launch,
                               pipeline_module.Pipeline._finish)

    def timed_decode(self, encoded, stream):
        state = self._states[self._turn]
        t0 = time.perf_counter()
        if state.last is not None:
            state.last[0].synchronize()  # what decode would wait for, timed apart (its own wait then returns at once)
        t1 = time.perf_counter()
        start = recorder.event(stream)
        decoded = decode(self, encoded, stream)
        end = recorder.event(stream)
        recorder.host_span("decode: wait for a state", t0, t1)
        recorder.host_span("decode: call", t1, time.perf_counter())
        recorder.gpu_span("decode", start, end)
        return decoded

    def timed_prepare(self, chunk, slot):
        t0 = time.perf_counter()
        prepared = prepare(self, chunk, slot)
        recorder.host_span("prepare", t0, time.perf_counter())
        return prepared

    def timed_launch(self, prepared, slot):
        t0 = time.perf_counter()
        launched = launch(self, prepared, slot)
        recorder.host_span("launch", t0, time.perf_counter())
        return launched

    def timed_finish(self, launched):
        t0 = time.perf_counter()
        results = finish(self, launched)
        recorder.host_span("finish", t0, time.perf_counter())
        return results

    def timed_prepare_batch(*args, **kwargs):
        stream = torch.cuda.current_stream()
        start = recorder.event(stream)  # reached once the stream has waited for the decode
        prepared = prepare_batch(*args, **kwargs)
        recorder.gpu_span("letterbox", start, recorder.event(stream))
        return prepared

    setattr(NvjpegBatched, DECODE, timed_decode)
    pipeline_module.prepare_batch = timed_prepare_batch
    pipeline_module.Pipeline._prepare = timed_prepare
    pipeline_module.Pipeline._launch = timed_launch
    pipeline_module.Pipeline._finish = timed_finish


def time_engine_runs(pipeline, recorder: Recorder) -> None:
    """Each bucket context's run as a GPU span on the stream it is queued on, after the waits
    `_launch` queued before it, and as a host span (the rest of `_launch` is staging the outputs)."""
    for bucket in pipeline._buckets:
        run = bucket.context.run

        def timed_run(inputs, run=run):
            stream = torch.cuda.current_stream()
            start = recorder.event(stream)
            t0 = time.perf_counter()
            outputs = run(inputs)
            recorder.host_span("launch: engine run", t0, time.perf_counter())
            recorder.gpu_span("engine", start, recorder.event(stream))
            return outputs
        bucket.context.run = timed_run


def overlap_share(engine: list[tuple[float, float]], decodes: list[tuple[float, float]]) -> float:
    """The share of the engine spans' time during which a decode span ran too."""
    covered = total = 0.0
    for start, end in engine:
        total += end - start
        for d_start, d_end in decodes:
            covered += max(0.0, min(end, d_end) - max(start, d_start))
    return covered / total if total else 0.0


def report(spans: list, steady_from_ms: float, batch: int, show: int) -> None:
    steady = [s for s in spans if s[0] >= steady_from_ms]
    by_label: dict[tuple[str, str], list[float]] = {}
    for start, end, where, label in steady:
        key = ("gpu" if where == "gpu" else where.split("_")[0], label)
        by_label.setdefault(key, []).append(end - start)
    for (where, label), values in sorted(by_label.items()):
        print(f"  {where:18s} {label:26s} median {statistics.median(values):7.3f} ms  "
              f"p90 {sorted(values)[int(0.9 * (len(values) - 1))]:7.3f}  n {len(values)}")
    engine = [(s, e) for s, e, where, label in steady if where == "gpu" and label == "engine"]
    decodes = [(s, e) for s, e, where, label in steady if where == "gpu" and label == "decode"]
    starts = [s for s, _ in engine]
    periods = [b - a for a, b in zip(starts, starts[1:])]
    if periods:
        period = statistics.median(periods)
        print(f"  period (engine start to start) median {period:.3f} ms = {batch * 1e3 / period:.0f} frames/s; "
              f"engine GPU time beside a decode {overlap_share(engine, decodes):.2f}")
    if engine and show:
        middle = engine[len(engine) // 2][0]
        window = [s for s in steady if middle - 1.0 <= s[0] <= middle + show * (periods[0] if periods else 5.0)]
        base = window[0][0] if window else 0.0
        for start, end, where, label in window:
            print(f"    {start - base:8.3f} {end - base:8.3f}  {where:22s} {label}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("engine")
    parser.add_argument("--images", required=True)
    parser.add_argument("--variants", default="2:own:1:1,2:own:2:1,2:own:2:2",
                        help="decode states:stream (caller, own or own-high):workers:decoders, one variant each")
    parser.add_argument("--passes", type=int, default=3, help="passes over the files; the first is warm-up")
    parser.add_argument("--switch-intervals-ms", default="",
                        help="Python's thread switch intervals to run every variant at (default: the process's)")
    parser.add_argument("--show", type=int, default=3, help="steady batches printed span by span")
    parser.add_argument("--sources", default="files",
                        help="files (paths, read by the Pipeline) and/or bytes (the files' bytes, held in memory)")
    args = parser.parse_args()
    engine = sartor.load(args.engine)
    files = image_files(args.images)
    device = torch.device("cuda", torch.cuda.current_device())
    print(torch.cuda.get_device_name(), f"torch {torch.__version__}", f"{len(files)} files",
          f"sartor from {Path(sartor.__file__).parent}", flush=True)
    intervals = [float(ms) / 1e3 for ms in args.switch_intervals_ms.split(",") if ms] or [sys.getswitchinterval()]
    held = {"files": files, "bytes": [Path(f).read_bytes() for f in files]}
    # the Pipeline's own workers and decoders, for variants that leave them out (set per variant below)
    defaults = [str(pipeline_module.PREPARE_AHEAD), str(decode_module.DECODERS_PER_DEVICE)]
    for interval, variant, source in ((i, v, k) for i in intervals for v in args.variants.split(",")
                                      for k in args.sources.split(",")):
        sys.setswitchinterval(interval)
        items = held[source]
        fields = variant.split(":")
        states, stream, workers, decoders = fields + defaults[len(fields) - 2:]
        pipeline_module.PREPARE_AHEAD = int(workers)  # the Pipeline takes a staging buffer more
        if hasattr(pipeline_module, "STAGING_SLOTS"):  # a checkout from before session 51 sets it apart
            pipeline_module.STAGING_SLOTS = int(workers) + 1

        def make(states=int(states), stream=stream) -> decode_module.GpuJpegDecoder:
            return decode_module.GpuJpegDecoder(NvjpegBatched(device, states=states), torch.cuda.Stream(
                device, priority=-1 if stream == "own-high" else 0) if stream.startswith("own") else None)
        if hasattr(decode_module, "set_gpu_jpeg_decoders"):
            decode_module.set_gpu_jpeg_decoders(device, make, limit=int(decoders))
        else:  # a checkout from before session 54 has no setter
            decode_module._BATCHED[device] = decode_module.GpuJpegDecoders(make, make(), limit=int(decoders))
        recorder = Recorder()
        instrument(recorder)
        pipeline, _, _ = bench_pipeline(engine, None, "auto")
        time_engine_runs(pipeline, recorder)
        for _ in pipeline.stream(items):  # warm-up pass
            pass
        steady_from = (time.perf_counter() - recorder.origin) * 1e3
        if steady_state is not None:  # as sartor bench --end-to-end times it: one stream, from its first batch
            rate, _ = steady_state(pipeline, items * (args.passes - 1), pipeline.batch_size)
        else:  # a checkout from before steady_state: a stream a pass
            start = time.perf_counter()
            for _ in range(args.passes - 1):
                for _ in pipeline.stream(items):
                    pass
            rate = len(items) * (args.passes - 1) / (time.perf_counter() - start)
        print(f"== {states} decode state(s), {stream} stream, {workers} worker(s), {decoders} decoder(s), "
              f"switch interval {interval * 1e3:g} ms, {source}: "
              f"files → boxes {rate:.0f} frames/s, batch {pipeline.batch_size}", flush=True)
        report(recorder.spans_ms(), steady_from, pipeline.batch_size, args.show)
        restore()


# The binding's entry the Pipeline calls (`decode` before it had `decode_batch`).
DECODE = "decode_batch" if hasattr(NvjpegBatched, "decode_batch") else "decode"
ORIGINALS = (getattr(NvjpegBatched, DECODE), pipeline_module.Pipeline._prepare, pipeline_module.Pipeline._launch,
             pipeline_module.Pipeline._finish, pipeline_module.prepare_batch)


def restore() -> None:
    decode, pipeline_module.Pipeline._prepare, pipeline_module.Pipeline._launch, \
        pipeline_module.Pipeline._finish, pipeline_module.prepare_batch = ORIGINALS
    setattr(NvjpegBatched, DECODE, decode)


if __name__ == "__main__":
    main()
