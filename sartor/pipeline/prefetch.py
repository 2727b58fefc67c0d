"""Batches prepared ahead on a thread of their own: the caller `submit`s jobs, one worker thread runs
`prepare(*job, slot)` for each in order, and `take()` returns the results in that order, so decode
runs while the caller runs the batches before. The caller keeps up to `depth` jobs submitted and
not yet taken; the user's items are read in the caller's thread, as without the worker.

Each batch is prepared into a staging slot the worker takes from a free list, and the caller gives
it back (`release`) once the batch is launched (on CUDA, once the event that frees it on the device
is recorded), so a slot is never handed to two batches at once however far ahead the worker is.
An exception in the worker is raised to the caller at the batch it stopped, and the worker stops;
`close()` (also on the caller's early exit) stops the worker and joins it."""
from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable

POLL_S = 0.05  # how often a blocked worker looks whether it should stop


class _Failed:
    def __init__(self, exc: BaseException) -> None:
        self.exc = exc


class Prefetcher:
    def __init__(self, prepare: Callable, depth: int, name: str = "sartor-pipeline-decode") -> None:
        self.depth = max(1, depth)
        self._prepare = prepare
        self._todo: queue.Queue = queue.Queue()
        self._ready: queue.Queue = queue.Queue()
        self._free: queue.Queue = queue.Queue()
        for slot in range(self.depth + 1):  # `depth` waiting or being prepared, one being launched
            self._free.put(slot)
        self._stop = threading.Event()
        self.pending = 0  # jobs submitted and not yet taken
        self.busy_s = 0.0  # the worker's time preparing batches
        self.waited_s = 0.0  # the caller's time waiting for a prepared batch: what decode cost it
        self._thread = threading.Thread(target=self._work, name=name, daemon=True)
        self._thread.start()

    def submit(self, *job) -> None:
        self.pending += 1
        self._todo.put(job)

    def _get(self, source: queue.Queue):
        while not self._stop.is_set():
            try:
                return source.get(timeout=POLL_S)
            except queue.Empty:
                continue
        return None

    def _work(self) -> None:
        while True:
            job = self._get(self._todo)
            slot = self._get(self._free) if job is not None else None
            if slot is None:
                return  # stopped
            try:
                start = time.perf_counter()
                prepared = self._prepare(*job, slot)
                self.busy_s += time.perf_counter() - start
            except BaseException as exc:  # noqa: BLE001 - raised in the caller's thread, at this batch
                self._ready.put(_Failed(exc))
                return
            self._ready.put((prepared, slot))

    def take(self) -> tuple[object, int]:
        """The next job's (prepared batch, its slot); what its prepare raised, raised here."""
        if not self.pending:
            raise RuntimeError("take() with no job submitted")
        start = time.perf_counter()
        while True:
            try:
                item = self._ready.get(timeout=POLL_S)
                break
            except queue.Empty:
                if not self._thread.is_alive() and self._ready.empty():
                    raise RuntimeError("the pipeline's decode thread stopped") from None
        self.waited_s += time.perf_counter() - start
        self.pending -= 1
        if isinstance(item, _Failed):
            raise item.exc
        return item

    def release(self, slot: int) -> None:
        self._free.put(slot)

    def close(self) -> None:
        self._stop.set()
        self._thread.join()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()
