"""INT8 calibration balanced per split (--calib-balance-by), the split coverage warning (--data),
and the accuracy planner (--accuracy-budget): its search, an end-to-end run on a tiny classifier
that INT8 visibly breaks, the reasons `sartor inspect` shows, and the impossible budget."""
from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from conftest import (
    IMAGE,
    assert_cli_error,
    classifier_model,
    make_model,
    save,
    shape_flag,
)
from onnx import TensorProto, helper, numpy_helper
from PIL import Image

import sartor
from sartor.errors import ConfigError
from sartor.builder import accuracy_planner as planner
from sartor.quant.data import split_coverage
from sartor.builder.accuracy_planner import Trial, search
from sartor.runtime.engine_file import read_engine_file

SPEC = f"resize={IMAGE}x{IMAGE},std=255"
SHAPES = {"min": {"images": (1, 3, IMAGE, IMAGE)}, "opt": {"images": (4, 3, IMAGE, IMAGE)},
          "max": {"images": (8, 3, IMAGE, IMAGE)}}
SHAPE_ARGS = ("--min-shapes", shape_flag(SHAPES["min"]), "--opt-shapes", shape_flag(SHAPES["opt"]),
              "--max-shapes", shape_flag(SHAPES["max"]))


# ---- data ----------------------------------------------------------------------------------------------

def _image(path: Path, seed: int, dark: bool) -> None:
    pixels = np.random.default_rng(seed).integers(0, 64 if dark else 256, (IMAGE, IMAGE, 3), dtype=np.uint8)
    Image.fromarray(pixels).save(path)


def coco_set(directory: Path, day: int, night: int, seed: int = 0) -> Path:
    """A COCO file of random images, `day` then `night` of them, each with a "lighting" attribute."""
    directory.mkdir(parents=True, exist_ok=True)
    images = []
    for k, lighting in enumerate(["day"] * day + ["night"] * night):
        name = f"{lighting}_{k}.png"
        _image(directory / name, seed + k, lighting == "night")
        images.append({"id": k + 1, "file_name": name, "width": IMAGE, "height": IMAGE, "lighting": lighting})
    path = directory / "annotations.json"
    path.write_text(json.dumps({"images": images, "annotations": [], "categories": [{"id": 1, "name": "thing"}]}))
    return path


def manifest_set(directory: Path, count: int = 24, seed: int = 100) -> Path:
    """An unlabelled CSV manifest (reference mode: top-1 agreement with the FP32 model), alternately
    day and night, split by the column "light"."""
    directory.mkdir(parents=True, exist_ok=True)
    rows = []
    for k in range(count):
        light = "day" if k % 2 == 0 else "night"
        _image(directory / f"img{k}.png", seed + k, light == "night")
        rows.append({"path": f"img{k}.png", "light": light})
    path = directory / "val.csv"
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["path", "light"])
        writer.writeheader()
        writer.writerows(rows)
    return path


def loud_classifier(seed: int = 0, loud: float = 1e4) -> onnx.ModelProto:
    """conv1 → relu → conv2 → relu → conv3 → relu → pool → fc. conv1's channel 7 is a constant
    `loud` that no later layer reads (zero weights): harmless in FP32, but conv2's per-tensor INT8
    input scale is set by it, so INT8 conv2 sees only zeros in the channels that matter."""
    rng = np.random.default_rng(seed)

    def w(*shape):
        return (rng.standard_normal(shape) / np.sqrt(np.prod(shape[1:]))).astype(np.float32)

    def b(n):
        return (rng.standard_normal(n) * 0.1).astype(np.float32)
    c1w, c1b, c2w, c2b, c3w, c3b, fcw, fcb = w(8, 3, 3, 3), b(8), w(8, 8, 3, 3), b(8), w(8, 8, 3, 3), b(8), w(10, 8), b(10)
    c1w[7], c1b[7], c2w[:, 7] = 0.0, loud, 0.0
    inits = [numpy_helper.from_array(a, n) for a, n in ((c1w, "c1.w"), (c1b, "c1.b"), (c2w, "c2.w"), (c2b, "c2.b"),
                                                           (c3w, "c3.w"), (c3b, "c3.b"), (fcw, "fc.w"), (fcb, "fc.b"))]
    nodes = [helper.make_node("Conv", ["images", "c1.w", "c1.b"], ["c1"], name="conv1", pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c1"], ["r1"], name="relu1"),
             helper.make_node("Conv", ["r1", "c2.w", "c2.b"], ["c2"], name="conv2", pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c2"], ["r2"], name="relu2"),
             helper.make_node("Conv", ["r2", "c3.w", "c3.b"], ["c3"], name="conv3", pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c3"], ["r3"], name="relu3"),
             helper.make_node("GlobalAveragePool", ["r3"], ["p"], name="pool"),
             helper.make_node("Flatten", ["p"], ["f"], name="flatten", axis=1),
             helper.make_node("Gemm", ["f", "fc.w", "fc.b"], ["logits"], name="fc", transB=1)]
    model = make_model(nodes, [helper.make_tensor_value_info("images", TensorProto.FLOAT, ["batch", 3, IMAGE, IMAGE])],
                       [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", 10])], inits, name="loud")
    onnx.checker.check_model(model)
    return model


def _build(model: Path, out: Path, **kwargs):
    return sartor.build(model, out, device="cpu", profiles=[SHAPES], precision="int8", preprocess=SPEC, **kwargs)


# ---- --calib-balance-by and the coverage warning -------------------------------------------------------

def test_balance_by_draws_equal_counts_and_records_them(tmp_path, cli):
    data = coco_set(tmp_path / "calib", day=12, night=4)
    model = save(classifier_model(), tmp_path / "m.onnx")
    spread = _build(model, tmp_path / "spread.plan", calib=data, calib_size=8)
    assert spread.header["provenance"]["calibration"]["splits"] == {"lighting": {"day": 6, "night": 2}}
    cache = tmp_path / "cache.json"
    balanced = _build(model, tmp_path / "balanced.plan", calib=data, calib_size=8, calib_balance_by="lighting",
                      calib_cache=cache)
    record = balanced.header["provenance"]["calibration"]
    assert record["balance_by"] == "lighting" and record["calib_size"] == 8
    assert record["splits"] == {"lighting": {"day": 4, "night": 4}}
    assert record["calib_sha256"] != spread.header["provenance"]["calibration"]["calib_sha256"]
    assert "calibration: images per lighting: day 4, night 4" in balanced.log
    # A group smaller than its share gives all it has; the others fill in.
    more = _build(model, tmp_path / "more.plan", calib=data, calib_size=12, calib_balance_by="lighting")
    assert more.header["provenance"]["calibration"]["splits"] == {"lighting": {"day": 8, "night": 4}}
    # The cache keeps the counts: a build from it records and checks them without the images.
    again = _build(model, tmp_path / "again.plan", calib_cache=cache)
    assert again.header["provenance"]["calibration"]["splits"] == {"lighting": {"day": 4, "night": 4}}
    # sartor sensitivity draws the same way.
    ranked = cli("sensitivity", model, "--calib", data, "--calib-size", "6", "--preprocess", SPEC,
                 "--calib-balance-by", "lighting", "--json")
    assert ranked.code == 0 and json.loads(ranked.out)["samples"] == 6, ranked


def test_split_coverage_thresholds():
    assert split_coverage({"day": 250, "night": 250}, {"day": 201, "night": 199}, "lighting", "val") == []
    missing = split_coverage({"day": 500}, {"day": 201, "night": 199}, "lighting", "val")
    assert len(missing) == 1 and "no lighting=night image" in missing[0] and "199 images" in missing[0]
    # Under 25% of the fair share (500 / 2 = 250) is warned about; 25% itself is not.
    few = split_coverage({"day": 438, "night": 62}, {"day": 1, "night": 1}, "lighting", "val")
    assert len(few) == 1 and "62 lighting=night image(s) of 500" in few[0] and "fair share (250)" in few[0]
    assert split_coverage({"day": 375, "night": 125}, {"day": 1, "night": 1, "dusk": 1}, "lighting", "val")[0] \
        .startswith("warning: the calibration sample (500 images) holds no lighting=dusk image")
    assert split_coverage({"day": 375, "night": 125}, {"day": 1, "night": 1}, "lighting", "val") == []


def test_missing_split_warns_in_the_build_log_and_on_stderr(tmp_path, cli):
    day_only = coco_set(tmp_path / "day", day=8, night=0)
    val = coco_set(tmp_path / "val", day=3, night=3, seed=50)
    model = save(classifier_model(), tmp_path / "m.onnx")
    out = tmp_path / "m.plan"
    result = cli("build", model, "-o", out, "--device", "cpu", "--precision", "int8", "--preprocess", SPEC,
                 *SHAPE_ARGS, "--calib", day_only, "--calib-balance-by", "lighting", "--data", val,
                 "--split-by", "lighting")
    assert result.code == 0, result
    warnings = [line for line in result.err.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and "no lighting=night image" in warnings[0] and "(3 images)" in warnings[0], result
    assert " ".join(result.out.split()).count(warnings[0]) == 1  # and in the build log (wrapped), once
    header, _ = read_engine_file(out)
    assert header["build_log"].count(warnings[0]) == 1
    assert header["provenance"]["calibration"]["splits"] == {"lighting": {"day": 8}}
    # Balanced on day and night: no warning.
    both = coco_set(tmp_path / "both", day=4, night=4, seed=80)
    quiet = cli("build", model, "-o", tmp_path / "q.plan", "--device", "cpu", "--precision", "int8", "--preprocess",
                SPEC, *SHAPE_ARGS, "--calib", both, "--calib-balance-by", "lighting", "--data", val)
    assert quiet.code == 0 and "warning:" not in quiet.err, quiet


def test_balance_and_budget_refusals(tmp_path, cli):
    model = save(classifier_model(), tmp_path / "m.onnx")
    data = coco_set(tmp_path / "calib", day=2, night=2)
    npy = tmp_path / "calib.npy"
    np.save(npy, np.zeros((4, 3, IMAGE, IMAGE), np.float32))
    base = ("build", model, "-o", tmp_path / "x.plan", "--device", "cpu", "--preprocess", SPEC, *SHAPE_ARGS)
    int8 = (*base, "--precision", "int8")
    assert_cli_error(cli(*int8, "--calib", npy, "--calib-balance-by", "lighting"), "--calib-balance-by lighting",
                     "without attributes")
    assert_cli_error(cli(*int8, "--calib", data, "--calib-balance-by", "weather"), "--calib-balance-by weather",
                     "attributes: lighting")
    assert_cli_error(cli(*int8, "--calib", data, "--accuracy-budget", "0.01"), "--accuracy-budget needs --data")
    assert_cli_error(cli(*int8, "--calib", data, "--data", data, "--accuracy-budget", "-1"), "must be a finite value")
    assert_cli_error(cli(*base, "--precision", "fp32", "--data", data, "--accuracy-budget", "0.01"),
                     "needs --precision int8, fp8, fp16 or bf16, not fp32")
    assert_cli_error(cli(*int8, "--calib", data, "--split-by", "lighting"), "--split-by lighting needs --data")
    assert_cli_error(cli(*int8, "--calib", data, "--data", data, "--split-by", "weather"),
                     "--split-by weather: no image of --data")
    with pytest.raises(ConfigError, match="--data is for INT8 builds"):
        sartor.build(model, tmp_path / "y.plan", device="cpu", profiles=[SHAPES], preprocess=SPEC, data=str(data))


# ---- the planner ---------------------------------------------------------------------------------------

def _fake_measure(needed: set, calls: list):
    """Holds (drop 0.001) once every layer in `needed` is kept out; else a night drop of 0.02."""
    def measure(kept_out):
        calls.append(len(kept_out))
        ok = needed <= set(kept_out)
        return Trial(list(kept_out), {"all": 0.001 if ok else 0.01, "day": 0.0, "night": 0.001 if ok else 0.02})
    return measure


def test_search_grows_then_bisects_back():
    ranking = [f"layer{k}" for k in range(20)]
    calls: list = []
    best, trials = search(ranking, _fake_measure({"layer4"}, calls), 0.008)
    assert calls == [0, 1, 2, 4, 8, 6, 5] and best.kept_out == ranking[:5] and len(trials) == 7
    calls.clear()
    best, _ = search(ranking, _fake_measure(set(), calls), 0.008)
    assert calls == [0] and best.kept_out == []  # the default plan holds: nothing moves
    calls.clear()
    best, _ = search(ranking, _fake_measure({"layer19"}, calls), 0.008)
    assert calls == [0, 1, 2, 4, 8, 16, 20, 18, 19] and best.kept_out == ranking
    calls.clear()
    best, trials = search(ranking, _fake_measure({"absent"}, calls), 0.008)
    assert best is None and calls == [0, 1, 2, 4, 8, 16, 20]
    assert search([], _fake_measure({"absent"}, []), 0.008)[0] is None
    # The budget applies to every split, with float noise forgiven.
    assert Trial([], {"all": 0.008 + 1e-12}).holds(0.008) and not Trial([], {"all": 0.0, "night": 0.0081}).holds(0.008)
    assert Trial([], {"all": None}).holds(0.0)


def test_planner_keeps_the_sensitive_layer_out_until_the_budget_holds(tmp_path, cli):
    model = save(loud_classifier(), tmp_path / "loud.onnx")
    val = manifest_set(tmp_path / "val")
    out = tmp_path / "loud.plan"
    result = cli("build", model, "-o", out, "--device", "cpu", "--precision", "int8", "--preprocess", SPEC,
                 *SHAPE_ARGS, "--calib", val, "--calib-balance-by", "light", "--calib-size", "12", "--data", val,
                 "--split-by", "light", "--accuracy-budget", "0.05", "--classes", ",".join(map(str, range(10))))
    assert result.code == 0, result
    header, _ = read_engine_file(out)
    layers = {layer["name"]: layer for layer in header["layers"]}
    assert layers["conv2"]["precision"] == "fp32" and layers["conv2"]["op"] == "FusedConv"
    reason = layers["conv2"]["reason"]
    assert reason.startswith("planner: sensitivity rank 1, SNR ") and "needed for budget 0.05 (day drop 1.0000 → " \
        in reason, reason
    assert layers["conv1"]["op"] == "QConv" and layers["conv3"]["op"] == "QConv"
    plan = header["planner"]
    assert plan["kept_out"] == ["conv2"] and plan["ranking"][0]["name"] == "conv2" and plan["metric"] == "top-1"
    assert [it["layers_out"] for it in plan["iterations"]] == [0, 1]
    assert [it["holds"] for it in plan["iterations"]] == [False, True]
    assert plan["iterations"][0]["drops"]["day"] == 1.0 and set(plan["drops"]) == {"all", "day", "night"}
    # The engine that was kept measures what the planner measured.
    from sartor.validate.runner import validate
    report = validate(out, val, split_by="light", max_drop=0.05)
    assert report.passed and {s.name: s.drop for s in [report.overall, *report.splits]} == plan["drops"]
    # inspect: the reason per layer and the planner's iterations.
    shown = cli("inspect", out)
    assert shown.code == 0 and "planner: sensitivity rank 1" in shown.out and "INT8 planner: budget 0.05" in shown.out
    assert "kept out of INT8 (1 of 3): conv2" in shown.out
    assert json.loads(cli("inspect", out, "--json").out)["planner"]["kept_out"] == ["conv2"]
    # A budget the default INT8 plan meets moves nothing.
    relaxed = sartor.build(model, tmp_path / "relaxed.plan", device="cpu", profiles=[SHAPES], precision="int8",
                           preprocess=SPEC, calib=val, calib_size=12, data=val, accuracy_budget=1.0)
    assert relaxed.header["planner"]["kept_out"] == [] and len(relaxed.header["planner"]["iterations"]) == 1
    assert {layer["op"] for layer in relaxed.header["layers"] if layer["name"].startswith("conv")} == {"QConv"}


def test_impossible_budget_fails_with_one_line(tmp_path, cli, monkeypatch):
    model = save(loud_classifier(), tmp_path / "loud.onnx")
    val = manifest_set(tmp_path / "val", count=8)
    calls = []

    def never(engine_path, dataset, config):  # a drop no precision can fix
        calls.append(read_engine_file(engine_path)[0]["layers"])
        return Trial([], {"all": 0.5, "day": 0.2, "night": 0.5})
    monkeypatch.setattr(planner, "measure_drops", never)
    out = tmp_path / "never.plan"
    result = cli("build", model, "-o", out, "--device", "cpu", "--precision", "int8", "--preprocess", SPEC,
                 *SHAPE_ARGS, "--calib", val, "--data", val, "--split-by", "light", "--accuracy-budget", "0.008")
    line = assert_cli_error(result, "--accuracy-budget 0.008 cannot be met", "all 3 INT8 layer(s) moved to fp32",
                            "night drop", "0.5000")
    assert not out.exists(), line
    # It measured 0, 1, 2 and then all 3 layers out of INT8; the last engine had no INT8 layer.
    assert [sum(layer["precision"] == "int8" for layer in layers) for layers in calls] == [3, 2, 1, 0]
