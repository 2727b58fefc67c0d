"""Remove ops that compute nothing: Identity, inference Dropout, same-dtype Cast, identity
Transpose, x*1, x+0, x-0, x/1."""
from __future__ import annotations

import numpy as np

from ..ir import Graph, Node
from ..ir.dtypes import ONNX_TO_TORCH, TORCH_TO_NUMPY
from .base import bypass


def _neutral_operand(graph: Graph, node: Node) -> str | None:
    """For x op c with c a neutral constant that does not broadcast x larger, return x."""
    neutral = {"Mul": 1.0, "Div": 1.0, "Add": 0.0, "Sub": 0.0}.get(node.op_type)
    if neutral is None or len(node.inputs) != 2:
        return None
    candidates = [(0, 1)] if node.op_type in ("Sub", "Div") else [(0, 1), (1, 0)]
    for keep, const in candidates:
        array = graph.constant(node.inputs[const])
        x_shape = graph.shape_of(node.inputs[keep])
        x_dtype = graph.dtype_of(node.inputs[keep])
        if array is None or x_shape is None or x_dtype is None or not np.all(array == neutral):
            continue
        if str(array.dtype) == x_dtype and _broadcasts_into(array.shape, x_shape):
            return node.inputs[keep]
    return None


def _broadcasts_into(const_shape: tuple, x_shape: tuple) -> bool:
    if len(const_shape) > len(x_shape):
        return False
    aligned = x_shape[len(x_shape) - len(const_shape):]
    return all(c == 1 or c == x for c, x in zip(const_shape, aligned))


def _noop_source(graph: Graph, node: Node) -> str | None:
    if node.op_type == "Identity":
        return node.inputs[0]
    if node.op_type == "Dropout" and len([o for o in node.outputs if o]) == 1:
        return node.inputs[0]
    if node.op_type == "Cast":
        target = ONNX_TO_TORCH.get(node.attrs.get("to"))
        if target is not None and graph.dtype_of(node.inputs[0]) == TORCH_TO_NUMPY.get(target):
            return node.inputs[0]
    if node.op_type == "Transpose" and node.attrs.get("perm") is not None:
        if list(node.attrs["perm"]) == list(range(len(node.attrs["perm"]))):
            return node.inputs[0]
    return _neutral_operand(graph, node)


def remove_identities(graph: Graph) -> int:
    removed = 0
    for node in list(graph.nodes):
        source = _noop_source(graph, node)
        if source is not None and bypass(graph, node, source):
            removed += 1
    return removed
