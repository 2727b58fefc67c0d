"""The INT8 accuracy planner: `sartor build --precision int8 --accuracy-budget B --data VAL
[--split-by ATTR]`.

It starts from the default INT8 plan. For each candidate plan it builds a temporary engine (the
same thresholds, through a calibration cache in a temporary directory) and measures the task
metric's drop against the FP32 ONNX model with `sartor.validate` — overall and per split. While a
drop is over the budget, the most sensitive INT8 layers move to the higher precision (FP16 on
CUDA, FP32 on the CPU):

1. rank the plan's INT8 layers with `sensitivity.layer_sensitivity` on (up to
   SENSITIVITY_SAMPLES of) the calibration samples: each layer quantized alone, lowest output SNR
   first;
2. grow: keep the first 1, 2, 4, 8 … layers of the ranking out of INT8 until the budget holds;
3. bisect back between the last count that failed and the first that held, for the smallest
   prefix of the ranking that holds.

Each layer kept out records why ("planner: sensitivity rank k, SNR x dB; needed for budget B
(night drop 0.012 → 0.004)"), and the engine header's "planner" record holds the ranking and
every measured iteration (`sartor inspect` shows both). When the budget still fails with every
INT8 layer moved out, the build fails with one line (PlannerError).

The search assumes that keeping more layers out of INT8 does not make the drop worse. Where that
is not so, it still ends on a set that was measured to meet the budget. Layers pinned with
--layer-precision are never moved.
"""
from __future__ import annotations

import math
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from ..errors import SartorError
from ..ir import Graph

SENSITIVITY_SAMPLES = 32  # calibration samples the ranking runs on (each INT8 layer costs one pass over them)
DROP_EPS = 1e-9  # float noise allowed over the budget, as in `sartor validate --max-drop`


class PlannerError(SartorError):
    """The accuracy budget cannot be met, even with every INT8 layer at higher precision."""


@dataclass
class Trial:
    """One measured plan: the layers kept out of INT8 and the drop per split ("all" first)."""
    kept_out: list
    drops: dict  # split name -> reference − engine (None: undefined, e.g. no ground truth)
    reference: dict = field(default_factory=dict)
    engine: dict = field(default_factory=dict)
    metric: str = ""
    seconds: float = 0.0

    def over(self, budget: float) -> dict:
        return {k: d for k, d in self.drops.items() if d is not None and d > budget + DROP_EPS}

    def holds(self, budget: float) -> bool:
        return not self.over(budget)

    def worst(self) -> tuple[str, float | None]:
        """The split with the largest drop (a named split before "all" on a tie)."""
        defined = {k: d for k, d in self.drops.items() if d is not None}
        if not defined:
            return "all", None
        name = max(defined, key=lambda k: (defined[k], k != "all"))
        return name, defined[name]

    def describe(self) -> str:
        return ", ".join(f"{k} {_fmt(d)}" for k, d in self.drops.items())

    def to_json(self, budget: float) -> dict:
        return {"layers_out": len(self.kept_out), "kept_out": list(self.kept_out), "drops": self.drops,
                "reference": self.reference, "engine": self.engine, "holds": self.holds(budget),
                "seconds": round(self.seconds, 3)}


def search(ranking: list[str], measure: Callable[[list[str]], Trial], budget: float) -> tuple[Trial | None, list]:
    """(the first plan found that holds, or None; every trial in order). `measure(names)` measures
    the plan with the layers `names` kept out of INT8; only prefixes of `ranking` are tried."""
    trials: list[Trial] = []

    def run(count: int) -> Trial:
        trial = measure(list(ranking[:count]))
        trials.append(trial)
        return trial

    best = run(0)
    if best.holds(budget):
        return best, trials
    failing, count, best, held = 0, 1, None, None
    while best is None:  # grow: 1, 2, 4, 8 … (then all of them)
        count = min(count, len(ranking))
        if count == failing:
            return None, trials
        trial = run(count)
        if trial.holds(budget):
            best, held = trial, count
        else:
            failing, count = count, count * 2
    while held - failing > 1:  # bisect back to the smallest prefix that holds
        middle = (failing + held) // 2
        trial = run(middle)
        if trial.holds(budget):
            best, held = trial, middle
        else:
            failing = middle
    return best, trials


def measure_drops(engine_path: str | Path, dataset, config) -> Trial:
    """Validate `engine_path` against the FP32 ONNX model on `dataset`: the drop overall and per
    split of config.split_by."""
    from ..validate.runner import validate
    report = validate(engine_path, dataset, reference=config.model_path, split_by=config.split_by,
                      device=config.device)
    rows = [report.overall, *report.splits]
    return Trial([], {s.name: s.drop for s in rows}, {s.name: s.reference for s in rows},
                 {s.name: s.engine for s in rows}, report.metric)


def _literal(name: str) -> str:
    """A --layer-precision pattern that matches exactly `name` (glob characters escaped)."""
    return "".join(f"[{c}]" if c in "*?[" else c for c in name)


def _fmt(drop: float | None) -> str:
    return "-" if drop is None else f"{drop:.4f}"


def _finite(value: float) -> float | None:
    return float(value) if math.isfinite(value) else None


def _ranking(graph: Graph, weights: dict, amax: dict, candidates: list[str], config, device: torch.device,
             profiles: list) -> tuple[list, dict]:
    """The candidates, least robust first, and where the ranking was measured."""
    from .data import open_calibration
    from .sensitivity import layer_sensitivity
    from .stage import calibration_batch_size, open_build_calibration
    started = time.perf_counter()
    limit = min(config.calib_size, SENSITIVITY_SAMPLES)
    if config.calib:
        source = f"calibration set {config.calib}"
        batches = list(open_build_calibration(graph, config, profiles, limit))
    else:  # thresholds from the cache alone: rank on the validation images
        source = f"--data {config.data} (no --calib given)"
        batches = list(open_calibration(config.data, graph.inputs, limit, calibration_batch_size(graph, profiles),
                                        config.preprocess_spec(), config.split_by, config.seed))
    report = layer_sensitivity(graph, weights, batches, amax, device, layers=set(candidates))
    where = {"samples": report.samples, "source": source, "seconds": round(time.perf_counter() - started, 3)}
    return report.layers, where


def plan_for_budget(graph: Graph, weights: dict, plan, amax: dict, calibration: dict, config, onnx_sha256: str,
                    device: torch.device, profiles: list, log: list):
    """The builder's planner stage: (the precision plan that meets config.accuracy_budget, the
    header's "planner" record). `plan` is the default INT8 plan; `calibration` the calibration
    stage's provenance record."""
    from ..builder.pipeline import build
    from ..builder.precision import PrecisionPlan, base_precision
    from ..data import open_dataset
    from .cache import CalibrationCache, write_cache

    budget = config.accuracy_budget
    higher = base_precision(config, device)
    candidates = [name for name, p in plan.layers.items() if p == "int8" and name not in plan.reasons]
    dataset = open_dataset(config.data, class_names=config.classes)  # before the ranking: a bad --data fails now
    ranking, where = _ranking(graph, weights, amax, candidates, config, device, profiles) if candidates else ([], {})
    if ranking:
        log.append(f"planner: ranked {len(ranking)} INT8 layer(s) on {where['samples']} samples of the "
                   f"{where['source']} in {where['seconds']:.1f} s; least robust: "
                   + ", ".join(f"{r.name} ({r.snr_db:.1f} dB)" for r in ranking[:3]))
    preprocess = config.preprocess_spec()
    with tempfile.TemporaryDirectory(prefix="sartor-planner-") as tmp:
        cache = Path(tmp) / "calibration.json"
        write_cache(cache, CalibrationCache(onnx_sha256, calibration["method"], calibration["calib_sha256"],
                                            calibration["calib_size"], amax,
                                            preprocess.describe() if preprocess is not None else None,
                                            calibration.get("percentile")))
        count = [0]

        def measure(kept_out: list[str]) -> Trial:
            started = time.perf_counter()
            path = Path(tmp) / f"trial{count[0]}.plan"
            pins = {_literal(name): higher for name in kept_out}
            build(replace(config, output_path=str(path), calib=None, calib_cache=str(cache), calib_balance_by=None,
                          data=None, split_by=None, accuracy_budget=None,
                          layer_precision={**pins, **config.layer_precision}))
            trial = measure_drops(path, dataset, config)
            path.unlink(missing_ok=True)
            trial.kept_out, trial.seconds = list(kept_out), time.perf_counter() - started
            over = trial.over(budget)
            log.append(f"planner: iteration {count[0]}: {len(kept_out)} layer(s) out of INT8: drop {trial.describe()}"
                       + (f" — over budget {budget:g} in {', '.join(over)}" if over else f" — within budget {budget:g}")
                       + f" ({trial.seconds:.1f} s)")
            count[0] += 1
            return trial

        best, trials = search([r.name for r in ranking], measure, budget)
    first = trials[0]
    split, before = first.worst()
    if best is None:
        last = trials[-1]
        worst, drop = last.worst()
        raise PlannerError(f"--accuracy-budget {budget:g} cannot be met: with all {len(ranking)} INT8 layer(s) moved "
                           f"to {higher}, the {worst} drop on --data {config.data} is still {_fmt(drop)} "
                           f"(default INT8 plan: {split} drop {_fmt(before)})")
    updated = PrecisionPlan(dict(plan.layers), dict(plan.reasons))
    rank = {r.name: (k + 1, r.snr_db) for k, r in enumerate(ranking)}
    after = best.drops.get(split)
    for name in best.kept_out:
        k, snr = rank[name]
        updated.layers[name] = higher
        updated.reasons[name] = (f"planner: sensitivity rank {k}, SNR {snr:.1f} dB; needed for budget {budget:g} "
                                 f"({split} drop {_fmt(before)} → {_fmt(after)})")
        log.append(f"layer {name} runs {higher}: {updated.reasons[name]}")
    log.append(f"planner: {len(best.kept_out)} of {len(ranking)} INT8 layer(s) kept at {higher} for budget {budget:g} "
               f"after {len(trials)} measurement(s): drop {best.describe()}")
    record = {"budget": budget, "data": str(config.data), "split_by": config.split_by, "metric": first.metric,
              "images": len(dataset), "precision": higher, "sensitivity": where,
              "ranking": [{"name": r.name, "snr_db": _finite(r.snr_db)} for r in ranking],
              "iterations": [t.to_json(budget) for t in trials], "kept_out": list(best.kept_out),
              "drops": best.drops, "worst_split": split}
    return updated, record
