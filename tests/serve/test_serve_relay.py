"""The main process's per-request shortcuts in `sartor serve`: batcher futures relayed to the event
loop at one wake-up per burst (relay.py), a model version's cache of input signatures that passed its
checks, and metrics written per batch under precomputed keys. No server, no sockets."""
from __future__ import annotations

import asyncio
import threading
from concurrent.futures import Future

import numpy as np
import pytest

from sartor.serve.errors import InvalidRequest
from sartor.serve.metrics import Metrics
from sartor.serve.relay import LoopRelay, expire


# ---- the relay ------------------------------------------------------------------------------------------

def test_a_burst_of_finished_futures_wakes_the_loop_once():
    async def main():
        loop = asyncio.get_running_loop()
        relay = LoopRelay(loop)
        wakeups = []
        original = loop.call_soon_threadsafe
        loop.call_soon_threadsafe = lambda *a, **k: (wakeups.append(a), original(*a, **k))[1]
        sources = [Future() for _ in range(5)]
        targets = [relay.wait(s) for s in sources]

        def finish_batch():
            for i, source in enumerate(sources):
                source.set_running_or_notify_cancel()
                source.set_result(i)

        worker = threading.Thread(target=finish_batch)
        worker.start()
        worker.join()  # the whole batch finished before the loop ran again
        results = await asyncio.gather(*targets)
        return results, len(wakeups)

    results, wakeups = asyncio.run(main())
    assert results == [0, 1, 2, 3, 4]
    assert wakeups == 1


def test_notify_runs_each_callback_in_the_one_drain_and_survives_a_failing_one(caplog):
    """Grouped requests take a callback rather than an asyncio future: a batch's callbacks all run
    at the one wake-up, each with its own future, in order; one that raises is logged and the
    others still run."""
    async def main():
        loop = asyncio.get_running_loop()
        relay = LoopRelay(loop)
        wakeups, seen, drained = [], [], asyncio.Event()
        original = loop.call_soon_threadsafe
        loop.call_soon_threadsafe = lambda *a, **k: (wakeups.append(a), original(*a, **k))[1]
        sources = [Future() for _ in range(4)]

        def record(source):
            seen.append(source.result() if not source.cancelled() else "cancelled")
            if len(seen) == 4:
                drained.set()

        def broken(source):
            seen.append("broken")
            raise RuntimeError("a frontend's answer failed")
        for i, source in enumerate(sources):
            relay.notify(source, broken if i == 1 else record)

        def finish_batch():
            for i, source in enumerate(sources):
                if i == 3:
                    source.cancel()
                    continue
                source.set_running_or_notify_cancel()
                source.set_result(i)
        worker = threading.Thread(target=finish_batch)
        worker.start()
        worker.join()
        await asyncio.wait_for(drained.wait(), 5)
        return seen, len(wakeups)

    seen, wakeups = asyncio.run(main())
    assert seen == [0, "broken", 2, "cancelled"] and wakeups == 1
    assert "a batcher future's callback failed" in caplog.text


def test_exceptions_and_cancellation_pass_through():
    async def main():
        relay = LoopRelay(asyncio.get_running_loop())
        failing, cancelled_upstream, abandoned = Future(), Future(), Future()
        t_failing, t_upstream, t_abandoned = relay.wait(failing), relay.wait(cancelled_upstream), relay.wait(abandoned)
        failing.set_running_or_notify_cancel()
        failing.set_exception(InvalidRequest("bad"))
        cancelled_upstream.cancel()
        t_abandoned.cancel()  # the caller went away: the batcher must drop the request
        with pytest.raises(InvalidRequest, match="bad"):
            await t_failing
        with pytest.raises(asyncio.CancelledError):
            await t_upstream
        await asyncio.sleep(0)
        return abandoned.cancelled()

    assert asyncio.run(main())


def test_a_deadline_raises_timeout_and_drops_the_queued_request():
    async def main():
        loop = asyncio.get_running_loop()
        relay = LoopRelay(loop)
        source = Future()
        target = relay.wait(source)
        loop.call_later(0.01, expire, target, source)
        with pytest.raises(asyncio.TimeoutError):
            await target
        return source.cancelled()

    assert asyncio.run(main())


def test_a_deadline_does_not_fire_on_a_finished_request():
    async def main():
        loop = asyncio.get_running_loop()
        relay = LoopRelay(loop)
        source = Future()
        target = relay.wait(source)
        source.set_running_or_notify_cancel()
        source.set_result("done")
        value = await target
        expire(target, source)  # a timer that fires late changes nothing
        return value, target.result()

    assert asyncio.run(main()) == ("done", "done")


# ---- the input-signature cache --------------------------------------------------------------------------

class CountingChecker:
    """An ExecutionContext's two checks over one input x of shape [batch, 4], counting its calls."""

    def __init__(self) -> None:
        self.calls = 0

    def check_inputs(self, feeds):
        from sartor.errors import InputError
        self.calls += 1
        if set(feeds) != {"x"}:
            raise InputError("inputs must be exactly x")
        if not isinstance(feeds["x"], np.ndarray):
            raise InputError("x must be a numpy array")
        if str(feeds["x"].dtype) != "float32":
            raise InputError("x must be float32")
        return {"x": tuple(feeds["x"].shape)}

    def select_profile(self, shapes):
        return 0


@pytest.fixture
def served():
    from types import SimpleNamespace

    from sartor.serve.repository import ServedModel
    checker = CountingChecker()
    model = ServedModel("m", "1", None, None, SimpleNamespace(max_batch_size=8), {}, None, (), checker=checker)
    return model, checker


def test_a_request_shaped_like_an_earlier_one_skips_the_checks(served):
    model, checker = served
    assert model.check_inputs({"x": np.zeros((2, 4), np.float32)}) == 2
    assert model.check_inputs({"x": np.ones((2, 4), np.float32)}) == 2
    assert checker.calls == 1
    assert model.check_inputs({"x": np.zeros((3, 4), np.float32)}) == 3  # another shape: checked
    assert checker.calls == 2


def test_failed_checks_are_not_remembered(served):
    model, checker = served
    for _ in range(2):
        with pytest.raises(InvalidRequest, match="float32"):
            model.check_inputs({"x": np.zeros((2, 4), np.float64)})
        with pytest.raises(InvalidRequest, match="batch size 9 is outside"):
            model.check_inputs({"x": np.zeros((9, 4), np.float32)})
    assert checker.calls == 4
    with pytest.raises(InvalidRequest):
        model.check_inputs({"x": [[0.0] * 4]})  # not an array: no signature, full checks
    assert checker.calls == 5


# ---- metrics ---------------------------------------------------------------------------------------------

def test_precomputed_keys_and_batched_updates_match_the_per_call_ones():
    labels = {"model": "m", "version": "1"}
    one, batched = Metrics(), Metrics()
    for value in (0.05, 0.3, 7.0):
        one.inc("nv_inference_queue_duration_us", labels, value)
        one.inc("nv_inference_count", labels)
        one.observe("nv_inference_queue_histogram_ms", labels, value)
    key = batched.key(labels)
    batched.inc_many(key, {"nv_inference_queue_duration_us": 0.05 + 0.3 + 7.0, "nv_inference_count": 3})
    batched.observe_many("nv_inference_queue_histogram_ms", key, (0.05, 0.3, 7.0))
    assert batched.render() == one.render()
    assert batched.get("nv_inference_count", labels) == 3
