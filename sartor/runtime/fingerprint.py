"""What an engine is locked to: the device model and the toolkit that chose its kernels, and the
compatibility levels that say which differences refuse a load and which only warn
([0022](../../docs/decisions/0022-fingerprint-policy-and-memory-budgets.md)).

    strict   every field equal (what every load required before the levels existed)
    default  refused: another device kind, CPU architecture, GPU model or compute capability, CUDA
             major.minor, Triton version (the embedded cubins), torch or sartor major.minor;
             warned: driver, CPU model name, torch and sartor patch or local build suffix
    loose    refused: another device kind, CPU architecture or compute capability (code that cannot
             run); warned: everything else

A CPU engine compares torch without its local build suffix at every level: torch 2.14.1+cpu and
2.14.1+cu130 are one source and one set of CPU kernels, so an engine built for the CPU in either
loads in the other, as it would on the machine that built it
([0035](../../docs/decisions/0035-installs-that-fit.md)). A CUDA engine still needs a CUDA build.

The level is `load(..., compatibility=)`, else $SARTOR_FINGERPRINT, else "default".
"""
from __future__ import annotations

import logging
import os
import platform
import re
import subprocess
from dataclasses import dataclass
from functools import cache

import torch

from ..errors import ConfigError, DeviceError, FingerprintMismatchError
from ..version import __version__

log = logging.getLogger("sartor.runtime")
LEVELS = ("strict", "default", "loose")
ENVIRONMENT = "SARTOR_FINGERPRINT"
# Fields a difference in refuses at every level: the engine's code cannot run there.
ALWAYS_REFUSED = ("kind", "arch", "compute_capability")
# Fields that refuse at "default" when they differ as a whole; those in RELEASES compare only
# major.minor (a patch or a local build suffix such as +cu124 warns).
REFUSED_AT_DEFAULT = ("gpu", "triton")
RELEASES = ("cuda", "torch", "sartor")


def parse_device(spec: str | None) -> torch.device:
    spec = spec or ("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(spec)
    except RuntimeError:
        raise DeviceError(f"unknown device {spec!r}: use cpu or cuda[:N]") from None
    if device.type not in ("cpu", "cuda"):
        raise DeviceError(f"device {spec!r} is not supported: use cpu or cuda[:N]")
    if device.type == "cuda":
        if torch.version.cuda is None and getattr(torch.version, "hip", None) is None:
            raise DeviceError(f"device {spec!r} requested but this torch ({torch.__version__}) is a CPU-only build: "
                              f"CUDA engines need a CUDA build of torch (pip install torch from a CUDA index)")
        if not torch.cuda.is_available():
            raise DeviceError(f"device {spec!r} requested but no CUDA GPU is available here")
        index = device.index or 0
        if index >= torch.cuda.device_count():
            raise DeviceError(f"device {spec!r} requested but only {torch.cuda.device_count()} GPU(s) exist")
        device = torch.device("cuda", index)
    return device


@cache
def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as handle:
            for line in handle:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


@cache
def _driver_version() -> str:
    try:
        import pynvml  # nvidia-ml-py
        pynvml.nvmlInit()
        version = pynvml.nvmlSystemGetDriverVersion()
        return version.decode() if isinstance(version, bytes) else str(version)
    except Exception:
        pass
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20, check=True)
        return out.stdout.strip().splitlines()[0]
    except Exception:
        return "unknown"


def _triton_version() -> str:
    try:
        import triton
        return triton.__version__
    except Exception:
        return "none"


def device_fingerprint(device: torch.device) -> dict:
    """The identity an engine built on `device` is locked to."""
    common = {"torch": torch.__version__, "sartor": __version__}
    if device.type == "cpu":
        return {"kind": "cpu", "cpu": _cpu_model(), "arch": platform.machine(), **common}
    props = torch.cuda.get_device_properties(device)
    return {"kind": "cuda", "gpu": props.name, "compute_capability": f"{props.major}.{props.minor}",
            "driver": _driver_version(), "cuda": torch.version.cuda or "unknown", "triton": _triton_version(),
            **common}


def describe(fp: dict) -> str:
    if fp.get("kind") == "cpu":
        return f"cpu {fp.get('cpu')} ({fp.get('arch')}), torch {fp.get('torch')}, sartor {fp.get('sartor')}"
    return (f"{fp.get('gpu')} sm_{str(fp.get('compute_capability', '')).replace('.', '')}, driver {fp.get('driver')}, "
            f"CUDA {fp.get('cuda')}, torch {fp.get('torch')}, triton {fp.get('triton')}, sartor {fp.get('sartor')}")


def compatibility_level(level: str | None = None) -> str:
    """`level`, else $SARTOR_FINGERPRINT, else "default"; anything else is a one-line ConfigError."""
    chosen = level if level is not None else (os.environ.get(ENVIRONMENT) or "default")
    if chosen not in LEVELS:
        where = f"${ENVIRONMENT}" if level is None else "compatibility"
        raise ConfigError(f"{where}={chosen!r} is not a compatibility level: use one of {', '.join(LEVELS)}")
    return chosen


def _major_minor(version) -> tuple:
    numbers = re.findall(r"\d+", str(version).split("+", 1)[0])
    return tuple(numbers[:2]) if numbers else (str(version),)


def _refuses(field: str, built: object, here: object, level: str) -> bool:
    """Whether a difference in `field` (built != here) refuses a load at `level`."""
    if level == "strict" or field in ALWAYS_REFUSED:
        return True
    if level == "loose":
        return False
    if field in REFUSED_AT_DEFAULT:
        return True
    return field in RELEASES and _major_minor(built) != _major_minor(here)


@dataclass(frozen=True)
class Compatibility:
    """How an engine's fingerprint compares with this machine's at one level."""
    level: str
    refused: tuple  # fields whose difference refuses the load
    warned: tuple  # fields that differ but only warn
    built_for: dict
    here: dict

    @property
    def loads(self) -> bool:
        return not self.refused

    def differences(self, fields) -> str:
        return ", ".join(f"{k} {self.built_for.get(k)} (here {self.here.get(k)})" for k in fields)


def _public_version(version) -> str:
    """A version without its local build suffix: 2.14.1+cu130 -> 2.14.1."""
    return str(version).split("+", 1)[0]


def _same(field: str, built_for: dict, here: dict) -> bool:
    """Whether `field` counts as equal on both sides. torch's local build suffix (+cpu, +cu130) says
    which GPU toolkit the build carries, which a CPU engine does not use: it is ignored there."""
    built, this = built_for.get(field), here.get(field)
    if built == this:
        return True
    return (field == "torch" and built_for.get("kind") == here.get("kind") == "cpu"
            and built is not None and this is not None and _public_version(built) == _public_version(this))


def compare_fingerprints(built_for: dict, here: dict, level: str = "default") -> Compatibility:
    differing = sorted(k for k in set(built_for) | set(here) if not _same(k, built_for, here))
    refused = tuple(k for k in differing if _refuses(k, built_for.get(k), here.get(k), level))
    return Compatibility(level, refused, tuple(k for k in differing if k not in refused), built_for, here)


def check_fingerprint(built_for: dict, here: dict, rebuild_hint: str, level: str | None = None,
                      source: str = "engine") -> Compatibility:
    """Refuse (FingerprintMismatchError naming both sides and the rebuild) or warn once in the log, by
    the compatibility level (see the module's docstring)."""
    result = compare_fingerprints(built_for, here, compatibility_level(level))
    if result.refused:
        also = f"; also in {', '.join(result.warned)}" if result.warned else ""
        loose = compare_fingerprints(built_for, here, "loose")
        override = ("; or accept the difference: --compatibility loose (SARTOR_FINGERPRINT=loose)"
                    if loose.loads and result.level != "loose" else "")
        raise FingerprintMismatchError(
            f"engine was built for [{describe(built_for)}] but this machine is [{describe(here)}] "
            f"(differs in {', '.join(result.refused)}, which must match at compatibility '{result.level}'{also}); "
            f"rebuild it here: {rebuild_hint}{override}")
    if result.warned:
        log.warning("%s: loaded at compatibility '%s' although its fingerprint differs here in %s; rebuild it here "
                    "for tactics timed on this machine", source, result.level, result.differences(result.warned))
    return result
