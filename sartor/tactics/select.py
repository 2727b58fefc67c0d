"""Tactic selection: for each fused layer, time every implementation that applies at the profile's
opt shape on the build device, discard those whose output differs from the reference, keep the
fastest. The winner is written into the layer (and the engine); runners-up go to `inspect`.
Engines with several profiles choose per profile (the best tile at batch 1 is not the best at
batch 256): `select_tactics_by_profile`, `record_tactics`.

With a timing cache, a layer whose signature was timed before on this device (same fingerprint)
takes the cached winner without timing anything; the winner is still run once and checked against
the reference. `--builder-effort` sets how long each candidate is timed (0: not at all)."""
from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from typing import Callable, Iterable

import torch

from ..errors import ConfigError, TacticFaultError
from ..ir import Graph
from ..kernels.registry import SEPARATOR
from ..ops import default_registry, fp8
from ..runtime.concat_plan import ConcatBuffers, ShapeMemo
from ..runtime.context import matmul_precision
from ..runtime.executor import Executor
from ..runtime.fingerprint import device_fingerprint
from .compile_pool import Precompiled, precompile
from .kernel_requests import Recorder
from .precompile import compile_in_parallel
from .timing_cache import TimingCache, layer_signature

REFERENCE_TACTIC = "torch"
REFERENCE_COST = "reference runs"
# What CUDA says of a fault that ends the process's context (cudaErrorIllegalAddress,
# MisalignedAddress, IllegalInstruction, InvalidPc, LaunchFailure, HardwareStackError, Assert,
# LaunchTimeout): after one, no candidate can run, so the build must stop rather than reject the
# rest (a Triton 3.6 miscompile once met "misaligned address" mid-build).
STICKY_CUDA_ERRORS = ("illegal memory access", "misaligned address", "illegal instruction",
                      "invalid program counter", "unspecified launch failure", "hardware stack error",
                      "device-side assert", "launch timed out")
# Builder effort -> (warm-up runs, timed runs) per candidate. Effort 0 times nothing: every layer
# runs its first candidate, the reference. Higher efforts will also widen the Triton search.
EFFORT_TIMING = {1: (1, 3), 2: (3, 10), 3: (5, 25), 4: (10, 50), 5: (20, 100)}
EFFORTS = (0, *EFFORT_TIMING)
LayerProgress = Callable[[int, int, str], None]  # (layer i, of n, its name)


def _graph_replay(fn, device: torch.device, calls: int = 1):
    """`fn` captured as a CUDA graph, `calls` times in a row, as the engine runs it: timing the
    replay measures the GPU's time, not Python's launch overhead (which a captured engine does not
    pay). None when `fn` cannot be captured."""
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    try:
        with torch.cuda.stream(stream):
            fn()  # one warm run on the capture stream: lazy initialisation must not be captured
        torch.cuda.current_stream(device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream, capture_error_mode="thread_local"):  # see runtime/capture.py
            for _ in range(calls):
                fn()
    except Exception:  # noqa: BLE001 - not capturable: time it uncaptured
        torch.cuda.synchronize(device)
        return None
    return graph.replay


# Events around one replay also time the graph's launch, during which the GPU waits: about as long as
# a batch-1 layer's kernels or a small device copy (docs/decisions/tactic-timing-short-replays.md).
# A replay shorter than SHORT_REPLAY_MS is captured again
# with enough calls of the candidate to fill REPLAY_FILL_MS, up to MAX_CALLS_PER_REPLAY, and its
# time divided by them: the candidates of a small layer are then compared by their own time, with
# the launches between them as an engine's graph has them.
SHORT_REPLAY_MS = 0.05
REPLAY_FILL_MS = 0.2
MAX_CALLS_PER_REPLAY = 32


def calls_per_replay(single_replay_ms: float) -> int:
    """How many calls of a candidate one timed replay holds, given one replay of a single call."""
    if single_replay_ms >= SHORT_REPLAY_MS:
        return 1
    return max(1, min(MAX_CALLS_PER_REPLAY, math.ceil(REPLAY_FILL_MS / max(single_replay_ms, 1e-3))))


def _replay_of_calls(fn, device: torch.device) -> tuple:
    """(a replay of `fn` captured as a graph with calls_per_replay calls, the calls), or (fn, 1)
    when it cannot be captured."""
    replay = _graph_replay(fn, device)
    if replay is None:
        return fn, 1
    replay()
    calls = calls_per_replay(min(_event_ms(replay) for _ in range(2)))
    if calls == 1:
        return replay, 1
    longer = _graph_replay(fn, device, calls)
    return (longer, calls) if longer is not None else (replay, 1)


def _event_ms(fn) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def timing_samples_ms(fn, device: torch.device, iterations: int, warmup: int = 3,
                      graph: bool = False) -> list[float]:
    """Milliseconds of each of `iterations` calls after `warmup` untimed ones: CUDA events around
    each call on a GPU (with `graph`, around replays of `fn` captured as a CUDA graph, several calls
    per replay for short ones: calls_per_replay), the host clock on a CPU."""
    calls = 1
    if graph and device.type == "cuda":
        fn, calls = _replay_of_calls(fn, device)
    for _ in range(warmup):
        fn()
    times = []
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        for _ in range(iterations):
            times.append(_event_ms(fn) / calls)
        return times
    for _ in range(iterations):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return times


def time_ms(fn, device: torch.device, iterations: int, warmup: int = 3, graph: bool = False) -> float:
    """Median milliseconds of `fn` after warm-up (see timing_samples_ms)."""
    return statistics.median(timing_samples_ms(fn, device, iterations, warmup, graph))


SMALLEST_NORMAL = {torch.float16: torch.finfo(torch.float16).tiny}


def _mismatch(out, ref: torch.Tensor, fp8_products: bool = False) -> str | None:
    """Why a candidate's output is not the reference's, or None when it matches. `fp8_products`: an
    FP8 layer's, whose float32 outputs carry the tensor cores' sums (see FP8_CANCELLATION_TOLERANCE).
    A layer of several outputs (BatchedNms) matches output by output."""
    if isinstance(ref, (tuple, list)):
        if not isinstance(out, (tuple, list)) or len(out) != len(ref):
            return f"{len(ref)} outputs expected"
        reasons = [_mismatch(o, r, fp8_products) for o, r in zip(out, ref)]
        return next((f"output {k}: {why}" for k, why in enumerate(reasons) if why is not None), None)
    if not isinstance(out, torch.Tensor) or out.shape != ref.shape:
        return f"output shape {tuple(getattr(out, 'shape', ()))} is not the reference's {tuple(ref.shape)}"
    if ref.dtype == fp8.DTYPE:
        return _fp8_mismatch(out, ref)
    if ref.dtype in (torch.int32, torch.int64, torch.bool):  # counts and classes: equal or wrong
        return None if torch.equal(out, ref) else "integer output differs from reference"
    if not torch.isfinite(out).all():
        return "output has non-finite values"
    if ref.dtype == torch.int8:
        # Integer outputs of the same arithmetic: equal, but for a last-ulp difference in a
        # transcendental activation that may move a value across a rounding boundary.
        error = int((out.int() - ref.int()).abs().max()) if ref.numel() else 0
        return None if error <= 1 else f"int8 output differs from reference by up to {error}"
    tolerance = 1e-2 if ref.dtype in (torch.float16, torch.bfloat16) else 1e-4
    if fp8_products:
        # The FP8 tensor cores' chunk sums of ~14 bits against the emulation's exact ones: a float32
        # output lands up to a few 2^-14 of the layer's largest value away
        # (docs/decisions/tactic-timing-short-replays.md), where its e4m3 codes would be allowed
        # steps of 2^-4.
        tolerance = max(tolerance, FP8_CANCELLATION_TOLERANCE)
    # Below float16's smallest normal number (6.1e-5) a value has no relative precision: its steps
    # are absolute (2^-24). Networks whose activations fade layer by layer (random-weight YOLOv8n
    # reaches 1e-7 at its neck) would otherwise have every kernel but the reference rejected for
    # rounding one subnormal step differently, so the error is measured against that floor.
    scale = max(float(ref.abs().max()), SMALLEST_NORMAL.get(ref.dtype, 0.0)) + 1e-6
    error = float((out.float() - ref.float()).abs().max()) / scale
    if error > tolerance:
        return f"output differs from reference (max error {error:.2e} of max |ref|, tolerance {tolerance:g})"
    return None


# Hopper's FP8 tensor cores add each product chunk with about 14 bits of mantissa before Triton
# promotes it into the float32 accumulator (every BLOCK_K products: conv_igemm's
# max_num_imprecise_acc). Where a sum nearly cancels, that error is many e4m3 steps of the small
# result, yet small against the layer's large outputs, whose own e4m3 rounding is 2^-5 (half a
# step). An error under this fraction of the largest output is accepted at any step count.
FP8_CANCELLATION_TOLERANCE = 2.0 ** -8


def _fp8_mismatch(out: torch.Tensor, ref: torch.Tensor) -> str | None:
    """FP8 outputs of the tensor cores against the exact emulation: each value is the reference's
    e4m3 code or its neighbour, or off by less than FP8_CANCELLATION_TOLERANCE of the largest
    reference value (a cancelling sum, see there)."""
    if out.dtype != fp8.DTYPE:
        return f"output is {out.dtype}, not {ref.dtype}"
    values, expected = out.float(), ref.float()
    if not torch.isfinite(values).all():
        return "output has non-finite values"
    if not ref.numel():
        return None
    steps = fp8.code_distance(out, ref)
    far = steps > 1
    if not bool(far.any()):
        return None
    error = (values - expected).abs()
    largest = float(expected.abs().max())
    too_far = far & (error > FP8_CANCELLATION_TOLERANCE * largest)
    if not bool(too_far.any()):
        return None
    return (f"fp8 output differs from reference by up to {int(steps[too_far].max())} e4m3 steps "
            f"(up to {float(error.max()) / (largest + 1e-30):.2e} of its largest value)")


@dataclass
class TacticSelection:
    """What select_tactics chose: per layer {"tactic", "timings_ms", "rejected", "source"} (source:
    "timed" or "timing cache"), and how many layers were timed or served from the timing cache."""
    layers: dict[str, dict] = field(default_factory=dict)
    timed: int = 0
    cached: int = 0
    exclusions_used: set = field(default_factory=set)  # the --exclude-tactic globs that matched a candidate
    # Where the stage's time went, by tactic family (a tactic name's first word): {family: {"compile_s",
    # "time_s", "candidates"}}; REFERENCE_COST holds the reference runs every candidate is checked against.
    family_seconds: dict[str, dict] = field(default_factory=dict)
    precompiled: Precompiled | None = None  # what compile_pool.precompile did before the layers were timed

    def charge(self, family: str, kind: str, seconds: float, candidates: int = 0) -> None:
        entry = self.family_seconds.setdefault(family, {"compile_s": 0.0, "time_s": 0.0, "candidates": 0})
        entry[kind] += seconds
        entry["candidates"] += candidates

    def summary(self) -> str:
        return f"tactics: {self.timed} timed, {self.cached} from timing cache"


def _run(step, args: list, tactic: str, into: torch.Tensor | None = None):
    """One run of a candidate, with the weight in the layout the engine will store it in. With
    `into` (the Concat slice the engine places this layer's output in), the candidate runs as the
    engine will run it: stored there by `write_into` when it can, else computed and then copied
    there by the Concat, so a tactic that saves that copy is credited for it."""
    args = list(args)
    if step.weight_for_tactic is not None:
        args[1] = step.weight_for_tactic(args[1], tactic)
    attrs = dict(step.attrs, tactic=tactic)
    if into is not None:
        if step.write_into is not None and step.write_into(args, attrs, into) is not None:
            return into, lambda: step.write_into(args, attrs, into)
        return into.copy_(step.impl(args, attrs)), lambda: into.copy_(step.impl(args, attrs))
    return step.impl(args, attrs), lambda: step.impl(args, attrs)


def gpu_fault(exc: BaseException) -> bool:
    """Whether `exc` is the GPU faulting (STICKY_CUDA_ERRORS), not a candidate that merely cannot
    run here (a shape it does not take, too little memory). torch says "CUDA error: …"; Triton's
    launcher, where the next launch meets the lost context, "Triton Error [CUDA]: …"."""
    return isinstance(exc, RuntimeError) and "CUDA" in str(exc) and any(
        phrase in str(exc) for phrase in STICKY_CUDA_ERRORS)


def excluding(candidates: list[str], patterns: Iterable[str]) -> list[str]:
    """The candidates no pattern matches (`--exclude-tactic`: globs over tactic names)."""
    patterns = list(patterns)
    return [tactic for tactic in candidates if not any(fnmatchcase(tactic, pattern) for pattern in patterns)]


def tactic_family(tactic: str) -> str:
    """The family a tactic belongs to: its name's first word ("igemm" of "igemm.128x128x64.w8.s3")."""
    return tactic.split(SEPARATOR, 1)[0]


def _time_candidates(step, args, candidates, reference, device, effort,
                     into: torch.Tensor | None = None, spent: dict | None = None) -> tuple[dict, dict]:
    """({tactic: median ms}, {tactic: why rejected}) over the candidates that match the reference;
    each candidate's wall seconds (its checks and timing runs) are added to `spent` when given."""
    warmup, iterations = EFFORT_TIMING[effort]
    timings, rejected = {}, {}
    for tactic in candidates:
        started = time.perf_counter()
        try:
            _time_one(step, args, tactic, reference, device, warmup, iterations, into, timings, rejected)
        finally:
            if spent is not None:
                spent[tactic] = spent.get(tactic, 0.0) + time.perf_counter() - started
    return timings, rejected


def _time_one(step, args, tactic, reference, device, warmup, iterations, into, timings, rejected) -> None:
    try:
        out, call = _run(step, args, tactic, into)
    except Exception as exc:  # noqa: BLE001 - a candidate that cannot run here is simply not a candidate
        if gpu_fault(exc):
            raise
        rejected[tactic] = " ".join(f"{type(exc).__name__}: {exc}".split())[:160]
        return
    why = None if tactic == REFERENCE_TACTIC else _mismatch(out, reference, fp8.is_fp8(step.attrs))
    if why is not None:
        rejected[tactic] = why
        return
    timings[tactic] = round(time_ms(call, device, iterations, warmup, graph=True), 5)


def _cached_choice(cache, fingerprint, signature, effort, step, args, candidates, reference,
                   into: torch.Tensor | None = None) -> dict | None:
    """The cached entry for this layer, if there is one, its winner applies here and, run once,
    still matches the reference."""
    entry = cache.lookup(fingerprint, signature, effort) if cache is not None else None
    if entry is None or entry["winner"] not in candidates:
        return None
    try:
        out, _ = _run(step, args, entry["winner"], into)
    except Exception as exc:  # noqa: BLE001 - it cannot run here any more: time the candidates again
        if gpu_fault(exc):
            raise
        return None
    return entry if entry["winner"] == REFERENCE_TACTIC or _mismatch(out, reference, fp8.is_fp8(step.attrs)) is None \
        else None


def _charge_apportioned(selection: TacticSelection, kind: str, wall_seconds: float, spent: dict[str, float]) -> None:
    """Charge the wall time of a parallel step to the families that ran in it, in proportion to
    their own seconds (threads overlap, so their sum exceeds the wall time)."""
    total = sum(spent.values())
    for tactic, seconds in spent.items():
        selection.charge(tactic_family(tactic), kind, wall_seconds * seconds / total if total else 0.0)


# Ops whose candidates only compute on what their Triton kernels write: recorded with those kernels
# skipped (kernel_requests.Recorder), they read unwritten memory harmlessly. Others (BatchedNms turns
# device values into indices) compile when their layer is timed.
PRECOMPILED_OPS = frozenset({"FusedConv", "QConv", "QGemm", "MaxPool", "AddLayerNorm"})


@dataclass(frozen=True)
class _Search:
    """What decides a layer's candidates and its timing-cache entry, as select_tactics was given it."""
    effort: int
    exclude: tuple
    time_single: bool
    layer_precision: dict
    tf32: bool
    cache: TimingCache | None
    fingerprint: dict


def _record_layer(recorder: Recorder, step, args: list, search: _Search, into: torch.Tensor | None) -> None:
    """Record the Triton compiles the tactics stage will ask for at this layer: each candidate's
    (the cached winner's alone where the timing cache has the layer), stored in the Concat slice as
    it is timed and on its own as precompile.py's threads run it."""
    if step.node.op_type not in PRECOMPILED_OPS:
        return
    offered = default_registry()[step.node.op_type].tactics(args, step.attrs, search.effort)
    candidates = excluding(offered, search.exclude)
    if not candidates or (len(offered) == 1 and not search.time_single):
        return
    if search.cache is not None:
        signature = layer_signature(step.node.op_type, args, step.attrs,
                                    search.layer_precision.get(step.node.name, "fp32"), search.tf32, into)
        entry = search.cache.lookup(search.fingerprint, signature, search.effort)
        if entry is not None and entry["winner"] in candidates:
            candidates = [entry["winner"]]
    for tactic in candidates:
        if tactic == REFERENCE_TACTIC:
            continue
        recorder.run(tactic, lambda tactic=tactic: _run(step, args, tactic, into))
        if into is not None:
            recorder.run(tactic, lambda tactic=tactic: _run(step, args, tactic))


def _precompile_layers(selection: TacticSelection, executor: Executor, feeds: dict, memo: ShapeMemo,
                       slices: ConcatBuffers | None, search: _Search, device: torch.device) -> None:
    """Compile every layer's candidate kernels at once in worker processes (compile_pool.py), before
    the layers are timed; its wall time charged to the families that asked for the kernels."""
    def collect(recorder: Recorder) -> None:
        def before(index, step, args):
            into = slices.slice_for(step.node.outputs[0]) if slices is not None and len(step.node.outputs) == 1 \
                else None
            _record_layer(recorder, step, args, search, into)
        executor.run(feeds, memo, before=before)

    started = time.perf_counter()
    done = precompile(collect, device)
    if done is not None:
        _charge_apportioned(selection, "compile_s", time.perf_counter() - started, done.shares())
        selection.precompiled = done


def select_tactics(graph: Graph, weights: dict, feeds: dict, device: torch.device, layer_precision: dict,
                   channels_last: bool, tf32: bool, effort: int = 2, cache: TimingCache | None = None,
                   fingerprint: dict | None = None, time_single: bool = False,
                   exclude: Iterable[str] = (), on_layer: LayerProgress | None = None) -> TacticSelection:
    """Choose the tactic of each layer whose op lists several (FusedConv, QConv, QGemm, MaxPool) at
    the shapes of `feeds`, reading and extending `cache` (or None) for this device's `fingerprint`
    (default: the build device's). With `time_single`, layers of one candidate are timed too (their
    time is then known, for --fallback-where-faster). `exclude`: globs of tactics never run
    (`--exclude-tactic`). A candidate that faults the GPU stops the build with a TacticFaultError
    naming the layer and the candidates in flight. `on_layer(done, total, name)` hears of each layer
    as its turn comes (a caller's progress display)."""
    exclude = tuple(exclude)
    selection = TacticSelection()
    if effort == 0:
        return selection
    fingerprint = fingerprint or device_fingerprint(device)
    registry = default_registry()
    executor = Executor(graph, weights, device, layer_precision, channels_last=channels_last, registry=registry)
    slices = None  # scratch Concat buffers: where layers placed in a Concat are timed storing

    def before(index, step, args):
        if on_layer is not None:
            on_layer(index + 1, len(executor.steps), step.node.name)
        opdef = registry[step.node.op_type]
        if opdef.tactics is None:
            return
        name = step.node.name
        offered = opdef.tactics(args, step.attrs, effort)
        selection.exclusions_used.update(p for p in exclude if any(fnmatchcase(t, p) for t in offered))
        candidates = excluding(offered, exclude)
        if not candidates:
            raise ConfigError(f"--exclude-tactic {' '.join(exclude)} leaves layer {name!r} no tactic (it had "
                              f"{', '.join(offered)})")
        if len(offered) == 1 and not time_single:  # nothing to choose between (INT8 emulation on the CPU)
            return
        started = time.perf_counter()
        reference = step.impl(args, dict(step.attrs, tactic=REFERENCE_TACTIC))
        selection.charge(REFERENCE_COST, "time_s", time.perf_counter() - started)
        into = slices.slice_for(step.node.outputs[0]) if slices is not None and len(step.node.outputs) == 1 else None
        signature = layer_signature(step.node.op_type, args, step.attrs, layer_precision.get(name, "fp32"), tf32,
                                    into)
        try:
            entry = _cached_choice(cache, fingerprint, signature, effort, step, args, candidates, reference, into)
            if entry is None:
                compiled: dict[str, float] = {}
                started = time.perf_counter()
                compile_in_parallel(lambda tactic: _run(step, args, tactic),
                                    [tactic for tactic in candidates if tactic != REFERENCE_TACTIC], device,
                                    spent=compiled)
                _charge_apportioned(selection, "compile_s", time.perf_counter() - started, compiled)
                spent: dict[str, float] = {}
                timings, rejected = _time_candidates(step, args, candidates, reference, device, effort, into, spent)
                for tactic, seconds in spent.items():
                    selection.charge(tactic_family(tactic), "time_s", seconds, candidates=1)
        except Exception as exc:
            if not gpu_fault(exc):
                raise
            first_line = " ".join(str(exc).splitlines()[0].split()) if str(exc).strip() else type(exc).__name__
            raise TacticFaultError(
                f"layer {name!r} ({step.node.op_type}): the GPU faulted ({first_line}) while its candidate kernels "
                f"ran ({', '.join(candidates)}); a fault ends this process's CUDA context, so the build stops here. "
                f"Rebuild leaving the faulting kernel out with --exclude-tactic PATTERN (globs over those names)"
            ) from exc
        if entry is not None:
            selection.cached += 1
            winner, timings, rejected, source = entry["winner"], entry["timings_ms"], entry["rejected"], "timing cache"
        else:
            selection.timed += 1
            if not timings:  # possible once --exclude-tactic has left the reference out
                raise ConfigError(f"layer {name!r}: no tactic left after --exclude-tactic matches the reference ("
                                  + "; ".join(f"{tactic}: {why}" for tactic, why in rejected.items()) + ")")
            winner, source = min(timings, key=timings.get), "timed"
            if cache is not None:
                cache.record(fingerprint, signature, winner, timings, rejected, effort)
        step.attrs["tactic"] = winner
        if step.weight_for_tactic is not None:
            args[1] = step.weight_for_tactic(args[1], winner)  # this run goes on with the winner
        selection.layers[name] = {"tactic": winner, "timings_ms": dict(timings), "rejected": dict(rejected),
                                  "source": source}

    with torch.inference_mode(), matmul_precision(tf32):
        # A first run records the shapes that let Concats be written in place, so that candidates
        # are timed on the layouts the engine will run them on (channel slices of Concat buffers).
        memo = ShapeMemo()
        executor.run(feeds, memo)
        if memo.value_meta is not None and executor.concat_plan.concats:
            slices = ConcatBuffers(executor.concat_plan, memo.value_meta, device)
        search = _Search(effort, exclude, time_single, layer_precision, tf32, cache, fingerprint)
        _precompile_layers(selection, executor, feeds, memo, slices, search, device)
        executor.run(feeds, memo, before=before)
    return selection


def select_tactics_by_profile(graph: Graph, weights: dict, feeds_by_profile: Iterable[dict], device: torch.device,
                              layer_precision: dict, channels_last: bool, tf32: bool, effort: int = 2,
                              cache: TimingCache | None = None, fingerprint: dict | None = None,
                              time_single: bool = False, exclude: Iterable[str] = (),
                              on_layer: LayerProgress | None = None) -> list[TacticSelection]:
    """select_tactics at each profile's opt shapes (`feeds_by_profile`, one feed set per profile,
    produced as they are needed). The profiles share `cache` or, without one, a cache of this build's
    own timings, so a layer whose signature a previous profile timed is not timed again. `on_layer`
    (as select_tactics') names the profile too when there are several."""
    feeds_by_profile = iter(feeds_by_profile)
    first = next(feeds_by_profile)
    second = next(feeds_by_profile, None)
    if second is None:  # one profile: exactly the single-profile selection
        return [select_tactics(graph, weights, first, device, layer_precision, channels_last, tf32, effort, cache,
                               fingerprint, time_single, exclude, on_layer)]
    shared = cache if cache is not None else TimingCache()
    selections = []
    for k, feeds in enumerate((first, second, *feeds_by_profile)):
        def on_layer_of_profile(done, total, name, k=k):
            if on_layer is not None:
                on_layer(done, total, f"profile {k}: {name}")
        selections.append(select_tactics(graph, weights, feeds, device, layer_precision, channels_last, tf32,
                                         effort, shared, fingerprint, time_single, exclude, on_layer_of_profile))
    return selections


def record_tactics(graph: Graph, selections: list[TacticSelection]) -> None:
    """Write the winners into the layers: `tactic` is profile 0's (what engines with one profile, and
    readers of older engines, know); with several profiles `tactic_by_profile` lists every profile's
    winner (None: the profile runs the reference), which the executor runs per profile."""
    for node in graph.nodes:
        winners = [selection.layers.get(node.name, {}).get("tactic") for selection in selections]
        if winners[0] is not None:
            node.attrs["tactic"] = winners[0]
        if len(winners) > 1 and any(w is not None for w in winners):
            node.attrs["tactic_by_profile"] = winners


def family_seconds(selections: list[TacticSelection]) -> dict[str, dict]:
    """The tactics stage's seconds by tactic family over every profile, the costliest first:
    {family: {"seconds", "compile_s", "time_s", "candidates"}} (candidates: how many were timed)."""
    merged: dict[str, dict] = {}
    for selection in selections:
        for family, entry in selection.family_seconds.items():
            into = merged.setdefault(family, {"compile_s": 0.0, "time_s": 0.0, "candidates": 0})
            for key in into:
                into[key] += entry[key]
    rows = {family: {"seconds": round(e["compile_s"] + e["time_s"], 3), "compile_s": round(e["compile_s"], 3),
                     "time_s": round(e["time_s"], 3), "candidates": e["candidates"]} for family, e in merged.items()}
    return dict(sorted(rows.items(), key=lambda item: -item[1]["seconds"]))


def summary_by_profile(selections: list[TacticSelection]) -> str:
    """The build log's tactics line: totals, and per profile when there are several."""
    total = TacticSelection(timed=sum(s.timed for s in selections), cached=sum(s.cached for s in selections))
    if len(selections) == 1:
        return total.summary()
    each = "; ".join(f"profile {k}: {s.timed} timed, {s.cached} from timing cache" for k, s in enumerate(selections))
    return f"{total.summary()} ({each})"
