"""passes/frame_input.py: the graph reads raw frames through a Preprocess layer, the profiles follow
the frames (batch ranges kept, frame size fixed), and a model whose names or inputs leave no room
for it is refused in one line."""
from __future__ import annotations

import pytest

from sartor.data.frame_format import parse_frame_format
from sartor.data.preprocess import parse_preprocess
from sartor.errors import ConfigError
from sartor.ir import Graph, Node, ValueInfo, verify_graph
from sartor.passes.frame_input import PREPROCESS_LAYER, accept_frames
from sartor.runtime.profiles import Profile, ShapeRange

SPEC = parse_preprocess("letterbox=16,mean=0,std=255")


def two_input_graph(image: str = "images", layer: str = "relu") -> Graph:
    """images (N×3×16×16) → Relu, beside a 2-D `scale` input."""
    inputs = [ValueInfo("scale", "float32", (1, 4)), ValueInfo(image, "float32", ("n", 3, 16, 16))]
    return Graph([Node("Relu", layer, [image], ["y"])], inputs, [ValueInfo("y", "float32", ("n", 3, 16, 16))], {})


def profiles() -> list[Profile]:
    return [Profile({"scale": ShapeRange((1, 4), (1, 4), (1, 4)),
                     "images": ShapeRange((1, 3, 16, 16), (2, 3, 16, 16), (8, 3, 16, 16))})]


def test_the_image_input_becomes_frames_read_by_the_first_layer():
    graph = two_input_graph()
    (profile,) = accept_frames(graph, profiles(), SPEC, parse_frame_format("uint8:24x40:bgr"))
    verify_graph(graph)
    assert [(v.name, v.dtype, v.shape) for v in graph.inputs] == [("scale", "float32", (1, 4)),
                                                                    ("frames", "uint8", ("n", 24, 40, 3))]
    first = graph.nodes[0]
    assert (first.op_type, first.name, first.inputs, first.outputs) == ("Preprocess", PREPROCESS_LAYER, ["frames"],
                                                                        ["images"])
    assert first.attrs == {"spec": SPEC.describe(), "frame_order": "bgr"}
    assert profile.shapes["frames"] == ShapeRange((1, 24, 40, 3), (2, 24, 40, 3), (8, 24, 40, 3))
    assert profile.shapes["scale"] == ShapeRange((1, 4), (1, 4), (1, 4)) and "images" not in profile.shapes


@pytest.mark.parametrize("graph,fragment", [
    (two_input_graph(image="frames"), "already has a value named 'frames'"),
    (two_input_graph(layer=PREPROCESS_LAYER), "already has a layer named 'preprocess'"),
    (Graph([], [ValueInfo("x", "float32", (1, 4))], [ValueInfo("x", "float32", (1, 4))], {}), "no 4-D image input"),
])
def test_a_model_without_room_for_the_layer_is_refused(graph, fragment):
    with pytest.raises(ConfigError, match=fragment) as caught:
        accept_frames(graph, [], SPEC, parse_frame_format("uint8:24x40"))
    assert "\n" not in str(caught.value)
