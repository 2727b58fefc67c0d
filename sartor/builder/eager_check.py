"""The build's eager check: the tuned engine against the same layers each on its eager tactic, end
to end at every profile's opt shapes, so that an engine is never slower than running its layers on
the kernels PyTorch eager runs (docs/decisions/0038-eager-check.md).

A layer's eager tactic is what PyTorch eager runs for its op: the reference (cuDNN convolutions,
cuBLAS GEMMs, torch's elementwise kernels), or the op's own `OpDef.eager_tactic` where eager runs
something else (SDPA for attention). Every layer's candidates include it, so per layer the tuned
choice is never slower as timed; end to end it can be, since layers are timed alone (the layouts
and caches between them, a tiny layer's timing noise). Both engines run as the engine runs,
replayed as CUDA graphs, alternately, twice each, the faster of each pair kept. Where the
eager-tactic engine is faster than EAGER_MARGIN of the tuned one, that profile keeps the eager
tactics and the build log warns; the header's `eager_check` records both times per profile.

Float builds only: an INT8 layer's reference is an exact emulation, not an eager kernel.
"""
from __future__ import annotations

import contextlib
from typing import Callable, Iterator

import torch

from ..ir import Graph
from ..ops import default_registry
from ..runtime.engine import Engine
from ..tactics import TacticSelection, record_tactics
from ..tactics.select import REFERENCE_TACTIC
from .engine_timing import fastest_alternating

# The eager-tactic engine must be this much faster to be kept: end-to-end timings of one engine
# differ by a percent or two between runs.
EAGER_MARGIN = 0.97


def eager_tactic(op_type: str, timed: dict) -> str:
    """The tactic PyTorch eager runs for this op, when the layer's timing accepted it, else the reference."""
    opdef = default_registry().get(op_type)
    wanted = getattr(opdef, "eager_tactic", None) or REFERENCE_TACTIC
    return wanted if wanted in timed else REFERENCE_TACTIC


def eager_selections(graph: Graph, selections: list[TacticSelection]) -> list[TacticSelection]:
    """The same layers, each profile's on its eager tactic."""
    ops = {node.name: node.op_type for node in graph.nodes}
    eager = []
    for selection in selections:
        chosen = TacticSelection()
        for name, layer in selection.layers.items():
            chosen.layers[name] = dict(layer, tactic=eager_tactic(ops[name], layer.get("timings_ms", {})))
        eager.append(chosen)
    return eager


@contextlib.contextmanager
def tactics_applied(graph: Graph, selections: list[TacticSelection]) -> Iterator[None]:
    """The graph's layers carry `selections`' tactics inside the block, their own again after."""
    saved = {node.name: {key: node.attrs[key] for key in ("tactic", "tactic_by_profile") if key in node.attrs}
             for node in graph.nodes}
    try:
        apply_tactics(graph, selections)
        yield
    finally:
        _clear_tactics(graph)
        for node in graph.nodes:
            node.attrs.update(saved.get(node.name, {}))


def _clear_tactics(graph: Graph) -> None:
    for node in graph.nodes:
        node.attrs.pop("tactic", None)
        node.attrs.pop("tactic_by_profile", None)


def apply_tactics(graph: Graph, selections: list[TacticSelection]) -> None:
    """The layers carry exactly `selections`' tactics (record_tactics only adds)."""
    _clear_tactics(graph)
    record_tactics(graph, selections)


def check_against_eager(graph: Graph, selections: list[TacticSelection], make_header: Callable[[], tuple],
                        device: torch.device, opt_feeds: Callable[[int], dict], log: list,
                        warn: Callable[[str], None]) -> dict:
    """Compare, keep the eager tactics where they win (rewriting `selections` and the graph's
    tactics), and return the header's `eager_check` record."""
    eager = eager_selections(graph, selections)
    tuned_engine = Engine(*make_header(), device)
    with tactics_applied(graph, eager):
        eager_engine = Engine(*make_header(), device)
    record = {"margin": EAGER_MARGIN, "profiles": []}
    for k in range(len(tuned_engine.profiles)):
        feeds = opt_feeds(k)
        times = fastest_alternating({"tuned": tuned_engine.context(k), "eager": eager_engine.context(k)}, feeds,
                                    device)
        tuned_ms, eager_ms = times["tuned"], times["eager"]
        kept = "eager" if eager_ms < EAGER_MARGIN * tuned_ms else "tuned"
        record["profiles"].append({"profile": k, "tuned_ms": round(tuned_ms, 5), "eager_ms": round(eager_ms, 5),
                                   "kept": kept})
        shapes = ", ".join("x".join(map(str, feed.shape)) for feed in feeds.values())
        if kept == "eager":
            selections[k].layers.update({name: dict(layer, source="eager check")
                                         for name, layer in eager[k].layers.items()})
            line = (f"warning: eager check: profile {k} ({shapes}): the tuned layers took {tuned_ms:.4g} ms against "
                    f"{eager_ms:.4g} ms on their eager kernels; this profile keeps the eager kernels")
            log.append(line)
            warn(line)
        else:
            log.append(f"eager check: profile {k} ({shapes}): {tuned_ms:.4g} ms, {eager_ms:.4g} ms with every layer "
                       f"on its eager kernel ({eager_ms / tuned_ms:.2f}x)")
    if any(p["kept"] == "eager" for p in record["profiles"]):
        apply_tactics(graph, selections)
    return record
