"""Q → DQ → Relu (or Clip) → Q, where both Qs quantize the same way: the first pair goes.

ONNX Runtime's QDQ quantizer with symmetric activations writes Conv → Q → DQ → Relu → Q → DQ.
With a symmetric zero point and one scale s on both sides, Q(clamp(DQ(Q(y)))) == Q(clamp(y))
exactly for any clamp (Relu is clamp to [0, ∞)): rounding and saturation are monotone, so they
commute with clamping, and DQ(Q(·)) / s gives back the integer code exactly. Dropping the first
pair lets the activation fuse into the convolution (`fuse_conv_activation`) and the layer fold
into an INT8 layer (`fold_qdq`), as TensorRT does with Q/DQ models.

Fires only when the first pair feeds nothing but the activation and the activation feeds nothing
but the second Q.
"""
from __future__ import annotations

from ..ir import Graph
from .base import single_consumer
from .qdq_params import fake_quant_params, qparams, quantized_by

CLAMPS = ("Relu", "Clip")


def drop_redundant_qdq(graph: Graph) -> int:
    dropped = 0
    producers, consumers = graph.producers(), graph.consumers()
    for act in list(graph.nodes):
        if act.op_type not in CLAMPS or act not in graph.nodes:
            continue
        pair = quantized_by(graph, act.inputs[0], producers)
        if pair is None:
            continue
        q1, dq1 = pair
        first = fake_quant_params(graph, q1, dq1)
        if first is None or not first.symmetric():
            continue
        if single_consumer(graph, dq1.outputs[0], consumers) is not act or \
                single_consumer(graph, q1.outputs[0], consumers) is not dq1:
            continue
        q2 = single_consumer(graph, act.outputs[0], consumers)
        if q2 is None or q2.op_type != "QuantizeLinear" or q2.inputs[0] != act.outputs[0]:
            continue
        second = qparams(graph, q2)
        if second is None or not second.per_tensor or not second.same_as(first) or \
                q2.attrs.get("precision") not in (None, 0, 1):
            continue
        act.inputs = [q1.inputs[0]] + act.inputs[1:]
        act.origin = act.origin + q1.origin + dq1.origin
        graph.nodes.remove(q1)
        graph.nodes.remove(dq1)
        dropped += 1
        producers, consumers = graph.producers(), graph.consumers()
    if dropped:
        graph.remove_unused_initializers()
    return dropped
