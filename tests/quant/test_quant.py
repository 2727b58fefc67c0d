"""INT8: observers and threshold methods, exact integer accumulation, INT8 builds against FP32,
the calibration cache, and the refusals."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
import torch.nn.functional as F
from conftest import (
    IMAGE,
    assert_cli_error,
    classifier_model,
    cosine,
    first_output_on_cpu,
    gaussian_images,
    initializer_makers,
    make_model,
    save,
    shape_flag,
)
from onnx import TensorProto, helper, numpy_helper

import sartor
from sartor.errors import ConfigError, SartorError
from sartor.ops.quantized import int8_conv_accumulate, int8_matmul_accumulate, quantize
from sartor.quant import (
    CalibrationCache,
    StaleCalibrationCacheError,
    calibrate,
    compute_amax,
    read_cache,
    write_cache,
)
from sartor.quant.calibrators import METHODS, entropy_amax, mse_errors, percentile_amax
from sartor.quant.observers import DEFAULT_BINS, HistogramObserver, histogram_of
from sartor.quant.quantize import activation_scale, quantize_weight
from sartor.runtime.engine_file import read_engine_file

SHAPES = {"min": {"images": (1, 3, IMAGE, IMAGE)}, "opt": {"images": (2, 3, IMAGE, IMAGE)},
          "max": {"images": (8, 3, IMAGE, IMAGE)}}
SHAPE_ARGS = ("--min-shapes", shape_flag(SHAPES["min"]), "--opt-shapes", shape_flag(SHAPES["opt"]),
              "--max-shapes", shape_flag(SHAPES["max"]))



# ---- observers -------------------------------------------------------------------------------------

def test_histogram_regrowth_is_an_exact_merge():
    """Batches with growing maxima give the same counts as one pass binned over the final range."""
    rng = np.random.default_rng(0)
    chunks = [rng.standard_normal(10_000).astype(np.float32) * s for s in (0.1, 1.0, 0.5, 7.0, 3.0)]
    observer = HistogramObserver()
    for chunk in chunks:
        observer.update(torch.from_numpy(chunk))
    everything = np.abs(np.concatenate(chunks))
    assert observer.amax == float(everything.max())
    assert observer.count == everything.size and observer.counts.sum() == everything.size
    assert observer.range > observer.amax >= observer.range / 2  # the data fills over half of the bins
    index = np.minimum(np.floor(everything * np.float32(DEFAULT_BINS / observer.range)), DEFAULT_BINS - 1)
    assert np.array_equal(observer.counts, np.bincount(index.astype(np.int64), minlength=DEFAULT_BINS))


def test_observer_ignores_nonfinite_and_handles_zeros():
    observer = HistogramObserver()
    observer.update(torch.zeros(100))
    assert observer.range == 0.0 and observer.counts[0] == 100
    observer.update(torch.tensor([1.0, float("nan"), float("inf"), -2.0]))
    assert observer.nonfinite == 2 and observer.amax == 2.0 and observer.counts.sum() == 102
    assert observer.counts[0] == 100


# ---- threshold methods -------------------------------------------------------------------------------

def test_minmax_is_the_exact_max():
    x = np.random.default_rng(1).laplace(size=50_000).astype(np.float32)
    assert compute_amax(histogram_of(x, batches=5), "minmax") == float(np.abs(x).max())


@pytest.mark.parametrize("percentile", [99.0, 99.9, 99.99])
def test_percentile_matches_numpy_within_a_bin(percentile):
    x = np.random.default_rng(2).standard_normal(200_000).astype(np.float32)
    observer = histogram_of(x, batches=4)
    got = percentile_amax(observer, percentile)
    assert abs(got - np.percentile(np.abs(x), percentile)) <= observer.bin_width


def test_entropy_clips_long_tails_and_keeps_uniform_whole():
    rng = np.random.default_rng(3)
    tailed = histogram_of(rng.lognormal(size=200_000).astype(np.float32), batches=3)
    assert entropy_amax(tailed) < 0.5 * tailed.amax
    uniform = histogram_of(rng.random(200_000).astype(np.float32), batches=3)
    assert entropy_amax(uniform) >= 0.99 * uniform.amax
    # ReLU outputs: half exact zeros must not drag the threshold down (zero bin levelled).
    relu = histogram_of(np.maximum(rng.standard_normal(200_000), 0).astype(np.float32))
    assert entropy_amax(relu) > 0.6 * relu.amax


def test_mse_threshold_minimises_the_real_quantization_error():
    x = np.random.default_rng(4).laplace(size=200_000).astype(np.float32)
    observer = histogram_of(x, batches=2)
    best = compute_amax(observer, "mse")

    def real_mse(t):
        s = t / 127
        return float(np.mean((x - np.clip(np.round(x / s), -127, 127) * s) ** 2))
    assert real_mse(best) < real_mse(0.85 * best) and real_mse(best) < real_mse(1.15 * best)
    assert real_mse(best) < real_mse(observer.amax)
    # The histogram's expected error tracks the measured one.
    i = round(best / observer.bin_width)
    assert mse_errors(observer, np.array([i]))[0] / x.size == pytest.approx(real_mse(best), rel=0.05)


def test_every_method_on_a_degenerate_tensor():
    observer = HistogramObserver()
    observer.update(torch.zeros(10))
    for method in METHODS:
        assert compute_amax(observer, method) == 0.0
    assert activation_scale(0.0)[0] > 0


# ---- INT8 arithmetic ---------------------------------------------------------------------------------

def test_quantize_rounds_half_to_even_and_saturates():
    x = torch.tensor([0.5, 1.5, 2.5, -0.5, -1.5, 126.5, 127.5, 300.0, -300.0])
    assert quantize(x, 1.0).tolist() == [0, 2, 2, 0, -2, 126, 127, 127, -127]
    assert quantize(x, 1.0).dtype == torch.int8


def test_weight_quantization_is_per_output_channel():
    w = np.stack([np.linspace(-1, 1, 9), np.linspace(-0.01, 0.02, 9), np.zeros(9)]).reshape(3, 1, 3, 3)
    q, scale = quantize_weight(w)
    assert q.dtype == np.int8 and scale.dtype == np.float32
    assert np.abs(q.reshape(3, -1)).max(axis=1).tolist() == [127, 127, 0]
    assert scale[2] == 1.0 and scale[1] == np.float32(0.02 / 127)
    assert np.abs(q * scale[:, None, None, None] - w).max() <= scale.max() / 2 + 1e-9


def _conv_int64_reference(x, w, stride, pads, dilation, groups):
    """Direct int64 convolution (2-D): sum over kernel offsets of shifted slices × weights."""
    x = F.pad(x.to(torch.int64), (pads[1], pads[3], pads[0], pads[2]))
    n, _, h, wd = x.shape
    m, cg, kh, kw = w.shape
    oh = (h - dilation * (kh - 1) - 1) // stride + 1
    ow = (wd - dilation * (kw - 1) - 1) // stride + 1
    out = torch.zeros(n, m, oh, ow, dtype=torch.int64)
    w = w.to(torch.int64)
    mg = m // groups
    for i in range(kh):
        for j in range(kw):
            patch = x[:, :, i * dilation: i * dilation + (oh - 1) * stride + 1: stride,
                      j * dilation: j * dilation + (ow - 1) * stride + 1: stride]
            for g in range(groups):
                out[:, g * mg:(g + 1) * mg] += torch.einsum(
                    "nchw,oc->nohw", patch[:, g * cg:(g + 1) * cg], w[g * mg:(g + 1) * mg, :, i, j])
    return out


@pytest.mark.parametrize("groups,stride,dilation,pads", [(1, 1, 1, [1, 1, 1, 1]), (2, 2, 1, [0, 1, 2, 1]),
                                                        (8, 1, 2, [2, 2, 2, 2]), (1, 2, 2, [0, 1, 2, 1]),
                                                        (1, 1, 1, [0, 0, 0, 0])])
@pytest.mark.parametrize("channels_last", [False, True])
def test_integer_accumulation_is_exact(groups, stride, dilation, pads, channels_last):
    """int32 from the CPU's integer GEMM for dense convolutions (im2col, or rows for 1×1), float32
    for depthwise ones (every partial sum an integer below 2^24), float64 for other grouped ones;
    exact in every case, in the input's memory format."""
    g = torch.Generator().manual_seed(5)
    x = torch.randint(-127, 128, (2, 8, 9, 11), generator=g, dtype=torch.int8)
    kernel = 1 if pads == [0, 0, 0, 0] else 3
    w = torch.randint(-127, 128, (16, 8 // groups, kernel, kernel), generator=g, dtype=torch.int8)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    attrs = {"strides": [stride, stride], "dilations": [dilation, dilation], "pads": pads, "group": groups}
    got = int8_conv_accumulate(x, w, attrs)
    assert got.dtype == {1: torch.int32, 8: torch.float32}.get(groups, torch.float64)
    assert got.is_contiguous(memory_format=torch.channels_last if channels_last else torch.contiguous_format)
    assert torch.equal(got.to(torch.int64), _conv_int64_reference(x, w, stride, pads, dilation, groups))


def test_worst_case_accumulators_stay_exact():
    """All ±127 over 512 × 3 × 3 products: -74.3 M, beyond float32's exact integers."""
    x = torch.full((1, 512, 3, 3), 127, dtype=torch.int8)
    w = torch.full((4, 512, 3, 3), -127, dtype=torch.int8)
    w[1] = 127
    w[2, ::2] = 1
    got = int8_conv_accumulate(x, w, {}).to(torch.int64).reshape(-1)
    reference = (x.to(torch.int64).reshape(1, -1) * w.to(torch.int64).reshape(4, -1)).sum(1)
    assert torch.equal(got, reference) and abs(int(reference[0])) > 2 ** 24
    a = torch.randint(-127, 128, (5, 7, 4608), generator=torch.Generator().manual_seed(6), dtype=torch.int8)
    b = torch.randint(-127, 128, (33, 4608), generator=torch.Generator().manual_seed(7), dtype=torch.int8)
    assert torch.equal(int8_matmul_accumulate(a, b).to(torch.int64), a.to(torch.int64) @ b.to(torch.int64).t())


# ---- INT8 builds ----------------------------------------------------------------------------------------

def deeper_model(seed: int = 0) -> onnx.ModelProto:
    """conv → relu → conv s2 → relu → depthwise conv + add → pool → flatten → gemm (alpha, transB=0)
    → relu → matmul: every INT8 layer kind, the residual, and int8 passed between layers."""
    w, b = initializer_makers(np.random.default_rng(seed))
    inits = [w("c1.w", 16, 3, 3, 3), b("c1.b", 16), w("c2.w", 16, 16, 3, 3), b("c2.b", 16),
             w("dw.w", 16, 1, 3, 3), b("dw.b", 16), w("fc.w", 16, 32), b("fc.b", 32), w("mm.w", 32, 10)]
    nodes = [
        helper.make_node("Conv", ["images", "c1.w", "c1.b"], ["c1"], name="conv1", pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c1"], ["r1"], name="relu1"),
        helper.make_node("Conv", ["r1", "c2.w", "c2.b"], ["c2"], name="conv2", pads=[1, 1, 1, 1], strides=[2, 2]),
        helper.make_node("Relu", ["c2"], ["r2"], name="relu2"),
        helper.make_node("Conv", ["r2", "dw.w", "dw.b"], ["d"], name="dw", pads=[1, 1, 1, 1], group=16),
        helper.make_node("Add", ["d", "r2"], ["s"], name="add"),
        helper.make_node("GlobalAveragePool", ["s"], ["p"], name="pool"),
        helper.make_node("Flatten", ["p"], ["f"], name="flatten", axis=1),
        helper.make_node("Gemm", ["f", "fc.w", "fc.b"], ["g"], name="fc", alpha=0.5),
        helper.make_node("Relu", ["g"], ["gr"], name="relu3"),
        helper.make_node("MatMul", ["gr", "mm.w"], ["logits"], name="mm"),
    ]
    model = make_model(nodes, [helper.make_tensor_value_info("images", TensorProto.FLOAT, ["batch", 3, IMAGE, IMAGE])],
                       [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", 10])], inits, name="deeper")
    onnx.checker.check_model(model)
    return model


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("quant")


@pytest.fixture(scope="module")
def calib_npy(work) -> Path:
    path = work / "calib.npy"
    np.save(path, gaussian_images(10, 48))
    return path


@pytest.fixture(scope="module")
def test_images() -> np.ndarray:
    return gaussian_images(11, 8)



def _build(model: Path, out: Path, **kwargs):
    return sartor.build(model, out, device="cpu", profiles=[SHAPES], **kwargs)


@pytest.mark.parametrize("method", METHODS)
def test_int8_build_tracks_fp32(work, calib_npy, test_images, method):
    model = save(deeper_model(), work / f"deeper_{method}.onnx")
    _build(model, work / "deeper_fp32.plan")
    result = _build(model, work / f"deeper_{method}.plan", precision="int8", calib=calib_npy, calib_method=method,
                    layer_precision={"mm": "int8"})
    layers = {layer["name"]: layer for layer in result.header["layers"]}
    assert {name: (layer["op"], layer["precision"]) for name, layer in layers.items() if layer["precision"] == "int8"} \
        == {"conv1": ("QConv", "int8"), "conv2": ("QConv", "int8"), "dw": ("QConv", "int8"),
            "fc": ("QGemm", "int8"), "mm": ("QGemm", "int8")}
    assert {layers[n]["precision"] for n in ("pool", "flatten")} == {"fp32"}
    # INT8 passes between INT8 layers: conv1 → conv2 → dw (as its input and its residual).
    assert layers["conv1"]["attrs"]["output_scale"] and layers["conv2"]["attrs"]["output_scale"]
    assert layers["dw"]["attrs"]["residual_scale"] == layers["conv2"]["attrs"]["output_scale"]
    assert layers["dw"]["attrs"]["output_scale"] is None  # read by the FP32 pool
    fp32, int8 = first_output_on_cpu(work / "deeper_fp32.plan", test_images), first_output_on_cpu(work / f"deeper_{method}.plan", test_images)
    assert cosine(fp32, int8) >= 0.99, method


def test_int8_tiny_classifier_and_what_the_engine_stores(work, calib_npy, test_images):
    model = save(classifier_model(), work / "tiny.onnx")
    _build(model, work / "tiny_fp32.plan")
    result = _build(model, work / "tiny_int8.plan", precision="int8", calib=calib_npy, calib_size=40,
                    calib_method="auto")
    assert cosine(first_output_on_cpu(work / "tiny_fp32.plan", test_images), first_output_on_cpu(work / "tiny_int8.plan", test_images)) >= 0.99
    header, tensors = read_engine_file(work / "tiny_int8.plan")
    assert tensors["w/conv1.w_int8"].dtype == torch.int8 and tensors["w/conv2.b_int32"].dtype == torch.int32
    assert not any(k.startswith("w/conv1.w") and t.dtype == torch.float32 for k, t in tensors.items()
                   if k != "w/conv1.w_int8")
    calibration = header["provenance"]["calibration"]
    samples = np.load(calib_npy)[:40]
    assert calibration["calib_size"] == 40 and calibration["method"] == "auto" and not calibration["from_cache"]
    assert set(calibration["methods"].values()) <= set(METHODS) and calibration["auto"]["held_out_samples"] == 8
    assert len(calibration["calib_sha256"]) == 64
    # The fc layer is the output head: FP32 by default, with the reason in the build log.
    layers = {layer["name"]: layer for layer in header["layers"]}
    assert layers["fc"]["precision"] == "fp32" and "output head" in layers["fc"]["reason"]
    assert any("calibration: 40 samples" in line for line in result.log)
    # The same samples from a .npz give the same calibration digest.
    np.savez(work / "calib.npz", images=samples)
    again = _build(model, work / "tiny_npz.plan", precision="int8", calib=work / "calib.npz")
    assert again.header["provenance"]["calibration"]["calib_sha256"] == calibration["calib_sha256"]


def test_a_shape_reader_does_not_make_an_output_head(work, calib_npy, test_images):
    """Ultralytics' dynamic export sizes the anchor grid from Shape of the neck's feature maps: the
    convs that write them reach the output through Shape alone, which carries no values, so they
    are not output heads and run INT8."""
    rng = np.random.default_rng(3)
    inits = [numpy_helper.from_array((rng.standard_normal(s) / np.sqrt(np.prod(s[1:]))).astype(np.float32), n)
             for n, s in (("c1.w", (8, 3, 3, 3)), ("c2.w", (4, 8, 3, 3)))]
    inits.append(numpy_helper.from_array(np.array(0, np.int64), "zero"))
    nodes = [
        helper.make_node("Conv", ["images", "c1.w"], ["c1"], name="neck", pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c1"], ["r1"], name="relu"),
        helper.make_node("Conv", ["r1", "c2.w"], ["c2"], name="head", pads=[1, 1, 1, 1]),
        helper.make_node("Shape", ["r1"], ["shape"], name="shape"),
        helper.make_node("Gather", ["shape", "zero"], ["batch"], name="gather", axis=0),
        helper.make_node("Cast", ["batch"], ["batch_f"], name="cast", to=TensorProto.FLOAT),
        helper.make_node("Add", ["c2", "batch_f"], ["out"], name="add"),
    ]
    model = make_model(nodes, [helper.make_tensor_value_info("images", TensorProto.FLOAT, ["batch", 3, IMAGE, IMAGE])],
                       [helper.make_tensor_value_info("out", TensorProto.FLOAT, ["batch", 4, IMAGE, IMAGE])], inits,
                       name="shape_reader")
    onnx.checker.check_model(model)
    path = save(model, work / "shape_reader.onnx")
    _build(path, work / "shape_reader_fp32.plan")
    result = _build(path, work / "shape_reader_int8.plan", precision="int8", calib=calib_npy)
    layers = {layer["name"]: layer for layer in result.header["layers"]}
    assert layers["neck"]["precision"] == "int8", layers["neck"]["reason"]
    assert layers["head"]["precision"] == "fp32" and "output head" in layers["head"]["reason"]
    fp32, int8 = first_output_on_cpu(work / "shape_reader_fp32.plan", test_images), first_output_on_cpu(work / "shape_reader_int8.plan", test_images)
    assert cosine(fp32, int8) >= 0.99


def test_calibrate_api_returns_amax_per_int8_input():
    import tempfile

    from sartor.frontend import import_onnx
    from sartor.ops.util import tensor_from_numpy
    from sartor.passes import optimize
    with tempfile.TemporaryDirectory() as d:
        graph = import_onnx(save(classifier_model(), Path(d) / "m.onnx")).graph
    optimize(graph)
    weights = {k: tensor_from_numpy(v) for k, v in graph.initializers.items()}
    rng = np.random.default_rng(12)
    batches = [{"images": rng.standard_normal((4, 3, IMAGE, IMAGE)).astype(np.float32)} for _ in range(3)]
    amax = calibrate(graph, weights, batches, method="minmax")
    assert set(amax) == {"images", "r1", "f"}  # conv1, conv2 (input and residual), fc inputs
    assert amax["images"] == max(float(np.abs(b["images"]).max()) for b in batches)


# ---- the calibration cache ---------------------------------------------------------------------------

def test_cache_floats_round_trip_bit_for_bit(tmp_path):
    values = {"a": 0.1 + 0.2, "b": 5e-324, "c": float(np.float32(3.3)), "d": 1.0 / 3.0, "e": 1e300, "f": 0.0}
    cache = CalibrationCache("ab" * 32, "percentile", "cd" * 32, 7, values, "resize=16x16", 99.9)
    write_cache(tmp_path / "c.json", cache)
    back = read_cache(tmp_path / "c.json")
    assert {k: v.hex() for k, v in back.amax.items()} == {k: v.hex() for k, v in values.items()}
    assert (back.method, back.percentile, back.calib_size, back.preprocess) == ("percentile", 99.9, 7, "resize=16x16")
    data = json.loads((tmp_path / "c.json").read_text())
    assert data["format"] == "sartor-calib-1" and data["amax"]["a"] == values["a"]
    data["amax"]["a"] = 0.3
    (tmp_path / "c.json").write_text(json.dumps(data))
    with pytest.raises(SartorError, match="amax_hex says"):
        read_cache(tmp_path / "c.json")


def test_rebuild_from_cache_is_identical(work, calib_npy, tmp_path, cli):
    model = save(deeper_model(), work / "deeper_cache.onnx")
    cache = tmp_path / "calib.json"
    first = cli("build", model, "-o", tmp_path / "a.plan", "--device", "cpu", *SHAPE_ARGS, "--precision", "int8",
                "--calib", calib_npy, "--calib-method", "percentile", "--percentile", "99.9", "--calib-cache", cache)
    assert first.code == 0, first
    assert "wrote cache" in first.out
    amax = read_cache(cache).amax
    assert set(amax) == {"images", "r1", "r2", "f", "gr"}
    # No --calib this time: the cache alone, calibration skipped.
    second = cli("build", model, "-o", tmp_path / "b.plan", "--device", "cpu", *SHAPE_ARGS, "--precision", "int8",
                 "--calib-cache", cache)
    assert second.code == 0, second
    assert "calibration skipped" in second.out
    header_a, tensors_a = read_engine_file(tmp_path / "a.plan")
    header_b, tensors_b = read_engine_file(tmp_path / "b.plan")
    assert tensors_a.keys() == tensors_b.keys()
    assert all(torch.equal(tensors_a[k], tensors_b[k]) for k in tensors_a)
    assert [layer["attrs"] for layer in header_a["layers"]] == [layer["attrs"] for layer in header_b["layers"]]
    scales = {layer["name"]: layer["attrs"]["input_scale"] for layer in header_a["layers"] if layer["precision"] == "int8"}
    assert scales["conv1"] == activation_scale(amax["images"])[0]
    cal_a, cal_b = header_a["provenance"]["calibration"], header_b["provenance"]["calibration"]
    assert cal_b["from_cache"] and cal_a["calib_sha256"] == cal_b["calib_sha256"] and cal_b["method"] == "percentile"
    # Asking for another method than the cache holds is refused.
    assert_cli_error(cli("build", model, "-o", tmp_path / "c.plan", "--device", "cpu", *SHAPE_ARGS, "--precision",
                         "int8", "--calib-cache", cache, "--calib-method", "mse"), "holds percentile thresholds")


def test_stale_cache_is_refused(work, calib_npy, tmp_path, cli):
    model = save(classifier_model(seed=0), tmp_path / "m.onnx")
    cache = tmp_path / "cache.json"
    _build(model, tmp_path / "a.plan", precision="int8", calib=calib_npy, calib_cache=cache)
    other = save(classifier_model(seed=1), tmp_path / "other.onnx")
    with pytest.raises(StaleCalibrationCacheError, match="stale calibration cache: .* built for ONNX sha256"):
        _build(other, tmp_path / "b.plan", precision="int8", calib_cache=cache)
    line = assert_cli_error(cli("build", other, "-o", tmp_path / "b.plan", "--device", "cpu", *SHAPE_ARGS,
                                "--precision", "int8", "--calib-cache", cache), "stale calibration cache")
    assert "but the model is" in line
    assert not (tmp_path / "b.plan").exists()


# ---- refusals and overrides -----------------------------------------------------------------------------

def test_int8_without_calibration_is_refused(work, tmp_path, cli):
    model = save(classifier_model(), tmp_path / "m.onnx")
    with pytest.raises(ConfigError, match="INT8 needs calibration"):
        _build(model, tmp_path / "a.plan", precision="int8")
    with pytest.raises(ConfigError, match="INT8 needs calibration"):
        _build(model, tmp_path / "a.plan", layer_precision={"conv1": "int8"})
    assert_cli_error(cli("build", model, "-o", tmp_path / "a.plan", "--device", "cpu", "--precision", "int8"),
                     "INT8 needs calibration", "--calib DATA")
    assert_cli_error(cli("build", model, "-o", tmp_path / "a.plan", "--device", "cpu", "--precision", "int8",
                         "--calib-cache", tmp_path / "missing.json"), "does not exist yet")
    assert_cli_error(cli("build", model, "-o", tmp_path / "a.plan", "--device", "cpu", "--precision", "int8",
                         "--calib", tmp_path / "missing.npy"), "--calib", "not found")
    np.save(tmp_path / "bad.npy", np.zeros((4, 3, 8, 8), np.float32))
    assert_cli_error(cli("build", model, "-o", tmp_path / "a.plan", "--device", "cpu", *SHAPE_ARGS, "--precision",
                         "int8", "--calib", tmp_path / "bad.npy"), "size 16 on axis 2")
    assert not (tmp_path / "a.plan").exists()


def test_layer_precision_keeps_a_layer_out_of_int8(work, calib_npy, tmp_path, cli):
    model = save(classifier_model(), tmp_path / "m.onnx")
    plan = tmp_path / "mixed.plan"
    result = cli("build", model, "-o", plan, "--device", "cpu", *SHAPE_ARGS, "--precision", "int8", "--calib",
                 calib_npy, "--layer-precision", "conv2=fp32")
    assert result.code == 0, result
    assert "layer conv2 runs fp32: --layer-precision conv2=fp32" in result.out
    info = json.loads(cli("inspect", plan, "--json").out)
    layers = {layer["name"]: layer for layer in info["layers"]}
    assert (layers["conv1"]["op"], layers["conv1"]["precision"]) == ("QConv", "int8")
    assert (layers["conv2"]["op"], layers["conv2"]["precision"]) == ("FusedConv", "fp32")
    assert layers["conv2"]["reason"] == "--layer-precision conv2=fp32"
    # conv1's output feeds an FP32 layer now, so it is written in FP32.
    assert layers["conv1"]["attrs"]["output_scale"] is None
    table = cli("inspect", plan).out
    assert "int8" in table and "--layer-precision conv2=fp32" in table
    # A non-conv layer pinned to int8 runs at the base precision, saying why.
    result = cli("build", model, "-o", plan, "--device", "cpu", *SHAPE_ARGS, "--precision", "int8", "--calib",
                 calib_npy, "--layer-precision", "pool=int8")
    assert result.code == 0, result
    assert "layer pool runs fp32: --layer-precision pool=int8 not applied: no INT8 kernel for GlobalAveragePool" \
        in result.out


def test_int8_fallback_precision_sets_the_other_layers(calib_npy, test_images, tmp_path, cli):
    """CPU INT8 builds run the non-INT8 layers FP32 unless told otherwise; with the flag they run
    what CUDA builds would, and the engine says which and why."""
    model = save(classifier_model(), tmp_path / "m.onnx")
    default = _build(model, tmp_path / "default.plan", precision="int8", calib=calib_npy)
    assert default.header["int8_fallback_precision"] == "fp32"
    assert default.header["build_config"]["int8_fallback_precision"] is None
    plan = tmp_path / "fp16.plan"
    result = cli("build", model, "-o", plan, "--device", "cpu", *SHAPE_ARGS, "--precision", "int8", "--calib",
                 calib_npy, "--int8-fallback-precision", "FP16", "--layer-precision", "pool=fp32")
    assert result.code == 0, result
    assert "layers outside INT8 run fp16 (--int8-fallback-precision)" in result.out
    info = json.loads(cli("inspect", plan, "--json").out)
    assert info["int8_fallback_precision"] == "fp16" and info["build_config"]["int8_fallback_precision"] == "fp16"
    precisions = {layer["name"]: layer["precision"] for layer in info["layers"]}
    assert precisions["conv1"] == precisions["conv2"] == "int8"
    assert precisions["fc"] == precisions["flatten"] == "fp16" and precisions["pool"] == "fp32"  # a pin still wins
    table = cli("inspect", plan).out
    assert "layers outside INT8 run fp16 (--int8-fallback-precision)" in table
    assert "layers outside INT8 run fp32 (the cpu default)" in cli("inspect", tmp_path / "default.plan").out
    bf16 = _build(model, tmp_path / "bf16.plan", precision="int8", calib=calib_npy, int8_fallback_precision="bf16")
    assert {layer["precision"] for layer in bf16.header["layers"]} == {"int8", "bf16"}
    assert cosine(first_output_on_cpu(tmp_path / "default.plan", test_images), first_output_on_cpu(tmp_path / "bf16.plan", test_images)) >= 0.99


def test_int8_fallback_precision_needs_an_int8_build(tmp_path, cli):
    model = save(classifier_model(), tmp_path / "m.onnx")
    with pytest.raises(ConfigError, match="needs --precision int8, not fp16"):
        _build(model, tmp_path / "a.plan", precision="fp16", int8_fallback_precision="fp32")
    with pytest.raises(ConfigError, match="'fp8' is not one of fp32, fp16, bf16"):
        _build(model, tmp_path / "a.plan", precision="int8", int8_fallback_precision="fp8")
    assert_cli_error(cli("build", model, "-o", tmp_path / "a.plan", "--device", "cpu", "--int8-fallback-precision",
                         "fp16"), "--int8-fallback-precision", "needs --precision int8, not fp32")
    assert not (tmp_path / "a.plan").exists()


def test_entropy_does_not_clip_sparse_histograms():
    """A few hundred values (the pooled features of a small calibration set) spread over a thousand
    bins: the divergence is noise, so the threshold is the max."""
    x = np.random.default_rng(13).laplace(size=500).astype(np.float32)
    observer = histogram_of(x)
    assert entropy_amax(observer) == observer.amax
    # Enough values once bins are merged: clipping again.
    x = np.random.default_rng(13).lognormal(size=20_000).astype(np.float32)
    assert entropy_amax(histogram_of(x)) < 0.5 * float(x.max())


# ---- sensitivity --------------------------------------------------------------------------------------

def test_sensitivity_ranks_layers_and_finds_fp16_overflow(work, calib_npy, tmp_path, cli):
    model = classifier_model()
    for init in model.graph.initializer:
        if init.name in ("conv1.w", "conv1.b"):
            init.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(init) * 1e5, init.name))
    path = save(model, tmp_path / "loud.onnx")
    result = cli("sensitivity", path, "--calib", calib_npy, "--calib-size", "16", "--json")
    assert result.code == 0, result
    report = json.loads(result.out)
    layers = report["layers"]
    assert [layer["name"] for layer in layers] and {layer["name"] for layer in layers} == {"conv1", "conv2", "fc"}
    assert [layer["snr_db"] for layer in layers] == sorted(layer["snr_db"] for layer in layers)
    assert report["samples"] == 16 and report["all_int8_cosine"] > 0.99
    by_name = {layer["name"]: layer for layer in layers}
    assert by_name["conv1"]["overflows_fp16"] and by_name["conv1"]["origin"] == ["conv1", "relu1"]
    assert {"conv1", "conv2"} <= set(report["fp16_overflow"])
    assert "output head" in by_name["fc"]["default"] and by_name["conv2"]["default"] == "int8"
    table = cli("sensitivity", path, "--calib", calib_npy, "--calib-size", "16", "--top", "2")
    assert table.code == 0 and "overflows FP16" in table.out and "SNR" in table.out
    assert_cli_error(cli("sensitivity", path, "--calib", tmp_path / "none.npy"), "not found")


def yolo_head_model(size: int = 8, classes: int = 2, seed: int = 0) -> onnx.ModelProto:
    """A YOLO-format raw head [B, 4+C, size²]: a box branch in pixels (×200) and a score branch
    (sigmoid) whose first conv has one ±50 weight per output channel, so per-channel INT8 rounds its
    other weights to a few levels: the layer that hurts the scores most, in errors of 0..1."""
    rng = np.random.default_rng(seed)

    def w(name, *shape, outliers=False):
        a = rng.standard_normal(shape) / np.sqrt(np.prod(shape[1:]))
        if outliers:
            a[:, 0, 0, 0], a[:, 0, 1, 1] = 50.0, -50.0
        return numpy_helper.from_array(a.astype(np.float32), name)
    anchors = size * size
    inits = [w("box1.w", 8, 3, 3, 3), w("box2.w", 4, 8, 1, 1), w("score1.w", 8, 3, 3, 3, outliers=True),
             w("score2.w", classes, 8, 1, 1), numpy_helper.from_array(np.array(200, np.float32), "px"),
             numpy_helper.from_array(np.array([0, 4 + classes, anchors], np.int64), "head_shape")]
    nodes = [
        helper.make_node("Conv", ["images", "box1.w"], ["b1"], name="box1", pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["b1"], ["b1r"], name="box1_relu"),
        helper.make_node("Conv", ["b1r", "box2.w"], ["b2"], name="box2"),
        helper.make_node("Mul", ["b2", "px"], ["boxes"], name="to_pixels"),
        helper.make_node("Conv", ["images", "score1.w"], ["s1"], name="score1", pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["s1"], ["s1r"], name="score1_relu"),
        helper.make_node("Conv", ["s1r", "score2.w"], ["s2"], name="score2"),
        helper.make_node("Sigmoid", ["s2"], ["scores"], name="score_sigmoid"),
        helper.make_node("Concat", ["boxes", "scores"], ["head"], name="concat", axis=1),
        helper.make_node("Reshape", ["head", "head_shape"], ["output0"], name="reshape"),
    ]
    model = make_model(nodes, [helper.make_tensor_value_info("images", TensorProto.FLOAT, ["batch", 3, size, size])],
                       [helper.make_tensor_value_info("output0", TensorProto.FLOAT, ["batch", 4 + classes, anchors])],
                       inits, name="yolo_head")
    onnx.checker.check_model(model)
    return model


def test_sensitivity_per_box_and_score_group_finds_the_score_critical_layer(tmp_path, cli):
    """One SNR over the raw head ranks the score branch last (its errors are 0..1 next to box
    coordinates of hundreds of pixels); compared per group it comes first, by its score SNR."""
    model = save(yolo_head_model(), tmp_path / "det.onnx")
    calib = tmp_path / "calib.npy"
    np.save(calib, np.random.default_rng(1).standard_normal((16, 3, 8, 8)).astype(np.float32))
    raw = json.loads(cli("sensitivity", model, "--calib", calib, "--json").out)
    result = cli("sensitivity", model, "--calib", calib, "--decoder", "yolo", "--json")
    assert result.code == 0, result
    grouped = json.loads(result.out)
    raw_order = [layer["name"] for layer in raw["layers"]]
    assert raw_order[:2] == ["box2", "box1"] and raw["decoder"] is None and raw["layers"][0]["groups"] == {}
    assert grouped["decoder"] == "yolo" and grouped["layers"][0]["name"] == "score1"
    by_name = {layer["name"]: layer for layer in grouped["layers"]}
    score1, box1 = by_name["score1"], by_name["box1"]
    assert set(score1["groups"]) == {"boxes", "scores"} and score1["groups"]["boxes"]["snr_db"] == "inf"
    assert score1["snr_db"] == score1["groups"]["scores"]["snr_db"] < box1["groups"]["boxes"]["snr_db"] == \
        box1["snr_db"]
    # The raw SNR barely hears score1 (the box signal swamps it), 40+ dB more than its score SNR.
    raw_score1 = next(layer for layer in raw["layers"] if layer["name"] == "score1")
    assert raw_score1["snr_db"] > score1["snr_db"] + 40
    assert set(grouped["all_int8_groups"]) == {"boxes", "scores"}
    table = cli("sensitivity", model, "--calib", calib, "--decoder", "yolo", "--top", "2").out
    assert "boxes SNR dB" in table and "scores SNR dB" in table and "worst of boxes, scores SNR" in table


def test_sensitivity_output_groups_of_graphs_that_end_in_boxes():
    from sartor.validate.sensitivity import output_groups
    b, n = 2, 5
    boxes, scores = np.arange(b * n * 4, dtype=np.float64).reshape(b, n, 4), np.full((b, n, 3), 0.5)
    split = output_groups("boxes", {"boxes": boxes.shape, "scores": scores.shape, "num": (b, 1)})
    groups = split({"boxes": boxes, "scores": scores, "num": np.ones((b, 1))})
    assert list(groups) == ["boxes", "scores", "num"] and np.array_equal(groups["boxes"], boxes.ravel())
    combined = np.random.default_rng(0).random((b, n, 6))
    groups = output_groups("boxes", {"det": combined.shape})({"det": combined})
    assert np.array_equal(groups["scores"], combined[..., 4].ravel()) and set(groups) == {"boxes", "scores", "classes"}
    groups = output_groups(None, {"a": (2, 3)})({"a": np.ones((2, 3)), "b": np.zeros(4)})
    assert list(groups) == ["outputs"] and len(groups["outputs"]) == 10


def test_sensitivity_decoder_errors(work, calib_npy, tmp_path, cli):
    classifier = save(classifier_model(), tmp_path / "m.onnx")
    assert_cli_error(cli("sensitivity", classifier, "--calib", calib_npy, "--decoder", "mymodule:decode"),
                     "--decoder 'mymodule:decode'", "yolo or boxes")
    assert_cli_error(cli("sensitivity", classifier, "--calib", calib_npy, "--calib-size", "4", "--decoder", "yolo"),
                     "--decoder yolo needs one output [B, 4+C, N]", "the model gives logits [")
    model = save(yolo_head_model(), tmp_path / "det.onnx")
    np.save(tmp_path / "calib.npy", np.zeros((2, 3, 8, 8), np.float32))
    assert_cli_error(cli("sensitivity", model, "--calib", tmp_path / "calib.npy", "--decoder", "boxes"),
                     "--decoder boxes needs boxes [B,N,4]", "the model gives output0 [2, 6, 64]")


def test_calibration_from_an_image_dataset(tmp_path):
    from PIL import Image
    for label in ("cat", "dog"):
        (tmp_path / "images" / label).mkdir(parents=True)
        for k in range(5):
            pixels = np.random.default_rng(k + (label == "dog") * 10).integers(0, 256, (20, 24, 3), dtype=np.uint8)
            Image.fromarray(pixels).save(tmp_path / "images" / label / f"{k}.png")
    model = save(classifier_model(), tmp_path / "m.onnx")
    cache = tmp_path / "cache.json"
    result = _build(model, tmp_path / "a.plan", precision="int8", calib=tmp_path / "images", calib_size=6,
                    preprocess="resize=16x16,std=255", calib_cache=cache)
    calibration = result.header["provenance"]["calibration"]
    assert calibration["calib_size"] == 6 and calibration["source"] == str(tmp_path / "images")
    assert read_cache(cache).preprocess == "resize=16x16,mean=0,std=255,rgb,nchw"
    # The same preprocessing, spelt differently, reuses the cache; another one is refused.
    again = _build(model, tmp_path / "b.plan", precision="int8", preprocess="resize=16x16,mean=0,std=255,rgb",
                   calib_cache=cache)
    assert again.header["provenance"]["calibration"]["from_cache"]
    with pytest.raises(StaleCalibrationCacheError, match="calibrated with --preprocess"):
        _build(model, tmp_path / "c.plan", precision="int8", preprocess="resize=16x16,std=128", calib_cache=cache)
    with pytest.raises(ConfigError, match="give --preprocess"):
        _build(model, tmp_path / "d.plan", precision="int8", calib=tmp_path / "images")
