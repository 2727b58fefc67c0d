"""`--fallback-where-faster` measured (issue 5): the FP16 engine (FP32 on the CPU: the INT8
builds' fallback precision there), the INT8 engine and the INT8 engine built with the flag, side by
side, same calibration, one process, steady state.

    PYTHONPATH=. python bench/fallback_where_faster.py --out DIR [--models detector,resnet50]
        [--batch 32] [--effort 1] [--device cuda] [--iterations 100]

Per model: each engine's median and p99 (CUDA events around `ExecutionContext.run`, which replays
its CUDA graph; FP32 NCHW input on the device, as bench/h200_table.py times sartor), its build
time, and for the flagged build the layers it found faster at FP16, their per-layer times and the
two end-to-end times it compared. Calibration: 64 street scenes at the model's input size
(bench/h200_int8.py), shared by the two INT8 builds through one calibration cache. Writes
results.json and prints a table.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import sartor  # noqa: E402
from h200_table import CLASSIFIERS, SPEC, onnx_path, timed  # noqa: E402  (the benches' own folder is on sys.path)


def engine_row(plan: Path, input_name: str, shape: tuple, device: str, iterations: int) -> dict:
    context = sartor.load(str(plan)).context()
    x = torch.rand(*shape, device=device)
    return timed(lambda: context.run({input_name: x}), shape[0], iterations, device)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--models", default="detector")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--effort", type=int, default=1)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--iterations", type=int, default=100)
    parser.add_argument("--onnx-dir", type=Path, default=None)
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = {"torch": torch.__version__, "device": args.device, "batch": args.batch, "effort": args.effort,
               "rows": []}
    if args.device == "cuda":
        results["gpu"] = torch.cuda.get_device_name()
    from h200_int8 import scene_images
    baseline = "fp16" if args.device == "cuda" else "fp32"  # the INT8 builds' fallback precision there
    for model in args.models.split(","):
        input_name, size = SPEC.get(model, ("input", 224))
        shape = (args.batch, 3, size, size)
        onnx = Path(onnx_path(model, out, args.onnx_dir))
        calib = out / f"{model}_calib.npy"
        np.save(calib, scene_images(64, 50_000, size, imagenet=model in CLASSIFIERS))
        common = dict(device=args.device, min_shapes={input_name: shape}, opt_shapes={input_name: shape},
                      max_shapes={input_name: shape}, builder_effort=args.effort,
                      timing_cache=str(out / f"{model}_timing.json"))
        quantized = dict(calib=str(calib), calib_size=64, calib_cache=str(out / f"{model}_calib.json"))
        builds = {baseline: dict(precision=baseline), "int8": dict(precision="int8", **quantized),
                  "int8 --fallback-where-faster": dict(precision="int8", fallback_where_faster=True, **quantized)}
        row = {"model": model, "shape": list(shape)}
        for label, options in builds.items():
            plan = out / f"{model}_{label.split()[0]}{'_fallback' if 'fallback' in label else ''}.plan"
            t0 = time.perf_counter()
            result = sartor.build(str(onnx), str(plan), **common, **options)
            build_s = round(time.perf_counter() - t0, 1)
            row[label] = dict(engine_row(plan, input_name, shape, args.device, args.iterations), build_s=build_s)
            if "fallback_where_faster" in result.header:
                row[label]["record"] = result.header["fallback_where_faster"]
            print(json.dumps({model: {label: row[label]}}), flush=True)
        results["rows"].append(row)
        (out / "results.json").write_text(json.dumps(results, indent=1))
    print(f"\n{'model':<10} {'engine':<30} {'median ms':>10} {'p99 ms':>8} {'build s':>8}  moved")
    for row in results["rows"]:
        for label in (baseline, "int8", "int8 --fallback-where-faster"):
            entry = row[label]
            record = entry.get("record") or {}
            moved = (f"{len(record.get('candidates', {}))} candidate(s), kept {record.get('kept')}" if record else "")
            print(f"{row['model']:<10} {label:<30} {entry['median_ms']:>10.4f} {entry['p99_ms']:>8.4f} "
                  f"{entry['build_s']:>8.1f}  {moved}")


if __name__ == "__main__":
    main()
