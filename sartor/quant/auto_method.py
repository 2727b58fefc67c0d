"""`--calib-method auto` (the default): each tensor's threshold method chosen by output error on
calibration samples held out from the histograms (docs/decisions/0029-auto-calibration-method.md).

1. Split: every HELD_OUT_EVERY-th calibration sample (up to MAX_HELD_OUT of them) is held out;
   the others fill the histograms, as an explicit method's would.
2. Each method alone (entropy, percentile, minmax, mse) sets every threshold; the plan is run on
   the held-out samples and its output error against FP32 measured (`output_error`). The best
   one is the starting point.
3. Per tensor, locally: on the same pass, each layer that reads a tensor quantized is run again
   with only that input quantized at each method's threshold, against its float output. Where
   another method beats the starting one for a tensor, that tensor's threshold is swapped in
   (the largest local gains first, at most MAX_SWAPS of them) and kept only if the whole model's
   output error on the held-out samples goes down: never worse, on those samples, than the best
   single method.
4. When a swap was kept, the mix and the best single method are run once more in the engine's
   exact arithmetic (`quantize_graph`), and the mix stays only if it is still better there.

The held-out runs of steps 2 and 3 simulate the plan in float: each quantized layer's inputs
(at the thresholds its scale group shares, as `quantize_graph` applies them; a residual only
where the engine stores it quantized) and its weights (per output channel) are quantized and
dequantized, and the layer runs in FP32. The engine's exact integer
arithmetic is ~6× slower on the CPU; a single layer's error matches it within a few percent, a
whole model's within tens of percent (rounding differences compound), hence step 4.

Too few samples to hold out MIN_HELD_OUT leaves auto as FALLBACK_METHOD over every sample.
"""
from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

import numpy as np
import torch

from ..ir import Graph
from ..ir.dtypes import INT8_QMAX
from ..ops.fp8 import FP8_MAX, quantize_fp8
from ..runtime.executor import Executor
from .calibrate import amax_from_histograms
from .calibrators import DEFAULT_METHOD, METHODS
from .observers import HistogramObserver
from .plan import CONV_OPS, GEMM_OPS
from .quantize import activation_scale, shared_thresholds
from .sensitivity import quantized_copy, weights_for

AUTO = "auto"
BUILD_METHODS = (AUTO, *METHODS)  # what a build's --calib-method takes
DEFAULT_BUILD_METHOD = AUTO  # docs/decisions/0029-auto-calibration-method.md (and 0048: what it costs)
PER_TENSOR = "per-tensor"  # the name of the per-tensor plan among the guard's candidates
HELD_OUT_EVERY = 5  # one sample in five is held out: an 80/20 split
MAX_HELD_OUT = 32  # the held-out samples are kept in memory and run once per candidate plan
MAX_SWAPS = 16  # per-tensor swaps tried on the whole model (each one run over the held-out samples)
MIN_HELD_OUT = 2
FALLBACK_METHOD = DEFAULT_METHOD  # auto with fewer than HELD_OUT_EVERY · MIN_HELD_OUT samples


def can_hold_out(samples: int) -> bool:
    return samples // HELD_OUT_EVERY >= MIN_HELD_OUT


class HeldOutSplit:
    """The batches of `batches` without the held-out samples (iterate once); after the pass,
    `held_out_batches()` gives the held-out samples in batches of `batch_size`."""

    def __init__(self, batches: Iterable[dict], batch_size: int) -> None:
        self._batches = batches
        self.batch_size = max(1, batch_size)
        self.held: list[dict] = []
        self.fit = 0
        self.drawn = 0  # samples read so far, held-out ones included (a caller's progress)

    def __iter__(self) -> Iterator[dict]:
        self.held, self.fit, self.drawn, index = [], 0, 0, 0
        for batch in self._batches:
            names = sorted(batch)
            count = len(batch[names[0]])
            keep = []
            for k in range(count):
                if index % HELD_OUT_EVERY == HELD_OUT_EVERY - 1 and len(self.held) < MAX_HELD_OUT:
                    self.held.append({name: np.array(batch[name][k]) for name in names})
                else:
                    keep.append(k)
                index += 1
            self.fit += len(keep)
            self.drawn = index
            if keep:
                yield {name: np.asarray(batch[name])[keep] for name in names}

    def held_out_batches(self) -> list[dict]:
        out = []
        for start in range(0, len(self.held), self.batch_size):
            chunk = self.held[start:start + self.batch_size]
            out.append({name: np.stack([s[name] for s in chunk]) for name in chunk[0]})
        return out


@dataclass
class AutoChoice:
    amax: dict  # tensor -> threshold
    methods: dict  # tensor -> the method its threshold came from
    chosen: str  # PER_TENSOR, or the single method that won the guard
    errors: dict  # candidate plan -> output error on the held-out samples
    held_out: int
    fit: int
    tensor_errors: dict = field(default_factory=dict)  # tensor -> {method: the readers' relative error}
    swaps: list = field(default_factory=list)  # the per-tensor swaps tried: {tensor, method, error, kept}
    exact: dict = field(default_factory=dict)  # start method and per-tensor mix: the engine's arithmetic's error
    seconds: float = 0.0  # the choice's time, after the histograms

    def to_json(self) -> dict:
        counts: dict[str, int] = {}
        for method in self.methods.values():
            counts[method] = counts.get(method, 0) + 1
        return {"chosen": self.chosen, "errors": {k: _finite(v) for k, v in self.errors.items()},
                "held_out_samples": self.held_out, "fit_samples": self.fit, "tensors_by_method": counts,
                "swaps": self.swaps, "exact_errors": {k: _finite(v) for k, v in self.exact.items()},
                "seconds": round(self.seconds, 3)}


def _finite(value: float) -> float | None:
    return float(value) if math.isfinite(value) else None


def fake_quantize(x: torch.Tensor, amax: float, fmt: str = "int8") -> torch.Tensor:
    """x quantized at threshold `amax` and back, in float32, as the engine's per-tensor quantization."""
    qmax = FP8_MAX if fmt == "fp8" else INT8_QMAX
    scale, inverse = activation_scale(amax, qmax)
    if fmt == "fp8":
        return quantize_fp8(x, inverse).float() * scale
    codes = x.float() * inverse  # a new tensor: rounded, clamped and scaled in place (no more copies)
    return codes.round_().clamp_(-INT8_QMAX, INT8_QMAX).mul_(scale)


def output_error(reference: list[dict], outputs: list[dict]) -> float:
    """Mean over outputs and their channels (axis 1) of the relative squared error Σ(r−e)²/Σr²
    over all held-out samples: scale-free per channel, so that a detector's box coordinates (in
    pixels) do not drown its scores (0..1). Non-finite outputs make it infinite."""
    ratios = []
    for name in reference[0]:
        ref = [np.asarray(r[name], np.float64) for r in reference]
        got = [np.asarray(o[name], np.float64) for o in outputs]
        if not all(np.isfinite(g).all() for g in got):
            return math.inf
        channels = ref[0].shape[1] if ref[0].ndim >= 2 else 1
        signal, noise = np.zeros(channels), np.zeros(channels)
        for r, g in zip(ref, got):
            r2, d2 = (r.reshape(r.shape[0], channels, -1), (r - g).reshape(r.shape[0], channels, -1)) \
                if r.ndim >= 2 else (r.reshape(1, 1, -1), (r - g).reshape(1, 1, -1))
            signal += (r2 ** 2).sum(axis=(0, 2))
            noise += (d2 ** 2).sum(axis=(0, 2))
        floor = max(float(signal.mean()) * 1e-12, np.finfo(np.float64).tiny)
        ratios.extend(noise / np.maximum(signal, floor))
    return float(np.mean(ratios)) if ratios else 0.0


def fake_quantize_weight(w: torch.Tensor, fmt: str = "int8", axis: int = 0) -> torch.Tensor:
    """A weight quantized per output channel (`axis`) and back, as `quantize_weight` does."""
    if axis != 0:
        return fake_quantize_weight(w.transpose(0, axis), fmt).transpose(0, axis).contiguous()
    qmax = FP8_MAX if fmt == "fp8" else INT8_QMAX
    flat = w.detach().double().reshape(w.shape[0], -1)
    scale = (flat.abs().amax(dim=1) / qmax).float().double()
    scale[scale == 0] = 1.0
    if fmt == "fp8":
        codes = (flat / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).float().to(torch.float8_e4m3fn).double()
    else:
        codes = torch.clamp(torch.round(flat / scale[:, None]), -INT8_QMAX, INT8_QMAX)
    return (codes * scale[:, None]).reshape(w.shape).to(w.dtype)


def _run(executor: Executor, batches: list[dict], device: torch.device, before=None, observe=None) -> list[dict]:
    results = []
    with torch.inference_mode():
        for batch in batches:
            feeds = {k: torch.from_numpy(np.ascontiguousarray(v)).to(device) for k, v in batch.items()}
            outputs = executor.run(feeds, before=before, observe=observe)
            results.append({k: t.detach().double().cpu().numpy() for k, t in outputs.items()})
    return results


def _output_axis(node, weight: torch.Tensor | None) -> int | None:
    """The axis of a layer's constant weight that holds its output channels (None: no such weight)."""
    if weight is None or weight.dim() < 2:
        return None
    if node.op_type in CONV_OPS:
        return 0
    if node.op_type == "MatMul" and weight.dim() == 2:
        return 1
    if node.op_type in GEMM_OPS and node.op_type != "MatMul":
        return 0 if node.attrs.get("transB", 0) else 1
    return None


class Simulation:
    """Runs the float graph with the layers of `layers` ({name: "int8"/"fp8"}) reading quantized
    inputs and weights (module docstring): one float executor, thresholds given per run."""

    def __init__(self, graph: Graph, weights: dict, layers: dict[str, str], targets: dict[str, list],
                 device: torch.device) -> None:
        self.graph, self.layers, self.device = graph, layers, device
        self.executor = Executor(graph, weights, device)
        self.targets = {name: positions for name, positions in targets.items() if name in layers}
        self.weights = {}
        for step in self.executor.steps:
            node = step.node
            axis = _output_axis(node, step.constants.get(1))
            if node.name in self.targets and axis is not None:
                self.weights[node.name] = fake_quantize_weight(step.constants[1], layers[node.name], axis)

    def run(self, batches: list[dict], amax: dict) -> list[dict]:
        shared, stored = shared_thresholds(self.graph, self.layers, amax)

        def before(index, step, args):
            positions = self.targets.get(step.node.name)
            if not positions:
                return
            fmt = self.layers[step.node.name]
            for position in positions:
                tensor = step.node.inputs[position] if position < len(step.node.inputs) else None
                if position > 0 and tensor not in stored:
                    continue  # a residual the engine reads in float (its producer does not write codes)
                if tensor and tensor in shared and isinstance(args[position], torch.Tensor):
                    args[position] = fake_quantize(args[position], shared[tensor], fmt).to(args[position].dtype)
            if step.node.name in self.weights:
                args[1] = self.weights[step.node.name]
        return _run(self.executor, batches, self.device, before)


def reader_errors(graph: Graph, weights: dict, batches: list[dict], candidates: dict[str, dict],
                  targets: dict[str, list], formats: dict[str, str], device: torch.device) -> tuple[dict, list]:
    """({tensor: {method: error}}, the float model's outputs): for each tensor the layers in
    `targets` read quantized, each method's threshold (`candidates[method][tensor]`) applied to
    that input alone, the reader's output against its float output (Σ over readers of Σ(y−ŷ)²/Σy²)."""
    sums: dict[tuple, list] = {}  # (tensor, reader) -> [signal, {amax: noise}]
    pending: dict[int, list] = {}  # a reader's arguments, until its float output is there

    def before(index, step, args):
        if targets.get(step.node.name):
            pending[index] = list(args)

    def observe(index, step, outputs):
        # The executor's own output of the float arguments is the reference: not run twice.
        args = pending.pop(index, None)
        if args is None:
            return
        reference = None
        for position in targets[step.node.name]:
            tensor = step.node.inputs[position] if position < len(step.node.inputs) else None
            if not tensor or not isinstance(args[position], torch.Tensor):
                continue
            if reference is None:
                reference = outputs[0].double()
            entry = sums.setdefault((tensor, step.node.name), [0.0, {}])
            entry[0] += float((reference ** 2).sum())
            for amax in {table[tensor] for table in candidates.values() if tensor in table}:
                trial = list(args)
                trial[position] = fake_quantize(args[position], amax, formats.get(step.node.name, "int8")).to(
                    args[position].dtype)
                error = step.impl(trial, step.attrs).double().sub_(reference).square_()  # a new tensor: in place
                entry[1][amax] = entry[1].get(amax, 0.0) + float(error.sum())

    reference = _run(Executor(graph, weights, device), batches, device, before, observe)
    errors: dict[str, dict] = {}
    for (tensor, _), (signal, noise) in sums.items():
        floor = max(signal, np.finfo(np.float64).tiny)
        per_method = errors.setdefault(tensor, {})
        for method, table in candidates.items():
            if tensor in table:
                per_method[method] = per_method.get(method, 0.0) + noise[table[tensor]] / floor
    return errors, reference


def choose_methods(graph: Graph, weights: dict, observers: dict[str, HistogramObserver], held_out: list[dict],
                   layers: dict[str, str], targets: dict[str, list], device: torch.device, percentile: float,
                   fit_samples: int = 0, on_step: Callable[[int, int, str], None] | None = None) -> AutoChoice:
    """The methods alone, then the per-tensor swaps (module docstring). `layers` maps the layers
    planned quantized to their format ("int8"/"fp8"); `held_out` holds the held-out batches."""
    started = time.perf_counter()
    device = torch.device(device)
    candidates = {method: amax_from_histograms(observers, method, percentile) for method in METHODS}
    steps = 2 + len(METHODS) + MAX_SWAPS

    def step(k: int, what: str) -> None:
        if on_step is not None:
            on_step(k, steps, what)

    step(0, "float run and each method per reader")
    quantized_targets = {name: positions for name, positions in targets.items() if name in layers}
    tensor_errors, reference = reader_errors(graph, weights, held_out, candidates, quantized_targets, layers, device)
    simulation = Simulation(graph, weights, layers, targets, device)
    scores: dict[str, float] = {}
    for k, method in enumerate(METHODS):
        step(1 + k, f"held-out run, {method}")
        scores[method] = output_error(reference, simulation.run(held_out, candidates[method]))
    start = min(METHODS, key=lambda m: (scores[m], m != DEFAULT_METHOD))  # ties: the default
    amax, methods = dict(candidates[start]), dict.fromkeys(candidates[start], start)
    best = scores[start]
    gains = []  # (local gain, tensor, method) where another method beats the start for that tensor
    for tensor, errors in tensor_errors.items():
        if start not in errors:
            continue
        method = min(errors, key=lambda m: (errors[m], m != start))
        if method != start and candidates[method][tensor] != amax[tensor]:
            gains.append((errors[start] - errors[method], tensor, method))
    gains.sort(key=lambda g: (-g[0], g[1]))
    swaps = []
    for k, (gain, tensor, method) in enumerate(gains[:MAX_SWAPS]):
        step(1 + len(METHODS) + k, f"held-out run, {tensor} at {method}")
        trial = dict(amax, **{tensor: candidates[method][tensor]})
        if shared_thresholds(graph, layers, trial)[0] == shared_thresholds(graph, layers, amax)[0]:
            continue  # its scale group keeps a larger threshold: the plan does not change
        error = output_error(reference, simulation.run(held_out, trial))
        kept = error < best
        swaps.append({"tensor": tensor, "method": method, "error": _finite(error), "kept": kept})
        if kept:
            amax, best, methods[tensor] = trial, error, method
    scores[PER_TENSOR] = best
    chosen, exact = start, {}
    if any(s["kept"] for s in swaps):
        # The simulation rounds sums in float: the mix must also beat the start in the engine's
        # own arithmetic, or the start stays.
        step(steps - 1, "exact held-out runs")
        for name, table in ((start, candidates[start]), (PER_TENSOR, amax)):
            quantized = quantized_copy(graph, layers, table)
            exact[name] = output_error(reference, _run(Executor(quantized, weights_for(quantized, weights), device),
                                                       held_out, device))
        chosen = PER_TENSOR if exact[PER_TENSOR] < exact[start] else start
    if chosen != PER_TENSOR:
        amax, methods = dict(candidates[start]), dict.fromkeys(candidates[start], start)
    held = sum(len(next(iter(b.values()))) for b in held_out)
    return AutoChoice(amax, methods, chosen, scores, held, fit_samples, tensor_errors, swaps, exact,
                      time.perf_counter() - started)
