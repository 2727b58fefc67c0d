"""The planner's label-free target (--min-cosine): the engine it keeps meets the target when measured
here, independently, with ONNX Runtime on the held-out samples; a target the default plan meets moves
nothing; the held-out samples are never calibration samples (arrays, image datasets, --data, a
calibration cache); an unreachable target and bad settings fail with one line."""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
from conftest import IMAGE, assert_cli_error, save
from test_quant_planner import SHAPE_ARGS, SHAPES, SPEC, loud_classifier, manifest_set

import sartor
from sartor.data import iterate_batches, open_dataset
from sartor.data.preprocess import parse_preprocess
from sartor.errors import ConfigError
from sartor.builder.accuracy_planner import CosineTrial, sample_cosines, search
from sartor.runtime.engine_file import read_engine_file

CALIB_SIZE = 12


def _samples(path: Path, count: int = 2 * CALIB_SIZE, seed: int = 0) -> Path:
    """`count` input samples in 0..1, as SPEC (std=255) makes them from images."""
    np.save(path, np.random.default_rng(seed).random((count, 3, IMAGE, IMAGE), dtype=np.float32))
    return path


def _mean_cosine(model: Path, engine: Path, x: np.ndarray) -> tuple[float, float]:
    """(mean, min) over the samples of `x` of the cosine between ONNX Runtime FP32 and the engine,
    computed here without the planner's code."""
    reference = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"]).run(None, {"images": x})[0]
    context = sartor.load(engine).context()
    got = np.concatenate([context.run({"images": x[k:k + 8]})["logits"] for k in range(0, len(x), 8)])
    r, g = reference.astype(np.float64), got.astype(np.float64)
    cos = (r * g).sum(1) / (np.linalg.norm(r, axis=1) * np.linalg.norm(g, axis=1))
    return float(cos.mean()), float(cos.min())


def _build(model: Path, out: Path, **kwargs):
    return sartor.build(model, out, device="cpu", profiles=[SHAPES], precision="int8", **kwargs)


def _images(manifest: Path, names: list[str]) -> np.ndarray:
    """The named images of `manifest`, preprocessed with SPEC."""
    samples = [s for s in open_dataset(manifest).samples if Path(s.path).name in names]
    return np.concatenate([a for a, _, _ in iterate_batches(samples, parse_preprocess(SPEC), 8)])


# ---- the measure -----------------------------------------------------------------------------------------

def test_sample_cosines_and_the_criterion():
    r = np.array([[1.0, 0.0], [0.0, 0.0], [1.0, 1.0], [0.0, 0.0], [2.0, 0.0]])
    e = np.array([[2.0, 0.0], [0.0, 0.0], [-1.0, -1.0], [1.0, 0.0], [np.nan, 0.0]])
    cos = sample_cosines(r, e, batch=5)
    assert cos[:4].tolist() == pytest.approx([1.0, 1.0, -1.0, 0.0]) and math.isnan(cos[4])
    assert sample_cosines(np.ones(3), np.ones(3), batch=2).tolist() == [1.0]  # no batch axis: one sample
    # The worst output's mean decides; a NaN mean never meets the target.
    trial = CosineTrial([], {"boxes": {"mean": 0.995, "min": 0.90, "snr_db": 20.0},
                             "scores": {"mean": 0.989, "min": 0.98, "snr_db": 19.0}})
    assert not trial.holds(0.99) and trial.under(0.99) == ["scores"] and trial.worst() == ("scores", 0.989)
    assert trial.holds(0.989) and trial.holds(0.95)
    assert not CosineTrial([], {"logits": {"mean": None, "min": None, "snr_db": None}}).holds(0.01)
    # The shared search takes cosine trials: grow 1, 2, 4, then bisect back to 3.
    ranking = [f"layer{k}" for k in range(8)]

    def measure(kept):
        mean = 0.999 if len(kept) >= 3 else 0.9
        return CosineTrial(list(kept), {"logits": {"mean": mean, "min": mean, "snr_db": None}})
    best, trials = search(ranking, measure, 0.99)
    assert [len(t.kept_out) for t in trials] == [0, 1, 2, 4, 3] and best.kept_out == ranking[:3]


# ---- end to end ------------------------------------------------------------------------------------------

def test_min_cosine_keeps_the_sensitive_layer_out_and_the_engine_meets_it(tmp_path, cli):
    model = save(loud_classifier(), tmp_path / "loud.onnx")
    calib = _samples(tmp_path / "calib.npy")
    x = np.load(calib)
    held_out = x[CALIB_SIZE:]
    # The default INT8 plan misses the target by the independent measure (so this test can fail).
    default = _build(model, tmp_path / "default.plan", calib=calib, calib_size=CALIB_SIZE)
    assert _mean_cosine(model, Path(default.path), held_out)[0] < 0.9
    out = tmp_path / "loud.plan"
    result = cli("build", model, "-o", out, "--device", "cpu", "--precision", "int8", *SHAPE_ARGS, "--calib", calib,
                 "--calib-size", str(CALIB_SIZE), "--min-cosine", "0.99")
    assert result.code == 0, result
    mean, low = _mean_cosine(model, out, held_out)
    assert mean >= 0.99, (mean, low)
    header, _ = read_engine_file(out)
    layers = {layer["name"]: layer for layer in header["layers"]}
    assert layers["conv2"]["precision"] == "fp32" and layers["conv1"]["op"] == "QConv" and layers["conv3"]["op"] == "QConv"
    reason = layers["conv2"]["reason"]
    assert reason.startswith("planner: sensitivity rank 1, SNR ") and "needed for --min-cosine 0.99 (logits mean " \
        "cosine 0.7" in reason, reason
    plan = header["planner"]
    assert plan["target"] == "min_cosine" and plan["kept_out"] == ["conv2"] and plan["min_cosine"] == 0.99
    assert [it["layers_out"] for it in plan["iterations"]] == [0, 1]
    assert [it["holds"] for it in plan["iterations"]] == [False, True]
    # The planner measured the samples after the calibration draw: its figures are ours.
    held = plan["held_out"]
    assert held["samples"] == CALIB_SIZE and "samples 12..23 (calibration uses 0..11)" in held["source"]
    assert held["disjoint"].startswith("yes:")
    assert plan["outputs"]["logits"]["mean"] == pytest.approx(mean, abs=1e-6)
    assert plan["outputs"]["logits"]["min"] == pytest.approx(low, abs=1e-6)
    assert plan["iterations"][0]["outputs"]["logits"]["mean"] == pytest.approx(
        _mean_cosine(model, Path(default.path), held_out)[0], abs=1e-6)
    assert "min cosine" in result.out and "1 of 3 INT8 layer(s) kept at fp32" in " ".join(result.out.split())
    shown = cli("inspect", out)
    assert shown.code == 0 and "INT8 planner: min cosine 0.99" in " ".join(shown.out.split()), shown
    assert "kept out of INT8 (1 of 3): conv2" in shown.out and "planner: sensitivity rank 1" in shown.out
    assert json.loads(cli("inspect", out, "--json").out)["planner"]["kept_out"] == ["conv2"]


def test_a_target_the_default_plan_meets_moves_nothing(tmp_path):
    model = save(loud_classifier(loud=1.0), tmp_path / "quiet.onnx")  # no loud channel: INT8 is fine
    calib = _samples(tmp_path / "calib.npy")
    result = _build(model, tmp_path / "quiet.plan", calib=calib, calib_size=CALIB_SIZE, min_cosine=0.99)
    plan = result.header["planner"]
    assert plan["kept_out"] == [] and len(plan["iterations"]) == 1 and plan["iterations"][0]["holds"]
    assert {layer["op"] for layer in result.header["layers"] if layer["name"].startswith("conv")} == {"QConv"}
    assert _mean_cosine(model, Path(result.path), np.load(calib)[CALIB_SIZE:])[0] >= 0.99


def test_held_out_images_are_never_calibration_images(tmp_path):
    model = save(loud_classifier(), tmp_path / "loud.onnx")
    val = manifest_set(tmp_path / "val", count=24)
    # Calibration spreads its 12 images over the 24: img0, img2, … The planner measures the others.
    first = _build(model, tmp_path / "a.plan", calib=val, calib_size=CALIB_SIZE, preprocess=SPEC, min_cosine=0.99,
                   calib_cache=tmp_path / "cache.json")
    plan = first.header["planner"]
    assert plan["held_out"]["samples"] == 12, plan["iterations"]
    assert "12 of 12 images outside the calibration draw" in plan["held_out"]["source"]
    odd = _images(val, [f"img{k}.png" for k in range(1, 24, 2)])
    even = _images(val, [f"img{k}.png" for k in range(0, 24, 2)])
    default = _build(model, tmp_path / "default.plan", calib=val, calib_size=CALIB_SIZE, preprocess=SPEC)
    measured = plan["iterations"][0]["outputs"]["logits"]["mean"]
    assert measured == pytest.approx(_mean_cosine(model, Path(default.path), odd)[0], abs=1e-6)
    assert measured != pytest.approx(_mean_cosine(model, Path(default.path), even)[0], abs=1e-6)
    # --data the same set: the drawn images are left out of it too. Another set: measured whole, up to
    # --cosine-samples, and a cache made from the same draw is checked by its digest.
    same = _build(model, tmp_path / "b.plan", calib=val, calib_size=CALIB_SIZE, preprocess=SPEC, min_cosine=0.5,
                  data=val, calib_cache=tmp_path / "cache.json")
    held = same.header["planner"]["held_out"]
    assert held["sha256"] == plan["held_out"]["sha256"] and held["disjoint"].startswith("yes: the cache's 12")
    other = manifest_set(tmp_path / "other", count=10, seed=500)
    more = _build(model, tmp_path / "c.plan", calib=val, calib_size=CALIB_SIZE, preprocess=SPEC, min_cosine=0.5,
                  data=other, cosine_samples=6)
    assert more.header["planner"]["held_out"]["samples"] == 6
    assert more.header["planner"]["held_out"]["source"].startswith(f"--data {other}: 6 of 10 images")
    # A cache calibrated on another draw cannot vouch for its samples: said in the record and the log.
    unsure = _build(model, tmp_path / "d.plan", calib=val, calib_size=8, preprocess=SPEC, min_cosine=0.5,
                    calib_cache=tmp_path / "cache.json")
    assert unsure.header["planner"]["held_out"]["disjoint"].startswith("unverified: thresholds from cache")
    assert any("disjoint from calibration: unverified" in line for line in unsure.log)


def test_unreachable_target_fails_with_one_line(tmp_path, cli):
    # conv2 pinned to INT8 by the user: the planner may not move it, and nothing else can fix it.
    model = save(loud_classifier(), tmp_path / "loud.onnx")
    calib = _samples(tmp_path / "calib.npy")
    out = tmp_path / "never.plan"
    result = cli("build", model, "-o", out, "--device", "cpu", "--precision", "int8", *SHAPE_ARGS, "--calib", calib,
                 "--calib-size", str(CALIB_SIZE), "--layer-precision", "conv2=int8", "--min-cosine", "0.99")
    assert_cli_error(result, "--min-cosine 0.99 cannot be met", "all 2 INT8 layer(s) moved to fp32",
                     "output logits has mean cosine 0.", "over 12 held-out samples",
                     "1 INT8 layer(s) pinned by --layer-precision stay INT8 (conv2)")
    assert not out.exists()


def test_min_cosine_refusals(tmp_path, cli):
    model = save(loud_classifier(), tmp_path / "m.onnx")
    calib = _samples(tmp_path / "calib.npy")
    val = manifest_set(tmp_path / "val", count=4)
    base = ("build", model, "-o", tmp_path / "x.plan", "--device", "cpu", *SHAPE_ARGS)
    int8 = (*base, "--precision", "int8", "--calib", calib)
    for bad in ("0", "-0.5", "1.01", "nan"):
        assert_cli_error(cli(*int8, "--min-cosine", bad), f"--min-cosine {bad} must be in (0, 1]")
    assert_cli_error(cli(*int8, "--min-cosine", "0.99", "--cosine-samples", "0"), "--cosine-samples 0 must be at least 1")
    assert_cli_error(cli(*int8, "--preprocess", SPEC, "--data", val, "--min-cosine", "0.99", "--accuracy-budget",
                         "0.01"), "--min-cosine and --accuracy-budget are two planner targets: give one")
    assert_cli_error(cli(*base, "--precision", "fp32", "--calib", calib, "--min-cosine", "0.99"), "--min-cosine",
                     "needs --precision int8, fp8, fp16 or bf16")
    assert_cli_error(cli(*int8, "--data", val, "--min-cosine", "0.99"), "--min-cosine with --data needs --preprocess")
    # Only a calibration cache: nothing to measure on.
    cache = tmp_path / "cache.json"
    _build(model, tmp_path / "c.plan", calib=calib, calib_size=CALIB_SIZE, calib_cache=cache)
    with pytest.raises(ConfigError, match="--min-cosine needs samples to measure on"):
        _build(model, tmp_path / "y.plan", calib_cache=cache, min_cosine=0.99)
    # Every sample of --calib is a calibration sample.
    assert_cli_error(cli(*int8, "--calib-size", "24", "--min-cosine", "0.99"),
                     "holds 24 and calibration uses 24 (--calib-size 24)", "give more samples than --calib-size")
