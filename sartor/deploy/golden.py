"""Golden inputs and outputs: a few real inputs (the first calibration samples, else seeded random
ones at profile 0's opt shape), the engine's outputs on them and the FP32 reference's (ONNX
Runtime). A rebuilt engine is judged by its agreement with both."""
from __future__ import annotations

import math
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import SartorError
from ..quant.data import open_calibration
from ..runtime.engine import Engine
from ..runtime.sample_inputs import random_inputs
from ..validate.compare import compare_output, onnxruntime_outputs
from .manifest import BundleError

# A rebuilt engine agrees with the stored one when every output's cosine against the stored
# engine's outputs reaches this (INT8 engines built with other kernels round differently in a few
# codes; a wrong kernel or scale falls far below it).
DEFAULT_MIN_COSINE = 0.999


def _opt_batch(engine: Engine) -> int:
    opt = engine.profiles[0].opt_shapes()
    first = next((shape for shape in opt.values() if shape), None)
    return int(first[0]) if first else 1


def golden_inputs(engine: Engine, calib: str | None, preprocess, seed: int) -> tuple[dict, str]:
    """({input name: array}, where they came from): the first calibration samples (as many as
    profile 0's opt batch) when `calib` is given and they fit the engine, else seeded random inputs."""
    if calib:
        try:
            samples = open_calibration(calib, engine.inputs, _opt_batch(engine), _opt_batch(engine), preprocess,
                                       None, seed)
            batch = next(iter(samples))
            context = engine.context()
            context.select_profile(context.check_inputs(batch))
            return {name: np.ascontiguousarray(value) for name, value in batch.items()}, f"calibration data {calib}"
        except (SartorError, StopIteration):
            pass  # samples that do not fit profile 0 (or none): seeded inputs say as much
    return random_inputs(engine, seed=seed), f"seeded random inputs (seed {seed}) at profile 0's opt shape"


def engine_outputs(engine: Engine, feeds: dict) -> dict:
    outputs = engine.context().run(feeds)
    return {name: np.asarray(value) for name, value in outputs.items()}


def reference_outputs(model_path: str | Path, feeds: dict) -> tuple[dict | None, str]:
    """The FP32 reference's outputs (ONNX Runtime), or None and why not."""
    try:
        return onnxruntime_outputs(model_path, feeds), "onnxruntime (FP32, CPU)"
    except SartorError as exc:
        return None, f"none: {exc}"




def read_npz(path: Path) -> dict:
    """The arrays of a bundle's .npz (never pickled objects); a missing or broken file is a BundleError."""
    try:
        with np.load(path, allow_pickle=False) as archive:
            return {name: archive[name] for name in archive.files}
    except (OSError, ValueError, zipfile.BadZipFile) as exc:
        raise BundleError(f"bundle file {path} is not a readable .npz of arrays ({type(exc).__name__})") from None


@dataclass
class OutputAgreement:
    name: str
    max_abs: float  # against the stored engine's output
    cosine: float
    reference_max_abs: float | None  # against the FP32 reference (None: the bundle has none)
    reference_cosine: float | None
    stored_reference_cosine: float | None  # the stored engine's cosine against the same reference
    passed: bool

    def to_json(self) -> dict:
        def clean(v):
            return str(v) if isinstance(v, float) and not math.isfinite(v) else v
        return {key: clean(value) for key, value in self.__dict__.items()}


def agreement(stored: dict, rebuilt: dict, reference: dict | None, min_cosine: float) -> list[OutputAgreement]:
    """Per output of the stored engine: the rebuilt engine's agreement with it and with the FP32
    reference. An output passes when its cosine against the stored one reaches `min_cosine`."""
    rows = []
    for name, before in stored.items():
        if name not in rebuilt:
            rows.append(OutputAgreement(name, math.inf, math.nan, None, None, None, False))
            continue
        against_stored = compare_output(name, before, rebuilt[name])
        ref_row = stored_ref = None
        if reference is not None and name in reference:
            ref_row = compare_output(name, reference[name], rebuilt[name])
            stored_ref = compare_output(name, reference[name], before).cosine
        cosine = against_stored.cosine
        rows.append(OutputAgreement(name, against_stored.max_abs, cosine,
                                    None if ref_row is None else ref_row.max_abs,
                                    None if ref_row is None else ref_row.cosine, stored_ref,
                                    bool(math.isfinite(cosine) and cosine >= min_cosine)))
    return rows
