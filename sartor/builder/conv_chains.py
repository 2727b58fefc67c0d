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
engine is faster. Where it is not, the engines with each half of the chains (in graph order: a
detector's backbone chains, then its head's; `chain_halves`) are timed against the engine without
any in the same way, and the faster half that wins is kept: one chain that costs the engine more
than it saved alone no longer takes the others with it.
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
class ChainChoice:
    """The chains the builder timed: each one's timing, and the trial's selections (each chain's
    winner per profile), from which any of the chains that won can be fused into a copy of the
    graph without them (`fuse_only`)."""
    timings: list
    trial_selections: list

    @property
    def fused(self) -> list[str]:
        """The chains that timed faster than their two layers, in graph order."""
        return [timing.name for timing in self.timings if timing.fused]

    def fuse_only(self, graph: Graph, selections: list[TacticSelection], layer_precision: dict,
                  reasons: dict | None, names: Iterable[str]) -> None:
        """Fuse the chains named (of those that timed faster) into `graph`, which has none fused, as
        `fuse_faster_chains` fused them all into the build's graph."""
        names = set(names)
        pairs = [pair for pair in chain_pairs(graph, layer_precision) if chain_name(*pair) in names]
        fuse_faster_chains(graph, pairs, selections, self.trial_selections, layer_precision, reasons)


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
                       exclude: Iterable[str] = (), on_layer: Callable | None = None) -> ChainChoice:
    """Fuse the chains that time faster (module docstring) into `graph`, moving their selections into
    `selections` and their precision (and `reasons`' entry) into `layer_precision`; returns every
    chain's timing, fused or not, with the trial's selections. `cache` must hold the first selection's
    timings (or the trial times every layer again)."""
    pairs = chain_pairs(graph, layer_precision)
    if not pairs:
        return ChainChoice([], [])
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
    timings = fuse_faster_chains(graph, pairs, selections, trial_selections, layer_precision, reasons)
    return ChainChoice(timings, trial_selections)


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


def chain_halves(names: list[str]) -> list[tuple[str, ...]]:
    """The two halves of the chains, in graph order (the first takes the odd one): the subsets the
    engine check times where the engine with every chain does not win; none for fewer than two."""
    if len(names) < 2:
        return []
    middle = -(-len(names) // 2)
    return [tuple(names[:middle]), tuple(names[middle:])]


def _sums(profiles: list[dict]) -> tuple[list[float], list[float]]:
    return [p["apart_ms"] for p in profiles], [p["chains_ms"] for p in profiles]


def _times_text(profiles: list[dict]) -> str:
    return "; ".join(f"profile {p['profile']}: {p['apart_ms']:.4g} ms without, {p['chains_ms']:.4g} ms with"
                     for p in profiles)


def _time_against_apart(apart, engines: list, device: torch.device, opt_feeds: Callable[[int], dict]) -> list[list]:
    """Each engine of `engines` against `apart`, in turns with it, at every profile: per engine, its
    profiles' {"profile", "apart_ms", "chains_ms"} (the apart figure of the same turns)."""
    profiles = [[] for _ in engines]
    for k in range(len(apart.profiles)):
        contexts = {"apart": apart.context(k), **{i: engine.context(k) for i, engine in enumerate(engines)}}
        times = fastest_alternating(contexts, opt_feeds(k), device)
        for i in range(len(engines)):
            profiles[i].append({"profile": k, "apart_ms": round(times["apart"], 5), "chains_ms": round(times[i], 5)})
    return profiles


def check_chains(make_header: Callable[[], tuple], use_chains: Callable, device: torch.device,
                 opt_feeds: Callable[[int], dict], log: list, warn: Callable[[str], None] | None = None,
                 subsets: list[tuple[str, ...]] = ()) -> dict:
    """The engine with its fused chains (the build's state as it comes in) against the engine with
    every chain two layers, end to end at every profile's opt shape, replayed as the engine runs
    (engine_timing.fastest_alternating). `use_chains(kept)` switches the build's graph, tactics, layer
    precisions and memory plan: True to every chain fused, False to none, a tuple of chain names to those.
    Leaves the build with the chains where they win (`chains_win`); else each of `subsets` (chain_halves)
    is timed against the engine without chains in the same way, and the fastest that wins is kept, else
    none. Returns the header's `chains_check` record: `profiles` (every chain against none), `kept`, and
    where subsets were timed `subsets` (each one's `chains` and `profiles`) and `kept_chains`. Where the
    engines cannot be timed, the build goes on without chains, saying why (`warn`)."""
    from ..runtime.engine import Engine
    record = {"margin": MARGIN, "profiles": []}
    try:
        chained = Engine(*make_header(), device)
        use_chains(False)
        apart = Engine(*make_header(), device)
        record["profiles"] = _time_against_apart(apart, [chained], device, opt_feeds)[0]
    except Exception as exc:  # noqa: BLE001 - chains are an option the build can do without
        use_chains(False)
        return dict(record, kept=False, error=untimed_option("chains", "them", exc, log, warn))
    times = _times_text(record["profiles"])
    if chains_win(*_sums(record["profiles"])):
        use_chains(True)
        log.append(f"chains: kept, the engine is faster with them ({times})")
        return dict(record, kept=True)
    if not subsets:
        use_chains(False)
        log.append(f"chains: not used, the engine was not {1 - MARGIN:.0%} faster with them ({times})")
        return dict(record, kept=False)
    del chained  # its memory, before the subsets' engines
    log.append(f"chains: not all, the engine was not {1 - MARGIN:.0%} faster with every chain ({times}); "
               f"timing {len(subsets)} halves of them")
    try:
        engines = []
        for subset in subsets:
            use_chains(subset)
            engines.append(Engine(*make_header(), device))
        timed = _time_against_apart(apart, engines, device, opt_feeds)
    except Exception as exc:  # noqa: BLE001 - as above
        use_chains(False)
        return dict(record, kept=False, error=untimed_option("chains", "half of them", exc, log, warn))
    record["subsets"] = [{"chains": list(subset), "profiles": profiles} for subset, profiles in zip(subsets, timed)]
    winners = [entry for entry in record["subsets"] if chains_win(*_sums(entry["profiles"]))]
    if not winners:
        use_chains(False)
        log.append(f"chains: not used, no half of them made the engine {1 - MARGIN:.0%} faster (" + " | ".join(
            f"{len(entry['chains'])} chain(s): {_times_text(entry['profiles'])}" for entry in record["subsets"]) + ")")
        return dict(record, kept=False)
    best = min(winners, key=lambda entry: sum(_sums(entry["profiles"])[1]))
    use_chains(tuple(best["chains"]))
    log.append(f"chains: kept {len(best['chains'])} of {sum(len(subset) for subset in subsets)}, the engine is faster "
               f"with them ({_times_text(best['profiles'])}): {', '.join(best['chains'])}")
    return dict(record, kept=True, kept_chains=best["chains"])
