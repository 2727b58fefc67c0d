"""bench/staged_copy.py: decision 0068's three ways of running an engine, timed in turns."""
from __future__ import annotations

import json
import sys
from pathlib import Path

from conftest import IMAGE

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))

import staged_copy  # noqa: E402


def test_each_engine_is_timed_three_ways_with_the_same_outputs(tiny_onnx, tmp_path, capsys):
    """On the CPU (no graphs, so nothing is staged): both engines built, every way timed each round,
    the outputs of a copied run and of the engine's own buffer equal, the ratio line printed."""
    result = staged_copy.main(["--onnx", str(tiny_onnx), "--batch", "2", "--size", str(IMAGE), "--device", "cpu",
                               "--effort", "0", "--precisions", "fp32,int8", "--rounds", "2", "--iterations", "3",
                               "--out", str(tmp_path)])
    assert set(result["engines"]) == {"fp32", "int8"}
    for figures in result["engines"].values():
        assert figures["same_outputs"] is True
        assert all(figures[way] > 0 for way in staged_copy.WAYS)
    assert json.loads((tmp_path / "staged_copy.json").read_text())["shape"] == [2, 3, IMAGE, IMAGE]
    printed = capsys.readouterr().out
    assert "tiny int8 b2: staged copy" in printed and "FP16 ÷ INT8" not in printed
