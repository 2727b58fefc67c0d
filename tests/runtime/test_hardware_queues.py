"""CUDA_DEVICE_MAX_CONNECTIONS (`runtime/hardware_queues.py`): sartor asks for 32 hardware queues at
import, keeps a value the user set, and says when CUDA started too early for the request to count."""
from __future__ import annotations

import os
import subprocess
import sys
import warnings

import pytest
import torch
from conftest import MAX_SHAPES, MIN_SHAPES, OPT_SHAPES

import sartor
from sartor.pipeline import Pipeline
from sartor.runtime import hardware_queues
from sartor.runtime.hardware_queues import CONNECTIONS_ENV, WANTED_CONNECTIONS

SPEC = "letterbox=16,mean=0,std=255,rgb,nchw"


def queues_after_import(value: str | None, more: dict | None = None) -> str:
    """CUDA_DEVICE_MAX_CONNECTIONS in a fresh process after `import sartor`, started with `value` (None:
    unset) and the variables `more`."""
    env = {k: v for k, v in os.environ.items() if k != CONNECTIONS_ENV} | (more or {})
    if value is not None:
        env[CONNECTIONS_ENV] = value
    code = f"import os, sartor; print(os.environ.get({CONNECTIONS_ENV!r}, 'unset'))"
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          check=True).stdout.strip()


def test_importing_sartor_asks_for_thirty_two_queues(tmp_path):
    no_mps = {"CUDA_MPS_PIPE_DIRECTORY": str(tmp_path)}  # an MPS pipe folder with no daemon in it
    assert queues_after_import(None, no_mps) == str(WANTED_CONNECTIONS)


def test_a_value_the_user_set_is_kept():
    assert queues_after_import("4") == "4"


def test_beside_an_mps_daemon_the_driver_keeps_its_default(tmp_path):
    (tmp_path / "control").write_text("")  # the control daemon's pipe, where CUDA_MPS_PIPE_DIRECTORY says
    assert queues_after_import(None, {"CUDA_MPS_PIPE_DIRECTORY": str(tmp_path)}) == "unset"
    assert queues_after_import(None, {"CUDA_MPS_PIPE_DIRECTORY": str(tmp_path / "none")}) == str(WANTED_CONNECTIONS)


@pytest.fixture
def unset(monkeypatch, tmp_path):
    monkeypatch.delenv(CONNECTIONS_ENV, raising=False)
    monkeypatch.setenv("CUDA_MPS_PIPE_DIRECTORY", str(tmp_path))  # no MPS daemon, whatever the machine runs
    monkeypatch.setattr(hardware_queues, "_set_too_late", False)


def test_after_cuda_started_nothing_is_set_and_the_driver_default_is_reported(unset, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    hardware_queues.request_connections()
    assert CONNECTIONS_ENV not in os.environ
    assert hardware_queues.in_effect() == 8
    assert f"{CONNECTIONS_ENV}={WANTED_CONNECTIONS}" in hardware_queues.fewer_than_wanted()


def test_before_cuda_started_the_request_is_in_effect(unset, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    hardware_queues.request_connections()
    assert os.environ[CONNECTIONS_ENV] == str(WANTED_CONNECTIONS)
    assert hardware_queues.in_effect() == WANTED_CONNECTIONS and hardware_queues.fewer_than_wanted() is None


def test_a_value_that_is_no_number_counts_as_the_driver_default(unset, monkeypatch):
    monkeypatch.setenv(CONNECTIONS_ENV, "many")
    assert hardware_queues.in_effect() == 8


@pytest.fixture(scope="module")
def plans(tiny_onnx, tmp_path_factory):
    folder = tmp_path_factory.mktemp("queues")
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    for device in devices:
        sartor.build(tiny_onnx, folder / f"{device}.plan", device=device, min_shapes=MIN_SHAPES,
                     opt_shapes=OPT_SHAPES, max_shapes=MAX_SHAPES, preprocess=SPEC)
    return {device: folder / f"{device}.plan" for device in devices}


def test_a_cpu_pipeline_does_not_warn_about_queues_it_does_not_use(plans, monkeypatch):
    monkeypatch.setattr(hardware_queues, "_set_too_late", True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        Pipeline(sartor.load(plans["cpu"], device="cpu"))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_on_cuda_a_pipeline_warns_when_cuda_started_before_sartor_could_ask(plans, monkeypatch):
    monkeypatch.setattr(hardware_queues, "_set_too_late", True)
    with pytest.warns(RuntimeWarning, match=f"{CONNECTIONS_ENV}={WANTED_CONNECTIONS}"):
        Pipeline(sartor.load(plans["cuda"], device="cuda"))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_on_cuda_the_end_to_end_benchmark_reports_the_queues_in_effect(plans, tmp_path):
    from PIL import Image

    from sartor.pipeline.benchmark import end_to_end
    files = []
    for k in range(4):
        files.append(tmp_path / f"{k}.jpg")
        Image.new("RGB", (32, 24), (40 * k, 80, 120)).save(files[-1], quality=90)
    result = end_to_end(sartor.load(plans["cuda"], device="cuda"), files, batch=2, passes=2, stage_repeats=2)
    assert result.hardware_queues == hardware_queues.in_effect()
