"""`validate --ap-method ultralytics` against Ultralytics itself: on synthetic detections, sartor's
numbers equal DetectionValidator's matching and DetMetrics' AP to 1e-6 (edge cases included); end to
end, `sartor validate` on the trained YOLOv8n of samples/yolo gives what `yolo val` prints."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from sartor.validate.ap import ultralytics_map
from sartor.validate.ap.ultralytics import IOU_THRESHOLDS, box_iou
from sartor.validate.decoders import Detections

os.environ.setdefault("YOLO_OFFLINE", "1")  # before anything imports ultralytics: never go online

ROOT = Path(__file__).resolve().parents[2]
YOLOV8N = ROOT / "samples" / "yolo" / "yolov8n_scenes.onnx"
CLASSES = 5
EXACT = 1e-6
AGREEMENT = 0.002  # issue 37's bar between sartor validate and yolo val


@pytest.fixture(scope="module")
def ultralytics():
    """Ultralytics 8.4 or later: the matching and AP end points sartor reproduces changed in 8.4."""
    module = pytest.importorskip("ultralytics")
    major, minor = (int(v) for v in module.__version__.split(".")[:2])
    if (major, minor) < (8, 4):
        pytest.skip(f"ultralytics {module.__version__}: the ultralytics AP method reproduces 8.4's")
    return module


# ---- Ultralytics' own path: DetectionValidator's matching, DetMetrics' AP -----------------------------

def ultralytics_reference(ground_truth: list, detections: list) -> dict:
    """mAP, mAP@.5 and per-class AP as `yolo val` computes them: each image's stats built as
    DetectionValidator.update_metrics builds them (its _process_batch and match_predictions on
    torch tensors, NMS order), then DetMetrics.process."""
    from types import SimpleNamespace

    import torch
    from ultralytics.engine.validator import BaseValidator
    from ultralytics.models.yolo.detect.val import DetectionValidator
    from ultralytics.utils.metrics import DetMetrics

    validator = SimpleNamespace(iouv=torch.linspace(0.5, 0.95, 10), niou=10)
    validator.match_predictions = lambda *a, **k: BaseValidator.match_predictions(validator, *a, **k)
    metrics = DetMetrics(names={c: str(c) for c in range(CLASSES)})
    for k, (gt, det) in enumerate(zip(ground_truth, detections)):
        order = np.argsort(-det.scores, kind="stable")  # NMS hands detections over best first
        pred = {"bboxes": torch.from_numpy(det.boxes[order]), "conf": torch.from_numpy(det.scores[order]),
                "cls": torch.from_numpy(det.classes[order].astype(np.float32))}
        batch = {"cls": torch.from_numpy(gt.classes.astype(np.float32)), "bboxes": torch.from_numpy(gt.boxes)}
        cls = batch["cls"].numpy()
        no_pred = pred["cls"].shape[0] == 0
        metrics.update_stats({**DetectionValidator._process_batch(validator, pred, batch),
                              "target_cls": cls, "target_img": np.unique(cls),
                              "conf": np.zeros(0) if no_pred else pred["conf"].numpy(),
                              "pred_cls": np.zeros(0) if no_pred else pred["cls"].numpy(), "im_name": f"{k}.jpg"})
    metrics.process()
    per_class = {int(c): (float(row.mean()), float(row[0]))
                 for c, row in zip(metrics.box.ap_class_index, metrics.box.all_ap)}
    return {"map": float(metrics.box.map), "map50": float(metrics.box.map50), "per_class": per_class}


def assert_same_as_ultralytics(ground_truth: list, detections: list) -> None:
    theirs = ultralytics_reference(ground_truth, detections)
    ours = ultralytics_map(ground_truth, detections)
    assert abs(ours.map - theirs["map"]) <= EXACT, (ours.map, theirs["map"])
    assert abs(ours.map50 - theirs["map50"]) <= EXACT, (ours.map50, theirs["map50"])
    assert set(ours.per_class) == set(theirs["per_class"])
    for cls, (ap, ap50) in theirs["per_class"].items():
        assert abs(ours.per_class[cls]["ap"] - ap) <= EXACT and abs(ours.per_class[cls]["ap50"] - ap50) <= EXACT


# ---- synthetic scenes -------------------------------------------------------------------------------

def random_boxes(rng: np.random.Generator, n: int) -> np.ndarray:
    xy = rng.uniform(0, 200, (n, 2))
    wh = rng.uniform(5, 60, (n, 2))
    return np.concatenate([xy, xy + wh], axis=1).astype(np.float32)


def jitter(rng: np.random.Generator, boxes: np.ndarray, scale: float) -> np.ndarray:
    w, h = boxes[:, 2] - boxes[:, 0], boxes[:, 3] - boxes[:, 1]
    size = np.stack([w, h, w, h], axis=1)
    return (boxes + rng.normal(0, scale, boxes.shape) * size).astype(np.float32)


def synthetic_image(rng: np.random.Generator, kind: str) -> tuple[Detections, Detections]:
    """Labels of classes 0..3 (never 4) and detections: jittered copies (some of another class, some
    duplicates), strays, classes 3 never and 4 only detected. Scores on a 0.05 grid tie often."""
    labels = 0 if kind in ("no labels", "empty") else int(rng.integers(1, 8))
    gt = Detections(random_boxes(rng, labels), np.ones(labels), rng.integers(0, 4, labels))
    if kind in ("no detections", "empty"):
        return gt, Detections.empty()
    found = rng.random(labels) < 0.8
    boxes = [jitter(rng, gt.boxes[found], rng.choice([0.02, 0.08, 0.2]))]
    classes = [np.where(rng.random(found.sum()) < 0.85, gt.classes[found], rng.integers(0, 3, found.sum()))]
    twice = found & (rng.random(labels) < 0.3)  # a second, looser box on some objects
    boxes.append(jitter(rng, gt.boxes[twice], 0.1))
    classes.append(gt.classes[twice])
    strays = int(rng.integers(0, 4))
    boxes.append(random_boxes(rng, strays))
    classes.append(rng.choice([0, 1, 2, 4], strays))  # class 4 has no label anywhere
    boxes, classes = np.concatenate(boxes), np.concatenate(classes)
    classes = np.where(classes == 3, 2, classes)  # class 3 has labels but no detection
    scores = np.round(rng.uniform(0.001, 1.0, len(classes)) * 20) / 20 + 0.001
    return gt, Detections(boxes, scores, classes)


KINDS = ["objects"] * 6 + ["no labels", "no detections", "empty"]


@pytest.mark.parametrize("seed", range(8))
def test_synthetic_scenes_equal_ultralytics(ultralytics, seed):
    rng = np.random.default_rng(seed)
    images = [synthetic_image(rng, KINDS[k % len(KINDS)] if seed % 2 else "objects") for k in range(40)]
    ground_truth, detections = [g for g, _ in images], [d for _, d in images]
    assert_same_as_ultralytics(ground_truth, detections)
    ours = ultralytics_map(ground_truth, detections)
    assert 3 in ours.per_class and ours.per_class[3]["ap"] == 0.0  # labels, no detection: AP 0
    assert 4 not in ours.per_class  # detections of a class without labels count nowhere


def test_ties_and_thresholds_equal_ultralytics(ultralytics):
    """Tied scores across images, a detection tied between two identical labels, and IoUs exactly on
    thresholds (0.5 and 0.75: float32 and the 1e-7 of box_iou decide which side they fall)."""
    square = [0, 0, 10, 10]
    gt = [Detections([square, square, [20, 20, 40, 40]], [1, 1, 1], [0, 0, 1]),
          Detections([square, [50, 50, 60, 60]], [1, 1], [0, 0]),
          Detections([square], [1], [1])]
    dets = [Detections([square, [0, 0, 10, 5], [20, 20, 40, 35]], [0.5, 0.5, 0.5], [0, 0, 1]),
            Detections([[0, 0, 10, 7.5], [50, 50, 60, 60], [0, 0, 10, 10]], [0.5, 0.9, 0.5], [0, 0, 0]),
            Detections([[0, 0, 10, 5]], [0.9], [1])]
    iou = box_iou(np.array([square], np.float32), np.array([[0, 0, 10, 5], [0, 0, 10, 7.5]], np.float32))
    assert iou.dtype == np.float32 and iou[0, 0] == IOU_THRESHOLDS[0] and iou[0, 1] == IOU_THRESHOLDS[5]
    assert_same_as_ultralytics(gt, dets)


def test_edge_cases():
    perfect = [Detections([[0, 0, 10, 10], [20, 20, 30, 30]], [0.9, 0.8], [0, 1])]
    m = ultralytics_map(perfect, perfect)
    # Ultralytics 8.4 drops precision to 0 at the last recall, and at recall 1 the trapezoid's last
    # step sees that 0: a perfect class scores 0.995 in `yolo val`, and so here.
    assert m.map == pytest.approx(0.995) and m.map50 == pytest.approx(0.995) and m.instances == 2
    assert ultralytics_map(perfect, [Detections.empty()]).map == 0.0
    assert ultralytics_map([Detections.empty()], perfect).map is None  # no labels: undefined, as coco_map
    assert ultralytics_map([], []).map is None


# ---- end to end: sartor validate against yolo val ------------------------------------------------------

@pytest.fixture(scope="module")
def scenes_slice(tmp_path_factory) -> Path:
    """20 held-out scenes by day and 20 by night as make_yolo_dataset.py writes them."""
    out = tmp_path_factory.mktemp("yolo_slice") / "data"
    subprocess.run([sys.executable, str(ROOT / "samples" / "yolo" / "make_yolo_dataset.py"), str(out),
                    "--train", "0", "--val-per-split", "20", "--workers", "1"],
                   check=True, capture_output=True, timeout=300)
    return out


def test_sartor_validate_reproduces_yolo_val(ultralytics, scenes_slice, tmp_path, cli):
    """bench/yolo_val_agreement.py runs `yolo val` on the shipped ONNX (offline, in its own process)
    and builds the engine; `sartor validate --ap-method ultralytics` then gives yolo val's mAP."""
    pytest.importorskip("yaml")  # the bench reads Ultralytics' dataset YAML
    work = tmp_path / "work"
    env = dict(os.environ, SARTOR_YOLO_RUNS=str(tmp_path / "runs"),
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, str(ROOT / "samples" / "yolo" / "offline.py"),
                           str(ROOT / "bench" / "yolo_val_agreement.py"), "--weights", str(YOLOV8N),
                           "--data", str(scenes_slice / "data.yaml"), "--imgsz", "320", "--work", str(work)],
                          capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)
    assert done.returncode in (0, 1), done.stderr[-3000:]
    assert "network attempts: 0" in done.stderr
    printed = "\n" + done.stdout  # Ultralytics' own lines, then the bench's JSON document
    (bench,) = json.loads(printed[printed.rindex("\n{\n") + 1:])["results"]
    yolo_val = bench["yolo_val"]
    assert bench["images"] == 40 and yolo_val["map"] > 0.3  # a trained model on the scenes

    result = cli("validate", work / "model.plan", "--data", work / "data_val.json", "--reference", YOLOV8N,
                 "--ap-method", "ultralytics", "--json")
    assert result.code == 0, result
    report = json.loads(result.out)
    assert report["ap_method"] == "ultralytics" and report["options"]["ap_method"] == "ultralytics"
    assert "coco_max_dets" not in report["options"]
    engine = report["overall"]["engine"]
    assert abs(engine - yolo_val["map"]) <= AGREEMENT, (engine, yolo_val)
    assert abs(report["overall"]["engine_extra"]["map50"] - yolo_val["map50"]) <= AGREEMENT
    assert engine == pytest.approx(bench["sartor"]["ultralytics"]["map"], abs=1e-9)
    assert bench["within_tolerance"]
