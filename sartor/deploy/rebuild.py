"""`sartor rebuild BUNDLE -o OUT`: the engine a bundle describes, built again on this machine.

1. Every file is checked against the manifest (a modified bundle is refused in one line).
2. The stored options become a BuildConfig over copies of the bundle's model and caches (the
   bundle itself is never written), and the build records the bundle's build time and path
   labels, as `sartor build --bundle` did.
3. Same machine (this device's fingerprint is the bundle's and its timing cache holds entries for
   it): nothing is timed and the engine must be the bundle's byte for byte; when it is not, the
   header fields that differ are named.
4. Another toolkit or device: the timing cache does not apply, so tactics are timed again; the
   new engine is then judged on the golden inputs against the stored engine's outputs (and the
   FP32 reference's).
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from ..builder import BuildResult, build
from ..builder.pipeline import Reproducible
from ..runtime.engine import load
from ..runtime.engine_file import (
    check_writable,
    read_engine_file,
    termination_cleans_up,
)
from ..runtime.fingerprint import describe, device_fingerprint, parse_device
from ..tactics.timing_cache import TimingCache, fingerprint_digest
from .accuracy import DEFAULT_MAX_DROP, AccuracyDrop, accuracy_drop
from .archive import extracted, is_archive
from .bundle import (
    CALIB_CACHE,
    ENGINE,
    ENGINE_HEADER,
    GOLDEN,
    MODEL,
    OPTIONS,
    TIMING_CACHE,
    config_from_options,
    labels,
)
from .golden import (
    DEFAULT_MIN_COSINE,
    OutputAgreement,
    agreement,
    engine_outputs,
    read_npz,
)
from .manifest import BundleError, file_sha256, verify_bundle


@dataclass
class RebuildReport:
    bundle: str
    output: str
    same_machine: bool  # this fingerprint is the bundle's and its timing cache covers it
    why_retimed: str | None  # what differs, when not the same machine
    sha256: str
    bundle_sha256: str
    identical: bool
    differing_fields: list = field(default_factory=list)  # header fields that differ, when not identical
    timed: int = 0  # layers timed (0 when everything came from the timing cache)
    agreement: list[OutputAgreement] = field(default_factory=list)
    min_cosine: float = DEFAULT_MIN_COSINE
    golden_inputs: str = ""
    accuracy: AccuracyDrop | None = None  # on the bundle's labelled validation data, when it has some
    build: BuildResult | None = None

    @property
    def agreement_passed(self) -> bool:
        return all(row.passed for row in self.agreement)

    @property
    def passed(self) -> bool:
        """The golden outputs (and the validation metric) within tolerance, and on the same machine
        the same bytes too."""
        return (self.agreement_passed and (self.accuracy is None or self.accuracy.passed)
                and (self.identical or not self.same_machine))

    def to_json(self) -> dict:
        return {"bundle": self.bundle, "output": self.output, "same_machine": self.same_machine,
                "why_retimed": self.why_retimed, "sha256": self.sha256, "bundle_sha256": self.bundle_sha256,
                "identical": self.identical, "differing_fields": self.differing_fields, "timed": self.timed,
                "min_cosine": self.min_cosine, "golden_inputs": self.golden_inputs,
                "agreement": [row.to_json() for row in self.agreement],
                "accuracy": None if self.accuracy is None else self.accuracy.to_json(), "passed": self.passed}


def _read_json(root: Path, name: str) -> dict:
    try:
        data = json.loads((root / name).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise BundleError(f"bundle {root}: {name} is not readable JSON ({type(exc).__name__})") from None
    if not isinstance(data, dict):
        raise BundleError(f"bundle {root}: {name} is malformed (not an object)")
    return data


def _why_retimed(stored: dict, here: dict, cache: TimingCache, cached_layers: int) -> str | None:
    """None when this machine is the bundle's and the timing cache covers it (for the
    `cached_layers` the bundle's engine took from it), else what differs."""
    differing = sorted(k for k in set(stored) | set(here) if stored.get(k) != here.get(k))
    if differing:
        return f"this machine [{describe(here)}] differs from the bundle's in {', '.join(differing)}"
    slot = cache.devices.get(fingerprint_digest(here))
    if cached_layers and (slot is None or not slot["entries"]):
        return "the bundle's timing cache holds no timings for this machine's fingerprint"
    return None


def _differing_fields(before: dict, after: dict, prefix: str = "") -> list[str]:
    """The header keys (one level into provenance, build_config and tactics) whose values differ."""
    found = []
    for key in sorted(set(before) | set(after)):
        a, b = before.get(key), after.get(key)
        if a == b:
            continue
        if isinstance(a, dict) and isinstance(b, dict) and not prefix and key in ("provenance", "build_config",
                                                                                 "tactics", "fingerprint"):
            found += _differing_fields(a, b, f"{key}.")
        else:
            found.append(prefix + key)
    return found


def rebuild(bundle_dir: str | os.PathLike, output: str | os.PathLike, device: str | None = None,
            min_cosine: float = DEFAULT_MIN_COSINE, max_drop: float = DEFAULT_MAX_DROP, progress=None,
            warn=None) -> RebuildReport:
    """Rebuild the bundle's engine (a bundle directory, or its .tar) into `output` on this machine
    and say how it compares."""
    root = Path(bundle_dir)
    if not is_archive(root):
        return _rebuild(root, output, device, min_cosine, max_drop, progress, warn)
    check_writable(output)  # before extracting beside it
    with termination_cleans_up(), extracted(root, Path(os.path.dirname(os.path.abspath(output)))) as directory:
        try:
            report = _rebuild(directory, output, device, min_cosine, max_drop, progress, warn)
        except BundleError as exc:  # named by the file the user gave, not the temporary directory
            raise BundleError(str(exc).replace(str(directory), str(root))) from None
    report.bundle = str(root)
    return report


def _rebuild(root: Path, output, device, min_cosine, max_drop, progress, warn) -> RebuildReport:
    verify_bundle(root)
    options = _read_json(root, OPTIONS).get("options")
    engine_record = _read_json(root, ENGINE)
    stored_fingerprint = _read_json(root, "fingerprint.json")
    if not isinstance(options, dict) or not isinstance(engine_record.get("sha256"), str) \
            or not isinstance(engine_record.get("built_at"), str):
        raise BundleError(f"bundle {root}: {OPTIONS} or {ENGINE} is malformed")
    output = os.path.abspath(output)
    if Path(output).resolve().is_relative_to(root.resolve()):
        raise BundleError(f"output {output} is inside the bundle {root}: write the rebuilt engine elsewhere")
    check_writable(output)
    target = parse_device(device or options.get("device"))  # the builder's default when both are None
    here = device_fingerprint(target)
    stored_header = _read_json(root, ENGINE_HEADER)
    cached_layers = (stored_header.get("tactics") or {}).get("from_timing_cache", 0)
    why = _why_retimed(stored_fingerprint, here, TimingCache(root / TIMING_CACHE), cached_layers)
    # The bundle stays as it is: the build reads (and may add timings to) copies of its files.
    with termination_cleans_up():
        work = Path(os.path.abspath(tempfile.mkdtemp(prefix=".sartor-rebuild.", suffix=".tmp",
                                                     dir=os.path.dirname(output))))
        try:
            for name in (MODEL, CALIB_CACHE, TIMING_CACHE):
                if (root / name).is_file():
                    shutil.copyfile(root / name, work / name)
            config = config_from_options(dict(options, device=device or options.get("device")), work, output)
            result = build(config, progress, warn, Reproducible(engine_record["built_at"], labels(work, output)))
        finally:
            shutil.rmtree(work, ignore_errors=True)
    sha = file_sha256(Path(output))
    identical = sha == engine_record["sha256"]
    differing = []
    if not identical:
        header, _ = read_engine_file(output)
        differing = _differing_fields(stored_header, header) or ["weights or embedded kernels"]
    report = RebuildReport(str(root), output, why is None, why, sha, engine_record["sha256"], identical, differing,
                           result.header["tactics"].get("timed", 0), min_cosine=min_cosine, build=result)
    engine = load(output, device=str(target))
    _judge_golden(report, root, engine)
    report.accuracy = accuracy_drop(root, engine, root / MODEL, max_drop)
    return report


def _judge_golden(report: RebuildReport, root: Path, engine) -> None:
    golden = root / GOLDEN
    feeds = read_npz(golden / "inputs.npz")
    stored = read_npz(golden / "engine_outputs.npz")
    reference_path = golden / "reference_outputs.npz"
    reference = read_npz(reference_path) if reference_path.is_file() else None
    report.agreement = agreement(stored, engine_outputs(engine, feeds), reference, report.min_cosine)
    report.golden_inputs = str(_read_json(golden, "golden.json").get("inputs", ""))
