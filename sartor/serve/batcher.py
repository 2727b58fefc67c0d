"""Dynamic batching: one bounded queue per served model version, drained by one worker thread per
execution context (instance).

A worker takes the oldest request and adds the queued requests that share its input signature
(names, dtypes, the dims after the batch dim) while the summed batch stays within max_batch_size and
some profile of the engine admits it. It dispatches at once when the batch reaches the largest
preferred batch size (max_batch_size without preferred sizes), when max_queue_delay has passed since
the oldest request arrived, or when the delay is 0; otherwise it waits. The batch is copied along
dim 0 into a staging buffer of the instance (pinned on CUDA), padded up to the next batch size the
instance has already run (see `Instance.warm_batch`), run, and the outputs are split back per
request as views. An input may also be a torch tensor (a view of a CUDA shared-memory region): a
batch holding one is assembled in a device buffer of the instance instead, by device-to-device
copies. Requests whose timeout passes while
queued are answered with RequestTimeout; requests whose caller went away are dropped.

Runs that may capture a CUDA graph (a context's first run of a shape) take the GPUs alone, through
`DeviceGate`, because a capture must not overlap other CUDA work of the process. Runs whose engines
want different process-global TF32 settings never overlap either, through `FlagGate`.
"""
from __future__ import annotations

import bisect
import contextlib
import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

import numpy as np

from ..errors import SartorError
from .device_copies import DeviceCopies, wait_for_tensors
from .errors import (BatcherClosed, ExecutionError, InvalidRequest, ModelUnavailable, QueueFull, RequestTimeout,
                     ServeError)

log = logging.getLogger("sartor.serve")


# ---- one device's capture gate ----------------------------------------------------------------------

class DeviceGate:
    """A readers-writer lock: ordinary runs share the device, runs that may capture take it alone."""

    def __init__(self, needed: bool) -> None:
        self.needed = needed
        self._cv = threading.Condition()
        self._shared = 0
        self._exclusive = False
        self._waiting_exclusive = 0

    @contextlib.contextmanager
    def shared(self):
        if not self.needed:
            yield
            return
        with self._cv:
            while self._exclusive or self._waiting_exclusive:
                self._cv.wait()
            self._shared += 1
        try:
            yield
        finally:
            with self._cv:
                self._shared -= 1
                self._cv.notify_all()

    @contextlib.contextmanager
    def exclusive(self):
        if not self.needed:
            yield
            return
        with self._cv:
            self._waiting_exclusive += 1
            while self._exclusive or self._shared:
                self._cv.wait()
            self._waiting_exclusive -= 1
            self._exclusive = True
        try:
            yield
        finally:
            with self._cv:
                self._exclusive = False
                self._cv.notify_all()


_CUDA_GATE = DeviceGate(needed=True)
_NO_GATE = DeviceGate(needed=False)


def device_gate(device: str | None) -> DeviceGate:
    """One gate for every CUDA device of the process: torch captures CUDA graphs in the "global" error
    mode, where unsafe calls from any thread (an allocation, a synchronisation) break a capture on any
    device. Captures and engine loads are rare (warm-up, a new shape, a new version), so taking all
    GPUs for them costs little. None: the device an engine will pick (CUDA when there is one)."""
    if device is None:
        import torch
        return _CUDA_GATE if torch.cuda.is_available() else _NO_GATE
    return _CUDA_GATE if str(device).startswith("cuda") else _NO_GATE


# ---- process-global torch flags ----------------------------------------------------------------------

def _set_tf32(enabled: bool) -> None:
    import torch
    torch.backends.cuda.matmul.allow_tf32 = enabled
    torch.backends.cudnn.allow_tf32 = enabled


class FlagGate:
    """Runs that want TF32 and runs that must not have it never overlap; runs that agree do.

    `ExecutionContext.run` sets torch's TF32 flags for its engine (on for `tf32` engines, off for all
    others) and restores the previous values when it returns, around graph replays too. The flags
    are process-global and read whenever any thread launches or captures a matmul or convolution, so
    an FP32 model running beside a TF32 one could launch its matmuls and convolutions in TF32, and
    interleaved restores could leave either value behind.
    Here the first run of a group sets the group's value before any of its runs starts, so each run's
    own set-and-restore is a no-op while the group holds the gate. A group with runs waiting stops
    admitting newcomers of the other group, so neither starves. When every model agrees (the usual
    case) nothing ever waits.

    `torch.backends.cudnn.benchmark` needs no gate: every CUDA context sets it to True and nothing
    sets it back."""

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._mode: bool | None = None
        self._active = 0
        self._waiting = {False: 0, True: 0}

    @contextlib.contextmanager
    def hold(self, tf32: bool):
        with self._cv:
            self._waiting[tf32] += 1
            while self._active and (self._mode != tf32 or self._waiting[not tf32]):
                self._cv.wait()
            self._waiting[tf32] -= 1
            if not self._active:
                self._mode = tf32
                _set_tf32(tf32)
            self._active += 1
        try:
            yield
        finally:
            with self._cv:
                self._active -= 1
                if not self._active:
                    self._cv.notify_all()


FLAG_GATE = FlagGate()


def wants_tf32(context) -> bool:
    return getattr(getattr(context, "engine", None), "precision", None) == "tf32"


def on_device(context):
    """The context's GPU as the thread's current device. A worker thread starts on cuda:0, and code
    that launches on "the current device" rather than on its tensors' device (Triton kernels pick
    their stream that way) must see the instance's own GPU when there are several."""
    device = getattr(getattr(context, "engine", None), "device", None)
    if getattr(device, "type", None) == "cuda":
        import torch
        return torch.cuda.device(device)
    return contextlib.nullcontext()


def _is_tensor(value) -> bool:
    """A torch tensor rather than a numpy array (checked without importing torch)."""
    return not isinstance(value, np.ndarray) and type(value).__module__.startswith("torch")


def dtype_key(value) -> str:
    """The numpy dtype string of an array or a torch tensor: a CUDA shared-memory input batches with
    body inputs of the same dtype."""
    if _is_tensor(value):
        from ..ir.dtypes import TORCH_TO_NUMPY
        return np.dtype(TORCH_TO_NUMPY[value.dtype]).str
    return value.dtype.str


def release_cached_memory(device: str | None) -> None:
    """Give the CUDA caching allocator's free blocks back to the device after a warm-up: the runs
    before each capture leave blocks the graphs never use, which a memory budget shared with other
    models (or processes) must not keep."""
    if device is not None and str(device).startswith("cuda"):
        import torch
        torch.cuda.empty_cache()


WARM_EVERY_BATCH_UP_TO = 64  # beyond this, powers of two, multiples of max/8 and the preferred sizes


def warm_batch_sizes(top: int, preferred=()) -> list[int]:
    """The batch sizes a dynamic batcher of `top` warms up (each a CUDA graph) and pads batches up
    to: every size up to WARM_EVERY_BATCH_UP_TO, else powers of two, steps of top/8 (which bound
    the padding) and the preferred sizes."""
    if top <= WARM_EVERY_BATCH_UP_TO:
        return list(range(1, top + 1))
    step = -(-top // 8)
    sizes = {1 << k for k in range(top.bit_length())} | set(range(step, top, step)) | {top} | set(preferred)
    return sorted(b for b in sizes if 1 <= b <= top)


def warm_feeds(engine, sizes) -> list[dict]:
    """Zero inputs at each of `sizes` (the batch dimension; the rest at each profile's opt shape)
    that a profile admits: the runs that warm a batcher's batch sizes."""
    dtypes = {v.name: v.dtype for v in engine.inputs}
    feeds = []
    for profile in engine.profiles:
        for b in sizes:
            shapes = {n: (b, *r.opt[1:]) for n, r in profile.shapes.items()}
            if profile.admits(shapes):
                feeds.append({n: np.zeros(s, dtype=dtypes[n]) for n, s in shapes.items()})
    return feeds


def next_warm_size(sizes: list[int], total: int) -> int:
    """The smallest of the sorted `sizes` at or above `total`, else `total`."""
    at = bisect.bisect_left(sizes, total)
    return sizes[at] if at < len(sizes) else total


def shape_key(feeds: dict) -> tuple:
    return tuple(sorted((name, tuple(int(d) for d in value.shape)) for name, value in feeds.items()))


@dataclass
class Instance:
    """One execution context, the device it runs on, and the input shapes it has already run."""
    context: object
    device: str
    seen: set = field(default_factory=set)
    # The batch sizes run so far per input signature past the batch dim, sorted: what warm_batch
    # searches. Derived from `seen`; mark_run keeps the two together.
    _warm_batches: dict = field(default_factory=dict, repr=False)
    _staging: dict = field(default_factory=dict, repr=False)
    _device_staging: dict = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        keys, self.seen = self.seen, set()
        for key in keys:
            self.mark_run(key)

    def mark_run(self, key: tuple) -> None:
        """Record that the context has run inputs of these shapes (a shape_key)."""
        if key in self.seen:
            return
        self.seen.add(key)
        batches = {shape[0] if shape else None for _, shape in key}
        if len(batches) == 1 and None not in batches:
            rows = tuple((name, shape[1:]) for name, shape in key)
            bisect.insort(self._warm_batches.setdefault(rows, []), batches.pop())

    def run(self, feeds: dict) -> dict:
        key = shape_key(feeds)
        gate = device_gate(self.device)
        # Always the device gate first, then the flag gate (a fixed order: no deadlock).
        with (gate.shared() if key in self.seen else gate.exclusive()), FLAG_GATE.hold(wants_tf32(self.context)), \
                on_device(self.context):
            out = self.context.run(feeds)
        self.mark_run(key)
        return out

    def warm_batch(self, rest: dict, total: int) -> int:
        """The smallest batch >= total at which every input (batch, *rest[name]) has run already, else
        total. A shape's first run on CUDA captures a graph after cuDNN has timed its algorithms for it,
        about a second for ResNet-50, with every GPU of the process held (DeviceGate): padding a batch
        up to a warmed size costs a few rows of compute instead of stalling every queued request."""
        return next_warm_size(self._warm_batches.get(tuple(sorted(rest.items())), []), total)

    def staging(self, name: str, shape: tuple, dtype: np.dtype) -> np.ndarray:
        """A host buffer of `shape`, the leading rows of one kept per input and row shape and reused from
        batch to batch (one worker thread per instance uses it): no page faults of a fresh 100 MB
        allocation per batch, and on CUDA pinned memory, so the context's host-to-device copy is one
        DMA transfer rather than a staged pageable copy."""
        key = (name, tuple(shape[1:]), dtype.str, len(shape))
        buffer = self._staging.get(key)
        if buffer is None or (shape and len(buffer) < shape[0]):
            if buffer is None and len(self._staging) >= MAX_STAGING_BUFFERS:
                self._staging.clear()
            buffer = _host_buffer(tuple(shape), dtype, pinned=str(self.device).startswith("cuda"))
            self._staging[key] = buffer
        return buffer[:shape[0]] if shape else buffer

    def device_staging(self, name: str, shape: tuple, dtype):
        """A torch buffer on the instance's device (`dtype` a torch dtype), reused like `staging`: where
        a batch with an input in CUDA shared memory is assembled by device-to-device copies."""
        import torch
        key = (name, tuple(shape[1:]), str(dtype), len(shape))
        buffer = self._device_staging.get(key)
        if buffer is None or (shape and buffer.shape[0] < shape[0]):
            if buffer is None and len(self._device_staging) >= MAX_STAGING_BUFFERS:
                self._device_staging.clear()
            buffer = torch.empty(tuple(shape), dtype=dtype, device=torch.device(self.device))
            self._device_staging[key] = buffer
        return buffer[:shape[0]] if shape else buffer

    def owns(self, array: np.ndarray) -> bool:
        return any(np.may_share_memory(array, b) for b in self._staging.values())


MAX_STAGING_BUFFERS = 16  # per instance; a model has one per input unless shapes past the batch dim vary


def _host_buffer(shape: tuple, dtype: np.dtype, pinned: bool) -> np.ndarray:
    if pinned:
        try:
            import torch

            from ..ir.dtypes import NUMPY_TO_TORCH
            # The array keeps the pinned tensor alive through its base.
            return torch.empty(shape, dtype=NUMPY_TO_TORCH[dtype.name], pin_memory=True).numpy()
        except (KeyError, RuntimeError, TypeError):
            pass  # a dtype torch lacks, or no pinnable memory left: pageable still works
    return np.empty(shape, dtype)


# ---- requests and the policy ------------------------------------------------------------------------

@dataclass
class BatchPolicy:
    max_batch_size: int  # 0: no batch dim, each request runs alone
    dynamic: bool
    preferred: tuple = ()
    max_delay_s: float = 0.0
    max_queue_size: int = 1024


@dataclass
class BatchResult:
    outputs: dict
    queue_s: float
    compute_s: float
    batch_size: int
    written: dict | None = None  # what the request's sink wrote: bytes per output (None: no sink)


# A request's sink: called by the worker right after the request's batch, with the request's rows of
# every output on the host (numpy) and, where the engine gave torch tensors, as those tensors (else
# None), and the batch's DeviceCopies. It writes them where the request asked (shared memory),
# device-to-device copies queued in the DeviceCopies (issued and waited for by the worker before
# any answer goes out), and returns the bytes written per output. An exception fails that request
# alone.
Sink = Callable[[dict, "dict | None", DeviceCopies], dict]


@dataclass(eq=False)
class _Member:
    """One request of a pending entry: its rows and where its outputs go."""
    inputs: dict
    batch: int
    sink: Sink | None = None
    dropped: bool = False  # its caller went away (GroupFuture.drop): its rows are not run


class GroupFuture(Future):
    """The one future of a pending entry queued by `submit_group`: it ends with a list holding each
    member's answer in order (a BatchResult, the exception of that member alone, or None for a
    member dropped before its batch ran), or with the exception of the whole entry (a timeout in
    the queue, a failed run). One future, one lock and one wake-up of the event loop per entry
    rather than per request: the main process of `sartor serve --frontends` is the limit
    (docs/decisions/0016-serve-engine-processes.md)."""

    def __init__(self, members: list[_Member], lock: threading.Condition) -> None:
        super().__init__()
        self.members = members
        self._queue_lock = lock

    def drop(self, index: int) -> None:
        """The caller of member `index` went away: its rows are not run if its batch has not started,
        and the entry leaves the queue once every member is dropped."""
        with self._queue_lock:
            self.members[index].dropped = True
            if all(m.dropped for m in self.members):
                self.cancel()  # refused (False) once running: the batch then runs as it is


@dataclass(eq=False)
class _Pending:
    """A queue entry: one request (`submit`), or requests of one group that share a signature and
    fit one batch together (`submit_group`). A batch takes an entry whole."""
    members: list[_Member]
    batch: int
    signature: tuple
    enqueued: float
    deadline: float | None
    future: Future  # a GroupFuture (submit_group) ends with the members' answers as a list

    @property
    def inputs(self) -> dict:
        return self.members[0].inputs


class Batcher:
    def __init__(self, model: str, version: str, instances: list[Instance], policy: BatchPolicy,
                 profiles: list, metrics) -> None:
        self.model, self.version = model, version
        self.policy = policy
        self.profiles = profiles
        self.metrics = metrics
        self.labels = {"model": model, "version": version}
        self._series = metrics.key(self.labels)
        self._cv = threading.Condition()
        self._form = threading.Lock()  # one worker forms a batch at a time
        self._queue: deque[_Pending] = deque()
        self._queued = 0  # requests in the queue: an entry holds one or more
        self._closed = False
        self._paused = False
        self._admits_cache: dict = {}
        self._threads = [threading.Thread(target=self._worker, args=(inst,), daemon=True,
                                          name=f"sartor-serve-{model}-v{version}-{inst.device}-{i}")
                         for i, inst in enumerate(instances)]
        for thread in self._threads:
            thread.start()

    # ---- the producer side ----------------------------------------------------------------------
    def _signature(self, inputs: dict) -> tuple:
        batched = bool(self.policy.max_batch_size)
        return tuple(sorted((name, dtype_key(a), tuple(a.shape[1:] if batched else a.shape))
                            for name, a in inputs.items()))

    def _queue_full(self) -> QueueFull:
        return QueueFull(f"model '{self.model}' version {self.version}: the queue is full "
                         f"({self.policy.max_queue_size} requests waiting); retry later")

    def _dequeued(self, entries) -> None:
        """Under the lock: these entries left the queue."""
        self._queued -= sum(len(p.members) for p in entries)
        self.metrics.set("nv_inference_pending_request_count", self._series, self._queued)

    def submit(self, inputs: dict, batch: int, deadline: float | None, sink: Sink | None = None) -> Future:
        """Queue one request (inputs already validated; `sink`: where its outputs go, see Sink); its
        future ends with its BatchResult. Raises QueueFull, or BatcherClosed once this batcher
        stopped taking requests (the caller retries with the version now served)."""
        pending = _Pending([_Member(inputs, batch, sink)], batch, self._signature(inputs), time.monotonic(), deadline,
                           Future())
        with self._cv:
            if self._closed:
                raise BatcherClosed()
            if self._queued >= self.policy.max_queue_size:
                raise self._queue_full()
            self._queue.append(pending)
            self._queued += 1
            self.metrics.set("nv_inference_pending_request_count", self._series, self._queued)
            self._cv.notify()
        return pending.future

    def submit_group(self, requests: list) -> list:
        """Queue several requests, (inputs, batch, deadline, sink) each, under one lock. Requests
        that share a signature and whose deadlines lie within DEADLINE_SLACK_S of each other (or
        that have none) share queue entries, as many members each as one batch can take
        (max_batch_size, the profiles). An entry times out in the queue at its latest member's
        deadline; requests with deadlines further apart keep apart, so that a short timeout still
        answers its request alone. Per request: (GroupFuture, index of its answer in the future's
        list), or the QueueFull a request past the queue's bound gets. Raises BatcherClosed for all
        of them once this batcher stopped taking requests."""
        limit = self.policy.max_batch_size if self.policy.dynamic else 0
        signatures: dict = {}  # requests of one group usually share their shapes
        open_entries: dict = {}  # signature -> the entry still taking members
        now = time.monotonic()
        answers: list = []
        with self._cv:
            if self._closed:
                raise BatcherClosed()
            for inputs, batch, deadline, sink in requests:
                if self._queued >= self.policy.max_queue_size:
                    answers.append(self._queue_full())
                    continue
                shapes = tuple((name, type(a), a.dtype, a.shape) for name, a in inputs.items())
                signature = signatures.get(shapes)
                if signature is None:
                    signature = signatures[shapes] = self._signature(inputs)
                entry = open_entries.get(signature)
                if entry is not None and (entry.batch + batch > limit or not self._admits(signature, entry.batch + batch)
                                          or not _close_deadlines(entry.deadline, deadline)):
                    entry = None
                if entry is None:
                    members: list[_Member] = []
                    entry = _Pending(members, 0, signature, now, deadline, GroupFuture(members, self._cv))
                    self._queue.append(entry)
                    if limit:
                        open_entries[signature] = entry
                elif deadline is not None:
                    entry.deadline = max(entry.deadline, deadline)  # none of its members times out early
                entry.members.append(_Member(inputs, batch, sink))
                entry.batch += batch
                self._queued += 1
                answers.append((entry.future, len(entry.members) - 1))
            self.metrics.set("nv_inference_pending_request_count", self._series, self._queued)
            self._cv.notify(len(requests))
        return answers

    @property
    def pending(self) -> int:
        """Requests queued (those of a dropped member included until their entry leaves)."""
        with self._cv:
            return self._queued

    def pause(self) -> None:
        """Hold the queue: workers finish what they run but take nothing new (maintenance, tests)."""
        with self._cv:
            self._paused = True

    def resume(self) -> None:
        with self._cv:
            self._paused = False
            self._cv.notify_all()

    def close(self) -> None:
        """Take no new requests; the workers run what is queued, then exit."""
        with self._cv:
            self._closed = True
            self._paused = False
            self._cv.notify_all()

    def join(self, timeout: float | None = None) -> bool:
        end = None if timeout is None else time.monotonic() + timeout
        for thread in self._threads:
            thread.join(None if end is None else max(0.0, end - time.monotonic()))
        return not any(t.is_alive() for t in self._threads)

    def abort(self, message: str) -> None:
        """Answer every queued request with ModelUnavailable(message) (server shutdown)."""
        with self._cv:
            dropped = list(self._queue)
            self._queue.clear()
            self._queued = 0
            self._closed = True
            self._paused = False
            self._cv.notify_all()
        for p in dropped:
            _fail(p.future, ModelUnavailable(message))

    # ---- forming a batch ------------------------------------------------------------------------
    def _admits(self, signature: tuple, total: int) -> bool:
        key = (signature, total)
        hit = self._admits_cache.get(key)
        if hit is None:
            shapes = {name: (total, *rest) for name, _, rest in signature}
            hit = any(p.admits(shapes) for p in self.profiles)
            if len(self._admits_cache) < 4096:
                self._admits_cache[key] = hit
        return hit

    def _gather(self, head: _Pending) -> tuple[list[_Pending], int]:
        chosen, total = [head], head.batch
        if not self.policy.dynamic:
            return chosen, total
        limit = self.policy.max_batch_size
        for p in itertools.islice(self._queue, 1, None):
            if total >= limit:
                break
            if p.signature != head.signature or p.future.cancelled():
                continue
            n = total + p.batch
            if n <= limit and self._admits(head.signature, n):
                chosen.append(p)
                total = n
        return chosen, total

    def _expire(self, now: float) -> float | None:
        """Answer queued requests whose deadline passed or whose caller left; the next deadline."""
        expired, kept, next_deadline = [], deque(), None
        for p in self._queue:
            if p.future.cancelled():
                continue
            if p.deadline is not None and p.deadline <= now:
                expired.append(p)
                continue
            kept.append(p)
            if p.deadline is not None:
                next_deadline = p.deadline if next_deadline is None else min(next_deadline, p.deadline)
        if len(kept) != len(self._queue):
            self._queue = kept
            self._queued = sum(len(p.members) for p in kept)
            self.metrics.set("nv_inference_pending_request_count", self._series, self._queued)
        for p in expired:
            _fail(p.future, RequestTimeout(f"model '{self.model}': the request timed out after "
                                           f"{(now - p.enqueued) * 1e3:.0f} ms in the queue"))
        return next_deadline

    def _next_batch(self) -> list[_Pending] | None:
        policy = self.policy
        target = max(policy.preferred) if policy.preferred else policy.max_batch_size
        with self._form, self._cv:
            while True:
                now = time.monotonic()
                next_deadline = self._expire(now)
                if not self._queue:
                    if self._closed:
                        return None
                    self._cv.wait(None if next_deadline is None else max(next_deadline - now, 0.001))
                    continue
                if self._paused:
                    self._cv.wait(max(next_deadline - now, 0.001) if next_deadline else 0.5)
                    continue
                head = self._queue[0]
                chosen, total = self._gather(head)
                dispatch_at = head.enqueued + policy.max_delay_s
                if (not policy.dynamic or total >= target or policy.max_delay_s <= 0 or self._closed
                        or now >= dispatch_at):
                    taken = set(map(id, chosen))
                    self._queue = deque(p for p in self._queue if id(p) not in taken)
                    self._dequeued(chosen)
                    return chosen
                wake = dispatch_at if next_deadline is None else min(dispatch_at, next_deadline)
                self._cv.wait(max(wake - now, 0.0005))

    # ---- running it -------------------------------------------------------------------------------
    def _worker(self, instance: Instance) -> None:
        while True:
            try:
                batch = self._next_batch()
                if batch is None:
                    return
                self._execute(instance, batch)
            except Exception:  # never let a worker die: its requests were answered in _execute
                log.exception("batcher worker of model %s failed", self.model)
                time.sleep(0.01)

    def _execute(self, instance: Instance, batch: list[_Pending]) -> None:
        live = [p for p in batch if p.future.set_running_or_notify_cancel()]
        # The requests whose rows run: a member dropped from here on is still run, and its answer
        # ignored by whoever dropped it.
        units = [(p, m) for p in live for m in p.members if not m.dropped]
        if not units:  # every member of these (grouped) entries was dropped after they were taken
            for p in live:
                p.future.set_result([None] * len(p.members))
            return
        requests = [m for _, m in units]
        start = time.monotonic()
        total = sum(m.batch for m in requests)
        try:
            feeds, rows = self._feeds(instance, requests, total)
            ready = time.monotonic()
            outputs = instance.run(feeds)
            ran = time.monotonic()
            parts = self._split(instance, outputs, requests, rows)
            written = self._sinks(outputs, parts, requests, rows)
        except ServeError as exc:
            for p in live:
                _fail(p.future, exc)
            return
        except SartorError as exc:
            for p in live:
                _fail(p.future, InvalidRequest(f"model '{self.model}': {exc}"))
            return
        except Exception as exc:
            log.exception("model %s version %s failed on a batch of %d", self.model, self.version, total)
            message = " ".join(str(exc).split())[:500]
            for p in live:
                _fail(p.future, ExecutionError(f"model '{self.model}' failed to run: {type(exc).__name__}: {message}"))
            return
        done = time.monotonic()
        queued = [start - p.enqueued for p, _ in units]
        # Per batch, not per request: one lock and one key for the whole batch.
        m, series = self.metrics, self._series
        m.inc_many(series, {"nv_inference_exec_count": 1, "nv_inference_count": total,
                            "nv_inference_compute_input_duration_us": (ready - start) * 1e6,
                            "nv_inference_compute_infer_duration_us": (ran - ready) * 1e6,
                            "nv_inference_compute_output_duration_us": (done - ran) * 1e6,
                            "nv_inference_queue_duration_us": sum(queued) * 1e6})
        m.observe("nv_inference_batch_size", series, total)
        m.observe("nv_inference_compute_infer_histogram_ms", series, (ran - ready) * 1e3)
        m.observe_many("nv_inference_queue_histogram_ms", series, [q * 1e3 for q in queued])
        answers = {id(member): wrote if isinstance(wrote, BaseException)
                   else BatchResult(out, waited, ran - ready, total, wrote)
                   for member, out, waited, wrote in zip(requests, parts, queued, written)}
        for p in live:
            if p.future.done():
                continue
            if isinstance(p.future, GroupFuture):
                p.future.set_result([answers.get(id(member)) for member in p.members])
            elif isinstance(answer := answers[id(p.members[0])], BaseException):
                _fail(p.future, answer)
            else:
                p.future.set_result(answer)

    def _feeds(self, instance: Instance, live: list[_Member], total: int) -> tuple[dict, int]:
        """The batch's inputs and its rows (total, or more when padded up to a warmed batch), copied
        once into the instance's staging buffers. The requests' arrays may be read-only views of the
        wire bytes (decoding does not copy): this is their one copy."""
        first = live[0].inputs
        if (len(live) == 1 and not str(instance.device).startswith("cuda")
                and all(isinstance(a, np.ndarray) and a.flags.writeable and a.flags.c_contiguous
                        for a in first.values())):
            return first, total
        batched = bool(self.policy.max_batch_size)
        rows = total
        if batched and self.policy.dynamic:
            rows = instance.warm_batch({name: tuple(a.shape[1:]) for name, a in first.items()}, total)
        feeds = {}
        for name, a in first.items():
            parts = [p.inputs[name] for p in live]
            shape = (rows, *a.shape[1:]) if batched else tuple(a.shape)
            if any(_is_tensor(part) for part in parts):
                feeds[name] = _fill_device(instance, name, shape, parts, total, batched)
                continue
            buffer = instance.staging(name, shape, a.dtype)
            if not batched:
                np.copyto(buffer, a)
            else:
                offset = 0
                for part in parts:
                    buffer[offset:offset + len(part)] = part
                    offset += len(part)
                if rows > total:
                    buffer[total:] = 0  # padding rows: defined values, their outputs are dropped
            feeds[name] = buffer
        return feeds, rows

    def _sinks(self, outputs: dict, parts: list[dict], live: list[_Member], rows: int) -> list:
        """Each request's sink run on its rows (see Sink): what it wrote, its exception, or None
        where it has none. Here, on the worker, rather than per response on the event loop: with
        CUDA shared memory an output goes device to device, all of the batch's copies in one launch
        per device and dtype, waited for once (DeviceCopies)."""
        if not any(p.sink for p in live):
            return [None] * len(live)
        tensors = {name: value for name, value in outputs.items() if _is_tensor(value)}
        device_parts = _rows(tensors, live, rows) if tensors else [None] * len(live)
        written, copies = [], DeviceCopies()
        for p, host, device in zip(live, parts, device_parts):
            if p.sink is None:
                written.append(None)
                continue
            try:
                written.append(p.sink(host, device, copies))
            except Exception as exc:  # noqa: BLE001 (that request's answer)
                written.append(exc)
        copies.run()
        return written

    def _split(self, instance: Instance, outputs: dict, live: list[_Member], rows: int) -> list[dict]:
        # Outputs are torch tensors when every input was (CUDA shared memory): on CUDA the context's
        # own buffers, valid until its next run, so they are copied to the host here, once the batch
        # is done (a copy to the host would wait for it spinning a core).
        wait_for_tensors([value for value in outputs.values() if _is_tensor(value)])
        outputs = {name: value.detach().to("cpu", copy=True).numpy() if _is_tensor(value) else np.asarray(value)
                   for name, value in outputs.items()}
        # An output that is a view of a staging buffer (an identity-like engine on CPU) would change
        # under the response while the next batch fills the buffer.
        outputs = {name: value.copy() if value.size and instance.owns(value) else value
                   for name, value in outputs.items()}
        return _rows(outputs, live, rows)


def _rows(outputs: dict, live: list[_Member], rows: int) -> list[dict]:
    """Each request's rows of the batch's outputs (numpy arrays or torch tensors: views)."""
    if len(live) == 1 and rows == live[0].batch:
        return [outputs]
    parts: list[dict] = [{} for _ in live]
    sizes = [p.batch for p in live]
    padding = rows - sum(sizes)
    for name, value in outputs.items():
        if value.ndim == 0 or value.shape[0] != rows:
            raise ExecutionError(f"output {name!r} of shape {list(value.shape)} has no batch dim of "
                                 f"{rows}: it cannot be split between batched requests")
        if _is_tensor(value):  # one call for all the views: a torch slice costs microseconds each
            chunks = value.split(sizes + [padding] if padding else sizes)
        else:
            offsets = itertools.accumulate(sizes, initial=0)
            chunks = [value[start:start + size] for start, size in zip(offsets, sizes)]
        for part, chunk in zip(parts, chunks):
            part[name] = chunk
    return parts


def _fill_device(instance: Instance, name: str, shape: tuple, parts: list, total: int, batched: bool):
    """The batch's input `name` in a device buffer of the instance: torch parts (CUDA shared memory)
    are copied device to device, numpy parts host to device, padding rows zeroed."""
    import torch

    from ..ir.dtypes import NUMPY_TO_TORCH
    first = parts[0]
    dtype = first.dtype if _is_tensor(first) else NUMPY_TO_TORCH[first.dtype.name]
    buffer = instance.device_staging(name, shape, dtype)

    def tensor(part):
        if _is_tensor(part):
            return part
        # torch.from_numpy warns on read-only arrays (views of a request body): copy those.
        return torch.from_numpy(part if part.flags.writeable else np.array(part))

    if not batched:
        buffer.copy_(tensor(first))
        return buffer
    if all(_is_tensor(part) and part.device == buffer.device and part.dtype == dtype for part in parts):
        # One launch for the batch rather than a copy_ per request (each a launch in the main
        # process: docs/decisions/0017-serve-batched-copies-sleeping-waits.md).
        torch.cat(parts, out=buffer[:total])
    else:
        offset = 0
        for part in parts:
            buffer[offset:offset + len(part)].copy_(tensor(part))
            offset += len(part)
    if shape[0] > total:
        buffer[total:].zero_()
    return buffer


# Deadlines this close share a queue entry: the requests of one frontend group arrive within one
# read of its channel, so the server's default timeout (60 s) gives them deadlines microseconds apart.
DEADLINE_SLACK_S = 0.002


def _close_deadlines(a: float | None, b: float | None) -> bool:
    if a is None or b is None:
        return a is b
    return abs(a - b) <= DEADLINE_SLACK_S


def _fail(future: Future, error: Exception) -> None:
    if future.done():
        return
    if not future.running() and not future.set_running_or_notify_cancel():
        return  # the caller went away
    future.set_exception(error)
