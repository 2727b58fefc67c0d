"""`--input-format uint8`: the graph takes raw uint8 frames, N×H×W×3 of one declared size, and a
`Preprocess` layer (ops/preprocess.py) makes the model's image input from them with the engine's
stored `--preprocess`. The profiles follow: each keeps its batch range, the frame size is fixed,
so a frame of another size is refused at the gate."""
from __future__ import annotations

from ..data.frame_format import FrameFormat
from ..data.preprocess import PreprocessSpec
from ..errors import ConfigError
from ..ir import Graph, Node, ValueInfo
from ..runtime.profiles import Profile, ShapeRange

PREPROCESS_LAYER = "preprocess"


def accept_frames(graph: Graph, profiles: list[Profile], spec: PreprocessSpec,
                  frames: FrameFormat) -> list[Profile]:
    """Rewrites `graph` in place to read `frames` through a Preprocess layer; returns the profiles
    over the new input. The image input is the first 4-D input, as --preprocess's check finds it."""
    image = next((v for v in graph.inputs if v.shape is not None and len(v.shape) == 4), None)
    if image is None:
        raise ConfigError(f"--input-format {frames.describe()}: the model has no 4-D image input")
    taken = {v.name for v in graph.inputs} | set(graph.value_info) | set(graph.initializers) | \
        {out for node in graph.nodes for out in node.outputs}
    if frames.name in taken:
        raise ConfigError(f"--input-format {frames.describe()}: the model already has a value named "
                          f"{frames.name!r}, the name of the frames input")
    if PREPROCESS_LAYER in {node.name for node in graph.nodes}:
        raise ConfigError(f"--input-format {frames.describe()}: the model already has a layer named "
                          f"{PREPROCESS_LAYER!r}")
    frames_info = ValueInfo(frames.name, "uint8", (image.shape[0], *frames.size, 3))
    graph.inputs = [frames_info if v is image else v for v in graph.inputs]
    graph.value_info[image.name] = image
    graph.value_info[frames.name] = frames_info
    graph.nodes.insert(0, Node("Preprocess", PREPROCESS_LAYER, [frames.name], [image.name],
                               {"spec": spec.describe(), "frame_order": frames.order}))

    def over_frames(r: ShapeRange) -> ShapeRange:
        return ShapeRange(frames.shape(r.min[0]), frames.shape(r.opt[0]), frames.shape(r.max[0]))
    return [Profile({(frames.name if name == image.name else name): (over_frames(r) if name == image.name else r)
                     for name, r in profile.shapes.items()}) for profile in profiles]
