"""Compile a layer's kernel candidates in parallel before they are timed one by one.

A cold build spends most of its time in Triton's JIT: every candidate tile of every layer shape is
compiled on its first run. Triton's compiler works mostly outside Python's GIL (MLIR passes in C++,
ptxas as a subprocess): on this project's 2-core CPU machine, eight sm_90 compiles of sartor's
implicit-GEMM kernel took 5.2 s one after another and 2.8 s on two threads. So each candidate runs
once on a worker thread, all at the same time; the timing that follows, one candidate at a time
as timing must be, finds them compiled. On CUDA, compile_pool.py has usually compiled every layer's
kernels in worker processes before the first layer is timed; these threads then load them from
Triton's cache, and compile only what that step left out.

Only on CUDA, and never under Triton's interpreter (it patches `triton.language` while a kernel
runs, so interpreted kernels must not overlap). A candidate that fails here is left to the timing
run, which reports why it failed. Every worker has finished, and the device is synchronized,
before timing begins: a kernel launched from another thread while a CUDA graph is being captured
would invalidate the capture.
"""
from __future__ import annotations

import contextlib
import os
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Iterable

import torch

from ..runtime.launchers import usable_cpus

MAX_WORKERS = 16


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def compile_in_parallel(run_once: Callable[[str], object], tactics: Iterable[str], device: torch.device,
                        workers: int | None = None, spent: dict[str, float] | None = None) -> int:
    """Run `run_once(tactic)` for every tactic on its own worker thread (at most `workers`, default
    the CPU count up to MAX_WORKERS), each with `device` current and inference mode on, as the
    builder's thread has; return how many ran without raising. Nothing runs on a CPU device or
    under Triton's interpreter, or for fewer than two tactics. `spent` (when given) receives each
    tactic's seconds on its thread."""
    tactics = list(tactics)
    if device.type != "cuda" or interpreting() or len(tactics) < 2:
        return 0
    return _run_all(run_once, tactics, device, workers, spent)


def _run_all(run_once: Callable[[str], object], tactics: list[str], device: torch.device,
             workers: int | None, spent: dict[str, float] | None = None) -> int:
    def one(tactic: str) -> bool:
        started = time.perf_counter()
        with torch.inference_mode(), (torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()):
            try:
                run_once(tactic)
            except Exception:  # noqa: BLE001 - the timing run will say why this candidate cannot run
                return False
            finally:
                if spent is not None:
                    spent[tactic] = time.perf_counter() - started  # one key per thread: no lock needed
        return True

    count = workers or min(MAX_WORKERS, usable_cpus())
    with ThreadPoolExecutor(max_workers=max(1, min(count, len(tactics))), thread_name_prefix="sartor-compile") as pool:
        ran = sum(pool.map(one, tactics))
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return ran

