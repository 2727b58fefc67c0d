"""Fold an inference BatchNormalization into the MatMul (constant weight) that feeds it, directly or
through the Flatten that makes its [..., C] output the [M, C] the BatchNormalization reads.

LeViT-style models (a Linear then BatchNorm1d over `x.flatten(0, 1)`) write this pattern after
every linear layer; unfolded, each BatchNormalization is a layer of its own. The MatMul keeps its
op (so INT8 builds quantize it as before) with its columns scaled, and the BatchNormalization's
shift becomes an Add of one constant vector before the Flatten:

    MatMul(x, W) → [Flatten(axis = rank - 1)] → BatchNormalization(scale, bias, mean, var)
      ⇒  MatMul(x, W · m) → Add(shift) → [Flatten]        m = scale / √(var + ε), shift = bias − mean · m

It does not fire when the BatchNormalization's channels are not the MatMul's columns (its input is
not 2-D, or a Flatten mixes the last dim in), when a value on the way has other readers or is a
graph output, or when the weight or the statistics are not constants.
"""
from __future__ import annotations

import numpy as np

from ..ir import Graph, Node
from .base import single_consumer
from .fold_batchnorm import bn_affine


def _channels_match(graph: Graph, matmul: Node, flatten: Node | None, bn: Node, columns: int) -> bool:
    bn_input = graph.shape_of(bn.inputs[0])
    if bn_input is None or len(bn_input) != 2 or bn_input[1] not in (columns, None):
        return False
    if flatten is None:
        return True
    flat_input = graph.shape_of(flatten.inputs[0])
    axis = flatten.attrs.get("axis", 1)
    return flat_input is not None and len(flat_input) >= 2 and axis in (len(flat_input) - 1, -1)


def _only_reader(graph: Graph, value: str, consumers: dict, reader: Node, shapes_allowed: bool) -> bool:
    """Whether `reader` is the value's one reader; with `shapes_allowed`, Shape nodes may read it
    too (LeViT reshapes back with `reshape_as`): the Add that takes over the value keeps its shape."""
    if shapes_allowed:
        others = [n for n in consumers.get(value, []) if n is not reader]
        return (reader in consumers.get(value, []) and all(n.op_type == "Shape" for n in others)
                and value not in {v.name for v in graph.outputs})
    return single_consumer(graph, value, consumers) is reader


def fold_matmul_batchnorm(graph: Graph) -> int:
    folded = 0
    for bn in list(graph.nodes):
        if bn.op_type != "BatchNormalization" or len([o for o in bn.outputs if o]) != 1:
            continue
        producers, consumers = graph.producers(), graph.consumers()
        flatten = producers.get(bn.inputs[0])
        matmul = flatten
        if flatten is not None and flatten.op_type == "Flatten":
            if single_consumer(graph, flatten.outputs[0], consumers) is not bn:
                continue
            matmul = producers.get(flatten.inputs[0])
        else:
            flatten = None
        if matmul is None or matmul.op_type != "MatMul":
            continue
        if not _only_reader(graph, matmul.outputs[0], consumers, flatten or bn, shapes_allowed=flatten is not None):
            continue
        weight = graph.constant(matmul.inputs[1])
        affine = bn_affine(graph, bn)
        if weight is None or weight.ndim != 2 or affine is None or not np.issubdtype(weight.dtype, np.floating):
            continue
        mult, shift = affine
        if mult.shape != (weight.shape[1],) or not _channels_match(graph, matmul, flatten, bn, weight.shape[1]):
            continue
        w_name = graph.fresh_name(matmul.inputs[1] + "_bnfold")
        graph.initializers[w_name] = (weight.astype(np.float64) * mult[None, :]).astype(weight.dtype)
        shift_name = graph.fresh_name(bn.name + "_shift")
        graph.initializers[shift_name] = shift.astype(weight.dtype)
        product = graph.fresh_name(matmul.outputs[0] + "_scaled")
        # With a Flatten: MatMul → Add (writes the MatMul's old output) → Flatten (writes the BN's).
        # Without: MatMul → Add (writes the BN's output).
        shifted = matmul.outputs[0] if flatten is not None else bn.outputs[0]
        add = Node("Add", graph.fresh_name(bn.name + "_shift_add"), [product, shift_name], [shifted],
                   origin=list(bn.origin))
        if flatten is not None:
            flatten.outputs = [bn.outputs[0]]
        matmul.inputs = [matmul.inputs[0], w_name]
        matmul.outputs = [product]
        matmul.origin = matmul.origin + bn.origin
        graph.nodes.insert(graph.nodes.index(matmul) + 1, add)
        graph.nodes.remove(bn)
        folded += 1
    if folded:
        graph.remove_unused_initializers()
    return folded
