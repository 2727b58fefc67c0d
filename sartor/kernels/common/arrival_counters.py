"""Arrival counters: zeroed int32 words that a kernel's programs count themselves in at, so that the
last program of a group knows it is last (split-K shares reduced in the kernel: conv/igemm.py
`reduce_shares_in_place`). A kernel leaves its counters at zero when it ends, so counters stay
zeroed memory across launches without a memset, but two kernels that run at the same time must
never share one. Hence who owns them:

- an execution context owns an `ArrivalCounters` and binds it while it runs or captures
  (`bound`); each layer (its launch site: the executor's step, `set_launch_site`) gets its own counters in it, the same
  on every run, so graph replays and eager runs of one context agree on them, and layers on
  auxiliary streams never share them;
- elsewhere (the builder timing a candidate, a kernel called directly), the counters of the CUDA
  stream the kernel is launched on: kernels of one stream run one after another.

Counters are made outside graph capture when possible: a layer's first run (the warm-up before a
capture) makes them, and the capture then finds them. One made inside a capture is zeroed by the
graph on every replay, before its kernel: correct, one memset more.
"""
from __future__ import annotations

import contextlib
import threading
from contextvars import ContextVar

import torch


class ArrivalCounters:
    """Zeroed int32 counters per (launch site, device, count), made on first request and kept: a
    captured graph may hold any of them, so none is ever freed or regrown in place."""

    def __init__(self) -> None:
        self._ranges: dict[tuple, torch.Tensor] = {}
        self._lock = threading.Lock()

    def take(self, site, count: int, device: torch.device) -> torch.Tensor:
        """`count` zeroed counters for `site` on `device`: the same words every time it asks."""
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:  # "cuda" and "cuda:0" are one device's counters
            device = torch.device("cuda", torch.cuda.current_device())
        key = (site, device, int(count))
        with self._lock:
            held = self._ranges.get(key)
            if held is None:
                held = self._ranges[key] = torch.zeros(int(count), dtype=torch.int32, device=device)
            return held

    @property
    def words(self) -> int:
        return sum(t.numel() for t in self._ranges.values())


_BOUND: ContextVar[ArrivalCounters | None] = ContextVar("sartor_arrival_counters", default=None)
_SITE: ContextVar[object] = ContextVar("sartor_launch_site", default=None)
_BY_STREAM = ArrivalCounters()  # the fallback: keyed by the launching stream


@contextlib.contextmanager
def bound(counters: ArrivalCounters):
    """Kernels launched inside take their counters from `counters` (per launch site)."""
    token = _BOUND.set(counters)
    try:
        yield counters
    finally:
        _BOUND.reset(token)


def set_launch_site(site):
    """Kernels launched from now on belong to `site` (a layer of a run) for their bound counters;
    returns the token that `reset_launch_site` takes. (Not a context manager: the executor sets one
    per layer, where a generator's cost would show in an eager batch-1 run.)"""
    return _SITE.set(site)


def reset_launch_site(token) -> None:
    _SITE.reset(token)


def current_launch_site():
    return _SITE.get()


def bound_counters() -> ArrivalCounters | None:
    """The counters bound here (`bound`), or None."""
    return _BOUND.get()


def take_counters(count: int, device: torch.device) -> torch.Tensor:
    """`count` zeroed arrival counters for one launch on `device` (see the module's docstring)."""
    counters, site = _BOUND.get(), _SITE.get()
    if counters is not None and site is not None:
        return counters.take(site, count, device)
    device = torch.device(device)
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else None
    return _BY_STREAM.take(("stream", stream), count, device)
