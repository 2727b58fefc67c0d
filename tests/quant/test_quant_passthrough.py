"""INT8 (and FP8) through MaxPool, Concat and Split (sartor/quant/quantize.py): where the pass-through
fires and where it must not, that it computes exactly what the engine without it computes where
the scales agree, that engines still track ONNX Runtime; the int8/e4m3 max-pool kernel in Triton's
interpreter; QConv storing into a Concat's channel slice."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import save
from passes_helpers import OnnxBuilder, build_int8_cpu, run_ort

import sartor
from sartor.cli.inspect import epilogue
from sartor.frontend.onnx import import_model_proto
from sartor.ops.util import tensor_from_numpy
from sartor.passes import optimize
from sartor.quant import calibrate
from sartor.quant.plan import int8_decisions
from sartor.quant.quantize import quantize_graph
from sartor.runtime.executor import Executor

SIZE = 12
SHAPES = {"min": {"images": (1, 3, SIZE, SIZE)}, "opt": {"images": (2, 3, SIZE, SIZE)},
          "max": {"images": (4, 3, SIZE, SIZE)}}


def _images(seed: int, n: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, 3, SIZE, SIZE)).astype(np.float32)


def pool_chain(reader: str = "conv", pool: str = "MaxPool", pool_is_output: bool = False):
    """conv → ReLU → pool (3×3, stride 2, pad 1) → `reader` → conv → head conv. `reader` "conv"
    is an INT8 conv; "sigmoid" puts a float layer between the pool and the next conv."""
    b = OnnxBuilder(seed=1)
    x = b.input("images", ["batch", 3, SIZE, SIZE])
    y = b.node("Relu", [b.conv(x, 3, 8, "c1")], name="r1")
    p = b.node(pool, [y], name="pool", kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1])
    if reader == "sigmoid":
        p = b.node("Sigmoid", [p], name="sig")
    z = b.node("Relu", [b.conv(p, 8, 8, "c2")], name="r2")
    outputs = [b.conv(z, 8, 4, "head")] + (["pool_out"] if pool_is_output else [])
    return b.model(outputs)


def sppf_block():
    """YOLO's SPPF in small: conv → three chained 5×5 max pools → Concat(conv, p1, p2, p3) → conv
    → head conv."""
    b = OnnxBuilder(seed=2)
    x = b.input("images", ["batch", 3, SIZE, SIZE])
    y = b.node("Relu", [b.conv(x, 3, 4, "cv1", k=1)], name="cv1_act")
    pools = [y]
    for k in range(3):
        pools.append(b.node("MaxPool", [pools[-1]], name=f"m{k}", kernel_shape=[5, 5], strides=[1, 1],
                            pads=[2, 2, 2, 2]))
    cat = b.node("Concat", pools, name="cat", axis=1)
    z = b.node("Relu", [b.conv(cat, 16, 8, "cv2", k=1)], name="cv2_act")
    return b.model([b.conv(z, 8, 4, "head")])


def c2f_block(float_part: bool = False, shape_reader: bool = False):
    """YOLOv8's C2f in small: conv → Split in halves a, b → bottleneck on b (conv, ReLU, conv, ReLU,
    + b) → Concat(a, b, bottleneck) → conv → head conv. `float_part` feeds the Concat a Sigmoid of
    the bottleneck instead: one float input. `shape_reader`: the output is flattened to the batch of
    b's Shape, as an attention block sizes its reshapes from its input's Shape (YOLO11's C2PSA)."""
    b = OnnxBuilder(seed=3)
    x = b.input("images", ["batch", 3, SIZE, SIZE])
    y = b.node("Relu", [b.conv(x, 3, 8, "cv1", k=1)], name="cv1_act")
    a, h = b.node("Split", [y, b.const("sizes", np.array([4, 4], dtype=np.int64))], name="split", axis=1, outputs=2)
    inner = b.node("Relu", [b.conv(h, 4, 4, "m1")], name="m1_act")
    m = b.node("Add", [h, b.node("Relu", [b.conv(inner, 4, 4, "m2")], name="m2_act")], name="m_add")
    if float_part:
        m = b.node("Sigmoid", [m], name="sig")
    cat = b.node("Concat", [a, h, m], name="cat", axis=1)
    z = b.node("Relu", [b.conv(cat, 12, 8, "cv2", k=1)], name="cv2_act")
    out = b.conv(z, 8, 4, "head")
    if shape_reader:
        batch = b.node("Gather", [b.node("Shape", [h], name="h_shape"), b.const("first", np.array([0]))],
                       name="h_batch", axis=0)
        out = b.node("Reshape", [out, b.node("Concat", [batch, b.const("rest", np.array([-1]))], name="dims",
                                             axis=0)], name="flat")
    return b.model([out])


def _quantized_runs(model, precision: str = "int8") -> dict:
    """The model quantized with and without pass-through from one calibration (minmax), run on
    the same images: {True: (report, outputs), False: (report, outputs)}."""
    calib = [{"images": _images(10 + k, 4)} for k in range(3)]
    test = torch.from_numpy(_images(20, 3))
    amax = None
    runs = {}
    for pass_through in (True, False):
        graph = import_model_proto(model)
        optimize(graph)
        weights = {k: tensor_from_numpy(v) for k, v in graph.initializers.items()}
        amax = amax or calibrate(graph, weights, calib, method="minmax")
        layers = {name: p for name, (p, _) in int8_decisions(graph, "fp32", precision).items()}
        report = quantize_graph(graph, layers, amax, pass_through=pass_through)
        layers.update(report["pass_through"])
        weights = {k: tensor_from_numpy(v) for k, v in graph.initializers.items()}
        executor = Executor(graph, weights, torch.device("cpu"), layers)
        with torch.inference_mode():
            seen = {}
            outputs = executor.run({"images": test}, observe=lambda i, step, outs: seen.update(
                {name: t for name, t in zip(step.node.outputs, outs) if name}))
        runs[pass_through] = (report, graph, seen, next(iter(outputs.values())))
    return runs


# ---- it fires, and computes what the engine without it computes --------------------------------------

@pytest.mark.parametrize("precision", ["int8", "fp8"])
def test_max_pool_passes_codes_through_and_changes_no_number(precision):
    runs = _quantized_runs(pool_chain(), precision)
    report, graph, seen, out = runs[True]
    assert report["pass_through"] == {"pool": precision}
    code = torch.int8 if precision == "int8" else torch.float8_e4m3fn
    assert seen["r1_out"].dtype == code and seen["pool_out"].dtype == code  # the pool reads and writes codes
    nodes = {n.name: n for n in graph.nodes}
    scale = nodes["c1"].attrs["output_scale"]
    assert scale is not None and nodes["c2"].attrs["input_scale"] == scale  # one scale on both sides
    key = "int8_tensors" if precision == "int8" else "fp8_tensors"
    assert set(report[key]) == set(runs[False][0][key]) | {"r1_out", "pool_out"}
    plain_report, plain_graph, plain_seen, plain_out = runs[False]
    assert plain_report["pass_through"] == {} and plain_seen["pool_out"].dtype == torch.float32
    # max commutes with the monotonic quantization: the same codes reach c2, the same outputs leave.
    assert torch.equal(out, plain_out)


def test_sppf_concat_and_pools_share_one_scale_and_change_no_number():
    runs = _quantized_runs(sppf_block())
    report, graph, seen, out = runs[True]
    assert report["pass_through"] == {"m0": "int8", "m1": "int8", "m2": "int8", "cat": "int8"}
    assert seen["cat_out"].dtype == torch.int8
    nodes = {n.name: n for n in graph.nodes}
    assert nodes["cv1"].attrs["output_scale"] == nodes["cv2"].attrs["input_scale"]
    assert torch.equal(out, runs[False][3])  # the group's scale is cv2's own input scale


def test_c2f_split_and_concat_pass_int8_with_one_scale():
    runs = _quantized_runs(c2f_block())
    report, graph, seen, out = runs[True]
    assert report["pass_through"] == {"split": "int8", "cat": "int8"}
    nodes = {n.name: n for n in graph.nodes}
    scale = nodes["cv1"].attrs["output_scale"]
    # The Concat's inputs are requantized to one scale by their producers, read with it by all readers.
    assert nodes["m2"].attrs["output_scale"] == scale == nodes["cv2"].attrs["input_scale"]
    assert nodes["m1"].attrs["input_scale"] == scale == nodes["m2"].attrs["residual_scale"]
    assert seen["cat_out"].dtype == torch.int8 and seen["split_out0"].dtype == torch.int8
    # A common scale is coarser for the smaller inputs: close to, not equal to, the plain build.
    plain = runs[False][3]
    assert float((out - plain).abs().max()) <= 0.05 * float(plain.abs().max())


def test_a_shape_reader_does_not_keep_a_split_half_float():
    """A Shape reader takes only the shape, which codes keep: the Split half it reads still passes INT8,
    with the engine's numbers those of the C2f without it."""
    runs = _quantized_runs(c2f_block(shape_reader=True))
    report, graph, seen, out = runs[True]
    assert report["pass_through"] == {"split": "int8", "cat": "int8"}
    assert seen["split_out1"].dtype == torch.int8 and seen["h_shape_out"].tolist() == [3, 4, SIZE, SIZE]
    plain = _quantized_runs(c2f_block())[True][3]
    assert out.shape == (3, 4 * SIZE * SIZE) and torch.equal(out, plain.reshape(3, -1))


def int8_engine_run(model, work, seed: int):
    """An INT8 CPU engine of `model` calibrated on 24 images: its build result, and its output
    beside ONNX Runtime's on 2 other images (within 5% of the largest)."""
    result = build_int8_cpu(model, work, _images(seed, 24), [SHAPES])
    images = _images(seed + 1, 2)
    got = next(iter(sartor.load(work / "model.plan", device="cpu").context().run({"images": images}).values()))
    expected = run_ort(model, {"images": images})["head_out"]
    assert np.abs(got - expected).max() <= 0.05 * np.abs(expected).max()
    return result


def test_engine_with_pass_through_tracks_onnxruntime(tmp_path):
    result = int8_engine_run(pool_chain(), tmp_path, 30)
    assert "int8: 1 MaxPool/Concat/Split/Resize layer(s) pass INT8 through: pool" in result.log
    assert "int8: 2 layer(s) INT8, 2 tensor(s) passed between them in INT8" in result.log
    layers = {layer["name"]: layer for layer in result.header["layers"]}
    # c1 reads the 3-channel image: its INT8 codes' pool is carried by it (passes/fuse_stem_max_pool.py)
    assert "pool" not in layers and layers["c1"]["origin"][-1] == "pool"
    assert layers["c1"]["precision"] == "int8" and epilogue(layers["c1"]["attrs"]) == "Relu → MaxPool 3x3/2,2/1,1,1,1"


def test_c2f_engine_places_int8_producers_in_the_concat_buffer(tmp_path):
    """The Concat plan takes INT8 layers (QConv has write_into) and the Split's INT8 input, with an
    int8 buffer; the engine still matches ONNX Runtime run after run."""
    model = c2f_block()
    path = save(model, tmp_path / "c2f.onnx")
    np.save(tmp_path / "calib.npy", _images(40, 24))
    sartor.build(path, tmp_path / "c2f.plan", device="cpu", profiles=[SHAPES], precision="int8",
                 calib=tmp_path / "calib.npy")
    engine = sartor.load(tmp_path / "c2f.plan", device="cpu")
    plan = engine.executor.concat_plan
    assert set(plan.targets) == {"cv1_act_out", "m_add_out"}  # the Split's input, the bottleneck
    context = engine.context()
    images = _images(41, 2)
    expected = run_ort(model, {"images": images})["head_out"]
    for _ in range(2):
        got = next(iter(context.run({"images": images}).values()))
        assert np.abs(got - expected).max() <= 0.06 * np.abs(expected).max()


# ---- it does not fire where it must not ------------------------------------------------------------

@pytest.mark.parametrize("variant", ["float reader", "graph output", "AveragePool", "float producer"])
def test_pool_does_not_pass_through(variant):
    model = {"float reader": lambda: pool_chain(reader="sigmoid"),
             "graph output": lambda: pool_chain(pool_is_output=True),
             "AveragePool": lambda: pool_chain(pool="AveragePool"),
             "float producer": pool_chain}[variant]()
    graph = import_model_proto(model)
    optimize(graph)
    layers = {name: p for name, (p, _) in int8_decisions(graph, "fp32").items()}
    if variant == "float producer":
        layers["c1"] = "fp32"
    amax = {name: 1.0 for node in graph.nodes for name in node.inputs if name}
    report = quantize_graph(graph, layers, amax)
    assert report["pass_through"] == {}
    assert "pool_out" not in report["int8_tensors"] and "r1_out" not in report["int8_tensors"]


def test_concat_with_a_float_input_does_not_pass_through():
    runs = _quantized_runs(c2f_block(float_part=True))
    report, graph, seen, _ = runs[True]
    assert report["pass_through"] == {}
    assert seen["cat_out"].dtype == torch.float32
    nodes = {n.name: n for n in graph.nodes}
    assert nodes["cv1"].attrs["output_scale"] is None  # read by the float Split


# ---- kernels -----------------------------------------------------------------------------------

triton = pytest.importorskip("triton")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
POOL_CASES = [
    {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1]},
    {"kernel_shape": [3, 3], "strides": [2, 2], "ceil_mode": 1},
    {"kernel_shape": [5, 5], "strides": [1, 1], "pads": [2, 2, 2, 2]},
    {"kernel_shape": [3, 2], "strides": [1, 2], "pads": [0, 1, 2, 0], "dilations": [2, 1], "ceil_mode": 1},
]


def _codes(dtype, shape, generator) -> torch.Tensor:
    if dtype == torch.int8:
        x = torch.randint(-128, 128, shape, dtype=torch.int8, generator=generator)
        x[1] = -128  # a whole image at the lowest code: padding must not be taken for it, nor win
        return x
    x = (torch.randn(shape, generator=generator) * 60).clamp(-448, 448).to(dtype)
    x[1] = -448
    return x


@pytest.mark.parametrize("dtype", [torch.int8, torch.float8_e4m3fn])
@pytest.mark.parametrize("attrs", POOL_CASES)
def test_code_max_pool_kernel_matches_reference(dtype, attrs):
    from sartor.kernels.pool.max_pool import max_pool_nhwc
    from sartor.ops.pool import _pool_geometry, max_pool
    x = _codes(dtype, (2, 6, 9, 7), torch.Generator().manual_seed(0))
    expected = max_pool([x], dict(attrs))
    assert expected.dtype == dtype
    # The reference: the largest code of each window, padding left out (unfold over -inf padding).
    kernel, strides, dilations, begin, end, outs = _pool_geometry(x, attrs)
    padded = torch.nn.functional.pad(x.float(), [begin[1], end[1] + 4, begin[0], end[0] + 4], value=float("-inf"))
    windows = torch.stack([padded[:, :, i * dilations[0]:, j * dilations[1]:][:, :, ::strides[0], ::strides[1]]
                           [:, :, :outs[0], :outs[1]] for i in range(kernel[0]) for j in range(kernel[1])])
    assert torch.equal(expected.float(), windows.amax(0))
    x_cl = x.to(DEVICE).contiguous(memory_format=torch.channels_last)
    out = max_pool_nhwc(x_cl, tuple(kernel), tuple(strides), tuple(begin), tuple(dilations), tuple(outs))
    assert out.dtype == dtype and torch.equal(out.cpu().float(), expected.float())


@pytest.mark.parametrize("dtype", [torch.int8, torch.float8_e4m3fn])
def test_code_max_pool_reads_and_writes_channel_slices(dtype):
    from pool_helpers import assert_sppf_chain_in_one_buffer
    assert_sppf_chain_in_one_buffer(_codes(dtype, (2, 6, 7, 7), torch.Generator().manual_seed(5)))


def test_max_pool_tactics_take_codes_on_cuda():
    from sartor.kernels.pool.max_pool import max_pool_nhwc_supported
    x = torch.zeros(1, 8, 6, 6, dtype=torch.int8).contiguous(memory_format=torch.channels_last)
    assert max_pool_nhwc_supported(x) and max_pool_nhwc_supported(x.to(torch.float8_e4m3fn))
    assert not max_pool_nhwc_supported(x.to(torch.int32)) and not max_pool_nhwc_supported(x.contiguous())


@pytest.mark.parametrize("out_format", ["int8", "fp8", "float"])
def test_qconv_write_into_stores_into_a_slice_and_equals_the_plain_result(out_format, monkeypatch):
    from sartor.kernels.conv.igemm import TileConfig, pack_weight
    from sartor.ops import quantized
    from sartor.ops.conv import igemm_geometry
    from sartor.ops.fp8 import QFORMAT
    if DEVICE == "cpu":  # the kernel declines CPU tensors outside tests; the interpreter runs them
        monkeypatch.setattr(quantized, "_igemm_geometry",
                            lambda x, w, attrs, gemm: igemm_geometry(x, w, attrs, require_cuda=False))
    generator = torch.Generator().manual_seed(7)
    fp8 = out_format == "fp8"
    code = torch.float8_e4m3fn if fp8 else torch.int8
    attrs = {"kernel_shape": [3, 3], "pads": [1, 1, 1, 1], "input_inv_scale": 20.0, "activation": "Relu",
             "qmin": -127, "tactic": TileConfig(16, 16, 32, 1, 1).name}
    if fp8:
        attrs["qformat"] = QFORMAT
    if out_format != "float":
        attrs["output_inv_scale"] = 4.0
    source = _codes(code, (2, 40, 6, 5), generator).contiguous(memory_format=torch.channels_last)
    x = source[:, 8:40]  # a channel slice, as a Split's half
    wq = _codes(code, (24, 32, 3, 3), generator)
    bias = None if fp8 else torch.randint(-2000, 2000, (24,), dtype=torch.int32, generator=generator)
    scale = torch.rand(24, generator=generator) * 1e-3
    plain = quantized.qconv([x, wq, bias, None, scale], dict(attrs, tactic="torch"))
    out_dtype = quantized.qlayer_output_dtype(attrs)
    buffer = torch.zeros(2, 40, 6, 5, dtype=torch.float32).to(out_dtype).contiguous(memory_format=torch.channels_last)
    args = [t.to(DEVICE) if t is not None else None for t in (x, pack_weight(wq), bias, None, scale)]
    buffer = buffer.to(DEVICE)
    written = quantized.qconv_into(args, attrs, buffer[:, 10:34])
    assert written is not None and written.data_ptr() == buffer[:, 10:].data_ptr()
    got = buffer[:, 10:34].cpu()
    if fp8:  # float32 accumulation on the GPU: one e4m3 step at most (ops/quantized.py)
        from sartor.ops.fp8 import code_distance
        assert int(code_distance(got, plain).max()) <= 1
    elif out_format == "float":
        torch.testing.assert_close(got, plain, rtol=1e-6, atol=1e-6)
    else:
        assert torch.equal(got, plain)
    assert not buffer[:, :10].float().any() and not buffer[:, 34:].float().any()
    # The emulation cannot store into a slice, nor a slice of another dtype be written.
    assert quantized.qconv_into(args, dict(attrs, tactic="torch"), buffer[:, 10:34]) is None
    other = torch.zeros(2, 24, 6, 5, dtype=torch.float16).contiguous(memory_format=torch.channels_last)
    assert quantized.qconv_into(args, attrs, other.to(DEVICE)) is None
