"""Fuse a MatMul by a constant weight and the Add of its constant bias into one Linear layer: one
GEMM with the bias in its epilogue (torch.addmm: cuBLAS on CUDA, MKL/oneDNN on the CPU) instead
of a product written out and read back by an elementwise layer. Transformers write this pair for
every linear layer (four a ViT block).

    MatMul(x, W [K, C]) → Add(·, b)   with b of C values along the last axis  ⇒  Linear(x, W, b)

Float builds only (the builder runs it when no layer is planned INT8 or FP8): the INT8 planner
quantizes a bias-free MatMul and keeps the Add apart. It does not fire when the product has
another reader or is a graph output, when W or b is not a constant, or when b broadcasts over
anything but the last axis (a per-row or per-token bias).
"""
from __future__ import annotations

import numpy as np

from ..ir import Graph, Node
from .base import single_consumer


def _bias_of(graph: Graph, add: Node, product: str, columns: int) -> str | None:
    """The Add's other input when it is a constant of `columns` values along the last axis."""
    others = [name for name in add.inputs if name != product]
    if len(others) != 1 or add.inputs.count(product) != 1:
        return None
    bias = graph.constant(others[0])
    if bias is None or not np.issubdtype(bias.dtype, np.floating) or bias.size != columns:
        return None
    if bias.ndim == 0 or bias.shape[-1] != columns:
        return None
    return others[0]


def fuse_linear_bias(graph: Graph) -> int:
    fused = 0
    consumers = graph.consumers()
    graph_outputs = {v.name for v in graph.outputs}
    for matmul in list(graph.nodes):
        if matmul.op_type != "MatMul" or matmul.outputs[0] in graph_outputs:
            continue
        weight = graph.constant(matmul.inputs[1])
        if weight is None or weight.ndim != 2 or not np.issubdtype(weight.dtype, np.floating):
            continue
        add = single_consumer(graph, matmul.outputs[0], consumers)
        if add is None or add.op_type != "Add":
            continue
        bias = _bias_of(graph, add, matmul.outputs[0], weight.shape[1])
        if bias is None:
            continue
        bias_name = graph.fresh_name(add.name + "_bias")
        graph.initializers[bias_name] = graph.constant(bias).reshape(-1)
        linear = Node("Linear", matmul.name, [matmul.inputs[0], matmul.inputs[1], bias_name], list(add.outputs),
                      origin=matmul.origin + add.origin)
        graph.nodes[graph.nodes.index(matmul)] = linear
        graph.nodes.remove(add)
        consumers = graph.consumers()
        fused += 1
    if fused:
        graph.remove_unused_initializers()
    return fused
