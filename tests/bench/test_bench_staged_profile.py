"""bench/staged_profile.py: a copied and an in-place run's kernels side by side (on the CPU, its ops)."""
from __future__ import annotations

import sys
from pathlib import Path

from conftest import IMAGE

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))

import staged_profile  # noqa: E402


def test_both_ways_are_profiled_and_printed_side_by_side(tiny_onnx, capsys):
    ways = staged_profile.main(["--onnx", str(tiny_onnx), "--batch", "2", "--size", str(IMAGE), "--runs", "2",
                                "--device", "cpu"])
    assert set(ways) == {"copied", "in_place"}
    assert all(ways[w] and all(ms >= 0 for ms in ways[w].values()) for w in ways)
    assert any("int_mm" in name for name in ways["in_place"])  # the INT8 layers ran
    printed = capsys.readouterr().out
    assert printed.startswith("totals ms: copied ") and len(printed.splitlines()) > 2
