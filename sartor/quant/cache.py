"""The calibration cache: a readable JSON file of per-tensor thresholds, so that a rebuild (another
device, other precision overrides) skips calibration and gets the same INT8 scales bit for bit.

    {"format": "sartor-calib-1", "onnx_sha256": ..., "preprocess": ..., "method": ...,
     "percentile": ..., "calib_sha256": ..., "calib_size": N,
     "amax": {tensor: float}, "amax_hex": {tensor: float.hex()},
     "splits": {attribute: {value: images}},   # optional: the sample's per-split counts
     "methods": {tensor: method},   # the method each threshold came from (auto mixes them)
     "auto": {"chosen": ..., "errors": {plan: output error}, ...},   # --calib-method auto's record
     "bias_correction": {format: {layer: {"input_scale_hex": ..., "correction_hex": [...], ...}}}}

`amax` is for people; `amax_hex` is what is read (exact whatever the JSON reader), and the two
must agree. `bias_correction` (optional, written by builds with bias correction: see
`bias_correction.py`) holds each corrected layer's per-channel correction, keyed by format, layer
and input scale, so that a build from the cache alone gets the same biases. `splits` (image
datasets only) lets a build from the cache still record and check which conditions calibration
saw. `methods` (absent in older caches: every tensor then took `method`) and `auto` say how
`--calib-method auto` chose. A cache made for another ONNX model (by SHA-256) or another --preprocess is refused.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import SartorError
from ..runtime.engine_file import write_atomic
from .calibrators import METHODS

FORMAT = "sartor-calib-1"


class CalibrationCacheError(SartorError):
    """The calibration cache file is unreadable or malformed."""


class StaleCalibrationCacheError(CalibrationCacheError):
    """The calibration cache was made for another model or another preprocessing."""


@dataclass
class CalibrationCache:
    onnx_sha256: str
    method: str
    calib_sha256: str
    calib_size: int
    amax: dict = field(default_factory=dict)  # tensor name -> float
    preprocess: object = None
    percentile: float | None = None
    splits: dict = field(default_factory=dict)  # attribute -> {value: images in the calibration sample}
    bias_correction: dict = field(default_factory=dict)  # format -> {layer: entry} (bias_correction.corrections_to_json)
    methods: dict = field(default_factory=dict)  # tensor -> the method its threshold came from
    auto: dict = field(default_factory=dict)  # --calib-method auto: what it compared and chose

    def tensor_methods(self) -> dict:
        """tensor -> method: as recorded, else (older caches, single methods) `method` for each."""
        return dict(self.methods) if self.methods else dict.fromkeys(sorted(self.amax), self.method)

    def to_json(self) -> dict:
        amax = {name: float(value) for name, value in sorted(self.amax.items())}
        data = {"format": FORMAT, "onnx_sha256": self.onnx_sha256, "preprocess": self.preprocess,
                "method": self.method, "percentile": self.percentile, "calib_sha256": self.calib_sha256,
                "calib_size": int(self.calib_size), "amax": amax,
                "amax_hex": {name: value.hex() for name, value in amax.items()}}
        if self.splits:
            data["splits"] = {str(a): {str(v): int(n) for v, n in counts.items()} for a, counts in self.splits.items()}
        if self.bias_correction:
            data["bias_correction"] = self.bias_correction
        if self.methods:
            data["methods"] = {str(name): str(m) for name, m in sorted(self.methods.items())}
        if self.auto:
            data["auto"] = self.auto
        return data

    @classmethod
    def from_json(cls, data: dict, where: str = "calibration cache") -> CalibrationCache:
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            found = data.get("format") if isinstance(data, dict) else type(data).__name__
            raise CalibrationCacheError(f"{where} is not a sartor calibration cache (format {found!r}, "
                                        f"expected {FORMAT!r})")
        try:
            decimal = {str(k): float(v) for k, v in data["amax"].items()}
            exact = {str(k): float.fromhex(v) for k, v in data.get("amax_hex", {}).items()}
            onnx_sha, method = str(data["onnx_sha256"]), str(data["method"])
            calib_sha, size = str(data["calib_sha256"]), int(data["calib_size"])
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise CalibrationCacheError(f"{where} is malformed ({type(exc).__name__}: {exc})") from None
        for name, value in exact.items():
            if name in decimal and decimal[name] != value:
                raise CalibrationCacheError(f"{where}: amax of {name!r} is {decimal[name]!r} but amax_hex says "
                                            f"{value!r}; edit both (or drop amax_hex)")
        amax = dict(decimal, **exact)
        bad = [name for name, value in amax.items() if not (math.isfinite(value) and value >= 0)]
        if bad:
            raise CalibrationCacheError(f"{where}: amax of {bad[0]!r} is {amax[bad[0]]!r}, not a finite value ≥ 0")
        percentile = data.get("percentile")
        splits = data.get("splits") or {}
        try:
            splits = {str(a): {str(v): int(n) for v, n in counts.items()} for a, counts in splits.items()}
        except (TypeError, ValueError, AttributeError):
            raise CalibrationCacheError(f"{where}: \"splits\" must map attribute → {{value: images}}") from None
        corrections = data.get("bias_correction") or {}
        if not isinstance(corrections, dict) or not all(isinstance(v, dict) for v in corrections.values()):
            raise CalibrationCacheError(f"{where}: \"bias_correction\" must map format → {{layer: entry}}")
        methods = data.get("methods") or {}
        if not isinstance(methods, dict) or any(m not in METHODS for m in methods.values()):
            bad = next((m for m in methods.values() if m not in METHODS), methods) if isinstance(methods, dict) else methods
            raise CalibrationCacheError(f"{where}: \"methods\" must map tensor → one of {', '.join(METHODS)} "
                                        f"(found {bad!r})")
        unknown = sorted(set(methods) - set(amax))
        if unknown:
            raise CalibrationCacheError(f"{where}: \"methods\" names {unknown[0]!r}, which has no amax")
        auto = data.get("auto") or {}
        if not isinstance(auto, dict):
            raise CalibrationCacheError(f"{where}: \"auto\" must be an object")
        return cls(onnx_sha, method, calib_sha, size, amax, data.get("preprocess"),
                   None if percentile is None else float(percentile), splits, corrections,
                   {str(k): str(v) for k, v in methods.items()}, auto)


def write_cache(path: str | Path, cache: CalibrationCache) -> None:
    write_atomic(path, (json.dumps(cache.to_json(), indent=1) + "\n").encode("utf-8"))


def read_cache(path: str | Path, onnx_sha256: str | None = None, preprocess: object = None,
               check_preprocess: bool = False) -> CalibrationCache:
    """Read a cache; with `onnx_sha256`, refuse one made for another model (and, with
    `check_preprocess`, for another preprocessing)."""
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CalibrationCacheError(f"calibration cache {path} not found") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CalibrationCacheError(f"calibration cache {path} is not readable JSON ({type(exc).__name__})") from None
    cache = CalibrationCache.from_json(data, f"calibration cache {path}")
    if onnx_sha256 is not None and cache.onnx_sha256 != onnx_sha256:
        raise StaleCalibrationCacheError(
            f"stale calibration cache: {path} was built for ONNX sha256 {cache.onnx_sha256[:12]}… but the model is "
            f"{onnx_sha256[:12]}…: delete it (or give another --calib-cache) to recalibrate")
    if check_preprocess and cache.preprocess != preprocess:
        raise StaleCalibrationCacheError(
            f"stale calibration cache: {path} was calibrated with --preprocess {cache.preprocess!r} but this build "
            f"uses {preprocess!r}: delete it (or give another --calib-cache) to recalibrate")
    return cache
