"""The accuracy planner of quantized builds (--precision int8, or fp8: FP8 E4M3; "INT8" below
stands for the build's quantized format) and of FP16 and BF16 builds (the end of this docstring).
Three targets, one at a time:

- `sartor build --precision int8 --accuracy-budget B --data VAL [--split-by ATTR]`: the task
  metric's drop against the FP32 ONNX model, measured with `sartor.validate` on labelled (or
  reference-labelled) --data, overall and per split, must be at most B;
- `sartor build --precision int8 --calib DATA --min-cosine C [--cosine-samples N] [--data VAL]`:
  no labels, no metric. The engine's outputs must agree with the FP32 model's (the reference
  executor on the same optimized graph, in FP32) on held-out samples: for each output, the cosine
  between engine and FP32 per sample, averaged over the samples; the worst output's mean must be
  at least C. The minimum over samples is recorded and shown, not gated on: one near-zero output
  (a blank image) can have any cosine, and a gate on the minimum would chase that sample.
- `sartor build --precision int8 --calib DATA --min-snr DB [--decoder yolo|boxes]`: no labels
  either, on the same held-out samples: for each output, the SNR 10·log10(Σref² / Σ(ref−engine)²)
  over all held-out samples against FP32; the worst output's must be at least DB. With --decoder
  (either label-free target), a detector's boxes and scores are compared apart, as `sartor
  sensitivity --decoder` does, and the worst group decides: box coordinates in pixels would
  otherwise drown the scores' error.

The held-out samples are never calibration samples. They are up to N (--cosine-samples) images
of --data when given, else samples of --calib, always without the calibration draw: for an
image dataset the images calibration drew (by path) are left out; for a .npy/.npz, whose
calibration takes the first --calib-size samples, the samples after those. When the thresholds
come from a calibration cache, the build's draw is checked against the cache's SHA-256 of its
samples; where it does not match (or cannot be checked: --data beside a .npy --calib, or no
--calib) the record and the build log say so. The held-out samples are also what the search
tunes on, so its figure is the one it optimised; an independent check needs a third set
(bench/int8_cosine.py measures one).

For each candidate plan the planner builds a temporary engine (the same thresholds, through a
calibration cache in a temporary directory) and measures the target. While the target fails,
the most sensitive INT8 layers move to the higher precision (FP16 on CUDA, FP32 on the CPU):

1. when the default plan (measured first) misses the target, rank the plan's INT8 layers with
   `quant.sensitivity.layer_sensitivity` on (up to SENSITIVITY_SAMPLES of) the calibration samples:
   each layer quantized alone, lowest output SNR first;
2. grow: keep the first 1, 2, 4, 8 … layers of the ranking out of INT8 until the target holds;
3. bisect back between the last count that failed and the first that held, for the smallest
   prefix of the ranking that holds.

Each layer kept out records why ("planner: sensitivity rank k, SNR x dB; needed for budget B
(night drop 0.012 → 0.004)", or "needed for --min-cosine 0.99 (logits mean cosine 0.9843 →
0.9921)", or "needed for --min-snr 30 (logits SNR 21.40 dB → 31.02 dB)"), and the engine
header's "planner" record holds the target, the quantized format ("quantized"), the ranking and every
measured iteration (`sartor inspect` shows them). When the target still fails with every INT8
layer moved out, the build fails with one line (PlannerError).

The search assumes that keeping more layers out of INT8 does not make the result worse. Where that
is not so, it still ends on a set that was measured to meet the target. Layers pinned with
--layer-precision are never moved.

FP16 and BF16 builds (`--precision fp16|bf16` with any of the three targets) are planned the same
way, their layers moving to FP32 (docs/decisions/0050-fp16-accuracy-targets.md). Nothing is
calibrated: the held-out samples are the first N of --data, else of --calib, and the ranking
(`float_sensitivity.float_layer_sensitivity`: each layer alone at FP16, the rest FP32) runs on the
first SENSITIVITY_SAMPLES of them (of --data for the budget). The record names the precision left
in "reduced" ("quantized" too for INT8/FP8). All trial builds share a timing cache (the user's
--timing-cache, else a temporary one) and embed no kernels.
"""
from __future__ import annotations

import math
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import ClassVar

import numpy as np
import torch

from ..errors import ConfigError, SartorError
from ..ir import Graph
from ..ir.dtypes import QUANTIZED_PRECISIONS
from .config import PLANNED_PRECISIONS, BuildConfig
from .precision import PrecisionPlan, base_precision, exact_layer_pattern
from .quantization_stages import calibration_batch_size, open_build_calibration

SENSITIVITY_SAMPLES = 32  # calibration samples the ranking runs on (each INT8 layer costs one pass over them)
DROP_EPS = 1e-9  # float noise allowed over the budget, as in `sartor validate --max-drop`
COSINE_EPS = 1e-12  # float noise allowed under --min-cosine (cosines are computed in float64)
SNR_EPS = 1e-9  # float noise allowed under --min-snr, in dB


class PlannerError(SartorError):
    """The planner's target cannot be met, even with every INT8 layer at higher precision."""


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


@dataclass
class OutputTrial:
    """One plan measured for a label-free target: per output (or output group), the per-sample
    cosine against FP32 averaged over the held-out samples ("mean"), its minimum ("min") and the
    SNR over all samples ("snr_db"; +inf when the engine matches exactly). None stands for a figure
    that is not finite (a NaN in the engine's output). `key` names the figure the target gates on."""
    kept_out: list
    outputs: dict  # output name -> {"mean": float | None, "min": float | None, "snr_db": float | None}
    seconds: float = 0.0
    key: ClassVar[str]
    label: ClassVar[str]  # the figure, in words
    eps: ClassVar[float]

    def value(self, name: str) -> float | None:
        return self.outputs[name][self.key]

    def under(self, target: float) -> list[str]:
        return [k for k in self.outputs if self.value(k) is None or self.value(k) < target - self.eps]

    def holds(self, target: float) -> bool:
        return not self.under(target)

    def worst(self) -> tuple[str, float | None]:
        """The output with the lowest figure (a non-finite one first)."""
        name = min(self.outputs, key=lambda k: (self.value(k) is not None, self.value(k) or 0.0))
        return name, self.value(name)

    @staticmethod
    def format(value: float | None) -> str:
        raise NotImplementedError

    def describe(self) -> str:
        raise NotImplementedError

    def to_json(self, target: float) -> dict:
        return {"layers_out": len(self.kept_out), "kept_out": list(self.kept_out), "outputs": self.outputs,
                "holds": self.holds(target), "seconds": round(self.seconds, 3)}


class CosineTrial(OutputTrial):
    """--min-cosine: gated on each output's mean per-sample cosine."""
    key, label, eps = "mean", "mean cosine", COSINE_EPS

    @staticmethod
    def format(value: float | None) -> str:
        return cosine_text(value)

    def describe(self) -> str:
        return ", ".join(f"{k} mean {cosine_text(o['mean'])} (min {cosine_text(o['min'])})"
                         for k, o in self.outputs.items())


class SnrTrial(OutputTrial):
    """--min-snr: gated on each output's SNR over all held-out samples."""
    key, label, eps = "snr_db", "SNR", SNR_EPS

    @staticmethod
    def format(value: float | None) -> str:
        return _db(value)

    def describe(self) -> str:
        return ", ".join(f"{k} {_db(o['snr_db'])}" for k, o in self.outputs.items())


def search(ranking: list[str], measure: Callable[[list[str]], Trial | OutputTrial],
           target: float, first: Trial | OutputTrial | None = None) -> tuple[Trial | OutputTrial | None, list]:
    """(the first plan found that holds, or None; every trial in order). `measure(names)` measures
    the plan with the layers `names` kept out of INT8, and `trial.holds(target)` judges it; only
    prefixes of `ranking` are tried. `first`: the default plan (no layer kept out), when the caller
    has measured it already."""
    trials: list = [] if first is None else [first]

    def run(count: int):
        trial = measure(list(ranking[:count]))
        trials.append(trial)
        return trial

    best = run(0) if first is None else first
    if best.holds(target):
        return best, trials
    failing, count, best, held = 0, 1, None, None
    while best is None:  # grow: 1, 2, 4, 8 … (then all of them)
        count = min(count, len(ranking))
        if count == failing:
            return None, trials
        trial = run(count)
        if trial.holds(target):
            best, held = trial, count
        else:
            failing, count = count, count * 2
    while held - failing > 1:  # bisect back to the smallest prefix that holds
        middle = (failing + held) // 2
        trial = run(middle)
        if trial.holds(target):
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


def sample_cosines(reference: np.ndarray, engine: np.ndarray, batch: int) -> np.ndarray:
    """The cosine between `reference` and `engine` per sample (axis 0 when it holds `batch` of
    them; else the whole array counts as one sample), in float64. Two zero vectors agree (1); a zero
    against a non-zero one does not (0); a non-finite engine value gives NaN."""
    n = batch if reference.ndim and reference.shape[0] == batch else 1
    r = np.asarray(reference, np.float64).reshape(n, -1)
    e = np.asarray(engine, np.float64).reshape(n, -1)
    nr, ne = np.linalg.norm(r, axis=1), np.linalg.norm(e, axis=1)
    with np.errstate(invalid="ignore", divide="ignore"):
        cos = np.clip((r * e).sum(axis=1) / (nr * ne), -1.0, 1.0)  # rounding can step past ±1; NaN stays
    cos[(nr == 0) & (ne == 0)] = 1.0
    cos[(nr == 0) != (ne == 0)] = 0.0
    return cos


def compare_outputs(reference: list[dict], engine: list[dict], sizes: list[int]) -> dict:
    """Per output name: {"mean", "min"} of the per-sample cosines over all batches, and "snr_db"
    (10·log10 of signal over error energy, over all samples; +inf when they are equal). `reference`/
    `engine` hold one {name: array} per batch, of `sizes` samples each."""
    result = {}
    for name in reference[0]:
        cosines, signal, noise = [], 0.0, 0.0
        for ref, got, batch in zip(reference, engine, sizes):
            r, g = np.asarray(ref[name], np.float64), np.asarray(got[name], np.float64)
            cosines.append(sample_cosines(r, g, batch))
            signal, noise = signal + float((r * r).sum()), noise + float(((r - g) ** 2).sum())
        cos = np.concatenate(cosines)
        snr = math.inf if noise == 0 else (10 * math.log10(signal / noise) if signal > 0 else -math.inf)
        result[name] = {"mean": _finite(cos.mean()), "min": _finite(cos.min()),
                        "snr_db": snr if snr == math.inf else _finite(snr)}  # an exact match meets any --min-snr
    return result


def _fmt(drop: float | None) -> str:
    return "-" if drop is None else f"{drop:.4f}"


def cosine_text(value: float | None) -> str:
    """A cosine with 4 decimals, more near 1 (two digits past the first one that differs from 1,
    up to 8): FP16 targets such as 0.99995 would otherwise read 1.0000 on both sides."""
    if value is None:
        return "nan"
    gap = 1.0 - value
    digits = 4 if gap <= 0 else min(8, max(4, math.ceil(-math.log10(gap)) + 2))
    return f"{value:.{digits}f}"



def _db(value: float | None) -> str:
    return "nan" if value is None else f"{value:.2f} dB"


def _finite(value: float) -> float | None:
    return float(value) if math.isfinite(value) else None


def _ranking(graph: Graph, weights: dict, amax: dict, candidates: list[str], config, device: torch.device,
             profiles: list, precision: str) -> tuple[list, dict]:
    """The candidates, least robust first when quantized alone to `precision`, and where the ranking
    was measured."""
    from ..quant.data import open_calibration
    from ..quant.sensitivity import layer_sensitivity
    started = time.perf_counter()
    limit = min(config.calib_size, SENSITIVITY_SAMPLES)
    if config.calib:
        source = f"calibration set {config.calib}"
        batches = list(open_build_calibration(graph, config, profiles, limit))
    else:  # thresholds from the cache alone: rank on the validation images
        source = f"--data {config.data} (no --calib given)"
        batches = list(open_calibration(config.data, graph.inputs, limit, calibration_batch_size(graph, profiles),
                                        config.preprocess_spec(), config.split_by, config.seed))
    report = layer_sensitivity(graph, weights, batches, amax, device, layers=set(candidates), precision=precision)
    where = {"samples": report.samples, "source": source, "seconds": round(time.perf_counter() - started, 3)}
    return report.layers, where


# ---- the samples --min-cosine and --min-snr are measured on ------------------------------------------------------------

def _resolved(path: str) -> str:
    return str(Path(path).resolve())


def held_out_samples(graph: Graph, config, profiles: list, calibration: dict,
                     flag: str = "--min-cosine") -> tuple[list[dict], dict]:
    """(up to config.cosine_samples held-out batches, where they came from): images of --data, else
    samples of --calib, without the calibration draw (module docstring). Raises ConfigError, naming
    the target's `flag`, when nothing is left to measure on."""
    from ..data import balanced_sample, iterate_batches, open_dataset
    from ..quant.data import (
        ARRAY_SUFFIXES,
        CalibrationSet,
        array_batches,
        checked_input_array,
        load_input_arrays,
        spread_evenly,
    )
    limit, batch = config.cosine_samples, calibration_batch_size(graph, profiles)
    from_python = config.calib_data is not None
    calib_is_array = from_python or (bool(config.calib) and Path(config.calib).suffix in ARRAY_SUFFIXES
                                     and Path(config.calib).is_file())
    calibrated = calibration is not None  # None: a float build, which draws no calibration samples
    drawn = open_build_calibration(graph, config, profiles) if config.calib and calibrated else None  # lazy
    if not calibrated:
        disjoint = f"not applicable: {config.precision.upper()} builds calibrate nothing"
    elif drawn is None:
        disjoint = "assumed: no --calib to compare with (thresholds from the cache alone)"
    elif not calibration["from_cache"]:
        disjoint = f"yes: the {calibration['calib_size']} calibration samples are left out"
    else:  # the cache does not list its samples: redraw ours and compare the digests
        list(drawn)
        disjoint = (f"yes: the cache's {calibration['calib_size']} calibration samples are this build's draw of "
                    f"--calib (SHA-256 matches) and are left out" if drawn.sha256 == calibration["calib_sha256"] else
                    f"unverified: thresholds from cache {calibration['cache']}, whose calibration samples (sha256 "
                    f"{calibration['calib_sha256'][:12]}…) are not the draw of --calib {config.calib} with "
                    f"--calib-size {config.calib_size}")
    if from_python and not config.data:  # the samples after the first --calib-size, in order
        from ..quant.python_data import open_python_calibration, sample_count
        available = sample_count(config.calib_data, graph.inputs, config.preprocess_spec())
        start = min(available, config.calib_size) if calibrated else 0
        if available <= start:
            raise ConfigError(f"{flag} measures on samples calibration does not use, but calib {config.calib} holds "
                              f"{available} and calibration uses {start} (calib_size {config.calib_size}): give more "
                              f"samples than calib_size, or data= with other images")
        samples = open_python_calibration(config.calib_data, graph.inputs, limit, batch, config.preprocess_spec(),
                                          start)
        source = f"calib {config.calib}, samples {start}..{start + samples.available - 1}"
    elif calib_is_array and not config.data:
        arrays = load_input_arrays(Path(config.calib), graph.inputs)
        available = min(len(a) for a in arrays.values())
        start = min(available, config.calib_size) if calibrated else 0
        stop = min(available, start + limit)
        if stop <= start:
            raise ConfigError(f"{flag} measures on samples calibration does not use, but --calib {config.calib} "
                              f"holds {available} and calibration uses {start} (--calib-size {config.calib_size}): "
                              f"give more samples than --calib-size, or --data with other images")
        samples = CalibrationSet(str(config.calib), array_batches({k: a[start:stop] for k, a in arrays.items()},
                                                                   stop - start, batch), stop - start)
        source = f"--calib {config.calib}, samples {start}..{stop - 1}" + (
            f" (calibration uses 0..{start - 1})" if calibrated else "")
    else:
        path = config.data or config.calib
        if len(graph.inputs) != 1:
            raise ConfigError(f"{flag}: image datasets feed one-input models, and this one has "
                              f"{len(graph.inputs)}; give --calib as a .npz with one array per input")
        pool = list(open_dataset(path).samples)
        if drawn is not None and drawn.samples is not None:  # both image datasets: leave the drawn images out
            used = {_resolved(s.path) for s in drawn.samples}
            pool = [s for s in pool if _resolved(s.path) not in used]
        elif config.data and calib_is_array:
            disjoint = f"assumed: --calib {config.calib} holds arrays, which cannot be matched with the --data images"
        source_flag = "--data" if config.data else "--calib"
        if not pool:
            raise ConfigError(f"{flag} measures on images calibration does not use, but every image of {source_flag} "
                              f"{path} is in the calibration draw (--calib-size {config.calib_size}): give --data "
                              f"with other images, or a smaller --calib-size")
        by = config.split_by if config.data else config.calib_balance_by
        chosen = balanced_sample(pool, by, limit, config.seed) if by else spread_evenly(pool, limit)
        info, spec = graph.inputs[0], config.preprocess_spec()

        def batches():
            for array, _, _ in iterate_batches(chosen, spec, batch):
                yield {info.name: checked_input_array(info.name, array, info, Path(path))}
        samples = CalibrationSet(str(path), batches, len(chosen), chosen)
        source = f"{source_flag} {path}: {len(chosen)} of {len(pool)} images" + (
            " outside the calibration draw" if calibrated else "") + (
            f", drawn equally by {by}" if by else "")
    loaded = list(samples)
    return loaded, {"source": source, "samples": samples.size, "sha256": samples.sha256, "disjoint": disjoint}


def fp32_outputs(graph: Graph, weights: dict, batches: list[dict], device: torch.device) -> list[dict]:
    """The FP32 model's outputs on `batches` (the reference executor on the optimized graph)."""
    from ..runtime.context import matmul_precision
    from ..runtime.executor import Executor
    executor = Executor(graph, weights, device)
    results = []
    with torch.inference_mode(), matmul_precision(False):
        for batch in batches:
            feeds = {k: torch.from_numpy(np.ascontiguousarray(v)).to(device) for k, v in batch.items()}
            results.append({k: t.detach().float().cpu().numpy() for k, t in executor.run(feeds).items()})
    return results


def engine_outputs(engine_path: str | Path, batches: list[dict], device: torch.device) -> list[dict]:
    """The outputs of the engine at `engine_path` on `batches`."""
    from ..runtime import load
    context = load(engine_path, str(device)).context()
    outputs = []
    for batch in batches:
        result = context.run({k: np.ascontiguousarray(v) for k, v in batch.items()})
        outputs.append({k: np.asarray(v, np.float32) for k, v in result.items()})
    return outputs


def batch_sizes(batches: list[dict]) -> list[int]:
    return [len(next(iter(batch.values()))) for batch in batches]


def grouped_outputs(outputs: list[dict], groups, sizes: list[int]) -> list[dict]:
    """Each batch's outputs split into `groups` (`validate.sensitivity.output_groups`: boxes, scores, …;
    None: as they are). A group comes back flat; where it divides into the batch's samples it is
    shaped [samples, -1] again (the groups are cut per anchor, sample-major), so that the cosine
    stays per sample."""
    if groups is None:
        return outputs
    result = []
    for batch, size in zip(outputs, sizes):
        flat = groups({k: np.asarray(v, np.float64) for k, v in batch.items()})
        result.append({k: a.reshape(size, -1) if size and a.size % size == 0 else a for k, a in flat.items()})
    return result


# ---- the three targets --------------------------------------------------------------------------------------

class _BudgetTarget:
    """--accuracy-budget: the metric drop on --data, overall and per split."""

    def __init__(self, config, word: str) -> None:
        from ..data import open_dataset
        self.config, self.value, self.word = config, config.accuracy_budget, word
        self.flag = f"--accuracy-budget {self.value:g}"
        self.dataset = open_dataset(config.data, class_names=config.classes)  # before the ranking: a bad --data fails now

    def measure(self, engine_path: Path) -> Trial:
        return measure_drops(engine_path, self.dataset, self.config)

    def verdict(self, trial: Trial) -> str:
        over = trial.over(self.value)
        return (f"drop {trial.describe()}" + (f" — over budget {self.value:g} in {', '.join(over)}" if over
                                              else f" — within budget {self.value:g}"))

    def reason(self, first: Trial, best: Trial) -> str:
        split, before = first.worst()
        return f"needed for budget {self.value:g} ({split} drop {_fmt(before)} → {_fmt(best.drops.get(split))})"

    def summary(self, best: Trial) -> tuple[str, str]:
        return f"for budget {self.value:g}", f"drop {best.describe()}"

    def unreachable(self, first: Trial, last: Trial) -> str:
        split, before = first.worst()
        worst, drop = last.worst()
        return (f"the {worst} drop on --data {self.config.data} is still {_fmt(drop)} (default {self.word} plan: "
                f"{split} drop {_fmt(before)})")

    def record(self, first: Trial, best: Trial) -> dict:
        return {"target": "accuracy_budget", "budget": self.value, "data": str(self.config.data),
                "split_by": self.config.split_by, "metric": first.metric, "images": len(self.dataset),
                "drops": best.drops, "worst_split": first.worst()[0]}


class _LabelFreeTarget:
    """A target without labels: the engine's outputs against the FP32 model's on held-out samples,
    per output (per output group with --decoder); the worst one's figure (`trial.key`) must reach
    the value. The subclasses name the figure."""
    trial: ClassVar[type[OutputTrial]]
    name: ClassVar[str]  # the record's "target", and the key that holds the value
    statistic: ClassVar[str]

    def __init__(self, value: float, graph: Graph, weights: dict, config, profiles: list, calibration: dict,
                 device: torch.device, log: list, word: str) -> None:
        from ..validate.sensitivity import output_groups
        self.value, self.device, self.word, self.decoder = value, device, word, config.decoder
        self.flag = f"--{self.name.replace('_', '-')} {value:g}"
        self.batches, self.held_out = held_out_samples(graph, config, profiles, calibration, self.flag.split()[0])
        self.sizes = batch_sizes(self.batches)
        reference = fp32_outputs(graph, weights, self.batches, device)
        self.groups = None if self.decoder is None else output_groups(
            self.decoder, {k: a.shape for k, a in reference[0].items()})
        self.reference = grouped_outputs(reference, self.groups, self.sizes)
        log.append(f"planner: {self.flag} measured on {self.held_out['samples']} held-out samples from "
                   f"{self.held_out['source']}" + (f", outputs grouped by --decoder {self.decoder}" if self.decoder
                                                   else "") + f"; disjoint from calibration: {self.held_out['disjoint']}")

    def measure(self, engine_path: Path) -> OutputTrial:
        outputs = grouped_outputs(engine_outputs(engine_path, self.batches, self.device), self.groups, self.sizes)
        return self.trial([], compare_outputs(self.reference, outputs, self.sizes))

    def verdict(self, trial: OutputTrial) -> str:
        under = trial.under(self.value)
        return (f"{trial.label} {trial.describe()}" + (f" — under {self.flag} in {', '.join(under)}" if under
                                                       else f" — meets {self.flag}"))

    def reason(self, first: OutputTrial, best: OutputTrial) -> str:
        name, before = first.worst()
        return f"needed for {self.flag} ({name} {first.label} {first.format(before)} → {best.format(best.value(name))})"

    def summary(self, best: OutputTrial) -> tuple[str, str]:
        return f"for {self.flag}", f"{best.label} {best.describe()}"

    def unreachable(self, first: OutputTrial, last: OutputTrial) -> str:
        name, value = last.worst()
        return (f"output {name} has {last.label} {last.format(value)} over {self.held_out['samples']} held-out samples "
                f"(default {self.word} plan: {first.format(first.worst()[1])})")

    def record(self, first: OutputTrial, best: OutputTrial) -> dict:
        return {"target": self.name, self.name: self.value, "statistic": self.statistic, "decoder": self.decoder,
                "reference": "FP32 (reference executor, optimized graph)", "held_out": self.held_out,
                "outputs": best.outputs, "worst_output": first.worst()[0]}


class _CosineTarget(_LabelFreeTarget):
    """--min-cosine: the worst output's mean per-sample cosine against FP32."""
    trial, name = CosineTrial, "min_cosine"
    statistic = "per output, the mean over the held-out samples of the per-sample cosine against FP32; the worst output"


class _SnrTarget(_LabelFreeTarget):
    """--min-snr: the worst output's SNR against FP32 over all held-out samples."""
    trial, name = SnrTrial, "min_snr"
    statistic = ("per output, 10·log10(Σref² / Σ(ref−engine)²) in dB over the held-out samples against FP32; "
                 "the worst output")


def _stored_bias_corrections(config) -> dict:
    """The bias corrections the user's calibration cache holds (for the planner's trial cache)."""
    if not config.bias_correction or not config.calib_cache or not Path(config.calib_cache).is_file():
        return {}
    from ..quant.cache import read_cache
    return read_cache(config.calib_cache).bias_correction


def _trial_config(config: BuildConfig, tmp: Path, amax: dict, calibration: dict | None,
                  onnx_sha256: str) -> BuildConfig:
    """The settings every trial build shares: the build's own without the planner's; kernels not
    embedded (the trial engine is loaded once, here), nor PDL or streams timed; tactic timings
    shared through a timing cache (the user's --timing-cache, else one in `tmp`), so that a trial
    after the first times only the layers whose precision it changed. A quantized build's trials take its thresholds through a
    calibration cache in `tmp`; a float build's (`calibration` None) take no calibration at all."""
    common = dict(data=None, split_by=None, accuracy_budget=None, min_cosine=None, min_snr=None, decoder=None,
                  nms=None, embed_kernels=False, timing_cache=config.timing_cache or str(tmp / "timings.json"),
                  # A trial is judged on accuracy, which launching does not change: no PDL or streams timed.
                  pdl=False, max_aux_streams=0)
    if calibration is None:
        return replace(config, calib=None, calib_data=None, calib_cache=None, calib_balance_by=None, **common)
    from ..quant.cache import CalibrationCache, write_cache
    cache = tmp / "calibration.json"
    preprocess = config.preprocess_spec()
    write_cache(cache, CalibrationCache(onnx_sha256, calibration["method"], calibration["calib_sha256"],
                                        calibration["calib_size"], amax,
                                        preprocess.describe() if preprocess is not None else None,
                                        calibration.get("percentile"),
                                        bias_correction=_stored_bias_corrections(config)))
    # Trials are corrected as the final engine will be: from the corrections the user's cache
    # holds, the others measured on --calib (once: the trial cache keeps them for the next trials).
    calib = config.calib if config.bias_correction else None
    return replace(config, calib=calib, calib_cache=str(cache),
                   calib_balance_by=config.calib_balance_by if calib else None, **common)


def first_samples(batches: list[dict], limit: int) -> list[dict]:
    """The first `limit` samples of `batches` (the last batch taken cut short)."""
    taken, count = [], 0
    for batch, size in zip(batches, batch_sizes(batches)):
        if count >= limit:
            break
        keep = min(size, limit - count)
        taken.append({k: v[:keep] for k, v in batch.items()})
        count += keep
    return taken


def joined(graph: Graph, batches: list[dict]) -> list[dict]:
    """`batches` as one batch where every input's batch axis is free: the ranking runs the reference
    executor, which takes any batch, while the engine's samples come in batches its first profile
    admits (batch 1 for a latency profile: a pass per sample per layer)."""
    if len(batches) < 2 or any(not info.shape or isinstance(info.shape[0], int) for info in graph.inputs):
        return batches
    return [{k: np.concatenate([b[k] for b in batches]) for k in batches[0]}]


def _float_ranking(graph: Graph, weights: dict, candidates: list[str], target, config, device: torch.device,
                   profiles: list, precision: str) -> tuple[list, dict]:
    """A float build's candidates, least robust first when run alone at `precision` (FP16, BF16), and
    where that was measured: the first SENSITIVITY_SAMPLES samples the target measures on (a float
    build has no calibration set; the label-free targets tune on those samples anyway)."""
    from .float_sensitivity import float_layer_sensitivity
    started = time.perf_counter()
    if isinstance(target, _BudgetTarget):
        from ..quant.data import open_calibration
        batches = list(open_calibration(config.data, graph.inputs, SENSITIVITY_SAMPLES,
                                        calibration_batch_size(graph, profiles), config.preprocess_spec(),
                                        config.split_by, config.seed))
        source = f"validation set --data {config.data}"
    else:
        batches = joined(graph, first_samples(target.batches, SENSITIVITY_SAMPLES))
        source = f"held-out samples ({target.held_out['source']})"
    layers = float_layer_sensitivity(graph, weights, batches, device, set(candidates), precision)
    where = {"samples": sum(batch_sizes(batches)), "source": source,
             "seconds": round(time.perf_counter() - started, 3)}
    return layers, where


def plan_for_target(graph: Graph, weights: dict, plan: PrecisionPlan, amax: dict, calibration: dict | None,
                    config: BuildConfig, onnx_sha256: str, device: torch.device, profiles: list, log: list,
                    run_build: Callable[[BuildConfig], object]):
    """The builder's planner stage: (the precision plan that meets config.accuracy_budget,
    config.min_cosine or config.min_snr, the header's "planner" record). `plan` is the default plan
    of the build's reduced precision: quantized (INT8 or FP8; `calibration` the calibration stage's
    provenance record, None for a Q/DQ model) or float (FP16 or BF16; `calibration` None, `amax`
    empty), whose layers move to FP32. `run_build` builds one trial engine (the pipeline's build,
    passed in so that this stage does not import the pipeline that runs it)."""
    flag = config.planner_flag()
    reduced = config.precision
    quantized = reduced in QUANTIZED_PRECISIONS
    if reduced not in PLANNED_PRECISIONS:
        raise ConfigError(f"{flag} moves layers out of the build's reduced precision: it needs --precision "
                          f"{', '.join(PLANNED_PRECISIONS)}, not {reduced}")
    word = reduced.upper()
    if calibration is None and (quantized or any(p in QUANTIZED_PRECISIONS for p in plan.layers.values())):
        raise ConfigError(f"{flag}: the model is quantized with Q/DQ nodes, whose INT8 layers the planner does not "
                          f"move; keep layers out of INT8 with --layer-precision NODE=fp16")
    higher = base_precision(config, device) if quantized else "fp32"
    candidates = [name for name, p in plan.layers.items() if p == reduced and name not in plan.reasons]
    pinned = [name for name, p in plan.layers.items() if p == reduced and name in plan.reasons]
    # Built before the ranking, so that bad data fails now and not after it.
    if config.accuracy_budget is not None:
        target = _BudgetTarget(config, word)
    else:
        kind, value = (_CosineTarget, config.min_cosine) if config.min_cosine is not None else (_SnrTarget, config.min_snr)
        target = kind(value, graph, weights, config, profiles, calibration, device, log, word)

    def rank() -> tuple[list, dict]:
        if quantized:
            ranking, where = _ranking(graph, weights, amax, candidates, config, device, profiles, reduced)
        else:
            ranking, where = _float_ranking(graph, weights, candidates, target, config, device, profiles, reduced)
        log.append(f"planner: ranked {len(ranking)} {word} layer(s) on {where['samples']} samples of the "
                   f"{where['source']} in {where['seconds']:.1f} s; least robust: "
                   + ", ".join(f"{r.name} ({r.snr_db:.1f} dB)" for r in ranking[:3]))
        return ranking, where

    with tempfile.TemporaryDirectory(prefix="sartor-planner-") as tmp:
        trial_config = _trial_config(config, Path(tmp), amax, calibration, onnx_sha256)
        count = [0]

        def measure(kept_out: list[str]):
            started = time.perf_counter()
            path = Path(tmp) / f"trial{count[0]}.plan"
            pins = {exact_layer_pattern(name): higher for name in kept_out}
            run_build(replace(trial_config, output_path=str(path), layer_precision={**pins, **config.layer_precision}))
            trial = target.measure(path)
            path.unlink(missing_ok=True)
            trial.kept_out, trial.seconds = list(kept_out), time.perf_counter() - started
            log.append(f"planner: iteration {count[0]}: {len(kept_out)} layer(s) out of {word}: {target.verdict(trial)} "
                       f"({trial.seconds:.1f} s)")
            count[0] += 1
            return trial

        # The default plan first: where it meets the target, the ranking (one pass per layer) is not needed.
        default = measure([])
        ranking, where = (rank() if candidates and not default.holds(target.value) else
                          ([], {"skipped": "the default plan meets the target" if candidates else "no candidate"}))
        best, trials = search([r.name for r in ranking], measure, target.value, first=default)
    first = trials[0]
    if best is None:
        stuck = (f"; {len(pinned)} {word} layer(s) pinned by --layer-precision stay {word} ({', '.join(pinned[:3])}"
                 + (" …" if len(pinned) > 3 else "") + ")") if pinned else ""
        raise PlannerError(f"{flag} cannot be met: with all {len(ranking)} {word} layer(s) moved to {higher}, "
                           f"{target.unreachable(first, trials[-1])}{stuck}")
    updated = PrecisionPlan(dict(plan.layers), dict(plan.reasons))
    rank = {r.name: (k + 1, r.snr_db) for k, r in enumerate(ranking)}
    for name in best.kept_out:
        k, snr = rank[name]
        updated.layers[name] = higher
        updated.reasons[name] = f"planner: sensitivity rank {k}, SNR {snr:.1f} dB; {target.reason(first, best)}"
        log.append(f"layer {name} runs {higher}: {updated.reasons[name]}")
    goal, result = target.summary(best)
    log.append(f"planner: {len(best.kept_out)} of {len(candidates)} {word} layer(s) kept at {higher} {goal} after "
               f"{len(trials)} measurement(s): {result}")
    record = dict(target.record(first, best), reduced=reduced, precision=higher, sensitivity=where,
                  candidates=len(candidates),
                  ranking=[{"name": r.name, "snr_db": _finite(r.snr_db)} for r in ranking],
                  iterations=[t.to_json(target.value) for t in trials], kept_out=list(best.kept_out))
    if quantized:  # the key older readers know
        record["quantized"] = reduced
    return updated, record
