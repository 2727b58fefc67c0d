"""append_nms (passes/append_nms.py): the BatchedNms layer after the sample detector's fused head,
the engine's outputs replaced by its four; a model without a YOLO head is refused in one line."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import classifier_model
from passes_helpers import import_graph, run_sartor

from sartor.errors import ConfigError
from sartor.frontend import import_onnx
from sartor.ir import verify_graph
from sartor.ops.nms import OUTPUT_NAMES, NmsSettings, batched_nms_reference
from sartor.passes import optimize
from sartor.passes.append_nms import append_nms

SAMPLE = Path(__file__).resolve().parents[2] / "samples" / "detector" / "sample_detector.onnx"


def test_appends_nms_after_the_sample_detectors_head():
    graph = import_onnx(SAMPLE).graph
    optimize(graph)
    raw = graph.copy()
    settings = NmsSettings(conf=0.05, iou=0.5, max_det=20, topk=300)
    head = append_nms(graph, settings)
    verify_graph(graph)
    assert head == "output0"
    assert [v.name for v in graph.outputs] == list(OUTPUT_NAMES)
    assert [v.dtype for v in graph.outputs] == ["int32", "float32", "float32", "int32"]
    assert [v.shape for v in graph.outputs] == [("batch",), ("batch", 20, 4), ("batch", 20), ("batch", 20)]
    node = graph.nodes[-1]
    assert node.op_type == "BatchedNms" and node.inputs == ["output0"] and NmsSettings.from_json(node.attrs) == settings
    feeds = {"images": np.random.default_rng(0).uniform(0, 1, (2, 3, 320, 320)).astype(np.float32)}
    got = run_sartor(graph, feeds)
    expected = batched_nms_reference(torch.from_numpy(run_sartor(raw, feeds)["output0"]), settings)
    for name, value in zip(OUTPUT_NAMES, expected):
        np.testing.assert_array_equal(got[name], value.numpy())


def test_output_names_the_model_already_uses_are_made_fresh():
    graph = import_onnx(SAMPLE).graph
    optimize(graph)
    old = graph.nodes[0].outputs[0]  # a value inside the model named as an NMS output
    graph.nodes[0].outputs[0] = "num_detections"
    for node in graph.nodes[1:]:
        node.inputs = ["num_detections" if name == old else name for name in node.inputs]
    info = graph.value_info.pop(old, None)
    if info is not None:
        info.name = "num_detections"
        graph.value_info["num_detections"] = info
    append_nms(graph, NmsSettings())
    verify_graph(graph)
    assert graph.outputs[0].name == "num_detections_1"


def test_a_model_without_a_yolo_head_is_refused_in_one_line():
    graph = import_graph(classifier_model())
    optimize(graph)
    with pytest.raises(ConfigError) as info:
        append_nms(graph, NmsSettings())
    message = str(info.value)
    assert "\n" not in message and "--nms needs one YOLOv8/YOLO11 detection head" in message
    assert "this model has no" in message and "(outputs: logits [" in message
