"""Where an engine spends its time, for one device call: sartor's layers timed one by one (CUDA
events around each step, no CUDA graph) and summed per op type, then the top GPU kernels of
sartor and of the PyTorch peer (torch.compile default mode) from torch.profiler.

    PYTHONPATH=. python bench/profile_engine.py --model yolov8n --batch 32 [--onnx-dir .carry]
        [--precision fp16|int8|fp8] [--compiled-peer]

INT8 and FP8 engines are calibrated on 64 street scenes (bench/h200_int8.py's generator), as in
bench/h200_table.py. The slowest steps are listed with the tactics timed for them and why any
candidate was rejected.

Models are those of bench/h200_table.py. A diagnosis tool: its figures are not benchmark results
(no graph replay, and events between steps include the launch gaps).
"""
from __future__ import annotations

import argparse
import collections
import sys
import warnings
from pathlib import Path

import torch

warnings.filterwarnings("ignore")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import sartor  # noqa: E402
from h200_table import CLASSIFIERS, SPEC, onnx_path, torch_model  # noqa: E402
from sartor.runtime.context import ExecutionContext  # noqa: E402


def top_kernels(fn, label: str, rows: int) -> None:
    from torch.profiler import ProfilerActivity, profile
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    # Work on the device only: the runtime and driver calls that launched it take no device time.
    events = [e for e in prof.key_averages() if e.device_time_total > 0]
    total = sum(e.device_time_total for e in events)
    print(f"== {label}: {total / 1e3:.3f} ms of kernels, {sum(e.count for e in events)} launches")
    for e in sorted(events, key=lambda e: -e.device_time_total)[:rows]:
        print(f"  {e.device_time_total / 1e3:8.3f} ms  x{e.count:4d}  {e.key[:120]}")


def step_times(ctx: ExecutionContext, feeds: dict, repeats: int = 5) -> list[tuple[str, str, float, str]]:
    """(op type, node name, median ms, tactic) per device step."""
    executor = ctx.engine.executor
    samples: dict[int, list[float]] = collections.defaultdict(list)
    for _ in range(repeats):
        events: dict[int, tuple] = {}

        def before(index, step, args):
            if not step.on_host:
                start = torch.cuda.Event(enable_timing=True)
                start.record()
                events[index] = (start,)

        def observe(index, step, outputs):
            if index in events:
                end = torch.cuda.Event(enable_timing=True)
                end.record()
                events[index] = (events[index][0], end)

        with torch.inference_mode():
            executor.run(feeds, ctx.memo_for(("profile",)), observe=observe, before=before)
        torch.cuda.synchronize()
        for index, (start, end) in events.items():
            samples[index].append(start.elapsed_time(end))
    rows = []
    for index, values in samples.items():
        step = executor.steps[index]
        values.sort()
        rows.append((step.node.op_type, step.node.name, values[len(values) // 2], str(step.attrs.get("tactic", ""))))
    return rows


def kernels_by_step(ctx: ExecutionContext, feeds: dict, rows: int, kernel_device=None) -> None:
    """Each step's kernel launches and their device time, from one profiled run without a graph.
    The run synchronizes after every step inside a profiler range named for it, so a kernel belongs
    to the range its start falls in (Triton's launches go through the driver API, which the
    profiler does not tie to the op that made them). Launches outside every step are the run's own
    (the feeds' layout change, outputs)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile, record_function
    kernel_device = DeviceType.CUDA if kernel_device is None else kernel_device  # CPU: to check this on a CPU engine
    executor = ctx.engine.executor
    memo = ctx.memo_for(("by-step",))
    open_ranges: dict[int, object] = {}

    synchronize = torch.cuda.synchronize if ctx.engine.device.type == "cuda" else (lambda: None)

    def before(index, step, args):
        synchronize()
        open_ranges[index] = record_function(f"sartor_step_{index}")
        open_ranges[index].__enter__()

    def observe(index, step, outputs):
        synchronize()
        open_ranges.pop(index).__exit__(None, None, None)

    with torch.inference_mode():
        for _ in range(2):  # the first run with a memo records where Concats are written in place
            executor.run(feeds, memo, observe=observe, before=before)
        synchronize()
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if ctx.engine.device.type == "cuda" else [])
        with profile(activities=activities) as prof:
            executor.run(feeds, memo, observe=observe, before=before)
            synchronize()
    events = prof.events()
    # A range appears twice on CUDA: the host's and its device-side copy, counted once, host side.
    spans = sorted((e.time_range.start, e.time_range.end, int(e.name.rsplit("_", 1)[1]))
                   for e in events if e.name.startswith("sartor_step_") and e.device_type == DeviceType.CPU)
    kernels = [e for e in events if e.device_type == kernel_device and not e.name.startswith("sartor_step_")]
    per_step: dict[int | None, list] = collections.defaultdict(list)
    for kernel in kernels:
        owner = next((index for start, end, index in spans if start <= kernel.time_range.start <= end), None)
        per_step[owner].append(kernel)
    print(f"== kernels by step: {len(kernels)} launches, {sum(k.time_range.elapsed_us() for k in kernels) / 1e3:.3f} ms, "
          f"over {len(spans)} steps")
    by_op: dict[str, list] = collections.defaultdict(lambda: [0, 0, 0.0])
    for _, _, index in spans:
        step = executor.steps[index]
        by_op[step.node.op_type][0] += 1
        by_op[step.node.op_type][1] += len(per_step[index])
        by_op[step.node.op_type][2] += sum(k.time_range.elapsed_us() for k in per_step[index])
    for op, (steps, launches, us) in sorted(by_op.items(), key=lambda kv: -kv[1][1]):
        print(f"  {op:14s} steps {steps:4d}  launches {launches:4d}  {us / 1e3:8.3f} ms")
    outside = per_step.get(None, [])
    print(f"  outside steps: {len(outside)} launches: " + ", ".join(sorted({k.name[:60] for k in outside})))
    print("== steps with most launches (launches, kernel ms, op, name, tactic: kernels)")
    ranked = sorted(spans, key=lambda span: -len(per_step[span[2]]))
    for _, _, index in ranked[:rows]:
        step = executor.steps[index]
        names = collections.Counter(k.name[:48] for k in per_step[index])
        print(f"  {len(per_step[index]):3d} {sum(k.time_range.elapsed_us() for k in per_step[index]) / 1e3:7.3f} "
              f"{step.node.op_type:10s} {step.node.name[:40]:40s} {str(step.attrs.get('tactic', ''))[:50]}: "
              + "; ".join(f"{n} x{c}" for n, c in names.most_common()))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="resnet50")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--precision", default="fp16")
    parser.add_argument("--onnx-dir", type=Path, default=None)
    parser.add_argument("--effort", type=int, default=None)
    parser.add_argument("--rows", type=int, default=25)
    parser.add_argument("--compiled-peer", action="store_true", help="also list torch.compile's kernels")
    parser.add_argument("--by-step", action="store_true",
                        help="also each step's kernel launches (one profiled run, synchronized step by step)")
    parser.add_argument("--layers-out", type=Path, default=None,
                        help="write every layer's op, tactic and the builder's time for it (ms) here, as JSON")
    args = parser.parse_args()
    torch.backends.cudnn.benchmark = True
    work = Path("/tmp/sartor_profile")
    work.mkdir(exist_ok=True)
    input_name, size = SPEC.get(args.model, ("input", 224))
    shape = (args.batch, 3, size, size)
    plan = work / f"{args.model}_{args.precision}_b{args.batch}.plan"
    shapes = {input_name: shape}
    calib = {}
    if args.precision in ("int8", "fp8"):
        import numpy as np
        from h200_int8 import scene_images
        # at the model's input size, normalised as it reads its input (as h200_table calibrates)
        np.save(work / "calib.npy", scene_images(64, 50_000, size, imagenet=args.model in CLASSIFIERS))
        calib = {"calib": str(work / "calib.npy"), "calib_size": 64}
    result = sartor.build(str(onnx_path(args.model, work, args.onnx_dir)), str(plan), device="cuda",
                          precision=args.precision, min_shapes=shapes, opt_shapes=shapes, max_shapes=shapes,
                          builder_effort=args.effort, **calib)
    layers = {layer["name"]: layer for layer in result.header["layers"]}
    if args.layers_out is not None:  # the builder's own timing of each chosen tactic: no launch gaps
        import json
        from compare_layers import header_layers
        args.layers_out.write_text(json.dumps(header_layers(result.header), indent=1))
    engine = sartor.load(str(plan))
    ctx = ExecutionContext(engine, use_cuda_graphs=False)
    x = torch.rand(shape, device="cuda")
    rows = step_times(ctx, {input_name: x})
    by_op: dict[str, list] = collections.defaultdict(lambda: [0.0, 0])
    for op, _, ms, _ in rows:
        by_op[op][0] += ms
        by_op[op][1] += 1
    print(f"== sartor steps, {args.model} b{args.batch} {args.precision}: {sum(r[2] for r in rows):.3f} ms "
          f"over {len(rows)} device steps")
    for op, (ms, count) in sorted(by_op.items(), key=lambda kv: -kv[1][0]):
        print(f"  {ms:8.3f} ms  x{count:4d}  {op}")
    print("== slowest steps")
    for op, name, ms, tactic in sorted(rows, key=lambda r: -r[2])[:args.rows]:
        print(f"  {ms:8.3f} ms  {op:14s} {name[:60]:60s} {tactic}")
        layer = layers.get(name, {})
        timings = sorted((layer.get("tactic_timings_ms") or {}).items(), key=lambda kv: kv[1])
        if timings:
            print("      timed: " + ", ".join(f"{t} {v:.3f}" for t, v in timings[:4]))
        for rejected, why in list((layer.get("tactic_rejected") or {}).items())[:3]:
            print(f"      rejected {rejected}: {why}")
    if args.by_step:
        kernels_by_step(ctx, {input_name: x}, args.rows)
    with torch.inference_mode():
        top_kernels(lambda: ctx.run({input_name: x}), "sartor kernels", args.rows)
        model = torch_model(args.model)
        if args.compiled_peer and model is not None:
            model = model.half().cuda().to(memory_format=torch.channels_last)
            xh = x.half().contiguous(memory_format=torch.channels_last)
            compiled = torch.compile(model)
            top_kernels(lambda: compiled(xh), "torch.compile kernels", args.rows)


if __name__ == "__main__":
    main()
