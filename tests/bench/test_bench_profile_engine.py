"""bench/profile_engine.py --by-step on a CPU engine: every step counted once, and the profiler
ranges that mark the steps are not counted among the work they hold."""
from __future__ import annotations

import re
import sys
from pathlib import Path

import numpy as np
import torch
from torch.autograd import DeviceType

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import profile_engine  # noqa: E402
from conftest import IMAGE  # noqa: E402
import sartor  # noqa: E402
from sartor.runtime.context import ExecutionContext  # noqa: E402


def test_each_step_is_counted_once_and_its_range_is_not_a_launch(tiny_plan, capsys):
    engine = sartor.load(tiny_plan, device="cpu")
    ctx = ExecutionContext(engine, use_cuda_graphs=False)
    name = "images"
    x = torch.from_numpy(np.random.default_rng(0).standard_normal((2, 3, IMAGE, IMAGE), dtype=np.float32))
    profile_engine.kernels_by_step(ctx, {name: x}, rows=50, kernel_device=DeviceType.CPU)
    printed = capsys.readouterr().out
    steps = int(re.search(r"over (\d+) steps", printed).group(1))
    assert steps == len(engine.executor.steps)
    assert "sartor_step_" not in printed.split("== steps with most launches")[1]
    listed = [line for line in printed.splitlines() if re.match(r"\s+\d+\s+[\d.]+ \w", line)]
    assert len(listed) == steps  # one row a step, none twice
