"""The build's "kernels" stage: run the finished engine once per profile shape and keep the Triton
cache entries of exactly the kernels it ran (sartor/runtime/kernel_store.py stores and installs them).

Triton calls its compilation listener on every compile, a disk-cache hit included, but a kernel
already compiled in this process (while tactics were timed) is served from the JIT function's
in-memory table without a compile. So the capture run starts each of sartor's Triton functions with
an empty table (the old one is put back afterwards): every kernel the engine launches then goes
through Triton's compile, a cache hit on disk, and the listener names its files. Nothing is compiled
twice, and kernels of the tactics that lost are not stored.
"""
from __future__ import annotations

import contextlib
import sys
from collections import defaultdict
from typing import Callable, Iterator

import torch

from ..runtime.context import ExecutionContext
from ..runtime.engine import Engine
from ..runtime.kernel_store import KernelEntry, KernelRecorder

# Modules whose Triton functions an engine may launch.
_KERNEL_MODULE_PREFIX = "sartor."


class CaptureUnavailable(Exception):
    """This Triton lacks what the capture relies on (the reason is the message)."""


def _jit_functions() -> list:
    from triton.runtime.jit import JITFunction
    found: dict[int, object] = {}
    for name, module in list(sys.modules.items()):
        if module is None or not name.startswith(_KERNEL_MODULE_PREFIX):
            continue
        for value in list(vars(module).values()):
            # Autotuner and Heuristics wrap the JIT function in `.fn`.
            for _ in range(4):
                if isinstance(value, JITFunction):
                    found[id(value)] = value
                    break
                value = getattr(value, "fn", None)
                if value is None:
                    break
    return list(found.values())


@contextlib.contextmanager
def _fresh_jit_tables() -> Iterator[None]:
    saved = []
    for fn in _jit_functions():
        table = getattr(fn, "device_caches", None)
        if not isinstance(table, defaultdict):
            raise CaptureUnavailable("this Triton's JIT functions keep no device_caches table")
        saved.append((fn, table))
    try:
        for fn, table in saved:
            fn.device_caches = defaultdict(table.default_factory)
        yield
    finally:
        for fn, table in saved:
            fn.device_caches = table


@contextlib.contextmanager
def _listening(recorder: KernelRecorder) -> Iterator[None]:
    from triton import knobs
    compilation = getattr(knobs, "compilation", None)
    if compilation is None or not hasattr(compilation, "listener"):
        raise CaptureUnavailable("this Triton has no compilation listener")
    previous = compilation.listener

    def both(**event):
        recorder(**event)
        if previous is not None:
            previous(**event)
    compilation.listener = both
    try:
        yield
    finally:
        compilation.listener = previous


def capture_kernels(header: dict, tensors: dict[str, torch.Tensor], device: torch.device,
                    feeds_of_profile: Callable[[int], list[dict]]) -> tuple[list[KernelEntry], int]:
    """The cache entries of the Triton kernels the engine (`header`, `tensors`) runs on each input
    set `feeds_of_profile(k)` lists for its profile k, and how many runs that took. Raises
    CaptureUnavailable when this Triton cannot say."""
    engine = Engine(header, tensors, device)
    recorder = KernelRecorder()
    runs = 0
    benchmark = torch.backends.cudnn.benchmark  # a context turns it on for the process
    try:
        with _fresh_jit_tables(), _listening(recorder):
            for k in range(len(engine.profiles)):
                context = ExecutionContext(engine, k, use_cuda_graphs=False)
                for feeds in feeds_of_profile(k):
                    context.run(feeds)
                    runs += 1
            torch.cuda.synchronize(device)
    finally:
        torch.backends.cudnn.benchmark = benchmark
    import triton
    return recorder.entries(triton.__version__), runs
