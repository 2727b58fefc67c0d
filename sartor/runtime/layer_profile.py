"""Per-layer time of an engine (trtexec's --dumpProfile with --separateProfileRun): a profiling run
apart from the timed one, eager (no CUDA graph, so each layer is seen apart), each layer timed
between the executor's `before` and `observe` hooks: CUDA events around its launches on CUDA, the
host clock on the CPU (where a layer's work is done when its call returns). Optional NVTX ranges
named after the layers let Nsight Systems attribute kernels to layers.

The per-layer times add up to more than the engine's graph-replayed latency: eager launches and the
events themselves cost time. Shares between layers are what this is for."""
from __future__ import annotations

import contextlib
import statistics
import time
from dataclasses import asdict, dataclass

import numpy as np
import torch

from ..errors import ConfigError
from .benchmark import checked_run_options
from .context import matmul_precision
from .sample_inputs import random_inputs


@dataclass
class LayerTime:
    name: str
    op: str
    median_ms: float
    share: float  # of the sum of all layers' medians
    tactic: str | None
    precision: str
    origin: list  # the ONNX nodes the layer was fused from
    on_host: bool  # shape arithmetic computed on the host (no device work)


@dataclass
class LayerProfile:
    device: str
    shapes: dict
    profile: int
    iterations: int
    warmup: int
    nvtx: bool
    total_ms: float  # sum of the layers' medians
    run_median_ms: float  # a whole profiled run, hooks included
    layers: list  # LayerTime, slowest first

    def to_json(self) -> dict:
        data = asdict(self)
        data["shapes"] = {k: list(v) for k, v in self.shapes.items()}
        return data


def _nvtx():
    """torch.cuda.nvtx, or a one-line refusal where this torch has no CUDA."""
    if not torch.cuda.is_available():
        raise ConfigError("--nvtx needs a CUDA device (NVTX ranges are for Nsight Systems on NVIDIA GPUs)")
    return torch.cuda.nvtx


class _LayerClock:
    """Times each step of one executor run; `samples[i]` collects step i's milliseconds over runs."""

    def __init__(self, device: torch.device, steps: int, nvtx=None) -> None:
        self.cuda = device.type == "cuda"
        self.nvtx = nvtx
        self.samples: list[list[float]] = [[] for _ in range(steps)]
        self._pending: list = []  # (step index, start event, end event) until the run is synchronised
        self._started = 0.0

    def before(self, index, step, args) -> None:
        if self.nvtx is not None:
            self.nvtx.range_push(step.node.name)
        if self.cuda:
            start = torch.cuda.Event(enable_timing=True)
            start.record()
            self._pending.append([index, start, None])
        else:
            self._started = time.perf_counter()

    def observe(self, index, step, outputs) -> None:
        if self.cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self._pending[-1][2] = end
        else:
            self.samples[index].append((time.perf_counter() - self._started) * 1e3)
        if self.nvtx is not None:
            self.nvtx.range_pop()

    def collect(self) -> None:
        """After a run: read its events (one synchronisation per run, not per layer)."""
        if not self.cuda:
            return
        torch.cuda.synchronize()
        for index, start, end in self._pending:
            self.samples[index].append(start.elapsed_time(end))
        self._pending.clear()


def profile_layers(engine, shapes: dict | None = None, iterations: int = 20, warmup: int = 3, seed: int = 0,
                   nvtx: bool = False) -> LayerProfile:
    """Each layer's median time over `iterations` eager runs after `warmup` untimed ones, at `shapes`
    ({name: shape}; inputs left out run at profile 0's opt shape), slowest first."""
    shapes = checked_run_options(engine, shapes, iterations, warmup)
    ranges = _nvtx() if nvtx else None
    host = random_inputs(engine, seed=seed, shapes=shapes)
    context = engine.context()
    used = context.check_inputs(host)
    profile = context.select_profile(used)
    device = engine.device
    feeds = {name: torch.from_numpy(np.ascontiguousarray(a)).to(device) for name, a in host.items()}
    executor = engine.executor
    memo = context.memo_for(tuple(sorted(used.items())))
    clock = _LayerClock(device, len(executor.steps), ranges)
    run_ms = []
    # Events record on the current device's stream: make it the engine's (cuda:1 is not the default).
    on_device = torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()
    with on_device, torch.inference_mode(), matmul_precision(engine.precision == "tf32"):
        for _ in range(warmup):
            executor.run(feeds, memo, profile=profile)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        for _ in range(iterations):
            started = time.perf_counter()
            executor.run(feeds, memo, before=clock.before, observe=clock.observe, profile=profile)
            clock.collect()  # synchronises on CUDA, so the run's time covers its work
            run_ms.append((time.perf_counter() - started) * 1e3)
    recorded = {layer["name"]: layer for layer in engine.layers}
    medians = [statistics.median(s) if s else 0.0 for s in clock.samples]
    total = sum(medians)
    layers = []
    for step, median in zip(executor.steps, medians):
        record = recorded.get(step.node.name, {})
        variant = step.profile_variants.get(profile)
        tactic = variant.attrs.get("tactic") if variant is not None else record.get("tactic", step.attrs.get("tactic"))
        layers.append(LayerTime(step.node.name, step.node.op_type, median, median / total if total > 0 else 0.0,
                                tactic, record.get("precision", "fp32"), list(record.get("origin") or []),
                                step.on_host))
    layers.sort(key=lambda layer: -layer.median_ms)
    return LayerProfile(str(device), {k: tuple(v) for k, v in used.items()}, profile, iterations, warmup, nvtx,
                        total, statistics.median(run_ms), layers)
