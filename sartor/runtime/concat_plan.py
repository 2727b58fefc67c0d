"""Concat without copies: the producers of a channel Concat write straight into slices of its output.

Detectors are built of Concats along channels (YOLO's C2f and C3k2 blocks concatenate a Split's
halves with each bottleneck's output; necks concatenate upsampled and lateral features). torch.cat
reads and writes every byte once more, and memory traffic is what limits these layers. Here the
Concat's output buffer is allocated when its first producer runs; each producer that can store into
a strided channel slice (an op with `write_into`, e.g. FusedConv's Triton tactics) writes its
channels there, a Split whose outputs are consecutive Concat inputs has its own input placed there
(its outputs are then views already in place), and the Concat copies only what is not in place.

Shapes are not known when the engine is loaded, so a run first records the shapes and dtypes of
the values involved (per input shape: `ShapeMemo`); later runs at that shape, the CUDA-graph
capture among them, use the plan.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class SliceTarget:
    """Where a value lives in a Concat's buffer: the Concat's output value and the position of the
    first Concat input whose channels it holds (a Split's input holds several consecutive ones)."""
    buffer: str
    first_input: int


@dataclass
class ShapeMemo:
    """What one input shape's runs keep: device copies of host values, and the recorded shape,
    dtype and channels-last flag of each value the Concat plan needs (None until recorded)."""
    copies: dict = field(default_factory=dict)
    value_meta: dict | None = None


@dataclass
class ConcatPlan:
    targets: dict  # value name -> SliceTarget
    concats: dict  # Concat output name -> its input names (all device values)
    values: frozenset = field(init=False)  # every value whose shape a run records

    def __post_init__(self) -> None:
        names = set(self.concats) | set(self.targets)
        for inputs in self.concats.values():
            names.update(inputs)
        self.values = frozenset(names)


def plan_concats(steps: list, graph_inputs: set, graph_outputs: set, host_values: set) -> ConcatPlan:
    """Which values are written into which Concat's buffer (see the module's docstring)."""
    producer = {name: index for index, step in enumerate(steps) for name in step.node.outputs if name}
    targets: dict[str, SliceTarget] = {}
    concats: dict[str, list] = {}

    def writable(name: str) -> bool:
        """Produced as the only output of a device step that can store into a slice."""
        if name in targets or name in graph_outputs or name in graph_inputs or name not in producer:
            return False
        step = steps[producer[name]]
        return (step.write_into is not None and not step.on_host
                and [o for o in step.node.outputs if o] == [name])

    for step in steps:
        node = step.node
        if node.op_type != "Concat" or step.on_host or step.attrs.get("axis") not in (1, -3):
            continue
        inputs = list(node.inputs)
        if len(inputs) < 2 or not all(inputs) or len(set(inputs)) != len(inputs) or any(
                name in host_values or name in graph_inputs or name not in producer or position in step.constants
                for position, name in enumerate(inputs)):
            continue
        concats[node.outputs[0]] = inputs
        position = 0
        while position < len(inputs):
            name = inputs[position]
            source = steps[producer[name]]
            parts = [o for o in source.node.outputs if o]
            span = len(parts)
            if (source.node.op_type == "Split" and source.attrs.get("axis") in (1, -3) and not source.on_host
                    and inputs[position:position + span] == list(source.node.outputs)
                    and writable(source.node.inputs[0])):
                targets[source.node.inputs[0]] = SliceTarget(node.outputs[0], position)
                position += span
                continue
            if writable(name):
                targets[name] = SliceTarget(node.outputs[0], position)
            position += 1
    return ConcatPlan(targets, concats)


def value_meta(t: torch.Tensor) -> tuple:
    """(shape, dtype, channels-last) of a value: what the Concat plan needs of it. Recorded as each
    value is made, so that the first run keeps no value past its last reader (held to the end of
    the run, every Concat input made its peak far exceed the arena: BENCHMARKS.md, issue 31)."""
    return tuple(t.shape), t.dtype, t.dim() == 4 and not t.is_contiguous() and t.is_contiguous(
        memory_format=torch.channels_last)



class ConcatBuffers:
    """One run's Concat buffers, allocated when their first producer runs."""

    def __init__(self, plan: ConcatPlan, meta: dict, device: torch.device) -> None:
        self.plan = plan
        self.meta = meta
        self.device = device
        self.buffers: dict[str, torch.Tensor] = {}
        # Run on several streams (branch_streams.py): producers on other streams than the one a
        # buffer was allocated on wait for that stream's work up to the allocation, since the
        # caching allocator may hand out memory that stream still reads.
        self.track_streams = False
        self._allocated: dict[str, tuple] = {}  # concat -> (stream, event at the allocation)

    def _usable(self, concat: str) -> bool:
        inputs = self.plan.concats[concat]
        if concat not in self.meta or any(name not in self.meta for name in inputs):
            return False
        return len(self.meta[concat][0]) == 4 and all(len(self.meta[n][0]) == 4 for n in inputs)

    def _buffer(self, concat: str) -> torch.Tensor:
        buffer = self.buffers.get(concat)
        if buffer is None:
            shape, dtype, channels_last = self.meta[concat]
            buffer = torch.empty(shape, dtype=dtype, device=self.device,
                                 memory_format=torch.channels_last if channels_last else torch.contiguous_format)
            self.buffers[concat] = buffer
            if self.track_streams:
                stream = torch.cuda.current_stream(self.device)
                self._allocated[concat] = (stream, stream.record_event())
        else:
            self._order_after_allocation(concat)
        return buffer

    def _order_after_allocation(self, concat: str) -> None:
        allocated = self._allocated.get(concat)
        if allocated is not None and torch.cuda.current_stream(self.device) != allocated[0]:
            torch.cuda.current_stream(self.device).wait_event(allocated[1])

    def _offset(self, concat: str, position: int) -> int:
        return sum(self.meta[name][0][1] for name in self.plan.concats[concat][:position])

    def slice_for(self, value: str) -> torch.Tensor | None:
        """The slice `value` should be written into, or None (no plan for it, or shapes or
        dtypes that do not fit)."""
        target = self.plan.targets.get(value)
        if target is None or value not in self.meta or not self._usable(target.buffer):
            return None
        shape, dtype, _ = self.meta[value]
        # Producers store channels-last pixels; a buffer in NCHW (a Concat fed by reshaped
        # attention outputs, say) has no slice they can write, and the Concat copies as before.
        if dtype != self.meta[target.buffer][1] or len(shape) != 4 or not self.meta[target.buffer][2]:
            return None
        buffer = self._buffer(target.buffer)
        view = buffer.narrow(1, self._offset(target.buffer, target.first_input), shape[1])
        return view if tuple(view.shape) == shape else None

    def assemble(self, concat: str, parts: list) -> torch.Tensor | None:
        """The Concat's output: its buffer with every part not already in place copied in; None
        when this Concat runs as a plain one."""
        if concat not in self.plan.concats or not self._usable(concat):
            return None
        shape = self.meta[concat][0]
        if any(tuple(p.shape[:1] + p.shape[2:]) != shape[:1] + shape[2:] for p in parts) \
                or sum(p.shape[1] for p in parts) != shape[1]:
            return None
        buffer = self.buffers.pop(concat, None)
        if buffer is None:
            buffer = self._buffer(concat)
            self.buffers.pop(concat)
        else:
            self._order_after_allocation(concat)
        self._allocated.pop(concat, None)
        offset = 0
        for part in parts:
            view = buffer.narrow(1, offset, part.shape[1])
            if not (part.data_ptr() == view.data_ptr() and part.stride() == view.stride()
                    and part.dtype == view.dtype):
                view.copy_(part)
            offset += part.shape[1]
        return buffer
