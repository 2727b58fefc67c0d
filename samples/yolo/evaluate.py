"""Builds the shipped YOLO models with sartor and scores the engines per lighting split.

    python samples/yolo/evaluate.py --data /tmp/yolo/data [--device cpu] [--precisions fp32 int8] \
        [--models samples/yolo/yolov8n_scenes.onnx samples/yolo/yolo11n_scenes.onnx] [--work /tmp/yolo/engines]

For each model and precision it runs the commands a user would, with default flags:

    sartor build MODEL.onnx -o WORK/NAME_PREC.plan --device DEVICE --precision PREC \
        --preprocess letterbox=320,mean=0,std=255,rgb,nchw,resampler=cv2 \
        --min-shapes images:1x3x320x320 --opt-shapes images:8x3x320x320 --max-shapes images:8x3x320x320 \
        [--calib DATA/images/train]                     (int8: a plain folder, half day, half night)
    sartor validate WORK/NAME_PREC.plan --data DATA/val/annotations.json --split-by lighting --json

and prints, per split, mAP@[.5:.95] of ONNX Runtime FP32 (the reference) and of the engine, with the
drop. The last line is `RESULT {json}`. `--calib-subset day` calibrates on the day images only (a
manifest of them), to report what a calibration set that misses the night costs. `--build-flag`
(repeatable) adds a flag to every build, to score a variant beside the defaults, e.g.
`--build-flag=--layer-precision='/model.22/cv2.*/cv2.*.1/*=int8' --tag branches-int8`.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]


def sartor(*args: str) -> subprocess.CompletedProcess:
    done = subprocess.run([sys.executable, "-m", "sartor", *args], capture_output=True, text=True, cwd=ROOT)
    if done.returncode not in (0, 1):
        raise SystemExit(f"sartor {' '.join(args)} failed ({done.returncode}): {done.stderr.strip()[-2000:]}")
    return done


def calib_source(data: Path, subset: str, work: Path) -> str:
    """The training images as a plain folder (both lightings), or a manifest of one lighting."""
    if subset == "all":
        return str(data / "images" / "train")
    manifest = work / f"calib_{subset}.jsonl"
    images = sorted((data / "images" / "train").glob(f"*_{subset}.jpg"))
    manifest.write_text("".join(json.dumps({"path": str(p), "lighting": subset}) + "\n" for p in images))
    return str(manifest)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", required=True, type=Path, help="a make_yolo_dataset.py folder")
    ap.add_argument("--models", nargs="+", type=Path,
                    default=[HERE / "yolov8n_scenes.onnx", HERE / "yolo11n_scenes.onnx"])
    ap.add_argument("--precisions", nargs="+", default=["fp32"], choices=["fp32", "fp16", "int8"])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--imgsz", type=int, default=320)
    ap.add_argument("--batch", type=int, default=8, help="the profile's opt and max batch")
    ap.add_argument("--calib-subset", choices=["all", "day", "night"], default="all")
    ap.add_argument("--work", type=Path, default=Path("/tmp/sartor_yolo_engines"))
    ap.add_argument("--build-flag", action="append", default=[], metavar="FLAG",
                    help="a flag added to every build (FLAG=VALUE as one argument; repeatable)")
    ap.add_argument("--tag", default="", help="a name for the variant the build flags make (engine file names, rows)")
    args = ap.parse_args(argv)
    args.work.mkdir(parents=True, exist_ok=True)
    s = args.imgsz
    preprocess = f"letterbox={s},mean=0,std=255,rgb,nchw,resampler=cv2"
    results = []
    for model in args.models:
        name = model.stem
        for precision in args.precisions:
            suffix = "" if precision != "int8" or args.calib_subset == "all" else f"_calib_{args.calib_subset}"
            suffix += f"_{args.tag}" if args.tag else ""
            plan = args.work / f"{name}_{precision}{suffix}.plan"
            flags = ["--device", args.device, "--precision", precision, "--preprocess", preprocess,
                     "--min-shapes", f"images:1x3x{s}x{s}", "--opt-shapes", f"images:{args.batch}x3x{s}x{s}",
                     "--max-shapes", f"images:{args.batch}x3x{s}x{s}"]
            if precision == "int8":
                flags += ["--calib", calib_source(args.data, args.calib_subset, args.work)]
            flags += args.build_flag
            t0 = time.time()
            sartor("build", str(model), "-o", str(plan), *flags)
            build_s = time.time() - t0
            t0 = time.time()
            checked = sartor("validate", str(plan), "--data", str(args.data / "val" / "annotations.json"),
                             "--reference", str(model), "--split-by", "lighting", "--json")
            report = json.loads(checked.stdout)
            row = {"model": name, "precision": precision, "device": args.device, "calib": args.calib_subset
                   if precision == "int8" else None, "variant": args.tag or None, "build_flags": args.build_flag,
                   "build_s": round(build_s, 1),
                   "validate_s": round(time.time() - t0, 1), "splits": {}}
            for split in [report["overall"], *report["splits"]]:
                row["splits"][split["name"]] = {
                    "images": split.get("images"), "reference": round(split["reference"], 4),
                    "engine": round(split["engine"], 4), "drop": round(split["drop"], 4),
                    "reference_map50": round(split["reference_extra"]["map50"], 4),
                    "engine_map50": round(split["engine_extra"]["map50"], 4)}
            results.append(row)
            for split_name, m in row["splits"].items():
                print(f"{name:16s} {precision:5s} {split_name:6s} ORT FP32 {m['reference']:.4f} "
                      f"engine {m['engine']:.4f} drop {m['drop']:+.4f}  (mAP@.5 {m['reference_map50']:.4f} / "
                      f"{m['engine_map50']:.4f}, {m['images']} images)", flush=True)
    print("RESULT " + json.dumps(results))


if __name__ == "__main__":
    main()
