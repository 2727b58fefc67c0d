"""bench/staged_pipeline.py: raw frames → boxes through the Pipeline, batches staged or float, in turns."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
ROOT = BENCH.parent
sys.path.insert(0, str(BENCH))
pytest.importorskip("skimage")

import staged_pipeline  # noqa: E402


def test_both_ways_run_every_round_and_keep_the_same_boxes(tmp_path, capsys):
    """On the CPU (no preprocessing kernel, so neither way stages): the trained YOLOv8n at 64 built
    FP32 and INT8 with the NMS inside, each way timed each round, the boxes of both ways equal."""
    result = staged_pipeline.main(["--onnx", str(ROOT / "samples/yolo/yolov8n_scenes.onnx"), "--batch", "2",
                                   "--size", "64", "--count", "4", "--rounds", "2", "--effort", "0",
                                   "--precisions", "fp32,int8", "--device", "cpu", "--out", str(tmp_path)])
    assert set(result["engines"]) == {"fp32", "int8"}
    for entry in result["engines"].values():
        assert entry["same_boxes"] is True and entry["staging"] == "None"
        assert all(len(entry["rounds_per_s"][way]) == 2 and entry["frames_per_s"][way] > 0
                   for way in staged_pipeline.WAYS)
        assert entry["engine_alone_per_s"] > 0
    assert json.loads((tmp_path / "staged_pipeline.json").read_text())["size"] == 64
    assert "yolov8n_scenes int8 b2: raw frames → boxes, staged" in capsys.readouterr().out
