"""Writes the sample's synthetic street scenes as an Ultralytics (YOLO-format) dataset.

    python samples/yolo/make_yolo_dataset.py OUT_DIR [--train 4000] [--val-per-split 200] [--seed 0]

The scenes are samples/detector/scenes.py's, chosen as samples/detector does: training scene i has
seed SEED + i with night for a golden-ratio half of them (make_dataset.scene_specs), and the
validation scenes are the sample detector's held-out set (evaluate.held_out_specs: seeds
10_000_000 + i by day, 10_100_000 + i by night), so the YOLO models and the sample detector are
scored on the same images. OUT_DIR gets:

    images/train/*.jpg  labels/train/*.txt     day and night mixed (`<seed>_<lighting>.jpg`)
    images/val/*.jpg    labels/val/*.txt       the held-out scenes, half day, half night
    val_day.txt, val_night.txt                 the validation images of one lighting (for `yolo val`)
    data.yaml, data_day.yaml, data_night.yaml  Ultralytics dataset files (val: all, day, night)
    val/annotations.json                       the same validation labels as COCO, with "lighting"
                                               per image (`sartor validate --split-by lighting`)
    train/annotations.json                     the training labels as COCO (a calibration manifest)

Labels: `class cx cy w h`, normalised to the image size; classes 0 car, 1 pedestrian, 2 bicycle,
3 traffic_light, 4 traffic_sign.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "detector"))
import scenes  # noqa: E402
from evaluate import held_out_specs  # noqa: E402
from make_dataset import HELD_OUT_SEED, coco_dict, render_many, scene_specs  # noqa: E402


def yolo_lines(labels: list, size: int) -> str:
    """[(class, x1, y1, x2, y2)] in pixels -> YOLO txt lines (class cx cy w h, normalised)."""
    lines = []
    for cls, x1, y1, x2, y2 in labels:
        cx, cy, w, h = (x1 + x2) / 2 / size, (y1 + y2) / 2 / size, (x2 - x1) / size, (y2 - y1) / size
        lines.append(f"{int(cls)} {cx:.6f} {cy:.6f} {w:.6f} {h:.6f}")
    return "\n".join(lines) + ("\n" if lines else "")


def write_split(out: Path, split: str, specs: list, workers: int | None, quality: int) -> list:
    """Renders `specs` into images/<split> + labels/<split>; returns the image paths relative to out."""
    from PIL import Image

    (out / "images" / split).mkdir(parents=True, exist_ok=True)
    (out / "labels" / split).mkdir(parents=True, exist_ok=True)
    images, labels = render_many(specs, workers, progress=True)
    names = []
    for (seed, lighting, size), image, labs in zip(specs, images, labels):
        stem = f"{seed:08d}_{lighting}"
        Image.fromarray(image).save(out / "images" / split / f"{stem}.jpg", quality=quality)
        (out / "labels" / split / f"{stem}.txt").write_text(yolo_lines(labs, size))
        names.append(f"images/{split}/{stem}.jpg")
    coco_dir = out / split
    coco_dir.mkdir(exist_ok=True)
    # file_name relative to the COCO file's folder, as sartor's COCO reader resolves it
    coco = coco_dict(specs, labels, [f"../{name}" for name in names])
    (coco_dir / "annotations.json").write_text(json.dumps(coco))
    return names


def data_yaml(out: Path, val: str) -> str:
    names = "\n".join(f"  {k}: {name}" for k, name in enumerate(scenes.CLASSES))
    return f"path: {out.resolve()}\ntrain: images/train\nval: {val}\nnames:\n{names}\n"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out_dir")
    ap.add_argument("--train", type=int, default=4000, help="training scenes (half night)")
    ap.add_argument("--val-per-split", type=int, default=200, help="held-out scenes per lighting")
    ap.add_argument("--seed", type=int, default=0, help="first training scene seed")
    ap.add_argument("--size", type=int, default=320, help="rendered image size (square)")
    ap.add_argument("--quality", type=int, default=92, help="JPEG quality")
    ap.add_argument("--workers", type=int, default=None, help="render processes (default: all cores)")
    args = ap.parse_args(argv)
    if args.seed + args.train > HELD_OUT_SEED:
        raise SystemExit(f"training seeds must stay below {HELD_OUT_SEED} (the held-out range)")
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    write_split(out, "train", scene_specs(args.train, args.seed, 0.5, args.size), args.workers, args.quality)
    held = held_out_specs(args.val_per_split, args.size)
    val_names = write_split(out, "val", held["day"] + held["night"], args.workers, args.quality)
    for lighting in ("day", "night"):
        listed = [str((out / n).resolve()) for n in val_names if n.endswith(f"_{lighting}.jpg")]
        (out / f"val_{lighting}.txt").write_text("\n".join(listed) + "\n")
        (out / f"data_{lighting}.yaml").write_text(data_yaml(out, f"val_{lighting}.txt"))
    (out / "data.yaml").write_text(data_yaml(out, "images/val"))
    print(f"wrote {args.train} training and {len(val_names)} validation scenes to {out} in {time.time() - t0:.1f} s")


if __name__ == "__main__":
    main()
