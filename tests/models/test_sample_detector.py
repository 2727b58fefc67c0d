"""The shipped sample detector, as the README's first command uses it: rendered held-out scenes,
a CPU build with the stored preprocessing, and `sartor validate` per lighting split."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
MODEL = ROOT / "samples" / "detector" / "sample_detector.onnx"
PREPROCESS = "letterbox=320,mean=0,std=255,rgb,nchw"


def _sartor(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "sartor", *args], capture_output=True, text=True, cwd=ROOT,
                          timeout=600)


@pytest.fixture(scope="module")
def scenes(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("scenes")
    subprocess.run([sys.executable, str(ROOT / "samples/detector/make_dataset.py"), str(out), "--count", "24",
                    "--seed", "20000000", "--night-fraction", "0.5", "--workers", "1"],
                   check=True, capture_output=True, timeout=300)
    return out / "annotations.json"


@pytest.fixture(scope="module")
def plan(tmp_path_factory) -> Path:
    plan = tmp_path_factory.mktemp("sample_plan") / "det.plan"
    built = _sartor("build", str(MODEL), "-o", str(plan), "--device", "cpu", "--preprocess", PREPROCESS,
                    "--min-shapes", "images:1x3x320x320", "--opt-shapes", "images:8x3x320x320",
                    "--max-shapes", "images:8x3x320x320")
    assert built.returncode == 0, built.stderr
    return plan


def test_sample_detector_builds_and_validates_per_split_on_cpu(scenes, plan, tmp_path):
    report_path = tmp_path / "report.html"
    checked = _sartor("validate", str(plan), "--data", str(scenes), "--reference", str(MODEL), "--split-by",
                      "lighting", "--max-drop", "0.008", "--json", "--report", str(report_path))
    assert checked.returncode == 0, checked.stderr
    report = json.loads(checked.stdout)
    splits = {s["name"]: s for s in report["splits"]}
    assert set(splits) == {"day", "night"}
    for split in splits.values():
        # A trained detector: far above chance on both lightings, and the FP32 engine keeps it.
        assert split["reference_extra"]["map50"] >= 0.6
        assert abs(split["drop"]) <= 1e-3
    assert "<svg" in report_path.read_text()


def _engine_map_on_reference_batches(plan: Path, annotations: Path) -> dict:
    """The engine's mAP per split as `sartor validate` computed it before it ran the Pipeline: the
    engine on `sartor.data.preprocess`'s batches, decoded and scored by the same functions."""
    import sartor
    from sartor.data.datasets import iterate_batches, open_dataset
    from sartor.validate.decoders import DecodeOptions, make_decoder
    from sartor.validate.ap import coco_map

    engine = sartor.load(plan, device="cpu")
    dataset = open_dataset(annotations)
    context, detections, decoder = engine.context(), [], None
    for arrays, metas, _ in iterate_batches(dataset.samples, engine.preprocess, 8):
        outputs = {k: v.detach().cpu().numpy() if hasattr(v, "detach") else np.asarray(v)
                   for k, v in context.run({"images": arrays}).items()}
        decoder = decoder or make_decoder(None, {k: v.shape for k, v in outputs.items()},
                                          {k: v.dtype for k, v in outputs.items()}, DecodeOptions())
        detections.extend(decoder(outputs, metas))
    splits = {"all": list(range(len(dataset.samples)))}
    position = {id(s): i for i, s in enumerate(dataset.samples)}
    splits.update({name: [position[id(s)] for s in members] for name, members in dataset.splits("lighting").items()})
    class_ids = list(range(len(dataset.class_names)))
    return {name: coco_map([dataset.samples[i] for i in idx], [detections[i] for i in idx], class_ids,
                           [dataset.samples[i].size for i in idx]).map for name, idx in splits.items()}


def test_validate_through_the_pipeline_equals_the_engine_on_reference_batches(scenes, plan):
    from sartor.validate.runner import validate
    before = _engine_map_on_reference_batches(plan, scenes)
    report = validate(plan, scenes, reference=MODEL, split_by="lighting")  # exact decoding by default
    assert report.options["fast_decode"] is False
    now = {s.name: s.engine for s in [report.overall, *report.splits]}
    assert set(now) == set(before) == {"all", "day", "night"}
    for name, figure in now.items():
        assert before[name] > 0.3 and abs(figure - before[name]) <= 1e-3, (name, figure, before[name])


def test_validate_fast_decode_measures_the_cpu_fast_path(tmp_path_factory, plan):
    """Scenes of 640 for a letterbox of 320: the fast path decodes them at half scale; the sample
    detector keeps its accuracy on both lightings (decision 0025)."""
    out = tmp_path_factory.mktemp("scenes640")
    subprocess.run([sys.executable, str(ROOT / "samples/detector/make_dataset.py"), str(out), "--count", "16",
                    "--seed", "20000000", "--size", "640", "--workers", "1"], check=True, capture_output=True,
                   timeout=300)
    reports = {}
    for flags in ((), ("--fast-decode",)):
        checked = _sartor("validate", str(plan), "--data", str(out / "annotations.json"), "--reference", str(MODEL),
                          "--split-by", "lighting", "--json", *flags)
        assert checked.returncode == 0, checked.stderr
        reports[flags] = json.loads(checked.stdout)
    exact, fast = reports[()], reports[("--fast-decode",)]
    assert exact["options"]["fast_decode"] is False and fast["options"]["fast_decode"] is True
    for e, f in zip([exact["overall"], *exact["splits"]], [fast["overall"], *fast["splits"]]):
        assert e["name"] == f["name"] and e["reference"] == f["reference"]
        assert abs(e["drop"]) <= 1e-3  # exact decoding: the FP32 engine equals its reference
        assert f["engine"] != e["engine"] and abs(f["engine"] - e["engine"]) <= 0.02, (e, f)
