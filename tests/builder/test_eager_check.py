"""The build's eager check (builder/eager_check.py): the engine timed end to end against its layers on
their eager kernels; a profile where those are faster keeps them, with a warning; the header, the log
and `inspect` say both times. Run here on CPU builds (the check's devices widened to the CPU, whose
eager kernels are the reference ones), with the timing made to order where a winner is asserted."""
from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import MAX_SHAPES, MIN_SHAPES, OPT_SHAPES

import sartor
from sartor.builder import eager_check, engine_timing, pipeline
from sartor.ops.attention import SDPA
from sartor.tactics.select import REFERENCE_TACTIC

SHAPES = {"min_shapes": MIN_SHAPES, "opt_shapes": OPT_SHAPES, "max_shapes": MAX_SHAPES}


@pytest.fixture
def on_cpu(monkeypatch):
    monkeypatch.setattr(pipeline, "EAGER_CHECK_DEVICES", ("cuda", "cpu"))


def timed_layers(header: dict) -> dict:
    return {layer["name"]: layer for layer in header["layers"] if layer.get("tactic_timings_ms")}


def test_a_faster_tuned_engine_is_kept_and_both_times_are_recorded(tiny_onnx, tmp_path, on_cpu, monkeypatch, cli):
    calls = []

    def made_to_order(context, feeds, device):  # tuned, eager, tuned, eager: the tuned engine twice as fast
        calls.append(context)
        return 1.0 if len(calls) % 2 else 2.0
    monkeypatch.setattr(engine_timing, "time_context", made_to_order)
    result = sartor.build(tiny_onnx, tmp_path / "m.plan", device="cpu", **SHAPES)
    assert len(calls) == 2 * engine_timing.ROUNDS["cpu"]
    record = result.header["eager_check"]
    assert record == {"margin": eager_check.EAGER_MARGIN,
                      "profiles": [{"profile": 0, "tuned_ms": 1.0, "eager_ms": 2.0, "kept": "tuned"}]}
    assert any(line.startswith("eager check: profile 0 (") and "(2.00x)" in line for line in result.log)
    assert "eager check" in result.stage_seconds
    assert all(layer["tactic_source"] == "timed" for layer in timed_layers(result.header).values())
    shown = cli("inspect", tmp_path / "m.plan")
    assert "profile 0 1 ms against 2 ms eager" in shown.out
    assert json.loads(cli("inspect", tmp_path / "m.plan", "--json").out)["eager_check"]["profiles"] == record["profiles"]


def test_a_profile_where_the_eager_kernels_win_keeps_them_and_warns(tiny_onnx, tmp_path, on_cpu, monkeypatch):
    # The tiny model's convolutions time "torch" and "channels_last"; make the tuned choice channels_last.
    real_time_candidates = pipeline.select_tactics_by_profile

    def channels_last_wins(*args, **kwargs):
        selections = real_time_candidates(*args, **kwargs)
        for selection in selections:
            for layer in selection.layers.values():
                layer["tactic"] = "channels_last"
        return selections
    monkeypatch.setattr(pipeline, "select_tactics_by_profile", channels_last_wins)
    calls = []
    monkeypatch.setattr(engine_timing, "time_context", lambda context, feeds, device: calls.append(1) or
                        (2.0 if len(calls) % 2 else 1.0))  # the eager engine twice as fast
    result = sartor.build(tiny_onnx, tmp_path / "m.plan", device="cpu", **SHAPES)
    assert result.header["eager_check"]["profiles"][0]["kept"] == "eager"
    assert any("warning: eager check: profile 0" in line and "keeps the eager kernels" in line for line in result.warnings)
    layers = timed_layers(result.header)
    assert layers and all(layer["tactic_source"] == "eager check" for layer in layers.values())
    engine = sartor.load(tmp_path / "m.plan")
    assert all(step.attrs.get("tactic") == REFERENCE_TACTIC for step in engine.executor.steps
               if step.node.name in layers)
    images = np.random.default_rng(0).standard_normal(OPT_SHAPES["images"]).astype(np.float32)
    reference = sartor.build(tiny_onnx, tmp_path / "r.plan", device="cpu", builder_effort=0, **SHAPES)
    expected = sartor.load(reference.path).context().run({"images": images})
    got = engine.context().run({"images": images})
    for name in expected:
        np.testing.assert_allclose(got[name], expected[name], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("options", [dict(eager_check=False), dict(builder_effort=0)])
def test_not_run_when_switched_off_or_nothing_was_timed(tiny_onnx, tmp_path, on_cpu, options):
    result = sartor.build(tiny_onnx, tmp_path / "m.plan", device="cpu", **SHAPES, **options)
    assert "eager_check" not in result.header and "eager check" not in result.stage_seconds


def test_not_run_on_cpu_builds_by_default_nor_for_int8(tiny_onnx, tmp_path, on_cpu, monkeypatch):
    calib = np.random.default_rng(0).standard_normal((8, *OPT_SHAPES["images"][1:])).astype(np.float32)
    int8 = sartor.build(tiny_onnx, tmp_path / "q.plan", device="cpu", precision="int8", calib=calib, **SHAPES)
    assert "eager_check" not in int8.header
    monkeypatch.setattr(pipeline, "EAGER_CHECK_DEVICES", ("cuda",))
    assert "eager_check" not in sartor.build(tiny_onnx, tmp_path / "m.plan", device="cpu", **SHAPES).header


def test_the_cli_switch(tiny_onnx, tmp_path, on_cpu, cli):
    from conftest import shape_flag
    shapes = ["--min-shapes", shape_flag(MIN_SHAPES), "--opt-shapes", shape_flag(OPT_SHAPES),
              "--max-shapes", shape_flag(MAX_SHAPES)]
    result = cli("build", tiny_onnx, "-o", tmp_path / "m.plan", "--device", "cpu", *shapes, "--no-eager-check")
    assert result.code == 0
    assert "not run" in cli("inspect", tmp_path / "m.plan").out


def test_attention_is_checked_against_sdpa_where_its_timing_accepted_it():
    assert eager_check.eager_tactic("Attention", {REFERENCE_TACTIC: 1.0, SDPA: 0.5}) == SDPA
    assert eager_check.eager_tactic("Attention", {REFERENCE_TACTIC: 1.0}) == REFERENCE_TACTIC  # sdpa rejected
    assert eager_check.eager_tactic("FusedConv", {REFERENCE_TACTIC: 1.0, "channels_last": 0.5}) == REFERENCE_TACTIC
