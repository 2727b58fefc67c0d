"""Evaluate nodes whose inputs are all known at build time, Shape of statically shaped values, and
Slice or Gather of a Shape whose picked dims are static while others are not (the head dim that
torch's exported attention reads for its scale, beside a dynamic batch).

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


def _shape_dims(graph: Graph, shape_node: Node) -> tuple | None:
    """The dims a Shape node outputs (ints where static, names where not), from shape inference."""
    shape = graph.shape_of(shape_node.inputs[0])
    if shape is None:
        return None
    rank = len(shape)
    start = shape_node.attrs.get("start", 0)
    end = shape_node.attrs.get("end")
    start = max(0, min(rank, start + rank if start < 0 else start))
    end = rank if end is None else max(0, min(rank, end + rank if end < 0 else end))
    return tuple(shape[start:end])


def _static_shape_value(graph: Graph, node: Node) -> np.ndarray | None:
    """Shape (or Size) of a value whose shape inference gave every dim."""
    if node.op_type not in ("Shape", "Size"):
        return None
    shape = graph.shape_of(node.inputs[0])
    if shape is None or not all(isinstance(d, int) for d in shape):
        return None
    if node.op_type == "Size":
        return np.asarray(int(np.prod(shape)), dtype=np.int64)
    return np.asarray(_shape_dims(graph, node), dtype=np.int64)


def _static_dims_picked(graph: Graph, node: Node, producers: dict) -> np.ndarray | None:
    """Slice or Gather (constant indices) of a Shape output when every dim it picks is static: the
    op evaluated on the dims' positions says which dims it picks."""
    if node.op_type not in ("Slice", "Gather") or not node.inputs:
        return None
    shape_node = producers.get(node.inputs[0])
    if shape_node is None or shape_node.op_type != "Shape":
        return None
    if not all(graph.is_constant(name) for name in node.present_inputs()[1:]):
        return None
    dims = _shape_dims(graph, shape_node)
    if dims is None:
        return None
    picked = _evaluate(node, graph, first=np.arange(len(dims), dtype=np.int64))
    if picked is None:
        return None
    values = [dims[p] for p in picked[0].reshape(-1)]
    if not all(isinstance(d, int) for d in values):
        return None
    return np.asarray(values, dtype=np.int64).reshape(picked[0].shape)


def _evaluate(node: Node, graph: Graph, first: np.ndarray | None = None) -> list[np.ndarray] | None:
    """The node's outputs from its constant inputs (`first`, when given, in place of input 0)."""
    opdef = default_registry().get(node.op_type)
    if opdef is None:
        return None
    args = [tensor_from_numpy(first) if position == 0 and first is not None
            else tensor_from_numpy(graph.initializers[name]) if name else None
            for position, name in enumerate(node.inputs)]
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
        if static is None:
            static = _static_dims_picked(graph, node, producers)
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
