"""passes/fuse_conv_chain.py and builder/conv_chains.py: a convolution and the 1×1 convolution that
alone reads it become one ConvChain layer. Where it fires the engine computes exactly what the two
layers computed; where it must not fire nothing is offered; the builder's stage fuses only chains
whose kernel won its timing, which on the CPU (no chain kernel offered) is none."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from passes_helpers import OnnxBuilder, quantized_graph, run_quantized

from sartor.builder.conv_chains import CHAIN_MARGIN, ChainTiming, choose_conv_chains
from sartor.ir import verify_graph
from sartor.ops.conv_chain import CHAIN
from sartor.ops.util import tensor_from_numpy
from sartor.passes.fuse_conv_chain import chain_name, chain_pairs, fuse_conv_chain
from sartor.runtime.graph_codec import decode_graph, encode_graph
from sartor.tactics import TacticSelection, TimingCache

SIZE = 12


def _images(seed: int, n: int = 2) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, 3, SIZE, SIZE)).astype(np.float32)


def backbone(down_channels: int = 16, reader_k: int = 1, reader_strides=(1, 1), second_reader: bool = False,
             residual: bool = False, head_k: int = 3):
    """A YOLO backbone's step in small: stem → 3×3 stride 2 ("down") → 1×1 ("cv1") → 1×1 ("cv2")
    → head. The keyword arguments break one condition each."""
    b = OnnxBuilder(seed=3)
    x = b.input("images", ["batch", 3, SIZE, SIZE])
    stem = b.node("Relu", [b.conv(x, 3, 8, "stem")], name="stem_act")
    down = b.node("Relu", [b.conv(stem, 8, down_channels, "down", strides=[2, 2])], name="down_act")
    cv1 = b.conv(down, down_channels, 16, "cv1", k=reader_k, strides=list(reader_strides))
    if residual:
        cv1 = b.node("Add", [cv1, down], name="add")
    cv1 = b.node("Relu", [cv1], name="cv1_act")
    cv2 = b.node("Relu", [b.conv(cv1, 16, 16, "cv2", k=1)], name="cv2_act")
    outputs = [b.conv(cv2, 16, 4, "head", k=head_k)]
    if second_reader:
        outputs.append(b.conv(down, down_channels, 4, "side", k=1))
    return b.model(outputs)


def _quantized(model):
    return quantized_graph(model, [{"images": _images(10 + k, 4)} for k in range(3)])


def _names(pairs) -> list[tuple[str, str]]:
    return [(first.name, second.name) for first, second in pairs]


def test_fires_on_a_strided_3x3_and_its_1x1_reader_and_computes_the_two_layers():
    graph, layers = _quantized(backbone())
    pairs = chain_pairs(graph, layers)
    # cv1 → cv2 would be a chain too, but cv1 is taken by the first: no layer is in two chains
    assert _names(pairs) == [("down", "cv1")]
    images = _images(1)
    expected = run_quantized(graph, layers, {"images": images})
    chain = fuse_conv_chain(graph, *pairs[0])
    verify_graph(graph)
    assert chain.op_type == CHAIN and chain.name == "down+cv1" and chain.attrs["layers"] == "QConv"
    assert [n.op_type for n in graph.nodes] == ["QConv", CHAIN, "QConv", "FusedConv"]  # the output layer stays float
    layers[chain.name] = layers["down"]
    got = run_quantized(graph, layers, {"images": images})
    assert all(torch.equal(got[name], value) for name, value in expected.items())


def test_a_chain_travels_through_the_engine_file_with_its_layers_arrays():
    graph, layers = _quantized(backbone())
    chain = fuse_conv_chain(graph, *chain_pairs(graph, layers)[0])
    header, tensors = encode_graph(graph)
    json.dumps(header)  # the engine's header is JSON: the weight scales went to tensors
    decoded = {n.name: n for n in decode_graph(header, tensors)[0].nodes}[chain.name]
    for part in ("first", "second"):
        assert sorted(decoded.attrs[part]) == sorted(chain.attrs[part])
        assert np.array_equal(decoded.attrs[part]["weight_scale"], chain.attrs[part]["weight_scale"])


@pytest.mark.parametrize("broken", [
    dict(reader_k=3),                    # the reader is no 1×1
    dict(reader_strides=(2, 2)),         # the reader strides
    dict(second_reader=True),            # the first layer's output is read twice
    dict(down_channels=136),             # more channels between the layers than a tile holds
])
def test_must_not_fire(broken):
    graph, layers = _quantized(backbone(**broken))
    assert ("down", "cv1") not in _names(chain_pairs(graph, layers))


def c2f_step():
    """A C2f's opening in small: stem → 3×3 stride 2 ("down") → 1×1 ("cv1") → Split in halves →
    bottleneck on the second half → Concat of both halves and the bottleneck → 1×1 ("cv2")."""
    b = OnnxBuilder(seed=5)
    x = b.input("images", ["batch", 3, SIZE, SIZE])
    stem = b.node("Relu", [b.conv(x, 3, 8, "stem")], name="stem_act")
    down = b.node("Relu", [b.conv(stem, 8, 16, "down", strides=[2, 2])], name="down_act")
    cv1 = b.node("Relu", [b.conv(down, 16, 16, "cv1", k=1)], name="cv1_act")
    a, h = b.node("Split", [cv1, b.const("sizes", np.array([8, 8], dtype=np.int64))], name="split", axis=1, outputs=2)
    m = b.node("Relu", [b.conv(h, 8, 8, "m")], name="m_act")
    cat = b.node("Concat", [a, h, m], name="cat", axis=1)
    cv2 = b.node("Relu", [b.conv(cat, 24, 16, "cv2", k=1)], name="cv2_act")
    return b.model([b.conv(cv2, 16, 4, "head", k=3)])


def test_a_chain_under_a_split_writes_into_the_concat_buffer_and_keeps_the_outputs(monkeypatch):
    """The chain down+cv1 on its kernel (on the GPU where there is one, else in Triton's interpreter) is
    placed in the Concat's buffer as cv1 was (runtime/concat_plan.py: the Split's halves are then views
    already in place), is stored there by the kernel, and the engine computes what the two layers
    computed, run after run."""
    from sartor.kernels.conv.chain import CHAIN_TILES
    from sartor.ops import conv_chain as conv_chain_op
    from sartor.runtime.concat_plan import ShapeMemo, SliceTarget
    from sartor.runtime.context import matmul_precision
    from sartor.runtime.executor import Executor

    graph, layers = _quantized(c2f_step())
    images = _images(6)
    expected = run_quantized(graph, layers, {"images": images})
    pairs = [pair for pair in chain_pairs(graph, layers) if (pair[0].name, pair[1].name) == ("down", "cv1")]
    chain = fuse_conv_chain(graph, *pairs[0])
    chain.attrs["tactic"] = CHAIN_TILES[0].name
    layers[chain.name] = layers["down"]
    # The bottleneck on an implicit-GEMM tile too: its output, and so the Concat's, is channels-last, as
    # on a GPU (the emulation's are not, and a buffer in NCHW gets no slices).
    next(n for n in graph.nodes if n.name == "m").attrs["tactic"] = "igemm.32x32x32.w4.s1"
    weights = {k: tensor_from_numpy(v) for k, v in graph.initializers.items()}
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # compiled kernels take CUDA tensors
    executor = Executor(graph, weights, device, layers)
    concat = next(n for n in graph.nodes if n.op_type == "Concat")
    assert executor.concat_plan.targets[chain.outputs[0]] == SliceTarget(concat.outputs[0], 0)

    stores = []
    kernel = conv_chain_op.conv_chain
    monkeypatch.setattr(conv_chain_op, "conv_chain", lambda *args, **kwargs: stores.append(
        kwargs.get("out") is not None) or kernel(*args, **kwargs))
    memo = ShapeMemo()  # what an engine context keeps per input shape
    # FP32 without TF32, as an engine context runs an FP32 layer: once a context has turned cuDNN's
    # benchmark on, the float head's convolution may otherwise pick a TF32 algorithm.
    with torch.inference_mode(), matmul_precision(False):
        for _ in range(3):
            got = executor.run({"images": torch.from_numpy(images).to(device)}, memo)
            for name, value in expected.items():
                # The float head's convolution reads the Concat's channels-last codes where the reference's
                # are NCHW: the library may sum in another order (a few ulps, by CPU), so floats are close.
                torch.testing.assert_close(got[name].cpu(), value, rtol=1e-5, atol=1e-5)
    assert stores == [False, True, True]  # the first run records shapes, the next two store in place


def test_must_not_fire_across_a_residual_different_qmin_or_a_float_layer():
    graph, layers = _quantized(backbone(residual=True))
    assert ("down", "cv1") not in _names(chain_pairs(graph, layers))
    graph, layers = _quantized(backbone())
    nodes = {n.name: n for n in graph.nodes}
    nodes["cv1"].attrs["qmin"] = -128  # folded from a Q/DQ model
    assert ("down", "cv1") not in _names(chain_pairs(graph, layers))
    graph, layers = _quantized(backbone())
    {n.name: n for n in graph.nodes}["down"].attrs["output_inv_scale"] = None  # writes floats
    assert ("down", "cv1") not in _names(chain_pairs(graph, layers))


def test_fires_on_an_int8_layer_and_its_float16_1x1_head_and_computes_the_two_layers():
    """A mixed chain: cv2 (INT8, writing float for the head) and the 1×1 output head, which stays float
    (FP16 on a GPU). Its constants are stored as the two layers' were: the head's weight in float16,
    the INT8 layer's scale in float32; the engine computes what the two layers computed."""
    from sartor.runtime.executor import Executor
    graph, layers = _quantized(backbone(head_k=1))
    assert ("cv2", "head") not in _names(chain_pairs(graph, layers))  # the CPU's float head is FP32
    layers["head"] = "fp16"
    pairs = [pair for pair in chain_pairs(graph, layers) if _names([pair]) == [("cv2", "head")]]
    assert pairs and pairs[0][0].attrs["output_inv_scale"] is None
    images = _images(3)
    expected = run_quantized(graph, layers, {"images": images})
    with pytest.raises(ValueError, match="float layer 'head' runs FP16 or BF16"):
        fuse_conv_chain(graph.copy(), *pairs[0])
    chain = fuse_conv_chain(graph, *pairs[0], layers)
    verify_graph(graph)
    assert (chain.attrs["layers"], chain.attrs["second_layers"], chain.attrs["second_dtype"]) == (
        "QConv", "FusedConv", "float16")
    layers[chain.name] = layers["cv2"]
    weights = {k: tensor_from_numpy(v) for k, v in graph.initializers.items()}
    step = next(s for s in Executor(graph, weights, torch.device("cpu"), layers).steps if s.node is chain)
    split = chain.attrs["first_inputs"]
    assert step.constants[split].dtype == torch.float16 and step.constants[1].dtype == torch.int8
    assert step.constants[4].dtype == torch.float32  # the INT8 layer's dequant scale, not rounded
    got = run_quantized(graph, layers, {"images": images})
    assert all(torch.equal(got[name], value) for name, value in expected.items())
    header, tensors = encode_graph(graph)
    decoded = {n.name: n for n in decode_graph(header, tensors)[0].nodes}[chain.name]
    assert decoded.attrs["second_dtype"] == "float16" and decoded.attrs["second_layers"] == "FusedConv"


def test_the_stem_reading_the_graph_input_opens_no_chain():
    b = OnnxBuilder(seed=4)
    x = b.input("images", ["batch", 3, SIZE, SIZE])
    stem = b.node("Relu", [b.conv(x, 3, 8, "stem")], name="stem_act")
    model = b.model([b.conv(stem, 8, 4, "head", k=1)])
    graph, layers = _quantized(model)
    assert chain_pairs(graph, layers) == []


def test_a_chain_is_fused_only_when_its_kernel_won_by_the_margin():
    assert ChainTiming("a+b", 0.9, 1.0).fused
    assert not ChainTiming("a+b", CHAIN_MARGIN * 1.0 + 1e-6, 1.0).fused  # within timing noise
    assert not ChainTiming("a+b", None, 1.0).fused and not ChainTiming("a+b", 0.5, None).fused
    assert "one kernel 0.9000 ms, two layers 1.0000 ms" in ChainTiming("a+b", 0.9, 1.0).describe()


@pytest.mark.parametrize("time_single", [False, True])
def test_the_builder_stage_on_the_cpu_fuses_nothing(time_single):
    """No chain kernel is offered for CPU tensors: the trial's chains run their reference, so each
    stays two layers and the graph and selections are left as they were."""
    graph, layers = _quantized(backbone())
    before = [n.name for n in graph.nodes]
    selections = [TacticSelection()]
    weights = {k: tensor_from_numpy(v) for k, v in graph.initializers.items()}
    feeds = [{"images": torch.from_numpy(_images(2))}]
    choice = choose_conv_chains(graph, weights, selections, feeds, torch.device("cpu"), layers, effort=1,
                                cache=TimingCache(), time_single=time_single)
    timings = choice.timings
    assert choice.fused == []
    assert [t.name for t in timings] == [chain_name(*[n for n in graph.nodes if n.name in ("down", "cv1")])]
    assert not timings[0].fused and timings[0].chain_ms is None
    assert [n.name for n in graph.nodes] == before and "down+cv1" not in layers


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the chain kernel is offered for CUDA tensors")
@pytest.mark.parametrize("precision, head_k", [("fp16", 3), ("int8", 3), ("int8", 1)])
def test_a_cuda_build_times_its_chains_and_keeps_the_outputs(tmp_path, precision, head_k):
    """With a 1×1 head, the INT8 build also times the mixed chain of cv2 and the FP16 head."""
    import onnx

    import sartor
    onnx.save(backbone(head_k=head_k), tmp_path / "m.onnx")
    calib = tmp_path / "calib.npy"
    np.save(calib, _images(5, 16))
    shapes = {"images": (8, 3, SIZE, SIZE)}
    engines = {}
    for name, exclude in (("chains", None), ("apart", ["chain.*"])):
        plan = tmp_path / f"{name}.plan"
        sartor.build(str(tmp_path / "m.onnx"), str(plan), device="cuda", precision=precision, min_shapes=shapes,
                     opt_shapes=shapes, max_shapes=shapes, calib=str(calib) if precision == "int8" else None,
                     builder_effort=1, exclude_tactics=exclude)
        engines[name] = sartor.load(plan)
    lines = {name: [line for line in e.header["build_log"] if line.startswith("chains:")]
             for name, e in engines.items()}
    assert "down+cv1" in lines["chains"][0] and lines["apart"][0].startswith("chains: 0 of ")
    assert ("cv2+head" in lines["chains"][0]) == (head_k == 1 and precision == "int8")
    images = torch.from_numpy(_images(6, 8)).cuda()
    got, expected = (engines[name].context().run({"images": images}) for name in ("chains", "apart"))
    for name, value in expected.items():
        assert torch.allclose(got[name].float(), value.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the chain kernel is offered for CUDA tensors")
def test_asked_chains_skip_the_whole_engine_check_and_refused_chains_are_not_timed(tmp_path):
    """--conv-chains keeps every chain that timed faster than its two layers, without the engines'
    comparison; --no-conv-chains times none."""
    import onnx

    import sartor
    onnx.save(backbone(), tmp_path / "m.onnx")
    np.save(tmp_path / "calib.npy", _images(5, 16))
    shapes = {"images": (8, 3, SIZE, SIZE)}
    built = {}
    for asked in (True, False):
        built[asked] = sartor.build(str(tmp_path / "m.onnx"), str(tmp_path / f"{asked}.plan"), device="cuda",
                                    precision="int8", min_shapes=shapes, opt_shapes=shapes, max_shapes=shapes,
                                    calib=str(tmp_path / "calib.npy"), builder_effort=1, conv_chains=asked).header
    log = built[True]["build_log"]
    (timed,) = [line for line in log if line.startswith("chains: ")]
    fused = int(timed.split()[1])
    assert "chains_check" not in built[True]
    assert "chains check: not run, --conv-chains keeps every chain that timed faster" in log
    assert sum(node["op"] == CHAIN for node in built[True]["graph"]["nodes"]) == fused
    assert "chains_check" not in built[False]
    assert not any(line.startswith("chains") for line in built[False]["build_log"])
    assert not any(node["op"] == CHAIN for node in built[False]["graph"]["nodes"])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the chain kernel is offered for CUDA tensors")
def test_where_every_chain_loses_the_engine_keeps_the_half_that_wins(tmp_path, monkeypatch):
    """The engine check's halves, made to decide: every chain fused (whatever its timing), the engine with
    both slower, with the first half slower, with the second faster. The engine runs the second half's chain
    alone, its header says so, and it computes what the engine without chains computes."""
    import onnx

    import sartor
    from sartor.builder import conv_chains
    onnx.save(backbone(head_k=1), tmp_path / "m.onnx")
    np.save(tmp_path / "calib.npy", _images(5, 16))
    shapes = {"images": (8, 3, SIZE, SIZE)}
    monkeypatch.setattr(conv_chains, "CHAIN_MARGIN", 1e9)
    verdicts = iter([False, False, True])  # every chain, the first half, the second half
    monkeypatch.setattr(conv_chains, "chains_win", lambda apart, chains: next(verdicts))
    kwargs = dict(device="cuda", precision="int8", min_shapes=shapes, opt_shapes=shapes, max_shapes=shapes,
                  calib=str(tmp_path / "calib.npy"), builder_effort=1)
    header = sartor.build(str(tmp_path / "m.onnx"), str(tmp_path / "half.plan"), **kwargs).header
    check = header["chains_check"]
    assert [entry["chains"] for entry in check["subsets"]] == [["down+cv1"], ["cv2+head"]]
    assert check["kept"] is True and check["kept_chains"] == ["cv2+head"]
    assert [node["name"] for node in header["graph"]["nodes"] if node["op"] == CHAIN] == ["cv2+head"]
    assert {"down", "cv1", "cv2+head"} <= {layer["name"] for layer in header["layers"]}
    assert any(line.startswith("chains: kept 1 of 2") for line in header["build_log"])
    sartor.build(str(tmp_path / "m.onnx"), str(tmp_path / "apart.plan"), conv_chains=False, **kwargs)
    images = torch.from_numpy(_images(6, 8)).cuda()
    got, expected = (sartor.load(tmp_path / f"{name}.plan").context().run({"images": images})
                     for name in ("half", "apart"))
    for name, value in expected.items():
        assert torch.allclose(got[name].float(), value.float(), rtol=2e-2, atol=2e-2)
