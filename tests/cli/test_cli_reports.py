"""What reports leave sartor, as a log or a script reads them: real `python -m sartor` processes
with stdout and stderr pipes (progress lines per stage and per layer, plain tables that never cut a
name), `--json` on build, run, bench --per-layer and serve --dry-run, and their refusals."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import assert_cli_error, classifier_model, save
from serve_helpers import add_model

REPO = Path(__file__).resolve().parents[2]
BOX_DRAWING = set("│┃║─━═┌┐└┘├┤┬┴┼╭╮╯╰✓…")
# Longer than any terminal: a name cut to the width would end in "…".
LONG_NAME = "/model.22/cv3.2/" + "/".join(f"block{k}" for k in range(40)) + "/Conv"


def sartor_process(*argv, **env) -> subprocess.CompletedProcess:
    """`python -m sartor ARGV` from this checkout, stdout and stderr pipes, a line per progress step."""
    environment = dict(os.environ, PYTHONPATH=str(REPO), PYTHONWARNINGS="ignore", SARTOR_PROGRESS_INTERVAL="0",
                       COLUMNS="80", **env)
    return subprocess.run([sys.executable, "-m", "sartor", *map(str, argv)], capture_output=True, text=True,
                          check=False, env=environment, timeout=600, cwd=REPO)


@pytest.fixture(scope="module")
def long_named(tmp_path_factory) -> Path:
    """The tiny classifier whose second convolution has a 300-character name."""
    model = classifier_model()
    next(node for node in model.graph.node if node.name == "conv2").name = LONG_NAME
    return save(model, tmp_path_factory.mktemp("long_named") / "long.onnx")


@pytest.fixture(scope="module")
def long_built(long_named, tmp_path_factory):
    """(engine path, the `build --json` process) of the long-named model, built in a subprocess."""
    plan = tmp_path_factory.mktemp("long_plan") / "long.plan"
    done = sartor_process("build", long_named, "-o", plan, "--device", "cpu", "--opt-shapes", "images:2x3x16x16",
                          "--json")
    return plan, done


def test_build_json_and_progress_lines_in_a_log(long_built):
    plan, done = long_built
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stdout)  # stdout holds the JSON document only
    assert summary["schema"] == "sartor-build-summary/1" and summary["output"] == str(plan)
    assert summary["bytes"] == plan.stat().st_size and summary["device"] == "cpu" and summary["precision"] == "fp32"
    assert summary["onnx_nodes"] == 7 and summary["layer_count"] == 5
    assert [layer["name"] for layer in summary["layers"]] == ["conv1", LONG_NAME, "pool", "flatten", "fc"]
    assert summary["layers"][1]["origin"] == [LONG_NAME, "add"] and summary["layers"][1]["tactic"]
    assert set(summary["stage_seconds"]) >= {"import", "optimize", "tactics", "memory", "serialize"}
    assert "tactics: 2 timed, 0 from timing cache" in summary["log"] and summary["warnings"] == []
    assert summary["bundle"] is None
    # stderr: a line per stage started and done, and per layer as the tactics stage reaches it
    err = done.stderr.splitlines()
    assert "build: tactics started" in err and any(line.startswith("  done tactics ") for line in err)
    progress = [line for line in err if line.startswith("progress: build tactics ")]
    assert len(progress) == 5, done.stderr
    assert progress[1].startswith("progress: build tactics 1/5, elapsed ")
    assert progress[1].endswith(f"left: layer 2 of 5: {LONG_NAME}")  # whole, though far past 80 columns
    assert not BOX_DRAWING & set(done.stderr)


def test_piped_tables_are_plain_and_never_cut(long_built):
    plan, _ = long_built
    done = sartor_process("inspect", plan)
    assert done.returncode == 0, done.stderr
    assert not BOX_DRAWING & set(done.stdout)
    row = next(line for line in done.stdout.splitlines() if LONG_NAME in line)
    assert row.split()[:4] == ["1", LONG_NAME, "FusedConv", LONG_NAME + ","]
    assert all(line == line.rstrip() for line in done.stdout.splitlines())  # no padding to a width


def test_bench_per_layer_in_a_log(long_built):
    plan, _ = long_built
    done = sartor_process("bench", plan, "--per-layer", "--iterations", "2", "--warmup", "0")
    assert done.returncode == 0, done.stderr
    assert not BOX_DRAWING & set(done.stdout)
    lines = done.stdout.splitlines()
    header = lines.index(next(line for line in lines if line.startswith("#  layer")))
    rows = [line.split() for line in lines[header + 1:header + 6]]
    assert sorted(row[1] for row in rows) == sorted(["conv1", LONG_NAME, "pool", "flatten", "fc"])
    assert [row[0] for row in rows] == ["1", "2", "3", "4", "5"]
    assert all(row[4].endswith("%") for row in rows)
    assert "iterations    2 eager runs after 0 warm-up; medians per layer" in done.stdout

    done = sartor_process("bench", plan, "--per-layer", "--iterations", "2", "--warmup", "0", "--json")
    assert done.returncode == 0, done.stderr
    profile = json.loads(done.stdout)
    assert profile["schema"] == "sartor-layer-profile/1" and profile["engine"] == str(plan)
    assert profile["device"] == "cpu" and profile["iterations"] == 2 and profile["nvtx"] is False
    layers = profile["layers"]
    assert {layer["name"] for layer in layers} == {"conv1", LONG_NAME, "pool", "flatten", "fc"}
    assert [layer["median_ms"] for layer in layers] == sorted((layer["median_ms"] for layer in layers), reverse=True)
    assert sum(layer["share"] for layer in layers) == pytest.approx(1.0)
    long = next(layer for layer in layers if layer["name"] == LONG_NAME)
    assert long["origin"] == [LONG_NAME, "add"] and long["precision"] == "fp32" and long["op"] == "FusedConv"


def test_run_json(tiny_plan, tmp_path, cli):
    result = cli("run", tiny_plan, "--json", "--output", tmp_path / "out.npz")
    assert result.code == 0, result
    report = json.loads(result.out)
    assert report["schema"] == "sartor-run/1" and report["device"] == "cpu" and report["random_seed"] == 0
    assert report["inputs"] == {"images": {"shape": [2, 3, 16, 16], "dtype": "float32"}}
    (output,) = report["outputs"]
    assert output["name"] == "logits" and output["shape"] == [2, 10] and output["dtype"] == "float32"
    assert output["min"] <= output["mean"] <= output["max"] and report["seconds"] > 0
    assert report["saved_to"] == str(tmp_path / "out.npz") and (tmp_path / "out.npz").is_file()
    assert "random inputs (seed 0)" in result.err  # notes go to stderr, stdout stays JSON


def test_run_prints_its_time(tiny_plan, cli):
    result = cli("run", tiny_plan)
    assert result.code == 0 and "one run: " in result.out and " ms " in result.out, result


def test_serve_dry_run_json(tiny_plan, tmp_path, cli):
    root = tmp_path / "repo"
    add_model(root, "tiny", tiny_plan)
    result = cli("serve", "--model-repository", root, "--dry-run", "--json")
    assert result.code == 0, result
    report = json.loads(result.out)
    assert report["schema"] == "sartor-serve-dry-run/1" and report["ready"] is True
    assert report["models"] == [{"name": "tiny", "version": "1", "state": "READY", "reason": ""}]
    (root / "broken" / "1").mkdir(parents=True)
    (root / "broken" / "1" / "model.plan").write_bytes(b"not an engine")
    result = cli("serve", "--model-repository", root, "--dry-run", "--json")
    assert result.code == 1, result
    report = json.loads(result.out)
    assert report["ready"] is False
    assert {row["name"]: row["state"] for row in report["models"]} == {"tiny": "READY", "broken": "UNAVAILABLE"}


def test_refusals(tiny_plan, tmp_path, cli):
    assert_cli_error(cli("bench", tiny_plan, "--nvtx"), "--nvtx goes with --per-layer")
    assert_cli_error(cli("bench", tiny_plan, "--per-layer", "--end-to-end", "--images", tmp_path),
                     "--per-layer times the engine's layers")
    assert_cli_error(cli("bench", tiny_plan, "--per-layer", "--iterations", "0"), "--iterations must be at least 1")
    assert_cli_error(cli("bench", tiny_plan, "--per-layer", "--shapes", "img:2x3x16x16"), "unknown input(s) img")
    assert_cli_error(cli("serve", "--model-repository", tmp_path, "--json"), "--json goes with --dry-run")


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="the refusal is for machines without CUDA")
def test_nvtx_without_cuda(tiny_plan, cli):
    assert_cli_error(cli("bench", tiny_plan, "--per-layer", "--nvtx"), "--nvtx needs a CUDA device")


def test_calibration_reports_its_batches(tiny_onnx, tmp_path, cli, monkeypatch):
    monkeypatch.setenv("SARTOR_PROGRESS_INTERVAL", "0")
    np.save(tmp_path / "calib.npy", np.random.default_rng(0).standard_normal((12, 3, 16, 16)).astype(np.float32))
    result = cli("build", tiny_onnx, "-o", tmp_path / "int8.plan", "--device", "cpu", "--precision", "int8",
                 "--calib", tmp_path / "calib.npy", "--calib-size", "12", "--opt-shapes", "images:4x3x16x16", "--json")
    assert result.code == 0, result
    lines = [line for line in result.err.splitlines() if line.startswith("progress: build calibrate ")]
    assert [line.split()[3] for line in lines] == ["4/12,", "8/12,", "12/12,"], result.err
    assert lines[-1].endswith(": batch 3")
    assert json.loads(result.out)["precision"] == "int8"


def test_a_terminal_gets_a_live_bar_not_log_lines(tiny_onnx, tmp_path):
    """stderr a pseudo-terminal: rich draws (and clears) a bar; no `progress:` log lines, and stdout
    (a pipe) still holds only the JSON document."""
    import pty
    leader, follower = pty.openpty()
    environment = dict(os.environ, PYTHONPATH=str(REPO), PYTHONWARNINGS="ignore", SARTOR_PROGRESS_INTERVAL="0",
                       TERM="xterm")
    command = ["build", tiny_onnx, "-o", tmp_path / "t.plan", "--device", "cpu", "--opt-shapes", "images:2x3x16x16",
               "--json"]
    process = subprocess.Popen([sys.executable, "-m", "sartor", *map(str, command)],
                               stdout=subprocess.PIPE, stderr=follower, text=True, env=environment, cwd=REPO)
    os.close(follower)
    terminal = b""
    while True:
        try:
            chunk = os.read(leader, 65536)
        except OSError:  # the process closed its end of the terminal
            break
        if not chunk:
            break
        terminal += chunk
    out = process.stdout.read()
    assert process.wait(timeout=600) == 0, terminal.decode(errors="replace")
    os.close(leader)
    assert json.loads(out)["layer_count"] == 5
    shown = terminal.decode(errors="replace")
    assert "progress:" not in shown and "started" not in shown
    assert "build" in shown and "tactics" in shown  # the bar's description, redrawn in place
    assert "\x1b[" in shown  # drawn with terminal control codes
    assert "done tactics" in shown  # finished stages stay above the bar
