"""`sartor build --nms`: a BatchedNms layer after the YOLO head, its four fixed-size tensors the
engine's outputs in place of the raw head (see ops/nms.py and docs/decisions/0023).

It runs after `optimize`, so the head is the YoloDecode layer `fuse_yolo_head` made: a graph
output [B, 4 + C, A] whose decode sartor has checked numerically. A model without one (a
classifier, a head that did not fuse, an export that already ends in NMS) is refused in one line.
"""
from __future__ import annotations

from ..errors import ConfigError
from ..ir import Graph, Node, ValueInfo
from ..ops.nms import OUTPUT_NAMES, NmsSettings

HEAD_OP = "YoloDecode"


def yolo_head_output(graph: Graph) -> str:
    """The graph output a fused YOLO head writes, or ConfigError naming what the model gives."""
    outputs = graph.output_names()
    heads = [n.outputs[0] for n in graph.nodes if n.op_type == HEAD_OP and n.outputs[0] in outputs]
    if len(heads) != 1:
        listing = ", ".join(f"{v.name} {list(v.shape) if v.shape is not None else '?'}" for v in graph.outputs)
        found = "no" if not heads else f"{len(heads)}"
        raise ConfigError(f"--nms needs one YOLOv8/YOLO11 detection head (an output [B, 4+C, anchors] decoded by "
                          f"the head's DFL, as Ultralytics exports it); this model has {found} (outputs: {listing})")
    return heads[0]


def append_nms(graph: Graph, settings: NmsSettings) -> str:
    """Rewrite in place; returns the head output the NMS reads (no longer an engine output)."""
    head = yolo_head_output(graph)
    info = next(v for v in graph.outputs if v.name == head)
    shape = info.shape
    if shape is None or len(shape) != 3 or not isinstance(shape[1], int) or shape[1] <= 4:
        raise ConfigError(f"--nms: the head output {head} is {list(shape) if shape else '?'}, not [B, 4+C, anchors] "
                          f"with a fixed number of classes")
    batch = shape[0]
    names = [graph.fresh_name(name) for name in OUTPUT_NAMES]
    shapes = ((batch,), (batch, settings.max_det, 4), (batch, settings.max_det), (batch, settings.max_det))
    dtypes = ("int32", "float32", "float32", "int32")
    node = Node("BatchedNms", graph.fresh_name(head + "_nms"), [head], names, settings.to_json(),
                origin=[f"--nms {settings.describe()}"])
    graph.nodes.append(node)
    new_outputs = [ValueInfo(n, d, s) for n, d, s in zip(names, dtypes, shapes)]
    for value in new_outputs:
        graph.value_info[value.name] = value
    graph.value_info.setdefault(head, info)
    graph.outputs = [v for v in graph.outputs if v.name != head] + new_outputs
    return head
