"""Batcher futures, awaited on the event loop at one wake-up per batch.

A batcher worker thread finishes a whole batch's concurrent futures in a row. `asyncio.wrap_future`
would wake the event loop once per future (a call_soon_threadsafe, a self-pipe write and a loop
iteration each); the relay queues the finished futures and wakes the loop once for all that finished
before it ran. Cancellation and exceptions pass as through wrap_future: cancelling the awaited future
cancels the batcher's (which drops a request that has not started running).

`notify` is the same without an asyncio future, for callers that only need a callback (grouped
requests): the callback runs in the drain itself, not through the loop's queue, and no future is
made for it (a grouped request otherwise goes through several loop callbacks on its way back).
"""
from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future

log = logging.getLogger(__name__)


class LoopRelay:
    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._lock = threading.Lock()
        self._finished: list[tuple[Future, asyncio.Future | Callable[[Future], None]]] = []

    def wait(self, source: Future) -> asyncio.Future:
        """An asyncio future of this loop that ends as `source` ends (call on the loop's thread)."""
        target = self.loop.create_future()
        target.add_done_callback(lambda _: _cancel_if_cancelled(target, source))
        source.add_done_callback(lambda _: self._finish(source, target))
        return target

    def notify(self, source: Future, callback: Callable[[Future], None]) -> None:
        """Call `callback(source)` on this loop once `source` has ended, with the others that ended
        before the loop woke. The callback reads the outcome from `source` (result, exception or
        cancellation); an exception it raises is logged."""
        source.add_done_callback(lambda _: self._finish(source, callback))

    def _finish(self, source: Future, target: asyncio.Future | Callable[[Future], None]) -> None:
        """On the thread that finished `source` (a batcher worker, or the loop's own)."""
        with self._lock:
            self._finished.append((source, target))
            first = len(self._finished) == 1
        if first:
            try:
                self.loop.call_soon_threadsafe(self._drain)
            except RuntimeError:  # the loop is closed: nobody awaits the target any more
                with self._lock:
                    self._finished.clear()

    def _drain(self) -> None:
        with self._lock:
            finished, self._finished = self._finished, []
        for source, target in finished:
            if not isinstance(target, asyncio.Future):
                try:
                    target(source)
                except Exception:  # one failing callback must not keep the others from running
                    log.exception("a batcher future's callback failed")
                continue
            if target.done():  # cancelled, or timed out, meanwhile
                continue
            if source.cancelled():
                target.cancel()
                continue
            error = source.exception()
            if error is not None:
                target.set_exception(error)
            else:
                target.set_result(source.result())


def _cancel_if_cancelled(target: asyncio.Future, source: Future) -> None:
    if target.cancelled():
        source.cancel()


def expire(target: asyncio.Future, source: Future) -> None:
    """The timer of a wait with a deadline: the waiter raises asyncio.TimeoutError, and the batcher
    drops the request if it has not started running (what asyncio.wait_for on a wrapped future does)."""
    if not target.done():
        target.set_exception(asyncio.TimeoutError())
        source.cancel()
