"""passes/fuse_projected_residual.py: a quantized downsample computed inside the layer that reads it
as residual. Where it fires, the engine computes exactly what the unfused graph computes with the
downsample's output kept in float32; where it must not fire, the graph is left alone; the resident
kernel with the projection fused (and the split route) equals the emulation under Triton's
interpreter; a built engine carries it and still tracks ONNX Runtime."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch
from passes_helpers import OnnxBuilder, build_int8_cpu, quantized_graph, run_ort, run_quantized

import sartor
from sartor.cli.inspect import epilogue
from sartor.frontend.onnx import import_model_proto
from sartor.ir import verify_graph
from sartor.kernels.gemm.resident import RESIDENT_TILES, resident_gemm
from sartor.ops import quantized
from sartor.ops.quantized import SPLIT_TACTIC, projected_tactics, qconv
from sartor.ops.util import tensor_from_numpy
from sartor.passes import optimize
from sartor.passes.fuse_projected_residual import fuse_projected_residual
from sartor.runtime.executor import Executor
from sartor.tactics.select import _mismatch
from sartor.tactics.timing_cache import layer_signature

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SIZE = 12
SHAPES = {"min": {"images": (1, 3, SIZE, SIZE)}, "opt": {"images": (2, 3, SIZE, SIZE)},
          "max": {"images": (4, 3, SIZE, SIZE)}}


def _images(seed: int, n: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, 3, SIZE, SIZE)).astype(np.float32)


def bottleneck(downsample_k: int = 1, downsample_act: bool = False, downsample_read_twice: bool = False,
               mid: int = 4, wide: int = 16):
    """ResNet's first bottleneck of a stage in small: stem → (1×1 to `mid`, 3×3 stride 2, 1×1 to
    `wide`) + downsample (`downsample_k`², stride 2) → ReLU → head. The variants break one condition
    each."""
    b = OnnxBuilder(seed=5)
    x = b.input("images", ["batch", 3, SIZE, SIZE])
    stem = b.node("Relu", [b.conv(x, 3, 8, "stem")], name="stem_act")
    c1 = b.node("Relu", [b.conv(stem, 8, mid, "c1", k=1)], name="c1_act")
    c2 = b.node("Relu", [b.conv(c1, mid, mid, "c2", strides=[2, 2])], name="c2_act")
    c3 = b.conv(c2, mid, wide, "c3", k=1)
    ds = b.conv(stem, 8, wide, "ds", k=downsample_k, strides=[2, 2])
    if downsample_act:
        ds = b.node("Relu", [ds], name="ds_act")
    out = b.node("Relu", [b.node("Add", [c3, ds], name="add")], name="out")
    outputs = [b.conv(out, wide, 4, "head", k=1)]
    if downsample_read_twice:
        outputs.append(b.conv(ds, wide, 4, "side", k=1))
    return b.model(outputs)


def _quantized(model, precision: str = "int8"):
    return quantized_graph(model, [{"images": _images(10 + k, 4)} for k in range(3)], precision)


def _run(graph, layers, images: np.ndarray) -> torch.Tensor:
    return next(iter(run_quantized(graph, layers, {"images": images}).values()))


def _float_downsample(graph) -> None:
    """The unfused graph as the fused layer computes it: the downsample writes float32 and its
    reader adds that."""
    nodes = {n.name: n for n in graph.nodes}
    nodes["ds"].attrs.update(output_scale=None, output_inv_scale=None)
    nodes["c3"].attrs["residual_scale"] = None
    graph.value_info.pop(nodes["ds"].outputs[0], None)


@pytest.mark.parametrize("precision", ["int8", "fp8"])
def test_fires_and_computes_the_unfused_graph_with_a_float_downsample(precision):
    graph, layers = _quantized(bottleneck(), precision)
    reference = graph.copy()
    _float_downsample(reference)
    quantized_residual = _run(graph.copy(), layers, _images(20, 3))
    assert fuse_projected_residual(graph) == 1
    verify_graph(graph)
    assert "ds" not in {n.name for n in graph.nodes}
    fused = next(n for n in graph.nodes if n.name == "c3")
    assert len(fused.inputs) == 9 and fused.inputs[3] == "" and fused.inputs[5] == "stem_act_out"
    assert fused.attrs["projection_strides"] == [2, 2] and fused.attrs["residual_scale"] is None
    out = _run(graph, layers, _images(20, 3))
    assert torch.equal(out, _run(reference, layers, _images(20, 3)))
    # Against the engine whose downsample wrote INT8: one rounding of the residual fewer.
    assert float((out - quantized_residual).abs().max()) <= 0.05 * float(quantized_residual.abs().max())


@pytest.mark.parametrize("variant", [dict(downsample_k=3), dict(downsample_act=True), dict(downsample_read_twice=True),
                                     dict(mid=272)])  # the reader's K over MAX_RESIDENT_K
def test_does_not_fire(variant):
    graph, _ = _quantized(bottleneck(**variant))
    before = [(n.op_type, list(n.inputs)) for n in graph.nodes]
    assert fuse_projected_residual(graph) == 0
    assert [(n.op_type, list(n.inputs)) for n in graph.nodes] == before


def test_does_not_fire_on_layers_folded_from_qdq():
    graph, _ = _quantized(bottleneck())
    for node in graph.nodes:  # as fold_qdq marks them
        node.attrs["qmin"] = -128
    assert fuse_projected_residual(graph) == 0


def test_does_not_fire_on_a_graph_input():
    """A downsample reading the graph input itself (its reader at stride 1 on the same size)."""
    b = OnnxBuilder(seed=6)
    x = b.input("images", ["batch", 3, SIZE, SIZE])
    c = b.conv(b.node("Relu", [b.conv(x, 3, 8, "c1", k=1)], name="c1_act"), 8, 16, "c3", k=1)
    out = b.node("Relu", [b.node("Add", [c, b.conv(x, 3, 16, "ds", k=1)], name="add")], name="out")
    graph, _ = _quantized(b.model([b.conv(out, 16, 4, "head", k=1)]))
    assert any(n.name == "ds" for n in graph.nodes) and fuse_projected_residual(graph) == 0


def test_does_not_fire_on_float_layers():
    graph = import_model_proto(bottleneck())
    optimize(graph)
    assert fuse_projected_residual(graph) == 0


def _fused_layer_inputs(precision: str):
    """The fused layer's inputs and attributes, at the tensors it reads in the engine (codes,
    channels-last)."""
    graph, layers = _quantized(bottleneck(), precision)
    fuse_projected_residual(graph)
    seen = {}
    weights = {k: tensor_from_numpy(v) for k, v in graph.initializers.items()}
    with torch.inference_mode():
        Executor(graph, weights, torch.device("cpu"), layers).run(
            {"images": torch.from_numpy(_images(21, 2))},
            observe=lambda i, step, outs: seen.update({name: t for name, t in zip(step.node.outputs, outs) if name}))
    node = next(n for n in graph.nodes if n.name == "c3")
    env = {**weights, **seen}
    inputs = [env[name].contiguous(memory_format=torch.channels_last) if name in seen else env[name]
              if name else None for name in node.inputs]
    return inputs, dict(node.attrs)


@pytest.mark.parametrize("precision", ["int8", "fp8"])
def test_kernel_with_the_projection_equals_the_emulation(precision, monkeypatch):
    """Under Triton's interpreter on the CPU (conftest), compiled on a GPU."""
    pytest.importorskip("triton")
    inputs, attrs = _fused_layer_inputs(precision)
    inputs = [t.to(DEVICE) if t is not None else None for t in inputs]
    reference = qconv(inputs, dict(attrs, tactic="torch"))
    # bias and scale held by the program; the projection's too (proj-cols-loaded)
    columns_loaded = replace(RESIDENT_TILES[0], columns_loaded=True, n_adjacent=True)
    projection_columns = replace(columns_loaded, projection_columns_loaded=True)
    if DEVICE == "cuda":
        names = projected_tactics(inputs, attrs, 1)
        assert RESIDENT_TILES[0].name in names and names[-1] == SPLIT_TACTIC and projection_columns.name in names
    launches = []
    monkeypatch.setattr(quantized, "resident_gemm", lambda *a, **k: launches.append(k.get("projection")) or
                        resident_gemm(*a, **k))
    for tactic, kernels in ((RESIDENT_TILES[0].name, 1), (columns_loaded.name, 1), (projection_columns.name, 1),
                            (SPLIT_TACTIC, 2)):
        launches.clear()
        got = qconv(inputs, dict(attrs, tactic=tactic))
        assert len(launches) == kernels and (launches[0] is not None) == (kernels == 1)  # the kernel ran, not the emulation
        assert got.dtype == reference.dtype and got.shape == reference.shape
        if precision == "fp8" and DEVICE == "cuda":
            # FP8 tensor cores accumulate in float32, the emulation exactly: the builder's check (the
            # H200 run of session 18 differed in the last bits of float32 outputs).
            assert _mismatch(got, reference) is None, tactic
        else:
            assert torch.equal(got.float(), reference.float()), tactic


def test_tactics_and_timing_identity():
    inputs, attrs = _fused_layer_inputs("int8")
    assert projected_tactics(inputs, attrs, 1) == []  # CPU tensors: the reference only
    signature = layer_signature("QConv", inputs, attrs, "int8", False)
    assert "projection=i8[2x8x12x12]:nhwc*i8[16x8x1x1]:contiguous@2,2" in signature
    plain = layer_signature("QConv", inputs[:5], dict(attrs), "int8", False)
    assert "projection" not in plain


def test_engine_carries_the_projection_and_tracks_onnxruntime(tmp_path):
    model = bottleneck()
    result = build_int8_cpu(model, tmp_path, _images(30, 24), [SHAPES])
    assert any("projected residuals" in line for line in result.log)
    engine = sartor.load(tmp_path / "model.plan", device="cpu")
    assert [n.name for n in engine.graph.nodes if len(n.inputs) == 9] == ["c3"]
    layer = next(layer for layer in engine.header["layers"] if layer["name"] == "c3")
    assert layer["origin"][-1] == "ds" and epilogue(layer["attrs"]) == "+ projected residual → Relu"  # inspect
    # passes/bound_accumulators.py ran after the fusion: the bound covers the projection's product.
    assert any("decode their int32 sums" in line for line in result.log)
    fused = next(n for n in engine.graph.nodes if n.name == "c3")
    assert 0 < fused.attrs["accumulator_bound"] < 2 ** 22
    images = _images(31, 2)
    got = next(iter(engine.context().run({"images": images}).values()))
    expected = run_ort(model, {"images": images})["head_out"]
    assert np.abs(got - expected).max() <= 0.05 * np.abs(expected).max()
