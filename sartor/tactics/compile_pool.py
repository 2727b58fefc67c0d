"""Compile every layer's Triton candidates up front, in worker processes, before the layers are timed.

A cold build spends most of its tactics stage in Triton's JIT, and per layer threads
(precompile.py) scale poorly: a layer has few candidates, and Triton's front end (the Python AST
walk that emits TTIR, its Python passes) holds the GIL. So the builder first records the compile
requests of all layers' candidates (kernel_requests.py: Triton's jit_cache_hook, nothing compiled
or launched), hands those not in Triton's cache already to worker processes, and times the layers
afterwards: their kernels are then cache hits (a cubin loaded), and the per-layer threads only load
them. See docs/decisions/0039-parallel-precompile.md.

Workers are plain `python -m sartor.tactics.compile_worker` subprocesses, not multiprocessing's:
a spawned multiprocessing child imports the caller's main script, which would run a user's
unguarded `sartor.build(...)` again. They see no GPU (they compile for the recorded target) and
write into the builder's Triton cache directory.

Only on CUDA and never under Triton's interpreter. Anything that goes wrong leaves the build as it
was without this step (a debug log line says why): a kernel not compiled here compiles when its
layer is timed. `SARTOR_COMPILE_WORKERS` sets the worker count (0 turns the step off).
"""
from __future__ import annotations

import logging
import os
import queue
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from ..runtime.launchers import usable_cpus
from .kernel_requests import CompileRequest, Recorder, cache_state, check_recording_available
from .precompile import MAX_WORKERS, interpreting

log = logging.getLogger("sartor.tactics")

WORKERS_ENV = "SARTOR_COMPILE_WORKERS"
# The most the workers may take together; past it they are stopped and the rest compiles when timed.
DEADLINE_S = 600.0
_WORKER_MODULE = "sartor.tactics.compile_worker"
LOGGED_FAILURES = 3  # failed requests named in the debug log; the summary counts them all


@dataclass
class Precompiled:
    """What the step did: requests recorded (and compiles that could not be), found in the cache,
    compiled, failed (left to the
    timing run), compiled under another key than this process looks up (mismatched), and each
    first-asking tactic's share of the work (`spent`: worker seconds, for charging the families)."""
    requests: int = 0
    unrecorded: int = 0  # compiles the recorder could not write down (they compile when timed)
    failed_runs: int = 0  # candidate runs that raised while recorded (the timing run says why)
    cached: int = 0
    compiled: int = 0
    failed: int = 0
    mismatched: int = 0
    workers: int = 0
    seconds: float = 0.0
    spent: dict[str, float] = field(default_factory=dict)

    def shares(self) -> dict[str, float]:
        """Each tactic's share of the step's wall time: its worker seconds, equal shares when nothing
        needed compiling."""
        return dict(self.spent) if sum(self.spent.values()) > 0 else {tactic: 1.0 for tactic in self.spent}

    def summary(self) -> str:
        return (f"precompile: {self.requests} kernel(s) recorded ({self.unrecorded} could not be; "
                f"{self.failed_runs} candidate run(s) raised), {self.cached} cached, {self.compiled} compiled in "
                f"{self.workers} process(es), {self.failed} failed, {self.mismatched} under another key, "
                f"{self.seconds:.1f} s")


def worker_count() -> int:
    """Workers to use: SARTOR_COMPILE_WORKERS when it is an integer, else the CPUs this process may
    run on, at most MAX_WORKERS (each worker holds a Triton compiler's memory)."""
    given = os.environ.get(WORKERS_ENV, "").strip()
    if given.lstrip("-").isdigit():
        return max(0, min(int(given), MAX_WORKERS))
    return min(usable_cpus(), MAX_WORKERS)


def applies(device: torch.device) -> bool:
    """Whether the step runs for a build on `device`: CUDA, compiled kernels, two workers or more."""
    return device.type == "cuda" and not interpreting() and worker_count() >= 2


def precompile(collect: Callable[[Recorder], None], device: torch.device) -> Precompiled | None:
    """Record the compiles `collect(recorder)` asks for (it runs candidates through
    `recorder.run`) and compile those not cached yet in worker processes. None where the step does
    not apply or failed; the build then goes on as without it."""
    if not applies(device):
        return None
    started = time.perf_counter()
    try:
        check_recording_available()
        recorder = Recorder()
        collect(recorder)
        done = _compile_recorded(recorder, worker_count())
    except Exception as exc:  # noqa: BLE001 - the build goes on, compiling each layer's kernels when timed
        log.debug("precompile skipped: %s: %s", type(exc).__name__, exc)
        return None
    done.seconds = time.perf_counter() - started
    log.debug(done.summary())
    return done


def _compile_recorded(recorder: Recorder, workers: int) -> Precompiled:
    done = Precompiled(requests=len(recorder.requests), unrecorded=recorder.unrecorded,
                       failed_runs=recorder.failed_runs)
    expected, missing = {}, []
    for ident, request in recorder.requests.items():
        expected[ident], cached = _cache_state(request)
        if cached:
            done.cached += 1
            _add(done.spent, recorder.tactic_of[ident], 0.0)
        else:
            missing.append(request)
    done.workers = min(workers, len(missing))
    answers = compile_in_workers(missing, done.workers) if missing else {}
    for request in missing:
        reply = answers.get(request.ident) or {"error": "not compiled before the deadline"}
        if "error" in reply:
            done.failed += 1
            if done.failed <= LOGGED_FAILURES:
                log.debug("precompile: %s.%s not compiled: %s", request.module, request.qualname, reply["error"])
            continue
        done.compiled += 1
        done.mismatched += expected[request.ident] not in (None, reply["hash"])
        _add(done.spent, recorder.tactic_of[request.ident], reply["seconds"])
    return done


def _add(spent: dict[str, float], tactic: str, seconds: float) -> None:
    spent[tactic] = spent.get(tactic, 0.0) + seconds


def _cache_state(request: CompileRequest) -> tuple[str | None, bool]:
    """kernel_requests.cache_state, or (None, False) when it cannot say (the request is then
    compiled, and its key not checked)."""
    try:
        return cache_state(request)
    except Exception:  # noqa: BLE001
        return None, False


# ---- worker processes ---------------------------------------------------------------------------

def compile_in_workers(requests: list[CompileRequest], workers: int,
                       deadline_s: float = DEADLINE_S) -> dict[str, dict]:
    """Compile `requests` in `workers` worker processes, each taking the next request when it is
    done with one; {ident: worker's answer} for those answered ({"hash", "seconds"} or {"error"}).
    A worker that dies takes no more; all are stopped at the deadline."""
    pending: queue.SimpleQueue = queue.SimpleQueue()
    for request in requests:
        pending.put(request)
    pool = _Pool(pending, _worker_env())
    threads = [threading.Thread(target=pool.feed_worker, name=f"sartor-compile-worker-{k}", daemon=True)
               for k in range(max(1, workers))]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + deadline_s
    try:
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))
    finally:
        pool.stop_all()
        for thread in threads:
            thread.join(5.0)
    return dict(pool.answers)


class _Pool:
    """The worker processes of one compile_in_workers call, one feeding thread each."""

    def __init__(self, pending: queue.SimpleQueue, env: dict) -> None:
        self.pending, self.env = pending, env
        self.answers: dict[str, dict] = {}
        self.processes: list[subprocess.Popen] = []
        self.lock = threading.Lock()
        self.stopped = False

    def feed_worker(self) -> None:
        """Start a worker and feed it requests until none is left, it dies, or the pool stops."""
        from .compile_worker import read_frame, write_frame
        process = self._start()
        if process is None:
            return
        try:
            while not self.stopped:
                try:
                    request = self.pending.get_nowait()
                except queue.Empty:
                    return
                try:
                    write_frame(process.stdin, request)
                    reply = read_frame(process.stdout)
                except Exception:  # noqa: BLE001 - EOF when it died, OSError or ValueError when its pipe closed
                    self.answers[request.ident] = {"error": f"the worker ended (exit status {process.poll()})"}
                    return
                self.answers[reply["ident"]] = reply
        finally:
            _stop(process)

    def _start(self) -> subprocess.Popen | None:
        with self.lock:
            if self.stopped:
                return None
            try:
                process = subprocess.Popen([sys.executable, "-m", _WORKER_MODULE], stdin=subprocess.PIPE,
                                           stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=self.env)
            except OSError as exc:
                log.debug("precompile: a worker did not start: %s", exc)
                return None
            self.processes.append(process)
            return process

    def stop_all(self) -> None:
        """Past the deadline (or once every thread is done): no new worker, and any still running ended."""
        with self.lock:
            self.stopped = True
            processes = list(self.processes)
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait()


def _stop(process: subprocess.Popen) -> None:
    """Close a worker's input (it exits when it has answered) and end it if it does not."""
    try:
        if process.stdin and not process.stdin.closed:
            process.stdin.close()
    except OSError:
        pass
    try:
        process.wait(timeout=2.0)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
    if process.stdout:
        process.stdout.close()


def _worker_env() -> dict:
    """The builder's environment, with its Triton cache directory (which it may have set through
    Triton's knobs rather than TRITON_CACHE_DIR), sartor importable where this process imports it
    from, compiled kernels rather than interpreted ones, and no GPU: workers only compile."""
    from triton import knobs
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    env["TRITON_CACHE_DIR"] = str(knobs.cache.dir)
    env["CUDA_VISIBLE_DEVICES"] = ""
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join([root, *filter(None, [env.get("PYTHONPATH", "")])])
    return env
