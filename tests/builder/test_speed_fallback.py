"""--fallback-where-faster (`sartor/builder/speed_fallback.py`): which INT8 layers move to the
fallback precision, which engine is kept, what the kept engine records, and the refusals."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from conftest import make_model, save
from onnx import TensorProto, helper, numpy_helper

import sartor
from sartor.builder import speed_fallback
from sartor.errors import SartorError

SHAPES = {"min_shapes": {"x": (1, 8, 10, 10)}, "opt_shapes": {"x": (2, 8, 10, 10)}, "max_shapes": {"x": (2, 8, 10, 10)}}


def _model() -> onnx.ModelProto:
    """conv1 3×3 8 → 16, ReLU; conv2 3×3 16 → 16, ReLU; head 1×1 16 → 4."""
    rng = np.random.default_rng(7)
    shapes = {"conv1": (16, 8, 3, 3), "conv2": (16, 16, 3, 3), "head": (4, 16, 1, 1)}
    inits = [numpy_helper.from_array((rng.standard_normal(s) / np.sqrt(np.prod(s[1:]))).astype(np.float32), f"{n}.w")
             for n, s in shapes.items()]
    inits += [numpy_helper.from_array((rng.standard_normal(s[0]) * 0.1).astype(np.float32), f"{n}.b")
              for n, s in shapes.items()]
    nodes = [helper.make_node("Conv", ["x", "conv1.w", "conv1.b"], ["a"], name="conv1", pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["a"], ["ar"], name="relu1"),
             helper.make_node("Conv", ["ar", "conv2.w", "conv2.b"], ["b"], name="conv2", pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["b"], ["br"], name="relu2"),
             helper.make_node("Conv", ["br", "head.w", "head.b"], ["y"], name="head")]
    return make_model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 8, 10, 10])],
                      [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 4, 10, 10])], inits)


@pytest.fixture
def setup(tmp_path):
    model = save(_model(), tmp_path / "model.onnx")
    calib = tmp_path / "calib.npy"
    np.save(calib, np.random.default_rng(8).standard_normal((8, 8, 10, 10)).astype(np.float32))
    return model, calib


def _build(model, calib, output, **options):
    return sartor.build(model, output, device="cpu", precision="int8", calib=str(calib), calib_size=8,
                        builder_effort=1, fallback_where_faster=True, **SHAPES, **options)


def _layers(header: dict) -> dict:
    return {layer["name"]: layer for layer in header["layers"]}


def test_a_layer_moves_only_when_its_fallback_is_faster_by_the_margin():
    def header(times: dict, precision: str) -> dict:
        return {"layers": [{"name": n, "precision": precision if n != "pool" else "fp32",
                            "tactic_timings_ms": {"a": t, "b": t * 1.5}} for n, t in times.items()]}
    quantized = header({"fast": 1.0, "close": 1.0, "slow": 1.0, "pool": 1.0, "gone": 1.0}, "int8")
    fallback = header({"fast": 0.5, "close": 0.95, "slow": 2.0, "pool": 0.1}, "fp16")
    moves = speed_fallback.layers_faster_in_fallback(quantized, fallback)
    assert moves == {"fast": {"quantized_ms": 1.0, "fallback_ms": 0.5}}  # not within the margin, not float, not absent
    assert speed_fallback.layers_faster_in_fallback(quantized, fallback, margin=1.0) == {
        "fast": {"quantized_ms": 1.0, "fallback_ms": 0.5}, "close": {"quantized_ms": 1.0, "fallback_ms": 0.95}}


@pytest.mark.parametrize("fastest", ["int8", "mixed", "fallback"])
def test_the_fastest_engine_end_to_end_is_kept(setup, tmp_path, monkeypatch, fastest, cli):
    """conv2 faster at the fallback precision (made so): the mixed engine pins it there. Of the INT8,
    the all-fallback and the mixed engine the fastest end to end is kept; the kept engine says why
    each layer left INT8, and no temporary file is left."""
    model, calib = setup
    monkeypatch.setattr(speed_fallback, "layers_faster_in_fallback",
                        lambda q, f, margin=0.9: {"conv2": {"quantized_ms": 2.0, "fallback_ms": 1.0}})
    ms = {"int8": 3.0, "fallback": 3.0, "mixed": 3.0} | {fastest: 1.0}
    times = iter([ms["int8"], ms["fallback"], ms["mixed"]])  # the order they are built and timed in
    monkeypatch.setattr(speed_fallback, "end_to_end_ms", lambda path: next(times))
    result = _build(model, calib, tmp_path / "m.plan")
    record = result.header["fallback_where_faster"]
    assert record["candidates"] == {"conv2": {"quantized_ms": 2.0, "fallback_ms": 1.0}}
    assert (record["quantized_ms"], record["fallback_ms"], record["mixed_ms"]) == (ms["int8"], ms["fallback"], ms["mixed"])
    assert record["kept"] == fastest and record["fallback_precision"] == "fp32"
    header = sartor.load(tmp_path / "m.plan").header
    layers = _layers(header)
    precisions = {name: layers[name]["precision"] for name in ("conv1", "conv2")}  # the head stays float
    reasons = {name: layers[name]["reason"] for name in ("conv1", "conv2")}
    if fastest == "int8":
        assert precisions == {"conv1": "int8", "conv2": "int8"}
        assert not any(r.startswith("--fallback-where-faster") for r in reasons.values())
    elif fastest == "mixed":
        assert precisions == {"conv1": "int8", "conv2": "fp32"}
        assert reasons["conv2"].startswith("--fallback-where-faster: fp32 1 ms against int8 2 ms")
        assert not reasons["conv1"].startswith("--fallback-where-faster")
    else:
        assert header["build_config"]["precision"] == "fp32" and set(precisions.values()) == {"fp32"}
        assert reasons["conv1"] == reasons["conv2"] == ("--fallback-where-faster: the all-fp32 engine was faster end "
                                                         "to end (1 ms against int8 3 ms)")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["calib.npy", "m.plan", "model.onnx"]
    shown = cli("inspect", str(tmp_path / "m.plan"))
    assert "Fallback where faster" in shown.out and "fp32 1 ms against 2 ms" in shown.out
    assert "every layer at fp32" in shown.out
    assert f"--fallback-where-faster: 1 layer(s) faster at fp32; kept the {fastest} engine" in shown.out
    x = np.random.default_rng(9).standard_normal((2, 8, 10, 10)).astype(np.float32)
    assert np.isfinite(sartor.load(tmp_path / "m.plan").context().run({"x": x})["y"]).all()


def test_nothing_faster_means_two_builds_and_the_int8_engine(setup, tmp_path, monkeypatch):
    model, calib = setup
    monkeypatch.setattr(speed_fallback, "layers_faster_in_fallback", lambda q, f, margin=0.9: {})
    monkeypatch.setattr(speed_fallback, "end_to_end_ms", lambda path: 1.0)  # a tie keeps the INT8 engine
    from sartor.builder import pipeline
    builds = []
    real = pipeline.build
    monkeypatch.setattr(pipeline, "build", lambda config, *a, **k: builds.append(config.precision) or real(config, *a, **k))
    result = _build(model, calib, tmp_path / "m.plan")
    assert result.header["fallback_where_faster"]["kept"] == "int8"
    assert "mixed_ms" not in result.header["fallback_where_faster"]
    assert result.header["fallback_where_faster"]["fallback_ms"] == 1.0
    assert builds == ["int8", "fp32"]
    assert any(line.startswith("--fallback-where-faster: 0 layer(s)") for line in result.log)


def test_real_timings_decide_on_the_cpu(setup, tmp_path):
    """Unforced: whatever the timings say, the record is consistent with the engine kept."""
    model, calib = setup
    result = _build(model, calib, tmp_path / "m.plan", calib_cache=str(tmp_path / "c.json"))
    record = result.header["fallback_where_faster"]
    layers = _layers(result.header)
    assert set(record["candidates"]) <= {name for name, layer in layers.items() if layer["op"] in ("QConv", "FusedConv")}
    moved = {name for name, layer in layers.items() if layer["reason"].startswith("--fallback-where-faster")}
    timed = {"int8": record["quantized_ms"], "fallback": record["fallback_ms"], "mixed": record.get("mixed_ms")}
    assert timed[record["kept"]] == min(t for t in timed.values() if t is not None)
    if record["kept"] == "mixed":
        assert moved == set(record["candidates"])
    elif record["kept"] == "fallback":
        assert moved == {name for name, layer in layers.items() if layer["reason"].startswith("--fallback")} and moved
        assert result.header["build_config"]["precision"] == "fp32"
    else:
        assert not moved
    assert (tmp_path / "c.json").is_file()  # the user's calibration cache is the one the builds shared


@pytest.mark.parametrize("options,message", [
    ({"precision": "fp16"}, "needs --precision int8 or fp8, not fp16"),
    ({"builder_effort": 0}, "needs --builder-effort 1 or more"),
    ({"output": "missing/m.plan"}, "missing"),
])
def test_refusals(setup, tmp_path, options, message):
    model, calib = setup
    kwargs = dict(device="cpu", precision="int8", calib=str(calib), calib_size=8, builder_effort=1,
                  fallback_where_faster=True, **SHAPES)
    kwargs.update(options)
    output = tmp_path / kwargs.pop("output", "m.plan")
    with pytest.raises(SartorError, match=message) as raised:
        sartor.build(model, output, **kwargs)
    assert "\n" not in str(raised.value)  # one line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["calib.npy", "model.onnx"]


def test_the_cli_flag_reaches_the_config():
    from sartor.cli.build import config_from_args
    from sartor.cli.main import make_parser
    args = make_parser().parse_args(["build", "m.onnx", "-o", "m.plan", "--precision", "int8",
                                     "--fallback-where-faster"])
    assert config_from_args(args).fallback_where_faster
    args = make_parser().parse_args(["build", "m.onnx", "-o", "m.plan"])
    assert not config_from_args(args).fallback_where_faster


def test_the_fallback_build_drops_what_only_quantized_layers_take(tmp_path):
    """Calibration and the planner go with quantized layers: the all-fallback build, which has
    none, drops them and is a valid configuration. --pdl stays where the fallback's convolutions
    take part (FP16) and goes where none can (FP32, which would refuse it)."""
    from sartor.builder.config import BuildConfig
    # As build_with_fallback_where_faster passes it on (the flag itself cleared).
    config = BuildConfig(model_path="m.onnx", output_path=str(tmp_path / "m.plan"), precision="int8", calib="c.npy",
                         pdl=True, builder_effort=1, time_every_layer=True)
    fallback = speed_fallback._fallback_config(config, "fp16", tmp_path / "f.plan")
    assert (fallback.precision, fallback.pdl, fallback.calib) == ("fp16", True, None)
    fallback.validate()
    fp32 = speed_fallback._fallback_config(config, "fp32", tmp_path / "g.plan")
    assert fp32.pdl is None
    fp32.validate()
    with pytest.raises(SartorError, match="--pdl launches"):
        speed_fallback.replace(fp32, pdl=True).validate()
