"""The command line end to end on the tiny classifier, profiles, precision overrides, the compare
and benchmark helpers, and engine round trips."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
import torch
from conftest import (CLASSES, MAX_SHAPES, MIN_SHAPES, OPT_SHAPES, assert_cli_error, classifier_model, save,
                      shape_flag, two_input_model)

import sartor
from sartor.cli.build import profiles_from_events
from sartor.errors import ConfigError, ProfileError
from sartor.runtime.benchmark import benchmark
from sartor.runtime.engine_file import pack, unpack
from sartor.validate.compare import compare_output, compare_with_onnxruntime

SHAPE_ARGS = ["--min-shapes", shape_flag(MIN_SHAPES), "--opt-shapes", shape_flag(OPT_SHAPES),
              "--max-shapes", shape_flag(MAX_SHAPES)]


def reference(model: Path, feeds: dict) -> dict:
    session = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    return dict(zip([o.name for o in session.get_outputs()], session.run(None, feeds)))


# ---- build → run → inspect → compare → bench ---------------------------------------------------

def test_cli_end_to_end(tiny_onnx, tmp_path, cli, images):
    plan = tmp_path / "tiny.plan"
    result = cli("build", tiny_onnx, "-o", plan, "--device", "cpu", *SHAPE_ARGS)
    assert result.code == 0, result
    for fragment in ("Build summary", "ONNX nodes", "5 after fusion", "precision mix", "fp32 5",
                     "profile 0", "images 1x3x16x16..4x3x16x16 (opt 2x3x16x16)", "build seconds", "Stage seconds",
                     "import", "optimize", "serialize", "Build log", "pass fuse_conv_activation: 1 rewrite(s)"):
        assert fragment in result.out, fragment
    assert "\nONNX nodes        7\n" in result.out  # piped: a plain table, trailing padding trimmed
    assert not set("│┃━─╭╰✓…") & set(result.out + result.err)
    for stage in ("import", "profiles", "optimize", "precision", "memory", "serialize"):
        assert f"  done {stage}" in result.err  # one progress line per stage
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny.plan"]

    # run: from a file, saving the outputs atomically
    np.save(tmp_path / "images.npy", images)
    result = cli("run", plan, "--input", f"images={tmp_path / 'images.npy'}", "--output", tmp_path / "out.npz")
    assert result.code == 0, result
    assert "logits" in result.out and f"2x{CLASSES}" in result.out and "float32" in result.out
    saved = np.load(tmp_path / "out.npz")
    assert saved.files == ["logits"]
    np.testing.assert_array_equal(saved["logits"], sartor.load(plan).context().run({"images": images})["logits"])
    np.testing.assert_allclose(saved["logits"], reference(tiny_onnx, {"images": images})["logits"], rtol=1e-4, atol=1e-5)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["images.npy", "out.npz", "tiny.plan"]  # no temp files
    # a bare FILE.npy is enough for a one-input engine; no --input at all runs random inputs
    assert cli("run", plan, "--input", tmp_path / "images.npy").code == 0
    result = cli("run", plan)
    assert result.code == 0 and "random inputs (seed 0) at images 2x3x16x16" in result.out

    # inspect: layers with what they were fused from, precision, tactic, epilogue
    result = cli("inspect", plan)
    assert result.code == 0, result
    for fragment in ("matches this machine  yes", "FusedConv", "conv1, relu1", "conv2, add", "Relu", "+ residual",
                     "GlobalAveragePool", "Gemm", "torch.conv", "Profiles", "1x3x16x16", "4x3x16x16", "Memory",
                     "device total", "Provenance", "onnx_sha256", "batchx3x16x16"):
        assert fragment in result.out, fragment
    result = cli("inspect", plan, "--json")
    assert result.code == 0, result
    info = json.loads(result.out)
    engine = sartor.load(plan)
    assert [layer["name"] for layer in info["layers"]] == ["conv1", "conv2", "pool", "flatten", "fc"]
    assert info["layers"][0]["origin"] == ["conv1", "relu1"] and info["layers"][0]["epilogue"] == "Relu"
    assert info["layers"][1]["origin"] == ["conv2", "add"] and info["layers"][1]["epilogue"] == "+ residual"
    assert {layer["precision"] for layer in info["layers"]} == {"fp32"}
    assert info["fingerprint"] == engine.fingerprint and info["fingerprint_here"]["matches"] is True
    assert info["memory"]["device_bytes"] == engine.device_memory_bytes
    assert info["profiles"] == [{"images": {"min": [1, 3, 16, 16], "opt": [2, 3, 16, 16], "max": [4, 3, 16, 16]}}]
    assert info["provenance"]["onnx_nodes"] == 7 and info["inputs"][0]["name"] == "images"

    # compare: random inputs at the opt shape, or --batch, or files
    result = cli("compare", tiny_onnx, plan)
    assert result.code == 0, result
    assert "PASS: all 1 output(s) within tolerance" in result.out and "images 2x3x16x16" in result.out
    result = cli("compare", tiny_onnx, plan, "--batch", "3", "--seed", "7", "--json")
    assert result.code == 0, result
    report = json.loads(result.out)
    assert report["passed"] is True and report["inputs"] == {"images": [3, 3, 16, 16]} and report["seed"] == 7
    (out,) = report["outputs"]
    assert out["name"] == "logits" and out["shape"] == [3, CLASSES] and out["max_abs"] < 1e-5
    assert out["argmax_agreement"] == 1.0 and out["cosine"] > 0.999999
    result = cli("compare", tiny_onnx, plan, "--input", f"images={tmp_path / 'images.npy'}", "--json")
    assert result.code == 0 and json.loads(result.out)["random_inputs"] is False

    # bench: small iteration counts
    result = cli("bench", plan, "--iterations", "3", "--warmup", "1")
    assert result.code == 0, result
    for fragment in ("p50", "p90", "p99", "inputs/s", "with host↔device copies", "device only", "images 2x3x16x16"):
        assert fragment in result.out, fragment
    result = cli("bench", plan, "--iterations", "4", "--warmup", "0", "--shapes", "images:3x3x16x16", "--json")
    assert result.code == 0, result
    bench = json.loads(result.out)
    assert bench["batch"] == 3 and bench["shapes"] == {"images": [3, 3, 16, 16]} and bench["iterations"] == 4
    for mode in ("with_copies", "device_only"):
        stats = bench[mode]
        assert 0 < stats["min_ms"] <= stats["p50_ms"] <= stats["p90_ms"] <= stats["p99_ms"] <= stats["max_ms"]
        assert stats["throughput"] == pytest.approx(3 / (stats["mean_ms"] / 1e3))


def test_compare_exits_1_when_over_tolerance(tiny_plan, tmp_path, cli):
    # Same inputs and outputs, other weights: the engine does not match this model.
    other = save(classifier_model(seed=1), tmp_path / "other.onnx")
    result = cli("compare", other, tiny_plan)
    assert result.code == 1, result
    assert "FAIL" in result.out and "logits" in result.out
    result = cli("compare", other, tiny_plan, "--json")
    assert result.code == 1 and json.loads(result.out)["passed"] is False
    assert result.err == ""  # a failed check is not an error
    # ...and a tolerance wide enough accepts it
    assert cli("compare", other, tiny_plan, "--atol", "100").code == 0


def test_compare_refuses_bad_options(tiny_onnx, tiny_plan, cli):
    assert_cli_error(cli("compare", tiny_onnx, tiny_plan, "--rtol", "-1"), "must not be negative")
    assert_cli_error(cli("compare", tiny_onnx, tiny_plan, "--batch", "0"), "--batch must be at least 1")
    assert_cli_error(cli("compare", tiny_onnx, tiny_plan, "--batch", "9"), "images 9x3x16x16", "outside")


def test_compare_against_a_model_with_other_inputs(tiny_plan, tmp_path, cli):
    other = save(two_input_model(), tmp_path / "two.onnx")
    assert_cli_error(cli("compare", other, tiny_plan), "are not the engine's", "built from this model")


def test_bench_refuses_bad_options(tiny_plan, cli):
    assert_cli_error(cli("bench", tiny_plan, "--iterations", "0"), "--iterations must be at least 1")
    assert_cli_error(cli("bench", tiny_plan, "--warmup", "-1"), "--warmup must be 0 or more")
    assert_cli_error(cli("bench", tiny_plan, "--shapes", "img:2x3x16x16"), "unknown input(s) img")
    assert_cli_error(cli("bench", tiny_plan, "--shapes", "images:9x3x16x16"), "images 9x3x16x16", "outside")
    assert_cli_error(cli("bench", tiny_plan, "--aux-streams", "9"), "aux_streams must be a whole number from 0 to 8")
    assert_cli_error(cli("bench", tiny_plan, "--aux-streams", "2", "--per-layer"), "--aux-streams goes with")


def test_bench_aux_streams_on_the_cpu_runs_on_one(tiny_plan, cli):
    """--aux-streams is CUDA's: a CPU engine runs as without it and says it used none."""
    result = cli("bench", tiny_plan, "--iterations", "2", "--warmup", "0", "--aux-streams", "2", "--json")
    assert result.code == 0, result
    assert json.loads(result.out)["aux_streams"] == 0


def test_python_dash_m_and_the_console_script(tiny_plan, tmp_path):
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    done = subprocess.run([sys.executable, "-m", "sartor", "inspect", str(tiny_plan), "--json"],
                          capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["layers"][0]["name"] == "conv1"
    script = Path(sys.executable).with_name("sartor")
    assert script.exists(), "the `sartor` console script is not installed"
    (tmp_path / "bad.plan").write_bytes(b"\x80\x04junk")
    done = subprocess.run([str(script), "run", str(tmp_path / "bad.plan")], capture_output=True, text=True, env=env,
                          timeout=120)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [f"error: {tmp_path / 'bad.plan'} is a pickle/zip file, not a sartor "
                                                "engine; sartor never unpickles files"]


def test_build_help_documents_profiles(cli):
    result = cli("build", "--help")
    assert result.code == 0
    assert "--profile starts a new optimization profile" in result.out
    assert "--layer-precision NODE=fp32" in result.out


# ---- profiles -----------------------------------------------------------------------------------

def test_profiles_from_events():
    events = [("min", "images:1x3x16x16"), ("max", "images:4x3x16x16"), ("profile", None),
              ("opt", "images:8x3x16x16")]
    assert profiles_from_events(events) == [
        {"min": {"images": (1, 3, 16, 16)}, "opt": {}, "max": {"images": (4, 3, 16, 16)}},
        {"min": {}, "opt": {"images": (8, 3, 16, 16)}, "max": {}}]
    # a leading --profile only opens profile 0
    assert profiles_from_events([("profile", None), ("opt", "a:1x2")]) == [{"min": {}, "opt": {"a": (1, 2)}, "max": {}}]
    assert profiles_from_events(None) == []
    assert profiles_from_events([("opt", "a:1x2,b:3")]) == [{"min": {}, "opt": {"a": (1, 2), "b": (3,)}, "max": {}}]
    with pytest.raises(ConfigError, match="profile 1 has no shapes"):
        profiles_from_events([("opt", "a:1x2"), ("profile", None)])
    with pytest.raises(ConfigError, match="profile 1 has no shapes"):
        profiles_from_events([("opt", "a:1x2"), ("profile", None), ("profile", None), ("opt", "a:2x2")])
    with pytest.raises(ConfigError, match="profile 0 has no shapes"):
        profiles_from_events([("profile", None)])
    with pytest.raises(ConfigError, match="gives input 'a' twice in profile 0"):
        profiles_from_events([("opt", "a:1x2"), ("opt", "a:2x2")])
    with pytest.raises(ProfileError, match="must look like NAME:1x3x224x224"):
        profiles_from_events([("opt", "a=1x2")])


def _check_two_profiles(plan: Path, model: Path) -> None:
    engine = sartor.load(plan, device="cpu")
    assert len(engine.profiles) == 2
    assert engine.profiles[1].shapes["images"].opt == (6, 3, 16, 16)
    small = np.random.default_rng(0).random((3, 3, 16, 16), dtype=np.float32)
    large = np.random.default_rng(1).random((7, 3, 16, 16), dtype=np.float32)
    for k, x in ((0, small), (1, large)):
        out = engine.context(profile=k).run({"images": x})["logits"]
        np.testing.assert_allclose(out, reference(model, {"images": x})["logits"], rtol=1e-4, atol=1e-5)
    # a context bound to one profile refuses the other's shapes, and names only its own ranges
    with pytest.raises(ProfileError) as info:
        engine.context(profile=0).run({"images": large})
    assert "profile 0: images 1x3x16x16..4x3x16x16" in str(info.value) and "profile 1" not in str(info.value)
    with pytest.raises(ProfileError, match="profile 1: images 5x3x16x16..8x3x16x16"):
        engine.context(profile=1).run({"images": small})
    # an unbound context uses the first profile admitting the shapes; 9 fits none and both are named
    free = engine.context()
    assert free.select_profile({"images": (7, 3, 16, 16)}) == 1
    assert free.run({"images": small})["logits"].shape == (3, CLASSES)
    with pytest.raises(ProfileError) as info:
        free.run({"images": np.zeros((9, 3, 16, 16), np.float32)})
    assert "profile 0: images 1x3x16x16..4x3x16x16" in str(info.value)
    assert "profile 1: images 5x3x16x16..8x3x16x16 (opt 6x3x16x16)" in str(info.value)
    with pytest.raises(ProfileError, match="profile 2 does not exist"):
        engine.context(profile=2)


def test_multiple_profiles_cli(tiny_onnx, tmp_path, cli):
    plan = tmp_path / "two.plan"
    result = cli("build", tiny_onnx, "-o", plan, "--device", "cpu", *SHAPE_ARGS, "--profile",
                 "--min-shapes", "images:5x3x16x16", "--opt-shapes", "images:6x3x16x16", "--max-shapes", "images:8x3x16x16")
    assert result.code == 0, result
    assert "profile 1" in result.out and "images 5x3x16x16..8x3x16x16 (opt 6x3x16x16)" in result.out
    _check_two_profiles(plan, tiny_onnx)
    result = cli("inspect", plan)
    assert "5x3x16x16" in result.out and "8x3x16x16" in result.out
    bench = json.loads(cli("bench", plan, "--iterations", "1", "--warmup", "0", "--shapes", "images:7x3x16x16",
                           "--json").out)
    assert bench["profile"] == 1


def test_multiple_profiles_api(tiny_onnx, tmp_path):
    plan = tmp_path / "two.plan"
    sartor.build(tiny_onnx, plan, device="cpu", profiles=[
        {"min": MIN_SHAPES, "opt": OPT_SHAPES, "max": MAX_SHAPES},
        {"min": {"images": (5, 3, 16, 16)}, "opt": {"images": (6, 3, 16, 16)}, "max": {"images": (8, 3, 16, 16)}}])
    _check_two_profiles(plan, tiny_onnx)


def test_two_inputs_each_named(tmp_path, cli):
    model = save(two_input_model(), tmp_path / "two.onnx")
    plan = tmp_path / "two.plan"
    assert cli("build", model, "-o", plan, "--device", "cpu", "--min-shapes", "a:1x4,b:1x4",
               "--max-shapes", "a:8x4,b:8x4", "--opt-shapes", "a:2x4,b:2x4").code == 0
    a = np.arange(-12, 12, dtype=np.float32).reshape(6, 4)
    b = np.full((6, 4), 2.0, np.float32)
    np.save(tmp_path / "a.npy", a)
    np.save(tmp_path / "b.npy", b)
    result = cli("run", plan, "--input", f"a={tmp_path / 'a.npy'}", "--input", f"b={tmp_path / 'b.npy'}",
                 "--output", tmp_path / "y.npz")
    assert result.code == 0, result
    np.testing.assert_array_equal(np.load(tmp_path / "y.npz")["y"], np.maximum(a, 0) * 2)
    assert_cli_error(cli("run", plan, "--input", f"a={tmp_path / 'a.npy'}"), "missing input(s) b")
    assert_cli_error(cli("run", plan, "--input", tmp_path / "a.npy"), "must look like NAME=FILE.npy")
    assert cli("compare", model, plan, "--batch", "5").code == 0


# ---- precision overrides ----------------------------------------------------------------------------

def test_layer_precision_glob(tiny_onnx, tmp_path, cli):
    plan = tmp_path / "mixed.plan"
    # "relu*" matches the ONNX node relu1, now fused into layer conv1; "fc" matches by name.
    result = cli("build", tiny_onnx, "-o", plan, "--device", "cpu", *SHAPE_ARGS,
                 "--layer-precision", "relu*=fp16", "--layer-precision", "f?=bf16")
    assert result.code == 0, result
    assert "layer conv1 runs fp16: --layer-precision relu*=fp16" in result.out
    assert "layer fc runs bf16: --layer-precision f?=bf16" in result.out
    layers = {layer["name"]: layer for layer in sartor.load(plan).layers}
    assert {name: layer["precision"] for name, layer in layers.items()} == {
        "conv1": "fp16", "conv2": "fp32", "pool": "fp32", "flatten": "fp32", "fc": "bf16"}
    assert layers["conv1"]["reason"] == "--layer-precision relu*=fp16"
    assert cli("compare", tiny_onnx, plan, "--rtol", "0.05", "--atol", "0.01").code == 0
    info = json.loads(cli("inspect", plan, "--json").out)
    assert [layer["precision"] for layer in info["layers"]] == ["fp16", "fp32", "fp32", "fp32", "bf16"]


def test_op_precision_reaches_fused_layers(tiny_onnx, tmp_path, cli):
    plan = tmp_path / "op.plan"
    result = cli("build", tiny_onnx, "-o", plan, "--device", "cpu", *SHAPE_ARGS, "--precision", "bf16",
                 "--op-precision", "Conv=fp32")
    assert result.code == 0, result
    precisions = {layer["name"]: layer["precision"] for layer in sartor.load(plan).layers}
    assert precisions == {"conv1": "fp32", "conv2": "fp32", "pool": "bf16", "flatten": "bf16", "fc": "bf16"}
    assert "precision mix" in result.out and "bf16 3, fp32 2" in result.out


def test_override_matching_no_layer(tiny_onnx, tmp_path, cli):
    out = tmp_path / "x.plan"
    with pytest.raises(ConfigError, match=r"match no layer: --layer-precision nothing\*, --op-precision Softmax"):
        sartor.build(tiny_onnx, out, device="cpu", opt_shapes=OPT_SHAPES, layer_precision={"nothing*": "fp32"},
                     op_precision={"Softmax": "fp32"})
    assert_cli_error(cli("build", tiny_onnx, "-o", out, "--device", "cpu", *SHAPE_ARGS,
                         "--layer-precision", "conv9*=fp32"), "match no layer: --layer-precision conv9*")
    assert not out.exists() and list(tmp_path.iterdir()) == []


# ---- round trips and load time ---------------------------------------------------------------------

def test_save_load_round_trip_is_bit_identical(tiny_plan, tiny_onnx, images, tmp_path):
    data = tiny_plan.read_bytes()
    header, tensors = unpack(data)
    assert pack(header, tensors) == data  # re-serializing what was read gives the same bytes
    copy = tmp_path / "copy.plan"
    copy.write_bytes(pack(header, tensors))
    first = sartor.load(tiny_plan, device="cpu").context().run({"images": images})["logits"]
    second = sartor.load(copy, device="cpu").context().run({"images": images})["logits"]
    assert first.tobytes() == second.tobytes()
    # the weights travel bit for bit: the Gemm's weight is the ONNX initializer, unchanged
    onnx_fc = next(t for t in classifier_model().graph.initializer if t.name == "fc.w")
    assert tensors["w/fc.w"].numpy().tobytes() == onnx_fc.raw_data
    # torch tensors in, torch tensors out, same numbers
    as_torch = sartor.load(copy, device="cpu").context().run({"images": torch.from_numpy(images)})["logits"]
    assert isinstance(as_torch, torch.Tensor) and as_torch.numpy().tobytes() == first.tobytes()


def test_load_is_fast(tiny_plan, images):
    sartor.load(tiny_plan, device="cpu")  # imports are not the engine's cost
    started = time.perf_counter()
    engine = sartor.load(tiny_plan, device="cpu")
    engine.context().run({"images": images})
    assert time.perf_counter() - started < 2.0


# ---- the comparison metric itself ------------------------------------------------------------------

def test_compare_output_metrics():
    ref = np.array([[1.0, 3.0, 2.0], [0.0, -4.0, 1.0]], np.float32)
    out = ref.copy()
    out[0, 2] = 3.5  # argmax of row 0 moves from 1 to 2
    c = compare_output("y", ref, out, rtol=0.1, atol=0.05)
    assert c.max_abs == pytest.approx(1.5) and c.max_ref == 4.0 and c.max_rel == pytest.approx(1.5 / 4)
    assert c.argmax_agreement == 0.5 and c.tolerance == pytest.approx(0.45) and not c.passed
    expected_cos = float(ref.ravel() @ out.ravel() / np.linalg.norm(ref) / np.linalg.norm(out))
    assert c.cosine == pytest.approx(expected_cos)
    # exactly at the bound passes, just above fails
    at = ref + np.float32(0.25)
    assert compare_output("y", ref, at, rtol=0.05, atol=0.05).passed
    assert not compare_output("y", ref, at, rtol=0.05, atol=0.04).passed
    # rank-1 outputs have no argmax agreement; zeros compare equal
    z = compare_output("z", np.zeros(4), np.zeros(4))
    assert z.argmax_agreement is None and z.cosine == 1.0 and z.max_rel == 0.0 and z.passed
    # a NaN on one side fails; NaN on both sides matches
    n = compare_output("n", np.array([1.0, np.nan]), np.array([1.0, 2.0]))
    assert not n.passed and n.max_abs == float("inf")
    assert compare_output("n", np.array([1.0, np.nan]), np.array([1.0, np.nan])).passed
    # a shape mismatch fails with a note
    s = compare_output("s", np.zeros((2, 3)), np.zeros((3, 2)))
    assert not s.passed and "differs" in s.note
    assert json.dumps(s.to_json())  # inf/nan written as text: valid JSON


def test_compare_and_benchmark_api(tiny_onnx, tiny_engine):
    report = compare_with_onnxruntime(tiny_onnx, tiny_engine, batch=4, seed=3)
    assert report.passed and report.inputs == {"images": (4, 3, 16, 16)} and report.random_inputs
    assert [o.name for o in report.outputs] == ["logits"]
    result = benchmark(tiny_engine, iterations=2, warmup=1)
    assert result.shapes == {"images": (2, 3, 16, 16)} and result.batch == 2 and result.profile == 0
    assert result.with_copies.p50_ms > 0 and result.device_only.throughput > 0
