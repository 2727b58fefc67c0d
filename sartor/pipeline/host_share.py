"""`host_decode_share="auto"`: the share of each batch's JPEGs decoded on the host, chosen by timing
the pipeline itself over its first batches (docs/decisions/0058-host-decode-share-chosen-at-start.md).

Which share pays depends on the machine: the host's cores against the GPU's decoders, and how much
of the GPU the engine leaves them. So the pipeline runs each candidate share for a few batches, in
order, and keeps the one whose batches came out fastest (the median time per frame between two
batches' results), as the builder keeps the fastest kernel. The time between batch n's results and
batch n+1's is charged to the share batch n+2 was decoded with: with the next batch launched before
the last one's results are read, that interval is the wait for batch n+2's decode (when decode is
what limits the stream), and otherwise the engine's time, which no share changes. With k batches
prepared at once (the pipeline's workers), an interval counts only when the batches then decoding
had the same share, as each candidate's batches come in a row; with two decoders an interval spans
two batches, as the two decode side by side and their results come out close together. Without overlap
(`Pipeline(overlap=False)`: each batch decoded, run and finished before the next) a batch is timed
alone, from its decode to its results, so a stream of one batch is timed too."""
from __future__ import annotations

import statistics
import threading
import time
from collections import deque

CANDIDATES = (0.0, 0.25, 0.5, 0.75, 1.0)
# Handed to each candidate in turn: its intervals count once the batches in flight (three on CUDA)
# and the two decoders' last round are its batches alone (BatchTimer), two of them in five batches.
BATCHES_EACH = 5
TIMES_NEEDED = 2  # a candidate's batches timed before the choice: one may be lost to a stream's start


def candidates_for(batch: int, shares: tuple[float, ...] = CANDIDATES) -> tuple[float, ...]:
    """The candidate shares that split a batch of `batch` JPEGs differently, each as the share it
    really sends to the host (at batch 1, 0.25 and 0.5 send none: only 0 and 1 remain)."""
    return tuple(sorted({round(share * batch) / batch for share in shares}))


class HostShareSearch:
    """Hands out the share each batch is decoded with and takes back each batch's time per frame;
    `chosen` is set once every candidate has been timed, and every batch after gets it. Thread-safe:
    batches are decoded on a worker thread and timed on the caller's."""

    def __init__(self, candidates: tuple[float, ...] = CANDIDATES, batches_each: int = BATCHES_EACH,
                 times_needed: int = TIMES_NEEDED) -> None:
        self.candidates, self.batches_each, self.times_needed = candidates, batches_each, times_needed
        self._handed = {c: 0 for c in candidates}
        self.seconds_per_frame: dict[float, list[float]] = {c: [] for c in candidates}
        self.chosen: float | None = None
        self._lock = threading.Lock()

    def next_share(self) -> float:
        with self._lock:
            if self.chosen is not None:
                return self.chosen
            for share in self.candidates:
                if self._handed[share] < self.batches_each:
                    self._handed[share] += 1
                    return share
            # Every candidate handed out; one whose times were lost (a stream's first batches are
            # not timed) runs again, else the best so far while the last times come back.
            short = [c for c in self.candidates if len(self.seconds_per_frame[c]) < self.times_needed]
            return short[0] if short else self._best()

    def observe(self, share: float, seconds_per_frame: float) -> None:
        with self._lock:
            if self.chosen is not None or share not in self.seconds_per_frame:
                return
            self.seconds_per_frame[share].append(seconds_per_frame)
            if all(len(times) >= self.times_needed for times in self.seconds_per_frame.values()):
                self.chosen = self._best()

    def medians_ms(self) -> dict[str, float]:
        """Each candidate's median time per frame so far, in ms (what the choice was made on)."""
        with self._lock:
            return {f"{c:g}": round(statistics.median(t) * 1e3, 4) for c, t in self.seconds_per_frame.items() if t}

    def _best(self) -> float:
        timed = {c: statistics.median(t) for c, t in self.seconds_per_frame.items() if t}
        return min(timed, key=timed.get) if timed else self.candidates[0]


class BatchTimer:
    """One stream's clock: the time between batches' results (or from `start`), per frame, charged
    to a share. With `in_flight` batches prepared at once (the pipeline's workers), an interval is
    charged only when the batches then in flight had the same share (a fast share's decode
    overlapping a slow one's would otherwise be charged the slow one's wait, or the slow one the
    little left of a wait it shared), and not before `in_flight` batches have finished (the first
    ones were decoded together). With `window` decoders, batches they decoded side by side come out
    close together, one interval long and the next short: an interval then spans the last `window`
    batches, one decoder round."""

    def __init__(self, search: HostShareSearch | None, in_flight: int = 1, window: int = 1) -> None:
        self.search, self._in_flight, self._finished, self._alone = search, in_flight, 0, False
        self._recent: deque[float] = deque(maxlen=in_flight + window - 1)  # shares of the last batches
        self._marks: deque[tuple[float, int]] = deque(maxlen=window + 1)  # (time, frames) of the last results

    def start(self) -> None:
        """A batch run alone begins (its decode): `batch_finished` times it from here."""
        if self.search is not None:
            self._marks.append((time.perf_counter(), 0))
            self._alone = True

    def batch_finished(self, share: float, frames: int) -> None:
        if self.search is None:
            return
        now = time.perf_counter()
        self._recent.append(share)
        self._finished += 1
        self._marks.append((now, frames))
        alike = len(self._recent) == self._recent.maxlen and len(set(self._recent)) == 1
        settled = self._alone or self._finished > self._in_flight  # past the batches decoded together
        spanned = sum(n for _, n in list(self._marks)[1:])
        if len(self._marks) == self._marks.maxlen and spanned and alike and settled:
            self.search.observe(share, (now - self._marks[0][0]) / spanned)
