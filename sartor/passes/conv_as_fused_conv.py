"""A 2-D Conv with constant weights that nothing fused into becomes a FusedConv without an epilogue.

Only FusedConv has tactics (implicit-GEMM and Triton-epilogue kernels beside cuDNN) and can store its
output into a channel slice of a Concat's buffer. Convs with no activation after them (the last
1×1 convs of detection heads, projection convs) would otherwise run cuDNN alone and be copied by
the Concat that reads them. Runs after fusion and Q/DQ folding, so the passes that look for a plain
Conv (BatchNorm folding, Q/DQ folding, the YOLO head rule) have seen the graph first.
"""
from __future__ import annotations

from ..ir import Graph


def conv_as_fused_conv(graph: Graph) -> int:
    consumers = graph.consumers()
    promoted = 0
    for node in graph.nodes:
        if node.op_type != "Conv":
            continue
        weight = graph.constant(node.inputs[1]) if len(node.inputs) > 1 and node.inputs[1] else None
        if weight is None or weight.ndim != 4:
            continue
        if len(node.inputs) > 2 and node.inputs[2] and not graph.is_constant(node.inputs[2]):
            continue
        if any(user.op_type == "BatchNormalization" for user in consumers.get(node.outputs[0], [])):
            continue  # left for fold_batchnorm, which folds into a plain Conv
        node.op_type = "FusedConv"
        promoted += 1
    return promoted
