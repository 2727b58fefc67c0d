"""Calibration: run the FP32 graph over calibration batches, histogram the tensors INT8 layers
read, and turn each histogram into a threshold (amax)."""
from __future__ import annotations

from collections.abc import Callable, Iterable

import numpy as np
import torch

from ..errors import SartorError
from ..ir import Graph
from ..runtime.executor import Executor
from .calibrators import DEFAULT_METHOD, DEFAULT_PERCENTILE, METHODS, compute_amax
from .observers import HistogramObserver
from .plan import calibration_targets

# Progress of calibration, for whoever shows it: (batches run so far, samples in the batch just run).
BatchProgress = Callable[[int, int], None]


class CalibrationError(SartorError):
    """Calibration cannot run: no batches, a batch that does not fit, a tensor never seen."""


def batch_to_device(batch: dict, device: torch.device) -> dict[str, torch.Tensor]:
    """A calibration batch (numpy arrays or tensors by input name) as tensors on `device`."""
    return {name: torch.from_numpy(np.ascontiguousarray(a)).to(device) if isinstance(a, np.ndarray) else a.to(device)
            for name, a in batch.items()}


def collect_histograms(graph: Graph, weights: dict, batches: Iterable[dict], targets: dict[str, list] | None = None,
                       device: torch.device | str | None = None,
                       on_batch: BatchProgress | None = None) -> dict[str, HistogramObserver]:
    """{tensor: observer} over every batch. `targets` maps layer name → the input positions it
    reads in INT8 (default: every layer that could run INT8); `on_batch` is called after each batch."""
    device = torch.device(device or "cpu")
    targets = calibration_targets(graph) if targets is None else targets
    executor = Executor(graph, weights, device)
    observers: dict[str, HistogramObserver] = {}
    watched = {}
    for node in graph.nodes:
        positions = targets.get(node.name)
        if positions:
            watched[node.name] = [p for p in positions if p < len(node.inputs) and node.inputs[p]]
    seen: set[str] = set()

    def before(index, step, args):
        for position in watched.get(step.node.name, ()):
            name = step.node.inputs[position]
            if name in seen:
                continue
            seen.add(name)
            observers.setdefault(name, HistogramObserver()).update(args[position])

    count = 0
    with torch.inference_mode():
        for batch in batches:
            seen.clear()
            feeds = batch_to_device(batch, device)
            try:
                executor.run(feeds, before=before)
            except SartorError:
                raise
            except Exception as exc:  # noqa: BLE001 - any failure of a batch is reported as one line
                shapes = ", ".join(f"{k} {'x'.join(map(str, v.shape))}" for k, v in feeds.items())
                raise CalibrationError(f"calibration batch {count} ({shapes}) does not run through the model: "
                                       f"{type(exc).__name__}: {' '.join(str(exc).split())[:200]}") from None
            count += 1
            if on_batch is not None:
                first = next(iter(feeds.values()), None)
                on_batch(count, int(first.shape[0]) if first is not None and first.dim() else 1)
    if count == 0:
        raise CalibrationError("the calibration set is empty")
    return observers


def amax_from_histograms(observers: dict[str, HistogramObserver], method: str = DEFAULT_METHOD,
                         percentile: float = DEFAULT_PERCENTILE) -> dict[str, float]:
    if method not in METHODS:
        raise CalibrationError(f"calibration method {method!r} is not one of {', '.join(METHODS)}")
    return {name: compute_amax(observer, method, percentile) for name, observer in sorted(observers.items())}


def calibrate(graph: Graph, weights: dict, batches: Iterable[dict[str, np.ndarray]], method: str = DEFAULT_METHOD,
              percentile: float = DEFAULT_PERCENTILE, on_batch: BatchProgress | None = None,
              device: torch.device | str | None = None, targets: dict[str, list] | None = None) -> dict[str, float]:
    """{tensor name: amax} for the inputs of every layer that may run INT8 (data inputs, and the
    residual input of fused convolutions), from the FP32 graph run over `batches`. `on_batch` hears
    of each batch run (a caller's progress display: quant draws none itself)."""
    if method not in METHODS:
        raise CalibrationError(f"calibration method {method!r} is not one of {', '.join(METHODS)}")
    observers = collect_histograms(graph, weights, batches, targets, device, on_batch)
    return amax_from_histograms(observers, method, percentile)
