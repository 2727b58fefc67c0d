"""Evaluate nodes whose inputs are all known at build time, and Shape of statically shaped values.

A DequantizeLinear of constant weights is kept when its layer's data input is dequantized too:
`fold_qdq` reads the integers and scales from it."""
from __future__ import annotations

import numpy as np

from ..ir import Graph, Node
from ..ops import default_registry
from ..ir.dtypes import TORCH_TO_NUMPY
from ..ops.util import tensor_from_numpy, tensor_to_numpy

MAX_FOLDED_ELEMENTS = 1 << 24  # larger results stay computed at run time rather than bloat the engine
NEVER_FOLD = {"NonMaxSuppression"}
QDQ_LAYERS = ("Conv", "FusedConv", "Gemm", "FusedGemm", "MatMul")  # what `fold_qdq` folds


def _static_shape_value(graph: Graph, node: Node) -> np.ndarray | None:
    """Shape (or Size) of a value whose shape inference gave every dim."""
    if node.op_type not in ("Shape", "Size"):
        return None
    shape = graph.shape_of(node.inputs[0])
    if shape is None or not all(isinstance(d, int) for d in shape):
        return None
    if node.op_type == "Size":
        return np.asarray(int(np.prod(shape)), dtype=np.int64)
    rank = len(shape)
    start = node.attrs.get("start", 0)
    end = node.attrs.get("end")
    start = max(0, min(rank, start + rank if start < 0 else start))
    end = rank if end is None else max(0, min(rank, end + rank if end < 0 else end))
    return np.asarray(shape[start:end], dtype=np.int64)


def _evaluate(node: Node, graph: Graph) -> list[np.ndarray] | None:
    opdef = default_registry().get(node.op_type)
    if opdef is None:
        return None
    args = [tensor_from_numpy(graph.initializers[name]) if name else None for name in node.inputs]
    try:
        result = opdef.impl(args, opdef.fill_attrs(node.attrs))
    except Exception:  # a node that cannot be evaluated here is left for run time
        return None
    results = list(result) if isinstance(result, (tuple, list)) else [result]
    arrays = []
    for tensor in results[:len(node.outputs)]:
        if tensor.numel() > MAX_FOLDED_ELEMENTS or tensor.dtype not in TORCH_TO_NUMPY:
            return None
        arrays.append(tensor_to_numpy(tensor))
    return arrays


def _quantized_weights(node: Node, producers: dict, consumers: dict) -> bool:
    """A DequantizeLinear read as the weights or bias of a conv/gemm/matmul whose data input is
    also dequantized: kept, for `fold_qdq` takes the integers and scales from it."""
    if node.op_type != "DequantizeLinear":
        return False
    for user in consumers.get(node.outputs[0], []):
        data = producers.get(user.inputs[0]) if user.inputs else None
        if user.op_type in QDQ_LAYERS and node.outputs[0] in user.inputs[1:] and data is not None \
                and data.op_type == "DequantizeLinear":
            return True
    return False


def fold_constants(graph: Graph) -> int:
    folded = 0
    outputs = graph.output_names()
    producers, consumers = graph.producers(), graph.consumers()
    for node in list(graph.nodes):
        if node.op_type in NEVER_FOLD or _quantized_weights(node, producers, consumers):
            continue
        static = _static_shape_value(graph, node)
        if static is not None:
            values = [static]
        elif node.present_inputs() and all(graph.is_constant(i) for i in node.present_inputs()):
            values = _evaluate(node, graph)
            if values is None:
                continue
        else:
            continue
        if any(out in outputs for out in node.outputs):
            continue  # a graph output keeps a producing node
        for out, value in zip(node.outputs, values):
            if out:
                graph.initializers[out] = value
        graph.nodes.remove(node)
        folded += 1
    if folded:
        graph.remove_unused_initializers()
    return folded
