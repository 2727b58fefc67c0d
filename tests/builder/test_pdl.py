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
from sartor.builder.pdl import mark_programmatic_launch
from sartor.errors import SartorError
from sartor.ir import Graph
from sartor.ir.graph import Node
from sartor.ops.quantized import own_kernel_tactic
from sartor.runtime.engine import rebuild_command

SHAPES = {"min_shapes": {"x": (1, 8, 6, 6)}, "opt_shapes": {"x": (1, 8, 6, 6)}, "max_shapes": {"x": (1, 8, 6, 6)}}


def test_only_quantized_layers_whose_kernels_wait_are_marked():
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
                         node("FusedConv", "float", tactic="igemm.64x64x32.w4.s4")],
                  inputs=[], outputs=[], initializers={})
    assert mark_programmatic_launch(graph) == 5
    assert [n.name for n in graph.nodes if n.attrs.get("pdl")] == ["igemm", "resident", "tma", "fc",
                                                                   "one_profile_kernel"]
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
    ({"precision": "fp16"}, r"--pdl launches the INT8 \(FP8\) layers' kernels .* needs --precision int8 or fp8, not fp16"),
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
    from sartor.cli.build import config_from_args
    from sartor.cli.main import make_parser
    args = make_parser().parse_args(["build", "m.onnx", "-o", "m.plan", "--precision", "int8", "--pdl"])
    config = config_from_args(args)
    assert config.pdl
    assert not config_from_args(make_parser().parse_args(["build", "m.onnx", "-o", "m.plan"])).pdl
    header = {"build_config": config.to_json()}
    assert rebuild_command(header).split().count("--pdl") == 1
    assert "--pdl" not in rebuild_command({"build_config": dict(config.to_json(), pdl=False)})


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
