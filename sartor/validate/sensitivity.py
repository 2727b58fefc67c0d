"""`sartor sensitivity`: import and optimize a model as the builder does, calibrate it, and rank its
layers by how much quantizing each alone moves the outputs (`quant.sensitivity.layer_sensitivity`);
and how a detector's outputs are split into boxes and scores for that comparison, which the
accuracy planner's label-free targets share."""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from ..data.preprocess import parse_preprocess
from ..errors import ConfigError, DataError
from ..frontend import import_onnx
from ..ir.dtypes import TORCH_TO_NUMPY
from ..ops.util import tensor_from_numpy
from ..passes import optimize
from ..quant.cache import read_cache
from ..quant.calibrate import amax_from_histograms, collect_histograms
from ..quant.calibrators import DEFAULT_METHOD, DEFAULT_PERCENTILE
from ..quant.data import CALIB_BATCH, open_calibration
from ..quant.plan import calibration_targets
from ..quant.sensitivity import Groups, SensitivityReport, all_outputs_as_one, check_precision, layer_sensitivity
from ..runtime.context import matmul_precision
from ..runtime.executor import Executor
from ..runtime.fingerprint import parse_device
from .decoders import DECODERS, boxes_layout, yolo_output

DEFAULT_SAMPLES = 64  # calibration samples `sartor sensitivity` ranks on


def check_decoder(decoder: str | None) -> None:
    """Refuse, before any work, a `--decoder` that names no layout of raw outputs."""
    if decoder is not None and decoder not in DECODERS:
        raise ConfigError(f"--decoder {decoder!r}: sensitivity compares raw outputs, so it takes "
                          f"{' or '.join(DECODERS)} (a module:function decoder returns detections, not "
                          f"values per anchor)")


def output_groups(decoder: str | None, shapes: dict, dtypes: dict | None = None) -> Groups:
    """How outputs (name -> shape and dtype, from one batch) are compared: all as one (decoder
    None), or the detector outputs `decoder` lays out split into boxes, scores (and classes, when
    the graph outputs class ids), every other output on its own."""
    check_decoder(decoder)
    if decoder is None:
        return all_outputs_as_one
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
    check_decoder(decoder)
    check_precision(precision)
    target = parse_device(device)
    imported = import_onnx(model_path)
    graph = imported.graph
    optimize(graph)
    weights = {name: tensor_from_numpy(a) for name, a in graph.initializers.items()}
    spec = parse_preprocess(preprocess) if preprocess is not None else None
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
