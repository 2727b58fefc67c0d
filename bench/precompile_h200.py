"""Issue 34 part 4: what compiling every layer's Triton candidates up front in worker processes
(sartor/tactics/compile_pool.py) does to default-effort FP16 build time, in one device call.

    PYTHONPATH=. HF_HUB_OFFLINE=1 python bench/precompile_h200.py --out $OUT
        [--models resnet50,deeplabv3_mobilenet_v3_large] [--batch 8] [--budget-s 480] [--modes precompile]
    PYTHONPATH=. python bench/precompile_h200.py --out out/pc --device cpu --size 32 --models resnet50
        # a dry run of the script itself (on the CPU the step never runs: both builds are the same)

Each model (gpu_zoo.py's: random seeded weights, nothing downloaded, ONNX opset 17) is built FP16
at a static batch (`--batch`, default 8), default effort, each build in a fresh process with an
empty Triton cache directory of its own: once with the step (SARTOR_COMPILE_WORKERS unset: the
CPU count, at most 16) and once without (SARTOR_COMPILE_WORKERS=0, the per-layer threads alone).
Builds with the step run first, then those without, cheapest model first; a build is not started
when the budget left is below its estimate, and one that runs past the budget is stopped: the
results say which.

Per build: build and stage seconds, the tactics stage by family (compile and timing seconds), the
step's own line (kernels recorded, cached, compiled, failed, under another key), Triton compiles in
the building process with their cache hits, and each layer's tactic. Per model: whether the two
builds chose the same tactics (timing noise can move a near tie; each differing layer is listed
with both builds' timings of both winners). Written to $OUT/precompile_h200.json as it goes,
printed last.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before timm imports huggingface_hub: never go online

ROOT = Path(__file__).resolve().parents[1]
BENCH = Path(__file__).resolve().parent
RESULTS = "precompile_h200.json"
WORKERS_ENV = "SARTOR_COMPILE_WORKERS"
# Seconds a build is expected to take before one has run (H200, Triton 3.6, the per-layer threads:
# the profiles plus the stages around tactics); a measured build of the model replaces them.
FIRST_ESTIMATE_S = {"resnet50": 80.0, "deeplabv3_mobilenet_v3_large": 200.0, "convnextv2_atto": 100.0}
DEFAULT_ESTIMATE_S = 150.0
MARGIN_S = 10.0


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--models", default="resnet50,deeplabv3_mobilenet_v3_large")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--size", type=int, default=224)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--budget-s", type=float, default=480.0)
    parser.add_argument("--modes", default="precompile,threads",
                        help="precompile (the step on), threads (SARTOR_COMPILE_WORKERS=0), or both")
    parser.add_argument("--child", nargs=4, metavar=("ONNX", "MODE", "RESULT", "WORK"), help=argparse.SUPPRESS)
    return parser.parse_args(argv)


# ---- the build, in a fresh process ---------------------------------------------------------------

class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _count_compiles() -> dict:
    """Triton compiles in this process (a cache hit loads a binary; a miss compiles here)."""
    counts = {"hits": 0, "misses": 0}
    try:
        from triton import knobs
    except ImportError:
        return counts

    def listener(**event) -> None:
        counts["hits" if event.get("cache_hit") else "misses"] += 1
    knobs.compilation.listener = listener
    return counts


def _layer(layer: dict) -> dict:
    """A timed layer's winner (the fastest of its timings: what selection chose), what the engine
    runs (the eager check may have replaced it) and its timings."""
    timings = layer["tactic_timings_ms"]
    return {"winner": min(timings, key=timings.get), "runs": layer["tactic"], "timings_ms": timings}


def child(onnx: str, mode: str, result_path: str, work: str, args: argparse.Namespace) -> None:
    sys.path.insert(0, str(ROOT))
    import sartor
    lines = _Lines()
    logger = logging.getLogger("sartor.tactics")
    logger.addHandler(lines)
    logger.setLevel(logging.DEBUG)
    compiles = _count_compiles()
    shape = {"input": (args.batch, 3, args.size, args.size)}
    started = time.perf_counter()
    result = sartor.build(onnx, str(Path(work) / f"{mode}.plan"), device=args.device, precision="fp16",
                          min_shapes=shape, opt_shapes=shape, max_shapes=shape)
    report = {"mode": mode, "workers_env": os.environ.get(WORKERS_ENV),
              "build_s": round(time.perf_counter() - started, 2),
              "stage_s": result.stage_seconds, "tactic_s": result.tactic_seconds,
              "precompile": [line for line in lines.lines if line.startswith("precompile")],
              "triton_compiles": compiles,
              "layers": {layer["name"]: _layer(layer) for layer in result.header["layers"]
                         if layer.get("tactic_timings_ms")}}
    Path(result_path).write_text(json.dumps(report))


def run_build(arch: str, onnx: Path, mode: str, args: argparse.Namespace, work: Path, timeout: float) -> dict:
    """One build in a fresh process with an empty Triton cache; its report, or why there is none."""
    cache = Path(tempfile.mkdtemp(prefix=f"triton_{arch}_{mode}_", dir=work))
    result = work / f"{arch}_{mode}.json"
    env = dict(os.environ, TRITON_CACHE_DIR=str(cache), PYTHONPATH=os.pathsep.join([str(ROOT), str(BENCH)]))
    env.pop("TRITON_INTERPRET", None)
    if mode == "threads":
        env[WORKERS_ENV] = "0"
    else:
        env.pop(WORKERS_ENV, None)
    command = [sys.executable, __file__, "--out", args.out, "--batch", str(args.batch), "--size", str(args.size),
               "--device", args.device, "--child", str(onnx), mode, str(result), str(work)]
    started = time.perf_counter()
    try:
        run = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        return {"mode": mode, "stopped": f"past the budget ({timeout:.0f} s left for it)",
                "wall_s": round(time.perf_counter() - started, 1)}
    if run.returncode != 0 or not result.exists():
        return {"mode": mode, "error": run.stderr[-2000:], "wall_s": round(time.perf_counter() - started, 1)}
    report = json.loads(result.read_text())
    report["wall_s"] = round(time.perf_counter() - started, 1)
    return report


# ---- the comparison ------------------------------------------------------------------------------

def compare_tactics(with_step: dict, without: dict) -> dict:
    """Whether both builds chose the same tactic per layer; each differing layer with both builds'
    times of both winners (a near tie that timing noise moved reads as two close pairs)."""
    a, b = with_step.get("layers", {}), without.get("layers", {})
    differing = {}
    for name in sorted(set(a) & set(b)):
        mine, theirs = a[name]["winner"], b[name]["winner"]
        if mine != theirs:
            differing[name] = {"precompile": [mine, a[name]["timings_ms"].get(mine), a[name]["timings_ms"].get(theirs)],
                               "threads": [theirs, b[name]["timings_ms"].get(theirs), b[name]["timings_ms"].get(mine)]}
    return {"layers": len(set(a) & set(b)), "identical": not differing and set(a) == set(b),
            "same_layers_timed": set(a) == set(b), "differing": differing}


def export(arch_name: str, args: argparse.Namespace, work: Path) -> Path:
    sys.path.insert(0, str(BENCH))
    import gpu_zoo
    arch = gpu_zoo.BY_NAME[arch_name]
    return gpu_zoo.export_onnx(arch, gpu_zoo.make_model(arch, args.size), args.size, work)


def family_table(report: dict) -> str:
    rows = [f"  {'family':<22} {'seconds':>8} {'compile':>8} {'timing':>8} {'cands':>6}"]
    for family, row in report.get("tactic_s", {}).items():
        rows.append(f"  {family:<22} {row['seconds']:>8.1f} {row['compile_s']:>8.1f} {row['time_s']:>8.1f} "
                    f"{row['candidates']:>6}")
    return "\n".join(rows)


def print_summary(results: dict) -> None:
    print(f"versions: {results['versions']}; {results['cpus']} CPUs; {results['seconds']} s in all")
    for arch, entry in results["models"].items():
        print(f"== {arch}")
        for mode in ("precompile", "threads"):
            report = entry.get(mode)
            if report is None:
                print(f"{mode}: not run ({entry.get('skipped', {}).get(mode, 'budget')})")
                continue
            if "build_s" not in report:
                print(f"{mode}: {report.get('stopped') or report.get('error', '')[-600:]}")
                continue
            stages = ", ".join(f"{k} {v:.1f}" for k, v in report["stage_s"].items())
            print(f"{mode}: build {report['build_s']:.1f} s (wall {report['wall_s']:.1f} s); stages: {stages}")
            print(f"  triton compiles in the builder: {report['triton_compiles']}; {' | '.join(report['precompile'])}")
            print(family_table(report))
        if "tactics" in entry:
            same = entry["tactics"]
            print(f"tactics identical: {same['identical']} ({len(same['differing'])} of {same['layers']} layers "
                  f"differ; "
                  f"[winner, its ms, the other build's winner's ms] per build)")
            for name, row in list(same["differing"].items())[:12]:
                print(f"  {name}: precompile {row['precompile']}, threads {row['threads']}")


def versions(device: str) -> dict:
    import torch
    import triton
    gpu = torch.cuda.get_device_name(0) if device == "cuda" and torch.cuda.is_available() else None
    return {"torch": torch.__version__, "triton": triton.__version__, "gpu": gpu, "python": sys.version.split()[0]}


def main() -> None:
    args = parse_args()
    if args.child:
        child(*args.child, args)
        return
    started = time.perf_counter()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="sartor_precompile_"))
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    results = {"argv": sys.argv[1:], "cpus": len(os.sched_getaffinity(0)), "versions": versions(args.device),
               "models": {m: {} for m in models}}

    def save() -> None:
        results["seconds"] = round(time.perf_counter() - started, 1)
        (out / RESULTS).write_text(json.dumps(results, indent=1))

    onnx = {}
    for arch in models:
        t0 = time.perf_counter()
        onnx[arch] = export(arch, args, work)
        results["models"][arch]["export_s"] = round(time.perf_counter() - t0, 1)
    save()
    estimate = {arch: FIRST_ESTIMATE_S.get(arch, DEFAULT_ESTIMATE_S) for arch in models}
    order = sorted(models, key=estimate.get)
    for mode in [m.strip() for m in args.modes.split(",") if m.strip()]:
        for arch in order:
            left = args.budget_s - (time.perf_counter() - started)
            guess = estimate[arch] if mode == "threads" or args.device != "cuda" else estimate[arch] / 2
            if left < guess + MARGIN_S:
                why = f"{left:.0f} s left, about {guess:.0f} s needed"
                results["models"][arch].setdefault("skipped", {})[mode] = why
                continue
            report = run_build(arch, onnx[arch], mode, args, work, left - MARGIN_S)
            results["models"][arch][mode] = report
            if mode == "precompile" and "build_s" in report:
                estimate[arch] = max(estimate[arch], report["build_s"])
            save()
    for arch in models:
        entry = results["models"][arch]
        if "build_s" in entry.get("precompile", {}) and "build_s" in entry.get("threads", {}):
            entry["tactics"] = compare_tactics(entry["precompile"], entry["threads"])
    save()
    print_summary(results)


if __name__ == "__main__":
    main()
