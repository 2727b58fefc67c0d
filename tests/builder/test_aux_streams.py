"""builder/aux_streams.py: the build times the engine with 0 to --max-aux-streams auxiliary streams
and its contexts take the fastest count by default. On the CPU (contexts there run one stream) the
stage's choice is checked with a stand-in clock; the Hopper runs are bench/h200_session38.sh g's."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

import sartor
from sartor.builder import aux_streams, engine_timing
from sartor.errors import SartorError
from sartor.runtime.engine import rebuild_command
from sartor.runtime.engine_file import read_engine_file

DETECTOR = Path(__file__).resolve().parents[2] / "samples" / "detector" / "sample_detector.onnx"
SHAPE = {"images": (1, 3, 320, 320)}


@pytest.fixture(scope="module")
def detector_plan(tmp_path_factory) -> Path:
    plan = tmp_path_factory.mktemp("aux") / "detector.plan"
    sartor.build(str(DETECTOR), str(plan), device="cpu", builder_effort=0, min_shapes=SHAPE, opt_shapes=SHAPE,
                 max_shapes=SHAPE)
    return plan


def test_only_counts_that_put_more_layers_side_by_side_are_timed(detector_plan, tiny_engine):
    detector = sartor.load(detector_plan, device="cpu")
    counts = aux_streams.useful_counts(detector.executor, 8)
    assert counts[:3] == [0, 1, 2] and len(counts) < 9  # the head's branches, not eight streams' worth
    assert aux_streams.useful_counts(tiny_engine.executor, 8) == [0]  # a chain: nothing beside anything


def test_a_count_is_chosen_over_one_stream_only_by_a_margin():
    assert aux_streams.fastest_count({0: 1.0, 1: 0.97, 2: 0.95}) == 2
    assert aux_streams.fastest_count({0: 1.0, 1: 0.95, 2: 0.97}) == 1
    assert aux_streams.fastest_count({0: 1.0, 1: 0.995, 2: 0.999}) == 0  # within the margin: one stream
    assert aux_streams.fastest_count({0: 1.0, 2: 0.9}) == 2


@pytest.mark.parametrize("clock,differs,chosen", [
    ({0: 1.0, 1: 0.98, 2: 0.95}, (), 2),
    ({0: 1.0, 1: 0.998, 2: 0.999}, (), 0),
    ({0: 1.0, 1: 0.98, 2: 0.95}, (2,), 1),  # count 2's outputs differ: never used, whatever its time
])
def test_the_stage_times_each_count_checks_its_outputs_and_records_the_fastest(detector_plan, monkeypatch, clock,
                                                                                differs, chosen):
    runs = []

    def stand_in(context, feeds, device):
        runs.append(context.aux_streams)
        return clock[context.aux_streams]
    monkeypatch.setattr(engine_timing, "time_context", stand_in)
    real_same = aux_streams._same_outputs
    counts = [0, 1, 2]
    checked = iter(counts[1:])  # the stage checks counts 1 and 2 against one stream, in order (one profile)

    def same(got, expected):
        return real_same(got, expected) and next(checked) not in differs
    monkeypatch.setattr(aux_streams, "_same_outputs", same)
    log, warnings = [], []
    feeds = {"images": torch.rand(SHAPE["images"], generator=torch.Generator().manual_seed(0))}
    record = aux_streams.choose_aux_streams(lambda: read_engine_file(detector_plan), torch.device("cpu"),
                                            lambda k: feeds, log, 2, warnings.append)
    assert record["counts"] == counts and record["streams"] == chosen
    assert sorted(runs) == sorted([c for c in counts if c not in differs] * engine_timing.ROUNDS["cpu"])
    assert set(record["profiles"][0]["ms"]) == {str(c) for c in counts if c not in differs}
    assert list(record["rejected"]) == [str(c) for c in differs] and len(warnings) == len(differs)
    assert log[0].startswith(f"aux streams: {chosen} ")


def test_contexts_take_the_count_the_build_chose(tiny_engine, monkeypatch):
    assert tiny_engine.aux_streams == 0 and tiny_engine.context().aux_streams == 0  # no record: one stream
    monkeypatch.setitem(tiny_engine.header, "aux_streams", {"streams": 2})
    assert tiny_engine.aux_streams == 2 and tiny_engine.context().aux_streams == 2
    assert tiny_engine.context(aux_streams=0).aux_streams == 0  # asked for: as asked


def test_the_flag_is_checked_and_the_rebuild_command_repeats_it():
    from sartor.cli.build import config_from_args
    from sartor.cli.main import make_parser

    def config(*flags):
        return config_from_args(make_parser().parse_args(["build", "m.onnx", "-o", "m.plan", *flags]))
    assert config().max_aux_streams == 2 and config("--max-aux-streams", "0").max_aux_streams == 0
    with pytest.raises(SartorError, match="--max-aux-streams 9: a whole number from 0 to 8"):
        config("--max-aux-streams", "9").validate()
    assert "--max-aux-streams" not in rebuild_command({"build_config": config().to_json()})
    assert "--max-aux-streams 0" in rebuild_command({"build_config": config("--max-aux-streams", "0").to_json()})


def test_inspect_shows_the_count_and_the_times():
    from sartor.cli.inspect import _aux_streams_summary
    record = {"streams": 2, "profiles": [{"profile": 0, "ms": {"0": 0.3, "2": 0.27}}],
              "totals_ms": {"0": 0.3, "2": 0.27}, "rejected": {"1": "why"}}
    assert _aux_streams_summary({"aux_streams": record})["text"] == (
        "2 (timed by count, summed over the profiles: 0: 0.3 ms, 2: 0.27 ms; 1 not used: why)")
    assert _aux_streams_summary({})["text"].startswith("0 (not timed")


def test_the_accuracy_planners_trials_time_neither_streams_nor_pdl(tmp_path):
    """A trial build is judged on accuracy: its streams and launches are not timed (each would cost
    a capture and hundreds of replays per trial)."""
    from sartor.builder.accuracy_planner import _trial_config
    from sartor.builder.config import BuildConfig
    config = BuildConfig(model_path="m.onnx", output_path=str(tmp_path / "m.plan"), precision="fp16",
                         min_snr=30.0, calib="c.npy")
    trial = _trial_config(config, tmp_path, {}, None, "0" * 64)
    assert (trial.max_aux_streams, trial.pdl) == (0, False) and config.max_aux_streams == 2
    trial.validate()
