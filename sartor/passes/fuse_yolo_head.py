"""Fuse the decode of a YOLOv8 / YOLO11 detection head into one YoloDecode layer.

Ultralytics exports the decode after the head convs as some 20 layers: per scale, Reshape of the
box logits [B, 4R, H, W] and of the class logits [B, NC, H, W] to [B, C, HW]; Concat along anchors;
the DFL (Reshape to [B, 4, R, A], Transpose, Softmax over the R bins, a 1x1 Conv with weights
0..R-1, Reshape); dist2bbox (Slice, Sub, Add, Div, Concat); Mul by the strides; Sigmoid of the
classes; Concat to [B, 4 + NC, A]. The anchor grid and strides come from constants or, in dynamic
exports, from Shape of the feature maps (host arithmetic). Hand-written heads spell the DFL as
Mul by arange and ReduceSum, and may fold the strides into the anchors.

Matching, in stages:
1. the region: from a Concat, every ancestor up to the head's logits (values produced by anything
   but the decode ops below, a Conv among them only as the DFL's, or graph inputs); Shape readers
   end the walk too. Every value made inside must be read only inside.
2. the logits: those reaching the one Softmax with 4R channels are box logits (R: the bins of the
   DFL conv, arange weights [1, R, 1, 1] and no bias, where the DFL is one), those reaching the one
   Sigmoid class logits, each in the order the walk from there meets them (their Concat's order).
   Scale i pairs the i-th of each, which must share a feature map through stride-1, same-padded
   convs; a Shape reader must read one scale's maps.
3. the numbers: the region runs on random logits at two probe sizes (the graph's static dims, small
   others), the strides are fitted per scale and the whole output must equal YoloDecode's. This
   checks every constant at once: bins, softmax axis, split sizes, xywh form, anchor offsets,
   strides, the order of every Concat.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..ir import Graph, Node
from ..ops import default_registry
from ..ops.detection_head import yolo_decode_reference
from ..ops.elementwise import FUSABLE_ACTIVATIONS
from ..ir.dtypes import NUMPY_TO_TORCH
from ..ops.util import tensor_from_numpy

# What an exported decode is made of; anything else producing a value the region reads ends it.
DECODE_OPS = frozenset({
    "Reshape", "Flatten", "Transpose", "Squeeze", "Unsqueeze", "Concat", "Split", "Slice", "Gather",
    "Softmax", "Conv", "ReduceSum", "Sub", "Add", "Mul", "Div", "Sigmoid", "Shape", "Size", "Range", "Cast",
    "Expand", "ConstantOfShape", "Tile", "Identity",
})
SHAPE_READERS = ("Shape", "Size")
MAX_REGION_NODES = 400
PROBE_BATCHES = (2, 1)
# Box logits spread so that each side's softmax is neither flat nor one-hot.
BOX_LOGIT_SCALE, CLASS_LOGIT_SCALE = 2.0, 3.0


@dataclass
class YoloHead:
    final: Node  # the Concat writing [B, 4 + NC, A]
    nodes: list  # the region, in graph order
    boxes: list  # per scale: box logits [B, 4R, H, W]
    classes: list  # per scale: class logits [B, NC, H, W]
    shape_reads: dict  # value read only by Shape/Size -> its scale
    reg_max: int


# ---- stage 1: the region ---------------------------------------------------------------------
def _dfl_bins(graph: Graph, node: Node) -> int | None:
    """R when `node` is the DFL's conv: weights arange(R) as [1, R, 1, 1], no bias, plain 1x1."""
    if node.op_type != "Conv" or len(node.present_inputs()) != 2 or not graph.is_constant(node.inputs[1]):
        return None
    weight = graph.constant(node.inputs[1])
    if weight.ndim != 4 or weight.shape[0] != 1 or weight.shape[2:] != (1, 1) or weight.shape[1] < 2:
        return None
    bins = weight.shape[1]
    if not np.array_equal(weight.reshape(-1).astype(np.float64), np.arange(bins, dtype=np.float64)):
        return None
    if node.attrs.get("group", 1) != 1 or any(s != 1 for s in node.attrs.get("strides") or [1, 1]) \
            or any(p != 0 for p in node.attrs.get("pads") or [0]) or node.attrs.get("auto_pad", "NOTSET") != "NOTSET":
        return None
    return bins


def _in_decode(graph: Graph, node: Node) -> bool:
    return node.op_type in DECODE_OPS and (node.op_type != "Conv" or _dfl_bins(graph, node) is not None)


def _region(graph: Graph, final: Node, producers: dict) -> tuple[list, list] | None:
    """(region nodes in graph order, values it reads as data from outside, in first-met order)."""
    members = {id(final): final}
    leaves: list[str] = []
    stack = [final]
    while stack:
        node = stack.pop()
        if node.op_type in SHAPE_READERS:
            continue
        for name in node.present_inputs():
            if graph.is_constant(name):
                continue
            producer = producers.get(name)
            if producer is None or not _in_decode(graph, producer):
                if name not in leaves:
                    leaves.append(name)
            elif id(producer) not in members:
                members[id(producer)] = producer
                stack.append(producer)
                if len(members) > MAX_REGION_NODES:
                    return None
    return [n for n in graph.nodes if id(n) in members], leaves


def _closed(graph: Graph, nodes: list, final: Node, consumers: dict) -> bool:
    """Nothing outside the region reads a value made inside it, but the final output."""
    inside = {id(n) for n in nodes}
    outputs = graph.output_names()
    for node in nodes:
        for value in node.outputs:
            if not value or value == final.outputs[0]:
                continue
            if value in outputs or any(id(user) not in inside for user in consumers.get(value, [])):
                return False
    return True


# ---- stage 2: the logits and their scales -----------------------------------------------------
def _leaves_reached(start: Node, members: dict, producers: dict, leaves: set) -> list[str]:
    """Region leaves above `start`, depth first in input order: for a Concat, its inputs' order."""
    found: list[str] = []
    seen: set = set()

    def visit(node: Node) -> None:
        if id(node) in seen or node.op_type in SHAPE_READERS:
            return
        seen.add(id(node))
        for name in node.present_inputs():
            if name in leaves and name not in found:
                found.append(name)
            elif name in producers and id(producers[name]) in members:
                visit(producers[name])
    visit(start)
    return found


def _keeps_size(graph: Graph, node: Node, producers: dict) -> bool:
    """Output H×W equals input H×W: stride-1 same-padded convs, unary activations, x·sigmoid(x)."""
    if node.op_type in FUSABLE_ACTIVATIONS:
        return True
    if node.op_type == "Mul":
        sigmoid = producers.get(node.inputs[1])
        return sigmoid is not None and sigmoid.op_type == "Sigmoid" and sigmoid.inputs[0] == node.inputs[0]
    if node.op_type not in ("Conv", "FusedConv"):
        return False
    kernel = node.attrs.get("kernel_shape")
    weight_shape = graph.shape_of(node.inputs[1])
    kernel = list(kernel) if kernel else (list(weight_shape[2:]) if weight_shape else None)
    if not kernel or any(s != 1 for s in node.attrs.get("strides") or [1] * len(kernel)) \
            or any(d != 1 for d in node.attrs.get("dilations") or [1] * len(kernel)):
        return False
    if node.attrs.get("auto_pad", "NOTSET") in ("SAME_UPPER", "SAME_LOWER"):
        return True
    pads = list(node.attrs.get("pads") or [0] * 2 * len(kernel))
    return pads == [(k - 1) // 2 for k in kernel] * 2 and all(k % 2 for k in kernel)


def _same_size_values(graph: Graph, value: str, producers: dict, limit: int = 16) -> set:
    """`value` and the values above it whose H×W it keeps (the head's branch back to its feature map)."""
    chain = {value}
    for _ in range(limit):
        producer = producers.get(value)
        if producer is None or not _keeps_size(graph, producer, producers):
            break
        value = producer.inputs[0]
        chain.add(value)
    return chain


def _channels(graph: Graph, value: str) -> int | None:
    shape = graph.shape_of(value)
    if shape is None or len(shape) != 4 or not isinstance(shape[1], int):
        return None
    return shape[1]


def match_yolo_head(graph: Graph, final: Node, producers: dict, consumers: dict) -> YoloHead | None:
    """Stages 1 and 2 for the Concat `final` (the numbers are checked by `verify_strides`)."""
    if final.op_type != "Concat" or len(final.inputs) < 2:
        return None
    found = _region(graph, final, producers)
    if found is None:
        return None
    nodes, leaves = found
    softmaxes = [n for n in nodes if n.op_type == "Softmax"]
    sigmoids = [n for n in nodes if n.op_type == "Sigmoid"]
    dfl_convs = [n for n in nodes if n.op_type == "Conv"]
    if len(softmaxes) != 1 or len(sigmoids) != 1 or len(dfl_convs) > 1 \
            or not _closed(graph, nodes, final, consumers):
        return None
    members = {id(n): n for n in nodes}
    leaf_set = set(leaves)
    reached = _leaves_reached(softmaxes[0], members, producers, leaf_set)
    if dfl_convs:  # Ultralytics' DFL: a 1x1 conv (the walk only enters one with arange weights)
        reg_max = _dfl_bins(graph, dfl_convs[0])
    else:  # written out, e.g. Mul by arange and ReduceSum: the numbers will tell
        widths = {_channels(graph, v) for v in reached}
        reg_max = widths.pop() // 4 if len(widths) == 1 and None not in widths else 0
    if reg_max < 2:
        return None
    boxes = [v for v in reached if _channels(graph, v) == 4 * reg_max]
    classes = [v for v in _leaves_reached(sigmoids[0], members, producers, leaf_set) if v not in boxes]
    if not boxes or len(boxes) != len(classes) or set(boxes) | set(classes) != leaf_set:
        return None
    if len({_channels(graph, v) for v in classes}) != 1 or _channels(graph, classes[0]) is None:
        return None
    branches = []
    for box, cls in zip(boxes, classes):
        box_chain, cls_chain = _same_size_values(graph, box, producers), _same_size_values(graph, cls, producers)
        if not box_chain & cls_chain:  # not one scale's pair (a Concat of another order)
            return None
        branches.append(box_chain | cls_chain)
    shape_reads = {}
    made_inside = {v for n in nodes for v in n.outputs}
    for node in nodes:
        if node.op_type in SHAPE_READERS and node.inputs[0] not in made_inside:
            scales = [i for i, branch in enumerate(branches) if node.inputs[0] in branch]
            if len(scales) != 1:
                return None
            shape_reads[node.inputs[0]] = scales[0]
    return YoloHead(final, nodes, boxes, classes, shape_reads, reg_max)


# ---- stage 3: the numbers ---------------------------------------------------------------------
def _probe_sizes(graph: Graph, head: YoloHead, probe: int) -> tuple[int, list] | None:
    """(batch, [(H_i, W_i)]): the graph's static dims, small distinct sizes for the others."""
    batch, sizes = None, []
    scales = len(head.boxes)
    for i, (box, cls) in enumerate(zip(head.boxes, head.classes)):
        dims = []
        for axis, default in ((0, PROBE_BATCHES[probe]), (2, 3 + 2 * (scales - i) + probe),
                              (3, 2 + 3 * (scales - i) - probe)):
            known = {s[axis] for s in (graph.shape_of(box), graph.shape_of(cls)) if isinstance(s[axis], int)}
            if len(known) > 1:
                return None
            dims.append(known.pop() if known else default)
        if batch is not None and dims[0] != batch:
            return None
        batch = dims[0]
        sizes.append((dims[1], dims[2]))
    return batch, sizes


def _run_region(graph: Graph, head: YoloHead, feeds: dict) -> torch.Tensor | None:
    """The region's output, its layers run by the registry's reference implementations."""
    registry = default_registry()
    env = dict(feeds)
    for node in head.nodes:
        opdef = registry.get(node.op_type)
        if opdef is None:
            return None
        args = []
        for name in node.inputs:
            if not name:
                args.append(None)
            elif name in env:
                args.append(env[name])
            elif graph.is_constant(name):
                args.append(tensor_from_numpy(graph.constant(name)))
            else:
                return None
        try:
            result = opdef.impl(args, opdef.fill_attrs(node.attrs))
        except Exception:  # noqa: BLE001 - the region does not run at these sizes: not the pattern
            return None
        for name, value in zip(node.outputs, result if isinstance(result, (tuple, list)) else (result,)):
            env[name] = value
    return env.get(head.final.outputs[0])


def _probe(graph: Graph, head: YoloHead, probe: int) -> tuple[list, list, torch.Tensor] | None:
    """Random logits at one probe size, and what the region makes of them."""
    found = _probe_sizes(graph, head, probe)
    if found is None:
        return None
    batch, sizes = found
    dtype = NUMPY_TO_TORCH.get(graph.dtype_of(head.boxes[0]) or "float32", torch.float32)
    generator = torch.Generator().manual_seed(probe)
    num_classes = _channels(graph, head.classes[0])
    boxes = [torch.randn(batch, 4 * head.reg_max, h, w, generator=generator) * BOX_LOGIT_SCALE for h, w in sizes]
    classes = [torch.randn(batch, num_classes, h, w, generator=generator) * CLASS_LOGIT_SCALE for h, w in sizes]
    boxes, classes = [t.to(dtype) for t in boxes], [t.to(dtype) for t in classes]
    feeds = dict(zip(head.boxes, boxes)) | dict(zip(head.classes, classes))
    for value, scale in head.shape_reads.items():
        if value not in feeds:  # a Shape of the logits themselves reads the logits given above
            h, w = sizes[scale]
            feeds[value] = torch.zeros(batch, _channels(graph, value) or 1, h, w, dtype=dtype)
    out = _run_region(graph, head, feeds)
    expected_shape = (batch, 4 + num_classes, sum(h * w for h, w in sizes))
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != expected_shape or not out.is_floating_point():
        return None
    return boxes, classes, out.float()


def _fit_strides(boxes: list, out: torch.Tensor, reg_max: int) -> list[float]:
    """Per scale, the factor between the region's boxes and the decode's at stride 1 (least squares)."""
    unit = yolo_decode_reference([b.float() for b in boxes], [torch.zeros(b.shape[0], 1, *b.shape[2:]) for b in boxes],
                                 reg_max, [1.0] * len(boxes))
    strides, start = [], 0
    for box in boxes:
        end = start + box.shape[2] * box.shape[3]
        ours, base = out[:, :4, start:end].double(), unit[:, :4, start:end].double()
        stride = float((ours * base).sum() / (base * base).sum())
        strides.append(float(round(stride)) if abs(stride - round(stride)) <= 1e-4 * max(1.0, abs(stride)) else stride)
        start = end
    return strides


def verify_strides(graph: Graph, head: YoloHead) -> list[float] | None:
    """The strides with which YoloDecode equals the region at every probe size, or None."""
    strides = None
    for probe in range(len(PROBE_BATCHES)):
        found = _probe(graph, head, probe)
        if found is None:
            return None
        boxes, classes, out = found
        if strides is None:
            strides = _fit_strides(boxes, out, head.reg_max)
        expected = yolo_decode_reference([b.float() for b in boxes], [c.float() for c in classes], head.reg_max,
                                         strides)
        tolerance = 1e-4 if boxes[0].dtype == torch.float32 else 2e-2
        if not torch.isfinite(out).all() or ((out - expected).abs() > tolerance * (1 + expected.abs())).any():
            return None
    return strides


# ---- the rewrite ------------------------------------------------------------------------------
def _replace(graph: Graph, head: YoloHead, strides: list[float]) -> None:
    fused = Node("YoloDecode", graph.fresh_name(head.final.name + "_yolo_decode"), head.boxes + head.classes,
                 [head.final.outputs[0]], {"reg_max": head.reg_max, "strides": strides},
                 origin=[o for n in head.nodes for o in n.origin])
    graph.nodes.insert(graph.nodes.index(head.final), fused)
    region = {id(n) for n in head.nodes}
    removed = {v for n in head.nodes for v in n.outputs} - {head.final.outputs[0]}
    graph.nodes = [n for n in graph.nodes if id(n) not in region]
    for value in removed:
        graph.value_info.pop(value, None)


def fuse_yolo_head(graph: Graph) -> int:
    rewrites = 0
    alive = {id(n) for n in graph.nodes}
    for node in list(graph.nodes):
        if node.op_type != "Concat" or len(node.inputs) < 2 or id(node) not in alive:
            continue
        head = match_yolo_head(graph, node, graph.producers(), graph.consumers())
        if head is None:
            continue
        strides = verify_strides(graph, head)
        if strides is None:
            continue
        _replace(graph, head, strides)
        alive = {id(n) for n in graph.nodes}
        rewrites += 1
    return rewrites
