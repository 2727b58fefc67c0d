"""Issue 31 part 6 on the device: two engines sharing one GPU under `serve --memory-budget`.

Builds ResNet-50 FP16 (224, random settled weights) and the trained YOLOv8n of samples/yolo FP16
(640), both batch 1..B, then:
1. each engine alone in this process: the memory it declares (`Engine.memory_by_profile`: weights
   plus one context at the largest profile's max shapes) against what the CUDA caching allocator
   measures (bytes allocated once loaded, and the peak over a context's first run at the max batch,
   which captures its CUDA graph; the caller's input is made before and not counted);
2. a server (`sartor.serve.Server`, HTTP) over a repository holding both, with a budget that fits
   both with 5% to spare: both must be READY and answer a request;
3. the same with a budget that fits ResNet-50 and half of YOLOv8n: YOLOv8n must be refused with
   its one-line reason while ResNet-50 answers; the device memory the server holds is measured.

    PYTHONPATH=. python bench/h200_memory_budget.py --out $OUT [--batch 32]

Writes memory_budget.json under --out and prints a summary of it.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
YOLO_ONNX = ROOT / "samples" / "yolo" / "yolov8n_scenes.onnx"


def build(onnx: Path, plan: Path, name: str, size: int, batch: int, device: str) -> float:
    import sartor
    started = time.perf_counter()
    sartor.build(str(onnx), str(plan), device=device, precision="fp16" if device == "cuda" else "fp32",
                 builder_effort=1 if device == "cuda" else 0,
                 min_shapes={name: (1, 3, size, size)}, opt_shapes={name: (batch, 3, size, size)},
                 max_shapes={name: (batch, 3, size, size)})
    return round(time.perf_counter() - started, 1)


def mib(n: int) -> float:
    return round(n / (1 << 20), 1)


def alone(plan: Path, name: str, shape: tuple, device: str) -> dict:
    """What the engine declares against what the allocator measures (CUDA), in a clean allocator state."""
    import sartor
    cuda = device == "cuda"
    allocated = torch.cuda.memory_allocated if cuda else (lambda: 0)
    gc.collect()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    feeds = {name: torch.rand(shape, device=device)}  # the caller's, not the engine's: made before
    before = allocated()
    engine = sartor.load(str(plan), device=device)
    loaded = allocated() - before
    context = engine.context()
    context.run(feeds)
    if cuda:
        torch.cuda.synchronize()
    row = {"declared_bytes": engine.device_memory_bytes, "declared_mib": mib(engine.device_memory_bytes),
           "declared_by_profile": [{k: (mib(v) if k.endswith("_bytes") else v) for k, v in r.items()}
                                   for r in engine.memory_by_profile],
           "measured_loaded_mib": mib(loaded),
           "measured_after_first_run_mib": mib(allocated() - before),
           "measured_peak_mib": mib(torch.cuda.max_memory_allocated() - before) if cuda else None}
    row["declared_covers_peak"] = cuda and row["declared_mib"] >= row["measured_peak_mib"]
    del context, engine, feeds
    gc.collect()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    return row


def infer(url: str, model: str, name: str, shape: tuple) -> dict:
    """One v2 JSON request: its status and the first output's shape, or the server's error."""
    data = np.random.default_rng(0).random(shape, dtype=np.float32)
    body = json.dumps({"inputs": [{"name": name, "shape": list(shape), "datatype": "FP32",
                                   "data": data.ravel().tolist()}]}).encode()
    request = urllib.request.Request(f"http://{url}/v2/models/{model}/infer", body,
                                     {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            reply = json.loads(response.read())
        return {"status": response.status, "output_shape": reply["outputs"][0]["shape"]}
    except urllib.error.HTTPError as error:
        return {"status": error.code, "error": error.read().decode()[:400]}


def served(repo: Path, budget: int, feeds: dict, device: str) -> dict:
    from sartor.serve import ServeOptions, Server
    allocated = torch.cuda.memory_allocated if device == "cuda" else (lambda: 0)
    reserved = torch.cuda.memory_reserved if device == "cuda" else (lambda: 0)
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    before, before_reserved = allocated(), reserved()
    started = time.perf_counter()
    server = Server(ServeOptions(str(repo), http_port=0, grpc_port=None, metrics_port=None, poll_interval=None,
                                 memory_budget=budget)).start()
    try:
        ready_s = round(time.perf_counter() - started, 2)
        index = {row["name"]: {k: row.get(k) for k in ("state", "reason")} for row in server.index()}
        answers = {model: infer(server.http_url, model, name, shape) for model, (name, shape) in feeds.items()
                   if index.get(model, {}).get("state") == "READY"}
        held, held_reserved = allocated() - before, reserved() - before_reserved
        held_by = {model: mib(sum(server.repository.memory.held(model).values())) for model in feeds}
    finally:
        server.stop(grace=2.0)
    return {"budget_mib": mib(budget), "start_to_ready_s": ready_s, "index": index, "answers": answers,
            "reserved_by_model_mib": held_by, "measured_allocated_mib": mib(held),
            "measured_reserved_mib": mib(held_reserved)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.environ.get("OUT", "out"))
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--device", default="cuda", help="cpu: a dry run of the same steps (FP32, nothing measured)")
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT / "bench"))
    from h200_models import export_classifier, versions

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="memory_budget_"))
    models = {"resnet50": (export_classifier("resnet50", work), "input", 224),
              "yolov8n": (YOLO_ONNX, "images", 640)}
    results: dict = {"versions": versions() if args.device == "cuda" else {}, "batch": args.batch, "build_s": {}, "alone": {}}
    repo = work / "repo"
    feeds = {}
    for model, (onnx, name, size) in models.items():
        plan = work / f"{model}.plan"
        results["build_s"][model] = build(onnx, plan, name, size, args.batch, args.device)
        results["alone"][model] = alone(plan, name, (args.batch, 3, size, size), args.device)
        (repo / model / "1").mkdir(parents=True)
        shutil.copyfile(plan, repo / model / "1" / "model.plan")
        feeds[model] = (name, (1, 3, size, size))
        print(model, json.dumps(results["alone"][model]), flush=True)
    need = {m: row["declared_bytes"] for m, row in results["alone"].items()}
    results["fits_both"] = served(repo, int(1.05 * sum(need.values())), feeds, args.device)
    results["fits_one"] = served(repo, need["resnet50"] + need["yolov8n"] // 2, feeds, args.device)
    (out / "memory_budget.json").write_text(json.dumps(results, indent=1))
    print(summary(results))


def summary(results: dict) -> str:
    """A few lines of memory_budget.json: each engine's declared and measured memory, each server."""
    lines = [f"{model}: declared {row['declared_mib']} MiB; measured loaded {row['measured_loaded_mib']}, after the "
             f"first run {row['measured_after_first_run_mib']}, peak {row['measured_peak_mib']} MiB"
             for model, row in results["alone"].items()]
    for case in ("fits_both", "fits_one"):
        served = results[case]
        states = ", ".join(f"{m} {v['state']}" + (f" ({v['reason'][:120]})" if v["reason"] else "")
                           for m, v in served["index"].items())
        lines.append(f"{case}: budget {served['budget_mib']} MiB, ready in {served['start_to_ready_s']} s: {states}; "
                     f"answered {sorted(served['answers'])}; allocated {served['measured_allocated_mib']} MiB, "
                     f"reserved {served['measured_reserved_mib']} MiB")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
