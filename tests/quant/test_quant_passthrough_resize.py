"""INT8 (and FP8) through a nearest Resize (sartor/quant/quantize.py), as in YOLO's necks: conv →
Resize ×2 → Concat with a lateral conv → conv. Where it fires and where it must not (linear
Resize, a float reader), that it computes exactly what the engine without it computes, that the
engine tracks ONNX Runtime; the Resize reference and the Triton kernel (Triton's interpreter on
CPU) on int8 and e4m3 codes, into a Concat's channel slice too."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from passes_helpers import OnnxBuilder, run_ort
from test_quant_passthrough import SIZE, _images, _quantized_runs, int8_engine_run

from sartor.frontend.onnx import import_model_proto
from sartor.passes import optimize
from sartor.quant.plan import int8_decisions
from sartor.quant.quantize import quantize_graph

CODES = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}


def upsample_neck(mode: str = "nearest", reader: str = "concat", coordinates: str = "asymmetric"):
    """conv (stride 2) → ReLU → Resize ×2 (`mode`) → Concat with a lateral conv → conv → head conv.
    `reader` "sigmoid" puts a float layer between the Resize and the Concat."""
    b = OnnxBuilder(seed=4)
    x = b.input("images", ["batch", 3, SIZE, SIZE])
    deep = b.node("Relu", [b.conv(x, 3, 6, "deep", strides=[2, 2])], name="deep_act")
    inputs = [deep, "", b.const("up_scales", np.array([1, 1, 2, 2], dtype=np.float32))]
    if coordinates == "tf_crop_and_resize":
        inputs[1] = b.const("up_roi", np.array([0, 0, 0, 0, 1, 1, 1, 1], dtype=np.float32))
    up = b.node("Resize", inputs, name="up", mode=mode, coordinate_transformation_mode=coordinates,
                nearest_mode="floor")
    if reader == "sigmoid":
        up = b.node("Sigmoid", [up], name="sig")
    side = b.node("Relu", [b.conv(x, 3, 4, "side")], name="side_act")
    cat = b.node("Concat", [up, side], name="cat", axis=1)
    z = b.node("Relu", [b.conv(cat, 10, 8, "fuse", k=1)], name="fuse_act")
    return b.model([b.conv(z, 8, 4, "head")])


# ---- it fires, and computes what the engine without it computes --------------------------------------

@pytest.mark.parametrize("precision", ["int8", "fp8"])
def test_nearest_resize_passes_codes_into_the_concat_and_changes_no_number(precision):
    runs = _quantized_runs(upsample_neck(), precision)
    report, graph, seen, out = runs[True]
    assert report["pass_through"] == {"up": precision, "cat": precision}
    code = CODES[precision]
    assert seen["deep_act_out"].dtype == code and seen["up_out"].dtype == code and seen["cat_out"].dtype == code
    nodes = {n.name: n for n in graph.nodes}
    scale = nodes["fuse"].attrs["input_scale"]
    assert nodes["deep"].attrs["output_scale"] == scale == nodes["side"].attrs["output_scale"]  # one group
    key = f"{precision}_tensors"
    assert set(report[key]) == set(runs[False][0][key]) | {"deep_act_out", "side_act_out", "up_out", "cat_out"}
    plain_report, _, plain_seen, plain_out = runs[False]
    assert plain_report["pass_through"] == {} and plain_seen["up_out"].dtype == torch.float32
    # Minmax calibration gives the Concat the largest amax of its inputs and a nearest resize copies
    # values: the group's scale is fuse's own input scale, and the same codes reach it.
    assert torch.equal(out, plain_out)
    expected = run_ort(upsample_neck(), {"images": _images(20, 3)})["head_out"]
    assert np.abs(out.numpy() - expected).max() <= 0.06 * np.abs(expected).max()


def test_upsample_in_nearest_mode_passes_through_and_linear_does_not():
    """The opset-9 Upsample: the Resize node rewritten as one (the importer keeps both ops)."""
    for mode, expected in (("nearest", {"up": "int8", "cat": "int8"}), ("linear", {})):
        graph = import_model_proto(upsample_neck())
        optimize(graph)
        node = next(n for n in graph.nodes if n.name == "up")
        node.op_type, node.inputs, node.attrs = "Upsample", [node.inputs[0], node.inputs[2]], {"mode": mode}
        layers = {name: p for name, (p, _) in int8_decisions(graph, "fp32").items()}
        amax = {name: 1.0 for n in graph.nodes for name in n.inputs if name}
        assert quantize_graph(graph, layers, amax)["pass_through"] == expected


def test_int8_engine_with_resize_pass_through_tracks_onnxruntime(tmp_path):
    result = int8_engine_run(upsample_neck(), tmp_path, 50)
    assert "int8: 2 MaxPool/Concat/Split/Resize layer(s) pass INT8 through: cat, up" in result.log
    assert "int8: 3 layer(s) INT8, 4 tensor(s) passed between them in INT8" in result.log  # the head stays fp32
    layers = {layer["name"]: layer for layer in result.header["layers"]}
    assert layers["up"]["precision"] == "int8" and layers["cat"]["precision"] == "int8"


# ---- it does not fire where it must not ------------------------------------------------------------

@pytest.mark.parametrize("variant", ["linear", "cubic", "tf_crop_and_resize", "float reader"])
def test_resize_does_not_pass_through(variant):
    model = {"linear": lambda: upsample_neck(mode="linear"), "cubic": lambda: upsample_neck(mode="cubic"),
             "tf_crop_and_resize": lambda: upsample_neck(coordinates="tf_crop_and_resize"),
             "float reader": lambda: upsample_neck(reader="sigmoid")}[variant]()
    graph = import_model_proto(model)
    optimize(graph)
    layers = {name: p for name, (p, _) in int8_decisions(graph, "fp32").items()}
    amax = {name: 1.0 for node in graph.nodes for name in node.inputs if name}
    report = quantize_graph(graph, layers, amax)
    assert "up" not in report["pass_through"]
    assert "up_out" not in report["int8_tensors"] and "deep_act_out" not in report["int8_tensors"]
    # The Concat's other input alone cannot make it pass through.
    assert "cat" not in report["pass_through"]


# ---- the reference and the kernel on codes ----------------------------------------------------------

triton = pytest.importorskip("triton")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
from sartor.kernels.pointwise.resize import upsample_nearest_nhwc, upsample_nearest_nhwc_supported  # noqa: E402
from sartor.ops import default_registry  # noqa: E402
from sartor.ops.resize import RESIZE_ATTRS, resize, resize_into, upsample  # noqa: E402

YOLO_ATTRS = dict(RESIZE_ATTRS, coordinate_transformation_mode="asymmetric", nearest_mode="floor")


def _codes(dtype: torch.dtype, shape: tuple, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    if dtype == torch.int8:
        return torch.randint(-128, 128, shape, dtype=torch.int8, generator=generator)
    return (torch.randn(shape, generator=generator) * 60).clamp(-448, 448).to(dtype)


def _by_definition(x: torch.Tensor, factors) -> torch.Tensor:
    """y[..., i, j] = x[..., i // fh, j // fw], by indexing the bytes."""
    rows = torch.arange(x.shape[2] * factors[0], device=x.device) // factors[0]
    cols = torch.arange(x.shape[3] * factors[1], device=x.device) // factors[1]
    return x.view(torch.uint8)[:, :, rows][:, :, :, cols].view(x.dtype)


def _same_codes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.cpu().view(torch.uint8), b.cpu().view(torch.uint8))


RULES = [("asymmetric", "floor"), ("half_pixel", "round_prefer_floor"), ("align_corners", "round_prefer_ceil"),
         ("half_pixel", "floor")]


@pytest.mark.parametrize("dtype", [torch.int8, torch.float8_e4m3fn])
@pytest.mark.parametrize("coordinates,rule", RULES)
@pytest.mark.parametrize("scales", [[1, 1, 2, 2], [1, 1, 1.5, 3], [1, 1, 0.5, 0.5]])
def test_nearest_reference_copies_codes_exactly(dtype, coordinates, rule, scales):
    """The reference (interpolate's fast path or index_select axis by axis) on codes gives the
    codes of its float result: every e4m3 and int8 value is a float32 value."""
    x = _codes(dtype, (2, 5, 4, 6), seed=1)
    attrs = dict(RESIZE_ATTRS, coordinate_transformation_mode=coordinates, nearest_mode=rule)
    inputs = [x, None, torch.tensor(scales, dtype=torch.float32)]
    got = resize(inputs, attrs)
    assert _same_codes(got, resize([x.float()] + inputs[1:], attrs).to(dtype))
    assert _same_codes(upsample([x, torch.tensor(scales)], {"mode": "nearest", "scales": None}),
                       resize(inputs, YOLO_ATTRS))


@pytest.mark.parametrize("dtype", [torch.int8, torch.float8_e4m3fn])
@pytest.mark.parametrize("factors", [(2, 2), (1, 3)])
def test_kernel_copies_codes(dtype, factors):
    x = _codes(dtype, (2, 70, 5, 3), seed=2).to(DEVICE).contiguous(memory_format=torch.channels_last)
    assert upsample_nearest_nhwc_supported(x)
    y = upsample_nearest_nhwc(x, factors)
    assert y.dtype == dtype and y.is_contiguous(memory_format=torch.channels_last)
    assert _same_codes(y, _by_definition(x, factors))


@pytest.mark.parametrize("dtype", [torch.int8, torch.float8_e4m3fn])
def test_resize_tactic_writes_codes_into_a_concat_slice(dtype):
    """Input: channels 3..13 of a channels-last code tensor; output: channels 5..15 of a Concat's
    code buffer, whose other channels stay untouched."""
    x = _codes(dtype, (2, 20, 4, 3), seed=3).to(DEVICE).contiguous(memory_format=torch.channels_last)[:, 3:13]
    sentinel = _codes(dtype, (2, 24, 8, 6), seed=4).to(DEVICE).contiguous(memory_format=torch.channels_last)
    buffer = sentinel.clone()
    inputs = [x, None, torch.tensor([1.0, 1.0, 2.0, 2.0])]
    attrs = dict(YOLO_ATTRS, tactic="triton_nhwc")
    written = resize_into(inputs, attrs, buffer[:, 5:15])
    assert written is not None and written.data_ptr() == buffer[:, 5:].data_ptr()
    assert _same_codes(buffer[:, 5:15], resize(inputs, dict(YOLO_ATTRS, tactic="torch")))
    assert _same_codes(buffer[:, :5], sentinel[:, :5]) and _same_codes(buffer[:, 15:], sentinel[:, 15:])
    # A slice of another dtype is left to the Concat's copy, and so is the reference tactic's result.
    assert resize_into(inputs, attrs, buffer.view(torch.uint8)[:, 5:15]) is None
    assert resize_into(inputs, dict(YOLO_ATTRS, tactic="torch"), buffer[:, 5:15]) is None


@pytest.mark.parametrize("dtype", [torch.int8, torch.float8_e4m3fn])
def test_resize_tactics_offer_the_kernel_for_codes_on_cuda_only(dtype):
    x = _codes(dtype, (1, 8, 6, 6), seed=5).to(DEVICE).contiguous(memory_format=torch.channels_last)
    tactics = default_registry()["Resize"].tactics([x, None, torch.tensor([1.0, 1.0, 2.0, 2.0])], YOLO_ATTRS)
    assert tactics == (["torch", "triton_nhwc"] if DEVICE == "cuda" else ["torch"])
    assert not upsample_nearest_nhwc_supported(torch.zeros(1, 8, 6, 6, dtype=torch.int32).contiguous(
        memory_format=torch.channels_last))


@pytest.mark.parametrize("precision", ["int8", "fp8"])
def test_quantized_neck_writes_the_resized_codes_into_the_concat_buffer(precision):
    """The neck quantized with pass-through, run channels-last as a CUDA engine runs it: the Resize's
    Triton tactic stores its codes into the Concat's code buffer, run after run, and the outputs are
    those of the reference tactic."""
    from sartor.ops.util import tensor_from_numpy
    from sartor.quant import calibrate
    from sartor.runtime.concat_plan import ShapeMemo, SliceTarget
    from sartor.runtime.executor import Executor
    graph = import_model_proto(upsample_neck())
    optimize(graph)
    weights = {k: tensor_from_numpy(v) for k, v in graph.initializers.items()}
    amax = calibrate(graph, weights, [{"images": _images(60, 4)}], method="minmax")
    layers = {name: p for name, (p, _) in int8_decisions(graph, "fp32", precision).items()}
    layers.update(quantize_graph(graph, layers, amax)["pass_through"])
    weights = {k: tensor_from_numpy(v).to(DEVICE) for k, v in graph.initializers.items()}
    images = torch.from_numpy(_images(61, 2)).to(DEVICE).contiguous(memory_format=torch.channels_last)
    results = {}
    for tactic in ("torch", "triton_nhwc"):
        next(n for n in graph.nodes if n.name == "up").attrs["tactic"] = tactic
        executor = Executor(graph, weights, torch.device(DEVICE), layers, channels_last=True)
        assert executor.concat_plan.targets["up_out"] == SliceTarget("cat_out", 0)
        step = next(s for s in executor.steps if s.node.name == "up")
        stored, write_into = [], step.write_into

        def spy(inputs, attrs, out, write_into=write_into, stored=stored):
            written = write_into(inputs, attrs, out)
            stored.append(written is not None and written.data_ptr() == out.data_ptr() and out.dtype == CODES[precision])
            return written
        step.write_into = spy
        memo = ShapeMemo()
        with torch.inference_mode():
            results[tactic] = [next(iter(executor.run({"images": images}, memo).values())).cpu() for _ in range(3)]
        meta = {k: v for k, v in (memo.value_meta or {}).items() if k in ("deep_act_out", "up_out", "side_act_out", "cat_out")}
        assert stored == ([True, True] if tactic == "triton_nhwc" else [False, False]), (tactic, meta)
    for got in results["torch"] + results["triton_nhwc"]:
        assert torch.equal(got, results["torch"][0])


def test_an_input_read_only_by_quantized_convolutions_keeps_its_layout():
    """The network input read by INT8 convolutions alone (they gather any strides) is not copied to
    channels-last on arrival nor before them; read by a float layer too, it is. On CPU tensors the
    run copies nothing either way, so the plan itself is checked, and that the NCHW input runs."""
    from sartor.ops.util import tensor_from_numpy
    from sartor.quant import calibrate
    from sartor.runtime.executor import Executor
    graph = import_model_proto(upsample_neck())
    optimize(graph)
    weights = {k: tensor_from_numpy(v) for k, v in graph.initializers.items()}
    float_plan = Executor(graph, weights, torch.device("cpu"), {n.name: "fp32" for n in graph.nodes},
                          channels_last=True)
    assert float_plan.layout_free_feeds == frozenset()
    amax = calibrate(graph, weights, [{"images": _images(60, 4)}], method="minmax")
    layers = {name: p for name, (p, _) in int8_decisions(graph, "fp32", "int8").items()}
    layers.update(quantize_graph(graph, layers, amax)["pass_through"])
    readers = {n.op_type for n in graph.nodes if "images" in n.inputs}
    assert readers == {"QConv"}
    weights = {k: tensor_from_numpy(v) for k, v in graph.initializers.items()}
    executor = Executor(graph, weights, torch.device("cpu"), layers, channels_last=True)
    assert executor.layout_free_feeds == frozenset({"images"})
    seen = {}
    def before(index, step, args):
        if "images" in step.node.inputs:
            seen[step.node.name] = args[0]
    images = torch.from_numpy(_images(61, 2))
    with torch.inference_mode():
        executor.run({"images": images}, before=before)
    assert set(seen) == {"deep", "side"} and all(a.is_contiguous() for a in seen.values())
