"""Engines built with `--nms` end to end on the CPU: the sample detector's in-engine NMS keeps
exactly what the pipeline's host-side NMS keeps from the same model without it, through `Pipeline`,
`sartor validate` (same mAP on every split), `sartor run`, `inspect` and `bench --end-to-end`; and
`--nms` misused is refused in one line with exit 2."""
from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import assert_cli_error

import sartor
from sartor.ops.nms import OUTPUT_NAMES
from sartor.pipeline import EngineNms, Pipeline, YoloNms

ROOT = Path(__file__).resolve().parents[2]
MODEL = ROOT / "samples" / "detector" / "sample_detector.onnx"
PREPROCESS = "letterbox=320,mean=0,std=255,rgb,nchw"
SHAPES = {"min_shapes": {"images": (1, 3, 320, 320)}, "opt_shapes": {"images": (4, 3, 320, 320)},
          "max_shapes": {"images": (4, 3, 320, 320)}}
NMS = "conf=0.25,iou=0.45,max_det=50,topk=500"


@pytest.fixture(scope="module")
def scenes(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("scenes")
    subprocess.run([sys.executable, str(ROOT / "samples/detector/make_dataset.py"), str(out), "--count", "10",
                    "--seed", "20000002", "--night-fraction", "0.5", "--workers", "1"],
                   check=True, capture_output=True, timeout=300)
    return out / "annotations.json"


@pytest.fixture(scope="module")
def plans(tmp_path_factory) -> dict:
    folder = tmp_path_factory.mktemp("engines")
    built = {}
    for name, nms in (("raw", None), ("nms", NMS)):
        built[name] = folder / f"{name}.plan"
        sartor.build(MODEL, built[name], device="cpu", preprocess=PREPROCESS, builder_effort=0, nms=nms, **SHAPES)
    return built


def _images(scenes: Path) -> list[Path]:
    return sorted((scenes.parent / "images").iterdir())


def test_the_engine_outputs_the_four_fixed_size_tensors(plans):
    engine = sartor.load(plans["nms"])
    assert [v.name for v in engine.outputs] == list(OUTPUT_NAMES)
    assert engine.nms["head_output"] == "output0" and engine.nms["outputs"] == list(OUTPUT_NAMES)
    assert (engine.nms["conf"], engine.nms["iou"], engine.nms["max_det"], engine.nms["topk"]) == (0.25, 0.45, 50, 500)
    assert any("nms: conf=0.25" in line and "at most 4096" in line for line in engine.header["build_log"])
    assert sartor.load(plans["raw"]).nms is None
    from sartor.runtime.engine import rebuild_command
    assert f"--nms {NMS}" in rebuild_command(engine.header)  # a chip-lock refusal's command keeps the NMS


def test_pipeline_keeps_what_host_side_nms_keeps(plans, scenes):
    files = _images(scenes)
    host = Pipeline(sartor.load(plans["raw"]), batch_size=4, host_outputs=False,
                    decoder=YoloNms(conf=0.25, iou=0.45, max_det=50)).run(files)
    in_engine = Pipeline(sartor.load(plans["nms"]), batch_size=4).run(files)
    assert sum(len(r.detections) for r in host) > 20
    for expected, got in zip(host, in_engine):
        assert got.meta.orig_size == expected.meta.orig_size
        np.testing.assert_array_equal(got.detections.classes, expected.detections.classes)
        np.testing.assert_array_equal(got.detections.scores, expected.detections.scores)
        np.testing.assert_array_equal(got.detections.boxes, expected.detections.boxes)
    # A YoloNms given to an --nms engine gives way to the engine's own NMS.
    again = Pipeline(sartor.load(plans["nms"]), batch_size=4, decoder=YoloNms(conf=0.9), host_outputs=False).run(files)
    assert isinstance(Pipeline(sartor.load(plans["nms"])).decoder, EngineNms)
    for expected, got in zip(in_engine, again):
        np.testing.assert_array_equal(got.detections.boxes, expected.detections.boxes)


@pytest.mark.skipif(not any(importlib.util.find_spec(name) for name in ("pycocotools", "faster_coco_eval")),
                    reason="COCO mAP needs the build extra (pycocotools), which the H200 machine lacks")
def test_validate_gives_the_host_side_map_on_every_split(plans, scenes):
    from sartor.validate import validate
    raw = validate(plans["raw"], scenes, reference=MODEL, split_by="lighting", conf=0.25, iou=0.45, max_det=50)
    nms = validate(plans["nms"], scenes, reference=MODEL, split_by="lighting")
    assert nms.overall.engine == pytest.approx(raw.overall.engine, abs=1e-12) and nms.overall.engine > 0.3
    assert nms.overall.reference == pytest.approx(raw.overall.reference, abs=1e-12)
    assert {s.name: s.engine for s in nms.splits} == pytest.approx({s.name: s.engine for s in raw.splits}, abs=1e-12)
    assert any("runs NMS itself" in note for note in nms.notes)
    assert nms.options["conf"] == 0.25 and nms.options["max_det"] == 50


def test_run_inspect_and_bench_read_the_engine(plans, scenes, cli):
    ran = cli("run", plans["nms"])
    assert ran.code == 0 and "detection_boxes" in ran.out and "4x50x4" in ran.out
    shown = cli("inspect", plans["nms"])
    assert shown.code == 0 and "BatchedNms" in shown.out and "nms: conf=0.25" in shown.out
    assert "conf=0.25 iou=0.45 max_det=50 topk=500 after output0 (5 classes)" in shown.out
    assert json.loads(cli("inspect", plans["nms"], "--json").out)["nms"]["topk"] == 500
    from sartor.pipeline.benchmark import IN_ENGINE_NMS, end_to_end
    result = end_to_end(sartor.load(plans["nms"]), _images(scenes)[:4], batch=4, passes=2, stage_repeats=1)
    assert result.decoder == IN_ENGINE_NMS and "post" in result.stages_ms


def test_compare_refuses_an_nms_engine_in_one_line(plans, cli):
    assert_cli_error(cli("compare", MODEL, plans["nms"], "--batch", "2"), "the engine runs NMS itself",
                     "sartor validate")


def test_nms_on_a_model_without_a_yolo_head_exits_2(cli, tiny_onnx, tmp_path):
    out = tmp_path / "x.plan"
    result = cli("build", tiny_onnx, "-o", out, "--device", "cpu", "--builder-effort", "0", "--nms", "conf=0.3",
                 "--min-shapes", "images:1x3x16x16", "--opt-shapes", "images:2x3x16x16", "--max-shapes", "images:2x3x16x16")
    assert_cli_error(result, "--nms needs one YOLOv8/YOLO11 detection head", "logits")
    assert not out.exists() and list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("spec,fragment", [("conf=2", "conf=2 must be in [0, 1)"),
                                           ("iou=x", "iou needs a number"),
                                           ("topk=9000", "topk=9000 must be in 1..4096"),
                                           ("score=0.3", "is not one of conf=X")])
def test_bad_nms_settings_exit_2_before_anything_runs(cli, spec, fragment, tmp_path):
    out = tmp_path / "x.plan"
    assert_cli_error(cli("build", MODEL, "-o", out, "--device", "cpu", "--nms", spec), fragment)
    assert not out.exists()


def test_the_json_report_of_validate_names_the_engines_nms(plans, scenes, cli):
    result = cli("validate", plans["nms"], "--data", scenes, "--reference", MODEL, "--json")
    assert result.code == 0, result
    report = json.loads(result.out)
    # Ultralytics' AP scores unclipped boxes; the engine's NMS clips them, so both sides stay clipped
    ultra = cli("validate", plans["nms"], "--data", scenes, "--reference", MODEL, "--ap-method", "ultralytics",
                "--json")
    assert ultra.code == 0 and any("clips its boxes" in n for n in json.loads(ultra.out)["notes"])
    assert report["options"]["conf"] == 0.25 and report["decoder"] == "yolo"


def test_boxes_in_host_memory_map_back_as_the_device_path_maps_them():
    """EngineNms maps host outputs with numpy: the same float32 steps as the torch path, bit for bit,
    boxes past every edge clamped alike."""
    import torch

    from sartor.data.preprocess import parse_preprocess, placement
    from sartor.pipeline.detections import to_original
    spec = parse_preprocess("letterbox=64,mean=0,std=255,rgb,nchw")
    metas = [placement(h, w, spec).meta(f"f{i}", (h, w)) for i, (h, w) in enumerate([(48, 80), (37, 53), (64, 64)])]
    rng = np.random.default_rng(0)
    boxes = rng.uniform(-20, 90, (60, 4)).astype(np.float32)
    image = rng.integers(0, 3, 60)
    on_host = to_original(boxes, image, metas)
    with_torch = to_original(torch.from_numpy(boxes), torch.from_numpy(image), metas).numpy()
    assert on_host.dtype == np.float32 and np.array_equal(on_host, with_torch)
    assert (on_host >= 0).all() and not np.array_equal(on_host, boxes)  # clamped and mapped, not passed through


def test_batch_detections_equal_those_made_one_image_at_a_time_and_refuse_counts_they_do_not_hold():
    from sartor.errors import DataError
    from sartor.pipeline.detections import Detections
    rng = np.random.default_rng(1)
    boxes, scores = rng.uniform(0, 50, (3, 5, 4)).astype(np.float32), rng.uniform(0, 1, (3, 5)).astype(np.float32)
    classes = rng.integers(0, 80, (3, 5)).astype(np.int32)
    counts = [5, 0, 2]
    batch = Detections.per_image(boxes, scores, classes, counts)
    alone = [Detections(boxes[b, :n], scores[b, :n], classes[b, :n]) for b, n in enumerate(counts)]
    for made, reference in zip(batch, alone):
        assert len(made) == len(reference) and made.classes.dtype == reference.classes.dtype == np.int64
        assert all(np.array_equal(getattr(made, k), getattr(reference, k)) for k in ("boxes", "scores", "classes"))
    with pytest.raises(DataError, match="do not hold counts"):
        Detections.per_image(boxes, scores, classes, [6, 0, 0])
