"""Where Swin-T's batch-64 time goes, sartor against torch.compile (issue 34: Swin-T at batch 64
is the one zoo row slower than a peer). In one process on the GPU:

- sartor: the zoo's Swin-T (bench/gpu_zoo.py: same weights, export and FP16 default build, one
  profile at batch 64), its per-layer profile (every layer: op, tactic, median ms);
- torch.compile: timed as the zoo's peer ("reduce-overhead"), and its kernels (mode "default",
  the same kernels without the CUDA graph tree) under torch.profiler by total time; the same
  for eager FP16;
- totals: sartor's CUDA-graph replay, compile's and eager's medians.

    PYTHONPATH=. python bench/swin_profile.py --out $OUT [--model swin_tiny_patch4_window7_224 --batch 64]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import gpu_zoo  # noqa: E402

import sartor  # noqa: E402
from sartor.runtime.layer_profile import profile_layers  # noqa: E402


def kernel_table(fn, iterations: int = 5, top: int = 40) -> dict:
    """The CUDA kernels `fn` launches, by total device time over `iterations` calls after warm-up."""
    from torch.profiler import ProfilerActivity, profile
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iterations):
            fn()
        torch.cuda.synchronize()
    rows = []
    for event in prof.key_averages():
        device_us = getattr(event, "device_time_total", None) or getattr(event, "cuda_time_total", 0)
        if device_us:
            rows.append({"kernel": event.key[:140], "calls": event.count // iterations,
                         "ms_per_run": round(device_us / iterations / 1e3, 4)})
    rows.sort(key=lambda r: -r["ms_per_run"])
    return {"total_ms_per_run": round(sum(r["ms_per_run"] for r in rows), 4), "kernels": rows[:top],
            "kernel_count": sum(r["calls"] for r in rows)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "out")))
    parser.add_argument("--model", default="swin_tiny_patch4_window7_224")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--size", type=int, default=224)
    parser.add_argument("--no-compile", action="store_true")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    work = Path("/tmp/swin_profile")
    work.mkdir(exist_ok=True)
    result: dict = {"model": args.model, "batch": args.batch}
    save = lambda: (args.out / f"profile_{args.model}.json").write_text(json.dumps(result, indent=1))  # noqa: E731
    arch = next(a for a in gpu_zoo.ARCHITECTURES if a.name == args.model)
    model = gpu_zoo.make_model(arch, args.size)
    onnx = gpu_zoo.export_onnx(arch, model, args.size, work)
    shape = {gpu_zoo.INPUT: (args.batch, 3, args.size, args.size)}
    plan = work / f"{args.model}_b{args.batch}.plan"
    started = time.perf_counter()
    sartor.build(str(onnx), str(plan), device="cuda", precision="fp16", min_shapes=shape, opt_shapes=shape,
                 max_shapes=shape)
    result["build_s"] = round(time.perf_counter() - started, 1)
    engine = sartor.load(plan, device="cuda")
    ctx = engine.context()
    buffers = ctx.input_buffers(shape)
    buffers[gpu_zoo.INPUT].uniform_(0, 1)
    result["sartor"] = gpu_zoo.timed(lambda: ctx.run(buffers), args.batch, torch.device("cuda"), 100, 20)
    profile = profile_layers(engine, shape).to_json()
    result["sartor_layers"] = profile
    result["sartor_kernels"] = kernel_table(lambda: ctx.run(buffers))
    save()
    print(json.dumps(result["sartor"]), flush=True)
    x = torch.rand(args.batch, 3, args.size, args.size, device="cuda").half().contiguous(
        memory_format=torch.channels_last)
    peer = model.cuda().half().to(memory_format=torch.channels_last)
    with torch.inference_mode():
        result["eager_kernels"] = kernel_table(lambda: peer(x))
    save()
    if not args.no_compile:
        run, compile_s = gpu_zoo.compiled_runner(peer, x, "reduce-overhead")
        result["compile_s"] = round(compile_s, 1)
        result["compile"] = gpu_zoo.timed(run, args.batch, torch.device("cuda"), 100, 20)
        compiled = torch.compile(peer, mode="default", dynamic=False)  # the same kernels, no cudagraph tree
        with torch.inference_mode():
            result["compile_kernels"] = kernel_table(lambda: compiled(x))
        save()
        print(json.dumps(result["compile"]), flush=True)


if __name__ == "__main__":
    main()
