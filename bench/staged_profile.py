"""Where a copied (staged) run's time goes against a run from the engine's own buffer: torch.profiler
over a few runs of each way of one INT8 engine, kernels by total time, both ways side by side.

    PYTHONPATH=. python bench/staged_profile.py --onnx samples/yolo/yolov8n_scenes.onnx --batch 32 [--precision int8]
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import sartor  # noqa: E402


def kernel_times(fn, runs: int, device: str = "cuda") -> dict:
    """{kernel name: ms per run} over `runs` runs after 5 (on the CPU: its ops' own host time)."""
    cuda = device == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    for _ in range(5):
        fn()
    sync()
    activity = torch.profiler.ProfilerActivity.CUDA if cuda else torch.profiler.ProfilerActivity.CPU
    with torch.profiler.profile(activities=[activity]) as prof:
        for _ in range(runs):
            fn()
        sync()
    totals = defaultdict(float)
    for event in prof.events():
        if cuda and event.device_type == torch.autograd.DeviceType.CUDA:
            totals[event.name[:90]] += event.device_time / runs / 1e3
        elif not cuda and event.device_type == torch.autograd.DeviceType.CPU:
            totals[event.name[:90]] += event.self_cpu_time_total / runs / 1e3
    return totals


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser()
    parser.add_argument("--onnx", required=True)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--size", type=int, default=640)
    parser.add_argument("--precision", default="int8")
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--device", default="cuda", help="cpu: a check of the script (no graphs, nothing copied)")
    args = parser.parse_args(argv)
    work = Path(tempfile.mkdtemp())
    shape = (args.batch, 3, args.size, args.size)
    np.save(work / "calib.npy", np.random.default_rng(0).random((32, 3, args.size, args.size), dtype=np.float32))
    shapes = {"images": shape}
    sartor.build(args.onnx, str(work / "e.plan"), device=args.device, precision=args.precision, min_shapes=shapes,
                 opt_shapes=shapes, max_shapes=shapes, calib=str(work / "calib.npy"), calib_size=32)
    ctx = sartor.load(str(work / "e.plan"), device=args.device).context(bound_graphs=0)  # the copied way copies
    x = torch.rand(shape, device=args.device)
    bound = ctx.input_buffers(shapes)
    bound["images"].copy_(x)
    ways = {"copied": kernel_times(lambda: ctx.run({"images": x}), args.runs, args.device),
            "in_place": kernel_times(lambda: ctx.run(bound), args.runs, args.device)}
    names = sorted(set(ways["copied"]) | set(ways["in_place"]),
                   key=lambda n: -abs(ways["copied"].get(n, 0) - ways["in_place"].get(n, 0)))
    print("totals ms: " + ", ".join(f"{w} {sum(t.values()):.4f}" for w, t in ways.items()))
    for name in names[:14]:
        print(f"{ways['copied'].get(name, 0):.4f} {ways['in_place'].get(name, 0):.4f}  {name}")
    return ways


if __name__ == "__main__":
    main()
