"""ExecutionContext: the gate (names, ranks, dtypes, profile ranges), device transfer, and on CUDA
one captured CUDA graph per input shape, replayed on later runs of that shape."""
from __future__ import annotations

import contextlib
import math
import logging
import time
import weakref
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from ..errors import ConfigError, InputError, ProfileError
from ..ir.dtypes import NUMPY_TO_TORCH, TORCH_TO_NUMPY
from ..kernels.common.arrival_counters import ArrivalCounters, bound
from ..ops.quantized import quantize_into
from .branch_streams import MAX_AUX_STREAMS, BranchStreams
from .capture import CaptureFailed, EagerLayer, PiecewiseGraph, capture_pieces, first_line
from .concat_plan import ShapeMemo
from .executor import StagedForm

if TYPE_CHECKING:
    from .engine import Engine

log = logging.getLogger("sartor.capture")

WARMUP_RUNS_BEFORE_CAPTURE = 2
# A capture that fails is tried again before what failed runs eagerly: another thread's call (32
# NVDEC decoders starting beside the first batch) can invalidate a capture that nothing in the
# engine broke. A failure outside any one layer, which would make the whole run eager, is tried
# again a pause later, when those threads have moved on.
CAPTURE_TRIES = 3
WHOLE_CAPTURE_PAUSE_S = 0.2


class _Marker:
    """A graph key's item that no input's (name, shape) can equal: names are strings."""
    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return self.name


# The key suffix of a shape's graph captured from inputs in their staged forms (_run_graph).
STAGED = ((_Marker("staged"), ()),)
# The key item's first part of a graph that reads its inputs at the caller's addresses (BoundAddresses),
# and how many such graphs a context keeps: a Pipeline's staging slots, a camera's ring of buffers.
AT = _Marker("at")
MAX_BOUND_GRAPHS = 8
MAX_REMEMBERED_SHAPES = 1024  # input shapes whose profile a context remembers (a dynamic-shape caller may send many)


@contextlib.contextmanager
def matmul_precision(tf32: bool):
    """TF32 on or off for cuBLAS and cuDNN for the duration (FP32 engines must not use it)."""
    saved = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    torch.backends.cuda.matmul.allow_tf32 = tf32
    torch.backends.cudnn.allow_tf32 = tf32
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


class ExecutionContext:
    def __init__(self, engine: "Engine", profile: int | None = None, use_cuda_graphs: bool = True,
                 aux_streams: int = 0, bound_graphs: int = MAX_BOUND_GRAPHS) -> None:
        """`aux_streams`: run the engine's independent branches on this many more CUDA streams
        (branch_streams.py; CUDA engines only, ignored on the CPU). `bound_graphs`: how many buffers the
        caller reuses get a graph that reads them where they are (BoundAddresses); 0 copies every input
        into the engine's own buffers."""
        if profile is not None and not 0 <= profile < len(engine.profiles):
            raise ProfileError(f"profile {profile} does not exist; the engine has {len(engine.profiles)} "
                               f"profile(s) (0..{len(engine.profiles) - 1})")
        if not isinstance(aux_streams, int) or isinstance(aux_streams, bool) or not 0 <= aux_streams <= MAX_AUX_STREAMS:
            raise ConfigError(f"aux_streams must be a whole number from 0 to {MAX_AUX_STREAMS}; got {aux_streams!r}")
        if not isinstance(bound_graphs, int) or isinstance(bound_graphs, bool) or bound_graphs < 0:
            raise ConfigError(f"bound_graphs must be a whole number, 0 or more; got {bound_graphs!r}")
        self.engine = engine
        self.profile = profile
        self.aux_streams = aux_streams  # as asked; `branches` is None where it does not apply (the CPU)
        self.use_cuda_graphs = use_cuda_graphs and engine.device.type == "cuda" and engine.graph_capturable
        self._declared = {v.name: v for v in engine.inputs}
        self._frames = engine.input_format  # raw frames of one size (--input-format), or None
        self._profile_of: dict[tuple, int] = {}  # input shapes -> the profile that admits them
        self._captured: dict[tuple, PiecewiseGraph] = {}
        self._addresses = BoundAddresses(bound_graphs)  # input addresses that recur (_run_graph)
        self._memos: dict[tuple, ShapeMemo] = {}  # per input shape (see Executor.run)
        # What every captured shape of this context shares, as a TensorRT context's one device
        # memory region: the graphs' memory pool, one buffer per input at the profiles' largest
        # shape, and one per output for the shapes captured after the first (which copy their
        # outputs there). Without them each warmed batch size kept its own activations, inputs and
        # outputs, many times what the engine declares (BENCHMARKS.md, "sharing a GPU").
        self._graph_pool = None
        self._input_store: dict[tuple, torch.Tensor] = {}  # (input name, staged) -> buffer (_shared_input)
        self._forms: dict[tuple, dict] = {}  # input shapes -> the inputs' staged forms (_staged_forms)
        self._scalars: dict[str, torch.Tensor] | None = None  # per input, what _declared_like expands
        self._output_store: dict[str, torch.Tensor] = {}
        self.stream = torch.cuda.Stream(engine.device) if engine.device.type == "cuda" else None
        # The kernels' arrival counters (split-K reduced in the kernel), this context's own: another
        # context's kernels may run at the same time (kernels/common/arrival_counters.py).
        self.arrival_counters = ArrivalCounters()
        self.branches = (BranchStreams(engine.executor.branch_plan(aux_streams), engine.executor.device, aux_streams)
                         if aux_streams and self.stream is not None else None)
        if engine.device.type == "cuda":
            # cuDNN times its algorithms per shape on first use (captured before the CUDA graph):
            # the library-level tactic choice until sartor's own tactics replace it.
            torch.backends.cudnn.benchmark = True

    # ---- the gate -----------------------------------------------------------------------
    def _profiles_text(self) -> str:
        chosen = [self.profile] if self.profile is not None else range(len(self.engine.profiles))
        return "; ".join(f"profile {k}: {self.engine.profiles[k].describe()}" for k in chosen)

    def check_inputs(self, feeds: dict[str, Any]) -> dict[str, tuple]:
        """Validate names, ranks, dtypes and shapes; returns the input shapes."""
        if not isinstance(feeds, dict):
            raise InputError("inputs must be a dict of {name: array}")
        declared = self._declared
        unknown = sorted(set(feeds) - set(declared))
        if unknown:
            raise InputError(f"unknown input name(s) {', '.join(unknown)}; the engine's inputs are "
                             f"{', '.join(declared)}")
        missing = [name for name in declared if name not in feeds]
        if missing:
            raise InputError(f"missing input(s) {', '.join(missing)}")
        shapes = {}
        for name, value in feeds.items():
            if not isinstance(value, (np.ndarray, torch.Tensor)):
                raise InputError(f"input {name!r} must be a numpy array or torch tensor, not {type(value).__name__}")
            info = declared[name]
            dtype = TORCH_TO_NUMPY.get(value.dtype) if isinstance(value, torch.Tensor) else str(value.dtype)
            if dtype != info.dtype:
                raise InputError(f"input {name!r} has dtype {dtype}; the engine expects {info.dtype}")
            shape = tuple(int(d) for d in value.shape)
            if info.shape is not None and len(shape) != len(info.shape):
                raise InputError(f"input {name!r} has rank {len(shape)} (shape {'x'.join(map(str, shape))}); "
                                 f"the engine expects rank {len(info.shape)}")
            shapes[name] = shape
        frames = self._frames
        if frames is not None and frames_differ(shapes.get(frames.name), frames.size):
            got = shapes[frames.name]
            raise InputError(f"input {frames.name!r} holds {got[1]}x{got[2]} frames (shape {'x'.join(map(str, got))}); "
                             f"the engine takes {frames.size[0]}x{frames.size[1]}x3 uint8 frames (built with "
                             f"--input-format {frames.describe()}): resize them first or rebuild for this size")
        return shapes

    def select_profile(self, shapes: dict[str, tuple]) -> int:
        key = tuple(shapes.items())
        found = self._profile_of.get(key)
        if found is not None:
            return found
        candidates = [self.profile] if self.profile is not None else range(len(self.engine.profiles))
        for k in candidates:
            if self.engine.profiles[k].admits(shapes):
                if len(self._profile_of) < MAX_REMEMBERED_SHAPES:
                    self._profile_of[key] = k
                return k
        described = ", ".join(f"{name} {'x'.join(map(str, s))}" for name, s in shapes.items())
        raise ProfileError(f"input shape(s) {described} outside the allowed ranges ({self._profiles_text()})")

    # ---- running ------------------------------------------------------------------------
    def run(self, feeds: dict[str, Any], *, staged: bool = False) -> dict[str, Any]:
        """Run once. numpy in → numpy out (copies); torch in → torch tensors on the engine's device.
        `staged`: the inputs that have a staged form (`staged_forms`) come in it, as a preprocessing
        kernel wrote them (an INT8 stem's codes, channels-last float16), and are copied in as they are.

        On CUDA the returned tensors are this context's output buffers: valid until its next run.
        """
        if staged:
            shapes, forms = self._check_staged(feeds)
        else:
            shapes, forms = self.check_inputs(feeds), None
        profile = self.select_profile(shapes)  # its tactics run these inputs
        as_numpy = any(isinstance(v, np.ndarray) for v in feeds.values())
        device = self.engine.device
        tensors = {name: (torch.from_numpy(v if v.flags.c_contiguous else np.array(v, order="C")) if isinstance(v, np.ndarray) else v)
                   for name, v in feeds.items()}
        tensors = {name: t.to(device, non_blocking=True) if t.device != device else t for name, t in tensors.items()}
        with bound(self.arrival_counters):
            if self.use_cuda_graphs:
                outputs = self._run_graph(tensors, shapes, profile, forms)
            else:
                with matmul_precision(self.engine.precision == "tf32"):
                    outputs = self._run_eager(tensors, shapes, profile)
        if as_numpy:
            return {name: t.detach().cpu().numpy() for name, t in outputs.items()}
        return outputs

    def memo_for(self, key: tuple) -> ShapeMemo:
        memo = self._memos.get(key)
        if memo is None:
            memo = self._memos[key] = ShapeMemo()
        return memo

    def _run_eager(self, tensors: dict, shapes: dict, profile: int = 0) -> dict:
        key = tuple(sorted(shapes.items()))
        with torch.inference_mode():
            if self.stream is None:
                return self.engine.executor.run(tensors, self.memo_for(key), profile=profile)
            self.stream.wait_stream(torch.cuda.current_stream(self.engine.device))
            with torch.cuda.stream(self.stream):
                out = self.engine.executor.run(tensors, self.memo_for(key), profile=profile, branches=self.branches)
            torch.cuda.current_stream(self.engine.device).wait_stream(self.stream)
            return out

    def _run_graph(self, tensors: dict, shapes: dict, profile: int = 0, staged: dict | None = None) -> dict:
        """`staged`: the staged forms the inputs already come in (`run(staged=True)`), or None."""
        key = tuple(sorted(shapes.items()))
        forms = {}
        captured = self._captured.get(key)
        own = captured is not None and all(t.data_ptr() == captured.inputs[name].data_ptr()
                                           for name, t in tensors.items())
        at_key = None if own or not all(map(_dense, tensors.values())) else \
            key + (STAGED if staged else ()) + ((AT, address_of(tensors)),)
        # A buffer the caller reuses: a graph of its own reads the inputs where they are, no copy.
        bound_graph = None if at_key is None else self._captured.get(at_key)
        if bound_graph is None and at_key is not None and self._addresses.recurs(at_key, tensors):
            bound_graph = self._bind(tensors, at_key, profile)
        if bound_graph is not None:
            captured = bound_graph
        elif staged:  # already as the staged graph reads them: a plain copy into its buffers
            captured = self._captured_for(tensors, key + STAGED, profile)
        elif not own:
            # Not the graph's own buffers (input_buffers): the inputs are copied in, and where their
            # readers take them in another form the copy writes that, for a graph captured so.
            forms = self._staged_forms(key, tensors)
            if not forms:
                captured = self._captured_for(tensors, key, profile)
            else:
                captured = self._captured.get(key + STAGED)
                if captured is None:
                    captured = self._captured_for(_staged(tensors, forms), key + STAGED, profile)
        current = torch.cuda.current_stream(self.engine.device)
        self.stream.wait_stream(current)
        with torch.cuda.stream(self.stream):
            for name, t in tensors.items():
                bound = captured.inputs[name]
                if t.data_ptr() != bound.data_ptr():
                    _copy_in(t, bound, forms.get(name))
            outputs = captured.replay(self.engine.executor, profile)
        current.wait_stream(self.stream)
        return outputs

    def _staged_forms(self, key: tuple, tensors: dict) -> dict:
        """{input name: StagedForm} of the inputs a copy writes in another form than they come in
        (Executor.staged_form; docs/decisions/0068), for this input shape; {} when none."""
        forms = self._forms.get(key)
        if forms is None:
            executor = self.engine.executor
            forms = {name: form for name, t in tensors.items()
                     if (form := executor.staged_form(name, t)) is not None}
            if len(self._forms) < MAX_REMEMBERED_SHAPES:
                self._forms[key] = forms
        return forms

    def staged_forms(self, shapes: dict[str, tuple]) -> dict[str, StagedForm]:
        """{input name: StagedForm} for inputs of these shapes in the declared dtypes: the form a copy
        into the engine writes them in (the INT8 codes its INT8 readers take, or the dtype and layout
        the run converts them to; docs/decisions/0068). A caller that prepares its inputs can write
        them so, and `run(feeds, staged=True)` copies them in as they are; inputs not listed come as
        declared. The gate applies as in `run`."""
        stand_ins = self._declared_like(shapes)
        checked = self.check_inputs(stand_ins)
        self.select_profile(checked)
        return self._staged_forms(tuple(sorted(checked.items())), stand_ins)

    def _declared_like(self, shapes: dict[str, tuple]) -> dict[str, Any]:
        """Stand-ins of these shapes in the declared dtypes on the engine's device, holding no memory
        of their own (what a staged form depends on); None for an unknown name, which the gate refuses."""
        if self._scalars is None:
            self._scalars = {name: torch.empty((), dtype=NUMPY_TO_TORCH[v.dtype], device=self.engine.device)
                             for name, v in self._declared.items()}
        return {name: self._scalars[name].expand(tuple(int(d) for d in shape)) if name in self._scalars else None
                for name, shape in shapes.items()}

    def _check_staged(self, feeds: dict[str, Any]) -> tuple[dict, dict]:
        """The gate of `run(staged=True)`: names and shapes as `check_inputs` checks them, each input
        with a staged form in that form's dtype and the others in the declared one. Returns the
        shapes and the forms."""
        if not isinstance(feeds, dict):
            raise InputError("inputs must be a dict of {name: array}")
        stand_ins = self._declared_like({name: tuple(v.shape) for name, v in feeds.items()
                                         if isinstance(v, (np.ndarray, torch.Tensor))})
        shapes = self.check_inputs({name: stand_ins.get(name, value) for name, value in feeds.items()})
        forms = self._staged_forms(tuple(sorted(shapes.items())), stand_ins)
        for name, value in feeds.items():
            form = forms.get(name)
            want = form.dtype if form is not None else NUMPY_TO_TORCH[self._declared[name].dtype]
            got = value.dtype if isinstance(value, torch.Tensor) else NUMPY_TO_TORCH.get(str(value.dtype))
            if got != want:
                held = (f"its staged form, {_describe_form(form)}" if form is not None
                        else f"{TORCH_TO_NUMPY[want]}, as declared (it has no staged form)")
                raise InputError(f"input {name!r} has dtype {TORCH_TO_NUMPY.get(got, got)}; run(staged=True) "
                                 f"takes {held}")
        return shapes, forms

    def input_buffers(self, shapes: dict[str, tuple]) -> dict[str, torch.Tensor]:
        """The buffers the engine reads its inputs of these shapes from, on its device, as
        TensorRT's bound input buffers: fill them in place (a preprocessing kernel can write its
        output there) and `run` them, and no copy precedes the run. With CUDA graphs these are the
        inputs, in the declared dtype and layout, of the graph captured from them (now, from zeros,
        if it was not yet: a copied run of the shape captures a graph of its staged inputs instead,
        decision 0068, so call this at setup, as `warmup` is); without them, new tensors that `run`
        reads as any other input. The gate applies: unknown names, missing inputs and shapes outside
        the profiles are refused as `run` refuses them."""
        # An unknown name gets no tensor: check_inputs refuses it before it reads any value.
        feeds = {name: torch.zeros(tuple(int(d) for d in shape), dtype=NUMPY_TO_TORCH[self._declared[name].dtype],
                                   device=self.engine.device) if name in self._declared else None
                 for name, shape in shapes.items()}
        checked = self.check_inputs(feeds)
        profile = self.select_profile(checked)
        if not self.use_cuda_graphs:
            return feeds
        return dict(self._captured_for(feeds, tuple(sorted(checked.items())), profile).inputs)

    def _bind(self, tensors: dict, key: tuple, profile: int) -> PiecewiseGraph:
        """A graph that reads `tensors` where they are (decision 0069). A whole graph keeps only their
        addresses, so the caller's buffers are not held: when one is freed, the graph goes with it
        and its place among the context's bound graphs is free again. A graph in pieces runs its
        first eager piece from the tensors, so it keeps them for the context's life."""
        captured = self._captured_for(tensors, key, profile)
        if captured.whole:
            captured.inputs = {name: _Address(t.data_ptr()) for name, t in tensors.items()}
            this = weakref.ref(self)
            for t in tensors.values():
                weakref.finalize(t if t._base is None else t._base, _unbind, this, key)
        return captured

    def _captured_for(self, tensors: dict, key: tuple, profile: int) -> PiecewiseGraph:
        """The graph of this input shape, captured from `tensors` on first use. The library
        kernels' precision is fixed when they are captured, so replays need not set it (host time
        that a batch-1 latency would include)."""
        captured = self._captured.get(key)
        if captured is None:
            with matmul_precision(self.engine.precision == "tf32"), bound(self.arrival_counters):
                captured = self._captured[key] = self._capture(tensors, key, profile)
        return captured

    def _capture(self, tensors: dict, key: tuple, profile: int = 0) -> PiecewiseGraph:
        """Capture this shape's run: one CUDA graph, or pieces around the layers that cannot be
        captured (runtime/capture.py). A layer whose capture fails is run eagerly from then on, for
        every context of the engine, with one warning naming it."""
        executor = self.engine.executor
        device = self.engine.device
        if key[-1][0] is AT:  # the graph reads the caller's tensors where they are
            static_in = dict(tensors)
        else:
            staged = key[-len(STAGED):] == STAGED
            static_in = {name: self._shared_input(name, t, staged) for name, t in tensors.items()}
        memo = self.memo_for(key)
        # The first shape's outputs stay where its graph wrote them (no copy); the others' go to the
        # shared output buffers, so that outputs, like activations, are held once.
        # Their layers write them there where their ops can (OpDef.write_outputs): no copy.
        outputs_into = self._shared_outputs if self._captured else None
        with torch.inference_mode():
            self.stream.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(self.stream):
                for _ in range(WARMUP_RUNS_BEFORE_CAPTURE):
                    warm = executor.run(static_in, memo, profile=profile, branches=self.branches)
            self.stream.synchronize()
            targets = None
            if outputs_into is not None:
                targets = {name: view for name, value in warm.items()
                           if (view := self._shared_view(name, value)) is not None}
            failures: dict[int | None, int] = {}  # the layer a capture failed at (None: outside any) -> times
            while True:
                eager = {layer.index for layer in self.engine.eager_layers}
                before = torch.cuda.current_stream(device)
                try:
                    captured = capture_pieces(executor, static_in, memo, profile, eager, self.stream,
                                              self._graph_pool, outputs_into, self.branches, targets)
                except CaptureFailed as failed:
                    torch.cuda.set_stream(before)  # a failed capture may leave its stream current
                    site = None if self._outside_any_layer(failed, eager) else failed.index
                    failures[site] = failures.get(site, 0) + 1
                    if failures[site] < CAPTURE_TRIES:
                        log.info("CUDA graph capture failed %s (%s); trying again",
                                 "outside any one layer" if site is None else f"at layer {site}",
                                 first_line(failed.cause))
                        if site is None:
                            time.sleep(WHOLE_CAPTURE_PAUSE_S * failures[site])
                    else:
                        self._learn_eager_layer(failed, eager)
                    # A fresh stream: the allocator may still route the failed capture stream's
                    # allocations to its pool.
                    self.stream = torch.cuda.Stream(device)
                    self.stream.wait_stream(before)
                    if self.branches is not None:  # so for the auxiliary streams it had forked
                        self.branches = BranchStreams(self.branches.plan, device, len(self.branches.aux))
                    self._graph_pool = None  # nor share the failed capture's pool
                    continue
                self._graph_pool = captured.pool
                if not self._captured and captured.outputs:
                    self._size_output_store(captured.outputs)
                return captured

    def _largest_batch(self) -> int:
        return max(int(r.max[0]) for p in self.engine.profiles for r in p.shapes.values() if len(r.max))

    def _shared_input(self, name: str, t: torch.Tensor, staged: bool = False) -> torch.Tensor:
        """`t` copied into this context's buffer for input `name`, as a view of `t`'s shape (channels-last
        where `t` is). The graphs of copied inputs in their staged form (`staged`) share a buffer of
        their own: a copied run never writes the buffer of the engine's own (`input_buffers`)."""
        store = self._input_store.get((name, staged))
        if store is None:
            count = max(math.prod(p.shapes[name].max) for p in self.engine.profiles if name in p.shapes)
            store = self._input_store[(name, staged)] = torch.empty(count, dtype=t.dtype, device=t.device)
        if store.dtype != t.dtype or store.numel() < t.numel():
            return t.clone()
        flat = store[:t.numel()]
        channels_last = t.dim() == 4 and not t.is_contiguous() and t.is_contiguous(memory_format=torch.channels_last)
        view = flat.as_strided(t.shape, t.stride()) if channels_last else flat.view(t.shape)
        view.copy_(t)
        return view

    def _size_output_store(self, outputs: dict) -> None:
        """One buffer per output, for the largest batch (outputs scale with the batch, their first
        dimension); an output of another shape later keeps its own memory (`_shared_outputs`)."""
        largest = self._largest_batch()
        for name, value in outputs.items():
            if value.dim() and value.shape[0]:
                count = value.numel() // value.shape[0] * largest
                self._output_store[name] = torch.empty(count, dtype=value.dtype, device=value.device)

    def _shared_view(self, name: str, value: torch.Tensor) -> torch.Tensor | None:
        """Output `name`'s place in its shared buffer, shaped as `value`, where it fits; else None."""
        store = self._output_store.get(name)
        if store is None or store.dtype != value.dtype or store.numel() < value.numel():
            return None
        return store[:value.numel()].view(value.shape)

    def _shared_outputs(self, outputs: dict) -> dict:
        """Inside a graph's capture: each output in its shared buffer where it fits, copied there
        unless its layer wrote it there (a write_outputs op given the buffer)."""
        shared = {}
        for name, value in outputs.items():
            view = self._shared_view(name, value)
            if view is None:
                shared[name] = value
            elif view.data_ptr() == value.data_ptr() and view.stride() == value.stride():
                shared[name] = value
            else:
                shared[name] = view
                view.copy_(value)
        return shared

    def _outside_any_layer(self, failed: CaptureFailed, eager: set) -> bool:
        """Whether the failure names no layer that could be run eagerly on its own."""
        index = failed.index
        return index is None or index in eager or self.engine.executor.steps[index].on_host

    def _learn_eager_layer(self, failed: CaptureFailed, eager: set) -> None:
        steps = self.engine.executor.steps
        if self._outside_any_layer(failed, eager):
            # Not a layer's doing (or the layer already ran eagerly): the whole run goes eager.
            candidates = [i for i, step in enumerate(steps) if not step.on_host and i not in eager]
            reason = f"the CUDA graph capture failed outside any one layer: {first_line(failed.cause)}"
        else:
            candidates = [failed.index]
            reason = f"its CUDA graph capture failed: {first_line(failed.cause)}"
        if not candidates:
            raise failed
        learned = [EagerLayer(i, steps[i].node.name, steps[i].node.op_type, reason) for i in candidates]
        self.engine.eager_layers = sorted(self.engine.eager_layers + learned, key=lambda layer: layer.index)
        first = learned[0]
        log.warning("layer %s (%s) runs outside the CUDA graph: %s", first.name, first.op_type, reason)

    def warmup(self, iterations: int = 1) -> None:
        """Run every profile this context may use at max, opt and min shapes, so that graphs are
        captured and kernels loaded before the first real request. The largest shape first: the
        first captured keeps its outputs where its graph wrote them, the others copy theirs to the
        context's shared output buffers, and full batches are the ones throughput rides on."""
        chosen = [self.profile] if self.profile is not None else range(len(self.engine.profiles))
        for k in chosen:
            profile = self.engine.profiles[k]
            declared = {v.name: v.dtype for v in self.engine.inputs}
            for pick in ("max", "opt", "min"):
                for _ in range(iterations):  # new tensors each time: nothing here is a buffer to bind (0069)
                    self.run({name: _random_input(getattr(r, pick), declared[name], self.engine.device)
                              for name, r in profile.shapes.items()})
        if self.engine.device.type == "cuda":
            torch.cuda.synchronize(self.engine.device)


class BoundAddresses:
    """Which copied inputs get a graph of their own that reads them at the caller's address, as
    TensorRT reads the address given to setTensorAddress (docs/decisions/0069): buffers the caller
    reuses, seen a second time at the same address, layout and shape while still alive, up to `limit`
    graphs. A tensor made afresh for each call never qualifies (a capture spent on memory gone by the
    next call), nor do inputs once `limit` graphs are bound: those are copied into the graph's buffer.
    The last SIGHTINGS first sightings are remembered."""
    SIGHTINGS = 64

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.bound = 0
        self._seen: dict[tuple, tuple] = {}  # key -> weak references to the inputs' base tensors

    def recurs(self, key: tuple, tensors: dict) -> bool:
        """Whether the inputs of `key` (shapes and addresses) should now get a graph of their own:
        True at the second sighting of the same live buffers, while fewer than `limit` were bound."""
        if self.bound >= self.limit:
            return False
        bases = [t if t._base is None else t._base for _, t in sorted(tensors.items())]
        seen = self._seen.pop(key, None)
        if seen is not None and all(ref() is base for ref, base in zip(seen, bases)):
            self.bound += 1
            return True
        if len(self._seen) >= self.SIGHTINGS:
            del self._seen[next(iter(self._seen))]
        self._seen[key] = tuple(weakref.ref(base) for base in bases)
        return False


class _Address:
    """Where a bound graph reads an input (its `inputs` entry): the address alone, holding no memory."""
    def __init__(self, pointer: int) -> None:
        self.pointer = pointer

    def data_ptr(self) -> int:
        return self.pointer


def _unbind(context_ref, key: tuple) -> None:
    """A bound graph's input was freed: the graph goes, and so does its place (weakref.finalize)."""
    context = context_ref()
    if context is not None and context._captured.pop(key, None) is not None:
        context._memos.pop(key, None)
        context._addresses.bound -= 1


def _dense(t: torch.Tensor) -> bool:
    """In a layout the graph's own input buffers take (contiguous, or channels-last for 4-D)."""
    return t.is_contiguous() or (t.dim() == 4 and t.is_contiguous(memory_format=torch.channels_last))


def address_of(tensors: dict) -> tuple:
    """What a graph bound to these inputs depends on: each one's address, strides and dtype (the
    shapes are in the graph's key already)."""
    return tuple((name, t.data_ptr(), tuple(t.stride()), str(t.dtype)) for name, t in sorted(tensors.items()))


def _staged(tensors: dict, forms: dict) -> dict:
    """The inputs in the forms a staged copy writes (the tensors a staged graph is captured from)."""
    staged = dict(tensors)
    for name, form in forms.items():
        t = tensors[name]
        layout = torch.channels_last if form.channels_last else torch.contiguous_format
        staged[name] = torch.empty(t.shape, dtype=form.dtype, device=t.device, memory_format=layout)
        _copy_in(t, staged[name], form)
    return staged


def _describe_form(form: StagedForm) -> str:
    if form.codes is not None:
        return f"int8 codes (inv_scale {form.codes[0]:g}, qmin {form.codes[1]})"
    return f"{TORCH_TO_NUMPY[form.dtype]}{' channels-last' if form.channels_last else ''}"


def _copy_in(t: torch.Tensor, bound: torch.Tensor, form: StagedForm | None) -> None:
    """`t` written into the graph's input buffer `bound`: as the INT8 codes of the form, or converted
    to `bound`'s dtype and layout, in one pass."""
    if form is not None and form.codes is not None:
        quantize_into(t, bound, *form.codes)
    else:
        bound.copy_(t, non_blocking=True)


def frames_differ(shape: tuple | None, size: tuple[int, int]) -> bool:
    """Whether a frames input of `shape` (N×H×W×3) is not of the declared frame size."""
    return shape is not None and (len(shape) != 4 or tuple(shape[1:]) != (*size, 3))


def _random_input(shape: tuple, dtype: str, device: torch.device) -> torch.Tensor:
    torch_dtype = NUMPY_TO_TORCH[dtype]
    if torch_dtype.is_floating_point:
        return torch.rand(shape, dtype=torch_dtype, device=device)
    return torch.zeros(shape, dtype=torch_dtype, device=device)
