"""Which layers run INT8.

A layer can run INT8 when it is a Conv/FusedConv, a Gemm/FusedGemm or a MatMul whose weights are
constants (see `int8_unsupported` for the exact conditions). In an INT8 build every such layer
runs INT8 except, by default, the *output heads*: a conv/gemm whose output reaches a graph output
through no other conv/gemm (only Reshape/Concat/Sigmoid/Softmax/Mul/Add/… decode and
post-processing layers, or nothing at all; a Shape/Size reader carries no values and does not
count) keeps the higher precision. Those layers produce the
logits, box offsets and scores that decoding reads directly, where INT8's coarse steps cost the
most accuracy. So do the layers inside each head's *output branch*: the conv/gemm layers that
feed only that head, directly or through one another, back to the last fork, except the branch's
entry, which reads the shared features (in a YOLO head, the box and class convs after the first
of each); a plain chain or a residual block before a head is no branch, and a head whose output a
decode averages (a YOLO decode's box logits, through the DFL's expectation) has its branch INT8
(docs/decisions/0045-int8-placement-rules.md). `--layer-precision NAME=int8` quantizes one
anyway; `--layer-precision NAME=fp16` (or `--op-precision Conv=fp32`) keeps any layer out of INT8.
Every other layer runs FP16 on CUDA and FP32 on the CPU.

FP8 (`--precision fp8`, `--layer-precision NAME=fp8`) follows the same rules with the same layers:
FP8 QConv/QGemm exist for exactly the layers INT8 ones do. A model quantized with Q/DQ nodes runs
INT8 where its nodes say and no layer of it runs FP8.
"""
from __future__ import annotations

import numpy as np

from ..ir import Graph, Node
from ..ops.detection_head import YOLO_DECODE, box_logit_inputs
from ..ops.fp8 import FP8_EXACT_K
from .qdq import explicit_int8_unsupported, is_qdq_model, refuse_asymmetric

CONV_OPS = ("Conv", "FusedConv")
GEMM_OPS = ("Gemm", "FusedGemm", "MatMul")
INT8_OPS = CONV_OPS + GEMM_OPS
FLOAT_TYPES = ("float32", "float16", "bfloat16", "float64")
# Ops that read an input's shape and never its values. Exporters size a detector's anchor grid from
# Shape of the feature maps (Ultralytics with dynamic=True): that path carries no activation to the
# output, so it must not make the conv that writes a feature map an output head.
SHAPE_ONLY_OPS = ("Shape", "Size")


def _float_or_unknown(graph: Graph, name: str) -> bool:
    dtype = graph.dtype_of(name)
    return dtype is None or dtype in FLOAT_TYPES


def gemm_weight_rows(graph: Graph, node: Node) -> int | None:
    """M (output features) of a Gemm/MatMul with a constant 2-D weight."""
    w = graph.constant(node.inputs[1]) if len(node.inputs) > 1 else None
    if w is None or w.ndim != 2:
        return None
    if node.op_type == "MatMul":
        return int(w.shape[1])
    return int(w.shape[0] if node.attrs.get("transB", 0) else w.shape[1])


def quantized_unsupported(graph: Graph, node: Node, precision: str) -> str | None:
    """Why this layer cannot run at `precision` ("int8" or "fp8"; None when it can)."""
    if precision == "fp8":
        if node.op_type not in INT8_OPS:
            return f"no FP8 kernel for {node.op_type}"
        if is_qdq_model(graph):
            return "the model is quantized with Q/DQ nodes (INT8 with its own scales): no layer of it runs FP8"
        reason = int8_unsupported(graph, node)
        if reason is None and _reduction_length(graph, node) > FP8_EXACT_K:
            return (f"its reduction length {_reduction_length(graph, node)} exceeds {FP8_EXACT_K}, beyond which the "
                    f"CPU emulation of FP8 sums is no longer exact")
        return reason
    return int8_unsupported(graph, node)


def _reduction_length(graph: Graph, node: Node) -> int:
    """K: the products summed into each output (kh·kw·C/group for a conv, the inner size of a GEMM)."""
    weight = graph.constant(node.inputs[1])
    if node.op_type in CONV_OPS:
        return int(np.prod(weight.shape[1:]))
    if node.op_type in ("Gemm", "FusedGemm"):
        return int(weight.shape[1] if node.attrs.get("transB", 0) else weight.shape[0])
    return int(weight.shape[-2])


def int8_unsupported(graph: Graph, node: Node) -> str | None:
    """Why this layer cannot run INT8 (None when it can)."""
    if node.op_type not in INT8_OPS:
        return f"no INT8 kernel for {node.op_type}"
    explicit = explicit_int8_unsupported(graph, node)  # Q/DQ models: INT8 only where the model says
    if explicit is not None:
        return explicit
    if not node.inputs or not node.inputs[0] or graph.is_constant(node.inputs[0]):
        return "its data input is a constant"
    if not _float_or_unknown(graph, node.inputs[0]):
        return f"its data input is {graph.dtype_of(node.inputs[0])}"
    weight = graph.constant(node.inputs[1]) if len(node.inputs) > 1 and node.inputs[1] else None
    if weight is None:
        return "its weights are not constants"
    if weight.dtype.name not in FLOAT_TYPES:
        return f"its weights are {weight.dtype.name}"
    if node.op_type in CONV_OPS:
        if weight.ndim < 3:
            return "its weights are not a convolution kernel"
        bias = node.inputs[2] if len(node.inputs) > 2 else ""
        if bias and not graph.is_constant(bias):
            return "its bias is not a constant"
        return None
    if weight.ndim != 2:
        return f"its weight has rank {weight.ndim}, not 2"
    if node.op_type == "MatMul":
        return None
    if node.attrs.get("transA", 0):
        return "transA=1"
    if len(node.inputs) > 3 and any(node.inputs[3:]):
        return "it has a residual input"
    bias = node.inputs[2] if len(node.inputs) > 2 else ""
    if bias:
        c = graph.constant(bias)
        if c is None:
            return "its bias is not a constant"
        if c.size not in (1, gemm_weight_rows(graph, node)) or (c.ndim == 2 and c.shape[0] != 1) or c.ndim > 2:
            return f"its bias has shape {list(c.shape)}, not one value per output"
    return None


def int8_candidates(graph: Graph) -> list[Node]:
    return [node for node in graph.nodes if int8_unsupported(graph, node) is None]


def int8_positions(node: Node) -> list[int]:
    """Input positions an INT8 layer reads in INT8: the data input, and a FusedConv's residual."""
    positions = [0]
    if node.op_type in CONV_OPS and len(node.inputs) > 3 and node.inputs[3]:
        positions.append(3)
    return positions


def calibration_targets(graph: Graph) -> dict[str, list[int]]:
    """layer name → the input positions to calibrate, for every layer that could run INT8
    (whatever the plan: a calibration cache then serves any later choice of layers)."""
    return {node.name: int8_positions(node) for node in int8_candidates(graph)}


def output_heads(graph: Graph, candidates: list[Node]) -> dict[str, str]:
    """candidate name → the graph output it reaches through no other candidate."""
    candidate_names = {n.name for n in candidates}
    consumers = graph.consumers()
    outputs = graph.output_names()
    heads = {}
    for node in candidates:
        frontier = [o for o in node.outputs if o]
        visited = set(frontier)
        reached = None
        while frontier and reached is None:
            value = frontier.pop()
            if value in outputs:
                reached = value
                break
            for user in consumers.get(value, []):
                if user.name in candidate_names or user.op_type in SHAPE_ONLY_OPS:
                    continue
                for out in user.outputs:
                    if out and out not in visited:
                        visited.add(out)
                        frontier.append(out)
        if reached is not None:
            heads[node.name] = reached
    return heads


def output_branches(graph: Graph, candidates: list[Node], heads: dict[str, str]) -> dict[str, str]:
    """candidate name → the output head whose private branch it lies inside (docs/decisions/
    0045-int8-placement-rules.md). From each head the walk goes back through the conv/gemm layers
    that produce its data input, each the only value reader of its producer's output (a Shape/Size
    reader carries no values), until it reaches a *fork*: a layer whose output has other readers
    or is a graph output. The layers passed form the branch; its entry, the one that reads the
    fork, runs quantized like the fork's other readers, the others are returned. No fork (a chain
    from the graph input), a layer of another kind on the way, or a join (a layer with a second
    activation input, such as a residual) means no branch: those are a network's trunk, not a
    head's private layers."""
    by_name = {n.name: n for n in candidates}
    producers = graph.producers()
    consumers = graph.consumers()
    graph_outputs = graph.output_names()

    def value_readers(node: Node) -> list[Node]:
        return [r for out in node.outputs if out for r in consumers.get(out, []) if r.op_type not in SHAPE_ONLY_OPS]

    def joins(node: Node) -> bool:
        return any(v and not graph.is_constant(v) for v in node.inputs[1:])

    inside: dict[str, str] = {}
    for head in heads:
        chain, node = [], by_name[head]
        while True:
            producer = producers.get(node.inputs[0]) if node.inputs and node.inputs[0] else None
            if producer is None or producer.name not in by_name:
                chain = []  # the graph input or another kind of layer: no fork found
                break
            if len(value_readers(producer)) > 1 or any(out in graph_outputs for out in producer.outputs):
                break  # the fork: `chain` is the branch, its last layer the entry
            if producer.name in heads or joins(producer):
                chain = []
                break
            chain.append(producer)
            node = producer
        inside.update({member.name: head for member in chain[:-1]})
    return inside


def averaged_heads(graph: Graph, heads: dict[str, str]) -> set[str]:
    """The output heads whose output a decode averages before anything is ranked: those writing a
    YoloDecode's box logits, which the DFL turns into an expectation over its bins. Their branch
    layers run INT8 (decision 0045: measured no less accurate); a head feeding the class logits,
    which the scores take with nothing after them, keeps its branch float."""
    producers = graph.producers()
    box_logits = [name for node in graph.nodes if node.op_type == YOLO_DECODE for name in box_logit_inputs(node)]
    return {producers[name].name for name in box_logits if name in producers and producers[name].name in heads}


def int8_decisions(graph: Graph, base: str, precision: str = "int8") -> dict[str, tuple[str, str]]:
    """For an INT8 (FP8) build: layer name → (precision, reason) for every conv/gemm layer.
    Candidates run `precision` (reason ""); output heads, the layers inside their output branches
    (`output_branches`) and the layers without a kernel at that precision get `base`. A Q/DQ model
    with asymmetric activation zero points is refused (`sartor.quant.qdq`)."""
    if precision == "int8":
        refuse_asymmetric(graph)
    word = precision.upper()
    candidates = [node for node in graph.nodes if quantized_unsupported(graph, node, precision) is None]
    heads = output_heads(graph, candidates)
    averaged = averaged_heads(graph, heads)
    branches = output_branches(graph, candidates, {h: out for h, out in heads.items() if h not in averaged})
    decisions = {}
    for node in graph.nodes:
        if node.op_type not in INT8_OPS:
            continue
        why = quantized_unsupported(graph, node, precision)
        if why is not None:
            decisions[node.name] = (base, f"not {word}: {why}")
        elif node.name in heads:
            reason = (f"output head, kept out of {word}: reaches output {heads[node.name]!r} through no other "
                      f"conv/gemm (--layer-precision {node.name}={precision} to quantize it)")
            decisions[node.name] = (base, reason)
        elif node.name in branches:
            reason = (f"output branch, kept out of {word}: inside the layers that feed only output head "
                      f"{branches[node.name]!r} (--layer-precision {node.name}={precision} to quantize it)")
            decisions[node.name] = (base, reason)
        else:
            decisions[node.name] = (precision, "")
    return decisions
