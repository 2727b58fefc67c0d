"""Empirical bias correction of INT8/FP8 layers (sartor/quant/bias_correction.py): it fires and
removes the per-channel mean error on held-out data (conv, depthwise, gemm; INT8 and FP8), it
measures before the fused activation, it is off with --no-bias-correction and on Q/DQ models, and
the calibration cache reproduces the corrected engine bit for bit. A cache that lacks corrections,
holds other data's, or holds malformed ones is refused in one line."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from conftest import IMAGE, assert_cli_error, initializer_makers, make_model, save, shape_flag
from onnx import TensorProto, helper

import sartor
from sartor.errors import ConfigError
from sartor.quant import read_cache
from sartor.runtime.engine_file import read_engine_file

CHANNELS = 16
SHAPES = {"min": {"images": (1, 3, IMAGE, IMAGE)}, "opt": {"images": (8, 3, IMAGE, IMAGE)},
          "max": {"images": (8, 3, IMAGE, IMAGE)}}
SHAPE_ARGS = ("--min-shapes", shape_flag(SHAPES["min"]), "--opt-shapes", shape_flag(SHAPES["opt"]),
              "--max-shapes", shape_flag(SHAPES["max"]))


def positive_images(seed: int, count: int) -> np.ndarray:
    """|N(0,1)| + 0.5 images: inputs with a non-zero mean (as after a ReLU), so that rounding the
    weights of a channel shifts its output mean (with zero-mean inputs it does not)."""
    rng = np.random.default_rng(seed)
    return (np.abs(rng.standard_normal((count, 3, IMAGE, IMAGE))) + 0.5).astype(np.float32)


def layer_model(kind: str, relu: bool = False, seed: int = 0) -> onnx.ModelProto:
    """One quantizable layer after a fixed float stem (conv 3→16, so the layer reads 16 channels):
    "conv" (3×3), "depthwise" (3×3, group 16) or "gemm" (over the flattened stem output), its own
    output being the graph output (optionally after a ReLU the builder fuses)."""
    w, b = initializer_makers(np.random.default_rng(seed))
    inits = [w("stem.w", CHANNELS, 3, 1, 1), b("stem.b", CHANNELS)]
    n = helper.make_node
    nodes = [n("Conv", ["images", "stem.w", "stem.b"], ["s0"], name="stem"), n("Relu", ["s0"], ["s"], name="stem_relu")]
    if kind == "conv":
        inits += [w("l.w", CHANNELS, CHANNELS, 3, 3), b("l.b", CHANNELS)]
        nodes.append(n("Conv", ["s", "l.w", "l.b"], ["y0"], name="layer", pads=[1, 1, 1, 1]))
        shape = ["batch", CHANNELS, IMAGE, IMAGE]
    elif kind == "depthwise":
        inits += [w("l.w", CHANNELS, 1, 3, 3), b("l.b", CHANNELS)]
        nodes.append(n("Conv", ["s", "l.w", "l.b"], ["y0"], name="layer", pads=[1, 1, 1, 1], group=CHANNELS))
        shape = ["batch", CHANNELS, IMAGE, IMAGE]
    else:
        inits += [w("l.w", CHANNELS, CHANNELS * IMAGE * IMAGE), b("l.b", CHANNELS)]
        nodes += [n("Flatten", ["s"], ["f"], name="flatten", axis=1),
                  n("Gemm", ["f", "l.w", "l.b"], ["y0"], name="layer", transB=1)]
        shape = ["batch", CHANNELS]
    if relu:
        nodes.append(n("Relu", ["y0"], ["y"], name="relu"))
    else:
        nodes.append(n("Identity", ["y0"], ["y"], name="out"))
    model = make_model(nodes, [helper.make_tensor_value_info("images", TensorProto.FLOAT, ["batch", 3, IMAGE, IMAGE])],
                       [helper.make_tensor_value_info("y", TensorProto.FLOAT, shape)], inits, name=f"bc_{kind}")
    onnx.checker.check_model(model)
    return model


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("bias_correction")


@pytest.fixture(scope="module")
def calib_npy(work) -> Path:
    path = work / "calib.npy"
    np.save(path, positive_images(1, 64))
    return path


def _build(model: Path, out: Path, **kwargs):
    """A CPU build with bias correction on unless `bias_correction=False` (whatever the default)."""
    kwargs.setdefault("bias_correction", True)
    return sartor.build(model, out, device="cpu", profiles=[SHAPES], builder_effort=0, **kwargs)


def _quantized(model: Path, out: Path, calib: Path, precision: str = "int8", **kwargs):
    """Only `layer` quantized (the stem stays FP32): its own error is what is measured."""
    return _build(model, out, precision=precision, calib=calib, layer_precision={"layer": precision, "stem": "fp32"},
                  **kwargs)


def _run(plan: Path, images: np.ndarray) -> np.ndarray:
    context = sartor.load(plan, device="cpu").context()
    return np.concatenate([context.run({"images": images[k:k + 8]})["y"] for k in range(0, len(images), 8)])


def channel_mean_error(plan: Path, fp32_plan: Path, images: np.ndarray) -> np.ndarray:
    """|mean over batch and positions of (engine - FP32)| per output channel."""
    got, ref = _run(plan, images).astype(np.float64), _run(fp32_plan, images).astype(np.float64)
    diff = np.moveaxis(got - ref, 1, 0).reshape(got.shape[1], -1)
    return np.abs(diff.mean(axis=1))


def _layer_bias(plan: Path) -> np.ndarray | None:
    header, tensors = read_engine_file(plan)
    node = next(n for n in header["graph"]["nodes"] if n["name"] == "layer")
    return None if not node["inputs"][2] else tensors["w/" + node["inputs"][2]].float().numpy()


@pytest.mark.parametrize("precision,kind", [("int8", "conv"), ("int8", "depthwise"), ("int8", "gemm"),
                                            ("fp8", "conv"), ("fp8", "depthwise")])
def test_it_fires_and_removes_the_channel_mean_error_on_held_out_data(work, calib_npy, precision, kind):
    model = save(layer_model(kind), work / f"{kind}.onnx")
    fp32 = work / f"{kind}_fp32.plan"
    _build(model, fp32)
    off, on = work / f"{kind}_{precision}_off.plan", work / f"{kind}_{precision}_on.plan"
    result_off = _quantized(model, off, calib_npy, precision, bias_correction=False)
    result_on = _quantized(model, on, calib_npy, precision)
    assert any("bias correction: off" in line for line in result_off.log)
    line = next(line for line in result_on.log if line.startswith("bias correction: 1 layer(s) corrected"))
    assert f"1 {precision.upper()}" in line and "output RMS (layer)" in line
    record = result_on.header["provenance"]["calibration"]["bias_correction"]
    assert record["layers"] == 1 and record["largest_layer"] == "layer" and record["largest_relative"] > 0
    assert not np.array_equal(_layer_bias(off), _layer_bias(on))  # the bias changed
    held_out = positive_images(2, 64)
    before, after = channel_mean_error(off, fp32, held_out), channel_mean_error(on, fp32, held_out)
    assert after.mean() < 0.5 * before.mean(), (before.mean(), after.mean())


def test_the_correction_is_measured_before_the_fused_activation(work, calib_npy):
    """conv and conv → ReLU (fused into the QConv) with the same weights get the same corrected
    bias: the correction is of the pre-activation output (measuring after the ReLU would see
    clipped negatives and differ)."""
    plain, fused = save(layer_model("conv"), work / "plain.onnx"), save(layer_model("conv", relu=True), work / "relu.onnx")
    # One threshold method for both: auto may choose another input threshold for each model (their
    # outputs differ), and with it another input scale and bias.
    _quantized(plain, work / "plain_on.plan", calib_npy, calib_method="mse")
    result = _quantized(fused, work / "relu_on.plan", calib_npy, calib_method="mse")
    _quantized(fused, work / "relu_off.plan", calib_npy, bias_correction=False, calib_method="mse")
    layer = next(layer for layer in result.header["layers"] if layer["name"] == "layer")
    assert layer["op"] == "QConv" and layer["attrs"]["activation"] == "Relu"
    assert np.array_equal(_layer_bias(work / "plain_on.plan"), _layer_bias(work / "relu_on.plan"))
    assert not np.array_equal(_layer_bias(work / "relu_off.plan"), _layer_bias(work / "relu_on.plan"))


def test_a_qdq_model_is_left_alone(work, calib_npy):
    from test_qdq import qdq_conv_model
    model = save(qdq_conv_model(), work / "qdq.onnx")
    shapes = {k: {"images": (2, 3, 8, 8)} for k in ("min", "opt", "max")}
    np.save(work / "qdq_calib.npy", positive_images(3, 8)[:, :, :8, :8])
    results = [sartor.build(model, work / f"qdq_{on}.plan", device="cpu", profiles=[shapes], precision="int8",
                            calib=work / "qdq_calib.npy", bias_correction=on, builder_effort=0) for on in (False, True)]
    assert any("bias correction: not applied: the model is quantized with Q/DQ nodes" in line for line in results[1].log)
    assert not any("layer(s) corrected" in line for line in results[1].log)
    tensors = [read_engine_file(work / f"qdq_{on}.plan")[1] for on in (False, True)]
    assert tensors[0].keys() == tensors[1].keys()
    assert all(torch.equal(tensors[0][k], tensors[1][k]) for k in tensors[0])


@pytest.mark.parametrize("precision", ["int8", "fp8"])
def test_the_cache_round_trip_gives_identical_engines(work, calib_npy, tmp_path, cli, precision):
    model = save(layer_model("depthwise"), tmp_path / "m.onnx")
    cache = tmp_path / "calib.json"
    flags = ("--device", "cpu", *SHAPE_ARGS, "--builder-effort", "0", "--precision", precision, "--bias-correction",
             "--layer-precision", f"layer={precision}", "--layer-precision", "stem=fp32")
    first = cli("build", model, "-o", tmp_path / "a.plan", *flags, "--calib", calib_npy, "--calib-cache", cache)
    assert first.code == 0, first
    stored = json.loads(cache.read_text())["bias_correction"][precision]["layer"]
    assert len(stored["correction_hex"]) == CHANNELS and "input_scale_hex" in stored
    assert read_cache(cache).bias_correction  # the reader keeps them
    # The cache alone (no --calib): the corrections are read, the engine is the same bit for bit.
    second = cli("build", model, "-o", tmp_path / "b.plan", *flags, "--calib-cache", cache)
    assert second.code == 0, second
    header_a, tensors_a = read_engine_file(tmp_path / "a.plan")
    header_b, tensors_b = read_engine_file(tmp_path / "b.plan")
    assert tensors_a.keys() == tensors_b.keys()
    assert all(torch.equal(tensors_a[k], tensors_b[k]) for k in tensors_a)
    assert header_b["provenance"]["calibration"]["bias_correction"]["source"].startswith("read from cache")
    assert not np.array_equal(_layer_bias(tmp_path / "a.plan"),
                              _layer_bias(_quantized(model, tmp_path / "c.plan", calib_npy, precision,
                                                     bias_correction=False).path))


def test_a_cache_without_corrections_and_no_calib_is_refused(work, calib_npy, tmp_path, cli):
    model = save(layer_model("conv"), tmp_path / "m.onnx")
    cache = tmp_path / "calib.json"
    _quantized(model, tmp_path / "a.plan", calib_npy, calib_cache=cache, bias_correction=False)
    assert "bias_correction" not in json.loads(cache.read_text())
    with pytest.raises(ConfigError, match="holds no correction for 2 quantized layer"):
        _build(model, tmp_path / "b.plan", precision="int8", calib_cache=cache, layer_precision={"layer": "int8"})
    assert_cli_error(cli("build", model, "-o", tmp_path / "b.plan", "--device", "cpu", *SHAPE_ARGS, "--precision",
                         "int8", "--layer-precision", "layer=int8", "--calib-cache", cache, "--bias-correction"),
                     "--no-bias-correction")
    # With other data than the cache was made from, the corrections would sit under its name: refused.
    other = tmp_path / "other.npy"
    np.save(other, positive_images(7, 64))
    with pytest.raises(ConfigError, match="is not the data calibration cache .* was made from"):
        _quantized(model, tmp_path / "c.plan", other, calib_cache=cache)
    assert "bias_correction" not in json.loads(cache.read_text())
    # With the cache's own --calib the missing corrections are measured and added to the cache.
    _quantized(model, tmp_path / "c.plan", calib_npy, calib_cache=cache)
    assert "layer" in json.loads(cache.read_text())["bias_correction"]["int8"]


def test_the_cli_flag_and_the_default(tmp_path, cli):
    from sartor.builder import BuildConfig
    from sartor.cli.build import config_from_args
    from sartor.cli.main import make_parser
    parser = make_parser()
    args = parser.parse_args(["build", "m.onnx", "-o", "m.plan"])
    assert config_from_args(args).bias_correction is BuildConfig.bias_correction
    args = parser.parse_args(["build", "m.onnx", "-o", "m.plan", "--no-bias-correction"])
    assert config_from_args(args).bias_correction is False
    args = parser.parse_args(["build", "m.onnx", "-o", "m.plan", "--bias-correction"])
    assert config_from_args(args).bias_correction is True


def test_a_cache_without_a_layers_correction_needs_calib(work, calib_npy, tmp_path):
    """A cache written with the stem in FP32 holds no correction for an INT8 stem: a build without
    --calib is refused in one line, one with it measures again. The layer's own correction does not
    depend on the stem's precision (each layer is measured on the float model's input to it)."""
    model = save(layer_model("conv"), tmp_path / "m.onnx")
    cache = tmp_path / "calib.json"
    _quantized(model, tmp_path / "a.plan", calib_npy, calib_cache=cache)  # stem FP32
    with pytest.raises(ConfigError, match="holds no correction for 1 quantized layer.*first: stem"):
        _build(model, tmp_path / "c.plan", precision="int8", calib_cache=cache, layer_precision={"layer": "int8"})
    result = _build(model, tmp_path / "c.plan", precision="int8", calib=calib_npy, calib_cache=cache,
                    layer_precision={"layer": "int8"})
    assert any("2 layer(s) corrected (2 INT8; measured on 64 samples" in line for line in result.log)
    assert np.array_equal(_layer_bias(tmp_path / "a.plan"), _layer_bias(tmp_path / "c.plan"))


def _not_a_map(data: dict) -> None:
    data["bias_correction"] = [1]


def _no_values(data: dict) -> None:
    entry = data["bias_correction"]["int8"]["layer"]
    del entry["correction_hex"], entry["correction"]


def _values_disagree(data: dict) -> None:
    data["bias_correction"]["int8"]["layer"]["correction"][0] = 12.5


@pytest.mark.parametrize("tamper,fragment", [(_not_a_map, '"bias_correction" must map format'),
                                             (_no_values, 'malformed "bias_correction"'),
                                             (_values_disagree, '"correction" and "correction_hex" differ')])
def test_a_malformed_correction_in_the_cache_is_one_line(work, calib_npy, tmp_path, cli, tamper, fragment):
    model = save(layer_model("conv"), tmp_path / "m.onnx")
    cache = tmp_path / "calib.json"
    _quantized(model, tmp_path / "a.plan", calib_npy, calib_cache=cache)
    data = json.loads(cache.read_text())
    tamper(data)
    cache.write_text(json.dumps(data))
    assert_cli_error(cli("build", model, "-o", tmp_path / "b.plan", "--device", "cpu", *SHAPE_ARGS, "--precision",
                         "int8", "--layer-precision", "layer=int8", "--layer-precision", "stem=fp32",
                         "--calib-cache", cache, "--bias-correction"), fragment)
