"""passes/quantize_in_preprocess.py: a raw-frames INT8 graph's Preprocess layer writes the INT8
codes of the stem that alone reads its image, and the graph computes exactly what it computed before
(by the reference and by the kernel, through Triton's interpreter on the CPU); where some reader
takes the image otherwise the graph is left alone. On a GPU, every kernel of the stem reads the
codes as the emulation does; so do a few of its kernels under Triton's interpreter on the CPU."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from passes_helpers import OnnxBuilder, import_graph, quantized_graph

from sartor.data.frame_format import parse_frame_format
from sartor.data.preprocess import parse_preprocess
from sartor.ir import verify_graph
from sartor.kernels.common.interpreter import kernel_runs_on
from sartor.kernels.conv.igemm import TileConfig
from sartor.kernels.preprocess.letterbox import PREPROCESS_TILES
from sartor.ops.preprocess import preprocess
from sartor.ops.quantized import qconv, qlayer_weight_for_tactic
from sartor.ops.quantized_im2col import Im2colIgemm
from sartor.ops.quantized_window import window_tactic
from sartor.ops.util import tensor_from_numpy
from sartor.passes import optimize
from sartor.passes.frame_input import PREPROCESS_LAYER, accept_frames
from sartor.passes.quantize_in_preprocess import quantize_in_preprocess
from sartor.runtime.executor import Executor
from sartor.runtime.profiles import Profile, ShapeRange
from sartor.tactics.select import select_tactics

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SIZE = 16
FRAMES = parse_frame_format("uint8:21x27:bgr")  # letterboxed into SIZE × SIZE: resized, with pad bands
SPEC = f"letterbox={SIZE},mean=123.675:116.28:103.53,std=58.395:57.12:57.375,rgb,nchw"


def stem_model(second_stem: bool = False, float_reader: bool = False):
    """3 → 8 stem (3 × 3) → ReLU → 3 × 3 block → 1 × 1 head (the head stays float). The variants add
    a second INT8 stem over the image, or a float layer reading it."""
    b = OnnxBuilder(seed=3)
    x = b.input("images", ["batch", 3, SIZE, SIZE])
    stem = b.node("Relu", [b.conv(x, 3, 8, "stem")], name="stem_act")
    if second_stem:
        stem = b.node("Add", [stem, b.node("Relu", [b.conv(x, 3, 8, "stem2")], name="stem2_act")], name="join")
    block = b.node("Relu", [b.conv(stem, 8, 8, "block")], name="block_act")
    outputs = [b.conv(block, 8, 4, "head", k=1)]
    if float_reader:
        outputs.append(b.node("ReduceMean", [x], name="image_mean", axes=[2, 3], keepdims=0))
    return b.model(outputs)


def calibration() -> list[dict]:
    """Images in the range the spec makes (about -2.1 .. 2.6)."""
    rng = np.random.default_rng(5)
    return [{"images": rng.uniform(-2.1, 2.6, (4, 3, SIZE, SIZE)).astype(np.float32)} for _ in range(3)]


def frames_graph(model, precision: str = "int8", spec: str = SPEC):
    """`model` quantized (or, precision None, only optimized) and reading FRAMES: (graph, layers)."""
    if precision is None:
        graph, layers = import_graph(model), {}
        optimize(graph)
    else:
        graph, layers = quantized_graph(model, calibration(), precision)
    profile = Profile({"images": ShapeRange((1, 3, SIZE, SIZE), (2, 3, SIZE, SIZE), (4, 3, SIZE, SIZE))})
    accept_frames(graph, [profile], parse_preprocess(spec), FRAMES)
    return graph, dict(layers, **{PREPROCESS_LAYER: "fp32"})


def run(graph, layers, frames: torch.Tensor, tactic: str = "torch") -> tuple[dict, torch.Tensor]:
    """(the graph's outputs on the CPU, the image the Preprocess layer wrote), the layer on `tactic`."""
    graph = graph.copy()
    graph.nodes[0].attrs = dict(graph.nodes[0].attrs, tactic=tactic)
    weights = {k: tensor_from_numpy(v) for k, v in graph.initializers.items()}
    seen = {}

    def observe(index, step, outputs):
        if step.node.op_type == "Preprocess":
            seen["image"] = outputs[0]
    with torch.inference_mode():
        outputs = Executor(graph, weights, torch.device("cpu"), layers).run({FRAMES.name: frames}, observe=observe)
    return outputs, seen["image"]


def camera_frames(count: int = 3, seed: int = 0) -> torch.Tensor:
    return torch.from_numpy(np.random.default_rng(seed).integers(0, 256, (count, *FRAMES.size, 3), dtype=np.uint8))


@pytest.mark.parametrize("tactic", ["torch", PREPROCESS_TILES[0].name])
def test_the_stem_reads_codes_and_the_numbers_stay(tactic):
    if tactic != "torch" and not kernel_runs_on(torch.empty(0)):
        pytest.skip("a Triton tactic on CPU tensors needs Triton's interpreter, off on a GPU machine "
                    "(test_on_cuda_every_stem_kernel_reads_the_codes_as_the_emulation_does runs there)")
    before, layers = frames_graph(stem_model())
    graph = before.copy()
    assert quantize_in_preprocess(graph) == 1
    verify_graph(graph)
    preprocess, stem = graph.nodes[0], graph.nodes[1]
    assert stem.op_type == "QConv" and stem.inputs[0] == preprocess.outputs[0]
    assert (preprocess.attrs["output_scale"], preprocess.attrs["output_inv_scale"], preprocess.attrs["qmin"]) == \
        (stem.attrs["input_scale"], stem.attrs["input_inv_scale"], -127)
    assert graph.value_info[preprocess.outputs[0]].dtype == "int8"
    assert quantize_in_preprocess(graph) == 0  # once
    frames = camera_frames()
    expected, image = run(before, layers, frames, tactic)
    ours, codes = run(graph, layers, frames, tactic)
    assert image.dtype == torch.float32 and codes.dtype == torch.int8
    assert expected.keys() == ours.keys() and all(torch.equal(ours[k], expected[k]) for k in expected)


# An implicit-GEMM tile, im2col columns and packed pixel windows, small for the interpreter.
SMALL_TILE = TileConfig(16, 16, 32, 1, 1)
STEM_TACTICS = [SMALL_TILE.name, Im2colIgemm(SMALL_TILE).name, window_tactic(SMALL_TILE).name]


def test_the_stems_kernels_read_the_codes_as_they_quantized_the_image():
    """Each kernel given the codes computes what it computed quantizing the float image as it
    loaded it: the emulation's codes (both channels-last, as the layer writes them on CUDA)."""
    pytest.importorskip("triton")
    graph, _ = frames_graph(stem_model())
    assert quantize_in_preprocess(graph) == 1
    layer, stem = graph.nodes[:2]
    frames = camera_frames(2, seed=3)
    floats = {k: v for k, v in layer.attrs.items() if k not in ("output_scale", "output_inv_scale", "qmin")}
    image, codes = (preprocess([frames], attrs).to(DEVICE).contiguous(memory_format=torch.channels_last)
                    for attrs in (floats, layer.attrs))
    weight, bias, _, scale = (tensor_from_numpy(graph.initializers[name]).to(DEVICE) if name else None
                              for name in stem.inputs[1:5])
    reference = qconv([image, weight, bias, None, scale], dict(stem.attrs, tactic="torch"))
    assert reference.dtype == torch.int8
    for tactic in STEM_TACTICS:
        packed = qlayer_weight_for_tactic(weight, tactic)
        for x in (image, codes):
            got = qconv([x, packed, bias, None, scale], dict(stem.attrs, tactic=tactic))
            assert torch.equal(got, reference), (tactic, x.dtype)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_on_cuda_every_stem_kernel_reads_the_codes_as_the_emulation_does():
    """The builder's own check on real frames (not its zero feeds): each of the stem's candidates,
    now given codes where it quantized floats (windows, im2col, implicit GEMM, ...), equals the
    emulation or does not apply; none is rejected for its numbers."""
    graph, layers = frames_graph(stem_model())
    assert quantize_in_preprocess(graph) == 1
    weights = {k: tensor_from_numpy(v) for k, v in graph.initializers.items()}
    feeds = {FRAMES.name: camera_frames(4, seed=2).cuda()}
    selection = select_tactics(graph, weights, feeds, torch.device("cuda"), layers, channels_last=True, tf32=False)
    stem = selection.layers["stem"]
    assert len(stem["timings_ms"]) > 1, stem["rejected"]  # kernels ran on the codes, not the emulation alone
    assert not {t: why for t, why in stem["rejected"].items() if "differs" in why}, stem["rejected"]


def test_two_stems_of_one_scale_read_the_same_codes():
    graph, layers = frames_graph(stem_model(second_stem=True))
    before = graph.copy()
    assert quantize_in_preprocess(graph) == 1
    frames = camera_frames(seed=1)
    expected, ours = run(before, layers, frames)[0], run(graph, layers, frames)[0]
    assert all(torch.equal(ours[k], expected[k]) for k in expected)


def _untouched(graph) -> None:
    before = [(n.op_type, dict(n.attrs)) for n in graph.nodes]
    image = graph.nodes[0].outputs[0]
    assert quantize_in_preprocess(graph) == 0
    assert [(n.op_type, n.attrs) for n in graph.nodes] == before
    assert graph.value_info[image].dtype != "int8"


def test_not_where_a_float_layer_reads_the_image_too():
    _untouched(frames_graph(stem_model(float_reader=True))[0])


def test_not_in_float_builds():
    graph, _ = frames_graph(stem_model(), precision=None)
    assert graph.nodes[1].op_type == "FusedConv"
    _untouched(graph)


def test_not_for_an_fp8_stem():
    graph, _ = frames_graph(stem_model(), precision="fp8")
    assert graph.nodes[1].op_type == "QConv" and graph.nodes[1].attrs["qformat"] == "fp8e4m3"
    _untouched(graph)


def test_not_where_readers_quantize_differently():
    graph, _ = frames_graph(stem_model(second_stem=True))
    stems = [n for n in graph.nodes if n.name in ("stem", "stem2")]
    stems[1].attrs = dict(stems[1].attrs, qmin=-128)  # as a layer folded from a Q/DQ model saturates
    _untouched(graph)


def test_not_with_per_channel_input_scales():
    graph, _ = frames_graph(stem_model())
    stem = graph.nodes[1]
    stem.attrs = dict(stem.attrs, input_scale=[0.02] * 3, input_inv_scale=[50.0] * 3)  # no layer of sartor's has them
    _untouched(graph)


def test_not_where_the_image_is_a_residual_too():
    graph, _ = frames_graph(stem_model())
    stem = graph.nodes[1]
    stem.inputs = [stem.inputs[0], stem.inputs[1], stem.inputs[2], stem.inputs[0], *stem.inputs[4:]]
    _untouched(graph)


def test_not_for_a_uint8_image():
    graph, _ = frames_graph(stem_model(), spec=f"letterbox={SIZE},mean=0,std=1,rgb,nchw,dtype=uint8")
    _untouched(graph)
