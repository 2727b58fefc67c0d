"""Trains YOLOv8n and YOLO11n (Ultralytics, from their yaml: no pretrained weights) on the sample's
synthetic day/night street scenes, validates them per lighting split and exports them to ONNX.

    python samples/yolo/make_yolo_dataset.py /tmp/yolo/data --train 4000
    python samples/yolo/train.py --data /tmp/yolo/data --models yolov8n yolo11n --epochs 5 --imgsz 320 \
        --device cpu --threads 1 --out-dir samples/yolo

For each model: `YOLO("<model>.yaml").train(...)` with seed 0 and deterministic=True, plots=False,
amp=False; then `yolo val` (rect=False, conf 0.001, iou 0.7, the square inputs an engine takes) on
the day and the night validation scenes; then the ONNX export (opset 17, dynamic batch/height/width,
no onnxslim: what sartor's model zoo exports) to OUT_DIR/<model>_scenes.onnx, an onnxruntime check
against the PyTorch model, and samples/detector/evaluate.py's held-out mAP of the ONNX (the sample
detector's own evaluator, rendered scenes, NMS IoU 0.6). A one-line-per-epoch log goes to
OUT_DIR/<model>_scenes_train.log; the last line of each is `RESULT {json}`.

Nothing is downloaded: YOLO_OFFLINE=1, Ultralytics' settings and runs live under --runs-dir (default
/tmp/sartor_yolo_runs, never ~), the dataset check's font lookup (check_font, which would fetch
Arial.ttf) is skipped, and every socket connect or DNS lookup in this process is refused and
logged (samples/yolo/offline.py), so the log proves no download was attempted (`network attempts: 0`).

On a GPU: `--device 0 --batch 64 --workers 8 --threads 8` (and a larger dataset and more epochs).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from offline import NETWORK_ATTEMPTS, offline_ultralytics, refuse_network  # noqa: E402


class EpochLog:
    """Ultralytics callbacks writing one line per epoch (losses, learning rate, seconds) to a file."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.file = path.open("w")
        self.t0 = time.time()

    def line(self, text: str) -> None:
        print(text, flush=True)
        self.file.write(text + "\n")
        self.file.flush()

    def on_train_epoch_end(self, trainer) -> None:
        losses = trainer.label_loss_items(trainer.tloss, prefix="")
        lr = next(iter(trainer.lr.values()))
        losses_text = " ".join(f"{k.split('/')[-1]} {float(v):.4f}" for k, v in losses.items())
        self.line(f"epoch {trainer.epoch + 1:3d}/{trainer.epochs}  {losses_text}  lr {lr:.2e}  "
                  f"t {time.time() - self.t0:.0f} s")


def split_map(model, data_dir: Path, imgsz: int, batch: int, device: str) -> dict:
    """`yolo val` on each lighting split: mAP@[.5:.95] and mAP@.5, square inputs (rect=False)."""
    result = {}
    for lighting in ("day", "night"):
        metrics = model.val(data=str(data_dir / f"data_{lighting}.yaml"), imgsz=imgsz, batch=batch, rect=False,
                            conf=0.001, iou=0.7, max_det=300, device=device, plots=False, verbose=False,
                            workers=0, split="val")
        result[lighting] = {"mAP50_95": round(float(metrics.box.map), 4), "mAP50": round(float(metrics.box.map50), 4)}
    return result


def onnx_matches_torch(onnx_path: Path, model, imgsz: int) -> float:
    """max |ORT - torch| on two rendered held-out scenes (one day, one night)."""
    import numpy as np
    import onnxruntime as ort
    import torch

    sys.path.insert(0, str(HERE.parent / "detector"))
    from evaluate import held_out_specs
    from make_dataset import render_many

    specs = held_out_specs(1, imgsz)
    images, _ = render_many(specs["day"] + specs["night"], 1)
    x = np.ascontiguousarray(images.transpose(0, 3, 1, 2), dtype=np.float32) / 255.0
    session = ort.InferenceSession(str(onnx_path), providers=["CPUExecutionProvider"])
    ort_out = session.run(None, {session.get_inputs()[0].name: x})[0]
    net = model.model.float().eval().cpu()
    with torch.no_grad():
        out = net(torch.from_numpy(x))
    out = out[0] if isinstance(out, (list, tuple)) else out
    return float(np.abs(ort_out - out.numpy()).max())


def train_one(name: str, args, runs_dir: Path) -> dict:
    import torch
    from ultralytics import YOLO

    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    log = EpochLog(out_dir / f"{name}_scenes_train.log")
    n_train = len(list((Path(args.data) / "images" / "train").glob("*.jpg")))
    log.line(f"model {name} from {name}.yaml (no pretrained weights); data {args.data}: {n_train} training images; "
             f"imgsz {args.imgsz}, batch {args.batch}, epochs {args.epochs}, device {args.device}, "
             f"torch threads {torch.get_num_threads()}, seed {args.seed}; ultralytics {_ultralytics_version()}, "
             f"torch {torch.__version__}")
    model = YOLO(f"{name}.yaml")
    model.add_callback("on_train_epoch_end", log.on_train_epoch_end)
    t0 = time.time()
    model.train(data=str(Path(args.data) / "data.yaml"), epochs=args.epochs, imgsz=args.imgsz, batch=args.batch,
                device=args.device, workers=args.workers, seed=args.seed, deterministic=True, plots=False,
                amp=False, val=False, project=str(runs_dir), name=name, exist_ok=True, cache=args.cache,
                warmup_epochs=args.warmup_epochs, close_mosaic=args.close_mosaic, verbose=True,
                pretrained=False)
    train_s = time.time() - t0
    weights = runs_dir / name / "weights" / "last.pt"
    trained = YOLO(str(weights))
    log.line(f"trained in {train_s:.0f} s; weights {weights}")

    t0 = time.time()
    val = split_map(trained, Path(args.data), args.imgsz, args.val_batch, args.device)
    log.line(f"yolo val (rect=False, conf 0.001, iou 0.7) in {time.time() - t0:.0f} s: "
             + "  ".join(f"{k}: mAP@[.5:.95] {v['mAP50_95']:.4f} mAP@.5 {v['mAP50']:.4f}" for k, v in val.items()))

    exported = Path(trained.export(format="onnx", imgsz=args.imgsz, opset=17, dynamic=True, simplify=False,
                                   device="cpu", verbose=False))
    onnx_path = out_dir / f"{name}_scenes.onnx"
    onnx_path.write_bytes(exported.read_bytes())
    diff = onnx_matches_torch(onnx_path, YOLO(str(weights)), args.imgsz)
    log.line(f"onnx: {onnx_path} ({onnx_path.stat().st_size / 1e6:.2f} MB, opset 17, dynamic batch/height/width); "
             f"onnxruntime vs torch max |diff| {diff:.2e}")

    sys.path.insert(0, str(HERE.parent / "detector"))
    import evaluate as ev

    held = ev.evaluate(ev.onnx_predictor(str(onnx_path)), per_split=args.val_per_split, batch=16, workers=1)
    log.line("samples/detector/evaluate.py on the ONNX (onnxruntime, rendered held-out scenes, NMS IoU 0.6): "
             + "  ".join(f"{k}: mAP@[.5:.95] {v['mAP50_95']:.4f} mAP@.5 {v['mAP50']:.4f}" for k, v in held.items()))
    log.line(f"network attempts: {len(NETWORK_ATTEMPTS)}" + (f" ({NETWORK_ATTEMPTS})" if NETWORK_ATTEMPTS else ""))
    result = {"model": name, "onnx": str(onnx_path), "train_images": n_train, "imgsz": args.imgsz,
              "epochs": args.epochs, "batch": args.batch, "device": args.device, "threads": torch.get_num_threads(),
              "seed": args.seed, "train_s": round(train_s, 1), "yolo_val": val,
              "onnxruntime_held_out": {k: {m: (round(v[m], 4) if isinstance(v[m], float) else v[m])
                                           for m in ("mAP50_95", "mAP50", "images", "boxes")}
                                       for k, v in held.items()},
              "onnxruntime_vs_torch_max_abs_diff": diff, "network_attempts": len(NETWORK_ATTEMPTS)}
    log.line("RESULT " + json.dumps(result))
    log.file.close()
    return result


def _ultralytics_version() -> str:
    import ultralytics
    return ultralytics.__version__


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", required=True, help="a make_yolo_dataset.py folder")
    ap.add_argument("--models", nargs="+", default=["yolov8n", "yolo11n"], choices=["yolov8n", "yolo11n"])
    ap.add_argument("--epochs", type=int, default=5)
    ap.add_argument("--imgsz", type=int, default=320)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--val-batch", type=int, default=16)
    ap.add_argument("--val-per-split", type=int, default=200, help="held-out scenes per lighting")
    ap.add_argument("--device", default="cpu", help="cpu, or a CUDA index such as 0")
    ap.add_argument("--workers", type=int, default=0, help="dataloader workers (Ultralytics uses 0 on the CPU)")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cache", default="none",
                    help="Ultralytics' image cache: none, disk or ram (ram is not deterministic)")
    ap.add_argument("--warmup-epochs", type=float, default=1.0)
    ap.add_argument("--close-mosaic", type=int, default=2, help="last epochs without mosaic augmentation")
    ap.add_argument("--out-dir", default=str(HERE))
    ap.add_argument("--runs-dir", default="/tmp/sartor_yolo_runs", help="Ultralytics' settings, runs and weights")
    args = ap.parse_args(argv)
    args.cache = False if args.cache == "none" else args.cache

    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    import torch
    torch.set_num_threads(args.threads)
    refuse_network()
    runs_dir = Path(args.runs_dir).resolve()
    offline_ultralytics(runs_dir)
    results = [train_one(name, args, runs_dir) for name in args.models]
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
