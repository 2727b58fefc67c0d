"""Engines whose INT8 layers run the kernel tactics of sessions 13 and 14 (the stem's pixel windows,
by the implicit GEMM or the resident-window kernel, the resident-weight 1×1 kernel, cuBLAS's int8
GEMM through torch with the Triton epilogue, the implicit GEMM with its epilogue in column halves,
input boxes by TMA bulk copies), built, saved, loaded and run end to end (on the CPU under Triton's
interpreter, or on a GPU): the outputs equal those of the engine built with the emulation
alone, bit for bit.

The builder offers these tactics where they apply on a GPU (on the CPU, the emulation only). Here
the QConv op's candidates are those kernel tactics, and their timings are made to lose against
nothing, so that the engine stores them. What is checked is everything around the kernels: the
weights each tactic packs and the engine file keeps, the executor's call of the tactic, the layout
of the network input."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import onnx
import pytest
import torch
from conftest import make_model, save
from onnx import TensorProto, helper, numpy_helper

pytest.importorskip("triton")

import sartor  # noqa: E402
from sartor.kernels.conv.igemm import TileConfig  # noqa: E402
from sartor.kernels.conv.tma import TmaTile  # noqa: E402
from sartor.kernels.gemm.resident import ResidentTile  # noqa: E402
from sartor.kernels.window.resident import WindowResidentTile  # noqa: E402
from sartor.ops import default_registry  # noqa: E402
from sartor.ops.quantized_library import INT_MM  # noqa: E402
from sartor.ops.quantized_window import WINDOW_TILES, window_tactic  # noqa: E402
from sartor.runtime.engine_file import read_engine_file  # noqa: E402
from sartor.tactics import select  # noqa: E402

# Layer: (weight shape, the tactic it is given).
FORCED = {"stem": ((16, 3, 7, 7), window_tactic(WINDOW_TILES[0]).name),
          "mix": ((16, 16, 1, 1), ResidentTile(16, 32, 3, 1, 1).name),
          "proj": ((32, 16, 1, 1), INT_MM),
          "refine": ((32, 32, 3, 3), TmaTile(4, 8, 32, 32, 1, 1).name),
          "head": ((24, 32, 3, 3), TileConfig(16, 32, 32, 1, 1, epilogue_halves=True).name)}
# The stem's other window tactic: the resident-window kernel, small enough for the interpreter.
RESIDENT_WINDOW = WindowResidentTile(ResidentTile(16, 16, 2, 1, 1), kh_steps=True)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the CPU runs the kernels under Triton's interpreter
SHAPES = {"min_shapes": {"x": (1, 3, 12, 12)}, "opt_shapes": {"x": (2, 3, 12, 12)}, "max_shapes": {"x": (2, 3, 12, 12)}}


def _model() -> onnx.ModelProto:
    """stem: 7×7 stride 2 over 3 channels, ReLU; mix: 1×1 16 → 16 with the stem as residual, ReLU;
    proj: 1×1 16 → 32, ReLU; refine: 3×3 32 → 32 with proj as residual, ReLU; head: 3×3 32 → 24."""
    rng = np.random.default_rng(3)

    def weight(name, *shape):
        fan_in = int(np.prod(shape[1:]))
        return numpy_helper.from_array((rng.standard_normal(shape) / np.sqrt(fan_in)).astype(np.float32), name)

    inits = [weight(f"{layer}.w", *shape) for layer, (shape, _) in FORCED.items()]
    inits += [numpy_helper.from_array((rng.standard_normal(shape[0]) * 0.1).astype(np.float32), f"{layer}.b")
              for layer, (shape, _) in FORCED.items()]
    nodes = [helper.make_node("Conv", ["x", "stem.w", "stem.b"], ["s"], name="stem", strides=[2, 2], pads=[3, 3, 3, 3]),
             helper.make_node("Relu", ["s"], ["sr"], name="stem_relu"),
             helper.make_node("Conv", ["sr", "mix.w", "mix.b"], ["m"], name="mix"),
             helper.make_node("Add", ["m", "sr"], ["ma"], name="mix_add"),
             helper.make_node("Relu", ["ma"], ["mr"], name="mix_relu"),
             helper.make_node("Conv", ["mr", "proj.w", "proj.b"], ["p"], name="proj"),
             helper.make_node("Relu", ["p"], ["pr"], name="proj_relu"),
             helper.make_node("Conv", ["pr", "refine.w", "refine.b"], ["r"], name="refine", pads=[1, 1, 1, 1]),
             helper.make_node("Add", ["r", "pr"], ["ra"], name="refine_add"),
             helper.make_node("Relu", ["ra"], ["rr"], name="refine_relu"),
             helper.make_node("Conv", ["rr", "head.w", "head.b"], ["y"], name="head", pads=[1, 1, 1, 1])]
    model = make_model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 3, 12, 12])],
                       [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 24, 6, 6])], inits)
    onnx.checker.check_model(model)
    return model


@pytest.fixture
def forced_kernel_tactics(monkeypatch):
    """QConv's candidates: the emulation and the one kernel tactic FORCED names for the layer, which
    then wins its timing whenever it matched the emulation."""
    registry = default_registry()
    key = ("sartor", "QConv")
    opdef = registry._defs[key]

    def tactics(inputs, attrs, effort=2):
        for shape, tactic in FORCED.values():
            if tuple(inputs[1].shape) == shape:
                return ["torch", tactic]
        return ["torch"]

    monkeypatch.setitem(registry._defs, key, replace(opdef, tactics=tactics))
    real = select._time_candidates

    def kernels_first(*args, **kwargs):
        timings, rejected = real(*args, **kwargs)
        if len(timings) > 1:
            timings["torch"] = 1e9
        return timings, rejected
    monkeypatch.setattr(select, "_time_candidates", kernels_first)


@pytest.mark.parametrize("stem_tactic", [FORCED["stem"][1], window_tactic(RESIDENT_WINDOW).name])
def test_engine_with_kernel_tactics_equals_the_emulation_engine(tmp_path, forced_kernel_tactics, monkeypatch,
                                                                stem_tactic):
    monkeypatch.setitem(FORCED, "stem", (FORCED["stem"][0], stem_tactic))
    model = save(_model(), tmp_path / "model.onnx")
    calib = tmp_path / "calib.npy"
    np.save(calib, np.random.default_rng(4).standard_normal((8, 3, 12, 12)).astype(np.float32))
    # The head feeds the output: kept out of INT8 unless asked.
    common = dict(device=DEVICE, precision="int8", calib=str(calib), calib_size=8, calib_cache=str(tmp_path / "c.json"),
                  layer_precision={"head": "int8"}, **SHAPES)
    sartor.build(model, tmp_path / "kernels.plan", builder_effort=1, **common)
    header, _ = read_engine_file(tmp_path / "kernels.plan")
    stored = {node["name"]: node["attrs"].get("tactic") for node in header["graph"]["nodes"] if node["op"] == "QConv"}
    assert stored == {layer: tactic for layer, (_, tactic) in FORCED.items()}, stored
    sartor.build(model, tmp_path / "emulation.plan", builder_effort=0, **common)
    x = torch.from_numpy(np.random.default_rng(5).standard_normal((2, 3, 12, 12)).astype(np.float32))
    kernels = sartor.load(tmp_path / "kernels.plan").context().run({"x": x.to(DEVICE)})["y"].cpu()
    emulation = sartor.load(tmp_path / "emulation.plan").context().run({"x": x.to(DEVICE)})["y"].cpu()
    assert torch.equal(kernels, emulation)
    assert kernels.abs().max() > 0
