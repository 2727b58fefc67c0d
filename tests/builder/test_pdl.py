"""--pdl (`sartor/builder/pdl.py`, `sartor/kernels/common/pdl.py`): which layers are marked, the refusals a
user can reach, the flag through the CLI, the API and the rebuild command, and (GPU, compute
capability 9.0+) that kernels launched with programmatic dependent launch compute what the others
do, also chained in a CUDA graph."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import make_model, save
from onnx import TensorProto, helper, numpy_helper

import sartor
from sartor.builder import engine_timing
from sartor.builder.pdl import mark_programmatic_launch
from sartor.errors import SartorError
from sartor.ir import Graph
from sartor.ir.graph import Node
from sartor.ops.quantized import own_kernel_tactic
from sartor.runtime.engine import rebuild_command

SHAPES = {"min_shapes": {"x": (1, 8, 6, 6)}, "opt_shapes": {"x": (1, 8, 6, 6)}, "max_shapes": {"x": (1, 8, 6, 6)}}


def test_only_layers_whose_kernels_wait_are_marked():
    def node(op, name, **attrs):
        return Node(op, name, ["x"], [name], attrs)
    graph = Graph(nodes=[node("QConv", "igemm", tactic="igemm.64x64x64.w4.s4"),
                         node("QConv", "resident", tactic="resident.64x64.t8.w4.s3.grouped"),
                         node("QConv", "tma", tactic="tma.8x16x64x64.w4.s4.persistent1"),
                         node("QGemm", "fc", tactic="igemm.64x64x64.w4.s4.halves.residual-early"),
                         node("QConv", "emulation", tactic="torch"),
                         node("QConv", "cublas", tactic="cublas_int_mm"),
                         node("QConv", "window", tactic="window_igemm.128x64x32.w4.s4"),
                         node("QConv", "im2col", tactic="im2col_igemm.64x64x64.w4.s4"),
                         node("QConv", "untimed"),
                         node("QConv", "one_profile_kernel", tactic="torch",
                              tactic_by_profile=["torch", "igemm.64x64x64.w4.s4"]),
                         node("FusedConv", "float", tactic="igemm.64x64x32.w4.s4"),
                         node("FusedConv", "cudnn", tactic="cudnn_fused"),
                         node("FusedConv", "depthwise", tactic="triton_depthwise"),
                         node("QConv", "depthwise_int8", tactic="triton_depthwise_int8_words"),
                         node("QConv", "stem", tactic="triton_direct_stem_int8"),
                         node("QConv", "dp4a", tactic="triton_direct_int8_word_tiles"),
                         node("MaxPool", "pool", tactic="max_pool.elements1024.channels64.w4.loads-first"),
                         node("MaxPool", "torch_pool", tactic="torch"),
                         node("Resize", "upsample", tactic="triton_nhwc"),
                         node("Upsample", "torch_upsample", tactic="torch"),
                         node("DetectionHead", "decode", tactic="triton")],
                  inputs=[], outputs=[], initializers={})
    assert mark_programmatic_launch(graph) == 12
    assert [n.name for n in graph.nodes if n.attrs.get("pdl")] == [
        "igemm", "resident", "tma", "fc", "one_profile_kernel", "float", "depthwise", "depthwise_int8", "stem", "dp4a",
        "pool", "upsample"]
    assert not own_kernel_tactic(None) and not own_kernel_tactic("")
    assert own_kernel_tactic("igemm.64x64x64.w4.s4.padded-taps")


def _model(tmp_path):
    rng = np.random.default_rng(3)
    w = numpy_helper.from_array((rng.standard_normal((8, 8, 3, 3)) * 0.1).astype(np.float32), "w")
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], name="conv", pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c"], ["y"], name="relu")]
    model = make_model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 8, 6, 6])],
                       [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 8, 6, 6])], [w])
    calib = tmp_path / "calib.npy"
    np.save(calib, rng.standard_normal((4, 8, 6, 6)).astype(np.float32))
    return save(model, tmp_path / "m.onnx"), calib


@pytest.mark.parametrize("options,message", [
    ({"precision": "fp32"},
     r"--pdl launches sartor's own kernels .* needs --precision int8, fp8, fp16, bf16, not fp32"),
    ({"device": "cpu"}, r"--pdl \(programmatic dependent launch\) needs a CUDA device of compute capability 9.0"),
])
def test_refusals(tmp_path, options, message):
    model, calib = _model(tmp_path)
    kwargs = dict(device="cpu", precision="int8", calib=str(calib), calib_size=4, pdl=True, **SHAPES)
    kwargs.update(options)
    with pytest.raises(SartorError, match=message) as raised:
        sartor.build(model, tmp_path / "m.plan", **kwargs)
    assert "\n" not in str(raised.value)
    assert not (tmp_path / "m.plan").exists()


def test_the_cli_flag_reaches_the_config_and_the_rebuild_command():
    """--pdl: always; --no-pdl: never; neither: timed at the build (None). The rebuild command
    repeats what the build was told, so an engine built before the default was timed (pdl False)
    rebuilds as it was."""
    from sartor.cli.build import config_from_args
    from sartor.cli.main import make_parser

    def config(*flags):
        return config_from_args(make_parser().parse_args(["build", "m.onnx", "-o", "m.plan", "--precision", "int8",
                                                          *flags]))
    assert config("--pdl").pdl is True and config("--no-pdl").pdl is False and config().pdl is None
    for pdl, flags in ((True, ["--pdl"]), (False, ["--no-pdl"]), (None, [])):
        words = rebuild_command({"build_config": config().to_json() | {"pdl": pdl}}).split()
        assert [w for w in words if w.endswith("-pdl")] == flags


def test_pdl_is_kept_only_where_the_engine_is_a_margin_faster():
    from sartor.builder.pdl import PDL_MARGIN, pdl_wins
    assert pdl_wins([1.0], [0.95]) and pdl_wins([0.3, 2.0], [0.28, 1.99])
    assert not pdl_wins([1.0], [1.0]) and not pdl_wins([1.0], [PDL_MARGIN])  # within the margin: the plain launch
    assert not pdl_wins([0.3, 2.0], [0.2, 2.2])  # the profiles summed


def _two_layer_model(tmp_path):
    """conv (INT8) → relu → head (its output conv, kept float by decision 0045)."""
    rng = np.random.default_rng(4)
    weights = [numpy_helper.from_array((rng.standard_normal((8, 8, 3, 3)) * 0.1).astype(np.float32), name)
               for name in ("w", "wh")]
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], name="conv", pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c"], ["r"], name="relu"),
             helper.make_node("Conv", ["r", "wh"], ["y"], name="head", pads=[1, 1, 1, 1])]
    model = make_model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 8, 6, 6])],
                       [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 8, 6, 6])], weights)
    calib = tmp_path / "calib.npy"
    np.save(calib, rng.standard_normal((4, 8, 6, 6)).astype(np.float32))
    return save(model, tmp_path / "m2.onnx"), calib


@pytest.mark.parametrize("faster", [True, False], ids=["kept", "dropped"])
def test_a_default_build_times_the_engine_both_ways_and_keeps_the_faster(tmp_path, monkeypatch, faster):
    """The stage's plumbing on the CPU, as on a Hopper GPU: where the device has PDL (here told so)
    and a layer's kernel takes part (here every QConv and FusedConv), the build times the engine
    marked and unmarked (here a stand-in clock, faster for the marked one or not), keeps the marks
    only where they win, and records both times; --no-pdl and effort 0 time nothing."""
    import sartor.builder.pdl as pdl_module
    import sartor.builder.pipeline as pipeline
    model, calib = _two_layer_model(tmp_path)
    monkeypatch.setattr(pipeline, "pdl_available", lambda device: True)
    monkeypatch.setattr(pdl_module, "own_kernel_tactic", lambda tactic: True)
    runs = []

    def clock(context, feeds, device):
        marked = any(node.attrs.get("pdl") for node in context.engine.graph.nodes)
        runs.append(marked)
        return 0.9 if marked and faster else 1.0
    monkeypatch.setattr(engine_timing, "time_context", clock)
    kwargs = dict(device="cpu", precision="int8", calib=str(calib), calib_size=4, builder_effort=1, **SHAPES)
    result = sartor.build(model, tmp_path / "m.plan", **kwargs)
    record = result.header["pdl_check"]
    assert sorted(runs) == [False, False, True, True]  # ROUNDS each way
    assert record["kept"] is faster and record["profiles"] == [
        {"profile": 0, "without_ms": 1.0, "with_ms": 0.9 if faster else 1.0}] and "pdl check" in result.stage_seconds
    engine = sartor.load(tmp_path / "m.plan", device="cpu")
    marked = [node.name for node in engine.graph.nodes if node.attrs.get("pdl")]
    assert marked == (["conv", "head"] if faster else []) and record["layers"] == (2 if faster else 0)
    assert any(line.startswith("pdl: ") for line in result.header["build_log"])
    for options in ({"pdl": False}, {"builder_effort": 0}):
        runs.clear()
        quiet = sartor.build(model, tmp_path / "n.plan", **dict(kwargs, **options))
        assert "pdl_check" not in quiet.header and not runs


def test_an_engine_that_cannot_be_timed_with_pdl_is_built_without_it_and_says_why(tmp_path, monkeypatch):
    import sartor.builder.pdl as pdl_module
    import sartor.builder.pipeline as pipeline
    from sartor.cli.inspect import _pdl_summary
    model, calib = _two_layer_model(tmp_path)
    monkeypatch.setattr(pipeline, "pdl_available", lambda device: True)
    monkeypatch.setattr(pdl_module, "own_kernel_tactic", lambda tactic: True)

    def failing(context, feeds, device):
        raise RuntimeError("a PDL kernel failed to compile\nsecond line")
    monkeypatch.setattr(engine_timing, "time_context", failing)
    result = sartor.build(model, tmp_path / "m.plan", device="cpu", precision="int8", calib=str(calib), calib_size=4,
                          builder_effort=1, **SHAPES)
    record = result.header["pdl_check"]
    assert record["kept"] is False and record["error"] == "RuntimeError: a PDL kernel failed to compile"
    assert any("pdl: not used, the engine could not be timed with it" in w for w in result.warnings)
    assert not any(node.attrs.get("pdl") for node in sartor.load(tmp_path / "m.plan", device="cpu").graph.nodes)
    assert "could not time" in _pdl_summary(result.header)["text"]


def test_inspect_says_how_pdl_was_decided():
    from sartor.cli.inspect import _pdl_summary
    timed = {"margin": 0.99, "kept": True, "layers": 3,
             "profiles": [{"profile": 0, "with_ms": 0.29, "without_ms": 0.3}]}
    assert _pdl_summary({"pdl_check": timed})["text"] == (
        "3 layer(s), faster by the build's timing (profile 0 0.29 ms with, 0.3 ms without)")
    assert _pdl_summary({"pdl_check": dict(timed, kept=False, layers=0)})["text"].startswith("off, not faster")
    assert _pdl_summary({"build_config": {"pdl": True}})["text"].endswith("(--pdl)")
    assert _pdl_summary({"build_config": {"pdl": False}})["text"] == "off (--no-pdl)"
    assert _pdl_summary({"build_config": {}})["text"].startswith("off (not timed")


def _hopper() -> bool:
    from sartor.kernels.common.pdl import pdl_available
    return torch.cuda.is_available() and pdl_available("cuda")


@pytest.mark.skipif(not _hopper(), reason="programmatic dependent launch needs a CUDA device of compute capability 9.0+")
def test_pdl_kernels_equal_the_others_chained_in_a_cuda_graph():
    """Three layers in a row, each reading the one before (and the first's output again as the
    third's residual), launched with PDL inside one CUDA graph, replayed: the same codes as the
    ordinary launches."""
    from sartor.kernels.conv.igemm import ConvGeometry, TileConfig, conv_igemm, pack_weight
    from sartor.kernels.conv.tma import TmaTile, conv_tma
    from sartor.kernels.gemm.resident import ResidentTile, resident_gemm
    generator = torch.Generator(device="cuda").manual_seed(5)
    x = torch.randint(-127, 128, (2, 64, 16, 16), dtype=torch.int8, device="cuda", generator=generator)
    x = x.contiguous(memory_format=torch.channels_last)
    w3 = pack_weight(torch.randint(-127, 128, (64, 64, 3, 3), dtype=torch.int8, device="cuda", generator=generator))
    w1 = pack_weight(torch.randint(-127, 128, (64, 64, 1, 1), dtype=torch.int8, device="cuda", generator=generator))
    bias = torch.randint(-1000, 1000, (64,), dtype=torch.int32, device="cuda", generator=generator)
    scale = torch.full((64,), 2e-4, device="cuda")
    same = ConvGeometry((3, 3), (1, 1), (1, 1), (1, 1), (16, 16))
    epilogue = dict(dequant_scale=scale, activation="Relu", output_inv_scale=1.0)

    def chain(pdl: bool) -> torch.Tensor:
        a = conv_igemm(x, w3, bias, same, TileConfig(64, 64, 64, 4, 4), pdl=pdl, **epilogue)
        b = conv_tma(a, w3, bias, same, TmaTile(8, 16, 64, 64, 4, 4), pdl=pdl, **epilogue)
        return resident_gemm(b, w1, bias, ResidentTile(64, 64, 8, 4, 3, n_adjacent=True), residual=a,
                             residual_scale=1.0, pdl=pdl, **epilogue)
    expected = chain(False)
    assert torch.equal(chain(True), expected)
    chain(True)  # compiled outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = chain(True)
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, expected)


@pytest.mark.skipif(not _hopper(), reason="programmatic dependent launch needs a CUDA device of compute capability 9.0+")
def test_pool_upsample_stem_dp4a_and_depthwise_kernels_under_pdl_equal_the_others_in_a_cuda_graph():
    """A detector's small kernels in a row, each reading the one before: the INT8 stem on the CUDA cores, a
    dp4a convolution, a max pool into half of a Concat buffer, a ×2 upsample, the INT8 depthwise in words and
    code by code, and on FP16 the depthwise, pool and upsample; launched with PDL inside one CUDA graph,
    replayed: the same values as the ordinary launches."""
    from sartor.kernels.conv.depthwise import (depthwise_conv_nhwc, depthwise_qconv_nhwc, depthwise_tile_for,
                                               pack_depthwise_weight)
    from sartor.kernels.conv.direct_stem import direct_stem_conv, tap_words
    from sartor.kernels.conv.direct_words import direct_int8_words_conv
    from sartor.kernels.conv.igemm import ConvGeometry
    from sartor.kernels.pointwise.resize import upsample_nearest_nhwc
    from sartor.kernels.pool.max_pool import SMALL_POOL_LOADS_FIRST, max_pool_nhwc
    generator = torch.Generator(device="cuda").manual_seed(6)

    def codes(*shape):
        return torch.randint(-127, 128, shape, dtype=torch.int8, device="cuda", generator=generator)
    image = torch.rand((2, 3, 64, 64), device="cuda", generator=generator)
    nhwc = torch.channels_last
    w_stem, w_dense = tap_words(codes(16, 3, 3, 3)), codes(16, 16, 3, 3).contiguous(memory_format=nhwc)
    w_depth = pack_depthwise_weight(codes(32, 1, 3, 3))
    w_half = pack_depthwise_weight((torch.randn((16, 1, 3, 3), device="cuda", generator=generator) / 100).half())
    bias16, bias32 = (torch.randint(-500, 500, (c,), dtype=torch.int32, device="cuda", generator=generator)
                      for c in (16, 32))
    half_bias = torch.randn((16,), device="cuda", generator=generator).half()
    stride2 = ConvGeometry((3, 3), (2, 2), (1, 1), (1, 1), (32, 32))
    at32, at64 = (ConvGeometry((3, 3), (1, 1), (1, 1), (1, 1), (s, s)) for s in (32, 64))

    def chain(pdl: bool) -> tuple[torch.Tensor, torch.Tensor]:
        def int8(c):
            return dict(dequant_scale=torch.full((c,), 1e-3, device="cuda"), output_inv_scale=8.0, activation="SiLU",
                        pdl=pdl)
        a = direct_stem_conv(image, w_stem, bias16, stride2, input_inv_scale=100.0, **int8(16))
        b = direct_int8_words_conv(a, w_dense, bias16, at32, tactic="triton_direct_int8_word_tiles", **int8(16))
        buffer = torch.empty((2, 32, 32, 32), dtype=torch.int8, device="cuda").contiguous(memory_format=nhwc)
        buffer[:, :16] = b
        max_pool_nhwc(b, (5, 5), (1, 1), (2, 2), (1, 1), (32, 32), out=buffer[:, 16:], tile=SMALL_POOL_LOADS_FIRST,
                      pdl=pdl)
        c = upsample_nearest_nhwc(buffer, (2, 2), pdl=pdl)
        d = depthwise_qconv_nhwc(c, w_depth, bias32, at64, input_inv_scale=1.0,
                                 tile=depthwise_tile_for("triton_depthwise_int8_words"), **int8(32))
        e = depthwise_qconv_nhwc(d, w_depth, bias32, at64, input_inv_scale=1.0, **int8(32))
        f = depthwise_conv_nhwc(b.half(), w_half, half_bias, at32, activation="SiLU", pdl=pdl)
        g = max_pool_nhwc(f, (3, 3), (1, 1), (1, 1), (1, 1), (32, 32), pdl=pdl)
        return e, upsample_nearest_nhwc(g, (2, 2), pdl=pdl)
    expected = chain(False)
    assert all(torch.equal(got, want) for got, want in zip(chain(True), expected))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = chain(True)
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    assert all(torch.equal(got, want) for got, want in zip(captured, expected))
    assert expected[0].abs().sum() > 0 and expected[1].abs().sum() > 0  # not a chain of zeros


@pytest.mark.skipif(not _hopper(), reason="programmatic dependent launch needs a CUDA device of compute capability 9.0+")
def test_a_default_int8_build_on_hopper_records_both_times_and_runs_as_the_cpu_engine(tmp_path):
    """Without --pdl, a Hopper INT8 build times its engine with and without PDL (when its INT8
    layer's kernel takes part), marks the layer only if PDL won, and the engine computes what the
    CPU engine does."""
    model, calib = _two_layer_model(tmp_path)
    kwargs = dict(precision="int8", calib=str(calib), calib_size=4, builder_effort=1, **SHAPES)
    result = sartor.build(model, tmp_path / "gpu.plan", device="cuda", **kwargs)
    engine = sartor.load(tmp_path / "gpu.plan", device="cuda")
    conv = next(node for node in engine.graph.nodes if node.name == "conv")
    record = result.header.get("pdl_check")
    if own_kernel_tactic(conv.attrs.get("tactic")):
        assert record is not None and all(p["with_ms"] > 0 and p["without_ms"] > 0 for p in record["profiles"])
        assert bool(conv.attrs.get("pdl")) is record["kept"]
    else:
        assert record is None and not conv.attrs.get("pdl")
    sartor.build(model, tmp_path / "cpu.plan", device="cpu", **kwargs)
    x = np.random.default_rng(5).standard_normal((1, 8, 6, 6)).astype(np.float32)
    got = engine.context().run({"x": x})["y"]
    expected = sartor.load(tmp_path / "cpu.plan", device="cpu").context().run({"x": x})["y"]
    np.testing.assert_allclose(got, expected, rtol=1e-2, atol=1e-2)
