"""Per-layer INT8 (or FP8 E4M3) sensitivity: quantize one layer at a time (everything else FP32),
run the calibration batches, and measure the model outputs' SNR against FP32. The least robust layers
are the first candidates for `--layer-precision NODE=fp16`. The same pass records each layer's
FP32 output peak, which says which layers would overflow FP16 (|x| > 65504).

SNR is scale-free within what it compares but not across it: a YOLO head [B, 4+C, N] holds box
coordinates in hundreds of pixels next to class scores in 0..1, so one SNR over the whole output
hears only the boxes. Given the detector's layout (`sartor validate`'s `--decoder yolo|boxes`),
boxes and scores are compared apart, each against its own FP32 values, and a layer ranks by the
worse of the two. (The model-level run, `sartor sensitivity`'s, and the grouping by detector layout
are `sartor.validate.sensitivity`.)"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Collection
from dataclasses import dataclass, field

import numpy as np
import torch

from ..errors import ConfigError
from ..ir import Graph
from ..ir.dtypes import FP16_MAX, QUANTIZED_PRECISIONS
from ..ops.util import tensor_from_numpy
from ..runtime.context import matmul_precision
from ..runtime.executor import Executor
from .plan import int8_decisions, quantized_unsupported
from .quantize import quantize_graph

# An output group's name → its values, flattened (float64), from the model outputs of one batch
# (`validate.sensitivity.output_groups` builds them from a detector's layout).
Groups = Callable[[dict[str, np.ndarray]], dict[str, np.ndarray]]


@dataclass
class LayerSensitivity:
    name: str
    op: str
    origin: list
    snr_db: float  # model outputs, this layer alone quantized (INT8 or FP8), against FP32
    cosine: float
    default: str  # the quantized precision ("int8", "fp8"), or why the default plan keeps it out
    fp32_peak: float  # max |output| in FP32 over the batches
    # With a detector layout: {"boxes": {"snr_db", "cosine"}, "scores": {...}, ...}; snr_db and
    # cosine above are then the worst group's.
    groups: dict = field(default_factory=dict)

    @property
    def overflows_fp16(self) -> bool:
        return not self.fp32_peak <= FP16_MAX

    def to_json(self) -> dict:
        return dict(dataclasses.asdict(self), overflows_fp16=self.overflows_fp16)


@dataclass
class SensitivityReport:
    layers: list  # LayerSensitivity, least robust (lowest SNR) first
    all_int8_snr_db: float  # the default INT8 plan, every planned layer at once
    all_int8_cosine: float
    samples: int
    method: str
    fp16_overflow: list = field(default_factory=list)  # layer names, any op, whose FP32 output exceeds FP16
    decoder: str | None = None  # the detector layout the outputs were split by, or None: all outputs as one
    all_int8_groups: dict = field(default_factory=dict)  # the default INT8 plan, per output group
    # The quantized format under test. The all_int8_* figures are the default plan at this precision
    # (their names predate FP8 and stay, for the JSON's readers).
    precision: str = "int8"

    def to_json(self) -> dict:
        return {"precision": self.precision, "samples": self.samples, "method": self.method, "decoder": self.decoder,
                "all_int8_snr_db": self.all_int8_snr_db, "all_int8_cosine": self.all_int8_cosine,
                "all_int8_groups": self.all_int8_groups, "fp16_overflow": self.fp16_overflow,
                "layers": [layer.to_json() for layer in self.layers]}


def all_outputs_as_one(outputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {"outputs": np.concatenate([a.ravel() for a in outputs.values()])}


def grouped_outputs(executor: Executor, batches: list[dict], device: torch.device, groups: Groups,
                    observe=None) -> list[dict[str, np.ndarray]]:
    """Each batch's outputs in float64 on the host, as `groups` gathers them."""
    results = []
    with torch.inference_mode(), matmul_precision(False):
        for batch in batches:
            feeds = {k: torch.from_numpy(np.ascontiguousarray(v)).to(device) for k, v in batch.items()}
            outputs = executor.run(feeds, observe=observe)
            results.append(groups({k: t.detach().double().cpu().numpy() for k, t in outputs.items()}))
    return results


def compare_outputs(reference: list[dict], candidate: list[dict]) -> tuple[float, float, dict]:
    """(SNR, cosine, per group {"snr_db", "cosine"}): one group's figures, or the worst group's."""
    per_group = {}
    for group in reference[0]:
        snr, cos = _snr_cosine([r[group] for r in reference], [c[group] for c in candidate])
        per_group[group] = {"snr_db": snr, "cosine": cos}
    snr = min(g["snr_db"] for g in per_group.values())
    cos = min((g["cosine"] for g in per_group.values() if not math.isnan(g["cosine"])), default=float("nan"))
    return snr, cos, per_group


def _snr_cosine(reference: list[np.ndarray], candidate: list[np.ndarray]) -> tuple[float, float]:
    signal = sum(float(r @ r) for r in reference)
    noise = sum(float((r - c) @ (r - c)) for r, c in zip(reference, candidate))
    dot = sum(float(r @ c) for r, c in zip(reference, candidate))
    norm_c = math.sqrt(sum(float(c @ c) for c in candidate))
    snr = math.inf if noise == 0 else (10 * math.log10(signal / noise) if signal > 0 else -math.inf)
    cos = dot / (math.sqrt(signal) * norm_c) if signal > 0 and norm_c > 0 else float("nan")
    return snr, cos


def quantized_copy(graph: Graph, layers: dict, amax: dict) -> Graph:
    copy = Graph([dataclasses.replace(n, inputs=list(n.inputs), outputs=list(n.outputs), attrs=dict(n.attrs))
                  for n in graph.nodes], list(graph.inputs), list(graph.outputs), dict(graph.initializers),
                 dict(graph.value_info), graph.opset, graph.name)
    quantize_graph(copy, layers, amax)
    return copy


def weights_for(graph: Graph, base: dict) -> dict:
    return {name: base[name] if name in base else tensor_from_numpy(a) for name, a in graph.initializers.items()}


def layer_sensitivity(graph: Graph, weights: dict, batches: list[dict], amax: dict, device: torch.device,
                      method: str = "", on_layer: Callable[[int, int, str], None] | None = None,
                      layers: Collection[str] | None = None, groups: Groups | None = None,
                      decoder: str | None = None, precision: str = "int8") -> SensitivityReport:
    """Quantize each layer that can run `precision` ("int8" or "fp8") alone (only those named in
    `layers`, when given) and measure the outputs against FP32, per output group (`groups`, from
    `validate.sensitivity.output_groups`; all outputs as one when None). `decoder` names the layout `groups` came from, for the report."""
    check_precision(precision)
    grouped = groups is not None
    groups = groups or all_outputs_as_one
    peaks: dict[str, float] = {}

    def observe(index, step, outputs):
        for t in outputs:
            if isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel():
                peak = float(t.detach().abs().amax())
                previous = peaks.get(step.node.name, 0.0)
                if not math.isnan(previous) and not peak <= previous:  # a NaN peak sticks
                    peaks[step.node.name] = peak

    reference = grouped_outputs(Executor(graph, weights, device), batches, device, groups, observe)
    decisions = int8_decisions(graph, "fp32", precision)
    candidates = [n for n in graph.nodes if quantized_unsupported(graph, n, precision) is None
                  and (layers is None or n.name in layers)]
    rows = []
    for k, node in enumerate(candidates):
        if on_layer is not None:
            on_layer(k, len(candidates), node.name)
        quantized = quantized_copy(graph, {node.name: precision}, amax)
        outputs = grouped_outputs(Executor(quantized, weights_for(quantized, weights), device), batches, device, groups)
        snr, cos, per_group = compare_outputs(reference, outputs)
        default, reason = decisions.get(node.name, (precision, ""))
        rows.append(LayerSensitivity(node.name, node.op_type, list(node.origin), snr, cos,
                                     precision if default == precision else reason, peaks.get(node.name, 0.0),
                                     per_group if grouped else {}))
    plan = {name: p for name, (p, _) in decisions.items() if p == precision}
    if plan:
        quantized = quantized_copy(graph, plan, amax)
        total_snr, total_cos, total_groups = compare_outputs(reference, grouped_outputs(
            Executor(quantized, weights_for(quantized, weights), device), batches, device, groups))
    else:
        total_snr, total_cos = math.inf, 1.0
        total_groups = {group: {"snr_db": math.inf, "cosine": 1.0} for group in reference[0]}
    rows.sort(key=lambda r: (r.snr_db, r.name))
    overflow = [n.name for n in graph.nodes if n.name in peaks and not peaks[n.name] <= FP16_MAX]
    samples = sum(len(next(iter(b.values()))) for b in batches)
    return SensitivityReport(rows, total_snr, total_cos, samples, method, overflow, decoder,
                             total_groups if grouped else {}, precision)


def check_precision(precision: str) -> None:
    """Refuse, before any work, a precision that is not a calibrated quantized format."""
    if precision not in QUANTIZED_PRECISIONS:
        raise ConfigError(f"--precision {precision}: sensitivity ranks layers under a quantized format, "
                          f"{' or '.join(QUANTIZED_PRECISIONS)}")
