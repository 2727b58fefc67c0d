"""INT8 against FP32 on the CPU: torchvision classifiers with random weights and settled
BatchNorm (see h200_models.settle_batchnorm), built FP32 and INT8 (one engine per calibration
method), compared on held-out inputs drawn like the calibration set.

    PYTHONPATH=. python bench/int8_cpu.py --out /tmp/int8 [--models resnet18,mobilenet_v3_large]
        [--size 224] [--calib 64] [--test 16] [--methods entropy,percentile,minmax,mse]

Inputs are U(0, 1) images, the distribution the BatchNorm statistics were settled on (random
weights give no meaningful real-image accuracy). Prints cosine similarity, max relative error and
top-1 agreement per model and method, and writes results.json under --out.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import torch

warnings.filterwarnings("ignore")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from h200_models import settle_batchnorm

import sartor


def export(name: str, size: int, directory: Path) -> Path:
    import torchvision
    path = directory / f"{name}_{size}.onnx"
    if path.exists():
        return path
    torch.manual_seed(0)
    model = getattr(torchvision.models, name)(weights=None)
    settle_batchnorm(model)
    torch.onnx.export(model, (torch.rand(1, 3, size, size),), str(path), input_names=["input"], output_names=["logits"],
                      dynamic_axes={"input": {0: "batch"}, "logits": {0: "batch"}}, opset_version=17, dynamo=False)
    return path


def metrics(ref: np.ndarray, out: np.ndarray) -> dict:
    r, o = ref.astype(np.float64).ravel(), out.astype(np.float64).ravel()
    return {"cosine": float(r @ o / (np.linalg.norm(r) * np.linalg.norm(o))),
            "max_rel": float(np.abs(r - o).max() / np.abs(r).max()),
            "top1_agreement": float((ref.argmax(-1) == out.argmax(-1)).mean())}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--models", default="resnet18,mobilenet_v3_large")
    parser.add_argument("--size", type=int, default=224)
    parser.add_argument("--calib", type=int, default=64)
    parser.add_argument("--test", type=int, default=16)
    parser.add_argument("--methods", default="entropy,percentile,minmax,mse")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    shape = (3, args.size, args.size)
    np.save(out / "calib.npy", rng.random((args.calib,) + shape, dtype=np.float32))
    test = rng.random((args.test,) + shape, dtype=np.float32)
    profile = {"min": {"input": (1,) + shape}, "opt": {"input": (8,) + shape}, "max": {"input": (8,) + shape}}
    results = {}
    for name in args.models.split(","):
        model = export(name, args.size, out)
        sartor.build(model, out / f"{name}_fp32.plan", device="cpu", profiles=[profile])
        ref = np.concatenate([sartor.load(out / f"{name}_fp32.plan").context().run({"input": test[k:k + 8]})["logits"]
                              for k in range(0, len(test), 8)])
        for method in args.methods.split(","):
            started = time.perf_counter()
            result = sartor.build(model, out / f"{name}_int8_{method}.plan", device="cpu", profiles=[profile],
                                  precision="int8", calib=out / "calib.npy", calib_method=method,
                                  calib_cache=out / f"{name}_{method}.calib.json")
            build_s = time.perf_counter() - started
            engine = sartor.load(out / f"{name}_int8_{method}.plan")
            started = time.perf_counter()
            got = np.concatenate([engine.context().run({"input": test[k:k + 8]})["logits"]
                                  for k in range(0, len(test), 8)])
            run_s = time.perf_counter() - started
            mix = {}
            for layer in result.header["layers"]:
                mix[layer["precision"]] = mix.get(layer["precision"], 0) + 1
            row = dict(metrics(ref, got), mix=mix, build_s=round(build_s, 1), run_s=round(run_s, 1),
                       calibrate_s=result.stage_seconds.get("calibrate"))
            results[f"{name}/{method}"] = row
            print(f"{name:<20} {method:<10} cosine {row['cosine']:.5f}  max_rel {row['max_rel']:.4f}  "
                  f"top1 {row['top1_agreement']:.3f}  mix {mix}  build {build_s:.1f}s", flush=True)
    (out / "results.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
