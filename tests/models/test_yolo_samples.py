"""The trained YOLOv8n and YOLO11n shipped in samples/yolo (issue 33 part 4): each loads, builds for
the CPU at the smallest builder effort, and matches ONNX Runtime on rendered day and night scenes,
and is a trained detector (it finds the scenes' objects), not random weights."""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import onnx
import pytest

import sartor
from passes_helpers import max_rel_error, run_ort

ROOT = Path(__file__).resolve().parents[2]
SAMPLES = ROOT / "samples" / "yolo"
RTOL = 1e-4  # as the model zoo's FP32 builds against ONNX Runtime (tests/models/test_models.py)
SIZE = 320  # the size the shipped models were trained and validated at


@pytest.fixture(scope="module")
def scenes():
    """One held-out day scene and the same street at night (samples/detector/scenes.py), NCHW 0..1."""
    sys.path.insert(0, str(ROOT / "samples" / "detector"))
    import scenes as scene_module

    images, labels = [], []
    for lighting in ("day", "night"):
        image, boxes = scene_module.render_scene(10_000_003, lighting, SIZE)
        images.append(np.asarray(image))
        labels.append(boxes)
    x = np.ascontiguousarray(np.stack(images).transpose(0, 3, 1, 2), dtype=np.float32) / 255.0
    return x, labels


def _iou(a, b) -> float:
    ix = max(0.0, min(a[2], b[2]) - max(a[0], b[0]))
    iy = max(0.0, min(a[3], b[3]) - max(a[1], b[1]))
    inter = ix * iy
    union = (a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter
    return inter / union if union > 0 else 0.0


@pytest.mark.parametrize("name", ["yolov8n", "yolo11n"])
def test_shipped_yolo_builds_on_cpu_and_matches_onnxruntime(name, scenes, tmp_path):
    path = SAMPLES / f"{name}_scenes.onnx"
    model = onnx.load(str(path), load_external_data=False)
    (graph_input,) = model.graph.input
    (graph_output,) = model.graph.output
    assert graph_input.name == "images" and graph_output.name == "output0"
    dims = [d.dim_param or d.dim_value for d in graph_input.type.tensor_type.shape.dim]
    assert dims[1] == 3 and all(isinstance(d, str) for d in (dims[0], dims[2], dims[3])), dims  # dynamic N, H, W

    shapes = {"images": (1, 3, SIZE, SIZE)}
    result = sartor.build(str(path), str(tmp_path / f"{name}.plan"), device="cpu", precision="fp32",
                          builder_effort=0, min_shapes=shapes, opt_shapes={"images": (2, 3, SIZE, SIZE)},
                          max_shapes={"images": (2, 3, SIZE, SIZE)},
                          preprocess=f"letterbox={SIZE},mean=0,std=255,rgb,nchw")
    engine = sartor.load(result.path)
    assert engine.device.type == "cpu"

    x, labels = scenes
    ours = engine.context().run({"images": x})["output0"]
    ref = run_ort(str(path), {"images": x})["output0"]
    assert ours.shape == ref.shape == (2, 4 + 5, (SIZE // 8) ** 2 + (SIZE // 16) ** 2 + (SIZE // 32) ** 2)
    assert np.all(np.isfinite(ours))
    err = max_rel_error(ours, ref)
    assert err <= RTOL, f"{name}: max relative error {err:.3g} against ONNX Runtime > {RTOL}"

    # Trained: by day and by night, most labelled objects have a confident box of their class on them.
    for k, lighting in enumerate(("day", "night")):
        boxes_cxcywh, scores = ref[k, :4].T, ref[k, 4:].T
        xyxy = np.concatenate([boxes_cxcywh[:, :2] - boxes_cxcywh[:, 2:] / 2,
                               boxes_cxcywh[:, :2] + boxes_cxcywh[:, 2:] / 2], axis=1)
        found = 0
        for cls, *gt in labels[k]:
            candidates = np.nonzero(scores[:, cls] >= 0.25)[0]
            found += any(_iou(xyxy[i], gt) >= 0.5 for i in candidates)
        assert labels[k] and found >= 0.5 * len(labels[k]), (name, lighting, found, len(labels[k]))


def test_yolo_dataset_labels_match_its_coco_file(tmp_path):
    """make_yolo_dataset.py's YOLO txt labels, read back as bench/yolo_val_agreement.py reads them
    (Ultralytics' images→labels rule, normalised cx cy w h), give the boxes of its COCO file."""
    import json
    import subprocess

    out = tmp_path / "data"
    subprocess.run([sys.executable, str(SAMPLES / "make_yolo_dataset.py"), str(out), "--train", "4",
                    "--val-per-split", "2", "--workers", "1"], check=True, capture_output=True, timeout=300)
    sys.path.insert(0, str(ROOT / "bench"))
    import yolo_val_agreement as agreement

    for lighting in ("day", "night"):
        images, names = agreement.validation_images(out / f"data_{lighting}.yaml")
        assert len(images) == 2 and all(p.name.endswith(f"_{lighting}.jpg") for p in images)
    images, names = agreement.validation_images(out / "data.yaml")
    assert names == ["car", "pedestrian", "bicycle", "traffic_light", "traffic_sign"]
    from_yolo = json.loads(agreement.yolo_labels_as_coco(images, names, tmp_path / "back.json").read_text())
    coco = json.loads((out / "val" / "annotations.json").read_text())
    lighting_of = {Path(im["file_name"]).name: im["lighting"] for im in coco["images"]}
    assert sorted(lighting_of.values()) == ["day", "day", "night", "night"]

    def boxes(data):
        by_id = {im["id"]: Path(im["file_name"]).name for im in data["images"]}
        return sorted((by_id[a["image_id"]], a["category_id"], *a["bbox"]) for a in data["annotations"])

    ours, back = boxes(coco), boxes(from_yolo)
    assert len(ours) == len(back) > 0
    for a, b in zip(ours, back):
        assert a[:2] == b[:2] and np.allclose(a[2:], b[2:], atol=0.01), (a, b)
    train = json.loads((out / "train" / "annotations.json").read_text())
    assert len(train["images"]) == 4 and (out / "labels" / "train").is_dir()


@pytest.mark.parametrize("name,heads,branches", [("yolov8n", 6, 3), ("yolo11n", 6, 9)])
def test_shipped_yolo_int8_plan_keeps_the_class_branches_float(name, heads, branches):
    """Decision 0045 on the real graphs: the 6 output heads (3 scales × box and class) stay float, and
    so do the convs inside each class head's private branch; the box branches (the DFL averages
    them), each branch's first conv, the neck convs they fork from and the rest (YOLO11n's C2PSA
    convs among them) run INT8. (The mAP figures behind the rule take minutes, over this suite's
    budget: samples/yolo/evaluate.py.)"""
    from sartor.frontend import import_onnx
    from sartor.passes import optimize
    from sartor.quant.plan import int8_decisions

    graph = import_onnx(SAMPLES / f"{name}_scenes.onnx").graph
    optimize(graph)
    decisions = int8_decisions(graph, "fp32")
    kept = {why.split(",")[0].split(":")[0] for _, why in decisions.values() if why}
    # YOLO11n's attention MatMuls multiply two activations: no INT8 kernel.
    assert kept == {"output head", "output branch"} | ({"not INT8"} if name == "yolo11n" else set()), kept
    no_kernel = [layer for layer, (_, why) in decisions.items() if why.startswith("not INT8")]
    assert all(layer.startswith("/model.10/m/m.0/attn/MatMul") for layer in no_kernel), no_kernel
    assert sum(why.startswith("output head") for _, why in decisions.values()) == heads
    branch = [layer for layer, (_, why) in decisions.items() if why.startswith("output branch")]
    assert len(branch) == branches
    head_module = "/model.22/" if name == "yolov8n" else "/model.23/"
    assert all(layer.startswith(head_module + "cv3.") for layer in branch), branch
    box_branches = [layer for layer in decisions
                    if layer.startswith(head_module + "cv2.") and layer.endswith(".1/conv/Conv")]
    assert len(box_branches) == 3 and all(decisions[layer] == ("int8", "") for layer in box_branches)
    producers = graph.producers()
    for layer in branch:  # what they fork from (the neck) runs INT8
        node = next(n for n in graph.nodes if n.name == layer)
        source = producers[node.inputs[0]].name
        assert source in branch or decisions[source][0] == "int8", (layer, source)
    if name == "yolo11n":
        attention = [layer for layer in decisions if layer.startswith("/model.10/m/m.0/") and layer not in no_kernel]
        assert attention and all(decisions[layer][0] == "int8" for layer in attention)
