"""Issues 5 and 31: an engine loads and runs its first inference on a fresh machine (empty Triton
cache) in ≤ 2 s, because the compiled kernels travel in the engine file.

One device call:

    PYTHONPATH=. python bench/load_cold.py --out $OUT [--batch 1] [--onnx-dir .carry]
        [--engine resnet50:fp16 --engine resnet50:int8 --engine yolov8n:int8 ...] [--no-compare]
        [--lazy-launchers] [--repeat N]

Builds each engine twice (with embedded kernels, then, unless --no-compare, with --no-embed-kernels
from the same timing cache, so both run the same tactics), then loads each in fresh processes, each with
its own TRITON_CACHE_DIR, and measures import, load, first and second inference, how many kernels
Triton compiled (its compilation listener: cache misses) and what it wrote in the cache:

  cold             an empty cache: a machine that never ran Triton
  cold_host_warm   a cache holding only Triton's host modules (the cuda_utils/launcher .so that
                   Triton compiles with the C compiler once per machine), copied from the cold run:
                   isolates the kernel JIT from that one-time host build
  cold_lazy        (--lazy-launchers) an empty cache, with load leaving the host modules to Triton's
                   first launches, one at a time (SARTOR_NO_LAUNCHER_BUILD=1); in `cold`, load builds
                   them in parallel (runtime/launchers.py)

--repeat N runs cold (and cold_lazy) N times, each in a new process with new, empty caches: `runs`
keeps the first, `repeats` all of them.

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
# Set in a run's environment: load leaves Triton's host modules to its first launches (runtime/launchers.py).
LAZY_LAUNCHERS_ENV = "SARTOR_NO_LAUNCHER_BUILD"
# model: (input name, H×W, ImageNet-normalised calibration images)
MODELS = {"resnet50": ("input", 224, True), "resnet18": ("input", 224, True), "yolov8n": ("images", 640, False)}


def key_parts(src) -> dict:
    """What Triton's cache key is made of for one compile (ASTSource.hash's parts), to tell which
    part differs when an embedded kernel misses."""
    fn = getattr(src, "fn", None)
    return {"name": getattr(fn, "__name__", "?"), "fn_cache_key": getattr(fn, "cache_key", None),
            "attrs": repr(getattr(src, "attrs", None)), "signature": repr(getattr(src, "signature", None)),
            "constants": repr(sorted((str(k), repr(v)) for k, v in (getattr(src, "constants", None) or {}).items()))}


def jit_keys() -> dict:
    """Every sartor Triton function whose cache key this process computed: its key, the parts of
    it that are its own (source, first line, constexpr globals) and the functions it calls."""
    import hashlib as _hashlib

    from triton.runtime.jit import JITFunction
    found = {}
    for name, module in list(sys.modules.items()):
        if module is None or not name.startswith("sartor."):
            continue
        for attr, value in list(vars(module).items()):
            for _ in range(4):
                if isinstance(value, JITFunction):
                    break
                value = getattr(value, "fn", None)
            if not isinstance(value, JITFunction) or value.hash is None:
                continue
            globals_seen = getattr(value, "used_global_vals", {}) or {}
            found[f"{name}.{attr}"] = {
                "hash": value.hash, "line": value.starting_line_number,
                "src": _hashlib.sha256(value.src.encode()).hexdigest()[:16],
                "globals": sorted(f"{k[0]}={v[0]!r}" for k, v in globals_seen.items())}
    return found


def key_listener(events: list):
    def listener(**event):
        row = key_parts(event["src"])
        row["cache_hit"] = event["cache_hit"]
        row["hash"] = event["metadata"].get("hash")
        events.append(row)
    return listener


def host_module_files() -> int:
    """Triton's host modules (.so) in this process's Triton cache: a first run that adds some built them."""
    return len(list(Path(os.environ["TRITON_CACHE_DIR"]).glob("*/*.so")))


def child(plan: str, out_npy: str, batch: int, model: str) -> None:
    """One cold load in this (fresh) process: prints one JSON line."""
    t0 = time.perf_counter()
    import numpy as np
    import torch
    import triton
    events = {"compiled": [], "cache_hits": 0}

    keys: list = []
    record_key = key_listener(keys)

    def listener(**event):
        record_key(**event)
        if event["cache_hit"]:
            events["cache_hits"] += 1
        else:
            events["compiled"].append(event["metadata"].get("name"))
    triton.knobs.compilation.listener = listener
    import sartor
    torch.cuda.init()
    import_s = time.perf_counter() - t0
    name, size, _ = MODELS[model]
    x = torch.from_numpy(np.random.default_rng(0).random((batch, 3, size, size), dtype=np.float32)).cuda()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    engine = sartor.load(plan)
    load_s = time.perf_counter() - t0
    host_modules_after_load = host_module_files()
    ctx = engine.context()
    t0 = time.perf_counter()
    out = ctx.run({name: x})
    torch.cuda.synchronize()
    first_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    ctx.run({name: x})
    torch.cuda.synchronize()
    second_s = time.perf_counter() - t0
    np.save(out_npy, next(iter(out.values())).float().cpu().numpy())
    report, host = engine.kernels_installed, engine.host_modules
    print(json.dumps({"import_s": round(import_s, 3), "load_s": round(load_s, 3), "first_inference_s": round(first_s, 3),
                      "second_inference_s": round(second_s, 4), "load_plus_first_s": round(load_s + first_s, 3),
                      "kernels_compiled": len(events["compiled"]), "compiled_names": sorted(set(events["compiled"])),
                      "kernel_cache_hits": events["cache_hits"], "keys": keys,
                      "jit_keys": jit_keys(),
                      "installed": None if report is None else len(report.installed),
                      "already_cached": None if report is None else len(report.present),
                      "install_note": None if report is None else report.describe(),
                      "host_modules_at_load_s": None if host is None else round(host.seconds, 3),
                      "host_modules": None if host is None else {
                          "launchers": host.launchers, "kernels": host.kernels, "ready": host.ready,
                          "failed": host.failed, "pending": host.pending, "note": host.describe()},
                      "host_modules_in_cache": {"after_load": host_modules_after_load,
                                                "after_first": host_module_files()}}))


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


def fresh_cache(directory: Path, host_modules_from: Path | None = None) -> Path:
    """A new Triton cache, empty or holding only the host modules of the cache `host_modules_from`."""
    directory.mkdir()
    if host_modules_from is not None:
        seed_host_modules(host_modules_from, directory)
    return directory


def cold_load(plan: Path, cache: Path, out_npy: Path, batch: int, model: str, extra_env: dict | None = None) -> dict:
    # The engine's kernels install into sartor's private cache (runtime/kernel_cache.py): a fresh one
    # per run beside Triton's, so that every run starts as cold as its Triton cache.
    private = cache.parent / f"{cache.name}.sartor"
    shutil.rmtree(private, ignore_errors=True)
    env = dict(os.environ, TRITON_CACHE_DIR=str(cache), SARTOR_CACHE_DIR=str(private), PYTHONPATH=str(ROOT))
    env.pop("TRITON_INTERPRET", None)
    env.pop(LAZY_LAUNCHERS_ENV, None)
    env.update(extra_env or {})
    t0 = time.perf_counter()
    run = subprocess.run([sys.executable, __file__, "--child", str(plan), str(out_npy), "--batch", str(batch),
                          "--child-model", model],
                         env=env, capture_output=True, text=True, timeout=400, check=False)
    wall = time.perf_counter() - t0
    if run.returncode != 0:
        return {"error": run.stderr[-4000:]}
    row = json.loads(run.stdout.strip().splitlines()[-1])
    row.update(process_wall_s=round(wall, 2), cache_after=cache_contents(cache),
               private_kernel_entries=len(list(private.glob("kernels/*/*/__grp__*.json"))))
    return row


def calibration_file(work: Path, model: str) -> Path:
    """Street scenes, half at night, as the model reads them: what an INT8 build calibrates on."""
    import numpy as np
    from h200_int8 import scene_images
    _, size, imagenet = MODELS[model]
    path = work / f"calib_{model}.npy"
    if not path.exists():
        np.save(path, scene_images(32, 50_000, size=size, imagenet=imagenet))
    return path


def build_engines(work: Path, onnx: Path, batch: int, model: str, precision: str, compare: bool,
                  effort: int | None = None) -> dict:
    import sartor
    input_name, size, _ = MODELS[model]
    shapes = {input_name: (batch, 3, size, size)}
    timing = work / f"timing_{model}_{precision}.json"
    timing.unlink(missing_ok=True)
    extra = {} if effort is None else {"builder_effort": effort}
    if precision == "int8":
        extra.update(calib=str(calibration_file(work, model)), calib_size=32,
                     calib_cache=str(work / f"calib_cache_{model}.json"))
    built = {}
    for name, embed in (("embedded", True), ("not_embedded", False))[:2 if compare else 1]:
        plan = work / f"{model}_{precision}_b{batch}_{name}.plan"
        import triton
        build_keys: list = []
        triton.knobs.compilation.listener = key_listener(build_keys)
        t0 = time.perf_counter()
        result = sartor.build(str(onnx), str(plan), device="cuda", precision=precision, min_shapes=shapes,
                              opt_shapes=shapes, max_shapes=shapes, timing_cache=str(timing), embed_kernels=embed,
                              **extra)
        record = result.header.get("kernels") or {}
        built[name] = {"plan": plan, "build_s": round(time.perf_counter() - t0, 1),
                       "file_bytes": plan.stat().st_size, "kernels_stage_s": result.stage_seconds.get("kernels"),
                       "kernel_entries": len(record.get("entries") or []), "kernel_bytes": record.get("bytes", 0),
                       "kernel_names": sorted({e["name"] for e in record.get("entries") or []}),
                       "launcher_signatures": len({json.dumps(e.get("signature")) for e in record.get("entries") or []
                                                   if e.get("signature") is not None}),
                       "log": [line for line in result.log if line.startswith("kernels:")],
                       "tactics": sorted({layer["tactic"] for layer in result.header["layers"]}),
                       "build_keys": build_keys, "jit_keys": jit_keys()}
        triton.knobs.compilation.listener = None
    return built


def key_misses(build_keys: list, run_keys: list) -> list:
    """For each kernel compiled at first run: which key parts differ from the nearest compile of the
    same kernel during the build (the one differing in the fewest parts)."""
    parts = ("fn_cache_key", "attrs", "signature", "constants")
    found = []
    for row in run_keys:
        if row["cache_hit"]:
            continue
        same_name = [b for b in build_keys if b["name"] == row["name"]]
        if not same_name:
            found.append({"name": row["name"], "differs": "no build-time compile of this kernel"})
            continue
        nearest = min(same_name, key=lambda b: sum(b[k] != row[k] for k in parts))
        found.append({"name": row["name"], "differs": {k: [nearest[k], row[k]] for k in parts if nearest[k] != row[k]}})
    return found


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.environ.get("OUT", "out"))
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--onnx-dir", type=Path, default=None, help="where resnet50.onnx is (or is exported to)")
    parser.add_argument("--engine", action="append", default=[], metavar="MODEL:PRECISION",
                        help=f"models: {', '.join(MODELS)}; precisions fp16, int8 (default resnet50:fp16)")
    parser.add_argument("--no-compare", action="store_true", help="skip the engine without embedded kernels")
    parser.add_argument("--effort", type=int, default=None, help="--builder-effort of the builds (default: the builder's)")
    parser.add_argument("--lazy-launchers", action="store_true",
                        help=f"also run each engine cold with {LAZY_LAUNCHERS_ENV}=1 (host modules built at "
                             f"first launch)")
    parser.add_argument("--repeat", type=int, default=1, help="cold runs of each kind (each with new, empty caches)")
    parser.add_argument("--child", nargs=2, metavar=("PLAN", "OUT_NPY"), help=argparse.SUPPRESS)
    parser.add_argument("--child-model", default="resnet50", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child[0], args.child[1], args.batch, args.child_model)
        return
    import numpy as np
    sys.path.insert(0, str(ROOT))
    sys.path.insert(0, str(ROOT / "bench"))
    from h200_models import export_classifier, versions
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="load_cold_"))
    results = {"versions": versions(), "batch": args.batch, "builder_effort": args.effort, "target_s": TARGET_SECONDS, "engines": {}}
    for spec in args.engine or ["resnet50:fp16"]:
        model, precision = spec.split(":")
        if model.startswith("resnet"):
            onnx = export_classifier(model, args.onnx_dir or work)
        else:
            onnx = (args.onnx_dir or ROOT / ".carry") / f"{model}.onnx"
        built = build_engines(work, onnx, args.batch, model, precision, not args.no_compare, args.effort)
        runs = {}
        outs = work / "outputs"
        outs.mkdir(exist_ok=True)
        repeats: dict = {}

        def record(run: str, row: dict) -> None:
            repeats.setdefault(run, []).append(row)
            runs.setdefault(run, row)
        for name, info in built.items():
            for attempt in range(args.repeat):
                label = f"{spec}_{name}_{attempt}".replace(":", "_")
                cold_cache = fresh_cache(work / f"cache_{label}_cold")
                record(f"{name}/cold", cold_load(info["plan"], cold_cache, outs / f"{label}_cold.npy", args.batch,
                                                 model))
                if args.lazy_launchers:
                    record(f"{name}/cold_lazy", cold_load(info["plan"], fresh_cache(work / f"cache_{label}_lazy"),
                                                          outs / f"{label}_lazy.npy", args.batch, model,
                                                          {LAZY_LAUNCHERS_ENV: "1"}))
                if attempt == 0:  # the reference: Triton's host modules built before the process starts
                    host_warm = fresh_cache(work / f"cache_{label}_host", cold_cache)
                    record(f"{name}/cold_host_warm", cold_load(info["plan"], host_warm, outs / f"{label}_host.npy",
                                                               args.batch, model))
            info["plan"] = str(info["plan"])
        outputs = [np.load(p) for p in sorted(outs.glob("*.npy"))]
        shutil.rmtree(outs)
        embedded = runs.get("embedded/cold", {})
        results["engines"][spec] = {"key_misses": key_misses(built["embedded"].get("build_keys", []),
                                                             embedded.get("keys", [])),
            "built": built, "runs": runs,
            "outputs_identical": bool(outputs) and all(np.array_equal(outputs[0], o) for o in outputs[1:]),
            # cuDNN's algorithm search runs again in each fresh process and may pick another algorithm
            # (another summation order): a spread at FP16 rounding is expected, a wrong kernel is not.
            "outputs_max_relative_spread": max((float(np.abs(o - outputs[0]).max() / (np.abs(outputs[0]).max() or 1.0))
                                                for o in outputs[1:]), default=0.0),
            "embedded_cold_compiled_nothing": embedded.get("kernels_compiled") == 0,
            "embedded_cold_meets_target": embedded.get("load_plus_first_s", float("inf")) <= TARGET_SECONDS,
            "load_plus_first_s": {run: [row.get("load_plus_first_s") for row in rows] for run, rows in repeats.items()},
            "repeats": repeats,
        }
        (out / "load_cold.json").write_text(json.dumps(results, indent=1) + "\n")
    print(json.dumps(results, indent=1))
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
