"""The transformer graphs that crashed in CUDA-graph capture (issue 34): a Swin-style model (window
padding computed with Mod from shapes, shifted windows) and a MobileViT-style one (bilinear
Resize), small timm configurations with random weights. On the CPU each engine matches ONNX
Runtime; on CUDA an FP16 engine captures its whole run (no layer left outside the graph), and its
replayed outputs match ONNX Runtime FP32."""
from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

import sartor

timm = pytest.importorskip("timm")
ort = pytest.importorskip("onnxruntime")

# name -> (timm model, constructor overrides, resolution). Small widths and depths keep a CPU build
# under ten seconds; the graph's structure (window partition, padding, shifts, Resize) is the full model's.
MODELS = {
    "swin": ("swin_tiny_patch4_window7_224",
             dict(img_size=112, embed_dim=32, depths=(2, 2), num_heads=(2, 4), window_size=7), 112),
    "mobilevit": ("mobilevit_xxs", {}, 64),
}


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    directory = tmp_path_factory.mktemp("transformers")
    paths = {}
    for key, (name, overrides, size) in MODELS.items():
        torch.manual_seed(0)
        model = timm.create_model(name, pretrained=False, num_classes=10, **overrides).eval()
        path = directory / f"{key}.onnx"
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.onnx.export(model, torch.randn(2, 3, size, size), str(path), opset_version=17,
                              input_names=["input"], output_names=["logits"], dynamic_axes={"input": {0: "b"}},
                              dynamo=False)
        paths[key] = (path, size)
    return paths


def _reference(path, x: np.ndarray) -> np.ndarray:
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return session.run(None, {"input": x})[0]


def _cosine(a: np.ndarray, b: np.ndarray) -> float:
    a, b = a.astype(np.float64).ravel(), b.astype(np.float64).ravel()
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


@pytest.mark.parametrize("key", sorted(MODELS))
def test_cpu_engine_matches_onnxruntime(exported, tmp_path, key):
    path, size = exported[key]
    shape = (2, 3, size, size)
    plan = tmp_path / f"{key}.plan"
    result = sartor.build(str(path), str(plan), device="cpu", precision="fp32",
                          min_shapes={"input": (1, 3, size, size)}, opt_shapes={"input": shape},
                          max_shapes={"input": shape}, builder_effort=0)
    if key == "swin":  # each block's window partition and reverse, a row gather each, folded into its LayerNorm
        assert "pass gather_rows: 8 rewrite(s)" in result.log and "pass fuse_layernorm_rows: 8 rewrite(s)" in result.log
        assert "RowGather" not in [layer["op"] for layer in result.header["layers"]]
    x = np.random.default_rng(1).standard_normal(shape).astype(np.float32)
    got = sartor.load(str(plan)).context().run({"input": x})["logits"]
    np.testing.assert_allclose(got, _reference(path, x), rtol=1e-4, atol=1e-4)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("key", sorted(MODELS))
def test_cuda_fp16_engine_captures_whole_and_matches(exported, tmp_path, key):
    path, size = exported[key]
    shape = (8, 3, size, size)
    plan = tmp_path / f"{key}.plan"
    result = sartor.build(str(path), str(plan), device="cuda", precision="fp16",
                          min_shapes={"input": (1, 3, size, size)}, opt_shapes={"input": shape},
                          max_shapes={"input": shape}, builder_effort=1)
    assert result.header["capture"] == {"checked": True, "eager_layers": []}
    engine = sartor.load(str(plan))
    context = engine.context()
    assert context.use_cuda_graphs
    x = np.random.default_rng(1).standard_normal(shape).astype(np.float32)
    first = context.run({"input": x})["logits"]
    again = context.run({"input": x})["logits"]  # the replay, not the capture's own run
    np.testing.assert_array_equal(first, again)
    assert engine.eager_layers == []
    assert _cosine(again, _reference(path, x)) >= 0.9999
