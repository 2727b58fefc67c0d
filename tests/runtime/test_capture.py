"""CUDA graphs in pieces (runtime/capture.py): which layers run outside the graph, and on CUDA that
every op family's layers capture, that pieces around an uncapturable layer give the eager results,
and that a layer whose capture fails is learned, said once and run eagerly — never a traceback."""
from __future__ import annotations

import importlib.util
import logging
import threading
import warnings
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper

from sartor.errors import UnsupportedModelError
from sartor.frontend.onnx import import_model_proto
from sartor.ops import default_registry
from sartor.passes import optimize
from sartor.runtime.capture import capture_pieces, plan_pieces, static_eager_layers
from sartor.runtime.concat_plan import ShapeMemo
from sartor.runtime.context import matmul_precision
from sartor.runtime.executor import Executor

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _graph(nodes, inputs, outputs, initializers=()):
    model = helper.make_model(helper.make_graph(nodes, "g", inputs, outputs, list(initializers)),
                              opset_imports=[helper.make_opsetid("", 17)])
    return import_model_proto(model)


def _box_model():
    """Conv → RoiAlign (reads its boxes on the host: not capturable) → Relu → Mul."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, 16, 16])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4, 3, 3])
    rng = np.random.default_rng(0)
    inits = [
        onnx.numpy_helper.from_array(rng.standard_normal((4, 4, 3, 3)).astype(np.float32), "w"),
        onnx.numpy_helper.from_array(np.array([[1, 1, 9, 9], [2, 3, 14, 12]], np.float32), "rois"),
        onnx.numpy_helper.from_array(np.array([0, 0], np.int64), "batch"),
        onnx.numpy_helper.from_array(np.array(1.5, np.float32), "k"),
    ]
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1], name="conv"),
             helper.make_node("RoiAlign", ["c", "rois", "batch"], ["r"], output_height=3, output_width=3, name="roi"),
             helper.make_node("Relu", ["r"], ["a"], name="relu"),
             helper.make_node("Mul", ["a", "k"], ["y"], name="scale")]
    return _graph(nodes, [x], [y], inits)


def _weights(graph, device="cpu"):
    return {name: torch.from_numpy(np.array(a)).to(device) for name, a in graph.initializers.items()}


# ---- planning (CPU) ---------------------------------------------------------------------------
def test_pieces_alternate_captured_and_eager_runs():
    pieces = plan_pieces(7, {2, 3, 6})
    assert [(p.start, p.stop, p.captured) for p in pieces] == [(0, 2, True), (2, 4, False), (4, 6, True), (6, 7, False)]
    assert [(p.start, p.stop, p.captured) for p in plan_pieces(3, set())] == [(0, 3, True)]


def test_uncapturable_op_is_eager_and_names_why():
    graph = _box_model()
    executor = Executor(graph, _weights(graph), torch.device("cpu"))
    eager = static_eager_layers(executor)
    assert [(e.name, e.op_type) for e in eager] == [("roi", "RoiAlign")]
    assert "host" in eager[0].reason


def test_every_layer_after_a_data_dependent_size_is_eager():
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [8])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, "n"])
    nodes = [helper.make_node("Relu", ["x"], ["r"], name="relu"),
             helper.make_node("NonZero", ["r"], ["nz"], name="nonzero"),
             helper.make_node("Cast", ["nz"], ["f"], to=TensorProto.FLOAT, name="cast"),
             helper.make_node("Neg", ["f"], ["y"], name="neg")]
    graph = _graph(nodes, [x], [y])
    executor = Executor(graph, {}, torch.device("cpu"))
    eager = static_eager_layers(executor)
    assert [e.name for e in eager] == ["nonzero", "cast", "neg"]
    assert "relu" not in {e.name for e in eager}


def test_a_shape_computed_on_the_device_makes_the_rest_eager():
    """Range's limit from a device value (x's first element): read on the host, and the output's
    size follows the value."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n"])
    zero = onnx.numpy_helper.from_array(np.array(0, np.int64), "zero")
    one = onnx.numpy_helper.from_array(np.array(1, np.int64), "one")
    index = onnx.numpy_helper.from_array(np.array(0, np.int64), "index")
    nodes = [helper.make_node("Relu", ["x"], ["r"], name="relu"),
             helper.make_node("Gather", ["r", "index"], ["first"], name="first"),
             helper.make_node("Cast", ["first"], ["limit"], to=TensorProto.INT64, name="limit"),
             helper.make_node("Range", ["zero", "limit", "one"], ["steps"], name="range"),
             helper.make_node("Cast", ["steps"], ["y"], to=TensorProto.FLOAT, name="cast")]
    graph = _graph(nodes, [x], [y], [zero, one, index])
    executor = Executor(graph, _weights(graph), torch.device("cpu"))
    eager = static_eager_layers(executor)
    assert [e.name for e in eager] == ["range", "cast"]
    assert "'limit', computed on the device" in eager[0].reason


def test_no_layer_of_a_plain_network_is_eager():
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 2, 8, 8])
    w = onnx.numpy_helper.from_array(np.ones((2, 3, 1, 1), np.float32), "w")
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], name="conv"), helper.make_node("Relu", ["c"], ["y"], name="relu")]
    graph = _graph(nodes, [x], [y], [w])
    assert static_eager_layers(Executor(graph, _weights(graph), torch.device("cpu"))) == []


# ---- CUDA ------------------------------------------------------------------------------------
def _eager_and_captured(executor, feeds, eager):
    """(eager outputs, replayed outputs, the piecewise graph) on the current device."""
    memo = ShapeMemo()
    stream = torch.cuda.Stream()
    with torch.inference_mode(), matmul_precision(False):
        with torch.cuda.stream(stream):
            expected = {k: v.clone() for k, v in executor.run(feeds, memo).items()}
            executor.run(feeds, memo)
        stream.synchronize()
        captured = capture_pieces(executor, {k: v.clone() for k, v in feeds.items()}, memo, 0, eager, stream)
        with torch.cuda.stream(stream):
            got = captured.replay(executor, 0)
        stream.synchronize()
    return expected, got, captured


@cuda
def test_pieces_around_an_uncapturable_layer_match_eager():
    graph = _box_model()
    device = torch.device("cuda")
    executor = Executor(graph, _weights(graph, device), device)
    eager = {e.index for e in static_eager_layers(executor)}
    feeds = {"x": torch.randn(1, 4, 16, 16, device=device)}
    expected, got, captured = _eager_and_captured(executor, feeds, eager)
    assert not captured.whole and [p.captured for p in captured.pieces] == [True, False, True]
    torch.testing.assert_close(got["y"], expected["y"])
    # New values in the same input buffers: the pieces compute them, not the capture's.
    with torch.inference_mode():
        captured.inputs["x"].copy_(torch.randn(1, 4, 16, 16, device=device))
        again = {k: v.clone() for k, v in captured.replay(executor, 0).items()}
        reference = executor.run({"x": captured.inputs["x"].clone()})
    torch.testing.assert_close(again["y"], reference["y"])


@cuda
def test_another_threads_cuda_calls_during_a_capture_break_neither():
    """A video decoder reading ahead on its own thread allocates and launches while the engine
    captures its first run: under the global capture mode both would fail."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, 8, 8])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 8, 8])
    weights = np.random.default_rng(1).standard_normal((4, 4, 3, 3)).astype(np.float32)
    w = onnx.numpy_helper.from_array(weights, "w")
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1], name="conv"),
             helper.make_node("Relu", ["c"], ["y"], name="relu")]
    graph = _graph(nodes, [x], [y], [w])
    device = torch.device("cuda")
    executor = Executor(graph, _weights(graph, device), device)
    capturing, other_done, errors = threading.Event(), threading.Event(), []

    def other_thread():
        capturing.wait(60)
        try:
            side = torch.cuda.Stream(device)
            with torch.cuda.stream(side):  # larger than any cached block: a cudaMalloc of its own
                torch.empty((1 << 30) + (7 << 20), dtype=torch.uint8, device=device).fill_(1)
            side.synchronize()
        except Exception as exc:  # noqa: BLE001 - the test's finding
            errors.append(exc)
        finally:
            other_done.set()

    run_steps = executor.run_steps

    def run_steps_beside_the_other_thread(*args, **kwargs):
        if torch.cuda.is_current_stream_capturing() and not capturing.is_set():
            capturing.set()
            other_done.wait(60)
        return run_steps(*args, **kwargs)

    executor.run_steps = run_steps_beside_the_other_thread
    helper_thread = threading.Thread(target=other_thread)
    helper_thread.start()
    try:
        expected, got, captured = _eager_and_captured(executor, {"x": torch.randn(1, 4, 8, 8, device=device)}, set())
    finally:
        capturing.set()
        helper_thread.join(60)
    assert other_done.is_set() and errors == []
    assert captured.whole
    torch.testing.assert_close(got["y"], expected["y"])


def _relu_neg_sigmoid_engine(tmp_path):
    """y = sigmoid(-relu(x)) for x of 2×8, built FP32 for CUDA and loaded."""
    import sartor
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 8])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 8])
    nodes = [helper.make_node("Relu", ["x"], ["r"], name="relu"), helper.make_node("Neg", ["r"], ["n"], name="neg"),
             helper.make_node("Sigmoid", ["n"], ["y"], name="sigmoid")]
    path = tmp_path / "m.onnx"
    onnx.save(helper.make_model(helper.make_graph(nodes, "g", [x], [y]), opset_imports=[helper.make_opsetid("", 17)]),
              path)
    plan = tmp_path / "m.plan"
    sartor.build(str(path), str(plan), device="cuda", precision="fp32")
    return sartor.load(str(plan))


@cuda
def test_a_layer_that_breaks_capture_is_learned_and_run_eagerly(tmp_path, caplog):
    """A layer made to read a device value on the host (a sync the capture cannot record): the
    context warns once naming it, runs it between graph pieces and returns the eager results."""
    engine = _relu_neg_sigmoid_engine(tmp_path)
    step = next(s for s in engine.executor.steps if s.node.name == "neg")
    plain = step.impl

    def syncing(inputs, attrs):
        float(inputs[0].sum())  # a host read of a device value
        return plain(inputs, attrs)
    step.impl = syncing
    ctx = engine.context()
    feeds = {"x": torch.randn(2, 8, device="cuda")}
    with caplog.at_level(logging.WARNING, logger="sartor.capture"):
        out = ctx.run(feeds)["y"].clone()
        again = ctx.run(feeds)["y"].clone()
    torch.testing.assert_close(out, torch.sigmoid(-torch.relu(feeds["x"])))
    torch.testing.assert_close(again, out)
    assert [e.name for e in engine.eager_layers] == ["neg"]
    warned = [r.getMessage() for r in caplog.records if "outside the CUDA graph" in r.getMessage()]
    assert len(warned) == 1 and "neg" in warned[0]


@cuda
def test_a_capture_broken_from_another_thread_is_tried_again_not_given_up(tmp_path):
    """Another thread synchronises the stream the engine is capturing on (an illegal call that
    invalidates the capture) during its first try: the context tries again and keeps the whole
    graph, where it used to run every layer eagerly from then on."""
    engine = _relu_neg_sigmoid_engine(tmp_path)
    run_steps, tries, errors = engine.executor.run_steps, [], []

    def disturb(stream):
        try:
            stream.synchronize()
        except Exception as exc:  # noqa: BLE001 - the call the capture cannot survive
            errors.append(exc)

    def run_steps_disturbed_once(*args, **kwargs):
        if torch.cuda.is_current_stream_capturing():
            tries.append(1)
            if len(tries) == 1:
                other = threading.Thread(target=disturb, args=(torch.cuda.current_stream(),))
                other.start()
                other.join(60)
        return run_steps(*args, **kwargs)

    engine.executor.run_steps = run_steps_disturbed_once
    ctx = engine.context()
    feeds = {"x": torch.randn(2, 8, device="cuda")}
    out = ctx.run(feeds)["y"].clone()
    again = ctx.run(feeds)["y"].clone()
    assert errors, "the other thread's call did not reach the capture"
    assert len(tries) >= 2 and engine.eager_layers == []
    assert all(captured.whole for captured in ctx._captured.values())
    torch.testing.assert_close(out, torch.sigmoid(-torch.relu(feeds["x"])))
    torch.testing.assert_close(again, out)


def _node_cases():
    path = Path(__file__).resolve().parents[1] / "ops" / "test_node_cases.py"
    spec = importlib.util.spec_from_file_location("node_cases_for_capture", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@cuda
def test_every_op_family_captures():
    """Every ONNX node case sartor imports, on CUDA: captured (layers outside the graph only where
    their op says so), replayed, equal to the eager run. Host inputs (shapes, axes, ...) are
    constants, as exporters write them."""
    cases_module = _node_cases()
    registry = default_registry()
    device = torch.device("cuda")
    failures, ran = [], 0
    for name, case in sorted(cases_module.CASES.items()):
        try:
            graph = import_model_proto(case.model)
        except UnsupportedModelError:
            continue
        optimize(graph)
        feeds_all = dict(zip([vi.name for vi in case.model.graph.input
                              if vi.name not in {t.name for t in case.model.graph.initializer}], case.data_sets[0][0]))
        host_names = {n for node in graph.nodes for position, n in enumerate(node.inputs)
                      if n and position in registry[node.op_type].host_inputs}
        weights = {k: cases_module._to_torch(v).to(device) for k, v in graph.initializers.items()}
        feeds = {}
        for input_name, value in feeds_all.items():
            tensor = cases_module._to_torch(value)
            if input_name in host_names:
                weights[input_name] = tensor
                graph.initializers[input_name] = cases_module._to_numpy(value)
            else:
                feeds[input_name] = tensor.to(device)
        graph.inputs = [v for v in graph.inputs if v.name in feeds]
        try:
            executor = Executor(graph, weights, device)
            with warnings.catch_warnings(), torch.inference_mode():
                warnings.simplefilter("ignore")
                executor.run(feeds)
        except Exception:  # noqa: BLE001 - a case that does not run on CUDA at all says nothing of capture
            continue
        eager = {e.index for e in static_eager_layers(executor)}
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                expected, got, _ = _eager_and_captured(executor, feeds, eager)
        except Exception as exc:  # noqa: BLE001
            failures.append(f"{name}: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}")
            continue
        ran += 1
        for out_name, value in expected.items():
            if not torch.equal(value.cpu(), got[out_name].cpu()) and not (
                    value.is_floating_point() and torch.allclose(value, got[out_name], rtol=1e-5, atol=1e-6, equal_nan=True)):
                failures.append(f"{name}: output {out_name} differs after capture")
    assert ran > 500, f"only {ran} node cases ran on CUDA"
    assert not failures, f"{len(failures)} of {ran + len(failures)} cases fail capture:\n" + "\n".join(failures)


def test_inspect_says_which_layers_run_outside_the_graph():
    from sartor.cli.inspect import _capture_summary
    cuda_print = {"fingerprint": {"kind": "cuda"}}
    assert _capture_summary({"fingerprint": {"kind": "cpu"}})["text"] == "none (CPU engine)"
    assert "not checked" in _capture_summary(cuda_print)["text"]
    assert _capture_summary({**cuda_print, "capture": {"checked": True, "eager_layers": []}})["text"] \
        == "one CUDA graph per input shape"
    record = {"checked": True, "eager_layers": [{"index": 3, "layer": "roi", "op": "RoiAlign",
                                                 "reason": "it reads device values on the host"}]}
    line = _capture_summary({**cuda_print, "capture": record})["text"]
    assert line.startswith("captured in pieces: 1 layer(s)") and "roi (RoiAlign): it reads device values" in line


@cuda
def test_every_shape_of_a_context_shares_its_memory_and_keeps_its_results(tmp_path):
    """A context captures each batch size it runs; the graphs share one memory pool, one buffer per
    input and (after the first shape) one per output, as a TensorRT context's one memory region:
    capturing seven more batch sizes adds less than the first capture did, and runs alternating
    between shapes still give each its own results."""
    import sartor
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 16, 32, 32])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 16, 32, 32])
    rng = np.random.default_rng(3)
    inits = [onnx.numpy_helper.from_array(rng.standard_normal((16, 16, 3, 3)).astype(np.float32) / 12, f"w{k}")
             for k in range(3)]
    nodes = [helper.make_node("Conv", ["x", "w0"], ["c0"], pads=[1, 1, 1, 1], name="conv0"),
             helper.make_node("Relu", ["c0"], ["r0"], name="relu0"),
             helper.make_node("Conv", ["r0", "w1"], ["c1"], pads=[1, 1, 1, 1], name="conv1"),
             helper.make_node("Relu", ["c1"], ["r1"], name="relu1"),
             helper.make_node("Conv", ["r1", "w2"], ["y"], pads=[1, 1, 1, 1], name="conv2")]
    path = tmp_path / "m.onnx"
    onnx.save(helper.make_model(helper.make_graph(nodes, "g", [x], [y], inits),
                                opset_imports=[helper.make_opsetid("", 17)]), path)
    plan = tmp_path / "m.plan"
    sartor.build(str(path), str(plan), device="cuda", precision="fp32", min_shapes={"x": (1, 16, 32, 32)},
                 opt_shapes={"x": (8, 16, 32, 32)}, max_shapes={"x": (8, 16, 32, 32)})
    engine = sartor.load(str(plan))
    ctx, eager = engine.context(), engine.context()
    eager.use_cuda_graphs = False
    feeds = {b: {"x": torch.randn(b, 16, 32, 32, device="cuda")} for b in range(1, 9)}
    torch.cuda.synchronize()
    start = torch.cuda.memory_allocated()
    ctx.run(feeds[8])
    torch.cuda.synchronize()
    first = torch.cuda.memory_allocated() - start
    for b in range(1, 8):
        ctx.run(feeds[b])
    torch.cuda.synchronize()
    more = torch.cuda.memory_allocated() - start - first
    assert more < first, (first, more)
    for b in (3, 8, 1, 8, 5):
        torch.testing.assert_close(ctx.run(feeds[b])["y"], eager.run(feeds[b])["y"], rtol=1e-4, atol=1e-4)
    buffers = ctx.input_buffers({"x": (2, 16, 32, 32)})
    assert buffers["x"].data_ptr() == ctx.input_buffers({"x": (6, 16, 32, 32)})["x"].data_ptr()
