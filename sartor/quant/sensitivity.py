"""Per-layer INT8 (or FP8 E4M3) sensitivity: quantize one layer at a time (everything else FP32),
run the calibration batches, and measure the model outputs' SNR against FP32. The least robust layers
are the first candidates for `--layer-precision NODE=fp16`. The same pass records each layer's
FP32 output peak, which says which layers would overflow FP16 (|x| > 65504).

SNR is scale-free within what it compares but not across it: a YOLO head [B, 4+C, N] holds box
coordinates in hundreds of pixels next to class scores in 0..1, so one SNR over the whole output
hears only the boxes. Given the detector's layout (`sartor validate`'s `--decoder yolo|boxes`),
boxes and scores are compared apart, each against its own FP32 values, and a layer ranks by the
worse of the two."""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Collection
from dataclasses import dataclass, field

import numpy as np
import torch

from ..builder.config import FP16_MAX
from ..errors import ConfigError, DataError
from ..ir import Graph
from ..ops.util import TORCH_TO_NUMPY, tensor_from_numpy
from ..runtime.context import matmul_precision
from ..runtime.executor import Executor
from .calibrators import DEFAULT_PERCENTILE
from .plan import QUANTIZED_PRECISIONS, int8_decisions, quantized_unsupported
from .quantize import quantize_graph

DEFAULT_SAMPLES = 64  # calibration samples `sartor sensitivity` ranks on
# An output group's name → its values, flattened (float64), from the model outputs of one batch.
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


def _all_outputs(outputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {"outputs": np.concatenate([a.ravel() for a in outputs.values()])}


def check_decoder(decoder: str | None) -> None:
    """Refuse, before any work, a `--decoder` that names no layout of raw outputs."""
    from ..validate.decoders import DECODERS
    if decoder is not None and decoder not in DECODERS:
        raise ConfigError(f"--decoder {decoder!r}: sensitivity compares raw outputs, so it takes "
                          f"{' or '.join(DECODERS)} (a module:function decoder returns detections, not "
                          f"values per anchor)")


def output_groups(decoder: str | None, shapes: dict, dtypes: dict | None = None) -> Groups:
    """How outputs (name -> shape and dtype, from one batch) are compared: all as one (decoder
    None), or the detector outputs `decoder` lays out split into boxes, scores (and classes, when
    the graph outputs class ids), every other output on its own."""
    from ..validate.decoders import boxes_layout, yolo_output
    check_decoder(decoder)
    if decoder is None:
        return _all_outputs
    shapes = {k: tuple(int(d) for d in s) for k, s in shapes.items()}
    listing = ", ".join(f"{k} {list(s)}" for k, s in shapes.items())

    def with_others(groups: dict, outputs: dict, used: set) -> dict:
        return dict(groups, **{name: a.ravel() for name, a in outputs.items() if name not in used})

    if decoder == "yolo":
        head = yolo_output(shapes)
        if head is None:
            raise DataError(f"--decoder yolo needs one output [B, 4+C, N] with N > 4+C; the model gives {listing}")
        return lambda outputs: with_others({"boxes": outputs[head][:, :4].ravel(),
                                            "scores": outputs[head][:, 4:].ravel()}, outputs, {head})
    layout = boxes_layout(shapes, dtypes)
    if layout is None:
        raise DataError(f"--decoder boxes needs boxes [B,N,4] with scores [B,N,C] or scores [B,N] + classes [B,N] "
                        f"(or one [B,N,6]); the model gives {listing}")
    if layout.combined:
        return lambda outputs: with_others({"boxes": outputs[layout.boxes][..., :4].ravel(),
                                            "scores": outputs[layout.boxes][..., 4].ravel(),
                                            "classes": outputs[layout.boxes][..., 5].ravel()},
                                           outputs, {layout.boxes})
    named = {"boxes": layout.boxes, "scores": layout.scores, "classes": layout.classes}
    named = {group: name for group, name in named.items() if name is not None}
    return lambda outputs: with_others({group: outputs[name].ravel() for group, name in named.items()},
                                       outputs, set(named.values()))


def _outputs(executor: Executor, batches: list[dict], device: torch.device, groups: Groups,
             observe=None) -> list[dict[str, np.ndarray]]:
    results = []
    with torch.inference_mode(), matmul_precision(False):
        for batch in batches:
            feeds = {k: torch.from_numpy(np.ascontiguousarray(v)).to(device) for k, v in batch.items()}
            outputs = executor.run(feeds, observe=observe)
            results.append(groups({k: t.detach().double().cpu().numpy() for k, t in outputs.items()}))
    return results


def _compare(reference: list[dict], candidate: list[dict]) -> tuple[float, float, dict]:
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


def _quantized_copy(graph: Graph, layers: dict, amax: dict) -> Graph:
    copy = Graph([dataclasses.replace(n, inputs=list(n.inputs), outputs=list(n.outputs), attrs=dict(n.attrs))
                  for n in graph.nodes], list(graph.inputs), list(graph.outputs), dict(graph.initializers),
                 dict(graph.value_info), graph.opset, graph.name)
    quantize_graph(copy, layers, amax)
    return copy


def _weights_for(graph: Graph, base: dict) -> dict:
    return {name: base[name] if name in base else tensor_from_numpy(a) for name, a in graph.initializers.items()}


def layer_sensitivity(graph: Graph, weights: dict, batches: list[dict], amax: dict, device: torch.device,
                      method: str = "", on_layer: Callable[[int, int, str], None] | None = None,
                      layers: Collection[str] | None = None, groups: Groups | None = None,
                      decoder: str | None = None, precision: str = "int8") -> SensitivityReport:
    """Quantize each layer that can run `precision` ("int8" or "fp8") alone (only those named in
    `layers`, when given) and measure the outputs against FP32, per output group (`output_groups`;
    all outputs as one when None). `decoder` names the layout `groups` came from, for the report."""
    check_precision(precision)
    grouped = groups is not None
    groups = groups or _all_outputs
    peaks: dict[str, float] = {}

    def observe(index, step, outputs):
        for t in outputs:
            if isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel():
                peak = float(t.detach().abs().amax())
                previous = peaks.get(step.node.name, 0.0)
                if not math.isnan(previous) and not peak <= previous:  # a NaN peak sticks
                    peaks[step.node.name] = peak

    reference = _outputs(Executor(graph, weights, device), batches, device, groups, observe)
    decisions = int8_decisions(graph, "fp32", precision)
    candidates = [n for n in graph.nodes if quantized_unsupported(graph, n, precision) is None
                  and (layers is None or n.name in layers)]
    rows = []
    for k, node in enumerate(candidates):
        if on_layer is not None:
            on_layer(k, len(candidates), node.name)
        quantized = _quantized_copy(graph, {node.name: precision}, amax)
        outputs = _outputs(Executor(quantized, _weights_for(quantized, weights), device), batches, device, groups)
        snr, cos, per_group = _compare(reference, outputs)
        default, reason = decisions.get(node.name, (precision, ""))
        rows.append(LayerSensitivity(node.name, node.op_type, list(node.origin), snr, cos,
                                     precision if default == precision else reason, peaks.get(node.name, 0.0),
                                     per_group if grouped else {}))
    plan = {name: p for name, (p, _) in decisions.items() if p == precision}
    if plan:
        quantized = _quantized_copy(graph, plan, amax)
        total_snr, total_cos, total_groups = _compare(reference, _outputs(
            Executor(quantized, _weights_for(quantized, weights), device), batches, device, groups))
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


def analyze(model_path: str, calib: str, calib_size: int = DEFAULT_SAMPLES, method: str | None = None,
            percentile: float = DEFAULT_PERCENTILE, calib_cache: str | None = None, preprocess: str | None = None,
            device: str | None = "cpu", on_layer: Callable[[int, int, str], None] | None = None,
            balance_by: str | None = None, decoder: str | None = None, precision: str = "int8") -> SensitivityReport:
    """Import and optimize `model_path` as the builder does, take thresholds from `calib_cache`
    (when it exists) or by calibrating on `calib`, and rank the layers on `calib`'s samples
    (drawn equally from each value of the attribute `balance_by`, for image datasets). With
    `decoder` (yolo | boxes), detector outputs are compared as boxes and scores apart. `precision`
    is the format each layer is quantized to in turn: "int8" or "fp8" (E4M3, from the same
    thresholds)."""
    from pathlib import Path

    from ..frontend import import_onnx
    from ..passes import optimize
    from ..runtime.fingerprint import parse_device
    from .cache import read_cache
    from .calibrate import amax_from_histograms, collect_histograms
    from .calibrators import DEFAULT_METHOD
    from .data import open_calibration
    from .plan import calibration_targets
    from .stage import CALIB_BATCH

    check_decoder(decoder)
    check_precision(precision)
    target = parse_device(device)
    imported = import_onnx(model_path)
    graph = imported.graph
    optimize(graph)
    weights = {name: tensor_from_numpy(a) for name, a in graph.initializers.items()}
    spec = None
    if preprocess is not None:
        from ..data.preprocess import parse_preprocess
        spec = parse_preprocess(preprocess)
    batch = next((v.shape[0] for v in graph.inputs if v.shape and isinstance(v.shape[0], int)), CALIB_BATCH)
    batches = list(open_calibration(calib, graph.inputs, calib_size, batch, spec, balance_by))
    groups = None
    if decoder is not None:  # the layout is checked on one batch's outputs, before calibrating
        with torch.inference_mode(), matmul_precision(False):
            feeds = {k: torch.from_numpy(np.ascontiguousarray(v)).to(target) for k, v in batches[0].items()}
            first = Executor(graph, weights, target).run(feeds)
        groups = output_groups(decoder, {k: tuple(t.shape) for k, t in first.items()},
                               {k: TORCH_TO_NUMPY.get(t.dtype, "float32") for k, t in first.items()})
    if calib_cache and Path(calib_cache).is_file():
        cache = read_cache(calib_cache, imported.sha256, spec.describe() if spec is not None else None,
                           check_preprocess=True)
        amax, method = cache.amax, cache.method
    else:
        method = method or DEFAULT_METHOD
        with matmul_precision(False):
            observers = collect_histograms(graph, weights, batches, calibration_targets(graph), target)
        amax = amax_from_histograms(observers, method, percentile)
    return layer_sensitivity(graph, weights, batches, amax, target, method, on_layer, groups=groups,
                             decoder=decoder, precision=precision)
