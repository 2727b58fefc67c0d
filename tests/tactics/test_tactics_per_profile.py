"""Tactics chosen per profile: an engine with a small-batch and a large-batch profile times its
layers at each profile's opt shape, stores each profile's winner, and runs every input with the
winners of the profile it falls in (weights kept once per distinct layout). Timings are forced so
that the two CPU candidates of FusedConv win in different profiles."""
from __future__ import annotations

import json

import numpy as np
import onnxruntime as ort
import pytest
import torch
from conftest import MAX_SHAPES, MIN_SHAPES, OPT_SHAPES

import sartor
from sartor.ops import conv as conv_ops
from sartor.runtime.engine_file import pack, read_engine_file, write_atomic
from sartor.tactics import select

SMALL = {"min": MIN_SHAPES, "opt": OPT_SHAPES, "max": MAX_SHAPES}  # batch 1..4, opt 2
LARGE = {"min": {"images": (5, 3, 16, 16)}, "opt": {"images": (6, 3, 16, 16)}, "max": {"images": (8, 3, 16, 16)}}
# The forced winner at each opt batch: the reference at batch 2, channels_last at batch 6.
FAVOURITE = {2: "torch", 6: "channels_last"}


def _tactic_of(x: torch.Tensor) -> str:
    """Which CPU tactic a convolution's input says ran it: channels_last converts its input first."""
    return "channels_last" if x.is_contiguous(memory_format=torch.channels_last) and not x.is_contiguous() \
        else "torch"


@pytest.fixture
def convs(monkeypatch) -> list:
    """Every convolution run during the test, as (tactic, batch)."""
    seen = []
    real = conv_ops.conv_nd

    def recording(x, w, b, attrs):
        seen.append((_tactic_of(x), int(x.shape[0])))
        return real(x, w, b, attrs)
    monkeypatch.setattr(conv_ops, "conv_nd", recording)
    return seen


@pytest.fixture
def forced_timings(monkeypatch, convs) -> list:
    """select.time_ms replaced: a candidate's time is 1 ms where it is FAVOURITE at its batch, else
    2 ms (it is run once to see which). Returns the (tactic, batch) of every timed candidate."""
    timed = []

    def fake(fn, device, iterations, warmup=3, graph=False):
        convs.clear()
        fn()
        tactic, batch = convs[-1]
        timed.append((tactic, batch))
        return 1.0 if FAVOURITE.get(batch) == tactic else 2.0
    monkeypatch.setattr(select, "time_ms", fake)
    return timed


def reference(model, images: np.ndarray) -> np.ndarray:
    session = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    return session.run(None, {"images": images})[0]


def conv_nodes(header: dict) -> dict:
    return {n["name"]: n["attrs"] for n in header["graph"]["nodes"] if n["op"] == "FusedConv"}


def images(batch: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((batch, 3, 16, 16)).astype(np.float32)


@pytest.fixture
def two_profiles(tiny_onnx, tmp_path, forced_timings):
    plan = tmp_path / "two.plan"
    result = sartor.build(tiny_onnx, plan, device="cpu", profiles=[SMALL, LARGE])
    return plan, result


def test_each_profile_stores_its_own_winner(two_profiles, forced_timings):
    plan, result = two_profiles
    header, _ = read_engine_file(plan)
    for name, attrs in conv_nodes(header).items():
        assert attrs["tactic"] == "torch", name  # profile 0's, as older readers expect
        assert attrs["tactic_by_profile"] == ["torch", "channels_last"], name
    layers = {layer["name"]: layer for layer in header["layers"] if layer["op"] == "FusedConv"}
    for layer in layers.values():
        small, large = layer["tactic_by_profile"]
        assert small["tactic"] == "torch" and small["timings_ms"] == {"torch": 1.0, "channels_last": 2.0}
        assert large["tactic"] == "channels_last" and large["timings_ms"] == {"torch": 2.0, "channels_last": 1.0}
        assert small["source"] == large["source"] == "timed"
        assert layer["tactic_timings_ms"] == small["timings_ms"]  # the top-level record stays profile 0's
    # each profile was timed at its own opt batch
    assert sorted(set(forced_timings)) == [("channels_last", 2), ("channels_last", 6), ("torch", 2), ("torch", 6)]
    assert header["tactics"]["timed"] == 4 and header["tactics"]["by_profile"] == [
        {"timed": 2, "from_timing_cache": 0}, {"timed": 2, "from_timing_cache": 0}]
    assert ("tactics: 4 timed, 0 from timing cache (profile 0: 2 timed, 0 from timing cache; "
            "profile 1: 2 timed, 0 from timing cache)") in result.log


def test_each_profile_runs_its_own_winner_and_matches_onnxruntime(two_profiles, convs, tiny_onnx):
    plan, _ = two_profiles
    engine = sartor.load(plan, device="cpu")
    for context, batch, expected in ((engine.context(), 3, "torch"), (engine.context(), 7, "channels_last"),
                                     (engine.context(profile=0), 2, "torch"),
                                     (engine.context(profile=1), 5, "channels_last")):
        x = images(batch, seed=batch)
        convs.clear()
        out = context.run({"images": x})["logits"]
        assert convs == [(expected, batch)] * 2, (batch, convs)  # both convolutions, with that profile's tactic
        np.testing.assert_allclose(out, reference(tiny_onnx, x), rtol=1e-4, atol=1e-5)


def test_weights_are_kept_per_layout_and_counted(two_profiles):
    plan, _ = two_profiles
    engine = sartor.load(plan, device="cpu")
    steps = {step.node.name: step for step in engine.executor.steps if step.node.op_type == "FusedConv"}
    extra = 0
    for step in steps.values():
        assert set(step.profile_variants) == {1}  # profile 0 runs the step as it is
        variant = step.profile_variants[1]
        assert variant.attrs["tactic"] == "channels_last" and step.attrs["tactic"] == "torch"
        base, other = step.constants[1], variant.constants[1]
        assert base.is_contiguous() and other.is_contiguous(memory_format=torch.channels_last) and base is not other
        assert variant.constants[2] is step.constants[2]  # the bias reads the same in both tactics
        extra += other.numel() * other.element_size()
    assert engine.profile_weight_bytes == extra > 0
    arenas = [p["arena_bytes"] for p in engine.header["memory"]["profiles"]]
    rows = engine.memory_by_profile
    assert [r["arena_bytes"] for r in rows] == arenas and all(r["input_bytes"] > 0 for r in rows)
    assert engine.device_memory_bytes == engine.weight_bytes + extra + max(a + r["input_bytes"] for a, r in zip(arenas, rows))


def test_equal_layouts_are_stored_once(two_profiles):
    """Two tactics that read one weight layout (channels_last, and the implicit GEMM's packed weight,
    which is channels-last memory too) share one tensor and cost no second copy."""
    plan, _ = two_profiles
    header, tensors = read_engine_file(plan)
    for attrs in conv_nodes(header).values():
        attrs["tactic"] = "channels_last"
        attrs["tactic_by_profile"] = ["channels_last", "igemm.64x64x32.w4.s4"]
    same = plan.parent / "same.plan"
    write_atomic(same, pack(header, tensors))
    engine = sartor.load(same, device="cpu")
    for step in engine.executor.steps:
        if step.node.op_type == "FusedConv":
            variant = step.profile_variants[1]
            assert variant.attrs["tactic"] == "igemm.64x64x32.w4.s4"
            assert variant.constants[1] is step.constants[1]
            assert step.constants[1].is_contiguous(memory_format=torch.channels_last)
    assert engine.profile_weight_bytes == 0


def test_old_engine_without_per_profile_tactics_runs_profile_zeros_everywhere(two_profiles, convs, tiny_onnx):
    plan, _ = two_profiles
    header, tensors = read_engine_file(plan)
    for attrs in conv_nodes(header).values():
        del attrs["tactic_by_profile"]
    for layer in header["layers"]:
        layer.pop("tactic_by_profile", None)
    old = plan.parent / "old.plan"
    write_atomic(old, pack(header, tensors))
    engine = sartor.load(old, device="cpu")
    assert engine.profile_weight_bytes == 0
    assert all(not step.profile_variants for step in engine.executor.steps)
    for batch in (3, 7):
        x = images(batch, seed=batch)
        convs.clear()
        out = engine.context().run({"images": x})["logits"]
        assert convs == [("torch", batch)] * 2
        np.testing.assert_allclose(out, reference(tiny_onnx, x), rtol=1e-4, atol=1e-5)


def test_single_profile_engine_is_unchanged(tiny_onnx, tmp_path, forced_timings):
    result = sartor.build(tiny_onnx, tmp_path / "one.plan", device="cpu", profiles=[SMALL])
    header, _ = read_engine_file(tmp_path / "one.plan")
    assert {name: attrs.get("tactic") for name, attrs in conv_nodes(header).items()} == {"conv1": "torch",
                                                                                           "conv2": "torch"}
    assert all("tactic_by_profile" not in attrs for attrs in conv_nodes(header).values())
    assert all("tactic_by_profile" not in layer for layer in header["layers"])
    assert header["tactics"] == {"builder_effort": 2, "timed": 2, "from_timing_cache": 0, "timing_cache": None}
    assert "tactics: 2 timed, 0 from timing cache" in result.log
    engine = sartor.load(tmp_path / "one.plan", device="cpu")
    assert all(not step.profile_variants for step in engine.executor.steps) and engine.profile_weight_bytes == 0


def test_second_profile_with_the_same_signature_uses_the_timing_cache(tiny_onnx, tmp_path, forced_timings):
    """Profiles whose opt shapes agree time each layer once, with or without a timing cache file."""
    same_opt = {"min": {"images": (2, 3, 16, 16)}, "opt": OPT_SHAPES, "max": {"images": (8, 3, 16, 16)}}
    result = sartor.build(tiny_onnx, tmp_path / "a.plan", device="cpu", profiles=[SMALL, same_opt])
    assert len(forced_timings) == 4  # 2 layers x 2 candidates, once
    assert "profile 1: 0 timed, 2 from timing cache" in " ".join(result.log)
    header, _ = read_engine_file(tmp_path / "a.plan")
    for name, attrs in conv_nodes(header).items():
        assert attrs["tactic_by_profile"] == ["torch", "torch"], name
    layer = next(layer for layer in header["layers"] if layer["name"] == "conv1")
    assert [entry["source"] for entry in layer["tactic_by_profile"]] == ["timed", "timing cache"]
    assert sartor.load(tmp_path / "a.plan", device="cpu").profile_weight_bytes == 0

    # with a file: the second profile's own opt shape is timed and recorded there, the first's reused
    cache = tmp_path / "timing.json"
    sartor.build(tiny_onnx, tmp_path / "b.plan", device="cpu", profiles=[SMALL], timing_cache=cache)
    forced_timings.clear()
    result = sartor.build(tiny_onnx, tmp_path / "c.plan", device="cpu", profiles=[SMALL, LARGE], timing_cache=cache)
    assert sorted(set(forced_timings)) == [("channels_last", 6), ("torch", 6)] and len(forced_timings) == 4
    assert ("tactics: 2 timed, 2 from timing cache (profile 0: 0 timed, 2 from timing cache; "
            "profile 1: 2 timed, 0 from timing cache)") in result.log
    assert len(json.loads(cache.read_text())["devices"].popitem()[1]["entries"]) == 4


def test_inspect_shows_per_profile_winners_only_where_they_differ(two_profiles, tmp_path, cli, tiny_onnx):
    plan, _ = two_profiles
    shown = cli("inspect", plan)
    assert shown.code == 0, shown
    assert "Tactics per profile" in shown.out
    for name in ("conv1", "conv2"):
        assert f"{name}: profile 0: torch, profile 1: channels_last" in shown.out
    info = json.loads(cli("inspect", plan, "--json").out)
    conv1 = next(layer for layer in info["layers"] if layer["name"] == "conv1")
    assert [entry["tactic"] for entry in conv1["tactic_by_profile"]] == ["torch", "channels_last"]

    sartor.build(tiny_onnx, tmp_path / "one.plan", device="cpu", profiles=[SMALL])
    shown = cli("inspect", tmp_path / "one.plan")
    assert shown.code == 0 and "Tactics per profile" not in shown.out and "profile 1:" not in shown.out
