"""bench/h200_table.py's paired timing: a row's engines timed again in turns after its builds."""
from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))

from h200_table import paired_timings  # noqa: E402


def test_engines_are_timed_in_turns_each_way_and_their_rounds_kept():
    calls = []

    def runner(key: str, way: str, seconds: float):
        def run():
            calls.append((key, way))
            time.sleep(seconds)
        return run

    runners = {"sartor_fp16": {"copied": runner("fp16", "copied", 0.004), "bound": runner("fp16", "bound", 0.002)},
               "sartor_int8": {"copied": runner("int8", "copied", 0.002), "bound": runner("int8", "bound", 0.001)}}
    paired = paired_timings(runners, batch=4, iterations=6, rounds=3, device="cpu")
    # Each round times every engine both ways (5 warm-up calls, then 6 timed), the first engine first.
    per_round = [("fp16", "copied")] * 11 + [("fp16", "bound")] * 11 + [("int8", "copied")] * 11 \
        + [("int8", "bound")] * 11
    assert calls == per_round * 3
    fp16, int8 = paired["sartor_fp16"], paired["sartor_int8"]
    assert fp16["rounds"] == 3 and len(fp16["round_medians_ms"]) == 3
    assert len(int8["bound_input"]["round_medians_ms"]) == 3
    assert fp16["median_ms"] > int8["median_ms"] > int8["bound_input"]["median_ms"]
    assert fp16["median_ms"] > fp16["bound_input"]["median_ms"] >= 2.0
    # from the median before its rounding to 0.1 µs: equal to that of the rounded one within 1e-4
    assert int8["img_s"] == pytest.approx(4 / int8["median_ms"] * 1e3, rel=1e-4)


def test_a_plain_copy_is_timed_beside_them_where_the_row_keeps_one():
    """The third way, a plain copy into the engine's buffer and then its graph (decision 0068), comes
    back as the engine's `plain_copy` figures; a runner without it has none."""
    def runner(seconds: float):
        return lambda: time.sleep(seconds)
    runners = {"sartor_fp16": {"copied": runner(0.002), "bound": runner(0.001), "plain": runner(0.003),
                               "reused": runner(0.0015)},
               "sartor_int8": {"copied": runner(0.002), "bound": runner(0.001)}}
    paired = paired_timings(runners, batch=2, iterations=3, rounds=2, device="cpu")
    plain = paired["sartor_fp16"]["plain_copy"]
    assert len(plain["round_medians_ms"]) == 2 and plain["median_ms"] > paired["sartor_fp16"]["median_ms"]
    reused = paired["sartor_fp16"]["reused_buffer"]  # a bound reused tensor (decision 0069)
    assert paired["sartor_fp16"]["median_ms"] > reused["median_ms"] > paired["sartor_fp16"]["bound_input"]["median_ms"]
    assert "plain_copy" not in paired["sartor_int8"] and "reused_buffer" not in paired["sartor_int8"]
