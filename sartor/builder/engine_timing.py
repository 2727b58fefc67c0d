"""Whole engines timed against each other at build, as they run: the eager check (eager_check.py),
programmatic dependent launch (pdl.py) and the auxiliary streams (aux_streams.py) each compare
contexts of one shape, and keep a variant only where it wins by more than run-to-run noise."""
from __future__ import annotations

from typing import Callable

import torch

from ..tactics.select import time_ms

# (warm-up, timed) runs per measurement, and rounds in turn: on CUDA as the benches pair engines (five rounds of a
# hundred), since a whole engine's choice (chains, PDL, streams) rides on a percent or two, and a round costs
# milliseconds beside the build's minutes.
RUNS = {"cuda": (10, 100), "cpu": (1, 5)}
ROUNDS = {"cuda": 5, "cpu": 2}
# One engine's end-to-end timings differ by about a percent between runs: a variant must be faster
# than this fraction of the plain engine's time to be kept, else the simpler run stays.
MARGIN = 0.99


def untimed_option(option: str, timed_with: str, exc: BaseException, log: list,
                   warn: Callable[[str], None] | None = None) -> str:
    """An option the build goes on without, its engine not timed (a kernel that fails to compile or
    run with it): one line in the log (and to `warn`); returns the error's first line."""
    error = f"{type(exc).__name__}: {exc}".splitlines()[0]
    line = f"warning: {option}: not used, the engine could not be timed with {timed_with}: {error}"
    log.append(line)
    if warn is not None:
        warn(line)
    return error


def time_context(context, feeds: dict, device: torch.device) -> float:
    """Median milliseconds of one context's runs (CUDA graph replays on a GPU)."""
    warmup, runs = RUNS["cuda" if device.type == "cuda" else "cpu"]
    return time_ms(lambda: context.run(feeds), device, runs, warmup)


def fastest_alternating(contexts: dict, feeds: dict, device: torch.device) -> dict:
    """Each context's fastest of ROUNDS timings, taken in turn (the first, the second, …, the first
    again), so that a slow spell of the machine falls on all of them: {key: ms}."""
    times = {key: float("inf") for key in contexts}
    for _ in range(ROUNDS["cuda" if device.type == "cuda" else "cpu"]):
        for key, context in contexts.items():
            times[key] = min(times[key], time_context(context, feeds, device))
    return times
