"""Channels-last engines keep their convolutions channels-last: an NCHW tensor in the middle of the
graph (a Reshape, as attention blocks make) is changed once before the layer that reads it, and the
changed tensor serves that value's other readers."""
from __future__ import annotations

import numpy as np
import torch
from passes_helpers import OnnxBuilder, import_graph, run_ort

from sartor.kernels.pointwise.epilogue import pixel_stride
from sartor.passes.pipelines import optimize
from sartor.runtime.executor import Executor


def _model():
    b = OnnxBuilder()
    x = b.input("x", [2, 8, 4, 4])
    a = b.node("Relu", [b.conv(x, 8, 8, "conv_a")], name="relu_a")
    flat = b.node("Reshape", [a, b.const("flat", np.array([2, 8, 16], dtype=np.int64))], name="flatten")
    square = b.node("Reshape", [flat, b.const("square", np.array([2, 8, 4, 4], dtype=np.int64))], name="unflatten")
    c = b.node("Relu", [b.conv(square, 8, 8, "conv_b")], name="relu_b")
    d = b.node("Relu", [b.conv(square, 8, 8, "conv_c")], name="relu_c")
    return b, b.model([b.node("Add", [c, d], name="add")])


def _layouts(channels_last: bool):
    b, model = _model()
    graph = import_graph(model)
    optimize(graph)
    weights = {k: torch.from_numpy(np.array(v)) for k, v in graph.initializers.items()}
    executor = Executor(graph, weights, torch.device("cpu"), channels_last=channels_last)
    seen = {}

    def before(index, step, args):
        if step.node.op_type == "FusedConv":
            seen[step.node.name] = (pixel_stride(args[0]) is not None, args[0].data_ptr())
    feeds = b.feeds()
    out = executor.run({k: torch.from_numpy(v) for k, v in feeds.items()}, before=before)
    expected = run_ort(model, feeds)
    for name, value in expected.items():
        np.testing.assert_allclose(out[name].numpy(), value, rtol=1e-4, atol=1e-5)
    return seen


def test_nchw_values_are_made_channels_last_once_for_their_readers():
    seen = _layouts(channels_last=True)
    assert set(seen) == {"conv_a", "conv_b", "conv_c"}
    assert all(nhwc for nhwc, _ in seen.values())
    assert seen["conv_b"][1] == seen["conv_c"][1]  # one copy, shared by both readers


def test_nchw_engines_are_left_alone():
    seen = _layouts(channels_last=False)
    assert not any(nhwc for nhwc, _ in seen.values())
