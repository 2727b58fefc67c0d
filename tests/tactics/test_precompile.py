"""Parallel precompilation of a layer's kernel candidates (`sartor/tactics/precompile.py`): every
candidate runs once on a worker thread, failures are left to the timing run, nothing runs on the
CPU or under Triton's interpreter, and the builder calls it with the candidates it then times."""
from __future__ import annotations

import threading
import time

import torch
from conftest import MAX_SHAPES, MIN_SHAPES, OPT_SHAPES

import sartor
from sartor.tactics import precompile, select


def test_every_candidate_runs_once_on_worker_threads_and_failures_are_counted_out():
    seen, lock = [], threading.Lock()

    def run_once(tactic):
        with lock:
            seen.append((tactic, threading.current_thread().name, torch.is_inference_mode_enabled()))
        if tactic == "broken":
            raise RuntimeError("does not compile")

    ran = precompile._run_all(run_once, ["a", "b", "broken", "c"], torch.device("cpu"), workers=3)
    assert ran == 3
    assert sorted(t for t, _, _ in seen) == ["a", "b", "broken", "c"]
    assert all(name.startswith("sartor-compile") for _, name, _ in seen)
    assert all(inference for _, _, inference in seen)  # as on the builder's own thread


def test_nothing_runs_on_the_cpu_under_the_interpreter_or_for_one_candidate(monkeypatch):
    calls = []
    assert precompile.compile_in_parallel(calls.append, ["a", "b"], torch.device("cpu")) == 0
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert precompile.compile_in_parallel(calls.append, ["a", "b"], torch.device("cuda", 0)) == 0
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert precompile.compile_in_parallel(calls.append, ["a"], torch.device("cuda", 0)) == 0
    assert calls == []


def test_the_builder_precompiles_the_candidates_it_times(tiny_onnx, tmp_path, monkeypatch):
    """With the candidates' tactics (all but the reference) before the timing of each timed layer."""
    asked = []

    def record(run_once, tactics, device, workers=None, spent=None):
        asked.append((list(tactics), device.type))
        return 0
    monkeypatch.setattr(select, "compile_in_parallel", record)
    sartor.build(tiny_onnx, tmp_path / "m.plan", device="cpu", min_shapes=MIN_SHAPES, opt_shapes=OPT_SHAPES,
                 max_shapes=MAX_SHAPES)
    assert asked == [(["channels_last"], "cpu")] * 2  # two convolutions, each timed


def test_the_threads_seconds_are_reported_per_tactic():
    spent = {}
    precompile._run_all(lambda tactic: time.sleep(0.05 if tactic == "slow" else 0), ["slow", "quick"],
                        torch.device("cpu"), workers=2, spent=spent)
    assert set(spent) == {"slow", "quick"} and spent["slow"] >= 0.05 > spent["quick"]
