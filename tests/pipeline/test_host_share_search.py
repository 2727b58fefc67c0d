"""`host_decode_share="auto"`'s search (sartor/pipeline/host_share.py): every candidate share timed
in turn over its batches, then the fastest kept."""
from __future__ import annotations

import pytest

from sartor.pipeline import host_share
from sartor.pipeline.host_share import BatchTimer, HostShareSearch, candidates_for

CANDIDATES = (0.0, 0.5, 1.0)


def test_each_candidate_runs_its_batches_in_turn_then_the_fastest_is_kept():
    search = HostShareSearch(CANDIDATES, batches_each=2, times_needed=2)
    handed = [search.next_share() for _ in range(6)]
    assert handed == [0.0, 0.0, 0.5, 0.5, 1.0, 1.0]
    for share, seconds in zip(handed, [3e-4, 3e-4, 1e-4, 2e-4, 5e-4, 4e-4]):
        assert search.chosen is None
        search.observe(share, seconds)
    assert search.chosen == 0.5
    assert [search.next_share() for _ in range(3)] == [0.5] * 3
    search.observe(0.0, 1e-6)  # after the choice, nothing changes it
    assert search.chosen == 0.5
    assert search.medians_ms() == {"0": 0.3, "0.5": 0.15, "1": 0.45}


def test_the_median_decides_so_one_slow_batch_does_not():
    search = HostShareSearch((0.0, 1.0), batches_each=3, times_needed=3)
    for share, seconds in [(0.0, 2e-4), (0.0, 9e-3), (0.0, 2e-4), (1.0, 3e-4), (1.0, 3e-4), (1.0, 3e-4)]:
        search.next_share()
        search.observe(share, seconds)
    assert search.chosen == 0.0


def test_while_the_last_times_are_on_their_way_the_best_so_far_is_handed():
    search = HostShareSearch(CANDIDATES, batches_each=1, times_needed=1)
    assert [search.next_share() for _ in range(3)] == list(CANDIDATES)
    search.observe(0.0, 5e-4)
    search.observe(0.5, 2e-4)
    assert search.next_share() == 1.0  # no time back for it yet: it runs again
    search.observe(1.0, 3e-4)
    assert search.chosen == 0.5 and search.next_share() == 0.5


def test_a_candidate_whose_batches_were_not_timed_runs_again_before_the_choice():
    search = HostShareSearch(CANDIDATES, batches_each=2, times_needed=2)
    for _ in range(6):
        search.next_share()
    for share in (0.0, 0.0, 0.5, 1.0, 1.0):  # one of 0.5's batches was a stream's first: not timed
        search.observe(share, 1e-4)
    assert search.chosen is None
    assert search.next_share() == 0.5
    search.observe(0.5, 1e-4)
    assert search.chosen in CANDIDATES


def test_a_stream_times_the_gap_between_two_batches_per_frame_and_not_its_first(monkeypatch):
    clock = iter([10.0, 10.4, 11.0])
    monkeypatch.setattr(host_share.time, "perf_counter", lambda: next(clock))
    search = HostShareSearch(CANDIDATES, batches_each=1, times_needed=1)
    timer = BatchTimer(search)
    timer.batch_finished(0.5, 4)  # the first batch's results: the stream's fill, not timed
    timer.batch_finished(0.5, 4)
    timer.batch_finished(1.0, 2)
    assert search.seconds_per_frame == {0.0: [], 0.5: [pytest.approx(0.1)], 1.0: [pytest.approx(0.3)]}


def test_with_two_batches_decoded_at_once_only_gaps_after_two_alike_batches_are_timed(monkeypatch):
    clock = iter([1.0, 1.1, 1.3, 1.6, 2.0, 2.5, 3.1])
    monkeypatch.setattr(host_share.time, "perf_counter", lambda: next(clock))
    search = HostShareSearch(CANDIDATES, batches_each=3, times_needed=3)
    timer = BatchTimer(search, in_flight=2)
    for share in (0.5, 0.5, 0.5, 1.0, 1.0, 1.0, 0.0):
        timer.batch_finished(share, 1)
    # Not timed: the first two (decoded together), the first 1.0 (decoded beside the last 0.5), the 0.0.
    assert search.seconds_per_frame == {0.0: [], 0.5: [pytest.approx(0.2)],
                                        1.0: [pytest.approx(0.4), pytest.approx(0.5)]}


def test_with_two_decoders_an_interval_spans_their_round_so_results_in_pairs_time_right(monkeypatch):
    # Two decoders, three workers: batches come out in pairs 0.01 s apart, a pair every 0.2 s, so a
    # frame takes 0.1 s. One interval at a time reads 0.19 and 0.01 by turns.
    times = [1.0, 1.01, 1.2, 1.21, 1.4, 1.41, 1.6, 1.61]
    for window, expected in ((2, [0.1] * 5), (1, [0.01, 0.19, 0.01, 0.19, 0.01])):
        clock = iter(times)
        monkeypatch.setattr(host_share.time, "perf_counter", lambda: next(clock))
        search = HostShareSearch(CANDIDATES, batches_each=8, times_needed=8)
        timer = BatchTimer(search, in_flight=3, window=window)
        for _ in times:
            timer.batch_finished(0.5, 1)
        # not timed: the first three (decoded together), and until the window holds one share's batches
        assert search.seconds_per_frame[0.5] == [pytest.approx(t) for t in expected]


def test_a_batch_run_alone_is_timed_from_its_start_so_a_stream_of_one_batch_counts(monkeypatch):
    clock = iter([5.0, 5.2])
    monkeypatch.setattr(host_share.time, "perf_counter", lambda: next(clock))
    search = HostShareSearch(CANDIDATES, batches_each=1, times_needed=1)
    timer = BatchTimer(search)
    timer.start()
    timer.batch_finished(0.0, 2)
    assert search.seconds_per_frame[0.0] == [pytest.approx(0.1)]


def test_without_a_search_the_clock_is_not_read(monkeypatch):
    def no_clock():
        raise AssertionError("a fixed share needs no timing")
    monkeypatch.setattr(host_share.time, "perf_counter", no_clock)
    timer = BatchTimer(None)
    timer.start()
    timer.batch_finished(0.5, 4)


@pytest.mark.parametrize("batch,candidates", [
    (32, (0.0, 0.25, 0.5, 0.75, 1.0)),
    (4, (0.0, 0.25, 0.5, 0.75, 1.0)),
    (2, (0.0, 0.5, 1.0)),  # 0.25 of 2 rounds to none, 0.75 to both
    (1, (0.0, 1.0)),
])
def test_only_shares_that_split_the_batch_differently_are_candidates(batch, candidates):
    assert candidates_for(batch) == candidates
