"""Q/DQ models: the ONNX quantization ops as given, the passes that fold them into INT8 layers
(`drop_redundant_qdq`, `fold_qdq`), and builds checked against ONNX Runtime on the same model.

Tolerance against ONNX Runtime on a Q/DQ model: every output within one quantization step of the
output's scale, and cosine similarity ≥ 0.999. (Measured on the symmetric ORT-quantized net below:
0 steps, bit-identical on 40 batches, against ORT with and without its own QDQ fusions.)
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from conftest import assert_cli_error, cosine, initializer_makers, make_model, save
from onnx import TensorProto, helper, numpy_helper
from passes_helpers import import_graph, op_counts, run_ort, run_sartor

import sartor
from sartor.errors import ConfigError, UnsupportedModelError
from sartor.frontend.onnx import import_model_proto
from sartor.passes import optimize
from sartor.passes.drop_redundant_qdq import drop_redundant_qdq
from sartor.passes.fold_qdq import fold_qdq
from sartor.quant.quantize import EPILOGUE_KEYS, quantize_graph

ort = pytest.importorskip("onnxruntime")
quantization = pytest.importorskip("onnxruntime.quantization")

SIZE = 16
INT8_ZERO = np.int8(0)
PROFILE = [{"min": {"images": (1, 3, SIZE, SIZE)}, "opt": {"images": (8, 3, SIZE, SIZE)},
            "max": {"images": (8, 3, SIZE, SIZE)}}]



def ort_session(path: Path, optimized: bool = False):
    options = ort.SessionOptions()
    if not optimized:  # the Q/DQ nodes as written (fake quantization in float)
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    options.intra_op_num_threads = 2
    options.log_severity_level = 3
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


# ---- the ONNX quantization ops, computed as given ---------------------------------------------------

def _single_op_model(op: str, inputs: dict, consts: dict, out_type: int, opset: int = 13, **attrs):
    """(model, feeds): one `op` node reading graph inputs `inputs` (name → array, also the feeds)
    and initializers `consts`."""
    names = list(inputs) + list(consts)
    node = helper.make_node(op, [n if n else "" for n in names], ["y"], name=op.lower(), **attrs)
    graph_inputs = [helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(a.dtype), a.shape)
                    for n, a in inputs.items()]
    inits = [numpy_helper.from_array(np.asarray(a), n) for n, a in consts.items()]
    outputs = [helper.make_tensor_value_info("y", out_type, None)]
    if op == "DynamicQuantizeLinear":
        node.output.extend(["y_scale", "y_zero_point"])
        outputs += [helper.make_tensor_value_info("y_scale", TensorProto.FLOAT, None),
                    helper.make_tensor_value_info("y_zero_point", TensorProto.UINT8, None)]
    model = make_model([node], graph_inputs, outputs, inits, opset=opset)
    model.ir_version = 8 if opset <= 17 else 10
    inferred = {vi.name: vi for vi in onnx.shape_inference.infer_shapes(model).graph.output}
    for out in model.graph.output:  # the checker wants a shape field on graph outputs
        if inferred[out.name].type.tensor_type.HasField("shape"):
            out.type.CopyFrom(inferred[out.name].type)
        else:
            out.type.tensor_type.shape.SetInParent()
    return model, inputs


def _ties(scale: float) -> np.ndarray:
    """Exact halfway points (round half to even decides them) and values that saturate."""
    halves = np.arange(-6, 6, dtype=np.float32) + np.float32(0.5)
    return np.concatenate([halves, [0, 1, -1, 300, -300, 1e6, -1e6]]).astype(np.float32) * np.float32(scale)


def _op_cases():
    rng = np.random.default_rng(3)
    x = rng.standard_normal((2, 4, 5, 5)).astype(np.float32) * 3
    per_channel = np.array([0.02, 0.05, 0.1, 0.3], np.float32)
    yield "quantize_int8_ties", _single_op_model(
        "QuantizeLinear", {"x": _ties(0.25).reshape(1, -1)}, {"s": np.float32(0.25), "z": np.int8(0)}, TensorProto.INT8)
    yield "quantize_uint8_ties_default_zero_point", _single_op_model(
        "QuantizeLinear", {"x": _ties(0.5).reshape(1, -1)}, {"s": np.float32(0.5)}, TensorProto.UINT8)
    yield "quantize_per_axis_uint8", _single_op_model(
        "QuantizeLinear", {"x": x}, {"s": per_channel, "z": np.array([0, 10, 128, 255], np.uint8)}, TensorProto.UINT8)
    yield "quantize_per_axis_negative_axis_int16_opset21", _single_op_model(
        "QuantizeLinear", {"x": x * 1000}, {"s": np.array([0.5] * 5, np.float32), "z": np.zeros(5, np.int16)},
        TensorProto.INT16, opset=21, axis=-1)
    yield "dequantize_per_axis_int8", _single_op_model(
        "DequantizeLinear", {"x": rng.integers(-128, 128, (2, 4, 3), dtype=np.int8)},
        {"s": per_channel, "z": np.array([0, -3, 7, 127], np.int8)}, TensorProto.FLOAT)
    yield "dequantize_int32", _single_op_model(
        "DequantizeLinear", {"x": rng.integers(-2 ** 20, 2 ** 20, (7,), dtype=np.int32)}, {"s": np.float32(1e-4)},
        TensorProto.FLOAT)
    yield "dequantize_uint8_axis0_opset21", _single_op_model(
        "DequantizeLinear", {"x": rng.integers(0, 256, (4, 6), dtype=np.uint8)},
        {"s": per_channel, "z": np.array([128, 0, 3, 255], np.uint8)}, TensorProto.FLOAT, opset=21, axis=0)
    a = rng.integers(0, 256, (3, 8), dtype=np.uint8)
    b = rng.integers(-128, 128, (8, 5), dtype=np.int8)
    yield "matmul_integer_per_column_zero_point", _single_op_model(
        "MatMulInteger", {"a": a}, {"b": b, "az": np.uint8(3), "bz": np.arange(-2, 3, dtype=np.int8)},
        TensorProto.INT32)
    xq = rng.integers(0, 256, (1, 3, 6, 6), dtype=np.uint8)
    wq = rng.integers(-100, 100, (4, 3, 3, 3), dtype=np.int8)
    yield "conv_integer", _single_op_model(
        "ConvInteger", {"x": xq}, {"w": wq, "xz": np.uint8(120), "wz": np.int8(0)}, TensorProto.INT32,
        pads=[1, 1, 1, 1])
    yield "qlinear_conv_per_channel", _single_op_model(
        "QLinearConv", {"x": xq},
        {"xs": np.float32(0.02), "xz": np.uint8(120), "w": wq, "ws": per_channel * 0.1, "wz": np.zeros(4, np.int8),
         "ys": np.float32(0.05), "yz": np.uint8(100), "b": rng.integers(-500, 500, 4).astype(np.int32)},
        TensorProto.UINT8, strides=[2, 2], pads=[1, 1, 1, 1])
    yield "qlinear_matmul", _single_op_model(
        "QLinearMatMul", {"a": a},
        {"as": np.float32(0.03), "az": np.uint8(128), "b": b, "bs": np.float32(0.01), "bz": np.int8(0),
         "ys": np.float32(0.04), "yz": np.uint8(130)}, TensorProto.UINT8)
    yield "dynamic_quantize_linear", _single_op_model("DynamicQuantizeLinear", {"x": x}, {}, TensorProto.UINT8)


OP_CASES = dict(_op_cases())


@pytest.mark.parametrize("name", sorted(OP_CASES))
def test_quantization_ops_match_onnxruntime(name):
    model, feeds = OP_CASES[name]
    graph = import_graph(model)
    theirs = run_ort(model, feeds)
    optimized = graph.copy()
    optimize(optimized)
    for variant, g in (("imported", graph), ("optimized", optimized)):
        ours = run_sartor(g, feeds)
        for key, expected in theirs.items():
            assert ours[key].dtype == expected.dtype, (variant, key)
            np.testing.assert_array_equal(ours[key], expected, err_msg=f"{name} {key} {variant}")


def test_matmul_integer_per_row_zero_point():
    """A 1-D a_zero_point holds one value per row of a (ONNX Runtime takes only a scalar)."""
    rng = np.random.default_rng(5)
    a, b = rng.integers(0, 256, (3, 8), dtype=np.uint8), rng.integers(-128, 128, (8, 5), dtype=np.int8)
    az = np.array([3, 128, 200], np.uint8)
    model, feeds = _single_op_model("MatMulInteger", {"a": a}, {"b": b, "az": az}, TensorProto.INT32)
    expected = (a.astype(np.int64) - az[:, None]) @ b.astype(np.int64)
    np.testing.assert_array_equal(run_sartor(import_graph(model), feeds)["y"], expected.astype(np.int32))


def test_blocked_quantization_is_refused_with_its_reason():
    model, _ = _single_op_model("DequantizeLinear", {"x": np.zeros((4, 6), np.int8)},
                             {"s": np.ones((4, 3), np.float32)}, TensorProto.FLOAT, opset=21, axis=1, block_size=2)
    with pytest.raises(UnsupportedModelError, match=r"blocked quantization \(block_size=2\) is not supported"):
        import_model_proto(model)


# ---- models quantized by ONNX Runtime ----------------------------------------------------------------

def float_net(seed: int = 0) -> onnx.ModelProto:
    """conv → relu → conv s2 → relu → depthwise → relu6 → pointwise + residual add → pool → flatten →
    gemm (transB=0) → relu → matmul: every layer kind fold_qdq folds, with Clip and a residual."""
    w, b = initializer_makers(np.random.default_rng(seed))
    inits = [w("c1.w", 16, 3, 3, 3), b("c1.b", 16), w("c2.w", 32, 16, 3, 3), b("c2.b", 32),
             w("dw.w", 32, 1, 3, 3), b("dw.b", 32), w("pw.w", 32, 32, 1, 1), b("pw.b", 32),
             w("fc.w", 32, 24), b("fc.b", 24), w("mm.w", 24, 10),
             numpy_helper.from_array(np.float32(0), "lo"), numpy_helper.from_array(np.float32(6), "hi")]
    n = helper.make_node
    nodes = [
        n("Conv", ["images", "c1.w", "c1.b"], ["c1"], name="conv1", pads=[1, 1, 1, 1]),
        n("Relu", ["c1"], ["r1"], name="relu1"),
        n("Conv", ["r1", "c2.w", "c2.b"], ["c2"], name="conv2", pads=[1, 1, 1, 1], strides=[2, 2]),
        n("Relu", ["c2"], ["r2"], name="relu2"),
        n("Conv", ["r2", "dw.w", "dw.b"], ["d"], name="dw", pads=[1, 1, 1, 1], group=32),
        n("Clip", ["d", "lo", "hi"], ["d6"], name="relu6"),
        n("Conv", ["d6", "pw.w", "pw.b"], ["pw"], name="pw"),
        n("Add", ["pw", "r2"], ["s"], name="add"),
        n("GlobalAveragePool", ["s"], ["p"], name="pool"),
        n("Flatten", ["p"], ["f"], name="flatten", axis=1),
        n("Gemm", ["f", "fc.w", "fc.b"], ["g"], name="fc"),
        n("Relu", ["g"], ["gr"], name="relu3"),
        n("MatMul", ["gr", "mm.w"], ["logits"], name="mm"),
    ]
    model = make_model(nodes, [helper.make_tensor_value_info("images", TensorProto.FLOAT, ["batch", 3, SIZE, SIZE])],
                       [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", 10])], inits, name="qdqnet")
    onnx.checker.check_model(model)
    return model


class RandomImages(quantization.CalibrationDataReader):
    def __init__(self, batches: int = 16, seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        self.batches = iter([{"images": rng.standard_normal((2, 3, SIZE, SIZE)).astype(np.float32)}
                             for _ in range(batches)])

    def get_next(self):
        return next(self.batches, None)


def ort_quantize(source: Path, target: Path, symmetric: bool) -> Path:
    import logging
    logging.getLogger().setLevel(logging.ERROR)  # ORT's advice to pre-process the model
    extra = {"ActivationSymmetric": True, "WeightSymmetric": True} if symmetric else {}
    quantization.quantize_static(str(source), str(target), RandomImages(), quant_format=quantization.QuantFormat.QDQ,
                                 per_channel=True, activation_type=quantization.QuantType.QInt8,
                                 weight_type=quantization.QuantType.QInt8, extra_options=extra)
    return target


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("qdq")
    save(float_net(), path / "float.onnx")
    return path


@pytest.fixture(scope="module")
def symmetric_model(work) -> Path:
    return ort_quantize(work / "float.onnx", work / "symmetric.onnx", symmetric=True)


@pytest.fixture(scope="module")
def asymmetric_model(work) -> Path:
    return ort_quantize(work / "float.onnx", work / "asymmetric.onnx", symmetric=False)


def _initializer(path: Path, name: str) -> np.ndarray:
    return next(numpy_helper.to_array(t) for t in onnx.load(str(path)).graph.initializer if t.name == name)


def _images(seed: int, batch: int = 8) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((batch, 3, SIZE, SIZE)).astype(np.float32)


FOLDED = {"conv1": ("QConv", "Relu"), "conv2": ("QConv", "Relu"), "dw": ("QConv", "Clip"), "pw": ("QConv", None),
          "fc": ("QGemm", "Relu"), "mm": ("QGemm", None)}


@pytest.mark.parametrize("precision", ["fp32", "int8"])
def test_symmetric_qdq_model_folds_and_matches_onnxruntime(work, symmetric_model, precision, record_property):
    # --precision int8 needs no --calib: the model carries its scales
    result = sartor.build(symmetric_model, work / f"sym_{precision}.plan", device="cpu", precision=precision,
                          profiles=PROFILE)
    layers = {layer["name"]: layer for layer in result.header["layers"]}
    assert {name: (layer["op"], layer["attrs"].get("activation")) for name, layer in layers.items()
            if layer["precision"] == "int8"} == FOLDED
    assert all(layers[name]["reason"].startswith("quantized by the model (Q/DQ)") for name in FOLDED)
    # the scales are the model's: conv1 reads the images with the images' Q scale, and writes INT8
    # with the scale of the Q after its Relu
    assert layers["conv1"]["attrs"]["input_scale"] == float(_initializer(symmetric_model, "images_scale"))
    assert layers["conv1"]["attrs"]["output_scale"] == float(_initializer(symmetric_model, "r1_scale"))
    assert layers["mm"]["attrs"]["output_scale"] == float(_initializer(symmetric_model, "logits_scale"))
    assert result.header["provenance"]["calibration"] is None
    log = "\n".join(result.log)
    assert "calibration: none needed: the model is quantized with Q/DQ nodes" in log
    assert "qdq: the model has 14 QuantizeLinear and 25 DequantizeLinear; 6 conv/gemm layer(s) folded" in log
    assert "12 Q/DQ pair(s) folded, 2 run as fake quantization in float" in log
    assert "pass drop_redundant_qdq: 4 rewrite(s)" in log

    # The reference is the Q/DQ semantics as written: ONNX Runtime with its graph optimizations off.
    # Its optimized session fuses the Q/DQ pairs its own way and rounds differently (1.32 moved by
    # about 40 steps from its own as-written run), so it is a peer whose distance is reported.
    step = float(_initializer(symmetric_model, "logits_scale"))
    engine = sartor.load(result.path, device="cpu").context()
    as_written, optimized = ort_session(symmetric_model), ort_session(symmetric_model, optimized=True)
    worst, peer_worst, cosines = 0.0, 0.0, []
    for seed in range(8):
        images = _images(100 + seed)
        ours = engine.run({"images": images})["logits"]
        reference = as_written.run(None, {"images": images})[0]
        worst = max(worst, float(np.abs(ours - reference).max()) / step)
        cosines.append(cosine(ours, reference))
        peer = optimized.run(None, {"images": images})[0]
        peer_worst = max(peer_worst, float(np.abs(ours - peer).max()) / step)
    record_property("optimized_onnxruntime_steps", round(peer_worst, 3))
    print(f"sartor {precision}: {worst:.3f} steps from ONNX Runtime as written; {peer_worst:.3f} from "
          f"ONNX Runtime {ort.__version__} optimized (a peer, not the reference)")
    assert worst <= 1.0 + 1e-6, f"{worst:.3f} quantization steps from ONNX Runtime (Q/DQ as written)"
    assert min(cosines) >= 0.999


def test_cli_builds_a_qdq_model_in_int8_without_calibration(work, symmetric_model, cli):
    plan = work / "cli_int8.plan"
    result = cli("build", symmetric_model, "-o", plan, "--device", "cpu", "--precision", "int8",
                 *(f for kind in ("min", "opt", "max") for f in (f"--{kind}-shapes", f"images:2x3x{SIZE}x{SIZE}")))
    assert result.code == 0, result
    assert plan.exists()


def test_asymmetric_model_runs_as_given_and_int8_refuses_it(work, asymmetric_model):
    assert int(_initializer(asymmetric_model, "images_zero_point")) != 0  # ORT's default: asymmetric activations
    result = sartor.build(asymmetric_model, work / "asym.plan", device="cpu", profiles=PROFILE)
    ops = {layer["op"] for layer in result.header["layers"]}
    assert "QConv" not in ops and "QGemm" not in ops and {"Conv", "Gemm", "MatMul"} <= ops
    log = "\n".join(result.log)
    assert "0 conv/gemm layer(s) folded" in log
    assert "qdq: layer conv1 (Conv) not folded, runs as given: activation zero point" in log
    assert "sartor's INT8 kernels are symmetric" in log
    step = float(_initializer(asymmetric_model, "logits_scale"))
    engine = sartor.load(result.path, device="cpu").context()
    for seed in range(4):
        images = _images(200 + seed)
        diff = np.abs(engine.run({"images": images})["logits"] - ort_session(asymmetric_model).run(None, {"images": images})[0])
        assert float(diff.max()) <= step * (1 + 1e-6)

    with pytest.raises(ConfigError) as refused:
        sartor.build(asymmetric_model, work / "asym_int8.plan", device="cpu", precision="int8", profiles=PROFILE)
    message = str(refused.value)
    assert "\n" not in message
    assert "layer conv1 (Conv): activation zero point" in message and "images_QuantizeLinear" in message
    assert "sartor's INT8 kernels are symmetric" in message and "ActivationSymmetric" in message
    assert not (work / "asym_int8.plan").exists()


def test_asymmetric_refusal_on_the_command_line(work, asymmetric_model, cli):
    shapes = (f for kind in ("min", "opt", "max") for f in (f"--{kind}-shapes", f"images:2x3x{SIZE}x{SIZE}"))
    assert_cli_error(cli("build", asymmetric_model, "-o", work / "a.plan", "--device", "cpu", "--precision", "int8",
                         *shapes), "activation zero point", "sartor's INT8 kernels are symmetric")


def test_a_float_model_still_needs_calibration_for_int8(work):
    with pytest.raises(ConfigError, match="INT8 needs calibration"):
        sartor.build(work / "float.onnx", work / "f.plan", device="cpu", precision="int8", profiles=PROFILE)


def test_folded_layers_have_the_form_of_calibrated_ones(work, symmetric_model):
    """fold_qdq makes what quantize_graph makes from calibration: same ops, inputs and attributes
    (plus qmin), the same INT8 weights and scales when the thresholds are the model's."""
    folded = import_graph(onnx.load(str(symmetric_model)))
    optimize(folded)
    calibrated = import_graph(float_net())
    optimize(calibrated)
    qconv = {n.name: n for n in folded.nodes if n.op_type in ("QConv", "QGemm")}
    amax = {}
    for node in calibrated.nodes:
        if node.name in qconv:
            amax[node.inputs[0]] = qconv[node.name].attrs["input_scale"] * 127
    quantize_graph(calibrated, {name: "int8" for name in qconv}, amax)
    mine = {n.name: n for n in calibrated.nodes if n.name in qconv}
    for name, node in qconv.items():
        other = mine[name]
        assert node.op_type == other.op_type and len(node.inputs) == len(other.inputs), name
        # (the float net fuses pw's residual add; ORT's Q/DQ between pw and the add keep it apart)
        assert set(node.attrs) - set(EPILOGUE_KEYS) == (set(other.attrs) - set(EPILOGUE_KEYS)) | {"qmin"}, name
        assert node.attrs["qmin"] == -128 and other.attrs.get("qmin") is None
        assert node.attrs["input_scale"] == pytest.approx(other.attrs["input_scale"], rel=1e-6)
        for position, what in ((1, "weights"), (4, "dequant scales")):
            ours, theirs = folded.initializers[node.inputs[position]], calibrated.initializers[other.inputs[position]]
            assert ours.dtype == theirs.dtype and ours.shape == theirs.shape, (name, what)
        # ORT and sartor both quantize weights symmetric per channel at max|w| / 127
        np.testing.assert_array_equal(folded.initializers[node.inputs[1]], calibrated.initializers[other.inputs[1]])


# ---- the passes on small hand-written Q/DQ graphs -----------------------------------------------------

def _q(nodes, inits, x, name, scale, zero_point=INT8_ZERO):
    """x → QuantizeLinear → DequantizeLinear with one scale and zero point; returns the DQ output."""
    inits += [numpy_helper.from_array(np.float32(scale), f"{name}.s"),
              numpy_helper.from_array(np.asarray(zero_point), f"{name}.z")]
    nodes += [helper.make_node("QuantizeLinear", [x, f"{name}.s", f"{name}.z"], [f"{name}.q"], name=f"{name}.Q"),
              helper.make_node("DequantizeLinear", [f"{name}.q", f"{name}.s", f"{name}.z"], [f"{name}.dq"],
                               name=f"{name}.DQ")]
    return f"{name}.dq"


def qdq_conv_model(act_zero_point=INT8_ZERO, weight_axis=0, weight_zero_point=0, weight="int8", input_q=True,
                   second_scale=None, relu_between=False, residual=False, bias="int32", out_q=True):
    """images → Q → DQ → Conv(DQ(W), bias) [→ Q → DQ → Relu] [+ DQ(Q(images))] [→ Q → DQ] → y."""
    rng = np.random.default_rng(4)
    nodes, inits = [], []
    x = "images"
    if input_q:
        x = _q(nodes, inits, x, "in", 0.03, act_zero_point)
        if second_scale is not None:  # a DQ whose scale differs from its Q's
            inits.append(numpy_helper.from_array(np.float32(second_scale), "in.s2"))
            nodes[-1].input[1] = "in.s2"
    w_scale = (rng.random(8 if weight_axis == 0 else 3).astype(np.float32) + 0.5) * 0.01
    if weight == "int8":
        wq = rng.integers(-127, 128, (8, 3, 3, 3)).astype(np.int8)
        zp = np.full(w_scale.shape, weight_zero_point, np.int8)
        inits += [numpy_helper.from_array(wq, "w.q"), numpy_helper.from_array(w_scale, "w.s"),
                  numpy_helper.from_array(zp, "w.z")]
        nodes.append(helper.make_node("DequantizeLinear", ["w.q", "w.s", "w.z"], ["w"], name="w.DQ", axis=weight_axis))
    elif weight == "float_qdq":  # ModelOpt/PyTorch style: float weights → Q → DQ
        inits += [numpy_helper.from_array((rng.standard_normal((8, 3, 3, 3)) * 0.3).astype(np.float32), "w.f"),
                  numpy_helper.from_array(w_scale, "w.s"), numpy_helper.from_array(np.zeros(8, np.int8), "w.z")]
        nodes += [helper.make_node("QuantizeLinear", ["w.f", "w.s", "w.z"], ["w.q"], name="w.Q", axis=0),
                  helper.make_node("DequantizeLinear", ["w.q", "w.s", "w.z"], ["w"], name="w.DQ", axis=0)]
    else:  # float weights without Q/DQ
        inits.append(numpy_helper.from_array((rng.standard_normal((8, 3, 3, 3)) * 0.3).astype(np.float32), "w"))
    conv_inputs = [x, "w"]
    if bias == "int32":
        b_scale = np.full(8, 1e-4, np.float32) if weight_axis != 0 else (np.float32(0.03) * w_scale).astype(np.float32)
        inits += [numpy_helper.from_array(rng.integers(-3000, 3000, 8).astype(np.int32), "b.q"),
                  numpy_helper.from_array(b_scale, "b.s"), numpy_helper.from_array(np.zeros(8, np.int32), "b.z")]
        nodes.append(helper.make_node("DequantizeLinear", ["b.q", "b.s", "b.z"], ["b"], name="b.DQ", axis=0))
        conv_inputs.append("b")
    elif bias == "float":
        inits.append(numpy_helper.from_array((rng.standard_normal(8) * 0.1).astype(np.float32), "b"))
        conv_inputs.append("b")
    nodes.append(helper.make_node("Conv", conv_inputs, ["c"], name="conv", pads=[1, 1, 1, 1]))
    y = "c"
    if relu_between:
        y = _q(nodes, inits, y, "pre", 0.05)
        nodes.append(helper.make_node("Relu", [y], ["r"], name="relu"))
        y = "r"
    if residual:
        inits.append(numpy_helper.from_array(rng.standard_normal((8, 3, 1, 1)).astype(np.float32) * 0.3, "proj.w"))
        nodes.append(helper.make_node("Conv", ["images", "proj.w"], ["skip"], name="proj"))
        skip = _q(nodes, inits, "skip", "skip", 0.02)
        nodes.append(helper.make_node("Add", [y, skip], ["sum"], name="add"))
        y = "sum"
    if out_q:
        y = _q(nodes, inits, y, "out", 0.05)
    nodes.append(helper.make_node("Identity", [y], ["y"], name="out"))
    model = make_model(nodes, [helper.make_tensor_value_info("images", TensorProto.FLOAT, [2, 3, 8, 8])],
                       [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 8, 8, 8])], inits, name="qdqconv")
    onnx.checker.check_model(model)
    return model


def _feeds(seed: int = 1) -> dict:
    return {"images": np.random.default_rng(seed).standard_normal((2, 3, 8, 8)).astype(np.float32)}


def _within_one_step(graph, model, step: float = 0.05) -> None:
    for seed in range(3):
        ours, theirs = run_sartor(graph, _feeds(seed))["y"], run_ort(model, _feeds(seed))["y"]
        assert float(np.abs(ours - theirs).max()) <= step * 1.001  # float32 differences of multiples of step
        assert cosine(ours, theirs) >= 0.999


@pytest.mark.parametrize("case", ["int8_weights", "float_weights_with_qdq", "uint8_zero_point_128", "float_bias",
                                  "no_bias", "relu_between_qdq", "residual"])
def test_fold_qdq_fires_and_preserves_numbers(case):
    kwargs = {"int8_weights": {}, "float_weights_with_qdq": {"weight": "float_qdq"},
              "uint8_zero_point_128": {"act_zero_point": np.uint8(128)}, "float_bias": {"bias": "float"},
              "no_bias": {"bias": None}, "relu_between_qdq": {"relu_between": True},
              "residual": {"residual": True}}[case]
    model = qdq_conv_model(**kwargs)
    graph = import_graph(model)
    report = optimize(graph, verify=True)
    assert report.rewrites.get("fold_qdq", 0) >= 1, report.rewrites
    (qconv,) = [n for n in graph.nodes if n.op_type == "QConv"]
    assert qconv.inputs[0] == "images" and qconv.attrs["input_scale"] == float(np.float32(0.03))
    assert qconv.attrs["qmin"] == -128
    assert graph.initializers[qconv.inputs[1]].dtype == np.int8
    if case == "int8_weights":  # the model's INT8 weights, scales and INT32 bias, as they are
        np.testing.assert_array_equal(graph.initializers[qconv.inputs[1]], numpy_helper.to_array(
            next(t for t in model.graph.initializer if t.name == "w.q")))
        np.testing.assert_array_equal(graph.initializers[qconv.inputs[2]], numpy_helper.to_array(
            next(t for t in model.graph.initializer if t.name == "b.q")))
        # its output is read only by the int8 Q of the model: written INT8, that Q gone
        assert qconv.attrs["output_scale"] == float(np.float32(0.05))
        assert op_counts(graph).get("QuantizeLinear", 0) == 0 and graph.value_info[qconv.outputs[0]].dtype == "int8"
    if case == "relu_between_qdq":
        assert report.rewrites.get("drop_redundant_qdq") == 1 and qconv.attrs["activation"] == "Relu"
    if case == "residual":
        assert qconv.inputs[3] and qconv.attrs.get("residual_after_activation") is False
    _within_one_step(graph, model)


@pytest.mark.parametrize("case", ["asymmetric_activation", "weights_per_input_channel", "weight_zero_point",
                                  "float_weights", "dq_without_q", "q_and_dq_scales_differ"])
def test_fold_qdq_must_not_fire(case):
    kwargs = {"asymmetric_activation": {"act_zero_point": np.int8(5)},
              "weights_per_input_channel": {"weight_axis": 1},
              "weight_zero_point": {"weight_zero_point": 3},
              "float_weights": {"weight": "float"},
              "dq_without_q": {"input_q": False},
              "q_and_dq_scales_differ": {"second_scale": 0.031}}[case]
    model = qdq_conv_model(**kwargs)
    graph = import_graph(model)
    report = optimize(graph, verify=True)
    assert "fold_qdq" not in report.rewrites and "QConv" not in op_counts(graph)
    why = {"asymmetric_activation": "activation zero point 5 (int8) of in.Q is asymmetric",
           "weights_per_input_channel": "w.DQ scales weights along axis 1, not per output channel",
           "weight_zero_point": "weight zero point 3 (int8) of w.DQ is not symmetric",
           "float_weights": "its weights are not a DequantizeLinear output",
           "dq_without_q": None,
           "q_and_dq_scales_differ": "in.Q → in.DQ do not share one constant float32 scale"}[case]
    if why:
        assert any(why in note and "layer conv (Conv) not folded" in note for note in report.notes), report.notes
    _within_one_step(graph, model)


def test_dq_on_an_int8_graph_input_is_left_alone():
    nodes = [helper.make_node("DequantizeLinear", ["xq", "s", "z"], ["x"], name="dq"),
             helper.make_node("Conv", ["x", "w"], ["y"], name="conv")]
    inits = [numpy_helper.from_array(np.float32(0.1), "s"), numpy_helper.from_array(np.int8(0), "z"),
             numpy_helper.from_array(np.ones((2, 1, 1, 1), np.float32), "w")]
    model = make_model(nodes, [helper.make_tensor_value_info("xq", TensorProto.INT8, [1, 1, 2, 2])],
                       [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 2, 2, 2])], inits)
    graph = import_graph(model)
    assert fold_qdq(graph) == 0
    feeds = {"xq": np.array([[[[-128, -1], [0, 127]]]], np.int8)}
    np.testing.assert_array_equal(run_sartor(graph, feeds)["y"], run_ort(model, feeds)["y"])


def _relu_chain(second_scale=0.05, extra_reader=False, zero_point=INT8_ZERO, op="Relu"):
    """x → Q → DQ → Relu/Clip → Q' → DQ' → y (and optionally the first DQ read by a second output)."""
    nodes, inits = [], []
    a = _q(nodes, inits, "x", "a", 0.05, zero_point)
    clip_inputs = [a]
    if op == "Clip":
        inits += [numpy_helper.from_array(np.float32(-0.3), "lo"), numpy_helper.from_array(np.float32(0.42), "hi")]
        clip_inputs += ["lo", "hi"]
    nodes.append(helper.make_node(op, clip_inputs, ["r"], name="act"))
    b = _q(nodes, inits, "r", "b", second_scale, zero_point)
    nodes.append(helper.make_node("Identity", [b], ["y"], name="out"))
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 128])]
    if extra_reader:
        nodes.append(helper.make_node("Neg", [a], ["z"], name="neg"))
        outputs.append(helper.make_tensor_value_info("z", TensorProto.FLOAT, [4, 128]))
    return make_model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 128])], outputs, inits)


@pytest.mark.parametrize("op", ["Relu", "Clip"])
@pytest.mark.parametrize("zero_point", [np.int8(0), np.uint8(128)])
def test_drop_redundant_qdq_fires_and_is_exact(op, zero_point):
    model = _relu_chain(op=op, zero_point=zero_point)
    graph = import_graph(model)
    assert drop_redundant_qdq(graph) == 1
    assert op_counts(graph)["QuantizeLinear"] == 1
    rng = np.random.default_rng(0)
    # values on and around every code boundary, the clip bounds and the saturation limits
    x = np.concatenate([(np.arange(-140, 140) + 0.5) * 0.05, rng.standard_normal(232) * 4])
    feeds = {"x": x.astype(np.float32).reshape(4, 128)}
    np.testing.assert_array_equal(run_sartor(graph, feeds)["y"], run_ort(model, feeds)["y"])


@pytest.mark.parametrize("case", ["second_scale_differs", "first_pair_read_elsewhere", "asymmetric"])
def test_drop_redundant_qdq_must_not_fire(case):
    model = {"second_scale_differs": lambda: _relu_chain(second_scale=0.07),
             "first_pair_read_elsewhere": lambda: _relu_chain(extra_reader=True),
             "asymmetric": lambda: _relu_chain(zero_point=np.int8(3))}[case]()
    graph = import_graph(model)
    assert drop_redundant_qdq(graph) == 0
