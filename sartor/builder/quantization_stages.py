"""The builder's INT8 (and FP8) stages: thresholds (from the calibration cache, or by calibrating
on --calib and then writing the cache) with the check that calibration covered every split of
--data, the rewrite of the INT8 and FP8 layers, and their bias correction (`bias_correction.py`).
(The planner between thresholds and rewrite is `accuracy_planner.plan_for_target`.)"""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from ..errors import ConfigError
from ..ir import Graph
from ..runtime.context import matmul_precision
from ..quant.bias_correction import (
    apply_corrections,
    correctable_layers,
    corrections_from_json,
    corrections_to_json,
    measure_corrections,
    stored_for,
    summary,
)
from ..quant.cache import CalibrationCache, CalibrationCacheError, read_cache, write_cache
from ..quant.calibrate import amax_from_histograms, collect_histograms
from ..ir.dtypes import QUANTIZED_PRECISIONS
from ..quant.auto_method import (
    AUTO,
    DEFAULT_BUILD_METHOD,
    FALLBACK_METHOD,
    HELD_OUT_EVERY,
    MIN_HELD_OUT,
    HeldOutSplit,
    can_hold_out,
    choose_methods,
)
from ..quant.data import CALIB_BATCH, CalibrationSet, open_calibration, split_coverage
from ..quant.plan import calibration_targets
from ..quant.python_data import open_python_calibration
from ..quant.qdq import is_qdq_model
from ..quant.quantize import quantize_graph

RECORDED_VALUES = 16  # per-split counts are recorded for attributes with at most this many values (not ids)


def calibration_batch_size(graph: Graph, profiles: list) -> int:
    sizes = []
    for info in graph.inputs:
        if info.shape and isinstance(info.shape[0], int):
            sizes.append(info.shape[0])
            continue
        r = profiles[0].shapes.get(info.name) if profiles else None
        sizes.append(min(CALIB_BATCH, r.max[0]) if r is not None and r.max else CALIB_BATCH)
    return max(1, min(sizes)) if sizes else 1


def split_attributes(config) -> list[str]:
    """The attributes whose per-split counts are recorded and checked: --split-by, --calib-balance-by."""
    return list(dict.fromkeys(a for a in (config.split_by, config.calib_balance_by) if a))


def open_build_calibration(graph: Graph, config, profiles: list, limit: int | None = None,
                           source: str | None = None) -> CalibrationSet:
    """The build's calibration batches (`source` instead of --calib when given)."""
    if source is None and config.calib_data is not None:  # samples given from Python
        return open_python_calibration(config.calib_data, graph.inputs, limit or config.calib_size,
                                       calibration_batch_size(graph, profiles), config.preprocess_spec())
    return open_calibration(source or config.calib, graph.inputs, limit or config.calib_size,
                            calibration_batch_size(graph, profiles), config.preprocess_spec(),
                            config.calib_balance_by, config.seed)


def check_coverage(splits: dict, config, log: list, warn: Callable[[str], None] | None) -> None:
    """With --data: warn (build log and `warn`) about each of its splits that the calibration
    sample (`splits`: attribute → {value: images}) misses or under-represents."""
    if not config.data:
        return
    from ..data import open_dataset
    dataset = open_dataset(config.data, class_names=config.classes)
    for attribute in split_attributes(config):
        if attribute not in dataset.attributes():
            if attribute == config.split_by:
                raise ConfigError(f"--split-by {attribute}: no image of --data {config.data} has that attribute "
                                  f"(attributes: {', '.join(dataset.attributes()) or 'none'})")
            continue
        counts = splits.get(attribute)
        if counts is None:
            log.append(f"calibration: split coverage by {attribute} not checked (the calibration samples carry no "
                       f"attributes)")
            continue
        data_counts = {value: len(group) for value, group in dataset.splits(attribute).items()}
        for line in split_coverage(counts, data_counts, attribute, config.data):
            log.append(line)
            if warn is not None:
                warn(line)


def thresholds_for_build(graph: Graph, weights: dict, config, onnx_sha256: str, device: torch.device,
                         profiles: list, log: list, warn: Callable[[str], None] | None = None,
                         advance: Callable[[int, int, str], None] | None = None,
                         layers: dict | None = None) -> tuple[dict, dict]:
    """({tensor: amax}, provenance record); warns through `warn` when calibration misses a split of
    --data. `advance(done, total, detail)` hears of the calibration samples run so far; `layers`
    (the precision plan) says which layers auto's held-out runs quantize."""
    if is_qdq_model(graph):  # explicit quantization: the INT8 layers carry the model's scales
        log.append("calibration: none needed: the model is quantized with Q/DQ nodes and its INT8 layers use its "
                   "scales" + (f" (--calib {config.calib} not used)" if config.calib else ""))
        return {}, None
    method = config.calib_method or DEFAULT_BUILD_METHOD
    percentile = config.percentile if method in ("percentile", AUTO) else None
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
        if config.calib_balance_by:
            log.append(f"calibration: --calib-balance-by {config.calib_balance_by} not applied (calibration skipped)")
        check_coverage(cache.splits, config, log, warn)
        return cache.amax, {"method": cache.method, "percentile": cache.percentile, "calib_sha256": cache.calib_sha256,
                            "calib_size": cache.calib_size, "source": None, "cache": str(cache_path),
                            "from_cache": True, "tensors": len(cache.amax), "balance_by": None,
                            "splits": cache.splits, "methods": cache.tensor_methods(), "auto": cache.auto or None}
    if not config.calib:
        raise ConfigError(f"INT8 needs calibration data: --calib-cache {cache_path} does not exist; give --calib DATA "
                          f"to create it")
    calibration = open_build_calibration(graph, config, profiles)
    splits = {}
    if calibration.samples is not None:  # the asked attributes, and any other with few values (lighting, weather)
        present = sorted({k for sample in calibration.samples for k in sample.attributes})
        for attribute in dict.fromkeys(split_attributes(config) + present):
            counts = calibration.split_counts(attribute)
            if attribute in split_attributes(config) or len(counts) <= RECORDED_VALUES:
                splits[attribute] = counts
    for attribute, counts in splits.items():
        log.append(f"calibration: images per {attribute}: " + ", ".join(f"{v} {n}" for v, n in counts.items()))
    check_coverage(splits, config, log, warn)  # before the long part
    samples_done = 0

    def on_batch(batches: int, size: int) -> None:
        nonlocal samples_done
        samples_done += size
        if advance is not None:
            advance(samples_done, min(calibration.available, config.calib_size), f"batch {batches}")

    quantized = {name: p for name, p in (layers or {}).items() if p in QUANTIZED_PRECISIONS}
    auto = None
    with matmul_precision(False):
        if method == AUTO and quantized and can_hold_out(calibration.available):
            split = HeldOutSplit(calibration, calibration_batch_size(graph, profiles))
            targets = calibration_targets(graph)

            def on_fit_batch(batches: int, size: int) -> None:  # the held-out samples count as drawn
                on_batch(batches, split.drawn - samples_done)
            observers = collect_histograms(graph, weights, split, targets, device, on_fit_batch)
            choice = choose_methods(graph, weights, observers, split.held_out_batches(), quantized, targets, device,
                                    config.percentile, split.fit)
            amax, methods, auto = choice.amax, choice.methods, choice.to_json()
        else:
            if method == AUTO:
                auto = {"chosen": FALLBACK_METHOD, "reason": (
                    f"{calibration.available} calibration samples: auto holds one in {HELD_OUT_EVERY} out and needs "
                    f"{MIN_HELD_OUT} held out" if quantized else "no layer is planned quantized")}
                log.append(f"calibration: auto: {FALLBACK_METHOD} for every tensor ({auto['reason']})")
            observers = collect_histograms(graph, weights, calibration, calibration_targets(graph), device, on_batch)
            single = FALLBACK_METHOD if method == AUTO else method
            amax = amax_from_histograms(observers, single, config.percentile)
            methods = dict.fromkeys(amax, single)
    log.append(f"calibration: {calibration.size} samples from {config.calib} (sha256 {calibration.sha256[:12]}…), "
               f"{len(amax)} tensors, {method}" + (f" {config.percentile}" if method == "percentile" else "")
               + " thresholds" + (f", drawn equally by {config.calib_balance_by}" if config.calib_balance_by else ""))
    if auto is not None and "errors" in auto:
        counts = ", ".join(f"{m} {n}" for m, n in sorted(auto["tensors_by_method"].items()))
        errors = ", ".join(f"{name} {'inf' if e is None else f'{e:.3g}'}" for name, e in auto["errors"].items())
        log.append(f"calibration: auto chose {auto['chosen']} ({counts}) by output error on {auto['held_out_samples']} "
                   f"held-out samples, thresholds from the other {auto['fit_samples']}, in {auto['seconds']:.1f} s: "
                   f"{errors}")
    nonfinite = sorted(name for name, o in observers.items() if o.nonfinite)
    if nonfinite:
        log.append(f"calibration: non-finite values left out of the statistics of {', '.join(nonfinite[:5])}")
    record = {"method": method, "percentile": percentile, "calib_sha256": calibration.sha256,
              "calib_size": calibration.size, "source": str(config.calib), "cache": None, "from_cache": False,
              "tensors": len(amax), "balance_by": config.calib_balance_by, "splits": splits,
              "methods": methods, "auto": auto}
    if cache_path:
        write_cache(cache_path, CalibrationCache(onnx_sha256, method, calibration.sha256, calibration.size, amax,
                                                 preprocess_text, percentile, splits, methods=methods,
                                                 auto=auto or {}))
        log.append(f"calibration: wrote cache {cache_path}")
        record["cache"] = str(cache_path)
    return amax, record


def quantize_for_build(graph: Graph, layer_precision: dict, amax: dict, log: list) -> None:
    """Rewrite the INT8 and FP8 layers in place. The MaxPool/Concat/Split/Resize layers that run on
    INT8 (FP8) codes get that precision in `layer_precision`: the engine records it, and their
    inputs are not converted to the float dtype of the layers around them."""
    report = quantize_graph(graph, layer_precision, amax)
    passing = report["pass_through"]
    layer_precision.update(passing)
    for fmt, word in (("int8", "INT8"), ("fp8", "FP8")):
        names = sorted(name for name, f in passing.items() if f == fmt)
        if names:
            log.append(f"{fmt}: {len(names)} MaxPool/Concat/Split/Resize layer(s) pass {word} through: "
                       f"{', '.join(names[:8])}"
                       + (", …" if len(names) > 8 else ""))
    if report["layers"] or not report["fp8_layers"]:
        log.append(f"int8: {report['layers']} layer(s) INT8, {len(report['int8_tensors'])} tensor(s) passed between "
                   f"them in INT8")
    if report["fp8_layers"]:
        log.append(f"fp8: {report['fp8_layers']} layer(s) FP8 (E4M3), {len(report['fp8_tensors'])} tensor(s) passed "
                   f"between them in FP8")


def _stored_corrections(config, onnx_sha256: str) -> tuple[CalibrationCache | None, dict]:
    """(the calibration cache or None, its corrections by (format, layer))."""
    path = config.calib_cache
    if not path or not Path(path).is_file():
        return None, {}
    preprocess = config.preprocess_spec()
    cache = read_cache(path, onnx_sha256, preprocess.describe() if preprocess is not None else None,
                       check_preprocess=True)
    try:
        return cache, corrections_from_json(cache.bias_correction)
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise CalibrationCacheError(f"calibration cache {path}: malformed \"bias_correction\" ({type(exc).__name__}: "
                                    f"{exc}); delete it to recalibrate") from None


def correct_biases_for_build(graph: Graph, float_graph: Graph, float_weights: dict, config, onnx_sha256: str,
                             device: torch.device, profiles: list, log: list) -> dict | None:
    """Empirical bias correction of the rewritten INT8/FP8 layers of `graph` (`float_graph`: the
    same graph before the rewrite).
    The corrections come from the calibration cache when it holds them for every layer of this
    build (same format and input scale), else all are measured on --calib and added to the cache.
    Returns the engine header's record (None when nothing ran)."""
    if not config.bias_correction:
        log.append("bias correction: off (--bias-correction turns it on)")
        return None
    if is_qdq_model(float_graph):
        log.append("bias correction: not applied: the model is quantized with Q/DQ nodes (its scales and biases "
                   "come from the file)")
        return None
    if not correctable_layers(graph, float_graph):
        return None
    cache, stored = _stored_corrections(config, onnx_sha256)
    found, missing = stored_for(graph, float_graph, stored)
    source = f"read from cache {config.calib_cache}"
    if missing:
        if not config.calib:
            raise ConfigError(f"bias correction: calibration cache {config.calib_cache} holds no correction for "
                              f"{len(missing)} quantized layer(s) of this build (first: {missing[0]}): give --calib "
                              f"DATA to measure them, or build with --no-bias-correction")
        calibration = open_build_calibration(float_graph, config, profiles)
        with matmul_precision(False):  # the float reference in FP32, not TF32
            measured = measure_corrections(graph, float_graph, float_weights, calibration, device)
        if cache is not None and calibration.sha256 != cache.calib_sha256:  # known after the pass, not before
            # The cache names the data its thresholds came from; corrections from other data
            # would sit under that name.
            raise ConfigError(f"bias correction: --calib {config.calib} (sha256 {calibration.sha256[:12]}…) is not the "
                              f"data calibration cache {config.calib_cache} was made from (sha256 "
                              f"{cache.calib_sha256[:12]}…): give that data, or delete the cache to recalibrate")
        source = f"measured on {calibration.size} samples of {config.calib}"
        found = measured
        if cache is not None:
            merged = dict(cache.bias_correction)
            for fmt, layers in corrections_to_json(measured).items():
                merged[fmt] = dict(merged.get(fmt, {}), **layers)
            cache.bias_correction = merged
            write_cache(config.calib_cache, cache)
            log.append(f"bias correction: {len(measured)} correction(s) added to cache {config.calib_cache}")
    changed = apply_corrections(graph, found)
    line, record = summary(found, changed, source)
    log.append(line)
    return record
