"""Whole architectures through `sartor.build` → `sartor.load` → run, against ONNX Runtime.

Every model is exported locally (tests/model_zoo.py: random seeded weights, nothing downloaded),
built for the CPU with one profile (batch 1..2, opt 2), run at batch 2 and compared with ONNX
Runtime FP32: max|ours - ref| / max|ref| <= 1e-4 on every output.
"""
from __future__ import annotations

import collections

import numpy as np
import onnx
import pytest

import sartor
from model_zoo import ZooModel, all_models, zoo_directory
from passes_helpers import OnnxBuilder, max_rel_error, run_ort

RTOL = 1e-4

# name -> (activation, residual_after_activation) epilogues that must show up among the layers.
# None as the activation means a FusedConv that only carries a residual.
EXPECTED_EPILOGUES = {
    "resnet18": {("Relu", None), ("Relu", False)},
    "resnet50": {("Relu", None), ("Relu", False)},
    "mobilenet_v2": {("Clip", None), (None, False)},
    "mobilenet_v3_large": {("HardSwish", None), ("HardSigmoid", None), ("Relu", None), (None, False)},
    "efficientnet_b0": {("SiLU", None), ("Sigmoid", None), (None, False)},
    "regnet_y_400mf": {("Relu", None), ("Relu", False), ("Sigmoid", None)},
    "convnext_tiny": set(),  # depthwise conv → LayerNorm: nothing to fuse into a conv
    "densenet121": {("Relu", None)},
    "shufflenet_v2_x0_5": {("Relu", None)},
    "squeezenet1_0": {("Relu", None)},
    "vgg11": {("Relu", None)},
    "googlenet": {("Relu", None)},
    "yolov8n": {("SiLU", None), ("SiLU", True)},
    "yolo11n": {("SiLU", None), ("SiLU", True)},
    "ppocr_v4_det": {("Relu", None), ("HardSigmoid", None)},
}
# Layers that must be gone after optimisation. DenseNet's BatchNorms come before their convs
# (BN → ReLU → Conv), so they stay; PP-OCR keeps one BatchNorm after a ConvTranspose.
NO_LEFTOVER = {name: {"BatchNormalization", "Erf", "Identity", "Dropout"} for name in EXPECTED_EPILOGUES}
NO_LEFTOVER["densenet121"] = {"Erf", "Identity", "Dropout"}
NO_LEFTOVER["ppocr_v4_det"] = {"Erf", "Identity", "Dropout"}
# Layer ops that prove a particular pass did its job on that architecture.
EXPECTED_OPS = {
    "convnext_tiny": {"Gelu"},  # x * 0.5 * (1 + erf(x / sqrt 2)) recognised
    "vgg11": {"FusedGemm"},  # Linear → ReLU in the classifier
    "mobilenet_v3_large": {"FusedGemm"},
}


# Passes that must report rewrites in the build log. The torchvision exports keep their
# BatchNormalization nodes (model_zoo exports with TrainingMode.PRESERVE), so fold_batchnorm has work.
_BN_NETS = ("resnet18", "resnet50", "mobilenet_v2", "mobilenet_v3_large", "efficientnet_b0", "regnet_y_400mf",
            "densenet121", "shufflenet_v2_x0_5", "googlenet")
EXPECTED_PASSES = {name: {"fuse_conv_activation"} for name in EXPECTED_EPILOGUES}
EXPECTED_PASSES["convnext_tiny"] = {"fuse_activation_patterns"}
for _name in _BN_NETS:
    EXPECTED_PASSES[_name] = EXPECTED_PASSES[_name] | {"fold_batchnorm"}
for _name in ("resnet18", "resnet50", "mobilenet_v2", "regnet_y_400mf", "efficientnet_b0", "yolov8n", "yolo11n"):
    EXPECTED_PASSES[_name] = EXPECTED_PASSES[_name] | {"fuse_residual_add"}
EXPECTED_PASSES["ppocr_v4_det"] = {"fuse_conv_activation", "fuse_activation_patterns"}


@pytest.fixture(scope="session")
def zoo_dir(tmp_path_factory):
    return zoo_directory(tmp_path_factory.mktemp("model_zoo"))


@pytest.fixture(scope="session")
def zoo(zoo_dir):
    """name -> ZooModel, each exported on first use (once per session)."""
    makers = all_models(zoo_dir)
    cache: dict[str, ZooModel] = {}

    def get(name: str) -> ZooModel:
        if name not in cache:
            cache[name] = makers[name]()
        return cache[name]
    return get


def _build(model: ZooModel, out, precision: str = "fp32", **kwargs):
    return sartor.build(str(model.path), str(out), device="cpu", precision=precision,
                        min_shapes=model.shapes(1), opt_shapes=model.shapes(2), max_shapes=model.shapes(2),
                        **kwargs)


@pytest.mark.parametrize("name", list(EXPECTED_EPILOGUES))
def test_model_matches_onnxruntime_fp32(name, zoo, tmp_path):
    model = zoo(name)
    result = _build(model, tmp_path / f"{name}.plan")
    engine = sartor.load(result.path)
    assert engine.device.type == "cpu"

    feeds = model.feeds(batch=2, seed=0)
    ours = engine.context().run(feeds)
    ref = run_ort(str(model.path), feeds)
    assert set(ours) == set(ref), f"outputs {sorted(ours)} != ONNX Runtime's {sorted(ref)}"
    for out_name, expected in ref.items():
        assert ours[out_name].dtype == expected.dtype
        assert np.all(np.isfinite(ours[out_name])), f"{name}/{out_name} has non-finite values"
        err = max_rel_error(ours[out_name], expected)
        assert err <= RTOL, f"{name}/{out_name}: max relative error {err:.3g} > {RTOL}"

    # Fusion happened, and what fused is what the architecture calls for.
    layers = engine.layers
    assert result.layers == len(layers)
    assert result.layers < result.onnx_nodes, f"{name}: {result.layers} layers from {result.onnx_nodes} nodes"
    ops = collections.Counter(layer["op"] for layer in layers)
    epilogues = {(layer["attrs"].get("activation"), layer["attrs"].get("residual_after_activation"))
                 for layer in layers if layer["op"] in ("FusedConv", "FusedGemm")}
    missing = EXPECTED_EPILOGUES[name] - epilogues
    assert not missing, f"{name}: no fused layer with {sorted(missing, key=str)}; found {sorted(epilogues, key=str)}"
    leftover = NO_LEFTOVER[name] & set(ops)
    assert not leftover, f"{name}: {sorted(leftover)} left unfused/unremoved ({dict(ops)})"
    assert EXPECTED_OPS.get(name, set()) <= set(ops), f"{name}: expected {EXPECTED_OPS[name]} among {dict(ops)}"
    fired = {line.split()[1].rstrip(":") for line in result.log if line.startswith("pass ")}
    assert EXPECTED_PASSES[name] <= fired, f"{name}: passes {sorted(EXPECTED_PASSES[name] - fired)} did not fire"
    # Every ONNX node is accounted for exactly once across the layers' origins.
    origins = [o for layer in layers for o in layer["origin"]]
    assert len(origins) == len(set(origins)), f"{name}: an ONNX node appears in two layers"
    assert all(layer["precision"] == "fp32" for layer in layers)


@pytest.mark.parametrize("name", ["resnet18", "mobilenet_v3_large"])
def test_model_fp16_on_cpu(name, zoo, tmp_path):
    model = zoo(name)
    result = _build(model, tmp_path / f"{name}_fp16.plan", precision="fp16")
    engine = sartor.load(result.path)
    precisions = collections.Counter(layer["precision"] for layer in engine.layers)
    assert precisions["fp16"] > 0.9 * len(engine.layers), dict(precisions)

    feeds = model.feeds(batch=2, seed=1)
    ours = engine.context().run(feeds)
    ref = run_ort(str(model.path), feeds)
    for out_name, expected in ref.items():
        got = ours[out_name]
        assert got.dtype == np.float32  # outputs keep their declared dtype
        assert np.all(np.isfinite(got))
        a, b = got.astype(np.float64).ravel(), expected.astype(np.float64).ravel()
        cosine = float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))
        assert cosine >= 0.999, f"{name}/{out_name}: cosine similarity {cosine:.6f} < 0.999"


def _overflow_model(path) -> str:
    """conv → ×1e5 → ÷1e5 → sigmoid: the product exceeds FP16's 65504 although the result does not."""
    b = OnnxBuilder(seed=5)
    x = b.input("input", ["batch", 4, 8, 8])
    c = b.conv(x, 4, 4, "conv")
    big = b.node("Mul", [c, b.scalar(1e5, "scale_up")], name="scale_up")
    back = b.node("Div", [big, b.scalar(1e5, "scale_down")], name="scale_down")
    y = b.node("Sigmoid", [back], name="sigmoid")
    onnx.save(b.model([y]), str(path))
    return str(path)


def test_fp16_overflow_guard_keeps_layer_fp32(tmp_path):
    source = _overflow_model(tmp_path / "overflow.onnx")
    shapes = {"input": (1, 4, 8, 8)}
    opt = {"input": (2, 4, 8, 8)}
    result = sartor.build(source, str(tmp_path / "guarded.plan"), device="cpu", precision="fp16",
                          min_shapes=shapes, opt_shapes=opt, max_shapes=opt)
    engine = sartor.load(result.path)
    layers = {layer["origin"][0]: layer for layer in engine.layers}
    up = layers["scale_up"]
    assert up["precision"] == "fp32", up
    assert "overflow" in up["reason"].lower(), up
    # The layer reading the large values stays FP32 as well; the rest runs FP16.
    assert layers["scale_down"]["precision"] == "fp32" and "overflow" in layers["scale_down"]["reason"].lower()
    assert engine.layers[0]["precision"] == "fp16"  # the conv (it fused nothing: Mul is not an activation)
    assert layers["sigmoid"]["precision"] == "fp16"
    assert any("overflow" in line.lower() for line in result.log)

    feeds = {"input": np.random.default_rng(0).random((2, 4, 8, 8), dtype=np.float32)}
    ours = engine.context().run(feeds)["sigmoid_out"]
    ref = run_ort(source, feeds)["sigmoid_out"]
    assert np.all(np.isfinite(ours))
    np.testing.assert_allclose(ours, ref, atol=2e-3)

    # Without the guard the product overflows FP16: proof that the guard is what kept it finite.
    unguarded = sartor.build(source, str(tmp_path / "unguarded.plan"), device="cpu", precision="fp16",
                             min_shapes=shapes, opt_shapes=opt, max_shapes=opt, overflow_guard=False)
    raw = sartor.load(unguarded.path)
    assert all(layer["precision"] == "fp16" for layer in raw.layers)
    assert not np.allclose(raw.context().run(feeds)["sigmoid_out"], ref, atol=2e-3)
