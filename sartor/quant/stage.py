"""The builder's INT8 stage: thresholds (from the calibration cache, or by calibrating on --calib
and then writing the cache), then the rewrite of the INT8 layers."""
from __future__ import annotations

from pathlib import Path

import torch

from ..errors import ConfigError
from ..ir import Graph
from ..runtime.context import matmul_precision
from .cache import CalibrationCache, read_cache, write_cache
from .calibrate import amax_from_histograms, collect_histograms
from .calibrators import DEFAULT_METHOD
from .data import open_calibration
from .plan import calibration_targets
from .quantize import quantize_graph

CALIB_BATCH = 8  # samples per calibration batch when the batch dimension is dynamic


def calibration_batch_size(graph: Graph, profiles: list) -> int:
    sizes = []
    for info in graph.inputs:
        if info.shape and isinstance(info.shape[0], int):
            sizes.append(info.shape[0])
            continue
        r = profiles[0].shapes.get(info.name) if profiles else None
        sizes.append(min(CALIB_BATCH, r.max[0]) if r is not None and r.max else CALIB_BATCH)
    return max(1, min(sizes)) if sizes else 1


def thresholds_for_build(graph: Graph, weights: dict, config, onnx_sha256: str, device: torch.device,
                         profiles: list, log: list) -> tuple[dict, dict]:
    """({tensor: amax}, provenance record)."""
    method = config.calib_method or DEFAULT_METHOD
    percentile = config.percentile if method == "percentile" else None
    cache_path = config.calib_cache
    preprocess = config.preprocess_spec() if hasattr(config, "preprocess_spec") else None
    preprocess_text = preprocess.describe() if preprocess is not None else None  # normalised spelling
    if cache_path and Path(cache_path).is_file():
        cache = read_cache(cache_path, onnx_sha256, preprocess_text, check_preprocess=True)
        if config.calib_method and config.calib_method != cache.method:
            raise ConfigError(f"calibration cache {cache_path} holds {cache.method} thresholds but --calib-method "
                              f"{config.calib_method} was asked: delete the cache to recalibrate")
        log.append(f"calibration: {len(cache.amax)} thresholds read from cache {cache_path} ({cache.method}, "
                   f"{cache.calib_size} samples, calibration set sha256 {cache.calib_sha256[:12]}…): calibration skipped")
        return cache.amax, {"method": cache.method, "percentile": cache.percentile, "calib_sha256": cache.calib_sha256,
                            "calib_size": cache.calib_size, "source": None, "cache": str(cache_path),
                            "from_cache": True, "tensors": len(cache.amax)}
    if not config.calib:
        raise ConfigError(f"INT8 needs calibration data: --calib-cache {cache_path} does not exist; give --calib DATA "
                          f"to create it")
    calibration = open_calibration(config.calib, graph.inputs, config.calib_size,
                                   calibration_batch_size(graph, profiles), preprocess)
    with matmul_precision(False):
        observers = collect_histograms(graph, weights, calibration, calibration_targets(graph), device)
    amax = amax_from_histograms(observers, method, config.percentile)
    log.append(f"calibration: {calibration.size} samples from {config.calib} (sha256 {calibration.sha256[:12]}…), "
               f"{len(amax)} tensors, {method}" + (f" {config.percentile}" if percentile is not None else "")
               + " thresholds")
    nonfinite = sorted(name for name, o in observers.items() if o.nonfinite)
    if nonfinite:
        log.append(f"calibration: non-finite values left out of the statistics of {', '.join(nonfinite[:5])}")
    record = {"method": method, "percentile": percentile, "calib_sha256": calibration.sha256,
              "calib_size": calibration.size, "source": str(config.calib), "cache": None, "from_cache": False,
              "tensors": len(amax)}
    if cache_path:
        write_cache(cache_path, CalibrationCache(onnx_sha256, method, calibration.sha256, calibration.size, amax,
                                                 preprocess_text, percentile))
        log.append(f"calibration: wrote cache {cache_path}")
        record["cache"] = str(cache_path)
    return amax, record


def quantize_for_build(graph: Graph, weights: dict, layer_precision: dict, config, onnx_sha256: str,
                       device: torch.device, profiles: list, log: list) -> dict:
    """Calibrate (or read the cache), then rewrite the INT8 layers in place; returns the
    provenance record of the calibration."""
    amax, record = thresholds_for_build(graph, weights, config, onnx_sha256, device, profiles, log)
    report = quantize_graph(graph, layer_precision, amax)
    log.append(f"int8: {report['layers']} layer(s) INT8, {len(report['int8_tensors'])} tensor(s) passed between "
               f"them in INT8")
    return record
