"""Which convolution chains run as one kernel, chosen at build by timing (`passes/fuse_conv_chain.py`,
`kernels/conv/chain.py`; docs/decisions/kernel-conv-chain.md).

After the tactics stage has chosen each layer's winner, every chain the graph offers is fused in a
trial copy and the copy's layers are selected again: unchanged layers come back from the timing
cache the first selection filled, and each chain's kernel tiles are timed in place, on the inputs
and into the buffers the engine gives them. A chain is fused in the engine where its winner is one
of its tiles at every profile and its times, summed over the profiles, are under CHAIN_MARGIN of its
two layers' winners' summed times. The others stay two layers with their own winners.

A layer timed alone is not the engine (a kernel replayed back to back hides latency that the
engine's sequence shows; the decision record has the measurement). So the engine with its chains is
then timed against the engine without any (`check_chains`, as --pdl's and the auxiliary streams'
choices are made), at every profile's opt shape, and the chains are kept only where the whole
engine is faster.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable

import torch

from ..ir import Graph
from ..kernels.conv.chain import ChainTile
from ..kernels.registry import tactic_for
from ..passes.fuse_conv_chain import chain_name, chain_pairs, fuse_conv_chain
from ..tactics import TacticSelection, TimingCache, select_tactics_by_profile
from .engine_timing import MARGIN, fastest_alternating, untimed_option

# A chain replaces two measured layers only where it is measurably faster: timing noise must not
# swap in a kernel that is no better.
CHAIN_MARGIN = 0.97


@dataclass(frozen=True)
class ChainTiming:
    """One chain's summed times over the profiles (ms): as one kernel, and as its two layers."""
    name: str
    chain_ms: float | None  # None: no tile of it ran (or matched the reference) at some profile
    apart_ms: float | None  # None: a layer of it was not timed (one candidate)

    @property
    def fused(self) -> bool:
        return self.chain_ms is not None and self.apart_ms is not None and self.chain_ms < CHAIN_MARGIN * self.apart_ms

    def describe(self) -> str:
        chain = "no tile ran" if self.chain_ms is None else f"{self.chain_ms:.4f} ms"
        apart = "not timed" if self.apart_ms is None else f"{self.apart_ms:.4f} ms"
        return f"{self.name}: one kernel {chain}, two layers {apart}"


def _winner_ms(selection: TacticSelection, name: str) -> tuple[str | None, float | None]:
    entry = selection.layers.get(name)
    if entry is None or entry["tactic"] not in entry["timings_ms"]:
        return None, None
    return entry["tactic"], entry["timings_ms"][entry["tactic"]]


def _summed(values: list) -> float | None:
    return None if any(value is None for value in values) else round(sum(values), 5)


def choose_conv_chains(graph: Graph, weights: dict, selections: list[TacticSelection],
                       feeds_by_profile: Iterable[dict], device: torch.device, layer_precision: dict, *, effort: int,
                       cache: TimingCache, reasons: dict | None = None, time_single: bool = False,
                       exclude: Iterable[str] = (), on_layer: Callable | None = None) -> list[ChainTiming]:
    """Fuse the chains that time faster (module docstring) into `graph`, moving their selections into
    `selections` and their precision (and `reasons`' entry) into `layer_precision`; returns every
    chain's timing, fused or not. `cache` must hold the first selection's timings (or the trial
    times every layer again)."""
    pairs = chain_pairs(graph, layer_precision)
    if not pairs:
        return []
    trial = graph.copy()
    trial_precision = dict(layer_precision)
    by_name = {node.name: node for node in trial.nodes}
    for first, second in pairs:
        fuse_conv_chain(trial, by_name[first.name], by_name[second.name], trial_precision)
        trial_precision[chain_name(first, second)] = layer_precision.get(first.name, "fp32")
    trial_selections = select_tactics_by_profile(trial, weights, feeds_by_profile, device, trial_precision,
                                                 channels_last=True, tf32=False, effort=effort, cache=cache,
                                                 time_single=time_single, exclude=exclude, on_layer=on_layer)
    for kept, trial_selection in zip(selections, trial_selections):
        kept.exclusions_used |= trial_selection.exclusions_used  # --exclude-tactic 'chain.*' matched here
    return fuse_faster_chains(graph, pairs, selections, trial_selections, layer_precision, reasons)


def fuse_faster_chains(graph: Graph, pairs: list, selections: list[TacticSelection],
                       trial_selections: list[TacticSelection], layer_precision: dict,
                       reasons: dict | None = None) -> list[ChainTiming]:
    """Each chain's timing from the trial's selections (its winner, where a chain tile) against its two
    layers' winners in `selections`, summed over the profiles; the chains that win are fused into
    `graph`, their trial selection moved into `selections` and their first layer's precision into
    `layer_precision` (and its entry of `reasons`, where given), in place of their two layers'."""
    timings = []
    for first, second in pairs:
        name = chain_name(first, second)
        chain_ms = []
        for selection in trial_selections:
            tactic, ms = _winner_ms(selection, name)
            chain_ms.append(ms if tactic is not None and isinstance(tactic_for(tactic), ChainTile) else None)
        apart_ms = [_winner_ms(selection, layer)[1] for selection in selections for layer in (first.name, second.name)]
        timing = ChainTiming(name, _summed(chain_ms), _summed(apart_ms))
        timings.append(timing)
        if not timing.fused:
            continue
        fuse_conv_chain(graph, first, second, layer_precision)
        for kept, trial_selection in zip(selections, trial_selections):
            _move_entry(kept.layers, first.name, second.name, name, trial_selection.layers[name])
        _move_entry(layer_precision, first.name, second.name, name, layer_precision.get(first.name, "fp32"))
        if reasons is not None:
            _move_entry(reasons, first.name, second.name, name, reasons.get(first.name))
    return timings


def _move_entry(entries: dict, first: str, second: str, chain: str, value) -> None:
    """A fused chain's entry (`value`, none where None) in place of its two layers' in `entries`."""
    entries.pop(first, None)
    entries.pop(second, None)
    if value is not None:
        entries[chain] = value


def chains_win(apart_ms: list[float], chains_ms: list[float], margin: float = MARGIN) -> bool:
    """Whether the chains are kept: the engine's times with them, summed over the profiles, under
    `margin` of those without."""
    return sum(chains_ms) < margin * sum(apart_ms)


def check_chains(make_header: Callable[[], tuple], use_chains: Callable[[bool], None], device: torch.device,
                 opt_feeds: Callable[[int], dict], log: list, warn: Callable[[str], None] | None = None) -> dict:
    """The engine with its fused chains (the build's state as it comes in) against the engine with
    every chain two layers (`use_chains(False)` switches the build's graph, tactics, layer precisions
    and memory plan to that), end to end at every profile's opt shape, replayed as the engine runs
    (engine_timing.fastest_alternating). Leaves the build with the chains where they win
    (`chains_win`), else without; returns the header's `chains_check` record. Where the engines
    cannot be timed, the build goes on without chains, saying why (`warn`)."""
    from ..runtime.engine import Engine
    record = {"margin": MARGIN, "profiles": []}
    try:
        chained = Engine(*make_header(), device)
        use_chains(False)
        apart = Engine(*make_header(), device)
        for k in range(len(apart.profiles)):
            times = fastest_alternating({"apart": apart.context(k), "chains": chained.context(k)}, opt_feeds(k),
                                        device)
            record["profiles"].append({"profile": k, "apart_ms": round(times["apart"], 5),
                                       "chains_ms": round(times["chains"], 5)})
    except Exception as exc:  # noqa: BLE001 - chains are an option the build can do without
        use_chains(False)
        return dict(record, kept=False, error=untimed_option("chains", "them", exc, log, warn))
    kept = chains_win([p["apart_ms"] for p in record["profiles"]], [p["chains_ms"] for p in record["profiles"]])
    use_chains(kept)
    times = "; ".join(f"profile {p['profile']}: {p['apart_ms']:.4g} ms without, {p['chains_ms']:.4g} ms with"
                      for p in record["profiles"])
    log.append(f"chains: kept, the engine is faster with them ({times})" if kept else
               f"chains: not used, the engine was not {1 - MARGIN:.0%} faster with them ({times})")
    return dict(record, kept=kept)
