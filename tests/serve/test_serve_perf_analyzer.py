"""Triton's load generator perf_analyzer against `sartor serve`, unchanged, over HTTP and gRPC
(shared memory off). It reads the model metadata and config, drives inference and reads the
statistics endpoint for its server-side breakdown; any field it needs and misses makes it exit
non-zero. Installed by scripts/install_perf_analyzer.sh; skipped when the binary is absent."""
from __future__ import annotations

import csv
import os
import shutil
import subprocess
from pathlib import Path

import pytest
from serve_helpers import BATCHING, HOST, add_model, running

REPO_ROOT = Path(__file__).resolve().parents[2]


def perf_analyzer_binary() -> str:
    """perf_analyzer on PATH, else the one scripts/install_perf_analyzer.sh put in .cache; the
    calling test is skipped where there is neither."""
    found = shutil.which("perf_analyzer")
    if found:
        return found
    local = REPO_ROOT / ".cache" / "perf_analyzer" / "perf_analyzer"
    if not os.access(local, os.X_OK):
        pytest.skip("perf_analyzer is not installed (bash scripts/install_perf_analyzer.sh)")
    return str(local)


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_perf_analyzer_measures_throughput(tmp_path, tiny_plan, protocol):
    binary = perf_analyzer_binary()
    repo = tmp_path / "repo"
    add_model(repo, "tiny", tiny_plan, BATCHING + "instance_group [{ count: 2 }]\n")
    report = tmp_path / "perf.csv"
    with running(repo) as server:
        port = server.http_port if protocol == "http" else server.grpc_port
        # Short windows and a lax stability bound (a busy 2-core CI machine once took latencies more
        # than twice apart in 5 windows at concurrency 2): this checks that it works, not how fast.
        command = [binary, "-m", "tiny", "-u", f"{HOST}:{port}", "-i", protocol, "-b", "1",
                   "--concurrency-range", "1:2", "--measurement-interval", "500", "--stability-percentage", "500",
                   "--max-trials", "10", "--shared-memory", "none", "-f", str(report)]
        done = subprocess.run(command, check=False, capture_output=True, text=True, timeout=180)
        output = done.stdout + done.stderr
        assert done.returncode == 0, output
        stats = server.core.statistics("tiny")[0]
    rows = list(csv.DictReader(report.read_text().splitlines()))
    assert sorted(int(r["Concurrency"]) for r in rows) == [1, 2], output
    assert all(float(r["Inferences/Second"]) > 0 for r in rows), output
    # The server-side section comes from the statistics endpoint.
    assert "Server:" in output and "Successful request count" in output, output
    assert stats["inference_count"] > 0 and stats["inference_stats"]["success"]["count"] > 0
