"""Preflight: what a release must pass on the device before `current` may name it.

In order, stopping at the first failure:

1. bundle    (deployed from a bundle) every file against its manifest, and the engine is the one the
             bundle describes (its SHA-256, with or without a signature block added after the build)
2. signature with a trust store: signed by one of its keys (without one: the checksum only, said so)
3. fingerprint  the engine's fingerprint against this device at the compatibility level
4. load      `sartor.load` on the device (checksum, kernels into the engine's private cache)
5. warm-up   every profile at its min, opt and max shapes (what `sartor serve` runs before ready)
6. golden    bundle: the golden inputs' outputs against the bundle's stored ones (cosine at least
             `min_cosine` per output). Bare engine: no reference exists, so seeded inputs at each
             profile's opt shape must give finite outputs, the same on a second run
7. takt      steady-state time per inference at profile 0's opt shape (median of `takt_runs` runs
             after warm-up, with and without host copies), measured and recorded, not judged
"""
from __future__ import annotations

import hashlib
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from ..errors import SartorError
from ..runtime.benchmark import benchmark
from ..runtime.engine import load
from ..runtime.engine_file import read_engine
from ..runtime.engine_signature import (
    SIGNATURE_BLOCK_BYTES,
    SIGNATURE_MAGIC,
    trust_store,
)
from ..runtime.fingerprint import (
    compare_fingerprints,
    compatibility_level,
    describe,
    device_fingerprint,
    parse_device,
)
from ..runtime.sample_inputs import random_inputs
from .golden import DEFAULT_MIN_COSINE, agreement, engine_outputs, read_npz
from .manifest import ENGINE, GOLDEN, verify_bundle
from .releases import read_json

DEFAULT_TAKT_RUNS = 20


@dataclass
class Check:
    name: str
    passed: bool
    detail: str
    seconds: float = 0.0


@dataclass
class PreflightReport:
    engine: str
    checks: list[Check] = field(default_factory=list)
    takt: dict | None = None  # {"profile": k, "shapes": ..., "p50_ms", "p90_ms", "with_copies_p50_ms"}
    fingerprint: dict | None = None  # the engine's
    device: str = ""
    seconds: float = 0.0

    @property
    def passed(self) -> bool:
        return bool(self.checks) and all(c.passed for c in self.checks)

    @property
    def failure(self) -> Check | None:
        return next((c for c in self.checks if not c.passed), None)

    def to_json(self) -> dict:
        return {"engine": self.engine, "passed": self.passed, "device": self.device, "seconds": round(self.seconds, 3),
                "fingerprint": self.fingerprint, "takt": self.takt, "checks": [asdict(c) for c in self.checks]}


def _unsigned_sha256(data: bytes) -> str | None:
    """The SHA-256 of the engine without its signature block, when it carries one (`sartor sign`
    after `build --bundle` adds one: the payload the bundle describes is unchanged)."""
    if len(data) > SIGNATURE_BLOCK_BYTES and data[-SIGNATURE_BLOCK_BYTES:].startswith(SIGNATURE_MAGIC):
        return hashlib.sha256(data[:-SIGNATURE_BLOCK_BYTES]).hexdigest()
    return None


def _check_bundle(engine_path: Path, bundle: Path) -> str:
    verify_bundle(bundle)
    record = read_json(bundle / ENGINE) or {}
    data = engine_path.read_bytes()
    digests = {hashlib.sha256(data).hexdigest(), _unsigned_sha256(data)}
    if record.get("sha256") not in digests:
        raise SartorError(f"engine {engine_path} is not the engine bundle {bundle} describes (SHA-256 "
                          f"{str(record.get('sha256'))[:16]}…)")
    return f"{len(read_json(bundle / 'manifest.json')['files'])} files match the manifest; the engine is the bundle's"


def _golden_bundle(engine, bundle: Path, min_cosine: float) -> tuple[bool, str]:
    feeds = read_npz(bundle / GOLDEN / "inputs.npz")
    stored = read_npz(bundle / GOLDEN / "engine_outputs.npz")
    rows = agreement(stored, engine_outputs(engine, feeds), None, min_cosine)
    described = ", ".join(f"{r.name} cosine {r.cosine:.6f} max abs {r.max_abs:.3g}" for r in rows)
    failed = [r.name for r in rows if not r.passed]
    if failed:
        return False, (f"golden outputs {', '.join(failed)} disagree with the bundle's (cosine below {min_cosine:g}): "
                       f"{described}")
    return True, f"{len(rows)} golden output(s) within cosine {min_cosine:g} of the bundle's: {described}"


def _golden_bare(engine) -> tuple[bool, str]:
    for k, profile in enumerate(engine.profiles):
        feeds = random_inputs(engine, seed=k, shapes=profile.opt_shapes())
        context = engine.context()
        first, second = engine_outputs(engine, feeds), {n: np.asarray(v) for n, v in context.run(feeds).items()}
        for name, value in first.items():
            if np.issubdtype(value.dtype, np.floating) and not np.isfinite(value).all():
                return False, f"profile {k}: output {name} is not finite on seeded inputs at the opt shape"
            if not np.array_equal(value, second[name], equal_nan=True):
                return False, f"profile {k}: output {name} differs between two runs of the same inputs"
    return True, (f"no bundle, so no reference outputs: {len(engine.profiles)} profile(s) at their opt shape give "
                  f"finite outputs, the same on a second run")


def preflight(engine_path: str | Path, bundle: Path | None = None, device: str | None = None, trust=None,
              compatibility: str | None = None, min_cosine: float = DEFAULT_MIN_COSINE,
              takt_runs: int = DEFAULT_TAKT_RUNS) -> PreflightReport:
    """Run the checks of the module docstring; a failed check ends the preflight (report.failure)."""
    engine_path = Path(engine_path)
    report = PreflightReport(str(engine_path))
    started = time.perf_counter()
    store = trust_store(trust)
    level = compatibility_level(compatibility)
    state: dict = {}

    def step(name: str, work) -> bool:
        began = time.perf_counter()
        try:
            passed, detail = work()
        except SartorError as exc:
            passed, detail = False, str(exc)
        report.checks.append(Check(name, passed, detail, round(time.perf_counter() - began, 3)))
        return passed

    def signature():
        engine_file = read_engine(engine_path, store)
        state["fingerprint"] = report.fingerprint = engine_file.header.get("fingerprint")
        if store is None:
            signer = engine_file.signature.fingerprint if engine_file.signature else "unsigned"
            return True, f"no trust store: checksum only ({signer})"
        return True, f"signed by {engine_file.signature.fingerprint}, a key of the trust store"

    def fingerprint():
        built_for = state["fingerprint"]
        if not isinstance(built_for, dict):
            return False, f"{engine_path} has no device fingerprint in its header"
        here = device_fingerprint(parse_device(device or ("cuda" if built_for.get("kind") == "cuda" else "cpu")))
        result = compare_fingerprints(built_for, here, level)
        if not result.loads:
            return False, (f"built for [{describe(built_for)}] but this machine is [{describe(here)}] (differs in "
                           f"{', '.join(result.refused)}, which must match at compatibility '{level}')")
        warned = f"; differs in {result.differences(result.warned)} (allowed at '{level}')" if result.warned else ""
        return True, f"[{describe(here)}] at compatibility '{level}'{warned}"

    def loading():
        state["engine"] = engine = load(engine_path, device=device, trust=store, compatibility=level)
        report.device = str(engine.device)
        return True, f"loaded on {engine.device}"

    def warm_up():
        state["engine"].context().warmup()
        shapes = sum(3 for _ in state["engine"].profiles)
        return True, f"{len(state['engine'].profiles)} profile(s) at min, opt and max ({shapes} runs)"

    def golden():
        engine = state["engine"]
        return _golden_bundle(engine, bundle, min_cosine) if bundle is not None else _golden_bare(engine)

    def takt():
        result = benchmark(state["engine"], iterations=takt_runs, warmup=3)
        report.takt = {"profile": result.profile, "shapes": {k: list(v) for k, v in result.shapes.items()},
                       "batch": result.batch, "runs": takt_runs, "p50_ms": round(result.device_only.p50_ms, 4),
                       "p90_ms": round(result.device_only.p90_ms, 4),
                       "with_copies_p50_ms": round(result.with_copies.p50_ms, 4)}
        ok = math.isfinite(result.device_only.p50_ms)
        return ok, (f"{report.takt['p50_ms']:.3f} ms per inference at batch {result.batch} (p90 "
                    f"{report.takt['p90_ms']:.3f} ms; with host copies {report.takt['with_copies_p50_ms']:.3f} ms)")

    steps = ([("bundle", lambda: (True, _check_bundle(engine_path, bundle)))] if bundle is not None else [])
    steps += [("signature", signature), ("fingerprint", fingerprint), ("load", loading), ("warm-up", warm_up),
              ("golden", golden), ("takt", takt)]
    for name, work in steps:
        if not step(name, work):
            break
    report.seconds = time.perf_counter() - started
    return report
