"""Compare an engine's outputs with ONNX Runtime's FP32 reference on the same inputs.

`compare_outputs` is the metric itself (reference vs candidate arrays, per output);
`compare_with_onnxruntime` feeds one set of inputs to both and compares them. The CLI only
formats what these return.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from ..errors import InputError, ModelLoadError
from ..runtime.sample_inputs import random_inputs

if TYPE_CHECKING:
    from ..runtime.engine import Engine


@dataclass
class OutputComparison:
    name: str
    shape: tuple
    dtype: str
    max_abs: float  # max |ref - out|
    max_rel: float  # max |ref - out| / max |ref|
    max_ref: float  # max |ref|
    cosine: float  # cosine similarity of the flattened outputs
    argmax_agreement: float | None  # fraction of rows whose argmax over the last axis agree (rank >= 2)
    tolerance: float  # atol + rtol * max |ref|: the bound max_abs must not exceed
    passed: bool
    note: str = ""

    def to_json(self) -> dict:
        data = asdict(self)
        data["shape"] = list(self.shape)
        return {k: _finite_or_text(v) for k, v in data.items()}


@dataclass
class ComparisonReport:
    outputs: list  # OutputComparison, in the engine's output order
    inputs: dict  # input name -> shape used
    rtol: float
    atol: float
    random_inputs: bool
    seed: int | None = None
    extra: dict = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return all(o.passed for o in self.outputs)

    def to_json(self) -> dict:
        return {"passed": self.passed, "rtol": self.rtol, "atol": self.atol,
                "inputs": {k: list(v) for k, v in self.inputs.items()}, "random_inputs": self.random_inputs,
                "seed": self.seed, "outputs": [o.to_json() for o in self.outputs], **self.extra}


def _finite_or_text(value):
    """JSON has no inf/nan: write them as strings."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


def compare_output(name: str, reference: np.ndarray, candidate: np.ndarray, rtol: float = 1e-4,
                   atol: float = 1e-5) -> OutputComparison:
    ref = np.asarray(reference)
    out = np.asarray(candidate)
    shape = tuple(int(d) for d in ref.shape)
    if ref.shape != out.shape:
        return OutputComparison(name, shape, str(out.dtype), math.inf, math.inf, math.nan, math.nan, None, math.nan,
                                False, f"shape {'x'.join(map(str, out.shape))} differs from the reference's "
                                       f"{'x'.join(map(str, shape))}")
    a = ref.astype(np.float64)
    b = out.astype(np.float64)
    both_nan = np.isnan(a) & np.isnan(b)
    same_inf = np.isinf(a) & (a == b)
    diff = np.abs(a - b)
    diff[both_nan | same_inf] = 0.0
    diff[np.isnan(diff)] = math.inf  # NaN on one side only
    max_abs = float(diff.max()) if diff.size else 0.0
    finite_ref = np.abs(a[np.isfinite(a)])
    max_ref = float(finite_ref.max()) if finite_ref.size else 0.0
    if max_ref > 0:
        max_rel = max_abs / max_ref
    else:
        max_rel = 0.0 if max_abs == 0 else math.inf
    cosine = _cosine(a, b)
    agreement = None
    if ref.ndim >= 2 and ref.shape[-1] > 0 and ref.size:
        agreement = float(np.mean(np.argmax(a, axis=-1) == np.argmax(b, axis=-1)))
    tolerance = atol + rtol * max_ref
    passed = bool(max_abs <= tolerance)
    return OutputComparison(name, shape, str(out.dtype), max_abs, max_rel, max_ref, cosine, agreement, tolerance,
                            passed)


def _cosine(a: np.ndarray, b: np.ndarray) -> float:
    a, b = a.ravel(), b.ravel()
    if not (np.all(np.isfinite(a)) and np.all(np.isfinite(b))):
        return math.nan
    na, nb = float(np.linalg.norm(a)), float(np.linalg.norm(b))
    if na == 0 and nb == 0:
        return 1.0
    if na == 0 or nb == 0:
        return 0.0
    return float(np.dot(a, b) / (na * nb))


def compare_outputs(reference: dict, candidate: dict, rtol: float = 1e-4, atol: float = 1e-5) -> list:
    """Per output of `reference` (name -> array), its comparison with `candidate`'s output."""
    missing = [name for name in reference if name not in candidate]
    if missing:
        raise InputError(f"output(s) {', '.join(missing)} of the reference are missing from the compared outputs")
    return [compare_output(name, reference[name], candidate[name], rtol, atol) for name in reference]


def onnxruntime_outputs(model_path: str | Path, feeds: dict) -> dict:
    """Run the ONNX model with ONNX Runtime's FP32 CPU provider."""
    from ..extras import require_extra
    require_extra("build", "the ONNX Runtime FP32 reference", ("onnxruntime",))
    import onnxruntime as ort
    model_path = Path(model_path)
    if not model_path.is_file():
        raise ModelLoadError(f"model file not found: {model_path}")
    options = ort.SessionOptions()
    options.log_severity_level = 3
    try:
        session = ort.InferenceSession(str(model_path), options, providers=["CPUExecutionProvider"])
    except Exception as exc:
        raise ModelLoadError(f"ONNX Runtime cannot load {model_path}: {first_error_line(exc)}") from None
    expected = [i.name for i in session.get_inputs()]
    if sorted(expected) != sorted(feeds):
        raise InputError(f"the model's inputs ({', '.join(expected)}) are not the engine's ({', '.join(feeds)}): "
                         f"was the engine built from this model?")
    names = [o.name for o in session.get_outputs()]
    try:
        values = session.run(names, {k: np.ascontiguousarray(v) for k, v in feeds.items()})
    except Exception as exc:
        raise InputError(f"ONNX Runtime cannot run {model_path} on these inputs: {first_error_line(exc)}") from None
    return dict(zip(names, values))


def first_error_line(exc: Exception) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def compare_with_onnxruntime(model_path: str | Path, engine: "Engine", feeds: dict | None = None,
                             batch: int | None = None, seed: int = 0, rtol: float = 1e-4, atol: float = 1e-5,
                             profile: int | None = None) -> ComparisonReport:
    """Run `feeds` (completed with seeded random inputs for the inputs not given) through ONNX
    Runtime FP32 and the engine, and compare every engine output with the reference."""
    if getattr(engine, "nms", None) is not None:
        raise InputError(f"the engine runs NMS itself (built with --nms): its outputs (kept boxes) have no counterpart "
                         f"in {model_path}; compare an engine built without --nms, or measure this one with "
                         f"`sartor validate`")
    given = dict(feeds or {})
    unknown = sorted(set(given) - {v.name for v in engine.inputs})
    if unknown:
        raise InputError(f"unknown input name(s) {', '.join(unknown)}; the engine's inputs are "
                         f"{', '.join(v.name for v in engine.inputs)}")
    generated = random_inputs(engine, batch, seed)
    all_feeds = {name: given.get(name, generated[name]) for name in generated}
    all_feeds = {name: np.asarray(v) for name, v in all_feeds.items()}
    candidate = engine.context(profile).run(all_feeds)
    reference = onnxruntime_outputs(model_path, all_feeds)
    missing = [name for name in candidate if name not in reference]
    if missing:
        raise InputError(f"engine output(s) {', '.join(missing)} are not outputs of {model_path}: "
                         f"was the engine built from this model?")
    ordered = {name: reference[name] for name in candidate}
    outputs = compare_outputs(ordered, candidate, rtol, atol)
    return ComparisonReport(outputs, {k: tuple(v.shape) for k, v in all_feeds.items()}, rtol, atol,
                            random_inputs=len(given) < len(all_feeds), seed=seed if len(given) < len(all_feeds) else None)
