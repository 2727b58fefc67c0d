"""Runs a graph's layers in order with torch, each at its planned precision.

Values that only depend on input shapes (the Shape → Gather → Concat → Reshape chains exporters
write) are computed on the host, so reading them never synchronises the device and a whole run can
be captured as one CUDA graph. Intermediate tensors are released right after their last reader,
so peak memory follows tensor lifetimes.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ..ir import Graph, Node
from ..ir.dtypes import NUMPY_TO_TORCH, PRECISION_DTYPES
from ..ops import OpRegistry, default_registry
from ..ops.quantized import IM2COL_MAX_CHANNELS
from ..kernels.common.arrival_counters import reset_launch_site, set_launch_site
from ..kernels.pointwise.epilogue import pixel_stride
from ..passes.quantize_in_preprocess import shared_quantization
from .branch_streams import BranchPlan, BranchStreams, mark_used_by, plan_branches
from .concat_plan import ConcatBuffers, ShapeMemo, plan_concats, value_meta
from .float_outputs import plan_float_outputs

HOST_CONSTANT_LIMIT = 4096  # elements; larger constants are data, not shape arithmetic

# In channels-last engines, the inputs (by position) whose fast kernels read channels-last pixels:
# data and residual of the convolutions (and a projected QConv's projection input), data of pooling
# and upsampling.
CHANNELS_LAST_READS = {"FusedConv": (0, 3), "QConv": (0, 3, 5), "ConvChain": (0,), "MaxPool": (0,), "Resize": (0,),
                       "Upsample": (0,)}
# Layers whose every tactic reads its data input in any strides (see Executor._layout_free_feeds),
# for inputs of fewer channels than this: those run as packed pixels, im2col or the kernel's gather
# walk, which read NCHW as well as channels-last; wider inputs take the blocked walk's contiguous
# channel loads.
STRIDE_FREE_READERS = frozenset({"QConv"})
LAYOUT_FREE_MAX_CHANNELS = IM2COL_MAX_CHANNELS


@dataclass
class Step:
    node: Node
    impl: Any
    attrs: dict
    on_host: bool
    host_positions: frozenset
    compute_dtype: torch.dtype | None
    weight_for_tactic: Any = None  # the op's weight layout per tactic (OpDef.weight_for_tactic)
    write_into: Any = None  # stores the output into a given slice (OpDef.write_into)
    write_outputs: Any = None  # writes its graph outputs into given buffers (OpDef.write_outputs)
    constants: dict = field(default_factory=dict)  # input position -> prepared tensor
    release: list = field(default_factory=list)  # values whose last reader is this step
    # Profiles whose builder-chosen tactic is not `attrs["tactic"]` (profile 0's): profile ->
    # ProfileVariant. Other profiles run `attrs` and `constants` as they are.
    profile_variants: dict = field(default_factory=dict)
    capturable: bool = True  # OpDef.capturable
    data_dependent_shape: bool = False  # OpDef.data_dependent_shape
    stores_any_float: bool = False  # OpDef.stores_any_float
    constant_dtype: Any = None  # OpDef.constant_dtype


@dataclass
class RunState:
    """One run in progress (Executor.begin / run_steps / finish): the live values by name, the
    Concat buffers written in place, and the step running now (which layer raised, when one does)."""
    env: dict
    memo: ShapeMemo
    in_place: Any = None
    recorded: dict | None = None
    current: int | None = None
    output_targets: dict | None = None  # graph output -> the buffer its layer writes it into, where it can


@dataclass(frozen=True)
class StagedForm:
    """A graph input as its readers take it, which a copy of it into the engine's buffer can write in
    the same pass (`Executor.staged_form`): `dtype` in channels-last pixels where `begin` would convert
    it so, or, with `codes` (inv_scale, qmin), the INT8 codes its INT8 readers would quantize it to."""
    dtype: torch.dtype
    channels_last: bool = False
    codes: tuple[float, int] | None = None


@dataclass
class ProfileVariant:
    """How a layer runs in one profile whose tactic differs from profile 0's: its attributes with that
    tactic, and its constants with the weight in the layout that tactic reads (the very tensor of
    another profile when the layouts agree, so equal layouts are stored once)."""
    attrs: dict
    constants: dict


class Executor:
    def __init__(self, graph: Graph, weights: dict[str, torch.Tensor], device: torch.device,
                 layer_precision: dict[str, str] | None = None, channels_last: bool = False,
                 registry: OpRegistry | None = None) -> None:
        self.graph = graph
        # "cuda" names the current device; with its index, tensors' devices compare equal to it (a
        # host value's device copy is keyed on that comparison).
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        self.channels_last = channels_last
        registry = registry or default_registry()
        layer_precision = layer_precision or {}
        self.output_dtypes = {v.name: v.dtype for v in graph.outputs}
        host_values: set[str] = set()
        self.steps: list[Step] = []
        for node in graph.nodes:
            opdef = registry[node.op_type]
            on_host = self._runs_on_host(node, opdef, host_values, weights)
            if on_host:
                host_values.update(o for o in node.outputs if o)
            dtype = None if on_host else PRECISION_DTYPES.get(layer_precision.get(node.name, "fp32"))
            step = Step(node, opdef.impl, opdef.fill_attrs(node.attrs), on_host,
                        frozenset(opdef.host_inputs), dtype, opdef.weight_for_tactic, opdef.write_into,
                        write_outputs=opdef.write_outputs, capturable=opdef.capturable,
                        data_dependent_shape=opdef.data_dependent_shape,
                        stores_any_float=opdef.stores_any_float, constant_dtype=opdef.constant_dtype)
            for position, name in enumerate(node.inputs):
                if name in weights:
                    step.constants[position] = self._prepare_constant(weights[name], step, position, node)
            by_profile = node.attrs.get("tactic_by_profile") if opdef.tactics is not None else None
            if by_profile:
                self._prepare_profile_variants(step, weights, list(by_profile))
            self.steps.append(step)
        self.host_values = host_values
        feed_readers = self._feed_readers()
        self.feed_dtypes = self._feed_dtypes(feed_readers)
        self.layout_free_feeds = self._layout_free_feeds(feed_readers)
        self.feed_codes = self._feed_codes(feed_readers)
        self.constant_outputs = {v.name: weights[v.name] for v in graph.outputs if v.name in weights}
        self._plan_releases()
        self.float_outputs = plan_float_outputs(self.steps, self.output_dtypes)
        self.concat_plan = plan_concats(self.steps, {v.name for v in graph.inputs}, set(self.output_dtypes),
                                        host_values)
        self._branch_plans: dict[int, BranchPlan] = {}

    def branch_plan(self, aux_streams: int) -> BranchPlan:
        """Which stream each layer runs on with `aux_streams` auxiliary streams (branch_streams.py)."""
        if aux_streams not in self._branch_plans:
            self._branch_plans[aux_streams] = plan_branches(self.steps, aux_streams)
        return self._branch_plans[aux_streams]

    # ---- planning ---------------------------------------------------------------------
    @staticmethod
    def _runs_on_host(node: Node, opdef, host_values: set, weights: dict) -> bool:
        if node.op_type in ("Shape", "Size"):
            return True
        if not opdef.shape_arith:
            return False
        present = node.present_inputs()
        if not any(name in host_values for name in present):
            return False
        return all(name in host_values or (name in weights and weights[name].numel() <= HOST_CONSTANT_LIMIT)
                   for name in present)

    def _prepare_constant(self, tensor: torch.Tensor, step: Step, position: int, node: Node,
                          attrs: dict | None = None) -> torch.Tensor:
        attrs = step.attrs if attrs is None else attrs
        if step.on_host or position in step.host_positions:
            return tensor.cpu()
        tensor = tensor.to(self.device)
        dtype = step.compute_dtype
        if step.constant_dtype is not None:
            dtype = step.constant_dtype(position, attrs, dtype)
        if dtype is not None and tensor.is_floating_point():
            tensor = tensor.to(dtype)
        if self.channels_last and tensor.dim() == 4 and node.op_type in ("Conv", "FusedConv") and position == 1:
            tensor = tensor.contiguous(memory_format=torch.channels_last)
        if step.weight_for_tactic is not None and position == 1:
            tensor = step.weight_for_tactic(tensor, attrs.get("tactic"))
        return tensor

    def _prepare_profile_variants(self, step: Step, weights: dict, tactics: list) -> None:
        """The variants of a layer for the profiles whose tactic is not profile 0's, each weight
        prepared for its tactic once per distinct layout."""
        prepared = {position: [t] for position, t in step.constants.items()}  # distinct tensors so far
        for profile, tactic in enumerate(tactics):
            if tactic == step.attrs.get("tactic"):
                continue
            attrs = {k: v for k, v in step.attrs.items() if k != "tactic"}
            if tactic is not None:
                attrs["tactic"] = tactic
            constants = {}
            for position, base in step.constants.items():
                if position != 1 or step.weight_for_tactic is None:
                    constants[position] = base  # only the weight's layout depends on the tactic
                    continue
                tensor = self._prepare_constant(weights[step.node.inputs[position]], step, position, step.node, attrs)
                same = next((t for t in prepared[position] if _same_layout(t, tensor)), None)
                if same is None:
                    prepared[position].append(tensor)
                constants[position] = tensor if same is None else same
            step.profile_variants[profile] = ProfileVariant(attrs, constants)

    @property
    def profile_weight_bytes(self) -> int:
        """Device bytes of the weights kept in a second layout for some profile's tactic."""
        seen = {id(t) for step in self.steps for t in step.constants.values()}
        total = 0
        for step in self.steps:
            for variant in step.profile_variants.values():
                for t in variant.constants.values():
                    if id(t) not in seen:
                        seen.add(id(t))
                        total += t.numel() * t.element_size()
        return total

    def _feed_readers(self) -> dict[str, list[Step]]:
        """Each graph input's reading steps."""
        readers: dict[str, list[Step]] = {v.name: [] for v in self.graph.inputs}
        for step in self.steps:
            for name in step.node.present_inputs():
                if name in readers:
                    readers[name].append(step)
        return readers

    @staticmethod
    def _feed_dtypes(feed_readers: dict[str, list[Step]]) -> dict[str, torch.dtype]:
        """Graph inputs whose every device reader computes in one float dtype: converted to it on
        arrival, in the same copy as the change to channels-last (one pass over the input, not two)."""
        feed_dtypes = {}
        for name, steps in feed_readers.items():
            dtypes = {None if step.on_host else step.compute_dtype for step in steps}
            if len(dtypes) == 1 and None not in dtypes:
                feed_dtypes[name] = dtypes.pop()
        return feed_dtypes

    @staticmethod
    def _layout_free_feeds(feed_readers: dict[str, list[Step]]) -> frozenset[str]:
        """Graph inputs read only by layers that take any strides: when they have few channels
        (LAYOUT_FREE_MAX_CHANNELS) they stay as they arrive. An INT8 (FP8) stem's pixel packing,
        im2col or implicit GEMM reads its taps from the NCHW input as it would from a channels-last copy,
        so the copy (a transposition into 3-channel pixels) is skipped
        (docs/decisions/0018-few-channel-inputs-stay-nchw.md)."""
        return frozenset(name for name, steps in feed_readers.items()
                         if steps and all(not step.on_host and step.node.op_type in STRIDE_FREE_READERS
                                          for step in steps))

    def _feed_codes(self, feed_readers: dict[str, list[Step]]) -> dict[str, tuple[float, int]]:
        """Graph inputs whose every reader is a device INT8 layer quantizing it alike as its data
        input: {name: (inv_scale, qmin)} of their quantization (passes/quantize_in_preprocess.py)."""
        codes = {}
        for name, steps in feed_readers.items():
            if not steps or name in self.output_dtypes or any(step.on_host for step in steps):
                continue
            found = shared_quantization([step.node for step in steps], name)
            if found is not None:
                codes[name] = (found[1], found[2])
        return codes

    def _converted_form(self, name: str, tensor: torch.Tensor) -> StagedForm | None:
        """The dtype and layout `begin` converts a feed to before its readers read it, or None where
        they read it as it arrives. Integer feeds (raw uint8 frames, N×H×W×3) are not images in NCHW;
        few-channel inputs of layers that read any strides stay NCHW (`_layout_free_feeds`)."""
        if not (self.channels_last and tensor.dim() == 4 and tensor.is_cuda and tensor.is_floating_point()):
            return None
        if name in self.layout_free_feeds and tensor.shape[1] < LAYOUT_FREE_MAX_CHANNELS:
            return None
        return StagedForm(self.feed_dtypes.get(name) or tensor.dtype, channels_last=True)

    def staged_form(self, name: str, tensor: torch.Tensor) -> StagedForm | None:
        """What a copy of the feed `tensor` into the engine's own buffer should write so that the run
        reads it as it is (docs/decisions/0068): the INT8 codes its readers quantize it to, where they
        would read the float values as they arrive, else the form `begin` converts it to; None where
        the readers take the feed as it is."""
        converted = self._converted_form(name, tensor)
        if converted is None and name in self.feed_codes and tensor.is_floating_point():
            return StagedForm(torch.int8, codes=self.feed_codes[name])
        return converted

    def _plan_releases(self) -> None:
        last_reader: dict[str, int] = {}
        for index, step in enumerate(self.steps):
            for name in step.node.present_inputs():
                last_reader[name] = index
        keep = {v.name for v in self.graph.outputs}
        for name, index in last_reader.items():
            if name not in keep:
                self.steps[index].release.append(name)

    # ---- execution --------------------------------------------------------------------
    def run(self, feeds: dict[str, torch.Tensor], memo: ShapeMemo | None = None,
            observe=None, before=None, profile: int = 0,
            branches: BranchStreams | None = None) -> dict[str, torch.Tensor]:
        """Execute once. `memo` is what runs at one input shape keep: device copies of host values
        that device layers read as data (a caller capturing CUDA graphs fills it on a warm-up run so
        the capture copies nothing) and the value shapes that let Concats be written in place
        (concat_plan.py; recorded by the first run with this memo, used by the next ones).
        `observe(step_index, step, outputs)` sees every layer's outputs and `before(step_index, step,
        args)` its arguments (build-time analyses and tactic timing). Each layer runs the tactic the
        builder chose for `profile`, the profile these inputs fall in. `branches`: run independent
        branches on the context's auxiliary streams (branch_streams.py; CUDA only)."""
        state = self.begin(feeds, memo)
        self.run_steps(state, 0, len(self.steps), observe, before, profile, branches)
        return self.finish(state)

    def begin(self, feeds: dict[str, torch.Tensor], memo: ShapeMemo | None = None,
              output_targets: dict | None = None) -> RunState:
        """A run's start: the feeds in the layout and dtype their readers take. `run` is `begin`,
        `run_steps` over every layer, `finish`; a piecewise CUDA graph (runtime/capture.py) captures
        the parts apart. `output_targets`: {graph output: tensor} its layer writes it into where the op
        can (OpDef.write_outputs), else the output is made as usual."""
        memo = ShapeMemo() if memo is None else memo
        in_place = ConcatBuffers(self.concat_plan, memo.value_meta, self.device) \
            if memo.value_meta is not None and self.concat_plan.concats else None
        recorded = {} if memo.value_meta is None and self.concat_plan.concats else None
        env: dict[str, torch.Tensor] = {}
        for name, tensor in feeds.items():
            form = self._converted_form(name, tensor)
            if form is not None:  # a no-op for a feed already so (the context's staged copy)
                tensor = tensor.to(dtype=form.dtype, memory_format=torch.channels_last)
            env[name] = tensor
        return RunState(env, memo, in_place, recorded, output_targets=output_targets or None)

    def run_steps(self, state: RunState, start: int, stop: int, observe=None, before=None,
                  profile: int = 0, branches: BranchStreams | None = None) -> None:
        """Run layers start..stop-1 on `state` (see `run`). With `branches` (and no `observe` or
        `before`, whose analyses see layers one at a time), each layer runs on its planned stream,
        and the call returns with the caller's stream waiting for all of them."""
        streams = branches.begin() if branches is not None and observe is None and before is None else None
        if streams is not None and state.in_place is not None:
            state.in_place.track_streams = True
        try:
            for index in range(start, stop):
                state.current = index
                stream = streams.stream_for(index) if streams is not None else None
                if stream is None:
                    self._run_one(index, state, profile, observe, before)
                    continue
                with torch.cuda.stream(stream):
                    self._run_one(index, state, profile, stream=stream)
                streams.finished(index, stream)
        finally:
            if streams is not None:
                streams.join()
                # Outputs made on an auxiliary stream are read on the caller's: their memory must
                # not go back to the auxiliary stream's pool before the caller is done with it.
                mark_used_by([state.env[v.name] for v in self.graph.outputs if v.name in state.env], streams.main)
        state.current = None

    def _run_one(self, index: int, state: RunState, profile: int, observe=None, before=None,
                 stream: torch.cuda.Stream | None = None) -> None:
        """Layer `index` of a run (run_steps). On an auxiliary stream (`stream`), what it reads and
        writes is marked used by that stream, and values it converts are its own (another stream's
        reader converts again rather than read a conversion not yet made)."""
        env, recorded, in_place = state.env, state.recorded, state.in_place
        step = self.steps[index]
        variant = step.profile_variants.get(profile)
        constants, attrs = (step.constants, step.attrs) if variant is None else (variant.constants, variant.attrs)
        args = self._arguments(step, env, state.memo.copies, constants, on_branch=stream is not None)
        if stream is not None:
            mark_used_by(args, stream)
        if before is not None:
            before(index, step, args)
        site = set_launch_site(index)  # the layer's own arrival counters in a context's (arrival_counters.py)
        try:
            result = self._write_outputs(step, args, attrs, state.output_targets)
            if result is None:
                result = self._run_step(step, args, in_place, attrs)
        finally:
            reset_launch_site(site)
        results = result if isinstance(result, (tuple, list)) else (result,)
        if stream is not None:
            mark_used_by(results, stream)
        for name, value in zip(step.node.outputs, results):
            if name:
                env[name] = value
                if recorded is not None and name in self.concat_plan.values:
                    recorded[name] = value_meta(value)
        if observe is not None:
            observe(index, step, results[:len(step.node.outputs)])
        for name in step.release:
            env.pop(name, None)

    def finish(self, state: RunState) -> dict[str, torch.Tensor]:
        """The graph's outputs of a run whose layers have all run."""
        if state.recorded is not None:
            state.memo.value_meta = state.recorded  # each value's value_meta, taken as it was made
            state.recorded = None
        return {v.name: self._finish_output(v.name, state.env, state.memo.copies) for v in self.graph.outputs}

    @staticmethod
    def _write_outputs(step: Step, args: list, attrs: dict, targets: dict | None):
        """The layer's outputs from its op's write_outputs given their targets (RunState.output_targets):
        in the targets where its tactic can write there; None where it has no targets, its op no
        write_outputs, or the targets do not fit (the layer then runs as usual)."""
        if not targets or step.write_outputs is None:
            return None
        outs = [targets.get(name) if name else None for name in step.node.outputs]
        return step.write_outputs(args, attrs, outs) if any(out is not None for out in outs) else None

    @staticmethod
    def _run_step(step: Step, args: list, in_place: ConcatBuffers | None, attrs: dict):
        if in_place is not None:
            outputs = step.node.outputs
            if step.node.op_type == "Concat":
                assembled = in_place.assemble(outputs[0], args)
                if assembled is not None:
                    return assembled
            elif step.write_into is not None and len([o for o in outputs if o]) == 1:
                out = in_place.slice_for(outputs[0])
                if out is not None:
                    written = step.write_into(args, attrs, out)
                    if written is not None:
                        return written
        return step.impl(args, attrs)

    def _arguments(self, step: Step, env: dict, device_copies: dict, constants: dict,
                   on_branch: bool = False) -> list:
        args = []
        for position, name in enumerate(step.node.inputs):
            if not name:
                args.append(None)
                continue
            if position in constants:
                args.append(constants[position])
                continue
            value = env[name]
            if not step.on_host and position not in step.host_positions and name in self.host_values \
                    and value.dim() > 0:
                value = self._device_copy(name, value, device_copies, on_branch)
            if step.compute_dtype is not None and value.is_floating_point() and value.dtype != step.compute_dtype \
                    and name not in self.host_values:
                value = value.to(step.compute_dtype)
            if self.channels_last and position in CHANNELS_LAST_READS.get(step.node.op_type, ()) \
                    and value.dim() == 4 and pixel_stride(value) is None and name not in self.host_values \
                    and name not in self.layout_free_feeds:
                # An NCHW tensor (a Reshape of a MatMul in an attention block) would make this
                # layer and, through its output, every layer after it run NCHW: cuDNN with layout
                # transforms and no Triton tactic. One copy here, kept for the value's other readers.
                value = value.contiguous(memory_format=torch.channels_last)
                if env.get(name) is not None and env[name].dtype == value.dtype and not on_branch:
                    env[name] = value
            args.append(value)
        return args

    def _device_copy(self, name: str, value: torch.Tensor, device_copies: dict,
                     on_branch: bool = False) -> torch.Tensor:
        if value.device == self.device:
            return value
        # Host values depend on input shapes only, and callers keep one cache per input shape.
        cached = device_copies.get(name)
        if cached is None:
            cached = value.to(self.device)
            device_copies[name] = cached
            if on_branch and not torch.cuda.is_current_stream_capturing():
                # Readers on other streams take it from the cache without an event: it must have
                # landed. Made on the warm-up runs before a capture, never inside one.
                torch.cuda.current_stream(self.device).synchronize()
        return cached

    def _finish_output(self, name: str, env: dict, device_copies: dict) -> torch.Tensor:
        value = env[name] if name in env else self.constant_outputs[name]
        if value.device != self.device:
            value = self._device_copy(name, value, device_copies)
        dtype = NUMPY_TO_TORCH.get(self.output_dtypes.get(name))
        if dtype is not None and value.dtype != dtype:
            value = value.to(dtype)
        return value.contiguous()


def _same_layout(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two prepared weights are interchangeable: one tensor, or equal values in equal memory."""
    if a is b:
        return True
    return (a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride() and a.device == b.device
            and torch.equal(a, b))
