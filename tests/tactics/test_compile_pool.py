"""Compiling every layer's Triton candidates up front in worker processes (`sartor/tactics/compile_pool.py`,
`kernel_requests.py`): compiles recorded without compiling or launching, compiled for sm_90 by
worker processes into the builder's cache under the keys its JIT then looks up, failures left to
the timing run, and nothing done on the CPU, under Triton's interpreter or when turned off.

The cross-compile runs in a fresh process without the interpreter (its functions are compiled
ones), with Triton's driver replaced by one that names an sm_90 GPU and launches nothing."""
from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import MAX_SHAPES, MIN_SHAPES, OPT_SHAPES

import sartor
from sartor.tactics import compile_pool, kernel_requests, select

ROOT = Path(__file__).resolve().parents[2]

_PROBE = r"""
import json, os, sys
import torch
from triton import knobs
from triton.backends.compiler import GPUTarget
from triton.runtime.driver import driver

class NoLaunch(Exception):
    pass

class Sm90:
    # Triton's driver as the JIT asks it: an sm_90 target, device 0, stream 0, and no launches.
    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)
    def get_current_device(self):
        return 0
    def get_current_stream(self, device=None):
        return 0
    @property
    def launcher_cls(self):
        raise NoLaunch()

driver.set_active(Sm90())
from sartor.kernels.conv.igemm import candidate_tiles, conv_igemm, pack_weight
from sartor.ops.conv import _conv_depthwise, _geometry_2d
from sartor.tactics import compile_pool
from sartor.tactics.kernel_requests import Recorder

x = torch.randn(2, 16, 8, 8, dtype=torch.float16).contiguous(memory_format=torch.channels_last)
w = torch.randn(32, 16, 3, 3, dtype=torch.float16)
b = torch.randn(32, dtype=torch.float16)
dw = torch.randn(16, 1, 3, 3, dtype=torch.float16)
attrs = {"pads": [1, 1, 1, 1], "activation": "Relu"}
geometry = _geometry_2d(x, w, attrs)
tiles = candidate_tiles(int8=False, effort=1)[:2]
runs = [(t.name, lambda t=t: conv_igemm(x, pack_weight(w), b, geometry, t, activation="Relu")) for t in tiles]
runs.append(("triton_depthwise", lambda: _conv_depthwise(x, dw, None, None, dict(attrs, group=16), require_cuda=False)))

def collect(recorder):
    for tactic, run in runs:
        recorder.run(tactic, run)

alone = Recorder()
collect(alone)  # nothing compiled or launched: no launch error, no cache entry
entries_after_recording = len(os.listdir(os.environ["TRITON_CACHE_DIR"]))
done = compile_pool.precompile(collect, torch.device("cuda"))
looked_up = []
knobs.compilation.listener = lambda **event: looked_up.append([event["cache_hit"], event["metadata"]["hash"]])
for _, run in runs:  # the builder's own JIT: it finds each kernel in the cache, then cannot launch here
    try:
        run()
    except NoLaunch:
        pass
print(json.dumps({"recorded": sorted(alone.tactic_of.values()), "failed_runs": alone.failed_runs,
                  "unrecorded": alone.unrecorded, "entries_after_recording": entries_after_recording,
                  "done": done and vars(done), "looked_up": looked_up}))
"""


def _probe(tmp_path: Path, workers: str = "2") -> dict:
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(PYTHONPATH=str(ROOT), TRITON_CACHE_DIR=str(tmp_path / "triton"), SARTOR_COMPILE_WORKERS=workers)
    (tmp_path / "triton").mkdir()
    run = subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, timeout=600,
                         check=False)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def test_recorded_candidates_compile_for_sm90_in_workers_under_the_keys_the_jit_looks_up(tmp_path):
    result = _probe(tmp_path)
    assert result["recorded"] == ["igemm.128x128x32.w8.s3", "igemm.64x64x32.w4.s4", "triton_depthwise"]
    assert result["failed_runs"] == result["unrecorded"] == result["entries_after_recording"] == 0
    done = result["done"]
    assert (done["requests"], done["compiled"], done["cached"], done["failed"], done["mismatched"]) == (3, 3, 0, 0, 0)
    assert done["unrecorded"] == done["failed_runs"] == 0
    assert done["workers"] == 2 and set(done["spent"]) == set(result["recorded"])
    # The JIT's own lookups (one per kernel) all hit what the workers wrote.
    assert len(result["looked_up"]) == 3 and all(hit for hit, _ in result["looked_up"])


def test_a_request_that_fails_in_a_worker_is_left_to_the_timing_run():
    broken = kernel_requests.CompileRequest("sartor.no_such_module", "kernel", {}, {}, {}, {}, ("cuda", 90, 32), "k")
    answers = compile_pool.compile_in_workers([broken], workers=1)
    assert "ModuleNotFoundError" in answers[broken.ident]["error"]


def test_a_worker_that_dies_answers_nothing_more(monkeypatch):
    monkeypatch.setattr(compile_pool, "_WORKER_MODULE", "no_such_worker_module")  # exits at once
    requests = [kernel_requests.CompileRequest("m", f"k{i}", {}, {}, {}, {}, ("cuda", 90, 32), "k") for i in range(3)]
    answers = compile_pool.compile_in_workers(requests, workers=2)
    assert all("the worker ended" in answer["error"] for answer in answers.values())
    assert len(answers) <= 2  # each dead worker failed the request it was given; the rest went unasked


def test_the_step_applies_only_to_compiled_cuda_builds_with_workers(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setenv(compile_pool.WORKERS_ENV, "4")
    assert compile_pool.applies(torch.device("cuda", 0))
    assert not compile_pool.applies(torch.device("cpu"))
    monkeypatch.setenv(compile_pool.WORKERS_ENV, "0")
    assert not compile_pool.applies(torch.device("cuda", 0))
    monkeypatch.setenv(compile_pool.WORKERS_ENV, "4")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not compile_pool.applies(torch.device("cuda", 0))
    calls = []
    assert compile_pool.precompile(calls.append, torch.device("cuda", 0)) is None and calls == []


def test_worker_count_defaults_to_the_cpus_capped(monkeypatch):
    monkeypatch.delenv(compile_pool.WORKERS_ENV, raising=False)
    assert 1 <= compile_pool.worker_count() <= compile_pool.MAX_WORKERS
    monkeypatch.setenv(compile_pool.WORKERS_ENV, "1000")
    assert compile_pool.worker_count() == compile_pool.MAX_WORKERS
    monkeypatch.setenv(compile_pool.WORKERS_ENV, "3")
    assert compile_pool.worker_count() == 3


def test_a_failing_step_falls_back_with_a_debug_line(monkeypatch, caplog):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setenv(compile_pool.WORKERS_ENV, "2")

    def collect(recorder):
        raise RuntimeError("recording broke")
    with caplog.at_level(logging.DEBUG, logger="sartor.tactics"):
        assert compile_pool.precompile(collect, torch.device("cuda", 0)) is None
    assert "precompile skipped: RuntimeError: recording broke" in caplog.text


def test_the_hook_is_removed_after_a_failing_candidate_and_another_hook_is_left_alone():
    from triton import knobs
    recorder = kernel_requests.Recorder()
    recorder.run("broken", lambda: 1 / 0)
    assert recorder.failed_runs == 1 and knobs.runtime.jit_cache_hook is None
    knobs.runtime.jit_cache_hook = theirs = lambda **_: None
    try:
        with pytest.raises(kernel_requests.RecordingUnavailable):
            kernel_requests.check_recording_available()
        assert knobs.runtime.jit_cache_hook is theirs
    finally:
        knobs.runtime.jit_cache_hook = None


class _Tactics:
    """A recorder that notes which candidates the builder runs through it, and a precompile that
    hands it to the builder's collect as compile_pool.precompile would."""

    def __init__(self):
        self.ran = []

    def run(self, tactic, fn):
        fn()
        self.ran.append(tactic)

    def precompile(self, collect, device):
        collect(self)
        # The builder charges the step's wall time, rounded to the millisecond in its report: a
        # compile of some length, or two tiny candidates on a quick machine round to nothing.
        time.sleep(0.01)
        return compile_pool.Precompiled(requests=len(self.ran), compiled=len(self.ran),
                                        spent={tactic: 1.0 for tactic in self.ran})


def test_the_builder_records_the_candidates_it_times_and_charges_the_step_to_them(tiny_onnx, tmp_path,
                                                                               monkeypatch):
    tactics = _Tactics()
    monkeypatch.setattr(select, "precompile", tactics.precompile)
    cache = tmp_path / "timing.json"
    result = sartor.build(tiny_onnx, tmp_path / "m.plan", device="cpu", min_shapes=MIN_SHAPES,
                          opt_shapes=OPT_SHAPES, max_shapes=MAX_SHAPES, timing_cache=str(cache))
    assert tactics.ran == ["channels_last"] * 2  # two convolutions; the reference is not compiled
    assert result.tactic_seconds["channels_last"]["compile_s"] > 0

    tactics.ran.clear()  # a rebuild from the timing cache runs each layer's winner alone
    sartor.build(tiny_onnx, tmp_path / "n.plan", device="cpu", min_shapes=MIN_SHAPES, opt_shapes=OPT_SHAPES,
                 max_shapes=MAX_SHAPES, timing_cache=str(cache))
    devices = json.loads(cache.read_text())["devices"].values()
    winners = sorted(entry["winner"] for device in devices for entry in device["entries"].values())
    assert sorted(tactics.ran) == [w for w in winners if w != "torch"]
