"""Does `sartor validate` give the mAP that `yolo val` gives (issue 37, within 0.002)?

    python bench/yolo_val_agreement.py --weights yolov8n.pt|model.onnx --data data.yaml [more.yaml ...] \
        --imgsz 640 [--device cpu] [--work DIR]

Exports .pt weights to ONNX (an .onnx is taken as it is, and `yolo val` runs on it too), builds one
FP32 sartor engine with Ultralytics' own preprocessing (`letterbox=IMGSZ,mean=0,std=255,rgb,nchw,
resampler=cv2`), and for each YAML writes its validation split (YOLO txt labels) as a COCO file and
prints, as one JSON document, `yolo val`'s mAP@[.5:.95] and mAP@.5 against `sartor validate`'s with
each AP method (`--ap-method coco` and `ultralytics`) and the differences. The exit status is 1 when
the ultralytics method is more than --tolerance from `yolo val` on any YAML.
Ultralytics validates with rectangular batches by default (each batch letterboxed to its own shape);
the comparison runs it with `rect=False`, square IMGSZ inputs as the engine takes, and the same
conf/iou/max_det. To tell the AP code from the detections, Ultralytics' own detections
(`save_json=True`) are also scored with pycocotools on the same COCO file: that figure equals
sartor's coco-method mAP when the detections agree (the JSON's boxes are clipped to the image, as
the coco method's are; `yolo val`'s own AP, like the ultralytics method, scores them unclipped).

It needs a trained model to mean anything: untrained weights (`yolov8n.yaml`) score ~0 on both
sides, which agrees trivially. Needs ultralytics and PyYAML; downloads nothing itself (give local
weights and a local dataset; YOLO_OFFLINE=1 keeps Ultralytics from fetching).
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from PIL import Image

IMAGE_SUFFIXES = {".jpg", ".jpeg", ".png", ".bmp", ".webp"}


def validation_images(data_yaml: Path) -> tuple[list[Path], list[str]]:
    """The YAML's `val` images, sorted as Ultralytics' dataset sorts them (the order decides how tied
    scores fall in both AP codes), and its class names."""
    import yaml
    config = yaml.safe_load(data_yaml.read_text())
    root = Path(config.get("path") or data_yaml.parent)
    root = root if root.is_absolute() else (data_yaml.parent / root)
    val = config["val"]
    sources = [root / v for v in (val if isinstance(val, list) else [val])]
    images = []
    for source in sources:
        if source.is_dir():
            images += sorted(p for p in source.rglob("*") if p.suffix.lower() in IMAGE_SUFFIXES)
        else:  # a .txt list of image paths
            images += [root / line.strip() for line in source.read_text().splitlines() if line.strip()]
    names = config["names"]
    names = [names[k] for k in sorted(names)] if isinstance(names, dict) else list(names)
    return sorted(images), names


def label_path(image: Path) -> Path:
    """Ultralytics' rule: the last /images/ in the path becomes /labels/, the suffix .txt."""
    parts = list(image.parts)
    k = len(parts) - 1 - parts[::-1].index("images")
    parts[k] = "labels"
    return Path(*parts).with_suffix(".txt")


def yolo_labels_as_coco(images: list[Path], names: list[str], out: Path) -> Path:
    """YOLO txt labels (class cx cy w h, normalised) → one COCO file with absolute image paths."""
    records, annotations = [], []
    for i, image in enumerate(images, start=1):
        with Image.open(image) as im:
            w, h = im.size
        records.append({"id": i, "file_name": str(image.resolve()), "width": w, "height": h})
        labels = label_path(image)
        for line in (labels.read_text().splitlines() if labels.is_file() else []):
            cls, cx, cy, bw, bh = (float(v) for v in line.split()[:5])
            x1, y1 = (cx - bw / 2) * w, (cy - bh / 2) * h
            annotations.append({"id": len(annotations) + 1, "image_id": i, "category_id": int(cls) + 1,
                                "bbox": [x1, y1, bw * w, bh * h], "area": bw * w * bh * h, "iscrowd": 0})
    categories = [{"id": k + 1, "name": n} for k, n in enumerate(names)]
    out.write_text(json.dumps({"images": records, "annotations": annotations, "categories": categories}))
    return out


def pycocotools_map_of_ultralytics(save_dir: Path, coco: Path) -> dict | None:
    """Ultralytics' predictions.json (image ids are file stems) scored by pycocotools on `coco`."""
    import contextlib
    import io

    from pycocotools.coco import COCO
    from pycocotools.cocoeval import COCOeval
    predictions = Path(save_dir) / "predictions.json"
    if not predictions.is_file():
        return None
    with contextlib.redirect_stdout(io.StringIO()):
        truth = COCO(str(coco))
    ids = {Path(im["file_name"]).stem: im["id"] for im in truth.dataset["images"]}
    if len(ids) != len(truth.dataset["images"]):
        return None  # two images share a stem: Ultralytics' ids are ambiguous
    detections = json.loads(predictions.read_text())
    for d in detections:
        d["image_id"] = ids[str(d["image_id"])]
    if not detections:
        return {"map": 0.0, "map50": 0.0}
    with contextlib.redirect_stdout(io.StringIO()):
        evaluator = COCOeval(truth, truth.loadRes(detections), "bbox")
        evaluator.evaluate()
        evaluator.accumulate()
        evaluator.summarize()
    return {"map": float(evaluator.stats[0]), "map50": float(evaluator.stats[1])}


def yolo_val(model, data: Path, args) -> tuple[dict, float]:
    """Ultralytics' own validator on `data`: its mAP, mAP@.5 and where it saved its detections."""
    t0 = time.perf_counter()
    ultra = model.val(data=str(data), imgsz=args.imgsz, batch=1, rect=False, conf=args.conf, iou=args.iou,
                      max_det=args.max_det, device=args.device, plots=False, verbose=False, save_json=True)
    return ({"map": float(ultra.box.map), "map50": float(ultra.box.map50), "save_dir": ultra.save_dir},
            time.perf_counter() - t0)


def sartor_maps(plan: Path, coco: Path, onnx_path: Path, args) -> tuple[dict, dict]:
    """`sartor validate`'s engine and reference mAP with every AP method, and the seconds each took."""
    from sartor.validate.ap import AP_METHODS
    from sartor.validate.runner import validate
    maps, seconds = {}, {}
    for method in AP_METHODS:
        t0 = time.perf_counter()
        report = validate(plan, coco, reference=onnx_path, conf=args.conf, iou=args.iou, max_det=args.max_det,
                          ap_method=method)
        seconds[method] = time.perf_counter() - t0
        maps[method] = {"images": report.overall.images, "map": report.overall.engine,
                        "map50": report.overall.engine_extra.get("map50"),
                        "reference_map": report.overall.reference,
                        "reference_map50": report.overall.reference_extra.get("map50")}
    return maps, seconds


def agreement(data: Path, model, plan: Path, onnx_path: Path, work: Path, args) -> dict:
    """One YAML: yolo val against sartor validate with each AP method."""
    ultra, ultra_seconds = yolo_val(model, data, args)
    images, names = validation_images(data)
    coco = yolo_labels_as_coco(images, names, work / f"{data.stem}_val.json")
    maps, seconds = sartor_maps(plan, coco, onnx_path, args)
    result = {"data": str(data), "images": maps["coco"]["images"],
              "yolo_val": {"map": ultra["map"], "map50": ultra["map50"]}, "sartor": maps,
              "difference": {m: v["map"] - ultra["map"] for m, v in maps.items()},
              "difference_map50": {m: v["map50"] - ultra["map50"] for m, v in maps.items()},
              "seconds": {"yolo_val": ultra_seconds, **{f"sartor_{m}": t for m, t in seconds.items()}}}
    scored = pycocotools_map_of_ultralytics(ultra["save_dir"], coco)
    if scored is not None:  # equals sartor's coco figure when the detections are the same
        result["ultralytics_predictions_pycocotools"] = scored
    result["within_tolerance"] = abs(result["difference"]["ultralytics"]) <= args.tolerance
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--weights", required=True,
                        help="a trained Ultralytics .pt or its ONNX export (or .yaml: random weights)")
    parser.add_argument("--data", required=True, type=Path, nargs="+",
                        help="YOLO dataset YAMLs with a val split (e.g. one per lighting)")
    parser.add_argument("--imgsz", type=int, default=640)
    parser.add_argument("--device", default="cpu", help="cpu or cuda (the engine's and Ultralytics' device)")
    parser.add_argument("--conf", type=float, default=0.001)
    parser.add_argument("--iou", type=float, default=0.7)
    parser.add_argument("--max-det", type=int, default=300)
    parser.add_argument("--tolerance", type=float, default=0.002, help="the issue's bound on |mAP difference|")
    parser.add_argument("--work", type=Path, help="where the engine and the COCO files go (default: a new temp dir)")
    args = parser.parse_args(argv)

    import sartor
    from ultralytics import YOLO

    work = args.work or Path(tempfile.mkdtemp(prefix="yolo_val_agreement_"))
    work.mkdir(parents=True, exist_ok=True)
    model = YOLO(args.weights, task="detect")
    weights = Path(args.weights)
    onnx_path = weights if weights.suffix == ".onnx" else \
        Path(model.export(format="onnx", imgsz=args.imgsz, dynamic=True, simplify=False))
    plan = work / "model.plan"
    shapes = {"images": (1, 3, args.imgsz, args.imgsz)}
    sartor.build(onnx_path, plan, device=args.device, min_shapes=shapes, opt_shapes=shapes,
                 max_shapes={"images": (8, 3, args.imgsz, args.imgsz)},
                 preprocess=f"letterbox={args.imgsz},mean=0,std=255,rgb,nchw,resampler=cv2")
    results = [agreement(data, model, plan, onnx_path, work, args) for data in args.data]
    print(json.dumps({"weights": str(weights), "imgsz": args.imgsz, "tolerance": args.tolerance,
                      "results": results}, indent=2))
    return 0 if all(r["within_tolerance"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
