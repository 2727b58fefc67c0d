"""--fallback-where-faster: an INT8 (FP8) build whose layers run at the fallback precision where
that is faster, as TensorRT's builder treats INT8 as a permission rather than an order.

sartor runs every layer planned INT8 in INT8. Where its INT8 kernel is slower than the fallback
precision's best kernel for the same layer, the engine pays for the smaller numbers (a detector's
few-channel layers can be faster in cuDNN's FP16: docs/decisions/0010-fallback-where-faster-end-to-end.md).

Three builds, each the ordinary pipeline:
1. the INT8 (FP8) engine as asked;
2. the fallback engine (every layer at the fallback precision);
3. where some INT8 layer's best time exceeds its fallback time by more than the margin, the INT8
   engine again with those layers pinned to the fallback precision (`--layer-precision`).
A layer's precision also changes what its neighbours read and write (INT8 codes or floats), which
per-layer timings do not see: a mixed engine can be slower than the INT8 one although each moved
layer is faster. So the engines are compared end to end, timed on
the build device at profile 0's opt shape, and the fastest is kept, the all-fallback one included:
where no layer gains from INT8, TensorRT's builder too ends with a float engine. Ties keep the
first, in the order above. The builds share one calibration cache and one timing cache (the user's,
or temporary ones), so later builds calibrate and time only what changed. The kept engine's header
records the comparison; each layer that left INT8 says why.
"""
from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch

from ..ir.dtypes import QUANTIZED_PRECISIONS
from ..runtime.engine_file import check_writable, pack, read_engine_file, write_atomic
from .config import PDL_PRECISIONS, BuildConfig
from .precision import exact_layer_pattern

# A layer moves only when the fallback is faster than this fraction of its INT8 time: the builder's
# timings of one layer wobble by a few percent between runs.
MOVE_MARGIN = 0.9
# End-to-end timing of the two engines: (warm-up, timed) runs. The CPU runs the INT8 emulation, which is
# slow, so it gets fewer.
END_TO_END_RUNS = {"cuda": (10, 50), "cpu": (1, 5)}


def best_layer_ms(header: dict) -> dict[str, float]:
    """Each timed layer's winning time (ms) at profile 0's opt shape, by layer name."""
    return {layer["name"]: min(layer["tactic_timings_ms"].values())
            for layer in header["layers"] if layer.get("tactic_timings_ms")}


def layers_faster_in_fallback(quantized: dict, fallback: dict, margin: float = MOVE_MARGIN) -> dict[str, dict]:
    """The INT8 (FP8) layers of the `quantized` engine header whose fallback time (from the
    `fallback` engine header, same layer name) is under `margin` × their quantized time:
    {name: {"quantized_ms", "fallback_ms"}}."""
    quantized_ms, fallback_ms = best_layer_ms(quantized), best_layer_ms(fallback)
    moves = {}
    for layer in quantized["layers"]:
        name = layer["name"]
        if layer["precision"] in QUANTIZED_PRECISIONS and name in quantized_ms and name in fallback_ms:
            if fallback_ms[name] < margin * quantized_ms[name]:
                moves[name] = {"quantized_ms": quantized_ms[name], "fallback_ms": fallback_ms[name]}
    return moves


def end_to_end_ms(path: str | os.PathLike) -> float:
    """Median milliseconds of one run of the engine at profile 0's opt shape, inputs on its device."""
    from ..runtime import load
    from ..runtime.sample_inputs import random_inputs
    from ..tactics.select import time_ms
    engine = load(path)
    context = engine.context()
    feeds = {name: torch.from_numpy(a).to(engine.device) for name, a in random_inputs(engine, seed=0).items()}
    warmup, runs = END_TO_END_RUNS["cuda" if engine.device.type == "cuda" else "cpu"]
    return time_ms(lambda: context.run(feeds), engine.device, runs, warmup)


def _fallback_config(config: BuildConfig, fallback: str, output: Path) -> BuildConfig:
    """The fallback engine's build: every layer at the fallback precision, the user's non-quantized
    overrides kept, no calibration or accuracy planner (no layer is quantized), --pdl as asked where
    the fallback has kernels that take part (FP16, BF16), else not. It may be the engine kept, so it
    is built as the user asked in every other respect (kernels captured or not)."""
    keep = lambda table: {k: v for k, v in table.items() if v not in QUANTIZED_PRECISIONS}  # noqa: E731
    return replace(config, output_path=str(output), precision=fallback, int8_fallback_precision=None,
                   layer_precision=keep(config.layer_precision), op_precision=keep(config.op_precision),
                   accuracy_budget=None, min_cosine=None, min_snr=None, decoder=None, data=None, split_by=None,
                   classes=None, calib=None, calib_cache=None, calib_balance_by=None, bias_correction=False,
                   pdl=config.pdl if fallback in PDL_PRECISIONS else None)


def _record(path: Path, record: dict, moved_reasons: dict[str, str], summary: str) -> dict:
    """The kept engine's header with the comparison, the moved layers' reasons and the summary line
    in its build log, rewritten in place."""
    header, tensors = read_engine_file(path)
    header["fallback_where_faster"] = record
    header["build_log"] = [*header.get("build_log", []), summary]
    for layer in header["layers"]:
        if layer["name"] in moved_reasons:
            layer["reason"] = moved_reasons[layer["name"]]
    write_atomic(path, pack(header, tensors))
    return header


def _moved_reasons(record: dict, quantized: dict, precision: str) -> dict[str, str]:
    """Why each layer that was quantized in the first engine is not in the kept one, by name."""
    fallback = record["fallback_precision"]
    if record["kept"] == "mixed":
        return {name: f"--fallback-where-faster: {fallback} {m['fallback_ms']:.4g} ms against {precision} "
                      f"{m['quantized_ms']:.4g} ms" for name, m in record["candidates"].items()}
    if record["kept"] == "fallback":
        reason = (f"--fallback-where-faster: the all-{fallback} engine was faster end to end "
                  f"({record['fallback_ms']:.4g} ms against {precision} {record['quantized_ms']:.4g} ms)")
        return {layer["name"]: reason for layer in quantized["layers"] if layer["precision"] in QUANTIZED_PRECISIONS}
    return {}


def build_with_fallback_where_faster(config: BuildConfig, run: Callable[[BuildConfig], object]):
    """The three builds described above, through `run` (the pipeline's build for one config);
    returns the kept build's result, its engine at config.output_path (the config validated)."""
    output = Path(config.output_path)
    check_writable(output)  # before three builds, and before a temporary directory beside it
    base = replace(config, fallback_where_faster=False, time_every_layer=True)
    with tempfile.TemporaryDirectory(prefix=".sartor-fallback-", dir=output.resolve().parent) as tmp:
        work = Path(tmp)
        shared = replace(base, calib_cache=base.calib_cache or str(work / "calibration.json"),
                         timing_cache=base.timing_cache or str(work / "timing.json"))
        quantized = run(replace(shared, output_path=str(work / "quantized.plan")))
        fallback_precision = quantized.header["int8_fallback_precision"]
        fallback = run(_fallback_config(shared, fallback_precision, work / "fallback.plan"))
        moves = layers_faster_in_fallback(quantized.header, fallback.header)
        record = {"fallback_precision": fallback_precision, "margin": MOVE_MARGIN, "candidates": moves,
                  "quantized_ms": round(end_to_end_ms(quantized.path), 5),
                  "fallback_ms": round(end_to_end_ms(fallback.path), 5)}
        engines = {config.precision: (quantized, record["quantized_ms"]), "fallback": (fallback, record["fallback_ms"])}
        if moves:
            pins = {**shared.layer_precision, **{exact_layer_pattern(name): fallback_precision for name in moves}}
            mixed = run(replace(shared, layer_precision=pins, output_path=str(work / "mixed.plan")))
            record["mixed_ms"] = round(end_to_end_ms(mixed.path), 5)
            engines["mixed"] = (mixed, record["mixed_ms"])
        record["kept"] = min(engines, key=lambda label: engines[label][1])  # the first of equals
        kept = engines[record["kept"]][0]
        moved_reasons = _moved_reasons(record, quantized.header, config.precision)
        summary = (f"--fallback-where-faster: {len(moves)} layer(s) faster at {fallback_precision}; kept the "
                   f"{record['kept']} engine: {config.precision} {record['quantized_ms']:.4g} ms, "
                   + (f"mixed {record['mixed_ms']:.4g} ms, " if "mixed_ms" in record else "")
                   + f"all {fallback_precision} {record['fallback_ms']:.4g} ms")
        header = _record(Path(kept.path), record, moved_reasons, summary)
        os.replace(kept.path, output)
    return replace(kept, path=str(output), header=header, log=[*kept.log, summary])
