"""Request bodies admitted against their model's queue room before they are read.

A frontend reads a body, parses it into tensors and only then queues it, so without a bound on the
reading side a flood of large requests holds every body in memory however small the queue is (200
concurrent 9.8 MB requests against a queue of 16 grew the server by 2 GB). Each inference request is
counted from before its body is read until it is queued (or fails): a request that finds its model's
queue plus the bodies already being read at the queue's bound is refused at once with the QueueFull
(503 / UNAVAILABLE) a full queue gives, without reading its body. Server memory is then bounded by
about (2 × max_queue_size + a running batch) × --max-request-bytes per model.
"""
from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from .errors import QueueFull


class BodyAdmission:
    """Bodies being read (and parsed) per model, against a bound that counts the queued ones too."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # gRPC handlers and the event loop may both admit
        self._reading: dict[object, int] = {}

    def reading_count(self, key: object) -> int:
        with self._lock:
            return self._reading.get(key, 0)

    @contextmanager
    def reading(self, key: object, label: str, queued: Callable[[], int], bound: int) -> Iterator[None]:
        """Hold one place of `key`'s queue while the body is read; QueueFull when none is left.
        `queued()`: requests in the queue now; `label`: the model as messages name it."""
        with self._lock:
            reading = self._reading.get(key, 0)
            waiting = queued()
            if waiting + reading >= bound:
                raise QueueFull(f"{label}: the queue is full ({waiting} requests waiting and {reading} being "
                                f"received, of max_queue_size {bound}); the body was not read; retry later")
            self._reading[key] = reading + 1
        try:
            yield
        finally:
            with self._lock:
                left = self._reading[key] - 1
                if left:
                    self._reading[key] = left
                else:
                    del self._reading[key]
