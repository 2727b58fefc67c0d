"""What an engine is locked to: the device model and the toolkit that chose its kernels."""
from __future__ import annotations

import platform
import subprocess
from functools import lru_cache

import torch

from ..errors import DeviceError, FingerprintMismatchError
from ..version import __version__


def parse_device(spec: str | None) -> torch.device:
    spec = spec or ("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(spec)
    except RuntimeError:
        raise DeviceError(f"unknown device {spec!r}: use cpu or cuda[:N]") from None
    if device.type not in ("cpu", "cuda"):
        raise DeviceError(f"device {spec!r} is not supported: use cpu or cuda[:N]")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise DeviceError(f"device {spec!r} requested but no CUDA GPU is available here")
        index = device.index or 0
        if index >= torch.cuda.device_count():
            raise DeviceError(f"device {spec!r} requested but only {torch.cuda.device_count()} GPU(s) exist")
        device = torch.device("cuda", index)
    return device


@lru_cache(maxsize=None)
def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as handle:
            for line in handle:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


@lru_cache(maxsize=None)
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


def check_fingerprint(built_for: dict, here: dict, rebuild_hint: str) -> None:
    differing = sorted(k for k in set(built_for) | set(here) if built_for.get(k) != here.get(k))
    if differing:
        raise FingerprintMismatchError(
            f"engine was built for [{describe(built_for)}] but this machine is [{describe(here)}] "
            f"(differs in {', '.join(differing)}); rebuild it here: {rebuild_hint}")
