"""Helpers for the pass tests: build small ONNX graphs, import them, run sartor and ONNX Runtime.

Not a test module (no test_ prefix); the pass tests (`tests/passes/test_<pass>.py`) import it.
"""
from __future__ import annotations

import math

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

from sartor.frontend.onnx import import_model_proto
from sartor.ir import Graph, verify_graph
from sartor.runtime.executor import Executor

FLOAT = TensorProto.FLOAT


class OnnxBuilder:
    """Accumulates nodes and seeded random weights, then makes a checked ModelProto.

        b = OnnxBuilder(seed=0)
        x = b.input("x", [1, 3, 8, 8])
        y = b.node("Conv", [x, b.weight("w", [4, 3, 3, 3])], name="conv", pads=[1, 1, 1, 1])
        model = b.model([y])
    """

    def __init__(self, seed: int = 0, opset: int = 17) -> None:
        self.rng = np.random.default_rng(seed)
        self.opset = opset
        self.nodes: list[onnx.NodeProto] = []
        self.inputs: list[onnx.ValueInfoProto] = []
        self.initializers: list[onnx.TensorProto] = []
        self.input_shapes: dict[str, list] = {}
        self._count = 0

    def _fresh(self, base: str) -> str:
        self._count += 1
        return f"{base}_{self._count}"

    def input(self, name: str, shape: list, elem_type: int = FLOAT) -> str:
        self.inputs.append(helper.make_tensor_value_info(name, elem_type, shape))
        self.input_shapes[name] = list(shape)
        return name

    def const(self, name: str, array) -> str:
        self.initializers.append(numpy_helper.from_array(np.asarray(array), name))
        return name

    def scalar(self, value: float, name: str | None = None, dtype=np.float32) -> str:
        return self.const(name or self._fresh("c"), np.asarray(value, dtype=dtype))

    def weight(self, name: str, shape: list, scale: float = 0.3, low: float | None = None) -> str:
        if low is None:
            array = self.rng.standard_normal(shape) * scale
        else:  # uniform in [low, low + scale): BN variances and scales
            array = low + self.rng.random(shape) * scale
        return self.const(name, array.astype(np.float32))

    def node(self, op_type: str, inputs: list, name: str | None = None, outputs: int | list = 1, **attrs):
        name = name or self._fresh(op_type.lower())
        if isinstance(outputs, int):
            outputs = [name + "_out" if outputs == 1 else f"{name}_out{i}" for i in range(outputs)]
        self.nodes.append(helper.make_node(op_type, inputs, outputs, name=name, **attrs))
        return outputs[0] if len(outputs) == 1 else outputs

    # ---- common blocks -------------------------------------------------------------
    def conv(self, x: str, cin: int, cout: int, name: str, k: int = 3, bias: bool = True, **attrs) -> str:
        inputs = [x, self.weight(name + "_w", [cout, cin, k, k])]
        if bias:
            inputs.append(self.weight(name + "_b", [cout], scale=0.1))
        attrs.setdefault("pads", [k // 2] * 4)
        return self.node("Conv", inputs, name=name, **attrs)

    def batchnorm(self, x: str, channels: int, name: str, epsilon: float = 1e-5) -> str:
        scale = self.weight(name + "_scale", [channels], scale=1.0, low=0.5)
        bias = self.weight(name + "_bias", [channels], scale=0.2)
        mean = self.weight(name + "_mean", [channels], scale=0.2)
        var = self.weight(name + "_var", [channels], scale=1.0, low=0.5)
        return self.node("BatchNormalization", [x, scale, bias, mean, var], name=name, epsilon=epsilon)

    def model(self, outputs: list[str], output_shapes: dict | None = None) -> onnx.ModelProto:
        output_shapes = output_shapes or {}
        outs = [helper.make_tensor_value_info(o, FLOAT, output_shapes.get(o)) for o in outputs]
        graph = helper.make_graph(self.nodes, "pass_test", self.inputs, outs, self.initializers)
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", self.opset)])
        model.ir_version = 8 if self.opset <= 17 else 9
        # Graph outputs need a shape field: take the ranks and dims shape inference finds.
        inferred = onnx.shape_inference.infer_shapes(model)
        known = {vi.name: vi for vi in list(inferred.graph.value_info) + list(inferred.graph.output)}
        for out in model.graph.output:
            if not out.type.tensor_type.HasField("shape") and known.get(out.name) is not None \
                    and known[out.name].type.tensor_type.HasField("shape"):
                out.type.CopyFrom(known[out.name].type)
        onnx.checker.check_model(model)
        return model

    def feeds(self, seed: int = 1, shapes: dict | None = None) -> dict[str, np.ndarray]:
        rng = np.random.default_rng(seed)
        shapes = dict(self.input_shapes, **(shapes or {}))
        return {name: rng.standard_normal(shape).astype(np.float32) for name, shape in shapes.items()}


# ---- running ------------------------------------------------------------------------------
def import_graph(model: onnx.ModelProto) -> Graph:
    graph = import_model_proto(model)
    verify_graph(graph)
    return graph


def run_sartor(graph: Graph, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    weights = {k: torch.from_numpy(np.array(v)) for k, v in graph.initializers.items()}
    executor = Executor(graph, weights, torch.device("cpu"))
    with torch.inference_mode():
        out = executor.run({k: torch.from_numpy(np.array(v)) for k, v in feeds.items()})
    return {k: v.cpu().numpy() for k, v in out.items()}


def run_ort(model: onnx.ModelProto | str, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    import onnxruntime as ort
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    options.intra_op_num_threads = 2
    options.log_severity_level = 3
    source = model if isinstance(model, str) else model.SerializeToString()
    session = ort.InferenceSession(source, options, providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    return dict(zip(names, session.run(names, feeds)))


def max_rel_error(actual: np.ndarray, expected: np.ndarray) -> float:
    """max|a - b| / max|b| (0 when both are all zeros)."""
    actual = np.asarray(actual, dtype=np.float64)
    expected = np.asarray(expected, dtype=np.float64)
    assert actual.shape == expected.shape, f"shape {actual.shape} != reference {expected.shape}"
    diff = float(np.max(np.abs(actual - expected))) if expected.size else 0.0
    scale = float(np.max(np.abs(expected))) if expected.size else 0.0
    if scale == 0.0:
        return diff
    return diff / scale


def assert_matches_ort(graph: Graph, model: onnx.ModelProto, feeds: dict, rtol: float = 1e-4) -> None:
    """Every graph output of `graph` matches ONNX Runtime on `model` within rtol (max-relative)."""
    ours = run_sartor(graph, feeds)
    ref = run_ort(model, feeds)
    assert set(ours) == set(ref), f"outputs {sorted(ours)} != reference {sorted(ref)}"
    for name, expected in ref.items():
        err = max_rel_error(ours[name], expected)
        assert np.all(np.isfinite(ours[name])), f"output {name} has non-finite values"
        assert err <= rtol, f"output {name}: max relative error {err:.3g} > {rtol}"


def nodes_of(graph: Graph, op_type: str) -> list:
    return [n for n in graph.nodes if n.op_type == op_type]


def op_counts(graph: Graph) -> dict[str, int]:
    counts: dict[str, int] = {}
    for node in graph.nodes:
        counts[node.op_type] = counts.get(node.op_type, 0) + 1
    return counts


def quantized_graph(model: onnx.ModelProto, calibration: list[dict], precision: str = "int8") -> tuple[Graph, dict]:
    """`model` imported, optimized, calibrated (min-max) on the `calibration` feeds and quantized as
    the builder plans it: (graph, {layer: precision}). The passes that run after quantization (the
    QConv rewrites) are the caller's to run."""
    from sartor.ops.util import tensor_from_numpy
    from sartor.passes import optimize
    from sartor.quant import calibrate
    from sartor.quant.plan import int8_decisions
    from sartor.quant.quantize import quantize_graph
    graph = import_model_proto(model)
    optimize(graph)
    weights = {k: tensor_from_numpy(v) for k, v in graph.initializers.items()}
    amax = calibrate(graph, weights, calibration, method="minmax")
    layers = {name: p for name, (p, _) in int8_decisions(graph, "fp32", precision).items()}
    quantize_graph(graph, layers, amax)
    return graph, layers


def run_quantized(graph: Graph, layers: dict, feeds: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
    """A quantized graph's outputs on the CPU (the emulation), by name."""
    from sartor.ops.util import tensor_from_numpy
    weights = {k: tensor_from_numpy(v) for k, v in graph.initializers.items()}
    with torch.inference_mode():
        return Executor(graph, weights, torch.device("cpu"), layers).run(
            {name: torch.from_numpy(value) for name, value in feeds.items()})


def build_int8_cpu(model: onnx.ModelProto, work, calibration: np.ndarray, profiles: list):
    """`model` saved as work/model.onnx, calibrated on the `calibration` images and built INT8 for
    the CPU into work/model.plan: the build result."""
    import sartor
    onnx.save(model, str(work / "model.onnx"))
    np.save(work / "calib.npy", calibration)
    return sartor.build(work / "model.onnx", work / "model.plan", device="cpu", profiles=profiles, precision="int8",
                        calib=work / "calib.npy")


# ---- shared by the pass tests: one pass applied, a pass that must not fire, spelled-out activations ----

def apply_pass(model, rewrite, expect_fired: bool):
    """Import, run one pass, check its count and the graph's structure; returns (graph, count)."""
    graph = import_graph(model)
    count = rewrite(graph)
    if expect_fired:
        assert count > 0, f"{rewrite.__name__} did not fire"
    else:
        assert count == 0, f"{rewrite.__name__} fired {count} time(s) where it must not"
    verify_graph(graph)
    return graph, count


def assert_unchanged(model, rewrite, feeds=None):
    """The pass must not fire; the graph keeps every node and still computes the same."""
    before = import_graph(model)
    graph, _ = apply_pass(model, rewrite, expect_fired=False)
    assert [n.op_type for n in graph.nodes] == [n.op_type for n in before.nodes]
    assert_matches_ort(graph, model, feeds if feeds is not None else random_feeds(model))
    return graph


def random_feeds(model, seed: int = 1) -> dict:
    rng = np.random.default_rng(seed)
    feeds = {}
    inits = {t.name for t in model.graph.initializer}
    for vi in model.graph.input:
        if vi.name in inits:
            continue
        shape = [d.dim_value if d.HasField("dim_value") else 2 for d in vi.type.tensor_type.shape.dim]
        feeds[vi.name] = rng.standard_normal(shape).astype(np.float32)
    return feeds


def spelled_gelu(b: OnnxBuilder, x: str, order: str, x_operand_first: bool = True, scale_by: str = "Div") -> str:
    if scale_by == "Div":
        scaled = b.node("Div", [x, b.scalar(math.sqrt(2.0))], name="gelu_div")
    else:
        scaled = b.node("Mul", [x, b.scalar(1 / math.sqrt(2.0))], name="gelu_div")
    erf = b.node("Erf", [scaled], name="gelu_erf")
    one = b.node("Add", [erf, b.scalar(1.0)] if x_operand_first else [b.scalar(1.0), erf], name="gelu_add")
    if order == "x_then_half":  # (x * (1 + erf)) * 0.5, as torch.onnx exports F.gelu
        prod = b.node("Mul", [x, one] if x_operand_first else [one, x], name="gelu_mul_x")
        return b.node("Mul", [prod, b.scalar(0.5)] if x_operand_first else [b.scalar(0.5), prod], name="gelu_mul_half")
    half = b.node("Mul", [one, b.scalar(0.5)] if x_operand_first else [b.scalar(0.5), one], name="gelu_mul_half")
    return b.node("Mul", [half, x] if x_operand_first else [x, half], name="gelu_mul_x")


def spelled_hardswish(b: OnnxBuilder, x: str, divide: bool = True, bounds=(0.0, 6.0), clip_inputs=None,
               three_first: bool = False) -> str:
    added = b.node("Add", [b.scalar(3.0), x] if three_first else [x, b.scalar(3.0)], name="hs_add")
    bounds_in = clip_inputs or [b.scalar(bounds[0]), b.scalar(bounds[1])]
    clipped = b.node("Clip", [added] + bounds_in, name="hs_clip")
    prod = b.node("Mul", [x, clipped], name="hs_mul")
    if divide:
        return b.node("Div", [prod, b.scalar(6.0)], name="hs_scale")
    return b.node("Mul", [prod, b.scalar(1 / 6)], name="hs_scale")


def small_timm_swin(tmp_path) -> onnx.ModelProto:
    """timm's Swin at 112 pixels, two stages of two blocks, 7×7 windows (one shifted block a stage),
    seeded, exported as sartor's users do (opset 17, dynamic batch); skips without timm."""
    timm = pytest.importorskip("timm")
    torch.manual_seed(0)
    model = timm.create_model("swin_tiny_patch4_window7_224", pretrained=False, num_classes=10, img_size=112,
                              embed_dim=32, depths=(2, 2), num_heads=(2, 4), window_size=7).eval()
    path = tmp_path / "swin.onnx"
    torch.onnx.export(model, torch.randn(1, 3, 112, 112), str(path), opset_version=17, dynamo=False,
                      input_names=["input"], output_names=["output"], dynamic_axes={"input": {0: "b"}})
    return onnx.load(str(path))
