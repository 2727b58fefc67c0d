"""What both frontends call: server and model metadata, inference with retries across a version
swap, timeouts, shared memory, statistics. Frontends only translate wire formats to and from these
calls."""
from __future__ import annotations

import asyncio
import contextlib
import math
import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from ..version import __version__
from .admission import BodyAdmission
from .batcher import GroupFuture
from .device_copies import DeviceCopies
from .errors import BatcherClosed, InvalidRequest, ModelUnavailable, QueueFull, RequestTimeout, ServeError
from .relay import LoopRelay, expire
from .repository import Repository, ServedModel
from .shared_memory import Lease, SharedMemoryRegistry, ShmInput, ShmRef

SERVER_NAME = "sartor"
EXTENSIONS = ["model_repository", "schedule_policy", "model_configuration", "system_shared_memory",
              "binary_tensor_data", "parameters", "statistics", "infer_image"]
# Listed only where torch sees a GPU. A Triton client that checks the extensions before using CUDA
# shared memory then learns the truth; one that does not check gets a one-line UNIMPLEMENTED at
# registration. The routes exist either way, so that unregistering everything (what perf_analyzer
# does at start, for both kinds) succeeds on a CPU-only server too.
CUDA_EXTENSION = "cuda_shared_memory"
COMPLETION_GRACE_S = 1.0  # how long past its deadline a request that already runs may take
SWAP_RETRIES = 8


@dataclass
class InferOutcome:
    model: ServedModel
    outputs: dict  # name -> np.ndarray, in the engine's output order, filtered to those requested
    # name -> bytes written, for the outputs written to shared memory: their response entries carry
    # name, datatype and shape only, as Triton's (perf_analyzer's HTTP client reads an entry that has
    # "parameters" as binary data and fails without binary_data_size)
    shared_memory: dict = field(default_factory=dict)


@dataclass(eq=False)
class GroupMember:
    """One inference request of a group (a frontend process's grouped frame), as `infer` takes its
    arguments, and what start_group keeps of it while it runs."""
    key: int
    name: str
    version: str | None
    inputs: dict
    outputs: list | None = None
    timeout_us: object = None
    client_deadline_s: float | None = None
    output_regions: dict = field(default_factory=dict)
    start: float = 0.0
    model: ServedModel | None = None
    batch: int = 0
    timeout_s: float | None = None
    deadline: float | None = None
    lease: Lease | None = None
    future: GroupFuture | None = None  # its batcher entry's, once queued
    slot: int = 0  # its answer's place in that future's list
    done: Callable | None = None  # start_group's `done`, once queued
    answered: bool = False  # `done` ran (or is running) for it: later outcomes are dropped
    task: asyncio.Task | None = None
    cancelled: bool = False


def _region_sink(lease: Lease | None, output_regions: dict[str, ShmRef] | None):
    """The batcher's sink (batcher.Sink) for a request's outputs in shared memory, or None. The
    batcher's worker writes them right after the batch: the event loop, which answers every request,
    does no copy, and CUDA regions get device-to-device copies, issued with the batch's others and
    waited for once, not a host round trip and a synchronization per response."""
    if not output_regions:
        return None

    def sink(host: dict, device: dict | None, copies: DeviceCopies) -> dict:
        return {name: lease.write_output(ref, np.asarray(host[name]), device.get(name) if device else None, copies)
                for name, ref in output_regions.items()}
    return sink


def _timed_out(name: str, timeout_s: float) -> RequestTimeout:
    return RequestTimeout(f"model '{name}': the request timed out after {timeout_s * 1e3:.0f} ms")


def _hold_for(lease: Lease, future) -> None:
    """The batcher may still read a request's regions after its caller gave up (a timeout): they
    stay leased until the batcher's `future` is done too."""
    lease.hold()
    future.add_done_callback(lambda _: lease.release())


def _release(m: GroupMember) -> None:
    """The member's own lease hold, once."""
    lease, m.lease = m.lease, None
    if lease is not None:
        lease.release()


class InferenceCore:
    def __init__(self, repository: Repository, metrics, default_timeout_s: float | None = None,
                 shared_memory: SharedMemoryRegistry | None = None) -> None:
        self.repository = repository
        self.metrics = metrics
        self.default_timeout_s = default_timeout_s
        self.shared_memory = shared_memory if shared_memory is not None else SharedMemoryRegistry()
        self.extensions = EXTENSIONS + ([CUDA_EXTENSION] if self.shared_memory.cuda_available() else [])
        self._loop_relay: LoopRelay | None = None
        self._series_of: dict = {}
        # With --engine-processes K, the other shards (peers.Siblings): loads, unloads and
        # statistics span them (the registry is mirrored by peers.MirroredRegistry).
        self.siblings = None
        self.admission = BodyAdmission()

    # ---- server -------------------------------------------------------------------------------------
    def server_metadata(self) -> dict:
        return {"name": SERVER_NAME, "version": __version__, "extensions": list(self.extensions)}

    def live(self) -> bool:
        return True

    def ready(self) -> bool:
        return self.repository.ready

    # ---- inference ----------------------------------------------------------------------------------
    @contextlib.contextmanager
    def admit(self, name: str, version: str | None):
        """A context held while a request's body is read and parsed: QueueFull at once (counted as a
        rejected request), before the body is read, when the model's queue has no room (admission.py)."""
        model = self.repository.served(name, version)
        batcher = model.batcher
        with contextlib.ExitStack() as stack:
            try:
                stack.enter_context(self.admission.reading(
                    (model.name, model.version), f"model '{model.name}' version {model.version}",
                    lambda: batcher.pending, batcher.policy.max_queue_size))
            except QueueFull as exc:
                self._count_failure(model, exc)
                raise
            yield

    def _timeout(self, model: ServedModel, timeout_us) -> float | None:
        if timeout_us is not None:
            if (isinstance(timeout_us, bool) or not isinstance(timeout_us, (int, float)) or not math.isfinite(timeout_us)
                    or timeout_us < 0):
                raise InvalidRequest(f"parameter timeout {timeout_us!r} must be a non-negative number of microseconds")
        configured = model.settings.default_timeout_s
        default = configured if configured is not None else self.default_timeout_s
        if timeout_us and (configured is None or model.settings.allow_timeout_override):
            return float(timeout_us) / 1e6
        return default

    async def infer(self, name: str, version: str | None, inputs: dict, outputs: list[str] | None = None,
                    timeout_us=None, client_deadline_s: float | None = None,
                    output_regions: dict[str, ShmRef] | None = None) -> InferOutcome:
        """Validate, queue, await. `inputs`: name -> np.ndarray, or ShmInput (data in a registered
        region). `output_regions`: outputs to write into shared memory instead of the response.
        `client_deadline_s`: seconds the client still waits (gRPC deadline)."""
        if not output_regions and not any(isinstance(v, ShmInput) for v in inputs.values()):
            return await self._infer(name, version, inputs, outputs, timeout_us, client_deadline_s, None, None)
        lease = self.shared_memory.lease()
        try:
            inputs = {n: lease.read(v) if isinstance(v, ShmInput) else v for n, v in inputs.items()}
            for ref in (output_regions or {}).values():
                lease.check_output(ref)
            return await self._infer(name, version, inputs, outputs, timeout_us, client_deadline_s, lease,
                                     output_regions)
        finally:
            lease.release()

    def _deadline(self, model: ServedModel, timeout_us, client_deadline_s: float | None,
                  start: float) -> tuple[float | None, float | None]:
        """(timeout in seconds, monotonic deadline) of a request that arrived at `start`."""
        timeout_s = self._timeout(model, timeout_us)
        if client_deadline_s is not None:
            client_deadline_s = max(client_deadline_s, 0.0)
            timeout_s = client_deadline_s if timeout_s is None else min(timeout_s, client_deadline_s)
        return timeout_s, (start + timeout_s if timeout_s is not None else None)

    async def _infer(self, name: str, version: str | None, inputs: dict, outputs: list[str] | None, timeout_us,
                     client_deadline_s: float | None, lease: Lease | None, output_regions: dict | None
                     ) -> InferOutcome:
        start = time.monotonic()
        model = None
        written: dict = {}
        try:
            for _ in range(SWAP_RETRIES):
                model = self.repository.served(name, version)
                batch = model.check_inputs(inputs)
                if outputs:
                    model.check_outputs(outputs)
                timeout_s, deadline = self._deadline(model, timeout_us, client_deadline_s, start)
                try:
                    future = model.batcher.submit(inputs, batch, deadline, _region_sink(lease, output_regions))
                    break
                except BatcherClosed:
                    await asyncio.sleep(0.001)
            else:
                raise ModelUnavailable(f"model '{name}' is being reloaded; retry")
            if lease is not None:
                _hold_for(lease, future)
            wait = None if deadline is None else max(deadline - time.monotonic(), 0.0) + COMPLETION_GRACE_S
            waiter = self._relay().wait(future)
            timer = None if wait is None else waiter.get_loop().call_later(wait, expire, waiter, future)
            try:
                result = await waiter
            except asyncio.TimeoutError:
                raise _timed_out(name, timeout_s) from None
            finally:
                if timer is not None:
                    timer.cancel()
            written = result.written or {}
        except ServeError as exc:
            self._count_failure(model, exc)
            raise
        return self._succeeded(model, start, outputs, result, written)

    def _succeeded(self, model: ServedModel, start: float, outputs: list[str] | None, result, written: dict
                   ) -> InferOutcome:
        """A request's answer, counted in the metrics."""
        self._count_successes(model, 1, (time.monotonic() - start) * 1e6)
        return self._outcome(model, outputs, result, written)

    def _count_successes(self, model: ServedModel, count: int, duration_us: float) -> None:
        self.metrics.inc_many(self._series(model), {"nv_inference_request_success": count,
                                                    "nv_inference_request_duration_us": duration_us})
        model.last_inference_ms = int(time.time() * 1000)

    @staticmethod
    def _outcome(model: ServedModel, outputs: list[str] | None, result, written: dict) -> InferOutcome:
        """The outputs a request asked for (all by default)."""
        wanted = outputs or list(result.outputs)
        return InferOutcome(model, {n: np.asarray(result.outputs[n]) for n in wanted}, written)

    def _count_failure(self, model: ServedModel | None, error: ServeError) -> None:
        if model is not None:
            self.metrics.inc("nv_inference_request_failure",
                             {"model": model.name, "version": model.version, "reason": error.metric_reason})

    # ---- grouped inference (frontend processes) ---------------------------------------------------
    def start_group(self, members: list["GroupMember"], done: Callable[["GroupMember", object], None]
                    ) -> list["GroupMember"]:
        """Validate and queue a group of requests at once, without a task each (call on the event loop).
        `done(member, answer)` runs on the loop once per member: an InferOutcome, the exception `infer`
        would raise, or None where the member was cancelled (`cancel_member`). Requests naming the
        same shared-memory region share one lease of it. Returns the members whose batcher was being
        replaced (a version swap): run each through `infer_member`, which retries as `infer` does."""
        loop = asyncio.get_running_loop()
        lease: Lease | None = None
        by_batcher: dict[int, tuple] = {}
        retry: list[GroupMember] = []
        try:
            for m in members:
                if m.cancelled:
                    done(m, None)
                    continue
                m.start = time.monotonic()
                try:
                    if m.output_regions or any(isinstance(v, ShmInput) for v in m.inputs.values()):
                        if lease is None:
                            lease = self.shared_memory.lease()
                        lease.hold()  # the member's own hold, released once it is answered
                        m.lease = lease
                        m.inputs = {n: lease.read(v) if isinstance(v, ShmInput) else v for n, v in m.inputs.items()}
                        for ref in m.output_regions.values():
                            lease.check_output(ref)
                    m.model = self.repository.served(m.name, m.version)
                    m.batch = m.model.check_inputs(m.inputs)
                    if m.outputs:
                        m.model.check_outputs(m.outputs)
                    m.timeout_s, m.deadline = self._deadline(m.model, m.timeout_us, m.client_deadline_s, m.start)
                except Exception as exc:  # noqa: BLE001 (the member's answer)
                    self._member_failed(m, exc, done)
                    continue
                batcher = m.model.batcher
                by_batcher.setdefault(id(batcher), (batcher, []))[1].append(m)
            relay = self._relay()
            for batcher, queued in by_batcher.values():
                try:
                    answers = batcher.submit_group([(m.inputs, m.batch, m.deadline,
                                                     _region_sink(m.lease, m.output_regions)) for m in queued])
                except BatcherClosed:
                    retry.extend(queued)
                    continue
                entries: dict[int, tuple[GroupFuture, list]] = {}
                for m, answer in zip(queued, answers):
                    if isinstance(answer, BaseException):
                        self._member_failed(m, answer, done)
                        continue
                    m.future, m.slot = answer
                    m.done = done
                    entries.setdefault(id(m.future), (m.future, []))[1].append(m)
                for future, members in entries.values():
                    if lease is not None and any(m.lease is not None for m in members):
                        _hold_for(lease, future)
                    # One timer for the entry: its members' deadlines lie within the batcher's
                    # DEADLINE_SLACK_S, and the latest one times the entry out in the queue too.
                    deadline = max((m.deadline for m in members if m.deadline is not None), default=None)
                    timer = None
                    if deadline is not None:
                        wait = max(deadline - time.monotonic(), 0.0) + COMPLETION_GRACE_S
                        timer = loop.call_later(wait, self._entry_expired, members)
                    relay.notify(future, lambda ended, members=members, timer=timer:
                                 self._entry_answered(ended, members, timer))
        finally:
            if lease is not None:
                lease.release()  # the group's hold; its members hold it as long as they need it
        return retry

    async def infer_member(self, m: "GroupMember") -> InferOutcome:
        """A member that start_group gave back, run the per-request way (its lease hold included)."""
        try:
            return await self._infer(m.name, m.version, m.inputs, m.outputs, m.timeout_us, m.client_deadline_s,
                                     m.lease, m.output_regions)
        finally:
            _release(m)

    def cancel_member(self, m: "GroupMember") -> None:
        """Its caller went away: drop it from its batcher entry if that has not started running (or
        before it is queued), and answer it with None now."""
        m.cancelled = True
        if m.task is not None:
            m.task.cancel()
        elif m.future is not None and not m.answered:
            m.future.drop(m.slot)
            m.answered = True
            self._member_dropped(m)

    def _entry_expired(self, members: list["GroupMember"]) -> None:
        """The deadline of their entry (and the grace) passed: the members not answered yet fail with
        a timeout, and the batcher drops them if the entry has not started running."""
        for m in members:
            if not m.answered:
                m.answered = True
                m.future.drop(m.slot)
                self._member_failed(m, _timed_out(m.name, m.timeout_s), m.done)

    def _entry_answered(self, future: GroupFuture, members: list["GroupMember"],
                        timer: asyncio.TimerHandle | None) -> None:
        """The batcher entry of these members ended (on the loop, through the relay): each member
        not answered meanwhile (cancelled, timed out) gets its own answer from the entry's list, or
        the entry's exception."""
        if timer is not None:
            timer.cancel()
        answers = error = None
        if not future.cancelled():
            error = future.exception()
            if error is None:
                answers = future.result()
        successes, duration_us, now = 0, 0.0, time.monotonic()
        for m in members:
            if m.answered:
                continue
            m.answered = True
            if error is not None:
                answer = error
            else:  # None where the entry was cancelled: every member dropped
                answer = answers[m.slot] if answers is not None else None
            if answer is None:
                self._member_dropped(m)
            elif isinstance(answer, BaseException):
                self._member_failed(m, answer, m.done)
            else:
                successes += 1
                duration_us += (now - m.start) * 1e6
                outcome = self._outcome(m.model, m.outputs, answer, answer.written or {})
                _release(m)
                m.done(m, outcome)
        if successes:
            self._count_successes(members[0].model, successes, duration_us)

    @staticmethod
    def _member_dropped(m: "GroupMember") -> None:
        """Its caller went away (or its batcher future was cancelled): no answer, None to `done`."""
        _release(m)
        m.done(m, None)

    def _member_failed(self, m: "GroupMember", error: BaseException, done) -> None:
        if isinstance(error, ServeError):
            self._count_failure(m.model, error)
        _release(m)
        done(m, error)

    def _relay(self) -> LoopRelay:
        loop = asyncio.get_running_loop()
        if self._loop_relay is None or self._loop_relay.loop is not loop:
            self._loop_relay = LoopRelay(loop)
        return self._loop_relay

    def _series(self, model: ServedModel) -> tuple:
        """The metrics key of a model version, made once."""
        series = self._series_of.get((model.name, model.version))
        if series is None:
            series = self._series_of[(model.name, model.version)] = self.metrics.key(
                {"model": model.name, "version": model.version})
        return series

    # ---- repository control and statistics, over every shard ---------------------------------------
    def load_model(self, name: str) -> None:
        """Load (or reload) the model's newest version here, then in the sibling shards (blocking)."""
        self.repository.load(name)
        if self.siblings is not None:
            self.siblings.apply_everywhere("/load", {"name": name})

    def unload_model(self, name: str) -> None:
        self.repository.unload(name)
        if self.siblings is not None:
            self.siblings.apply_everywhere("/unload", {"name": name})

    def statistics(self, name: str | None = None, version: str | None = None) -> list[dict]:
        """Triton's model statistics (JSON form of inference.ModelStatistics), summed over the
        shards where there are several."""
        rows = self.local_statistics(name, version)
        return rows if self.siblings is None else self.siblings.statistics(rows, name, version)

    def local_statistics(self, name: str | None = None, version: str | None = None) -> list[dict]:
        """This process's share of the statistics."""
        models = [self.repository.served(name, version)] if name else self.repository.served_models()
        stats = []
        for m in sorted(models, key=lambda m: m.name):
            labels = {"model": m.name, "version": m.version}
            get = lambda metric: self.metrics.get(metric, labels)  # noqa: E731
            failures = sum(self.metrics.get("nv_inference_request_failure", dict(labels, reason=r))
                           for r in ("OTHER", "REJECTED", "CANCELED", "BACKEND"))
            executions = int(get("nv_inference_exec_count"))
            successes = int(get("nv_inference_request_success"))
            duration = lambda count, metric: {"count": int(count), "ns": int(get(metric) * 1000)}  # noqa: E731
            stats.append({
                "name": m.name, "version": m.version, "last_inference": m.last_inference_ms,
                "inference_count": int(get("nv_inference_count")), "execution_count": executions,
                "inference_stats": {
                    "success": duration(successes, "nv_inference_request_duration_us"),
                    "fail": {"count": int(failures), "ns": 0},
                    "queue": duration(successes, "nv_inference_queue_duration_us"),
                    "compute_input": duration(executions, "nv_inference_compute_input_duration_us"),
                    "compute_infer": duration(executions, "nv_inference_compute_infer_duration_us"),
                    "compute_output": duration(executions, "nv_inference_compute_output_duration_us"),
                },
            })
        return stats
