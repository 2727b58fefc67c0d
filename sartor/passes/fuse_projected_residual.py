"""A quantized 1×1 layer whose only reader takes it as residual (ResNet's downsample, read by its
block's last 1×1 layer) is computed inside that reader: a *projected* QConv (`ops/quantized.py`,
PROJECTION_FIRST_INPUT), whose resident kernel runs the projection's product beside its own and
adds it in the epilogue (`kernels/gemm/resident.py`, Projection).

The downsample's output is then never stored: in ResNet-50 at batch 256, 205 MB of INT8 codes in
layer1 (written by one kernel, read back by the next) and 103 MB in layer2
(docs/decisions/0012-projected-residual-fused.md).

What changes in the numbers: the projection's output is added as the float32 its own epilogue
makes before requantizing (no INT8 rounding of the residual), on the CPU as on the GPU, so the
emulation and the kernels still agree. Runs after quantization and bias correction (which
compares each quantized layer with its float original, the projection included), before tactics.

Fires where both layers are unpadded 1×1 convolutions of one K block of the resident kernel (K ≤
MAX_RESIDENT_K), the reader at stride 1, the projection at any stride, in one format (INT8 or
FP8), the projection without activation or residual of its own and reading no graph input (which
an engine may keep in NCHW for its stem: `runtime/executor.py`). Not for layers folded from a Q/DQ
model (`fold_qdq.py`): there the rounding of the residual to INT8 is the model's own.
"""
from __future__ import annotations

from ..ir import Graph, Node
from ..kernels.gemm.resident import MAX_RESIDENT_K
from .base import single_consumer
from .qdq_params import QDQ_QMIN

LAYER = "QConv"


def _plain_1x1(graph: Graph, node: Node, stride_one: bool) -> bool:
    """An unpadded, undilated, ungrouped 1×1 QConv of K ≤ MAX_RESIDENT_K (at stride 1 if asked)."""
    weight = graph.constant(node.inputs[1]) if len(node.inputs) > 1 else None
    if weight is None or weight.ndim != 4 or tuple(weight.shape[2:]) != (1, 1) or weight.shape[1] > MAX_RESIDENT_K:
        return False
    attrs = node.attrs
    strides = list(attrs.get("strides") or [1, 1])
    return (attrs.get("group", 1) == 1 and list(attrs.get("dilations") or [1, 1]) == [1, 1]
            and not any(attrs.get("pads") or [0, 0, 0, 0]) and len(strides) == 2
            and (not stride_one or strides == [1, 1]))


def _projection_of(graph: Graph, reader: Node, producers: dict, consumers: dict) -> Node | None:
    """The QConv that `reader` can take in as its projection, or None."""
    if reader.op_type != LAYER or len(reader.inputs) != 5 or not reader.inputs[3]:
        return None
    source = producers.get(reader.inputs[3])
    if source is None or source.op_type != LAYER or len(source.inputs) != 5 or source.inputs[3]:
        return None
    if single_consumer(graph, source.outputs[0], consumers) is not reader or source.attrs.get("activation"):
        return None
    same_format = source.attrs.get("qformat") == reader.attrs.get("qformat")
    folded = QDQ_QMIN in (source.attrs.get("qmin"), reader.attrs.get("qmin"))
    if not same_format or folded or source.inputs[0] in graph.input_names():
        return None
    if not _plain_1x1(graph, reader, stride_one=True) or not _plain_1x1(graph, source, stride_one=False):
        return None
    return source


def fuse_projected_residual(graph: Graph) -> int:
    """Fold each projection into its reader (module docstring); returns how many were folded."""
    fused = 0
    producers, consumers = graph.producers(), graph.consumers()
    for reader in list(graph.nodes):
        source = _projection_of(graph, reader, producers, consumers)
        if source is None:
            continue
        reader.inputs = reader.inputs[:3] + ["", reader.inputs[4], source.inputs[0], source.inputs[1],
                                             source.inputs[2], source.inputs[4]]
        reader.attrs = dict(reader.attrs, residual_scale=None,
                            projection_strides=list(source.attrs.get("strides") or [1, 1]),
                            projection_input_scale=source.attrs["input_scale"],
                            projection_input_inv_scale=source.attrs["input_inv_scale"])
        reader.origin = reader.origin + source.origin
        graph.nodes.remove(source)
        graph.value_info.pop(source.outputs[0], None)
        producers, consumers = graph.producers(), graph.consumers()
        fused += 1
    return fused
