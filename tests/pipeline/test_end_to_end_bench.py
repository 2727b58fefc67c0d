"""`sartor bench --end-to-end`: image files to results through the pipeline, on the CPU."""
from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import assert_cli_error
from PIL import Image


@pytest.fixture(scope="module")
def image_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("frames")
    rng = np.random.default_rng(0)
    for i in range(5):  # JPEG and PNG, two sizes, one in a sub-folder
        pixels = rng.integers(0, 256, (40 + 8 * (i % 2), 64, 3), dtype=np.uint8)
        target = folder / ("nested" if i == 4 else "") / f"frame{i}.{'png' if i == 3 else 'jpg'}"
        target.parent.mkdir(exist_ok=True)
        Image.fromarray(pixels).save(target)
    (folder / "notes.txt").write_text("not an image")
    return folder


def test_end_to_end_times_every_stage_and_the_engine(cli, letterbox_plan, image_folder):
    result = cli("bench", letterbox_plan, "--end-to-end", "--images", image_folder, "--batch", "2", "--passes", "3",
                 "--json")
    assert result.code == 0, result
    data = json.loads(result.out)
    assert data["images"] == 5 and data["batch"] == 2 and data["passes"] == 3 and data["decoder"] == "none"
    assert set(data["stages_ms"]) == {"read", "decode", "preprocess", "infer", "post"}
    assert all(v > 0 for v in data["stages_ms"].values())
    assert data["frames_per_s"] > 0 and data["engine_frames_per_s"] > 0 and data["first_pass_s"] > 0
    assert 0 < data["batch_ms_p50"] <= data["batch_ms_p99"]
    assert data["decode_frames_per_s"] > 0 and data["decode_workers"] == 2  # a CPU engine: two workers
    lower = min(data["engine_frames_per_s"], data["decode_frames_per_s"])
    assert data["ceiling_share"] == pytest.approx(data["frames_per_s"] / lower, abs=1e-3)
    assert data["hardware_queues"] is None  # CUDA's queues: a CPU engine has none to report
    table = cli("bench", letterbox_plan, "--end-to-end", "--images", image_folder)
    assert table.code == 0, table
    assert "steady state" in table.out and "One batch through each stage alone" in table.out
    assert "decode alone" in table.out and "of the lower" in table.out and "hardware queues" not in table.out


def test_end_to_end_refusals_are_one_line(cli, letterbox_plan, tiny_plan, image_folder, tmp_path):
    assert_cli_error(cli("bench", letterbox_plan, "--end-to-end"), "--end-to-end and --images DIR go together")
    assert_cli_error(cli("bench", letterbox_plan, "--images", image_folder),
                     "--end-to-end and --images DIR go together")
    (tmp_path / "empty").mkdir()
    assert_cli_error(cli("bench", letterbox_plan, "--end-to-end", "--images", tmp_path / "empty"),
                     "no image files")
    assert_cli_error(cli("bench", letterbox_plan, "--end-to-end", "--images", tmp_path / "missing"), "not a folder")
    assert_cli_error(cli("bench", tiny_plan, "--end-to-end", "--images", image_folder), "records no preprocessing")
    assert_cli_error(cli("bench", letterbox_plan, "--end-to-end", "--images", image_folder, "--passes", "1"),
                     "--passes must be at least 2")
    assert_cli_error(cli("bench", letterbox_plan, "--end-to-end", "--images", image_folder, "--batch", "9"),
                     "batch size 9 is outside 1..4")
    assert_cli_error(cli("bench", letterbox_plan, "--end-to-end", "--images", image_folder, "--host-decode-share",
                         "1.5"), "host_decode_share 1.5 must be between 0 and 1")
    assert_cli_error(cli("bench", letterbox_plan, "--end-to-end", "--images", image_folder, "--host-decode-share",
                         "half"), "--host-decode-share 'half' is neither a share (0 to 1) nor auto")
    assert_cli_error(cli("bench", letterbox_plan, "--host-decode-share", "0.5"),
                     "--host-decode-share goes with --end-to-end --images")
    assert_cli_error(cli("bench", letterbox_plan, "--end-to-end", "--images", image_folder, "--host-decode-threads",
                         "4"), "--host-decode-threads goes with --host-decode-share")
    assert_cli_error(cli("bench", letterbox_plan, "--end-to-end", "--images", image_folder, "--host-decode-share",
                         "0.5", "--host-decode-threads", "0"), "host_decode_threads 0 must be at least 1")
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "broken.jpg").write_bytes(b"\xff\xd8\xff\xe0 not really")
    assert_cli_error(cli("bench", letterbox_plan, "--end-to-end", "--images", tmp_path / "bad"),
                     "image", "broken.jpg", "corrupt")


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class _FillingPipeline:
    """A stream that takes `fill` s before its first result and `each` s a result after it."""

    def __init__(self, clock: _Clock, fill: float, each: float) -> None:
        self.clock, self.fill, self.each, self.streams = clock, fill, each, 0

    def stream(self, items):
        self.streams += 1
        self.clock.now += self.fill
        for item in items:
            self.clock.now += self.each
            yield item


def test_the_steady_state_is_one_stream_timed_from_its_first_batch(monkeypatch):
    from sartor.pipeline import benchmark
    clock = _Clock()
    monkeypatch.setattr(benchmark.time, "perf_counter", clock)
    pipeline = _FillingPipeline(clock, fill=1.0, each=0.001)
    rate, batch_times = benchmark.steady_state(pipeline, list(range(96)), batch=32)
    assert pipeline.streams == 1  # the passes are one stream: the pipeline fills once
    assert rate == pytest.approx(1000.0)  # 64 frames after the first batch in 64 ms; the fill left out
    assert batch_times == pytest.approx([32.0, 32.0])
    rate, batch_times = benchmark.steady_state(_FillingPipeline(clock, 1.0, 0.001), list(range(20)), batch=32)
    assert rate == pytest.approx(20 / 1.02) and batch_times == pytest.approx([1020.0])  # one batch: from the start
