"""Issue 5, part 5: do several execution contexts of one engine, each on its own CUDA stream, run
concurrently? One device call: build (or reuse) one engine, then for K = 1, 2, 4 contexts run each
context in its own thread replaying its CUDA graph for a fixed time, and report the aggregate
throughput against K = 1 in the same process.

    PYTHONPATH=. python bench/concurrent_contexts.py --out $OUT [--model resnet50] [--batch 8] \
        [--contexts 1,2,4] [--seconds 3] [--plan existing.plan]

Small batches are where concurrency can pay (one context leaves SMs idle between kernels); at
large batch one context already fills the GPU, so the aggregate should stay flat.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import sartor  # noqa: E402
from h200_models import export_classifier, versions  # noqa: E402


def run_contexts(engine, input_name: str, x: torch.Tensor, count: int, seconds: float) -> dict:
    contexts = [engine.context() for _ in range(count)]
    for ctx in contexts:  # capture each context's CUDA graph before timing
        for _ in range(3):
            ctx.run({input_name: x})
    torch.cuda.synchronize()
    done = [0] * count
    start = threading.Barrier(count + 1)
    stop_at = [0.0]

    def worker(i: int) -> None:
        ctx = contexts[i]
        start.wait()
        while time.perf_counter() < stop_at[0]:
            ctx.run({input_name: x})
            done[i] += 1
        ctx.stream.synchronize()

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(count)]
    for t in threads:
        t.start()
    t0 = time.perf_counter()
    stop_at[0] = t0 + seconds
    start.wait()
    for t in threads:
        t.join()
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - t0
    images = sum(done) * x.shape[0]
    return {"contexts": count, "runs": done, "seconds": round(elapsed, 3), "img_s": round(images / elapsed, 1)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.environ.get("OUT", "out"))
    parser.add_argument("--model", default="resnet50")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--contexts", default="1,2,4")
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--plan", type=Path, default=None, help="an existing engine (input 'input', 224)")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path("/tmp/sartor_concurrent")
    work.mkdir(exist_ok=True)
    shape = (args.batch, 3, 224, 224)
    plan = args.plan
    if plan is None:
        onnx = export_classifier(args.model, work)
        plan = work / f"{args.model}_b{args.batch}.plan"
        shapes = {"input": shape}
        sartor.build(str(onnx), str(plan), device="cuda", precision="fp16", min_shapes=shapes, opt_shapes=shapes,
                     max_shapes=shapes)
    engine = sartor.load(str(plan))
    x = torch.rand(*shape, device="cuda")
    results = {"versions": versions(), "model": args.model, "batch": args.batch, "rows": []}
    for count in (int(c) for c in args.contexts.split(",")):
        row = run_contexts(engine, "input", x, count, args.seconds)
        results["rows"].append(row)
        print(json.dumps(row), flush=True)
        (out / "concurrent.json").write_text(json.dumps(results, indent=1))
    single = results["rows"][0]["img_s"]
    for row in results["rows"]:
        row["vs_one_context"] = round(row["img_s"] / single, 3)
    (out / "concurrent.json").write_text(json.dumps(results, indent=1))
    print(json.dumps(results["rows"]))


if __name__ == "__main__":
    main()
