"""`sartor bench --end-to-end --video FILE [--streams N]`: concurrent video streams through the
pipeline on a CPU engine, from the command line (exit codes, JSON fields, refusals)."""
from __future__ import annotations

import json
import re

import pytest
from conftest import assert_cli_error
from video_helpers import clip_frames, truncated_copy, write_clip

FRAMES = 12


@pytest.fixture(scope="module")
def clips(tmp_path_factory):
    folder = tmp_path_factory.mktemp("bench_clips")
    return (write_clip(folder / "a.mp4", clip_frames(FRAMES)),
            write_clip(folder / "b.mp4", clip_frames(FRAMES + 4), codec="libx265", faststart=True))


def test_streams_of_one_clip_are_batched_together_and_timed(cli, letterbox_plan, clips):
    result = cli("bench", letterbox_plan, "--end-to-end", "--video", clips[0], "--streams", "2", "--batch", "3",
                 "--json")
    assert result.code == 0, result
    data = json.loads(result.out)
    assert data["streams"] == 2 and data["videos"] == [str(clips[0])] and data["frames"] == 2 * FRAMES
    assert data["video_decoder"] == "pyav" and data["batch"] == 3 and data["passes"] == 3
    assert data["decoder"] == "none" and data["device"] == "cpu"
    assert set(data["stages_ms"]) == {"decode", "preprocess", "infer", "post"}
    assert all(v > 0 for v in data["stages_ms"].values())
    assert data["frames_per_s"] > 0 and data["engine_frames_per_s"] > 0 and data["first_pass_s"] > 0
    assert 0 < data["latency_ms_p50"] <= data["latency_ms_p99"]


def test_one_stream_per_file_and_a_table(cli, letterbox_plan, clips):
    result = cli("bench", letterbox_plan, "--end-to-end", "--video", clips[0], "--video", clips[1], "--json")
    assert result.code == 0, result
    data = json.loads(result.out)
    assert data["streams"] == 2 and data["frames"] == 2 * FRAMES + 4
    assert data["videos"] == sorted(str(c) for c in clips)
    table = cli("bench", letterbox_plan, "--end-to-end", "--video", clips[0], "--passes", "2")
    assert table.code == 0, table
    assert "steady state" in table.out and "decoded by pyav" in table.out and "latency" in table.out


def test_video_bench_refusals_are_one_line(cli, letterbox_plan, tiny_plan, clips, tmp_path):
    plan, clip = letterbox_plan, clips[0]
    together = "--end-to-end and --video FILE go together"
    assert_cli_error(cli("bench", plan, "--video", clip), together)
    assert_cli_error(cli("bench", plan, "--end-to-end", "--images", tmp_path, "--streams", "2"), together)
    assert_cli_error(cli("bench", plan, "--end-to-end", "--video", clip, "--images", tmp_path),
                     "--images and --video: time one or the other")
    assert_cli_error(cli("bench", plan, "--end-to-end", "--video", clip, "--streams", "0"),
                     "--streams must be at least 1, not 0")
    assert_cli_error(cli("bench", plan, "--end-to-end", "--video", clip, "--video", clips[1], "--streams", "3"),
                     "--streams 3 with 2 --video files")
    assert_cli_error(cli("bench", plan, "--end-to-end", "--video", tmp_path / "missing.mp4"), "no such file")
    assert_cli_error(cli("bench", plan, "--end-to-end", "--video", tmp_path), "a folder, not a video file")
    assert_cli_error(cli("bench", plan, "--end-to-end", "--video", clip, "--passes", "1"),
                     "--passes must be at least 2")
    assert_cli_error(cli("bench", plan, "--end-to-end", "--video", clip, "--video-decoder", "nvdec"),
                     "video decoder 'nvdec' decodes into GPU memory")
    assert_cli_error(cli("bench", tiny_plan, "--end-to-end", "--video", clip), "records no preprocessing")


def test_a_truncated_clip_fails_naming_the_file_and_frame(cli, letterbox_plan, clips, tmp_path):
    whole = write_clip(tmp_path / "whole.mp4", clip_frames(FRAMES + 4), faststart=True)  # opens when cut
    cut = truncated_copy(whole, tmp_path / "cut.mp4", 0.7)
    message = assert_cli_error(cli("bench", letterbox_plan, "--end-to-end", "--video", cut, "--streams", "2"),
                               f"{cut} is truncated at frame")
    # Both streams play the cut file: whichever reaches its end first in a batch is named.
    assert re.search(rf"video stream [01]: {re.escape(str(cut))} is truncated", message), message
    assert f"its index lists {FRAMES + 4} frames" in message
