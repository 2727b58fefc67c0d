"""CUDA graphs of an engine's run, in pieces where a layer cannot be captured.

A run is captured as one CUDA graph when every layer can be. A layer that cannot (its op reads
device values on the host: `OpDef.capturable` is False; every layer from the first one whose output
size depends on values on, since what follows sees sizes that change from run to run; or a layer
whose capture failed, found by trying) runs eagerly between captured pieces, so one such layer costs
its own launch, never the whole graph and never a traceback. The pieces share one memory pool.

An eager piece reads the tensors earlier pieces wrote at capture time (captured pieces write the
same addresses on every replay) and copies what later pieces read back into the tensors they were
captured reading; the last piece's outputs are returned as it makes them.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..errors import SartorError
from .executor import Executor, RunState

@dataclass(frozen=True)
class EagerLayer:
    """A layer that runs outside the CUDA graph, and why."""
    index: int
    name: str
    op_type: str
    reason: str

    def to_json(self) -> dict:
        return {"index": self.index, "layer": self.name, "op": self.op_type, "reason": self.reason}


def static_eager_layers(executor: Executor) -> list[EagerLayer]:
    """The layers known before any capture to run outside it: ops that read device values on the
    host, and every layer from the first data-dependent output size on."""
    eager = []
    after_dynamic = None
    for index, step in enumerate(executor.steps):
        if step.on_host:
            continue  # host arithmetic on shapes: no device work to capture
        node = step.node
        if after_dynamic is not None:
            eager.append(EagerLayer(index, node.name, node.op_type, f"after {after_dynamic}, whose output size depends on values"))
        elif step.data_dependent_shape:
            after_dynamic = f"{node.name} ({node.op_type})"
            eager.append(EagerLayer(index, node.name, node.op_type, "its output size depends on values"))
        elif (read := _reads_device_value_on_host(executor, step)) is not None:
            # A shape, axis or pad read from a value the device computes: a host read mid-run, and
            # what follows may change size with the values.
            after_dynamic = f"{node.name} ({node.op_type})"
            eager.append(EagerLayer(index, node.name, node.op_type,
                                    f"it reads {read!r}, computed on the device, as a host value"))
        elif not step.capturable:
            eager.append(EagerLayer(index, node.name, node.op_type, "it reads device values on the host"))
    return eager


def _reads_device_value_on_host(executor: Executor, step) -> str | None:
    """The input this layer reads on the host (a shape, axes, pads) that the device computes, if any."""
    for position, name in enumerate(step.node.inputs):
        if name and position in step.host_positions and position not in step.constants \
                and name not in executor.host_values:
            return name
    return None


def describe_eager_layers(records: list[dict], limit: int = 5) -> str:
    """The layers outside the graph (EagerLayer.to_json records), in one line for the build log and
    `sartor inspect`: the first `limit` with their reasons."""
    named = "; ".join(f"{r.get('layer')} ({r.get('op')}): {r.get('reason')}" for r in records[:limit])
    return named + (f"; and {len(records) - limit} more" if len(records) > limit else "")


def first_line(exc: BaseException) -> str:
    """An exception as one line: its type and its message's first line."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"


@dataclass
class Piece:
    start: int
    stop: int
    captured: bool
    graph: torch.cuda.CUDAGraph | None = None
    snapshot: dict = field(default_factory=dict)  # eager: the values it reads, as captured
    writes: dict = field(default_factory=dict)  # eager: capture-time tensors later pieces read


def plan_pieces(count: int, eager: set[int]) -> list[Piece]:
    """Layers 0..count-1 as runs of captured and of eager layers, in order."""
    pieces: list[Piece] = []
    for index in range(count):
        captured = index not in eager
        if pieces and pieces[-1].captured == captured:
            pieces[-1].stop = index + 1
        else:
            pieces.append(Piece(index, index + 1, captured))
    return pieces or [Piece(0, 0, True)]


class CaptureFailed(SartorError):
    """A layer broke the capture; `index` says which (None when it was not a layer)."""

    def __init__(self, index: int | None, cause: BaseException) -> None:
        super().__init__(f"CUDA graph capture failed at layer {index}: {cause}")
        self.index = index
        self.cause = cause


@dataclass
class PiecewiseGraph:
    """One input shape's captured run: the graph's own input tensors, its pieces and (when the last
    piece is captured) its output tensors."""
    inputs: dict
    pieces: list[Piece]
    outputs: dict | None
    in_place: object
    memo: object
    pool: object = None  # the memory pool its graphs allocated from
    branches: object = None  # the context's BranchStreams its eager pieces run on, if any

    @property
    def whole(self) -> bool:
        return len(self.pieces) == 1 and self.pieces[0].captured

    def replay(self, executor: Executor, profile: int) -> dict:
        if self.whole:
            self.pieces[0].graph.replay()
            return self.outputs
        outputs = self.outputs
        for number, piece in enumerate(self.pieces):
            if piece.captured:
                piece.graph.replay()
                continue
            with torch.inference_mode():  # an eager piece makes tensors; a graph's replay makes none
                state = executor.begin(self.inputs, self.memo) if number == 0 \
                    else RunState(dict(piece.snapshot), self.memo)
                state.in_place = self.in_place
                executor.run_steps(state, piece.start, piece.stop, profile=profile, branches=self.branches)
                for name, target in piece.writes.items():
                    value = state.env[name]
                    if value.shape != target.shape:
                        raise SartorError(f"value {name!r} changed shape between runs of one input shape "
                                          f"({tuple(target.shape)} captured, {tuple(value.shape)} now)")
                    target.copy_(value)
                if number == len(self.pieces) - 1:
                    outputs = executor.finish(state)
        return outputs


def capture_pieces(executor: Executor, static_in: dict, memo, profile: int, eager: set[int],
                   stream: torch.cuda.Stream, pool=None, outputs_into=None, branches=None,
                   output_targets: dict | None = None) -> PiecewiseGraph:
    """Capture a run of `static_in` with the layers in `eager` outside the graphs. Raises
    CaptureFailed naming the layer whose capture failed. `pool`: the memory pool of graphs this one
    may share (never replayed at the same time); `outputs_into(outputs)`, called inside the last
    graph, returns the tensors the outputs are copied to (kept outside the pool), or None;
    `output_targets`: those tensors by output name, which the last graph's layers write into where
    their ops can (Executor.begin), so that `outputs_into` finds them there.
    `branches`: the context's auxiliary streams (branch_streams.py), forked from `stream` and
    joined back inside each piece, so a captured piece is one graph with parallel branches."""
    pieces = plan_pieces(len(executor.steps), eager)
    needed_from = _values_needed_from(executor, {b for piece in pieces for b in (piece.start, piece.stop)})
    state: RunState | None = None
    with torch.cuda.stream(stream):
        for number, piece in enumerate(pieces):
            last = number == len(pieces) - 1
            if piece.captured:
                graph = torch.cuda.CUDAGraph()
                try:
                    # thread_local: another thread's CUDA calls (a video decoder reading ahead, the
                    # host pool pinning memory) neither break this capture nor fail in that thread.
                    with torch.cuda.graph(graph, pool=pool, stream=stream, capture_error_mode="thread_local"):
                        if state is None:
                            state = executor.begin(static_in, memo)
                        if last:
                            state.output_targets = output_targets or None
                        executor.run_steps(state, piece.start, piece.stop, profile=profile, branches=branches)
                        if last:
                            outputs = executor.finish(state)
                            outputs = outputs_into(outputs) if outputs_into is not None else outputs
                except Exception as exc:  # noqa: BLE001 - any failure names its layer; the caller retries without it
                    raise CaptureFailed(state.current if state is not None else None, exc) from exc
                piece.graph = graph
                pool = graph.pool()
                if not last:
                    graph.replay()  # real values for the eager piece that follows (it may read them on the host)
                continue
            if state is None:
                state = executor.begin(static_in, memo)
                before = dict(static_in)
            else:
                needed = needed_from[piece.start]
                piece.snapshot = {name: t for name, t in state.env.items() if name in needed}
                before = piece.snapshot
            executor.run_steps(state, piece.start, piece.stop, profile=profile, branches=branches)
            if last:
                outputs = None  # made afresh on every replay
            else:
                later = needed_from[piece.stop]
                piece.writes = {name: t for name, t in state.env.items()
                                if name in later and before.get(name) is not t}
    return PiecewiseGraph(static_in, pieces, outputs, state.in_place if state else None, memo, pool, branches)


def _values_needed_from(executor: Executor, boundaries: set[int]) -> dict[int, set]:
    """For each boundary index i: the names layers i.. read, and the graph outputs."""
    needed = {v.name for v in executor.graph.outputs}
    found = {}
    for index in range(len(executor.steps), -1, -1):
        if index < len(executor.steps):
            needed.update(executor.steps[index].node.present_inputs())
        if index in boundaries:
            found[index] = set(needed)
    return found
