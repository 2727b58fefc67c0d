"""Issue 5, part 4: a ResNet-50 FP16 engine loads and runs its first inference on a fresh machine
(empty Triton cache) in ≤ 2 s, because the compiled kernels travel in the engine file.

One device call:

    PYTHONPATH=. python bench/load_cold.py --out $OUT [--batch 1] [--onnx-dir .carry]

Builds ResNet-50 FP16 twice (with embedded kernels, then with --no-embed-kernels from the same
timing cache, so both run the same tactics), then loads each engine in fresh processes, each with
its own TRITON_CACHE_DIR, and measures import, load, first and second inference, how many kernels
Triton compiled (its compilation listener: cache misses) and what it wrote in the cache:

  cold             an empty cache: a machine that never ran Triton
  cold_host_warm   a cache holding only Triton's host modules (the cuda_utils/launcher .so that
                   Triton compiles with the C compiler once per machine), copied from the cold run:
                   isolates the kernel JIT from that one-time host build

Writes load_cold.json (and prints it). The engines' outputs are compared with each other.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TARGET_SECONDS = 2.0
INPUT = "input"


def child(plan: str, out_npy: str, batch: int) -> None:
    """One cold load in this (fresh) process: prints one JSON line."""
    t0 = time.perf_counter()
    import numpy as np
    import torch
    import triton
    events = {"compiled": [], "cache_hits": 0}

    def listener(**event):
        if event["cache_hit"]:
            events["cache_hits"] += 1
        else:
            events["compiled"].append(event["metadata"].get("name"))
    triton.knobs.compilation.listener = listener
    import sartor
    torch.cuda.init()
    import_s = time.perf_counter() - t0
    x = torch.from_numpy(np.random.default_rng(0).random((batch, 3, 224, 224), dtype=np.float32)).cuda()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    engine = sartor.load(plan)
    load_s = time.perf_counter() - t0
    ctx = engine.context()
    t0 = time.perf_counter()
    out = ctx.run({INPUT: x})
    torch.cuda.synchronize()
    first_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    ctx.run({INPUT: x})
    torch.cuda.synchronize()
    second_s = time.perf_counter() - t0
    np.save(out_npy, next(iter(out.values())).float().cpu().numpy())
    report = engine.kernels_installed
    print(json.dumps({"import_s": round(import_s, 3), "load_s": round(load_s, 3), "first_inference_s": round(first_s, 3),
                      "second_inference_s": round(second_s, 4), "load_plus_first_s": round(load_s + first_s, 3),
                      "kernels_compiled": len(events["compiled"]), "compiled_names": sorted(set(events["compiled"])),
                      "kernel_cache_hits": events["cache_hits"],
                      "installed": None if report is None else len(report.installed),
                      "already_cached": None if report is None else len(report.present),
                      "install_note": None if report is None else report.describe()}))


def cache_contents(cache: Path) -> dict:
    """What Triton (and the install) left in a cache directory: kernel entries (with a group file)
    and host modules (.so), with their bytes."""
    kernels = [d for d in cache.iterdir() if d.is_dir() and any(d.glob("__grp__*.json"))]
    host = sorted({p.name for p in cache.glob("*/*.so")})
    return {"kernel_entries": len(kernels), "host_modules": host,
            "bytes": sum(p.stat().st_size for p in cache.rglob("*") if p.is_file())}


def seed_host_modules(source: Path, target: Path) -> None:
    for so in source.glob("*/*.so"):
        (target / so.parent.name).mkdir(parents=True, exist_ok=True)
        shutil.copy2(so, target / so.parent.name / so.name)


def cold_load(plan: Path, cache: Path, out_npy: Path, batch: int) -> dict:
    # The engine's kernels install into sartor's private cache (runtime/kernel_cache.py): a fresh one
    # per run beside Triton's, so that every run starts as cold as its Triton cache.
    private = cache.parent / f"{cache.name}.sartor"
    shutil.rmtree(private, ignore_errors=True)
    env = dict(os.environ, TRITON_CACHE_DIR=str(cache), SARTOR_CACHE_DIR=str(private), PYTHONPATH=str(ROOT))
    env.pop("TRITON_INTERPRET", None)
    t0 = time.perf_counter()
    run = subprocess.run([sys.executable, __file__, "--child", str(plan), str(out_npy), "--batch", str(batch)],
                         env=env, capture_output=True, text=True, timeout=400)
    wall = time.perf_counter() - t0
    if run.returncode != 0:
        return {"error": run.stderr[-4000:]}
    row = json.loads(run.stdout.strip().splitlines()[-1])
    row.update(process_wall_s=round(wall, 2), cache_after=cache_contents(cache),
               private_kernel_entries=len(list(private.glob("kernels/*/*/__grp__*.json"))))
    return row


def build_engines(work: Path, onnx: Path, batch: int) -> dict:
    import sartor
    shapes = {INPUT: (batch, 3, 224, 224)}
    timing = work / "timing.json"
    timing.unlink(missing_ok=True)
    built = {}
    for name, embed in (("embedded", True), ("not_embedded", False)):
        plan = work / f"resnet50_fp16_b{batch}_{name}.plan"
        t0 = time.perf_counter()
        result = sartor.build(str(onnx), str(plan), device="cuda", precision="fp16", min_shapes=shapes,
                              opt_shapes=shapes, max_shapes=shapes, timing_cache=str(timing), embed_kernels=embed)
        record = result.header.get("kernels") or {}
        built[name] = {"plan": plan, "build_s": round(time.perf_counter() - t0, 1),
                       "file_bytes": plan.stat().st_size, "kernels_stage_s": result.stage_seconds.get("kernels"),
                       "kernel_entries": len(record.get("entries") or []), "kernel_bytes": record.get("bytes", 0),
                       "kernel_names": sorted({e["name"] for e in record.get("entries") or []}),
                       "log": [line for line in result.log if line.startswith("kernels:")],
                       "tactics": sorted({layer["tactic"] for layer in result.header["layers"]})}
    return built


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.environ.get("OUT", "out"))
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--onnx-dir", type=Path, default=None, help="where resnet50.onnx is (or is exported to)")
    parser.add_argument("--child", nargs=2, metavar=("PLAN", "OUT_NPY"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child[0], args.child[1], args.batch)
        return
    import numpy as np
    sys.path.insert(0, str(ROOT))
    sys.path.insert(0, str(ROOT / "bench"))
    from h200_models import export_classifier, versions
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="load_cold_"))
    onnx = export_classifier("resnet50", args.onnx_dir or work)
    built = build_engines(work, onnx, args.batch)
    runs = {}
    for name, info in built.items():
        cold_cache = work / f"cache_{name}_cold"
        cold_cache.mkdir()
        runs[f"{name}/cold"] = cold_load(info["plan"], cold_cache, work / f"{name}_cold.npy", args.batch)
        host_warm = work / f"cache_{name}_host_warm"
        host_warm.mkdir()
        seed_host_modules(cold_cache, host_warm)
        runs[f"{name}/cold_host_warm"] = cold_load(info["plan"], host_warm, work / f"{name}_host.npy", args.batch)
        info["plan"] = str(info["plan"])
    outputs = [np.load(p) for p in sorted(work.glob("*.npy"))]
    embedded = runs.get("embedded/cold", {})
    result = {
        "versions": versions(), "batch": args.batch, "target_s": TARGET_SECONDS, "engines": built, "runs": runs,
        "outputs_identical": bool(outputs) and all(np.array_equal(outputs[0], o) for o in outputs[1:]),
        # cuDNN's algorithm search runs again in each fresh process and may pick another algorithm
        # (another summation order): a spread at FP16 rounding is expected, a wrong kernel is not.
        "outputs_max_relative_spread": max((float(np.abs(o - outputs[0]).max() / (np.abs(outputs[0]).max() or 1.0))
                                            for o in outputs[1:]), default=0.0),
        "embedded_cold_compiled_nothing": embedded.get("kernels_compiled") == 0,
        "embedded_cold_meets_target": embedded.get("load_plus_first_s", float("inf")) <= TARGET_SECONDS,
    }
    (out / "load_cold.json").write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
