"""The shipped sample detector, as the README's first command uses it: rendered held-out scenes,
a CPU build with the stored preprocessing, and `sartor validate` per lighting split."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

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


def test_sample_detector_builds_and_validates_per_split_on_cpu(scenes, tmp_path):
    plan = tmp_path / "det.plan"
    built = _sartor("build", str(MODEL), "-o", str(plan), "--device", "cpu", "--preprocess", PREPROCESS,
                    "--min-shapes", "images:1x3x320x320", "--opt-shapes", "images:8x3x320x320",
                    "--max-shapes", "images:8x3x320x320")
    assert built.returncode == 0, built.stderr
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
