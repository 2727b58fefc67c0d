"""fuse_yolo_head (passes/fuse_yolo_head.py), the YoloDecode op and its Triton kernel.

The pass fires on real Ultralytics exports (made here from the yaml, and the carried .carry files
when present) and on a small synthetic head, and the results match ONNX Runtime; it leaves the
graph alone when any constant or order differs from the decode it replaces. The kernel matches the
PyTorch reference on channels-last inputs and channel slices (Triton's interpreter on CPU)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from model_zoo import export_yolo, zoo_directory
from passes_helpers import (
    OnnxBuilder,
    assert_matches_ort,
    import_graph,
    max_rel_error,
    op_counts,
    run_ort,
    run_sartor,
)

import sartor
from sartor.frontend import import_onnx
from sartor.ops import default_registry
from sartor.ops.detection_head import TRITON, yolo_decode_reference
from sartor.ops.registry import FLOAT_OUTPUT
from sartor.passes import optimize
from sartor.passes.fuse_yolo_head import fuse_yolo_head

CARRY = Path(__file__).resolve().parents[2] / ".carry"
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # CPU: Triton's interpreter (conftest.py)
RTOL = 1e-4  # max|ours - ORT| / max|ORT|, FP32
BATCH, FEATURES, BINS, CLASSES = 2, 8, 16, 3
SCALES = [(4, 6, 8.0), (2, 3, 16.0), (1, 2, 32.0)]  # H, W, stride of a 32×48 image
DECODE_LEFTOVERS = ("Softmax", "Sigmoid", "Slice", "Sub", "Div")


# ---- a synthetic head: Ultralytics' decode written out with onnx.helper -------------------------
def synthetic_head(variant: str | None = None) -> onnx.ModelProto:
    """Per scale: feature map → 1x1 box conv (4·16 ch) and class conv (3 ch); then the decode as
    Ultralytics 8.4 exports it, anchors and strides as constants. `variant` changes one thing;
    "packed" is the older export: per scale Concat(box, cls), along anchors, then Split."""
    b = OnnxBuilder(seed=3)
    boxes, classes, packed, anchors, strides = [], [], [], [], []
    for i, (h, w, stride) in enumerate(SCALES):
        x = b.input(f"p{i}", [BATCH, FEATURES, h, w])
        box = b.conv(x, FEATURES, 4 * BINS, f"box{i}", k=1)
        cls = b.conv(x, FEATURES, CLASSES, f"cls{i}", k=1)
        if variant == "packed":
            packed.append(b.node("Reshape", [b.node("Concat", [box, cls], axis=1),
                                             b.const(f"x{i}_shape", np.array([BATCH, 4 * BINS + CLASSES, -1]))]))
        else:
            boxes.append(b.node("Reshape", [box, b.const(f"box{i}_shape", np.array([BATCH, 4 * BINS, -1]))]))
            classes.append(b.node("Reshape", [cls, b.const(f"cls{i}_shape", np.array([BATCH, CLASSES, -1]))]))
        offset = 0.0 if variant == "anchor offset" else 0.5
        ys, xs = np.meshgrid(np.arange(h) + offset, np.arange(w) + offset, indexing="ij")
        anchors.append(np.stack([xs.reshape(-1), ys.reshape(-1)]))
        strides.append(np.full(h * w, stride))
    if variant == "class order":
        classes = [classes[1], classes[0], classes[2]]
    total = sum(h * w for h, w, _ in SCALES)
    if variant == "packed":
        sizes = b.const("split", np.array([4 * BINS, CLASSES]))
        box_cat, cls_cat = b.node("Split", [b.node("Concat", packed, axis=2), sizes], axis=1, outputs=2)
    else:
        box_cat, cls_cat = b.node("Concat", boxes, axis=2), b.node("Concat", classes, axis=2)
    dist = b.node("Reshape", [box_cat, b.const("dfl_shape", np.array([BATCH, 4, BINS, total]))])
    dist = b.node("Softmax", [b.node("Transpose", [dist], perm=[0, 2, 1, 3])],
                  axis=2 if variant == "softmax axis" else 1)
    weight = np.arange(BINS)[::-1] if variant == "dfl weights" else np.arange(BINS)
    dist = b.node("Conv", [dist, b.const("dfl_w", weight.astype(np.float32).reshape(1, BINS, 1, 1))], name="dfl")
    dist = b.node("Reshape", [dist, b.const("dist_shape", np.array([BATCH, 4, total]))])
    axis = b.const("axis", np.array([1]))
    top_left = b.node("Slice", [dist, b.const("lt0", np.array([0])), b.const("lt1", np.array([2])), axis])
    bottom_right = b.node("Slice", [dist, b.const("rb0", np.array([2])), b.const("rb1", np.array([4])), axis])
    anchor = b.const("anchors", np.concatenate(anchors, 1)[None].astype(np.float32))
    x1y1 = b.node("Sub", [anchor, top_left])
    x2y2 = b.node("Add", [anchor, bottom_right])
    centre = b.node("Div", [b.node("Add", [x1y1, x2y2]), b.scalar(2.0)])
    xywh = b.node("Concat", [centre, b.node("Sub", [x2y2, x1y1])], axis=1)
    scaled = b.node("Mul", [xywh, b.const("strides", np.concatenate(strides)[None].astype(np.float32))])
    scores = b.node("Sigmoid", [cls_cat], name="scores")
    parts = [scores, scaled] if variant == "output order" else [scaled, scores]
    out = b.node("Concat", parts, name="output0", axis=1)
    return b.model([out, scores] if variant == "scores read elsewhere" else [out])


def synthetic_feeds(seed: int = 1) -> dict:
    rng = np.random.default_rng(seed)
    return {f"p{i}": rng.standard_normal((BATCH, FEATURES, h, w)).astype(np.float32) * 2
            for i, (h, w, _) in enumerate(SCALES)}


@pytest.mark.parametrize("variant", [None, "packed"])
def test_fires_on_the_synthetic_head_and_matches_onnxruntime(variant):
    model = synthetic_head(variant)
    graph = import_graph(model)
    assert fuse_yolo_head(graph) == 1
    fused = [n for n in graph.nodes if n.op_type == "YoloDecode"]
    assert len(fused) == 1 and fused[0].attrs == {"reg_max": BINS, "strides": [8.0, 16.0, 32.0]}
    assert fused[0].inputs == ["box0_out", "box1_out", "box2_out", "cls0_out", "cls1_out", "cls2_out"]
    assert not set(op_counts(graph)) & set(DECODE_LEFTOVERS) and op_counts(graph)["Conv"] == 6  # DFL conv gone
    assert_matches_ort(graph, model, synthetic_feeds(), rtol=RTOL)


@pytest.mark.parametrize("variant", ["dfl weights", "softmax axis", "output order", "class order", "anchor offset",
                                     "scores read elsewhere"])
def test_does_not_fire_where_the_decode_differs(variant):
    model = synthetic_head(variant)
    graph = import_graph(model)
    before = op_counts(graph)
    assert fuse_yolo_head(graph) == 0
    assert op_counts(graph) == before
    assert_matches_ort(graph, model, synthetic_feeds(), rtol=RTOL)


# ---- real Ultralytics exports -------------------------------------------------------------------
@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    pytest.importorskip("ultralytics")  # exports from the yaml; the GPU machine has no ultralytics
    directory = zoo_directory(tmp_path_factory.mktemp("yolo_head_zoo"))
    return {name: export_yolo(f"{name}.yaml", directory, imgsz=128) for name in ("yolov8n", "yolo11n")}


def _ultralytics_dfl(onnx_name: str) -> bool:
    return "/dfl/" in onnx_name


def _assert_fused_and_matches(path: Path, size: int, batch: int, in_dfl=_ultralytics_dfl) -> None:
    """One YoloDecode made of every ONNX node `in_dfl` names (the DFL's Softmax at least), and ONNX
    Runtime's output0."""
    graph = import_onnx(path).graph
    report = optimize(graph)
    assert report.rewrites.get("fuse_yolo_head") == 1
    decodes = [n for n in graph.nodes if n.op_type == "YoloDecode"]
    assert len(decodes) == 1 and decodes[0].attrs == {"reg_max": 16, "strides": [8.0, 16.0, 32.0]}
    assert any(in_dfl(o) and o.endswith("Softmax") for o in decodes[0].origin)
    assert not any(in_dfl(o) for n in graph.nodes if n is not decodes[0] for o in n.origin)
    feeds = {"images": np.random.default_rng(0).random((batch, 3, size, size), dtype=np.float32)}
    ours, expected = run_sartor(graph, feeds)["output0"], run_ort(str(path), feeds)["output0"]
    assert max_rel_error(ours, expected) <= RTOL


def test_engine_of_an_ultralytics_yolov8n_export_matches_onnxruntime(exported, tmp_path):
    model = exported["yolov8n"]
    shapes = {"images": (2, 3, 128, 128)}
    result = sartor.build(str(model.path), str(tmp_path / "yolo.plan"), device="cpu", precision="fp32",
                          min_shapes=shapes, opt_shapes=shapes, max_shapes=shapes)
    assert "pass fuse_yolo_head: 1 rewrite(s)" in result.log
    assert [layer["op"] for layer in result.header["layers"]].count("YoloDecode") == 1
    assert not any(layer["op"] == "Softmax" for layer in result.header["layers"])
    feeds = model.feeds(batch=2)
    got = sartor.load(str(tmp_path / "yolo.plan")).context().run(feeds)["output0"]
    assert max_rel_error(got, run_ort(str(model.path), feeds)["output0"]) <= RTOL


def test_fires_on_an_ultralytics_yolo11n_export(exported):
    _assert_fused_and_matches(exported["yolo11n"].path, 128, 2)


def test_fires_on_the_sample_detector():
    """Its decode is written by hand: Softmax, Mul by arange and ReduceSum, Split, anchors already
    times the strides, and a three-input Concat."""
    path = Path(__file__).resolve().parents[2] / "samples" / "detector" / "sample_detector.onnx"
    _assert_fused_and_matches(path, 320, 1, in_dfl=lambda name: name.startswith("/head/") and name.count("/") == 2)


@pytest.mark.parametrize("name", ["yolov8n", "yolo11n"])
def test_fires_on_the_carried_exports(name):
    path = CARRY / f"{name}.onnx"
    if not path.is_file():
        pytest.skip(f"{path} is not here (.carry/ is local to the lead's checkout); the yaml exports above cover CI")
    _assert_fused_and_matches(path, 160, 1)


# ---- the op and its Triton kernel ----------------------------------------------------------------
def _logits(layout: str, dtype: torch.dtype, device: str = "cpu", seed: int = 0) -> tuple[list, list]:
    """Per scale box and class logits: "nchw", "channels_last", or "channel slice" (views into one
    channels-last buffer holding both, with spare channels, as a Concat's buffer would)."""
    generator = torch.Generator().manual_seed(seed)
    boxes, classes = [], []
    for h, w, _ in SCALES:
        full = (torch.randn(BATCH, 4 * BINS + CLASSES + 5, h, w, generator=generator) * 3).to(device, dtype)
        if layout != "nchw":
            full = full.contiguous(memory_format=torch.channels_last)
        if layout == "channel slice":
            box, cls = full[:, 2:2 + 4 * BINS], full[:, 2 + 4 * BINS:2 + 4 * BINS + CLASSES]
        else:
            box, cls = full[:, :4 * BINS].contiguous(), full[:, 4 * BINS:4 * BINS + CLASSES].contiguous()
            if layout == "channels_last":
                box, cls = (t.contiguous(memory_format=torch.channels_last) for t in (box, cls))
        boxes.append(box)
        classes.append(cls)
    return boxes, classes


@pytest.mark.parametrize("layout", ["channels_last", "channel slice", "nchw"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_triton_decode_matches_the_reference(layout, dtype):
    pytest.importorskip("triton")
    boxes, classes = _logits(layout, dtype, DEVICE)
    assert all(t.stride(1) == 1 for t in boxes) == (layout != "nchw")
    strides = [s for _, _, s in SCALES]
    expected = yolo_decode_reference([t.cpu() for t in boxes], [t.cpu() for t in classes], BINS, strides)
    opdef = default_registry()["YoloDecode"]
    got = opdef.impl(boxes + classes, {"reg_max": BINS, "strides": strides, "tactic": TRITON}).cpu()
    assert got.dtype == dtype and got.shape == (BATCH, 4 + CLASSES, sum(h * w for h, w, _ in SCALES))
    tolerance = 1e-5 if dtype == torch.float32 else 1e-3
    torch.testing.assert_close(got.float(), expected.float(), rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("sizes", [[(9, 10)], [(9, 10), (5, 5)], [(9, 10), (5, 5), (3, 3), (1, 2)],
                                   [(8, 8), (4, 4), (2, 2), (1, 1), (1, 1)]],
                         ids=["one scale", "two", "four: two launches", "five"])
def test_triton_decode_of_any_number_of_scales_matches_the_reference(sizes, monkeypatch):
    """One launch decodes up to three scales; blocks of 64 pixels, so a 9×10 scale is two blocks and
    the next scale's first block starts after a ragged one."""
    pytest.importorskip("triton")
    from sartor.kernels.pointwise import yolo_head
    grids = []

    class CountedLaunches:
        def __getitem__(self, grid):
            grids.append(grid)
            return kernel[grid]
    kernel = yolo_head._yolo_decode_kernel
    monkeypatch.setattr(yolo_head, "_yolo_decode_kernel", CountedLaunches())
    generator = torch.Generator().manual_seed(len(sizes))
    boxes = [torch.randn(BATCH, 4 * BINS, h, w, generator=generator).to(DEVICE) * 3 for h, w in sizes]
    classes = [torch.randn(BATCH, CLASSES, h, w, generator=generator).to(DEVICE) * 3 for h, w in sizes]
    strides = [8.0 * 2 ** i for i in range(len(sizes))]
    expected = yolo_decode_reference([t.cpu() for t in boxes], [t.cpu() for t in classes], BINS, strides)
    got = default_registry()["YoloDecode"].impl(boxes + classes, {"reg_max": BINS, "strides": strides,
                                                                  "tactic": TRITON}).cpu()
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-4)  # boxes to 128 px: float32 ulps of 1e-5
    blocks = [-(-h * w // 64) for h, w in sizes]
    assert grids == [(sum(blocks[i:i + 3]), BATCH) for i in range(0, len(sizes), 3)]


@pytest.mark.parametrize("tactic", ["torch", TRITON])
def test_float16_logits_decode_into_float32_when_asked(tactic):
    """FLOAT_OUTPUT "float32" (the executor's, where the decode's output is the engine's float32
    output): the FP32 decode stored as it is, not rounded to float16 first."""
    if tactic == TRITON:
        pytest.importorskip("triton")
    boxes, classes = _logits("channels_last", torch.float16, DEVICE)
    strides = [s for _, _, s in SCALES]
    expected = yolo_decode_reference([t.cpu() for t in boxes], [t.cpu() for t in classes], BINS, strides,
                                     torch.float32)
    opdef = default_registry()["YoloDecode"]
    attrs = {"reg_max": BINS, "strides": strides, "tactic": tactic}
    got = opdef.impl(boxes + classes, dict(attrs, **{FLOAT_OUTPUT: "float32"})).cpu()
    half = opdef.impl(boxes + classes, attrs).cpu()
    assert got.dtype == torch.float32 and half.dtype == torch.float16
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert not torch.equal(got, half.float())  # what the float16 store rounded away


def test_reference_decodes_a_known_box():
    """Uniform bins put each side at (R-1)/2 from the anchor: at cell (x=1, y=0) of an 8-pixel
    stride, the box is centred at (12, 4) and 8·15 wide and tall; zero logits score 0.5."""
    box = torch.zeros(1, 4 * BINS, 1, 2)
    cls = torch.zeros(1, 1, 1, 2)
    out = yolo_decode_reference([box], [cls], BINS, [8.0])
    torch.testing.assert_close(out[0, :, 1], torch.tensor([12.0, 4.0, 120.0, 120.0, 0.5]))


def test_tactics_and_refusals():
    opdef = default_registry()["YoloDecode"]
    boxes, classes = _logits("channels_last", torch.float32)
    attrs = {"reg_max": BINS, "strides": [8.0, 16.0, 32.0]}
    assert opdef.tactics(boxes + classes, attrs) == ["torch"]  # CPU: the reference only
    if DEVICE == "cuda":
        assert opdef.tactics([t.cuda() for t in boxes + classes], attrs) == ["torch", TRITON]
    with pytest.raises(ValueError, match="not one scale's"):
        opdef.impl(boxes + [classes[1], classes[0], classes[2]], attrs)
    with pytest.raises(ValueError, match="5 inputs for 3 scales"):
        opdef.impl(boxes + classes[:2], attrs)


def test_triton_decode_writes_into_a_given_output_and_the_reference_declines():
    """OpDef.write_outputs: a later graph's decode stored straight into the context's shared output
    buffer, whatever it held; the reference tactic makes its own output (left to a copy), and another
    dtype, another shape or no buffer is not given to the op at all."""
    pytest.importorskip("triton")
    from sartor.kernels.pointwise.yolo_head import yolo_decode
    boxes, classes = _logits("channels_last", torch.float16, DEVICE)
    strides = [s for _, _, s in SCALES]
    opdef = default_registry()["YoloDecode"]
    attrs = {"reg_max": BINS, "strides": strides, "tactic": TRITON, FLOAT_OUTPUT: "float32"}
    expected = opdef.impl(boxes + classes, attrs)
    out = torch.full(expected.shape, 7.0, device=DEVICE)
    assert opdef.write_outputs(boxes + classes, attrs, [out]) is out and torch.equal(out, expected)
    out.fill_(7.0)
    made = opdef.write_outputs(boxes + classes, dict(attrs, tactic="torch"), [out])
    assert made is not out and (out == 7.0).all()
    torch.testing.assert_close(made, expected, rtol=1e-5, atol=1e-5)
    for declined_out in (out.half(), out[:, :, :-1].contiguous(), None):
        assert opdef.write_outputs(boxes + classes, attrs, [declined_out]) is None
    with pytest.raises(ValueError, match="`out` must be a contiguous"):
        yolo_decode(boxes, classes, BINS, strides, out=out[:, :, :-1])
