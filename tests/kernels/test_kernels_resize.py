"""The channels-last nearest-upsample kernel against PyTorch and ONNX's own reference, through
Triton's interpreter on CPU (and natively on a GPU); where Resize and Upsample offer it as a tactic
and where they must not; and a Resize → Concat neck whose Resize is written into the Concat's
buffer, matching ONNX Runtime run after run."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from onnx import helper
from onnx.reference import ReferenceEvaluator

# conftest.py switches Triton to its interpreter when there is no GPU.
triton = pytest.importorskip("triton")

from sartor.kernels.pointwise.resize import upsample_nearest_nhwc, upsample_nearest_nhwc_supported  # noqa: E402
from sartor.ops import default_registry  # noqa: E402
from sartor.ops.resize import RESIZE_ATTRS, resize, resize_into, upsample, upsample_into  # noqa: E402
from sartor.runtime.concat_plan import ShapeMemo, SliceTarget  # noqa: E402
from sartor.runtime.executor import Executor  # noqa: E402
from tests.passes_helpers import OnnxBuilder, import_graph, run_ort  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
YOLO_ATTRS = dict(RESIZE_ATTRS, coordinate_transformation_mode="asymmetric", nearest_mode="floor")


def _channels_last(*shape, dtype=torch.float32, seed=0) -> torch.Tensor:
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)
    return x.to(DEVICE).contiguous(memory_format=torch.channels_last)


def _by_definition(x: torch.Tensor, factors) -> torch.Tensor:
    """y[..., i, j] = x[..., i // fh, j // fw], by indexing."""
    rows = torch.arange(x.shape[2] * factors[0], device=x.device) // factors[0]
    cols = torch.arange(x.shape[3] * factors[1], device=x.device) // factors[1]
    return x[:, :, rows][:, :, :, cols]


def _scales(factors) -> torch.Tensor:
    return torch.tensor([1.0, 1.0, float(factors[0]), float(factors[1])])


@pytest.mark.parametrize("factors", [(2, 2), (1, 2), (3, 3), (2, 1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("size", [(5, 7), (1, 1), (4, 4)])
def test_kernel_matches_interpolate_on_dense_channels_last(factors, dtype, size):
    x = _channels_last(2, 70, *size, dtype=dtype)
    y = upsample_nearest_nhwc(x, factors)
    assert y.is_contiguous(memory_format=torch.channels_last) and y.dtype == dtype
    torch.testing.assert_close(y, F.interpolate(x, scale_factor=factors, mode="nearest"), rtol=0, atol=0)
    torch.testing.assert_close(y, _by_definition(x, factors), rtol=0, atol=0)


@pytest.mark.parametrize("factors", [(2, 2), (3, 3)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_kernel_reads_and_writes_channel_slices(factors, dtype):
    """Input: channels 3..13 of a channels-last buffer; output: channels 5..15 of a Concat-like
    buffer whose other channels must stay untouched."""
    source = _channels_last(2, 20, 5, 3, dtype=dtype)
    x = source[:, 3:13]
    oh, ow = 5 * factors[0], 3 * factors[1]
    buffer = torch.full((2, 24, oh, ow), 7.0, dtype=dtype, device=DEVICE).contiguous(memory_format=torch.channels_last)
    out = buffer[:, 5:15]
    written = upsample_nearest_nhwc(x, factors, out=out)
    assert written.data_ptr() == out.data_ptr()
    torch.testing.assert_close(buffer[:, 5:15], _by_definition(x, factors), rtol=0, atol=0)
    assert bool((buffer[:, :5] == 7).all()) and bool((buffer[:, 15:] == 7).all())


@pytest.mark.parametrize("dtype", [torch.int8, torch.float16])
@pytest.mark.parametrize("channels, width, offset", [(40, 120, 40), (24, 72, 48)])
def test_kernel_told_a_slice_alignment_of_8_keeps_every_value(dtype, channels, width, offset):
    """40 or 24 channels upsampled into a slice of a 120- or 72-channel buffer: the kernel is told
    the counts and strides are multiples of 8 (CH_ALIGN) and rewrites them as such, which a wrong
    factor would shrink; every value is the definition's, the other channels untouched."""
    generator = torch.Generator().manual_seed(3)
    x = torch.randint(-128, 128, (2, channels, 4, 5), generator=generator).to(dtype)
    x = x.to(DEVICE).contiguous(memory_format=torch.channels_last)
    buffer = torch.full((2, width, 8, 10), 7, dtype=dtype, device=DEVICE).contiguous(memory_format=torch.channels_last)
    upsample_nearest_nhwc(x, (2, 2), out=buffer[:, offset:offset + channels])
    assert torch.equal(buffer[:, offset:offset + channels], _by_definition(x, (2, 2)))
    assert bool((buffer[:, :offset] == 7).all()) and bool((buffer[:, offset + channels:] == 7).all())


def test_kernel_refuses_an_out_it_cannot_fill():
    x = _channels_last(1, 4, 3, 3)
    with pytest.raises(ValueError, match="cannot hold"):
        upsample_nearest_nhwc(x, (2, 2), out=torch.empty(1, 4, 6, 5, device=DEVICE))
    with pytest.raises(ValueError, match="cannot hold"):
        upsample_nearest_nhwc(x, (2, 2), out=torch.empty(1, 4, 6, 6, device=DEVICE))  # NCHW
    with pytest.raises(ValueError, match="not integers"):
        upsample_nearest_nhwc(x, (1.5, 2))


@pytest.mark.parametrize("coordinates,rule", [("asymmetric", "floor"), ("half_pixel", "round_prefer_floor"),
                                              ("pytorch_half_pixel", "round_prefer_ceil")])
@pytest.mark.parametrize("given", ["scales", "sizes"])
def test_resize_tactic_matches_onnx_reference(coordinates, rule, given):
    """The Triton tactic of Resize against onnx.reference for the coordinate rules that map output
    i to input i // f, the factors given as scales or as sizes."""
    x = _channels_last(1, 6, 3, 5)
    factors = (2, 3)
    scales = np.array([1, 1, *factors], dtype=np.float32)
    sizes = np.array([1, 6, 3 * factors[0], 5 * factors[1]], dtype=np.int64)
    node_inputs = ["x", "", "scales"] if given == "scales" else ["x", "", "", "sizes"]
    node = helper.make_node("Resize", node_inputs, ["y"], mode="nearest", coordinate_transformation_mode=coordinates,
                            nearest_mode=rule)
    feeds = {"x": x.cpu().numpy(), "scales": scales, "sizes": sizes}
    expected = ReferenceEvaluator(node).run(None, {k: v for k, v in feeds.items() if k in node_inputs})[0]
    attrs = dict(RESIZE_ATTRS, coordinate_transformation_mode=coordinates, nearest_mode=rule, tactic="triton_nhwc")
    inputs = [x, None, torch.from_numpy(scales), None] if given == "scales" else \
        [x, None, None, torch.from_numpy(sizes)]
    got = resize(inputs, attrs)
    np.testing.assert_array_equal(got.cpu().numpy(), expected)
    out = torch.empty(expected.shape, device=DEVICE).contiguous(memory_format=torch.channels_last)
    assert resize_into(inputs, attrs, out) is out  # the kernel ran, not the reference
    np.testing.assert_array_equal(out.cpu().numpy(), expected)


def test_upsample_tactic_matches_reference_and_writes_into_slices():
    x = _channels_last(2, 4, 3, 3)
    attrs = {"mode": "nearest", "scales": None, "tactic": "triton_nhwc"}
    inputs = [x, _scales((2, 2))]
    expected = upsample(inputs, dict(attrs, tactic="torch"))
    torch.testing.assert_close(upsample(inputs, attrs), expected, rtol=0, atol=0)
    buffer = torch.zeros(2, 10, 6, 6, device=DEVICE).contiguous(memory_format=torch.channels_last)
    assert upsample_into(inputs, attrs, buffer[:, 6:]) is not None
    torch.testing.assert_close(buffer[:, 6:], expected, rtol=0, atol=0)
    assert upsample_into(inputs, dict(attrs, mode="linear"), buffer[:, 6:]) is None


REFUSED = {
    "non-integer factor": ([1, 1, 1.5, 2], {}),
    "downsampling": ([1, 1, 0.5, 0.5], {}),
    "channel axis scaled": ([1, 2, 2, 2], {}),
    "linear mode": ([1, 1, 2, 2], {"mode": "linear"}),
    "cubic mode": ([1, 1, 2, 2], {"mode": "cubic"}),
    "align_corners": ([1, 1, 2, 2], {"coordinate_transformation_mode": "align_corners"}),
    "asymmetric with ceil": ([1, 1, 2, 2], {"nearest_mode": "ceil"}),
    "half_pixel with floor": ([1, 1, 2, 2], {"coordinate_transformation_mode": "half_pixel"}),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_resize_tactic_does_not_apply_where_it_must_not(case):
    """These resizes are not x[i // f]: the Triton tactic is neither offered nor run, and the layer
    still computes the reference (and leaves a given slice to the Concat's copy)."""
    scales, changes = REFUSED[case]
    x = _channels_last(1, 4, 4, 4)
    attrs = dict(YOLO_ATTRS, **changes)
    inputs = [x, None, torch.tensor(scales)]
    tactics = default_registry()["Resize"].tactics
    assert tactics(inputs, attrs) == ["torch"]
    reference = resize(inputs, dict(attrs, tactic="torch"))
    torch.testing.assert_close(resize(inputs, dict(attrs, tactic="triton_nhwc")), reference, rtol=0, atol=0)
    out = torch.empty(reference.shape, device=DEVICE).contiguous(memory_format=torch.channels_last)
    assert resize_into(inputs, dict(attrs, tactic="triton_nhwc"), out) is None


def test_resize_tactic_does_not_apply_to_layouts_and_dtypes_it_cannot_read_or_write():
    attrs = dict(YOLO_ATTRS, tactic="triton_nhwc")
    scales = _scales((2, 2))
    nchw = torch.randn(1, 4, 3, 3, device=DEVICE)
    dense_out = torch.empty(1, 4, 6, 6, device=DEVICE).contiguous(memory_format=torch.channels_last)
    assert not upsample_nearest_nhwc_supported(nchw)
    assert resize_into([nchw, None, scales], attrs, dense_out) is None
    assert not upsample_nearest_nhwc_supported(torch.zeros(1, 4, 3, 3, dtype=torch.int32).contiguous(
        memory_format=torch.channels_last))
    x = _channels_last(1, 4, 3, 3)
    nchw_slice = torch.empty(1, 8, 6, 6, device=DEVICE).narrow(1, 0, 4)
    assert resize_into([x, None, scales], attrs, nchw_slice) is None
    assert resize_into([x, None, scales], attrs, dense_out.half()) is None  # another dtype
    assert resize_into([x, None, scales], dict(attrs, tactic="torch"), dense_out) is None
    assert resize_into([x, None, scales], attrs, dense_out) is dense_out


def test_resize_tactics_are_listed_on_cuda_only_and_reach_the_executor():
    opdef = default_registry()["Resize"]
    x = _channels_last(1, 8, 6, 6)
    inputs = [x, None, _scales((2, 2))]
    if DEVICE == "cuda":
        assert opdef.tactics(inputs, YOLO_ATTRS) == ["torch", "triton_nhwc"]
        assert opdef.tactics([x.contiguous(), None, _scales((2, 2))], YOLO_ATTRS) == ["torch"]
    else:
        assert opdef.tactics(inputs, YOLO_ATTRS) == ["torch"]  # CPU: the reference only
    assert opdef.fill_attrs({"mode": "nearest", "tactic": "triton_nhwc"})["tactic"] == "triton_nhwc"
    assert opdef.unsupported_reason({"mode": "nearest", "tactic": "triton_nhwc"}, ["float32"]) is None
    assert default_registry()["Upsample"].fill_attrs({"tactic": "triton_nhwc"})["tactic"] == "triton_nhwc"


# ---- a YOLO neck: Resize → Concat, the Resize written into the Concat's buffer ----------------------
SMALL, LARGE = (1, 6, 4, 5), (1, 4, 8, 10)


def _neck():
    """conv → Resize ×2 (Ultralytics' attributes) → Concat with a lateral conv → conv."""
    b = OnnxBuilder(seed=7)
    deep = b.input("deep", list(SMALL))
    lateral = b.input("lateral", list(LARGE))
    top = b.node("Relu", [b.conv(deep, 6, 6, "top", k=1)], name="top_act")
    up = b.node("Resize", [top, "", b.const("up_scales", np.array([1, 1, 2, 2], dtype=np.float32))], name="up",
                mode="nearest", coordinate_transformation_mode="asymmetric", nearest_mode="floor")
    side = b.node("Relu", [b.conv(lateral, 4, 4, "side", k=1)], name="side_act")
    cat = b.node("Concat", [up, side], name="cat", axis=1)
    return b, b.model([b.conv(cat, 10, 3, "head", k=1)])


def _neck_executor(tactic: str):
    """The neck as a CUDA engine runs it (channels-last, Resize's tactic as the builder recorded
    it), on this machine's device."""
    builder, model = _neck()
    graph = import_graph(model)
    next(n for n in graph.nodes if n.op_type == "Resize").attrs["tactic"] = tactic
    weights = {k: torch.from_numpy(np.array(v)) for k, v in graph.initializers.items()}
    return builder, model, Executor(graph, weights, torch.device(DEVICE), channels_last=True)


def _written_into(executor) -> list:
    """Records, for every write_into call of the Resize, whether it stored into the slice."""
    calls = []
    step = next(s for s in executor.steps if s.node.op_type == "Resize")
    original = step.write_into

    def spy(inputs, attrs, out):
        written = original(inputs, attrs, out)
        calls.append(written is not None and written.data_ptr() == out.data_ptr())
        return written
    step.write_into = spy
    return calls


def _run_neck(executor, feeds: dict, memo: ShapeMemo) -> np.ndarray:
    tensors = {k: torch.from_numpy(v).to(DEVICE).contiguous(memory_format=torch.channels_last)
               for k, v in feeds.items()}
    with torch.inference_mode():
        return next(iter(executor.run(tensors, memo).values())).cpu().numpy()


def test_resize_is_written_into_the_concat_buffer_and_matches_onnxruntime():
    builder, model, executor = _neck_executor("triton_nhwc")
    assert executor.concat_plan.targets["up_out"] == SliceTarget("cat_out", 0)
    calls = _written_into(executor)
    feeds = builder.feeds(seed=3)
    expected = next(iter(run_ort(model, feeds).values()))
    memo = ShapeMemo()
    for _ in range(3):
        np.testing.assert_allclose(_run_neck(executor, feeds, memo), expected, rtol=1e-5, atol=1e-5)
    assert memo.value_meta["cat_out"][2]  # the Concat's buffer is channels-last
    assert calls == [True, True]  # the first run records shapes, the next two write in place


def test_resize_with_the_reference_tactic_is_left_to_the_concat_copy():
    builder, model, executor = _neck_executor("torch")
    calls = _written_into(executor)
    feeds = builder.feeds(seed=4)
    expected = next(iter(run_ort(model, feeds).values()))
    memo = ShapeMemo()
    for _ in range(2):
        np.testing.assert_allclose(_run_neck(executor, feeds, memo), expected, rtol=1e-5, atol=1e-5)
    assert calls == [False]
