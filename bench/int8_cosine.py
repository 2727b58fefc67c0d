"""INT8 against FP32 engine output cosine on the CPU (issue 4): random-weight ResNet-50 and
YOLOv8n, one INT8 engine per calibration method, measured on held-out crops of real photos.

    PYTHONPATH=. python bench/int8_cosine.py --out /tmp/int8cos [--models resnet50,yolov8n]
        [--calib 64] [--test 16] [--yolo-size 320] [--methods entropy,percentile,minmax,mse]
        [--recover mse,entropy] [--budget 0.02] [--tune 32] [--overrides 4,8,16 --override-methods mse]
        [--cosine-recover mse] [--min-cosine 0.99] [--bias-correction off,on]

Inputs are random square crops (scale, position, horizontal flip) of the photographs bundled
with scikit-image, resized to the model's input. Three disjoint draws (independent seeds) are
made: one settles the random networks' BatchNorm statistics, one calibrates, one is evaluated
(and, with --recover, a fourth is the planner's tuning set). So the evaluation images come from
the calibration images' distribution without being any of them.

Random weights: both networks are built with their initialisers, then their BatchNorm running
statistics are re-estimated on the settling crops (as h200_models.settle_batchnorm does on noise).
Untouched, activations shrink or blow up layer by layer and the output says nothing.

For YOLOv8n the raw `[B, 84, anchors]` head is reported three ways: cosine over all of it (the
issue's measure), over the 4 box rows and over the 80 class rows, each with the per-element
mean over the evaluation images removed ("centred"), because an untrained box branch is a
nearly constant anchor grid that makes the plain cosine ≈ 1 whatever INT8 does to the rest.

With --recover METHODS, each of those methods' engines is rebuilt with
`--accuracy-budget B` on the tuning crops (no labels: the planner measures top-1 agreement /
pseudo-label mAP against ONNX Runtime FP32) and measured again on the evaluation crops. With
--overrides K1,K2,…, `sartor sensitivity` ranks the layers (on 32 calibration crops) and the first
K of them are pinned to FP32 with --layer-precision, one engine per K. With --cosine-recover
METHODS, those methods' engines are rebuilt with the label-free `--min-cosine C`: --calib is then
the calibration crops followed by the tuning crops, with --calib-size the calibration count, so
that the planner measures on the tuning crops (held out: never calibrated on) and the evaluation
crops stay a third, independent set.

With --bias-correction off,on each default engine is built once per setting (`--no-bias-correction`,
`--bias-correction`; one calibration cache), so one run gives the before/after figures; the
recovery rows use the builder's default.

Besides the cosine over all outputs, each row has the per-sample cosine over the evaluation
crops (mean and minimum), the statistic --min-cosine gates on.

Nothing is downloaded: the photos ship inside scikit-image and Ultralytics builds YOLOv8n from
its yaml. Prints one table and writes results.json under --out, with what bench/int8_cosine_gpu.py
needs to build the same engines on a GPU: the exported models, the calibration caches, the
evaluation crops ({model}_test_crops.npy) and each default engine's outputs (*.output.npy).
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import logging
import os
import subprocess
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import torch
from PIL import Image

warnings.filterwarnings("ignore")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import sartor
from cli_types import on_off_list  # the benches' own folder is on sys.path

# Photographs bundled with scikit-image (read from its package directory, never fetched).
PHOTOS = ("astronaut", "camera", "chelsea", "coffee", "coins", "grass", "gravel", "brick", "hubble_deep_field",
          "immunohistochemistry", "moon", "retina", "rocket", "stereo_motorcycle", "page", "text")
IMAGENET = "mean=123.675:116.28:103.53,std=58.395:57.12:57.375,rgb,nchw"
SEEDS = {"settle": 1, "calib": 2, "test": 3, "tune": 4}


def photos() -> list[np.ndarray]:
    import skimage.data
    images = []
    for name in PHOTOS:
        image = getattr(skimage.data, name)()
        if isinstance(image, tuple):  # stereo_motorcycle: (left, right, disparity)
            image = image[0]
        image = np.asarray(image)
        if image.dtype != np.uint8:
            image = (image.astype(np.float64) * (255.0 / max(float(image.max()), 1e-12))).astype(np.uint8)
        if image.ndim == 2:
            image = np.stack([image] * 3, axis=-1)
        images.append(np.ascontiguousarray(image[..., :3]))
    return images


def crops(images: list[np.ndarray], count: int, size: int, seed: int) -> np.ndarray:
    """`count` uint8 HWC crops: a random photo, a square of 30–100% of its short side at a random
    place, flipped left-right half the time, resized bilinearly to size×size."""
    rng = np.random.default_rng(seed)
    out = np.empty((count, size, size, 3), np.uint8)
    for k in range(count):
        image = images[rng.integers(len(images))]
        h, w = image.shape[:2]
        side = int(min(h, w) * rng.uniform(0.3, 1.0))
        y, x = rng.integers(0, h - side + 1), rng.integers(0, w - side + 1)
        crop = image[y:y + side, x:x + side]
        if rng.random() < 0.5:
            crop = crop[:, ::-1]
        out[k] = np.asarray(Image.fromarray(np.ascontiguousarray(crop)).resize((size, size), Image.BILINEAR))
    return out


def model_io(model: str, yolo_size: int) -> tuple[str, str, int, str]:
    """(exported ONNX file name, input name, input size, --preprocess spec) of `model`, as this
    script exports it and bench/int8_cosine_gpu.py finds it."""
    if model == "resnet50":
        return "resnet50_224.onnx", "input", 224, f"resize=224x224,{IMAGENET}"
    return f"yolov8n_{yolo_size}.onnx", "images", yolo_size, f"letterbox={yolo_size},mean=0,std=255,rgb,nchw"


def normalise(batch: np.ndarray, model: str) -> np.ndarray:
    x = batch.astype(np.float32).transpose(0, 3, 1, 2)
    if model == "resnet50":
        mean = np.array([123.675, 116.28, 103.53], np.float32).reshape(1, 3, 1, 1)
        std = np.array([58.395, 57.12, 57.375], np.float32).reshape(1, 3, 1, 1)
        return (x - mean) / std
    return x / np.float32(255.0)


def settle_batchnorm(model: torch.nn.Module, images: torch.Tensor, batch: int = 16) -> None:
    """h200_models.settle_batchnorm on the settling crops instead of noise: cumulative running
    statistics over train-mode forward passes."""
    for module in model.modules():
        if isinstance(module, torch.nn.modules.batchnorm._BatchNorm):
            module.reset_running_stats()
            module.momentum = None
    model.train()
    with torch.no_grad():
        for k in range(0, len(images), batch):
            model(images[k:k + batch])
    model.eval()


def export_resnet50(directory: Path, settle: np.ndarray) -> Path:
    import torchvision
    path = directory / model_io("resnet50", 0)[0]
    torch.manual_seed(0)
    model = torchvision.models.resnet50(weights=None)
    settle_batchnorm(model, torch.from_numpy(settle))
    torch.onnx.export(model, (torch.from_numpy(settle[:1]),), str(path), input_names=["input"],
                      output_names=["logits"], dynamic_axes={"input": {0: "batch"}, "logits": {0: "batch"}},
                      opset_version=17, dynamo=False)
    return path


def export_yolov8n(directory: Path, settle: np.ndarray, size: int) -> Path:
    """Ultralytics builds YOLOv8n from its yaml (random weights) and exports it itself."""
    os.environ["YOLO_OFFLINE"] = "1"
    os.environ.setdefault("YOLO_VERBOSE", "False")
    work = directory / "_yolo_export"
    work.mkdir(exist_ok=True)
    previous = os.getcwd()
    try:
        os.chdir(work)
        from ultralytics import YOLO
        from ultralytics.utils import LOGGER
        LOGGER.setLevel(logging.ERROR)
        torch.manual_seed(0)
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            yolo = YOLO("yolov8n.yaml")
            settle_batchnorm(yolo.model, torch.from_numpy(settle))
            exported = Path(yolo.export(format="onnx", imgsz=size, dynamic=True, opset=17, simplify=False,
                                        device="cpu", verbose=False)).resolve()
    finally:
        os.chdir(previous)
    path = directory / model_io("yolov8n", size)[0]
    os.replace(exported, path)
    return path


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    a, b = a.astype(np.float64).ravel(), b.astype(np.float64).ravel()
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def measures(model: str, ref: np.ndarray, got: np.ndarray) -> dict:
    per_sample = [cosine(r, g) for r, g in zip(ref, got)]
    row = {"cosine": cosine(ref, got), "max_rel": float(np.abs(ref - got).max() / np.abs(ref).max()),
           "sample_cos_mean": float(np.mean(per_sample)), "sample_cos_min": float(np.min(per_sample))}
    if model == "resnet50":
        row["top1_agreement"] = float((ref.argmax(-1) == got.argmax(-1)).mean())
    else:
        centre = ref.mean(axis=0, keepdims=True)
        row["box_centred"] = cosine(ref[:, :4] - centre[:, :4], got[:, :4] - centre[:, :4])
        row["cls_centred"] = cosine(ref[:, 4:] - centre[:, 4:], got[:, 4:] - centre[:, 4:])
    return row


def run(plan: Path, name: str, x: np.ndarray, batch: int) -> np.ndarray:
    context = sartor.load(plan).context()
    output = None
    parts = []
    for k in range(0, len(x), batch):
        result = context.run({name: x[k:k + batch]})
        output = output or next(iter(result))
        parts.append(result[output])
    return np.concatenate(parts)


def write_manifest(directory: Path, images: np.ndarray) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    lines = []
    for k, image in enumerate(images):
        Image.fromarray(image).save(directory / f"{k:04d}.png")
        lines.append(json.dumps({"path": f"{k:04d}.png"}))
    (directory / "images.jsonl").write_text("\n".join(lines) + "\n")
    return directory / "images.jsonl"


def recover_with_planner(args, out: Path, pool, model: str, size: int, onnx_path: Path, calib: Path, method: str,
                         common: dict, ref: np.ndarray, name: str, test: np.ndarray) -> dict:
    """`--accuracy-budget` on the tuning crops. They carry no labels, so the planner measures top-1
    agreement (classifier) or pseudo-label mAP (detector) against ONNX Runtime FP32."""
    tune = write_manifest(out / f"{model}_tune", crops(pool, args.tune, size, SEEDS["tune"] + 100 * size))
    plan = out / f"{model}_int8_{method}_budget.plan"
    started = time.perf_counter()
    result = sartor.build(onnx_path, plan, precision="int8", calib=calib, calib_size=args.calib, calib_method=method,
                          calib_cache=out / f"{model}_{method}.calib.json", data=tune, accuracy_budget=args.budget,
                          **common)
    build_s = time.perf_counter() - started
    planner = result.header.get("planner") or {}
    return dict(model=model, size=size, method=method, plan=f"budget {args.budget:g}",
                int8_layers=sum(layer["precision"] == "int8" for layer in result.header["layers"]),
                kept_out=planner.get("kept_out", []), planner_drops=planner.get("drops"), build_s=round(build_s, 1),
                **measures(model, ref, run(plan, name, test, args.batch)))


def recover_with_cosine(args, out: Path, pool, model: str, size: int, onnx_path: Path, calib: Path, method: str,
                        common: dict, ref: np.ndarray, name: str, test: np.ndarray) -> dict:
    """`--min-cosine` with the tuning crops appended to the calibration crops in --calib: the
    planner measures on them (the samples after --calib-size) and the engine is scored on the
    evaluation crops. The default build's calibration cache is reused; the planner checks that
    its samples are the first --calib-size of this file."""
    tune = normalise(crops(pool, args.tune, size, SEEDS["tune"] + 100 * size), model)
    extended = out / f"{model}_calib_and_tune.npy"
    np.save(extended, np.concatenate([np.load(calib), tune]))
    plan = out / f"{model}_int8_{method}_cosine.plan"
    started = time.perf_counter()
    result = sartor.build(onnx_path, plan, precision="int8", calib=extended, calib_size=args.calib,
                          calib_method=method, calib_cache=out / f"{model}_{method}.calib.json",
                          min_cosine=args.min_cosine, cosine_samples=args.tune, **common)
    build_s = time.perf_counter() - started
    planner = result.header["planner"]
    stages = {k: round(v, 1) for k, v in result.stage_seconds.items()}
    return dict(model=model, size=size, method=method, plan=f"min-cos {args.min_cosine:g}",
                int8_layers=sum(layer["precision"] == "int8" for layer in result.header["layers"]),
                kept_out=planner["kept_out"], planner_iterations=[(it["layers_out"], it["outputs"])
                                                                  for it in planner["iterations"]],
                held_out=planner["held_out"], build_s=round(build_s, 1), stage_s=stages,
                **measures(model, ref, run(plan, name, test, args.batch)))


def recover_with_overrides(args, out: Path, model: str, onnx_path: Path, calib: Path, method: str, common: dict,
                           ref: np.ndarray, name: str, test: np.ndarray) -> list[dict]:
    """The first K layers of `sartor sensitivity`'s ranking pinned to FP32 with --layer-precision,
    for each K of --overrides."""
    from sartor.builder.precision import exact_layer_pattern
    cache = out / f"{model}_{method}.calib.json"
    command = [sys.executable, "-m", "sartor", "sensitivity", str(onnx_path), "--calib", str(calib), "--calib-size",
               str(min(args.calib, 32)), "--calib-method", method, "--calib-cache", str(cache), "--preprocess", common["preprocess"], "--json"]
    if model == "yolov8n":
        command += ["--decoder", "yolo"]  # rank by the worse of boxes and scores, not by pixel-sized boxes alone
    started = time.perf_counter()
    report = json.loads(subprocess.run(command, check=True, capture_output=True, text=True).stdout)
    ranking = [layer["name"] for layer in report["layers"] if layer["default"] == "int8"]
    print(f"{model} {method}: sensitivity ranking of {len(ranking)} layers in {time.perf_counter() - started:.0f} s; "
          f"least robust: {', '.join(ranking[:4])}", flush=True)
    rows = []
    for k in (int(v) for v in args.overrides.split(",")):
        plan = out / f"{model}_int8_{method}_top{k}.plan"
        result = sartor.build(onnx_path, plan, precision="int8", calib_cache=cache, calib_method=method,
                              layer_precision={exact_layer_pattern(n): "fp32" for n in ranking[:k]}, **common)
        rows.append(dict(model=model, size=common["profiles"][0]["opt"][name][-1], method=method,
                         plan=f"top-{k} fp32", int8_layers=sum(layer["precision"] == "int8"
                                                               for layer in result.header["layers"]),
                         kept_out=ranking[:k], **measures(model, ref, run(plan, name, test, args.batch))))
    return rows


def default_engine(args, out: Path, model: str, size: int, onnx_path: Path, calib: Path, method: str, common: dict,
                   ref: np.ndarray, name: str, test: np.ndarray, bias_correction: bool | None) -> dict:
    """The INT8 engine of one method (with `bias_correction` True/False, or the builder's default
    for None) and its measures."""
    suffix = "" if bias_correction is None else ("_bc" if bias_correction else "_nobc")
    plan = out / f"{model}_int8_{method}{suffix}.plan"
    options = {} if bias_correction is None else {"bias_correction": bias_correction}
    started = time.perf_counter()
    result = sartor.build(onnx_path, plan, precision="int8", calib=calib, calib_size=args.calib, calib_method=method,
                          calib_cache=out / f"{model}_{method}.calib.json", **options, **common)
    build_s = time.perf_counter() - started
    started = time.perf_counter()
    got = run(plan, name, test, args.batch)
    np.save(plan.with_suffix(".output.npy"), got)  # the CPU engine's outputs, for bench/int8_cosine_gpu.py
    int8 = sum(layer["precision"] == "int8" for layer in result.header["layers"])
    label = "default" if bias_correction is None else ("bias corr" if bias_correction else "no bias corr")
    return dict(model=model, size=size, method=method, plan=label, int8_layers=int8,
                build_s=round(build_s, 1), run_s=round(time.perf_counter() - started, 1), **measures(model, ref, got))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--models", default="resnet50,yolov8n")
    parser.add_argument("--calib", type=int, default=64)
    parser.add_argument("--test", type=int, default=16)
    parser.add_argument("--settle", type=int, default=64)
    parser.add_argument("--yolo-size", type=int, default=320)
    parser.add_argument("--methods", default="entropy,percentile,minmax,mse")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--recover", default="", help="methods also rebuilt with --accuracy-budget")
    parser.add_argument("--budget", type=float, default=0.02, help="the planner's budget for --recover")
    parser.add_argument("--tune", type=int, default=32, help="tuning crops for --recover")
    parser.add_argument("--overrides", default="", help="e.g. 4,8,16: pin the first K layers of the sensitivity "
                                                        "ranking to FP32, one engine per K")
    parser.add_argument("--override-methods", default="mse", help="the methods --overrides runs for")
    parser.add_argument("--cosine-recover", default="", help="methods also rebuilt with --min-cosine")
    parser.add_argument("--min-cosine", type=float, default=0.99, help="the planner's target for --cosine-recover")
    parser.add_argument("--bias-correction", type=on_off_list, default=[None], help="off,on: each default engine built with each setting "
                                                              "(default: the builder's default only)")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    pool = photos()
    results = {"torch": torch.__version__, "photos": len(pool), "calib": args.calib, "test": args.test, "rows": []}
    for model in args.models.split(","):
        _, name, size, spec = model_io(model, args.yolo_size)
        sets = {k: crops(pool, n, size, SEEDS[k] + 100 * size)
                for k, n in (("settle", args.settle), ("calib", args.calib), ("test", args.test))}
        settle = normalise(sets["settle"], model)
        onnx_path = export_resnet50(out, settle) if model == "resnet50" else export_yolov8n(out, settle, size)
        calib = out / f"{model}_calib.npy"
        np.save(calib, normalise(sets["calib"], model))
        test = normalise(sets["test"], model)
        np.save(out / f"{model}_test_crops.npy", sets["test"])  # for bench/int8_cosine_gpu.py
        profile = {"min": {name: (1, 3, size, size)}, "opt": {name: (args.batch, 3, size, size)},
                   "max": {name: (args.batch, 3, size, size)}}
        common = {"device": "cpu", "profiles": [profile], "preprocess": spec, "builder_effort": 0}
        sartor.build(onnx_path, out / f"{model}_fp32.plan", **common)
        ref = run(out / f"{model}_fp32.plan", name, test, args.batch)
        settings = args.bias_correction
        for method in args.methods.split(","):
            for setting in settings:
                row = default_engine(args, out, model, size, onnx_path, calib, method, common, ref, name, test, setting)
                results["rows"].append(row)
                print(json.dumps(row), flush=True)
            if method in args.recover.split(","):
                row = recover_with_planner(args, out, pool, model, size, onnx_path, calib, method, common, ref,
                                           name, test)
                results["rows"].append(row)
                print(json.dumps(row), flush=True)
            if method in args.cosine_recover.split(","):
                row = recover_with_cosine(args, out, pool, model, size, onnx_path, calib, method, common, ref,
                                          name, test)
                results["rows"].append(row)
                print(json.dumps(row), flush=True)
            if method in args.override_methods.split(",") and args.overrides:
                for row in recover_with_overrides(args, out, model, onnx_path, calib, method, common, ref, name, test):
                    results["rows"].append(row)
                    print(json.dumps(row), flush=True)
    (out / "results.json").write_text(json.dumps(results, indent=1))
    print(f"\ntorch {results['torch']}, {results['photos']} photos, {args.calib} calibration / {args.test} "
          f"evaluation crops (disjoint draws)")
    print(f"{'model':<10} {'size':>4} {'method':<10} {'plan':<12} {'INT8':>4} {'cosine':>9} {'per-sample mean/min':>19} "
          f"{'max rel':>8} {'top-1 agr / box c / cls c':>26}")
    for r in results["rows"]:
        extra = (f"{r['top1_agreement']:.3f}" if "top1_agreement" in r
                 else f"{r['box_centred']:.5f} / {r['cls_centred']:.5f}")
        print(f"{r['model']:<10} {r['size']:>4} {r['method']:<10} {r['plan']:<12} {r['int8_layers']:>4} "
              f"{r['cosine']:>9.6f} {r['sample_cos_mean']:>9.5f}/{r['sample_cos_min']:.5f} {r['max_rel']:>8.4f} "
              f"{extra:>26}")


if __name__ == "__main__":
    main()
