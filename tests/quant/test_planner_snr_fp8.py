"""The planner and `sartor sensitivity` under FP8 E4M3, and the planner's second label-free target
(--min-snr): an FP8 build keeps the layer FP8 breaks out of FP8 until --min-cosine holds on the
held-out samples (measured here with ONNX Runtime); `sartor sensitivity --precision fp8` ranks that
layer first and says fp8; --min-snr fires when the default plan's SNR is under it, moves nothing when
it is met, records the SNR a direct computation gives, and refuses the other targets beside it."""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
from conftest import IMAGE, assert_cli_error, save
from test_quant_planner import SHAPE_ARGS, SHAPES, loud_classifier

import sartor
from sartor.errors import ConfigError
from sartor.builder.accuracy_planner import SnrTrial, grouped_outputs, search
from sartor.validate.sensitivity import analyze, output_groups
from sartor.runtime.engine_file import read_engine_file

CALIB_SIZE = 12
# conv1's channel 7 is a constant this loud: FP8's activation scale of conv2's input (amax/448) then
# puts every other channel under E4M3's smallest step, so FP8 conv2 sees zeros. (INT8 breaks at 1e4
# already; FP8's exponent carries it much further.)
FP8_LOUD = 1e6


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("snr_fp8")


@pytest.fixture(scope="module")
def loud(work) -> Path:
    return save(loud_classifier(loud=FP8_LOUD), work / "loud.onnx")


@pytest.fixture(scope="module")
def calib(work) -> Path:
    """2 × CALIB_SIZE input samples in 0..1: calibration takes the first half, the planner the rest."""
    path = work / "calib.npy"
    np.save(path, np.random.default_rng(0).random((2 * CALIB_SIZE, 3, IMAGE, IMAGE), dtype=np.float32))
    return path


@pytest.fixture(scope="module")
def default_fp8(work, loud, calib) -> Path:
    return Path(_build(loud, work / "default.plan", calib=calib).path)


def _build(model: Path, out: Path, **kwargs):
    return sartor.build(model, out, device="cpu", profiles=[SHAPES], precision="fp8", calib_size=CALIB_SIZE, **kwargs)


def _outputs(model: Path, engine: Path, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(ONNX Runtime FP32, the engine) logits on `x`, in float64."""
    reference = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"]).run(None, {"images": x})[0]
    context = sartor.load(engine).context()
    got = np.concatenate([context.run({"images": x[k:k + 8]})["logits"] for k in range(0, len(x), 8)])
    return reference.astype(np.float64), got.astype(np.float64)


def _mean_cosine(model: Path, engine: Path, x: np.ndarray) -> float:
    r, g = _outputs(model, engine, x)
    return float(((r * g).sum(1) / (np.linalg.norm(r, axis=1) * np.linalg.norm(g, axis=1))).mean())


def _snr_db(model: Path, engine: Path, x: np.ndarray) -> float:
    """10·log10(Σref² / Σ(ref−engine)²) over all of `x`, computed here without the planner's code."""
    r, g = _outputs(model, engine, x)
    return 10 * math.log10(float((r ** 2).sum()) / float(((r - g) ** 2).sum()))


def _held_out(calib: Path) -> np.ndarray:
    return np.load(calib)[CALIB_SIZE:]


# ---- FP8 through the planner and sensitivity -------------------------------------------------------------

def test_fp8_min_cosine_keeps_the_layer_fp8_breaks_and_meets_the_target(work, loud, calib, default_fp8, cli):
    held_out = _held_out(calib)
    assert _mean_cosine(loud, default_fp8, held_out) < 0.9  # the default FP8 plan misses: the test can fail
    out = work / "cosine.plan"
    result = cli("build", loud, "-o", out, "--device", "cpu", "--precision", "fp8", *SHAPE_ARGS, "--calib", calib,
                 "--calib-size", str(CALIB_SIZE), "--min-cosine", "0.99")
    assert result.code == 0, result
    assert _mean_cosine(loud, out, held_out) >= 0.99
    header, _ = read_engine_file(out)
    layers = {layer["name"]: layer for layer in header["layers"]}
    assert layers["conv2"]["precision"] == "fp32" and layers["conv2"]["op"] != "QConv"
    for name in ("conv1", "conv3"):
        assert layers[name]["op"] == "QConv" and layers[name]["precision"] == "fp8", layers[name]
    assert layers["conv2"]["reason"].startswith("planner: sensitivity rank 1, SNR ")
    assert "needed for --min-cosine 0.99 (logits mean cosine 0.7" in layers["conv2"]["reason"]
    plan = header["planner"]
    assert plan["quantized"] == "fp8" and plan["precision"] == "fp32" and plan["kept_out"] == ["conv2"]
    assert [r["name"] for r in plan["ranking"]][0] == "conv2" and len(plan["ranking"]) == 3
    assert "samples 12..23 (calibration uses 0..11)" in plan["held_out"]["source"]
    assert "1 of 3 FP8 layer(s) kept at fp32" in " ".join(result.out.split())
    assert "planner: iteration 0: 0 layer(s) out of FP8" in result.out
    shown = cli("inspect", out)
    assert shown.code == 0 and "FP8 planner: min cosine 0.99" in " ".join(shown.out.split()), shown
    assert "kept out of FP8 (1 of 3): conv2" in shown.out


def test_fp8_sensitivity_ranks_the_broken_layer_first_and_says_fp8(loud, calib, cli):
    result = cli("sensitivity", loud, "--calib", calib, "--calib-size", str(CALIB_SIZE), "--precision", "fp8", "--json")
    assert result.code == 0, result
    report = json.loads(result.out)
    assert report["precision"] == "fp8"
    rows = {r["name"]: r for r in report["layers"]}
    assert report["layers"][0]["name"] == "conv2" and rows["conv2"]["snr_db"] < 10 < rows["conv1"]["snr_db"]
    assert {rows[n]["default"] for n in ("conv1", "conv2", "conv3")} == {"fp8"}
    assert "output head, kept out of FP8" in rows["fc"]["default"]
    # INT8 ranks the same layers on the same thresholds to other figures: FP8 was really the format tried.
    int8 = {r["name"]: r for r in json.loads(cli("sensitivity", loud, "--calib", calib, "--calib-size",
                                                 str(CALIB_SIZE), "--json").out)["layers"]}
    assert rows["conv1"]["snr_db"] != pytest.approx(int8["conv1"]["snr_db"], abs=0.5)
    table = cli("sensitivity", loud, "--calib", calib, "--calib-size", str(CALIB_SIZE), "--precision", "fp8")
    assert "FP8 sensitivity" in table.out and "default FP8 plan" in table.out
    assert cli("sensitivity", loud, "--calib", calib, "--precision", "fp16").code == 2
    with pytest.raises(ConfigError, match="--precision fp16: sensitivity ranks layers under a quantized format"):
        analyze(str(loud), str(calib), precision="fp16")


# ---- --min-snr -------------------------------------------------------------------------------------------

def test_snr_trial_gates_on_the_worst_output_and_an_exact_match_holds():
    trial = SnrTrial([], {"boxes": {"mean": 1.0, "min": 1.0, "snr_db": 35.0},
                          "scores": {"mean": 1.0, "min": 1.0, "snr_db": 18.0}})
    assert trial.under(20.0) == ["scores"] and trial.worst() == ("scores", 18.0) and trial.holds(18.0)
    assert SnrTrial([], {"logits": {"mean": 1.0, "min": 1.0, "snr_db": math.inf}}).holds(200.0)
    assert not SnrTrial([], {"logits": {"mean": None, "min": None, "snr_db": None}}).holds(-100.0)

    def measure(kept):
        return SnrTrial(list(kept), {"logits": {"mean": 1.0, "min": 1.0, "snr_db": 10.0 * len(kept)}})
    best, trials = search([f"layer{k}" for k in range(8)], measure, 25.0)
    assert [len(t.kept_out) for t in trials] == [0, 1, 2, 4, 3] and len(best.kept_out) == 3


def test_decoder_groups_stay_per_sample():
    # A YOLO head [B, 4+C, N]: boxes and scores apart, each [B, -1] so that the cosine stays per sample.
    head = np.arange(2 * 6 * 8, dtype=np.float32).reshape(2, 6, 8)
    groups = output_groups("yolo", {"output0": head.shape})
    (split,) = grouped_outputs([{"output0": head}], groups, [2])
    assert split["boxes"].shape == (2, 32) and split["scores"].shape == (2, 16)
    assert np.array_equal(split["scores"][1], head[1, 4:].ravel())


def test_min_snr_fires_and_records_the_snr_a_direct_computation_gives(work, loud, calib, default_fp8, cli):
    held_out = _held_out(calib)
    before = _snr_db(loud, default_fp8, held_out)
    target = 30.0
    assert before < target  # above the all-quantized SNR: the planner must keep a layer out
    out = work / "snr.plan"
    result = cli("build", loud, "-o", out, "--device", "cpu", "--precision", "fp8", *SHAPE_ARGS, "--calib", calib,
                 "--calib-size", str(CALIB_SIZE), "--min-snr", str(target))
    assert result.code == 0, result
    header, _ = read_engine_file(out)
    plan = header["planner"]
    assert plan["target"] == "min_snr" and plan["min_snr"] == target and plan["quantized"] == "fp8"
    assert len(plan["kept_out"]) >= 1 and plan["kept_out"][0] == "conv2"
    assert [it["holds"] for it in plan["iterations"]][0] is False and plan["iterations"][-1]["holds"]
    # The recorded SNRs are the SNRs of these engines on the held-out samples against FP32.
    assert plan["iterations"][0]["outputs"]["logits"]["snr_db"] == pytest.approx(before, abs=0.01)
    after = _snr_db(loud, out, held_out)
    assert after >= target and plan["outputs"]["logits"]["snr_db"] == pytest.approx(after, abs=0.01)
    reason = {layer["name"]: layer["reason"] for layer in header["layers"]}["conv2"]
    assert f"needed for --min-snr 30 (logits SNR {before:.2f} dB → " in reason, reason
    assert "min SNR" in result.out and "FP8 layer(s) kept at fp32" in " ".join(result.out.split())
    shown = cli("inspect", out)
    assert shown.code == 0 and "FP8 planner: min SNR 30 dB" in " ".join(shown.out.split()), shown


def test_min_snr_already_met_moves_nothing(work, calib):
    quiet = save(loud_classifier(loud=1.0), work / "quiet.onnx")  # nothing loud: FP8 is fine everywhere
    result = _build(quiet, work / "quiet.plan", calib=calib, min_snr=15.0)
    plan = result.header["planner"]
    assert plan["kept_out"] == [] and len(plan["iterations"]) == 1 and plan["iterations"][0]["holds"]
    assert {layer["op"] for layer in result.header["layers"] if layer["name"].startswith("conv")} == {"QConv"}
    assert _snr_db(quiet, Path(result.path), _held_out(calib)) >= 15.0


def test_min_snr_refusals(work, loud, calib, cli):
    base = ("build", loud, "-o", work / "x.plan", "--device", "cpu", *SHAPE_ARGS)
    fp8 = (*base, "--precision", "fp8", "--calib", calib)
    assert_cli_error(cli(*fp8, "--min-snr", "30", "--min-cosine", "0.99"),
                     "--min-cosine and --min-snr are two planner targets: give one")
    assert_cli_error(cli(*fp8, "--min-snr", "30", "--accuracy-budget", "0.01"),
                     "--min-snr and --accuracy-budget are two planner targets: give one")
    assert_cli_error(cli(*fp8, "--min-snr", "30", "--min-cosine", "0.99", "--accuracy-budget", "0.01"),
                     "three planner targets")
    for bad in ("nan", "inf"):
        assert_cli_error(cli(*fp8, "--min-snr", bad), f"--min-snr {bad} must be a finite number of dB")
    assert_cli_error(cli(*base, "--precision", "fp32", "--min-snr", "30"), "--min-snr moves layers",
                     "needs --precision int8, fp8, fp16 or bf16, not fp32")
    assert_cli_error(cli(*fp8, "--decoder", "yolo"), "--decoder yolo groups the outputs --min-snr and --min-cosine")
    assert_cli_error(cli(*fp8, "--min-snr", "30", "--decoder", "mine:decode"), "--decoder 'mine:decode'")
    assert_cli_error(cli(*fp8, "--calib-size", "24", "--min-snr", "30"),
                     "--min-snr measures on samples calibration does not use", "holds 24 and calibration uses 24")
    assert not (work / "x.plan").exists()
