"""Renders a street-scene data set to JPEGs + a COCO annotations.json (with "lighting" per image).

    python samples/detector/make_dataset.py OUT_DIR --count N --seed S [--night-fraction 0.5] [--workers W]

Image i has scene seed S + i; its lighting is night for a deterministic night-fraction share of the
images (a golden-ratio sequence, so any prefix is balanced). Category ids are class index + 1.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import scenes  # noqa: E402

HELD_OUT_SEED = 10_000_000  # held-out evaluation seeds start here; training seeds stay below


def lighting_of(i: int, night_fraction: float) -> str:
    return "night" if ((i + 1) * 0.6180339887498949) % 1.0 < night_fraction else "day"


def scene_specs(count: int, seed: int, night_fraction: float = 0.5, size: int = 320) -> list:
    return [(seed + i, lighting_of(i, night_fraction), size) for i in range(count)]


def render_many(specs: list, workers: int | None = None, progress: bool = False):
    """Renders (seed, lighting, size) specs in a process pool: (uint8 array [N, S, S, 3], list of label lists)."""
    n = len(specs)
    size = specs[0][2] if specs else 320
    images = np.empty((n, size, size, 3), np.uint8)
    labels: list = [None] * n
    workers = workers or os.cpu_count() or 1
    t0 = time.time()
    if workers <= 1 or n < 8:
        for i, spec in enumerate(specs):
            images[i], labels[i] = scenes.render_array(spec)
    else:
        methods = mp.get_all_start_methods()
        ctx = mp.get_context("fork" if "fork" in methods else None)
        with ctx.Pool(workers) as pool:
            chunk = max(1, min(64, n // (workers * 4)))
            for i, (img, lab) in enumerate(pool.imap(scenes.render_array, specs, chunksize=chunk)):
                images[i] = img
                labels[i] = lab
                if progress and (i + 1) % 2000 == 0:
                    print(f"  rendered {i + 1}/{n} ({time.time() - t0:.1f} s)", flush=True)
    return images, labels


def coco_dict(specs: list, labels: list, file_names: list | None = None) -> dict:
    images, anns = [], []
    for i, ((seed, lighting, size), labs) in enumerate(zip(specs, labels)):
        entry = {"id": i + 1, "width": size, "height": size, "lighting": lighting, "seed": int(seed)}
        if file_names is not None:
            entry["file_name"] = file_names[i]
        images.append(entry)
        for cls, x1, y1, x2, y2 in labs:
            w, h = x2 - x1, y2 - y1
            anns.append({"id": len(anns) + 1, "image_id": i + 1, "category_id": int(cls) + 1,
                         "bbox": [round(float(x1), 2), round(float(y1), 2), round(float(w), 2), round(float(h), 2)],
                         "area": round(float(w * h), 2), "iscrowd": 0})
    cats = [{"id": k + 1, "name": name, "supercategory": "street"} for k, name in enumerate(scenes.CLASSES)]
    return {"info": {"description": "sartor sample street scenes (samples/detector/scenes.py)"},
            "images": images, "annotations": anns, "categories": cats}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out_dir")
    ap.add_argument("--count", type=int, required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--night-fraction", type=float, default=0.5)
    ap.add_argument("--size", type=int, default=320)
    ap.add_argument("--quality", type=int, default=92, help="JPEG quality")
    ap.add_argument("--workers", type=int, default=None)
    args = ap.parse_args()
    if args.seed + args.count > HELD_OUT_SEED and args.seed < HELD_OUT_SEED:
        print(f"warning: seeds reach {HELD_OUT_SEED}+, the held-out evaluation range", file=sys.stderr)
    out = Path(args.out_dir)
    (out / "images").mkdir(parents=True, exist_ok=True)
    specs = scene_specs(args.count, args.seed, args.night_fraction, args.size)
    t0 = time.time()
    images, labels = render_many(specs, args.workers, progress=True)
    from PIL import Image

    names = []
    for (seed, lighting, _), img in zip(specs, images):
        name = f"images/{seed:08d}_{lighting}.jpg"
        Image.fromarray(img).save(out / name, quality=args.quality)
        names.append(name)
    (out / "annotations.json").write_text(json.dumps(coco_dict(specs, labels, names)))
    n_obj = sum(len(lab) for lab in labels)
    n_night = sum(1 for s in specs if s[1] == "night")
    print(f"wrote {len(specs)} images ({n_night} night) with {n_obj} boxes to {out} in {time.time() - t0:.1f} s")


if __name__ == "__main__":
    main()
