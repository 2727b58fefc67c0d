"""Latency and throughput of an engine, with and without the host↔device copies.

"with copies": numpy inputs in, numpy outputs out, as an application feeding host memory sees it.
"device only": inputs already on the device, outputs left there; on CUDA each iteration ends with
torch.cuda.synchronize so the time covers the work, not just its launch.
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from ..errors import ConfigError
from .sample_inputs import random_inputs

if TYPE_CHECKING:
    from .engine import Engine


@dataclass
class LatencyStats:
    p50_ms: float
    p90_ms: float
    p99_ms: float
    mean_ms: float
    min_ms: float
    max_ms: float
    throughput: float  # inputs per second: batch / mean latency

    @staticmethod
    def from_seconds(samples: list[float], batch: int) -> "LatencyStats":
        ms = np.asarray(samples, dtype=np.float64) * 1e3
        p50, p90, p99 = (float(np.percentile(ms, q)) for q in (50, 90, 99))
        mean = float(ms.mean())
        return LatencyStats(p50, p90, p99, mean, float(ms.min()), float(ms.max()),
                            batch / (mean / 1e3) if mean > 0 else float("inf"))


@dataclass
class BenchmarkResult:
    device: str
    shapes: dict  # input name -> shape
    batch: int
    iterations: int
    warmup: int
    profile: int  # the profile these shapes ran under
    with_copies: LatencyStats
    device_only: LatencyStats
    aux_streams: int = 0  # auxiliary CUDA streams the context ran independent branches on (0 on the CPU)

    def to_json(self) -> dict:
        data = asdict(self)
        data["shapes"] = {k: list(v) for k, v in self.shapes.items()}
        return data


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (nothing to wait for on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def checked_run_options(engine, shapes: dict | None, iterations: int, warmup: int) -> dict:
    """The shapes ({name: shape}) of a timed or profiled run, after checking the run's options as
    `bench` takes them; an unknown input or a bad count is one ConfigError line."""
    if iterations < 1:
        raise ConfigError(f"--iterations must be at least 1, not {iterations}")
    if warmup < 0:
        raise ConfigError(f"--warmup must be 0 or more, not {warmup}")
    shapes = dict(shapes or {})
    unknown = sorted(set(shapes) - {v.name for v in engine.inputs})
    if unknown:
        raise ConfigError(f"--shapes names unknown input(s) {', '.join(unknown)}; the engine's inputs are "
                          f"{', '.join(v.name for v in engine.inputs)}")
    return shapes


def benchmark(engine: "Engine", shapes: dict | None = None, iterations: int = 100, warmup: int = 10,
              seed: int = 0, aux_streams: int | None = None) -> BenchmarkResult:
    """Time `iterations` runs after `warmup` untimed ones, at `shapes` ({name: shape}; inputs left
    out run at profile 0's opt shape), in a context with `aux_streams` auxiliary streams
    (runtime/branch_streams.py; None: the engine's own count, `Engine.aux_streams`)."""
    shapes = checked_run_options(engine, shapes, iterations, warmup)
    host = random_inputs(engine, seed=seed, shapes=shapes)
    context = engine.context(aux_streams=aux_streams)
    used = context.check_inputs(host)
    profile = context.select_profile(used)
    first = next(iter(used.values()), ())
    batch = int(first[0]) if len(first) >= 1 else 1
    device = engine.device
    on_device = {name: torch.from_numpy(a).to(device) for name, a in host.items()}

    def timed(feeds: dict, to_host: bool) -> list[float]:
        for _ in range(warmup):
            context.run(feeds)
        synchronize(device)
        samples = []
        for _ in range(iterations):
            start = time.perf_counter()
            outputs = context.run(feeds)
            if not to_host:
                synchronize(device)
            samples.append(time.perf_counter() - start)
            del outputs
        return samples

    with_copies = timed(host, to_host=True)
    device_only = timed(on_device, to_host=False)
    return BenchmarkResult(str(device), {k: tuple(v) for k, v in used.items()}, batch, iterations, warmup, profile,
                           LatencyStats.from_seconds(with_copies, batch), LatencyStats.from_seconds(device_only, batch),
                           len(context.branches.aux) if context.branches is not None else 0)
