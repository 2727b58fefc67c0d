"""How many auxiliary streams the engine's contexts run its independent branches on, chosen at build
by timing (TensorRT's builder does the same with `setMaxAuxStreams`: the engine records its streams
and every context uses them). The engine is timed end to end at every profile's opt shapes in a
context of each count from 0 to the most allowed (`--max-aux-streams`, default DEFAULT_MAX_TIMED), each
replayed as the engine runs (engine_timing.fastest_alternating). A count is chosen over 0 only
where the profiles' times, summed, are under MARGIN of those on one stream, and only if its outputs
are those of one stream. Counts past what the graph's branches can use are not timed.

The header's `aux_streams` records the times and the count; `Engine.context()` takes it as its
default (docs/decisions/0056-auxiliary-streams-chosen-at-build.md).
"""
from __future__ import annotations

from typing import Callable

import torch

from ..runtime.branch_streams import DEFAULT_MAX_TIMED
from .engine_timing import MARGIN, fastest_alternating

# A branch's outputs may differ from one stream's only by float rounding order, which the same
# kernels do not change; anything past this is a race, and that count is not used.
OUTPUT_TOLERANCE = 1e-3


def useful_counts(executor, most: int) -> list[int]:
    """0 and every count up to `most` that puts more layers beside each other than the one before."""
    counts, used = [0], 1
    for aux in range(1, most + 1):
        streams = executor.branch_plan(aux).streams_used
        if streams > used:
            counts.append(aux)
            used = streams
    return counts


def fastest_count(totals: dict[int, float], margin: float = MARGIN) -> int:
    """The count whose summed time is least, if under `margin` of one stream's; else 0."""
    best = min(totals, key=lambda count: (totals[count], count))
    return best if totals[best] < margin * totals[0] else 0


def _same_outputs(got: dict, expected: dict) -> bool:
    return all(torch.allclose(got[name].float(), value.float(), rtol=OUTPUT_TOLERANCE, atol=OUTPUT_TOLERANCE)
               for name, value in expected.items())


def choose_aux_streams(make_header: Callable[[], tuple], device: torch.device, opt_feeds: Callable[[int], dict],
                       log: list, most: int = DEFAULT_MAX_TIMED,
                       warn: Callable[[str], None] | None = None) -> dict | None:
    """Time the engine `make_header` describes with each useful count of auxiliary streams up to
    `most` (module docstring); the header's `aux_streams` record, or None where the graph has no
    branches to run beside each other."""
    from ..runtime.engine import Engine
    engine = Engine(*make_header(), device)
    counts = useful_counts(engine.executor, most)
    if len(counts) == 1:
        return None
    record = {"max": most, "margin": MARGIN, "counts": counts, "profiles": [], "rejected": {}}
    rejected = record["rejected"]  # str(count) -> why (JSON keys)
    for k in range(len(engine.profiles)):
        feeds = opt_feeds(k)
        contexts = {count: engine.context(k, aux_streams=count) for count in counts}
        expected = {name: t.clone() for name, t in contexts[0].run(feeds).items()}
        for count in counts[1:]:
            if str(count) not in rejected and not _same_outputs(contexts[count].run(feeds), expected):
                rejected[str(count)] = f"profile {k}: outputs differ from one stream's"
        times = fastest_alternating({c: context for c, context in contexts.items() if str(c) not in rejected}, feeds,
                                    device)
        record["profiles"].append({"profile": k, "ms": {str(c): round(t, 5) for c, t in times.items()}})
    # The counts never rejected, timed at every profile (one rejected later keeps its earlier times).
    totals = {count: sum(p["ms"][str(count)] for p in record["profiles"])
              for count in counts if str(count) not in rejected}
    record["totals_ms"] = {str(count): round(total, 5) for count, total in totals.items()}
    record["streams"] = fastest_count(totals)
    times = "; ".join(f"{count}: {total:.4g} ms" for count, total in totals.items())
    log.append(f"aux streams: {record['streams']} (summed over the profiles, by count: {times})")
    for count, why in rejected.items():
        line = f"warning: aux streams: {count} not used, {why}"
        log.append(line)
        if warn is not None:
            warn(line)
    return record
