"""Where the Pipeline's time goes between frames and boxes (issue 30), in one device call.

The trained YOLOv8n at 640 built FP16 with the NMS and the preprocessing inside (`--nms
--input-format uint8:720x1280`, bench/pipeline_e2e.py's `frames` variant), batch 1..32, on
1280×720 JPEG frames (bench/make_frames.py) as bytes and as uint8 frames already on the GPU:

- engine: its CUDA graph alone on a bound input, batch 32, and the plain engine's (the letterbox
  outside, no NMS: issue 30's "engine-only figure") on its bound input;
- per path (raw frames, JPEG bytes): frames/s through `Pipeline(engine)` over --count frames after
  a warm-up pass, and the host time per batch of each of its steps (the worker's prepare; on the
  calling thread, launch, finish, and the wait for the worker: what the engine was not hidden
  behind), from timers around the Pipeline's own methods;
- batch 1, frame after frame: a raw frame's latency through `Pipeline(batch_size=1, overlap=False)`
  against the engine's own at batch 1 (issue 30's bar: within 0.5 ms);
- the GPU work of four batches of each path by torch.profiler: its total against the wall time
  (under 1: the device idled, unless streams overlapped), and the heaviest kernels and copies.

    PYTHONPATH=. python bench/pipeline_stages.py --frames .carry/frames --onnx .carry/yolov8n.onnx --out $OUT
"""
from __future__ import annotations

import argparse
import collections
import json
import sys
import threading
import time
import warnings
from pathlib import Path

import torch

warnings.filterwarnings("ignore")
ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

import sartor  # noqa: E402
from sartor.pipeline import Pipeline  # noqa: E402
from sartor.pipeline.pipeline import Pipeline as PipelineClass  # noqa: E402


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


class StepTimers:
    """Host seconds in each wrapped Pipeline method, per thread kind (worker or caller)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = collections.defaultdict(float)
        self.lock = threading.Lock()

    def wrap(self, name: str):
        original = getattr(PipelineClass, name)

        def timed(pipeline, *args, **kwargs):
            start = time.perf_counter()
            try:
                return original(pipeline, *args, **kwargs)
            finally:
                with self.lock:
                    self.seconds[name.strip("_")] += time.perf_counter() - start
        setattr(PipelineClass, name, timed)
        return original


def run_path(pipeline, items: list, batch: int, timers: StepTimers) -> dict:
    pipeline.run(items[:2 * batch])  # warm-up
    sync()
    timers.seconds.clear()
    start = time.perf_counter()
    results = pipeline.run(items)
    wall = time.perf_counter() - start
    batches = len(items) / batch
    steps = {k: round(v * 1e3 / batches, 4) for k, v in timers.seconds.items()}
    caller = steps.get("launch", 0.0) + steps.get("finish", 0.0)
    steps["caller_waits_for_worker_and_device"] = round(wall * 1e3 / batches - caller, 4)
    return {"per_s": round(len(items) / wall, 1), "ms_per_batch": round(wall * 1e3 / batches, 4),
            "host_ms_per_batch": steps, "boxes_per_frame": round(sum(len(r.detections) for r in results) / len(items), 2)}


def kernel_time(pipeline, items: list) -> dict:
    from torch.profiler import ProfilerActivity, profile
    sync()
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        pipeline.run(items)
        sync()
        wall = time.perf_counter() - start
    busy = sum(e.self_device_time_total for e in prof.key_averages()) / 1e3
    top = sorted(((e.self_device_time_total / 1e3, e.count, e.key[:90]) for e in prof.key_averages()
                  if e.self_device_time_total > 0), reverse=True)[:14]
    return {"wall_ms": round(wall * 1e3, 3), "device_ms": round(busy, 3),
            "top": [f"{ms:.3f} ms x{n} {key}" for ms, n, key in top]}


def main() -> None:
    from pipeline_e2e import (DEVICE, build, cycled, device_frames, frames_engine_arguments, per_call_ms, read_frames,
                              summary)
    args = frames_engine_arguments(argparse.ArgumentParser()).parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    work = Path("/tmp/pipeline_stages")
    work.mkdir(exist_ok=True)
    frames = read_frames(args.frames)
    engine = sartor.load(build(args.onnx, 640, args.batch, work, "frames"), device=DEVICE)
    ctx = engine.context()
    chosen = {layer["op"]: [layer.get("tactic"), layer.get("tactic_timings_ms")] for layer in engine.layers
              if layer["op"] in ("Preprocess", "BatchedNms")}
    print("tactics", json.dumps(chosen), flush=True)
    device = torch.device(DEVICE)
    raw = device_frames(frames, device)
    feed = {engine.inputs[0].name: torch.stack(cycled(raw, args.batch))}
    results = {"gpu": torch.cuda.get_device_name() if DEVICE == "cuda" else DEVICE, "torch": torch.__version__,
               "tactics": chosen,
               "engine_b%d" % args.batch: summary(per_call_ms(lambda: ctx.run(feed), 200), args.batch)}
    print("engine", json.dumps(results["engine_b%d" % args.batch]), flush=True)
    plain = sartor.load(build(args.onnx, 640, args.batch, work, "plain"), device=DEVICE)
    plain_ctx = plain.context()
    plain_feed = plain_ctx.input_buffers({"images": (args.batch, 3, 640, 640)})
    plain_feed["images"].uniform_(0, 1)
    results["plain_engine_b%d" % args.batch] = summary(per_call_ms(lambda: plain_ctx.run(plain_feed), 200), args.batch)
    print("plain engine", json.dumps(results["plain_engine_b%d" % args.batch]), flush=True)
    timers = StepTimers()
    for name in ("_prepare", "_launch", "_finish"):
        timers.wrap(name)
    pipeline = Pipeline(engine, batch_size=args.batch)
    paths = {"raw": cycled(raw, args.count), "jpeg": cycled(frames, args.count)}
    single = Pipeline(engine, batch_size=1, overlap=False)
    feed1 = {engine.inputs[0].name: raw[0][None].contiguous()}
    results["engine_b1"] = summary(per_call_ms(lambda: ctx.run(feed1), 200, warmup=10), 1)
    results["latency_b1_raw"] = summary(per_call_ms(lambda: single.run(raw[:1]), 200, warmup=10), 1)
    results["latency_b1_raw"]["over_engine_ms"] = round(
        results["latency_b1_raw"]["median_ms"] - results["engine_b1"]["median_ms"], 4)
    print("batch 1", json.dumps({k: results[k] for k in ("engine_b1", "latency_b1_raw")}), flush=True)
    for label, items in paths.items():
        results[label] = run_path(pipeline, items, args.batch, timers)
        for engine_key in ("engine_b%d" % args.batch, "plain_engine_b%d" % args.batch):
            results[label][f"share_of_{engine_key}"] = round(results[label]["per_s"] / results[engine_key]["per_s"], 3)
        print(label, json.dumps(results[label]), flush=True)
        results[label]["kernels_4_batches"] = kernel_time(pipeline, items[:4 * args.batch])
        print(label, json.dumps(results[label]["kernels_4_batches"]), flush=True)
        (args.out / "pipeline_stages.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
