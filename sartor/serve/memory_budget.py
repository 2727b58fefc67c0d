"""Several models on one device: `sartor serve --memory-budget 8G` and a model's own
`parameters { key: "memory_budget" value: { string_value: "2G" } }` in its config.pbtxt.

A model version needs, on each device its instances run on, its weights once and each instance's
context at the largest profile's max shapes (activation arena, inputs, workspace:
Engine.memory_by_profile); the instance_group count is the number of concurrent contexts. A
version that would not fit what the other models leave of the server's budget, or its own budget,
is refused with one line giving the numbers; it is reported unavailable with that reason, and the
others keep serving. The check runs once the engine is loaded (its weights are then on the device)
and before any context is made or warmed up. A new version replaces its model's reservation: the
old version's memory is freed when it retires, shortly after the swap.
"""
from __future__ import annotations

import re
import threading

from ..errors import ConfigError, SartorError

UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


class OverMemoryBudget(SartorError):
    """A model version that would not fit its device's memory budget."""


def parse_size(text: str, what: str) -> int:
    """'8G', '512M', '1.5GiB', '1000000' → bytes (K, M, G, T are powers of 1024, as Docker's --memory)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(?:i?b)?\s*", str(text), re.IGNORECASE)
    if not match:
        raise ConfigError(f"{what} {text!r} is not a size: write it as 8G, 512M or a number of bytes")
    value = int(float(match.group(1)) * UNITS[match.group(2).lower()])
    if value <= 0:
        raise ConfigError(f"{what} {text!r} must be more than 0 bytes")
    return value


def fmt_size(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


def needs(engine, instances: list[tuple[str, int]]) -> dict[str, tuple[int, str]]:
    """device -> (bytes, how they add up) for a version whose engine is `engine`, with `instances`
    [(device, contexts)]."""
    rows = engine.memory_by_profile
    largest = max(rows, key=lambda r: r["context_bytes"]) if rows else None
    per_context = largest["context_bytes"] if largest else 0
    weights = engine.weight_bytes + engine.profile_weight_bytes
    out = {}
    for device, count in instances:
        total = weights + count * per_context
        how = f"weights {fmt_size(weights)} + {count} context{'s' if count > 1 else ''} x {fmt_size(per_context)}"
        if largest is not None:
            how += (f" (profile {largest['profile']} at max shapes: arena {fmt_size(largest['arena_bytes'])}, inputs "
                    f"{fmt_size(largest['input_bytes'])}, workspace {fmt_size(largest['workspace_bytes'])})")
        out[device] = (total, how)
    return out


class MemoryBudget:
    """What each served model holds per device, against the server's budget (None: no server budget)."""

    def __init__(self, budget_bytes: int | None) -> None:
        self.budget_bytes = budget_bytes
        self._lock = threading.Lock()
        self._held: dict[str, dict[str, int]] = {}  # model -> device -> bytes

    def held(self, name: str) -> dict[str, int]:
        with self._lock:
            return dict(self._held.get(name, {}))

    def reserve(self, name: str, version: str, need: dict[str, tuple[int, str]],
                own_budget: int | None = None) -> dict[str, int] | None:
        """Hold `need` for model `name` (replacing what it held); returns what it held before (to put
        back with `restore` if the load fails later). OverMemoryBudget when it does not fit."""
        label = f"model '{name}' version {version}"
        for device, (size, how) in need.items():
            if own_budget is not None and size > own_budget:
                raise OverMemoryBudget(f"{label} needs {fmt_size(size)} on {device} ({how}) but its config's "
                                       f"memory_budget is {fmt_size(own_budget)}")
        with self._lock:
            if self.budget_bytes is not None:
                for device, (size, how) in need.items():
                    others = {m: held[device] for m, held in self._held.items() if m != name and device in held}
                    left = self.budget_bytes - sum(others.values())
                    if size > left:
                        taken = ", ".join(f"{m} {fmt_size(b)}" for m, b in sorted(others.items())) or "nothing"
                        raise OverMemoryBudget(
                            f"{label} needs {fmt_size(size)} on {device} ({how}) but --memory-budget "
                            f"{fmt_size(self.budget_bytes)} has {fmt_size(max(left, 0))} left (held: {taken}); "
                            f"raise the budget, unload a model or lower its instance_group count")
            previous = self._held.get(name)
            self._held[name] = {device: size for device, (size, _) in need.items()}
            return previous

    def restore(self, name: str, previous: dict[str, int] | None) -> None:
        with self._lock:
            if previous is None:
                self._held.pop(name, None)
            else:
                self._held[name] = previous

    def release(self, name: str) -> None:
        self.restore(name, None)
