"""sartor/progress.py in log mode (a stream that is not a terminal): stage lines, throttled
progress lines with done/total, elapsed and an estimate, and nothing when disabled."""
from __future__ import annotations

import io

from sartor.progress import ProgressReport, advance_of, fmt_seconds, log_interval


def test_every_update_is_a_line_when_the_interval_is_zero():
    stream = io.StringIO()
    with ProgressReport("build", stream=stream, interval=0) as report:
        report("tactics")
        for done in range(4):
            report.advance(done, 4, f"layer {done + 1} of 4: a/very/long/{'x' * 300}/name")
        report.print("  done tactics    1.000 s")
    lines = stream.getvalue().splitlines()
    assert lines[0] == "build: tactics started"
    assert lines[1].startswith("progress: build tactics 0/4, elapsed ")
    assert lines[2].startswith("progress: build tactics 1/4, elapsed ") and "left: layer 2 of 4: " in lines[2]
    assert lines[4].endswith(f"layer 4 of 4: a/very/long/{'x' * 300}/name")  # names are never cut
    assert lines[-1] == "  done tactics    1.000 s"
    assert "\x1b" not in stream.getvalue()  # no terminal control codes in a log


def test_lines_are_throttled_but_the_last_step_is_reported():
    stream = io.StringIO()
    report = ProgressReport("validate", stream=stream, interval=1e9)
    report("images")
    for done in range(1, 101):
        report.advance(done, 100)
    lines = stream.getvalue().splitlines()
    assert lines == [lines[0], lines[1]] and lines[0] == "validate: images started"
    assert lines[1].startswith("progress: validate images 100/100, elapsed ") and "left" not in lines[1]


def test_a_disabled_report_prints_nothing():
    stream = io.StringIO()
    report = ProgressReport("build", stream=stream, enabled=False, interval=0)
    report("import")
    report.advance(1, 2, "x")
    report.print("warning")
    assert stream.getvalue() == ""


def test_interval_from_the_environment(monkeypatch):
    monkeypatch.setenv("SARTOR_PROGRESS_INTERVAL", "0.5")
    assert log_interval() == 0.5
    monkeypatch.setenv("SARTOR_PROGRESS_INTERVAL", "soon")
    assert log_interval() == 5.0  # not a number: the default, not a failure in the middle of a build
    monkeypatch.delenv("SARTOR_PROGRESS_INTERVAL")
    assert log_interval() == 5.0


def test_advance_of_a_plain_callback_does_nothing():
    calls = []
    advance_of(calls.append)(1, 2, "x")
    assert calls == []
    report = ProgressReport("build", stream=io.StringIO(), interval=0)
    assert advance_of(report) == report.advance


def test_fmt_seconds():
    assert [fmt_seconds(s) for s in (3.2, 75, 3725)] == ["3s", "1m15s", "1h02m"]
