"""passes/fuse_stem_max_pool.py and the pooled window tiles (`kernels/window/resident.py`, `_mp`): an
INT8 stem carrying the 3 × 3 / 2 max pool that alone read its codes. Where the pass fires the graph
computes exactly what it computed before, by the emulation, by a layer's other tactics followed by
the pool, and by the pooled kernel (under Triton's interpreter on the CPU, compiled on a GPU);
where it must not fire the graph is left alone; a built engine carries the pool and still tracks
ONNX Runtime."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from passes_helpers import OnnxBuilder, build_int8_cpu, quantized_graph, run_ort, run_quantized

import sartor
from sartor.builder.pipeline import _tactic
from sartor.frontend.onnx import import_model_proto
from sartor.ir import verify_graph
from sartor.ir.graph import Node
from sartor.kernels.registry import TacticNameError, tactic_for
from sartor.kernels.gemm.resident import ResidentTile
from sartor.kernels.window.resident import (POOLED_TILES, WindowResidentTile, narrow_tiles, pooled_row_groups,
                                            pooled_steps, window_resident_conv, window_resident_tiles)
from sartor.ops import default_registry, quantized
from sartor.ops.conv import igemm_geometry
from sartor.ops.fused_pool import fused_max_pool, max_pool_label, pool_in_kernel
from sartor.ops.quantized import qconv, qlayer_weight_for_tactic
from sartor.ops.quantized_window import window_pack, window_tactic, window_tactics
from sartor.ops.util import tensor_from_numpy
from sartor.passes import optimize
from sartor.passes.fuse_stem_max_pool import fuse_stem_max_pool
from sartor.tactics.timing_cache import layer_signature

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SIZE = 26  # stem output 13 × 13 (odd: the last pair's lower row lies outside), pooled 7 × 7
SHAPES = {"min": {"images": (1, 3, SIZE, SIZE)}, "opt": {"images": (2, 3, SIZE, SIZE)},
          "max": {"images": (4, 3, SIZE, SIZE)}}
POOL = dict(kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1])
# Interpreted kernels are slow: small tiles, a strip of 3 pooled columns and bands of 2 pairs.
SMALL_POOLED = WindowResidentTile(ResidentTile(8, 16, 2, 1, 1), kh_steps=True, row_pairs=True, max_pool=True)
# The balanced walk: 3 programs on each of the interpreter's 2 "multiprocessors" share the 2 images'
# 3 strips of 7 pairs, 7 steps each, crossing strips and images.
SMALL_BALANCED = WindowResidentTile(ResidentTile(8, 16, 3, 1, 1), kh_steps=True, row_pairs=True, max_pool=True,
                                    balanced=True)


def _images(seed: int, n: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, 3, SIZE, SIZE)).astype(np.float32)


def stem_model(pool: dict | None = None, stem_read_twice: bool = False, wide_stem: bool = False,
               pool_indices: bool = False, activation: str = "Relu"):
    """ResNet's stem in small: 7 × 7 / 2 convolution (3 → 8 channels) → activation → max pool →
    3 × 3 convolution → 1 × 1 head (float, as the last layer stays). The variants break one
    condition each."""
    b = OnnxBuilder(seed=7)
    x = b.input("images", ["batch", 3, SIZE, SIZE])
    if wide_stem:  # the stem reads 6 channels: no window tile runs it
        x = b.node("Relu", [b.conv(x, 3, 6, "pre", k=1)], name="pre_act")
    stem = b.conv(x, 6 if wide_stem else 3, 8, "stem", k=7, strides=[2, 2])
    if activation:
        stem = b.node(activation, [stem], name="stem_act")
    pooled = b.node("MaxPool", [stem], name="pool", outputs=2 if pool_indices else 1, **(pool or POOL))
    if pool_indices:
        pooled = pooled[0]
    block = b.node("Relu", [b.conv(pooled, 8, 8, "block")], name="block_act")  # INT8: the pool passes codes
    outputs = [b.conv(block, 8, 4, "head", k=1)]
    if stem_read_twice:
        outputs.append(b.conv(stem, 8, 4, "side", k=1))
    if pool_indices:
        outputs.append(b.node("Cast", ["pool_out1"], name="indices", to=1))
    return b.model(outputs)


def _quantized(model, precision: str = "int8"):
    return quantized_graph(model, [{"images": _images(10 + k, 4)} for k in range(3)], precision)


def _run(graph, layers, images: np.ndarray) -> dict:
    return run_quantized(graph, layers, {"images": images})


def _stem(graph) -> Node:
    return next(n for n in graph.nodes if n.op_type == "QConv" and n.name == "stem")


def test_fires_and_computes_what_the_unfused_graph_did():
    graph, layers = _quantized(stem_model())
    unfused = _run(graph.copy(), layers, _images(20, 3))
    pool_output = next(n for n in graph.nodes if n.op_type == "MaxPool").outputs[0]
    assert fuse_stem_max_pool(graph) == 1
    verify_graph(graph)
    assert not any(n.op_type == "MaxPool" for n in graph.nodes)
    stem = _stem(graph)
    assert stem.outputs == [pool_output] and stem.origin[-1] == "pool"
    assert fused_max_pool(stem.attrs) == POOL and pool_in_kernel(fused_max_pool(stem.attrs))
    fused = _run(graph, layers, _images(20, 3))
    assert fused.keys() == unfused.keys()
    for name, value in unfused.items():
        assert torch.equal(fused[name], value), name
    assert fuse_stem_max_pool(graph) == 0  # the layer carries its pool already


@pytest.mark.parametrize("variant", [
    pytest.param(dict(pool=dict(kernel_shape=[2, 2], strides=[2, 2])), id="pool-2x2"),
    pytest.param(dict(pool=dict(POOL, ceil_mode=1)), id="ceil-mode"),
    pytest.param(dict(pool=dict(POOL, pads=[0, 0, 1, 1])), id="other-pads"),
    pytest.param(dict(stem_read_twice=True), id="stem-read-twice"),
    pytest.param(dict(wide_stem=True), id="six-channel-stem"),
    pytest.param(dict(pool_indices=True), id="pool-indices"),
])
def test_does_not_fire(variant):
    graph, _ = _quantized(stem_model(**variant))
    before = [(n.op_type, list(n.inputs), list(n.outputs)) for n in graph.nodes]
    assert any(n.op_type == "MaxPool" for n in graph.nodes)
    assert fuse_stem_max_pool(graph) == 0
    assert [(n.op_type, list(n.inputs), list(n.outputs)) for n in graph.nodes] == before


def test_does_not_fire_on_fp8_or_float_layers():
    graph, _ = _quantized(stem_model(), "fp8")
    assert fuse_stem_max_pool(graph) == 0
    graph = import_model_proto(stem_model())
    optimize(graph)
    assert fuse_stem_max_pool(graph) == 0


def _pooled_layer_inputs(activation: str = "Relu"):
    """The fused stem's inputs (the float images) and attributes."""
    graph, layers = _quantized(stem_model(activation=activation))
    assert fuse_stem_max_pool(graph) == 1
    stem = _stem(graph)
    weights = {k: tensor_from_numpy(v) for k, v in graph.initializers.items()}
    env = {**weights, "images": torch.from_numpy(_images(21, 2))}
    return [env[name] if name else None for name in stem.inputs], dict(stem.attrs)


@pytest.mark.parametrize("activation", ["Relu", None], ids=["relu", "no-activation"])
def test_pooled_kernel_equals_the_emulation(activation):
    """Under Triton's interpreter on the CPU (conftest), compiled on a GPU; without an activation
    the codes are negative too, and the pool's padding must lose to every one of them."""
    pytest.importorskip("triton")
    inputs, attrs = _pooled_layer_inputs(activation)
    reference = qconv(inputs, dict(attrs, tactic="torch"))
    assert reference.shape == (2, 8, 7, 7) and reference.dtype == torch.int8
    if activation is None:
        assert int(reference.min()) < 0
    for form, tile in ((False, SMALL_POOLED), (True, SMALL_POOLED), (False, SMALL_BALANCED), (True, SMALL_BALANCED)):
        tactic = window_tactic(tile, space_to_depth=form).name
        args = [t.to(DEVICE) if t is not None else None for t in inputs]
        args[1] = qlayer_weight_for_tactic(inputs[1], tactic).to(DEVICE)
        got = qconv(args, dict(attrs, tactic=tactic))
        assert got.shape == reference.shape and got.is_contiguous(memory_format=torch.channels_last)
        assert torch.equal(got.cpu(), reference), tactic


def test_narrow_pooled_tiles_equal_the_emulation():
    """The builder's pooled tiles narrowed for the stem's 8 channels (256 × 16: strips of 127 pooled
    columns, banded and balanced) pool as the 64-wide ones do."""
    pytest.importorskip("triton")
    inputs, attrs = _pooled_layer_inputs()
    reference = qconv(inputs, dict(attrs, tactic="torch"))
    for tile in narrow_tiles(list(POOLED_TILES[:2]), 8):
        for form in (False, True):
            tactic = window_tactic(tile, space_to_depth=form).name
            args = [t.to(DEVICE) if t is not None else None for t in inputs]
            args[1] = qlayer_weight_for_tactic(inputs[1], tactic).to(DEVICE)
            assert torch.equal(qconv(args, dict(attrs, tactic=tactic)).cpu(), reference), tactic


def test_other_tactics_run_the_layer_then_the_pool():
    """An unpooled window tile: the layer's codes, then the pool (Triton's on CUDA)."""
    pytest.importorskip("triton")
    inputs, attrs = _pooled_layer_inputs()
    reference = qconv(inputs, dict(attrs, tactic="torch"))
    tactic = window_tactic(window_resident_tiles(1)[0]).name
    args = [t.to(DEVICE) if t is not None else None for t in inputs]
    args[1] = qlayer_weight_for_tactic(inputs[1], tactic).to(DEVICE)
    assert torch.equal(qconv(args, dict(attrs, tactic=tactic)).cpu(), reference)


def test_pooled_tactics_are_offered_for_pooled_stems_only(monkeypatch):
    """QConv lists kernel tactics for CUDA tensors only; here the geometry check lets CPU ones
    through, as the interpreter runs the kernels."""
    monkeypatch.setattr(quantized, "_igemm_geometry",
                        lambda x, w, attrs, gemm: igemm_geometry(x, w, attrs, require_cuda=False))
    inputs, attrs = _pooled_layer_inputs()
    registry = default_registry()["QConv"]
    pooled = registry.tactics(inputs, attrs, 1)
    # The stem's 8 channels: each pooled tile also narrowed to 16 columns (`narrow_tiles`).
    tiles = [*POOLED_TILES[:3], *narrow_tiles(list(POOLED_TILES[:3]), 8)]
    expected = [window_tactic(tile, form).name for form in (False, True) for tile in tiles]
    assert sum(".balanced" in name for name in expected) == 4  # the balanced walk from effort 1
    assert sum(".256x16." in name for name in expected) == 6
    assert [name for name in pooled if tactic_for(name).fuses_max_pool] == expected
    assert window_tactics(1, space_to_depth=True, max_pool=True, out_channels=8) == [
        n for n in pooled if n.startswith("window_")]
    plain = {key: value for key, value in attrs.items() if not key.startswith("max_pool_")}
    assert not any(tactic_for(name).fuses_max_pool for name in registry.tactics(inputs, plain, 1))
    other_pool = dict(attrs, max_pool_kernel_shape=[2, 2], max_pool_pads=[0, 0, 0, 0])
    assert not any(tactic_for(name).fuses_max_pool for name in registry.tactics(inputs, other_pool, 1))
    float_out = dict(attrs, output_inv_scale=None)
    assert not any(tactic_for(name).fuses_max_pool for name in registry.tactics(inputs, float_out, 1))


def test_pooled_tactic_refused_where_the_layer_does_not_pool_so():
    inputs, attrs = _pooled_layer_inputs()
    tactic = window_tactic(SMALL_POOLED).name
    args = list(inputs)
    args[1] = qlayer_weight_for_tactic(inputs[1], tactic)
    plain = {key: value for key, value in attrs.items() if not key.startswith("max_pool_")}
    with pytest.raises(ValueError, match="carries no max pool"):
        qconv(args, dict(plain, tactic=tactic))
    with pytest.raises(ValueError, match="pools 3x3/2 with padding 1"):
        qconv(args, dict(attrs, tactic=tactic, max_pool_kernel_shape=[2, 2], max_pool_pads=[0, 0, 0, 0]))


def test_pooled_kernel_refuses_a_residual_float_output_or_fp8():
    pytest.importorskip("triton")
    inputs, attrs = _pooled_layer_inputs()
    x, w, bias, _, scale = [t.to(DEVICE) if t is not None else None for t in inputs]
    w_window = qlayer_weight_for_tactic(w, window_tactic(SMALL_POOLED).name)
    geometry = igemm_geometry(x, w, attrs, require_cuda=False)
    packed = window_pack(x, w_window, geometry, torch.int8, attrs["input_inv_scale"], -127)
    common = dict(geometry=geometry, dequant_scale=scale)
    with pytest.raises(ValueError, match="pools INT8 output codes"):
        window_resident_conv(packed, w_window, bias, SMALL_POOLED, **common)  # float output
    with pytest.raises(ValueError, match="pools INT8 output codes"):
        window_resident_conv(packed, w_window, bias, SMALL_POOLED, residual=torch.zeros(2, 8, 13, 13, device=DEVICE),
                             output_inv_scale=2.0, **common)
    with pytest.raises(ValueError, match="pools INT8 output codes"):
        window_resident_conv(packed, w_window, bias, SMALL_POOLED, output_inv_scale=2.0, fp8=True, **common)


def test_pooled_tile_names_round_trip_and_malformed_ones_are_refused():
    for tile in (*POOLED_TILES, SMALL_POOLED, SMALL_BALANCED):
        tactic = window_tactic(tile).name
        assert tactic.endswith(".kh-steps.row-pairs.max-pool" + (".balanced" if tile.balanced else ""))
        assert tactic_for(tactic).tile == tile
    for bad in ("window_resident.64x64.t8.w4.s2.max-pool", "window_resident.64x64.t8.w4.s2.kh-steps.max-pool",
                "window_resident.64x64.t8.w4.s2.kh-steps.row-pairs.max-pool.max-pool",
                "window_resident.64x64.t8.w4.s2.kh-steps.max-pool.row-pairs",
                "window_resident.2x16.t2.w1.s1.kh-steps.row-pairs.max-pool",
                "window_resident.64x64.t3.w4.s2.grouped.kh-steps.balanced",
                "window_resident.64x64.t3.w4.s2.kh-steps.row-pairs.max-pool.balanced.balanced",
                "window_resident.64x64.t3.w4.s2.grouped.kh-steps.row-pairs.max-pool.balanced"):
        with pytest.raises(TacticNameError):
            tactic_for(bad)
    with pytest.raises(ValueError, match="walks row pairs"):
        WindowResidentTile(ResidentTile(64, 64, 8, 4, 2), kh_steps=True, max_pool=True)
    with pytest.raises(ValueError, match="balanced walk runs on a 2-D grid"):
        WindowResidentTile(ResidentTile(64, 64, 3, 4, 2, n_adjacent=True), kh_steps=True, row_pairs=True,
                           balanced=True)
    # Unpooled tiles walk balanced too (tests/kernels/test_kernels_window.py runs them).
    unpooled = WindowResidentTile(ResidentTile(64, 64, 3, 4, 2), kh_steps=True, row_pairs=True, balanced=True)
    assert tactic_for(window_tactic(unpooled).name).tile == unpooled
    # ResNet-50 at batch 256: 2 strips of 31 pooled columns, 7 bands of 8 pairs; balanced, 3 programs
    # on each of the H200's 132 multiprocessors, or one a step where there are fewer steps.
    banded, balanced = POOLED_TILES[1], POOLED_TILES[0]
    assert pooled_row_groups(banded, 256, (112, 112), 132) == 256 * 2 * 7
    assert pooled_row_groups(balanced, 256, (112, 112), 132) == 396 and pooled_steps(balanced, 256, (112, 112)) == 28672
    assert pooled_row_groups(balanced, 1, (112, 112), 132) == 112  # batch 1: 2 strips of 56 pairs


def test_timing_identity_and_description():
    inputs, attrs = _pooled_layer_inputs()
    signature = layer_signature("QConv", inputs, attrs, "int8", False)
    assert "pool=3x3/2,2/1,1,1,1" in signature and max_pool_label(attrs) == "3x3/2,2/1,1,1,1"
    plain = {key: value for key, value in attrs.items() if not key.startswith("max_pool_")}
    assert "pool=" not in layer_signature("QConv", inputs, plain, "int8", False) and max_pool_label(plain) is None
    cpu = torch.device("cpu")
    pooled_words = _tactic(Node("QConv", "stem", ["x"], ["y"], dict(attrs, tactic=window_tactic(SMALL_POOLED).name)), cpu)
    assert pooled_words.endswith("max pool 3x3/2,2/1,1,1,1 in the epilogue (only pooled codes stored)")
    assert _tactic(Node("QConv", "stem", ["x"], ["y"], dict(attrs, tactic="torch")), cpu).endswith(
        "then max pool 3x3/2,2/1,1,1,1 (torch)")
    assert "max pool" not in _tactic(Node("QConv", "stem", ["x"], ["y"], dict(plain, tactic="torch")), cpu)


def test_engine_carries_the_pool_and_tracks_onnxruntime(tmp_path):
    model = stem_model()
    result = build_int8_cpu(model, tmp_path, _images(30, 24), [SHAPES])
    assert any("max pool(s) carried by the stem" in line for line in result.log)
    engine = sartor.load(tmp_path / "model.plan", device="cpu")
    assert not any(n.op_type == "MaxPool" for n in engine.graph.nodes)
    assert fused_max_pool(_stem(engine.graph).attrs) == POOL
    images = _images(31, 2)
    got = next(iter(engine.context().run({"images": images}).values()))
    expected = run_ort(model, {"images": images})["head_out"]
    assert np.abs(got - expected).max() <= 0.05 * np.abs(expected).max()
