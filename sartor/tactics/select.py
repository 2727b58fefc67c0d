"""Tactic selection: for each fused layer, time every implementation that applies at the profile's
opt shape on the build device, discard those whose output differs from the reference, keep the
fastest. The winner is written into the layer (and the engine); runners-up go to `inspect`."""
from __future__ import annotations

import statistics

import torch

from ..ir import Graph
from ..ops.conv import applicable_conv_tactics
from ..runtime.context import matmul_precision
from ..runtime.executor import Executor

REFERENCE_TACTIC = "torch"


def time_ms(fn, device: torch.device, iterations: int, warmup: int = 3) -> float:
    """Median milliseconds of `fn` after warm-up: CUDA events on a GPU, the host clock on a CPU."""
    for _ in range(warmup):
        fn()
    if device.type == "cuda":
        times = []
        for _ in range(iterations):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        return statistics.median(times)
    import time
    times = []
    for _ in range(iterations):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _close(out: torch.Tensor, ref: torch.Tensor) -> bool:
    if out.shape != ref.shape or not torch.isfinite(out).all():
        return False
    tolerance = 1e-2 if ref.dtype in (torch.float16, torch.bfloat16) else 1e-4
    scale = float(ref.abs().max()) + 1e-6
    return float((out.float() - ref.float()).abs().max()) <= tolerance * scale


def select_tactics(graph: Graph, weights: dict, feeds: dict, device: torch.device, layer_precision: dict,
                   channels_last: bool, tf32: bool, iterations: int = 10) -> dict[str, dict]:
    """{layer name: {"tactic": winner, "timings_ms": {tactic: ms}, "rejected": {tactic: why}}}."""
    executor = Executor(graph, weights, device, layer_precision, channels_last=channels_last)
    chosen: dict[str, dict] = {}

    def before(index, step, args):
        if step.node.op_type != "FusedConv":
            return
        reference = step.impl(args, dict(step.attrs, tactic=REFERENCE_TACTIC))
        timings, rejected = {}, {}
        for tactic in applicable_conv_tactics(args, step.attrs):
            attrs = dict(step.attrs, tactic=tactic)
            try:
                out = step.impl(args, attrs)
            except Exception as exc:  # a candidate that cannot run here is simply not a candidate
                rejected[tactic] = f"{type(exc).__name__}"
                continue
            if not _close(out, reference):
                rejected[tactic] = "output differs from reference"
                continue
            timings[tactic] = round(time_ms(lambda: step.impl(args, attrs), device, iterations), 5)
        best = min(timings, key=timings.get)
        step.attrs["tactic"] = best
        chosen[step.node.name] = {"tactic": best, "timings_ms": timings, "rejected": rejected}

    with torch.inference_mode(), matmul_precision(tf32):
        executor.run(feeds, before=before)
    return chosen
