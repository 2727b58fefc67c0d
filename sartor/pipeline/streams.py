"""Several frame sources decoded at once, each on a thread of its own, merged into one sequence in
the order their frames come out of the decoders, so one engine batch holds frames of several streams.

Each stream's own frames stay in order. A bounded queue keeps a decoder from running far ahead of
the engine (`prefetch` frames per stream). `decoded_at[name]` is when each frame left its decoder
(time.perf_counter), for per-frame latency. Stopping early (a consumer that closes the iterator, or
an error) stops every decoder thread before the iterator returns."""
from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterable, Iterator

from .sources import FrameSource

_DONE = object()  # a decoder thread's last item
POLL_S = 0.05  # how often a decoder blocked on a full queue looks whether it should stop


class ConcurrentStreams:
    def __init__(self, sources: list[Iterable[FrameSource]], prefetch: int = 8) -> None:
        self.sources = list(sources)
        self.prefetch = max(1, prefetch)
        self.decoded_at: dict[str, float] = {}

    def __iter__(self) -> Iterator[FrameSource]:
        merged: queue.Queue = queue.Queue(maxsize=self.prefetch * max(1, len(self.sources)))
        stop = threading.Event()

        def put(item) -> bool:
            while not stop.is_set():
                try:
                    merged.put(item, timeout=POLL_S)
                    return True
                except queue.Full:
                    continue
            return False

        def decode(source) -> None:
            frames = iter(source)
            try:
                for item in frames:
                    self.decoded_at[item.name] = time.perf_counter()
                    if not put(item):
                        return
            except BaseException as exc:  # noqa: BLE001 - handed to the consumer, raised there
                put(exc)
            finally:
                close = getattr(frames, "close", None)
                if close is not None:
                    close()
                put(_DONE)

        threads = [threading.Thread(target=decode, args=(source,), name=f"sartor-stream-{k}", daemon=True)
                   for k, source in enumerate(self.sources)]
        for thread in threads:
            thread.start()
        try:
            running = len(threads)
            while running:
                item = merged.get()
                if item is _DONE:
                    running -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield item
        finally:
            stop.set()
            for thread in threads:
                thread.join()
