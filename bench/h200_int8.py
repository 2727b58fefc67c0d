"""One device call: ResNet-50 FP16 and INT8 engines (Triton implicit-GEMM tactics) against PyTorch
eager FP16 channels-last + CUDA graph (and, with --peers, torch.compile reduce-overhead), at batch 1
and 256, in the same process; INT8 tensor-core engine against the exact INT8 emulation engine (same
calibration) and against FP32 on held-out images.

    PYTHONPATH=. python bench/h200_int8.py --out $OUT [--peers] [--effort 2]

Calibration and evaluation images are the sample detector's street scenes (rendered here, nothing
downloaded), resized to 224 and normalised as ImageNet models expect. The ResNet-50 has random
weights with settled BatchNorm statistics (see h200_models.settle_batchnorm). Writes int8.json
under --out and prints each result as it comes.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback
import warnings
from pathlib import Path

import numpy as np
import torch

warnings.filterwarnings("ignore")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "samples" / "detector"))

import sartor  # noqa: E402
from h200_models import compiled_runner, eager_graph_runner, export_classifier, versions  # noqa: E402
from sartor.tactics.select import timing_samples_ms  # noqa: E402

MEAN = np.array([0.485, 0.456, 0.406], dtype=np.float32).reshape(1, 3, 1, 1)
STD = np.array([0.229, 0.224, 0.225], dtype=np.float32).reshape(1, 3, 1, 1)


def _scene(job: tuple) -> np.ndarray:
    from PIL import Image
    from scenes import render_scene
    seed, lighting, size = job
    image, _ = render_scene(seed, lighting)
    image = image.convert("RGB").resize((size, size), Image.BILINEAR)
    return np.asarray(image, dtype=np.float32).transpose(2, 0, 1) / 255.0


def scene_images(count: int, seed: int, size: int = 224, imagenet: bool = True) -> np.ndarray:
    """Street scenes, half at night, as [count, 3, size, size] float32: normalised as ImageNet
    classifiers expect, or (`imagenet` off) in 0..1 as the detectors read them."""
    from concurrent.futures import ProcessPoolExecutor
    jobs = [(seed + i, "night" if i % 2 else "day", size) for i in range(count)]
    with ProcessPoolExecutor(max_workers=min(16, os.cpu_count() or 1)) as pool:
        images = np.stack(list(pool.map(_scene, jobs)))
    return ((images - MEAN) / STD).astype(np.float32) if imagenet else images


def stats(samples_ms: list[float], batch: int) -> dict:
    median = statistics.median(samples_ms)
    return {"median_ms": round(median, 4), "p99_ms": round(float(np.percentile(samples_ms, 99)), 4),
            "img_s": round(batch / median * 1e3, 1)}


def resnet50_compiled(batch: int):
    """torch.compile reduce-overhead on the peer's model: FP16, channels-last."""
    import torchvision
    torch.manual_seed(0)
    model = torchvision.models.resnet50(weights=None).eval().half().cuda().to(memory_format=torch.channels_last)
    x = torch.rand(batch, 3, 224, 224, device="cuda").half().contiguous(memory_format=torch.channels_last)
    return compiled_runner(model, x)


STEM = "/conv1/Conv"


def build_engine(onnx: Path, plan: Path, precision: str, batch: int, effort: int, calib: Path | None,
                 cache: Path, timing_cache: Path) -> dict:
    """precision: fp32, fp16, int8, or int8_stem_fp16 (INT8 with the 3-channel stem kept FP16)."""
    shapes = {"input": (batch, 3, 224, 224)}
    kwargs = {}
    if precision.startswith("int8"):
        kwargs = {"calib": str(calib), "calib_size": 64, "calib_cache": str(cache)}
        if precision == "int8_stem_fp16":
            kwargs["layer_precision"] = {STEM: "fp16"}
            precision = "int8"
    t0 = time.perf_counter()
    result = sartor.build(str(onnx), str(plan), device="cuda", precision=precision, min_shapes=shapes,
                          opt_shapes=shapes, max_shapes=shapes, builder_effort=effort,
                          timing_cache=str(timing_cache) if effort else None, **kwargs)
    return {"plan": plan.name, "build_s": round(time.perf_counter() - t0, 1), "layers": result.layers}


def tactic_summary(plan: Path) -> dict:
    engine = sartor.load(str(plan))
    wins: dict[str, int] = {}
    best_sum = 0.0
    slowest = []
    for layer in engine.layers:
        timings = layer.get("tactic_timings_ms") or {}
        tactic = layer.get("tactic", "")
        wins[tactic.split(" ")[0][:40]] = wins.get(tactic.split(" ")[0][:40], 0) + 1
        if timings:
            best = min(timings.values())
            best_sum += best
            slowest.append((best, layer["name"], min(timings, key=timings.get), timings.get("torch")))
    slowest.sort(reverse=True)
    return {"wins": wins, "sum_best_layer_ms": round(best_sum, 4),
            "slowest_layers": [{"ms": round(b, 4), "layer": n, "winner": w, "reference_ms": r}
                               for b, n, w, r in slowest[:8]]}


def kernel_profile(plan: Path, batch: int, runs: int = 5) -> list[dict]:
    """GPU time per kernel name over uncaptured runs (a CUDA graph hides its kernels from the
    profiler), milliseconds per inference, largest first."""
    from sartor.runtime.context import ExecutionContext
    ctx = ExecutionContext(sartor.load(str(plan)), use_cuda_graphs=False)
    x = torch.rand(batch, 3, 224, 224, device="cuda")
    for _ in range(2):
        ctx.run({"input": x})
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(runs):
            ctx.run({"input": x})
        torch.cuda.synchronize()
    rows = []
    for event in prof.key_averages():
        total = getattr(event, "device_time_total", None) or getattr(event, "cuda_time_total", 0)
        if total > 0:
            rows.append({"kernel": event.key[:90], "ms": round(total / runs / 1e3, 4), "calls": event.count // runs})
    return sorted(rows, key=lambda r: -r["ms"])[:20]


def layer_times(plan: Path) -> list[dict]:
    """Each layer's winning tactic and its timed GPU milliseconds (CUDA-graph replays at build)."""
    rows = []
    for layer in sartor.load(str(plan)).layers:
        timings = layer.get("tactic_timings_ms") or {}
        if timings:
            rows.append({"layer": layer["name"], "tactic": min(timings, key=timings.get),
                         "ms": min(timings.values()), "reference_ms": timings.get("torch"),
                         "rejected": layer.get("tactic_rejected") or {}})
    return rows


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    a, b = a.astype(np.float64).ravel(), b.astype(np.float64).ravel()
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b) + 1e-30))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.environ.get("OUT", "out"))
    parser.add_argument("--effort", type=int, default=2)
    parser.add_argument("--iterations", type=int, default=200)
    parser.add_argument("--batches", default="1,256")
    parser.add_argument("--peers", action="store_true", help="also time torch.compile reduce-overhead")
    parser.add_argument("--skip-agreement", action="store_true", help="skip the INT8 kernel vs emulation check")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path("/tmp/sartor_int8")
    work.mkdir(exist_ok=True)
    results: dict = {"versions": versions(), "effort": args.effort, "builds": [], "speed": [], "errors": {}}

    def save():
        (out / "int8.json").write_text(json.dumps(results, indent=1))

    def step(name, fn):
        t0 = time.perf_counter()
        try:
            value = fn()
            print(f"[{time.perf_counter() - t0:6.1f}s] {name}: {json.dumps(value)[:1500]}", flush=True)
            return value
        except Exception as exc:  # keep measuring the rest; the failure is reported
            results["errors"][name] = f"{type(exc).__name__}: {exc}"[:800]
            traceback.print_exc()
            return None
        finally:
            save()

    print(json.dumps(results["versions"]), flush=True)
    torch.backends.cudnn.benchmark = True
    onnx = export_classifier("resnet50", work)
    calib_images = scene_images(64, 50_000)
    eval_images = scene_images(16, 60_000)
    calib = work / "calib.npy"
    np.save(calib, calib_images)
    cache, timing_cache = work / "calib_cache.json", work / "timing_cache.json"

    # Agreement and accuracy at batch 16: FP32, INT8 emulation (effort 0), INT8 tensor cores.
    agreement_plans = {"fp32": (work / "agree_fp32.plan", "fp32", 0), "emulation": (work / "agree_emu.plan", "int8", 0),
                       "int8": (work / "agree_int8.plan", "int8", args.effort)}
    for key, (plan, precision, effort) in ({} if args.skip_agreement else agreement_plans).items():
        built = step(f"build {key} b16", lambda p=plan, pr=precision, e=effort: build_engine(
            onnx, p, pr, 16, e, calib, cache, timing_cache))
        if built:
            results["builds"].append(built)

    def agreement():
        outs = {k: sartor.load(str(p)).context().run({"input": eval_images})["logits"]
                for k, (p, _, _) in agreement_plans.items()}
        diff = np.abs(outs["int8"].astype(np.float64) - outs["emulation"])
        return {"int8_vs_emulation_max_abs": float(diff.max()), "elements_differing": int((diff > 0).sum()),
                "elements": int(diff.size), "cosine_int8_vs_fp32": cosine(outs["int8"], outs["fp32"]),
                "cosine_emulation_vs_fp32": cosine(outs["emulation"], outs["fp32"]),
                "top1_agreement_int8_vs_fp32": float((outs["int8"].argmax(1) == outs["fp32"].argmax(1)).mean())}
    if not args.skip_agreement:
        results["agreement"] = step("agreement", agreement)
        results["tactics_b16"] = step("tactics int8 b16", lambda: tactic_summary(agreement_plans["int8"][0]))

    for batch in [int(b) for b in args.batches.split(",")]:
        plans = {}
        for precision in ("fp16", "int8", "int8_stem_fp16"):
            plan = work / f"rn50_{precision}_b{batch}.plan"
            built = step(f"build {precision} b{batch}", lambda p=plan, pr=precision: build_engine(
                onnx, p, pr, batch, args.effort, calib, cache, timing_cache))
            if built:
                results["builds"].append(built)
                plans[precision] = plan
        x = torch.rand(batch, 3, 224, 224, device="cuda")
        row = {"batch": batch}
        for precision, plan in plans.items():
            def measure(p=plan):
                ctx = sartor.load(str(p)).context()
                ctx.run({"input": x})
                return stats(timing_samples_ms(lambda: ctx.run({"input": x}), torch.device("cuda"),
                                               args.iterations, 20), batch)
            row[f"sartor_{precision}"] = step(f"time {precision} b{batch}", measure)
            row[f"{precision}_tactics"] = step(f"tactics {precision} b{batch}", lambda p=plan: tactic_summary(p))
            results[f"layers_{precision}_b{batch}"] = step(f"layers {precision} b{batch}", lambda p=plan: layer_times(p))
            if batch >= 64:
                results[f"kernels_{precision}_b{batch}"] = step(f"kernels {precision} b{batch}",
                                                                lambda p=plan: kernel_profile(p, batch))
        row["eager_fp16_cl_graph"] = step(f"time eager b{batch}", lambda: stats(timing_samples_ms(
            eager_graph_runner(batch), torch.device("cuda"), args.iterations, 20), batch))
        if args.peers:
            def peer():
                run, compile_s = resnet50_compiled(batch)
                return dict(stats(timing_samples_ms(run, torch.device("cuda"), args.iterations, 20), batch),
                            compile_s=round(compile_s, 1))
            row["torch_compile_reduce_overhead"] = step(f"time compile b{batch}", peer)
        results["speed"].append(row)
        save()
    print(json.dumps(results["speed"], indent=1))


if __name__ == "__main__":
    main()
