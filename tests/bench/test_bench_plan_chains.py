"""bench/plan_chains.py: an engine file's chains as the device scripts print them."""
from __future__ import annotations

import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))

import plan_chains  # noqa: E402


def test_the_line_counts_mixed_chains_and_tiles_and_quotes_the_build_log(monkeypatch):
    """A chain with a float second layer ("second_layers") is mixed, one of two QConv is not; the engine
    check's verdict, the chains' tiles counted and the build log's `chains:` line (cut to the width asked)
    follow the file's name."""
    gathered = "chain.128x32x32.w4.s4.gathered"
    header = {"chains_check": {"kept": True, "profiles": [{"apart_ms": 1.2, "chains_ms": 1.1}]},
              "graph": {"nodes": [{"name": "a+b", "op": "ConvChain", "attrs": {"layers": "QConv", "tactic": gathered}},
                                  {"name": "c+d", "op": "ConvChain",
                                   "attrs": {"layers": "QConv", "second_layers": "FusedConv", "tactic": gathered}},
                                  {"name": "e", "op": "QConv", "attrs": {"tactic": "igemm.64x64x64.w4.s3"}}]},
              "build_log": ["calibration: ...", "chains: 2 of 3 convolution chain(s) run as one kernel"]}
    monkeypatch.setattr(plan_chains, "read_engine_file", lambda path: (header, {}))
    line = plan_chains.chains_line("/tmp/x/yolo_int8_b1.plan", width=9)
    assert line == ("yolo_int8_b1.plan | chains kept True [{'apart_ms': 1.2, 'chains_ms': 1.1}] | "
                    f"mixed chains in the engine: 1 | tiles: {gathered} ×2 | chains: 2")
    halves = [{"chains": ["a+b"], "profiles": [1]}, {"chains": ["c+d"], "profiles": [2]}]
    header["chains_check"].update(subsets=halves, kept_chains=["c+d"])
    assert " | halves ['a+b'] [1]; ['c+d'] [2] | kept ['c+d'] | mixed" in plan_chains.chains_line("h.plan")
    monkeypatch.setattr(plan_chains, "read_engine_file", lambda path: ({"build_log": []}, {}))
    assert plan_chains.chains_line("e.plan") == ("e.plan | chains kept None None | mixed chains in the engine: 0 | "
                                                 "tiles: none | no chains line")
