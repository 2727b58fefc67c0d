"""Independent branches of an engine on several CUDA streams (TensorRT's auxiliary streams).

At batch 1 a detector's layers are each one small kernel, and the GPU runs them one after another
though most of its multiprocessors idle: YOLOv8n's head is six chains of three convolutions that
depend on each other only through the neck before them. Here each layer is given a stream: a layer continues the stream of the layer that wrote its input when that layer
was the last given to it (a chain stays on one stream), and otherwise takes the stream whose last
layer came earliest (a new branch starts beside the others). A layer that reads a value made on
another stream waits for that layer's event first. Inside a CUDA graph capture the streams become
parallel branches of the one graph; every run forks from the caller's stream and joins back to it,
so what follows the run (outputs, the next captured piece) sees all of it.

Memory: a tensor made on one stream and read on another is marked used by the reader's stream
(`record_stream`), so the caching allocator does not hand its memory out again before the reader is
done (during a capture it defers such frees to the capture's end: more memory, never a race).

Its gain depends on the model, the batch and the card, so the build times the engine with 0 to
`--max-aux-streams` streams and records the fastest count, which contexts run unless told another
(`engine.context(aux_streams=N)`; builder/aux_streams.py, docs/decisions/0053 and 0056).
A Concat buffer written in place from several streams is ordered by concat_plan.ConcatBuffers.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

MAIN = 0  # the stream the run was called on
MAX_AUX_STREAMS = 8
# The counts a build times by default, 0 to this (builder/aux_streams.py): the detectors' branches
# use two (decision 0053).
DEFAULT_MAX_TIMED = 2


@dataclass(frozen=True)
class BranchPlan:
    """Per step: its stream (MAIN, or 1..aux for the auxiliary streams; None for host steps), the
    earlier steps on other streams it waits for, and which steps another stream waits for."""
    stream_of: tuple
    waits: tuple
    signals: frozenset

    @property
    def streams_used(self) -> int:
        return len({s for s in self.stream_of if s is not None})


def plan_branches(steps: list, aux_streams: int) -> BranchPlan:
    """The stream of every step (see the module's docstring) over MAIN and `aux_streams` others."""
    producer: dict[str, int] = {}  # value -> the device step that made it (host values wait for nothing)
    tail = {stream: -1 for stream in range(MAIN, aux_streams + 1)}  # stream -> its last step so far
    stream_of: list = []
    waits: list = []
    signals: set[int] = set()
    for index, step in enumerate(steps):
        if step.on_host:  # shape arithmetic on the host: no device work to place
            stream_of.append(None)
            waits.append(())
            continue
        producers = [producer[name] for name in step.node.present_inputs() if name in producer]
        chained = [stream_of[p] for p in producers if tail[stream_of[p]] == p]
        if chained:
            stream = chained[0]
        elif not producers:
            stream = MAIN
        else:
            stream = min(tail, key=lambda s: (tail[s], s))
        stream_of.append(stream)
        waited = tuple(sorted({p for p in producers if stream_of[p] != stream}))
        waits.append(waited)
        signals.update(waited)
        tail[stream] = index
        for name in step.node.outputs:
            if name:
                producer[name] = index
    return BranchPlan(tuple(stream_of), tuple(waits), frozenset(signals))


class BranchStreams:
    """A context's auxiliary streams and its engine's plan over them; one per ExecutionContext (two
    contexts never share streams, so their runs never wait on each other's events)."""

    def __init__(self, plan: BranchPlan, device: torch.device, aux_streams: int) -> None:
        self.plan = plan
        self.device = device
        self.aux = [torch.cuda.Stream(device) for _ in range(aux_streams)]

    def begin(self) -> "BranchRun":
        return BranchRun(self, torch.cuda.current_stream(self.device))


class BranchRun:
    """One run_steps call over the streams: forks lazily from `main`, joins in `join`."""

    def __init__(self, streams: BranchStreams, main: torch.cuda.Stream) -> None:
        self.streams = streams
        self.main = main
        self.fork = main.record_event()
        self.forked: set[int] = set()
        self.events: dict[int, torch.cuda.Event] = {}

    def stream_for(self, index: int) -> torch.cuda.Stream | None:
        """The stream step `index` runs on, made to wait for what it reads from other streams; None
        for a host step."""
        number = self.streams.plan.stream_of[index]
        if number is None:
            return None
        stream = self.main if number == MAIN else self.streams.aux[number - 1]
        if number != MAIN and number not in self.forked:
            stream.wait_event(self.fork)
            self.forked.add(number)
        for producer in self.streams.plan.waits[index]:
            event = self.events.get(producer)
            if event is not None:  # made before this call: the fork (or an earlier join) orders it
                stream.wait_event(event)
        return stream

    def finished(self, index: int, stream: torch.cuda.Stream) -> None:
        if index in self.streams.plan.signals:
            self.events[index] = stream.record_event()

    def join(self) -> None:
        """The caller's stream waits for every auxiliary stream this run used."""
        for number in sorted(self.forked):
            self.main.wait_stream(self.streams.aux[number - 1])


def mark_used_by(tensors, stream: torch.cuda.Stream) -> None:
    """Mark every CUDA tensor among `tensors` (nested lists too) as used by `stream`."""
    for tensor in tensors:
        if isinstance(tensor, torch.Tensor):
            if tensor.is_cuda:
                tensor.record_stream(stream)
        elif isinstance(tensor, (list, tuple)):
            mark_used_by(tensor, stream)
