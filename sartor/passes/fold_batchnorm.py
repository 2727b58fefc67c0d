"""Fold an inference BatchNormalization into the Conv or Gemm that feeds it."""
from __future__ import annotations

import numpy as np

from ..ir import Graph, Node
from .base import single_consumer


def bn_affine(graph: Graph, bn: Node) -> tuple[np.ndarray, np.ndarray] | None:
    arrays = [graph.constant(name) for name in bn.inputs[1:5]]
    if any(a is None for a in arrays) or bn.attrs.get("training_mode", 0):
        return None
    scale, bias, mean, var = (a.astype(np.float64) for a in arrays)
    mult = scale / np.sqrt(var + bn.attrs.get("epsilon", 1e-5))
    return mult, bias - mean * mult


def _fold_into_conv(graph: Graph, conv: Node, mult: np.ndarray, shift: np.ndarray) -> bool:
    weight = graph.constant(conv.inputs[1])
    if weight is None or weight.shape[0] != mult.shape[0]:
        return False
    bias = graph.constant(conv.inputs[2]) if len(conv.inputs) > 2 and conv.inputs[2] else np.zeros(weight.shape[0])
    if bias is None:
        return False
    new_w = (weight.astype(np.float64) * mult.reshape((-1,) + (1,) * (weight.ndim - 1))).astype(weight.dtype)
    new_b = (bias.astype(np.float64) * mult + shift).astype(weight.dtype)
    w_name = graph.fresh_name(conv.inputs[1] + "_bnfold")
    graph.initializers[w_name] = new_w
    b_name = graph.fresh_name(conv.name + "_bias_bnfold")
    graph.initializers[b_name] = new_b
    conv.inputs = [conv.inputs[0], w_name, b_name] + conv.inputs[3:]
    return True


def _fold_into_gemm(graph: Graph, gemm: Node, mult: np.ndarray, shift: np.ndarray) -> bool:
    weight = graph.constant(gemm.inputs[1])
    if weight is None or gemm.attrs.get("transA", 0) or weight.ndim != 2:
        return False
    trans_b = gemm.attrs.get("transB", 0)
    n = weight.shape[0] if trans_b else weight.shape[1]
    if n != mult.shape[0]:
        return False
    alpha, beta = gemm.attrs.get("alpha", 1.0), gemm.attrs.get("beta", 1.0)
    bias = graph.constant(gemm.inputs[2]) if len(gemm.inputs) > 2 and gemm.inputs[2] else np.zeros(n)
    if bias is None:
        return False
    # C broadcasts to [M, N]: only a per-column bias ([N], [1, N], [1], [1, 1], scalar) folds;
    # an [M, 1] or [M, N] bias differs per row.
    if bias.ndim > 2 or (bias.ndim >= 1 and bias.shape[-1] not in (1, n)) or (bias.ndim == 2 and bias.shape[0] != 1):
        return False
    bias = np.broadcast_to((bias.astype(np.float64) * beta).reshape(-1), (n,))
    w = weight.astype(np.float64) * alpha
    new_w = (w * mult[:, None] if trans_b else w * mult[None, :]).astype(weight.dtype)
    new_b = (bias * mult + shift).astype(weight.dtype)
    w_name = graph.fresh_name(gemm.inputs[1] + "_bnfold")
    b_name = graph.fresh_name(gemm.name + "_bias_bnfold")
    graph.initializers[w_name], graph.initializers[b_name] = new_w, new_b
    gemm.inputs = [gemm.inputs[0], w_name, b_name]
    gemm.attrs = dict(gemm.attrs, alpha=1.0, beta=1.0)
    return True


def fold_batchnorm(graph: Graph) -> int:
    folded = 0
    producers = graph.producers()
    consumers = graph.consumers()
    for bn in list(graph.nodes):
        if bn.op_type != "BatchNormalization" or len([o for o in bn.outputs if o]) != 1:
            continue
        producer = producers.get(bn.inputs[0])
        if producer is None or producer.op_type not in ("Conv", "Gemm"):
            continue
        if single_consumer(graph, bn.inputs[0], consumers) is not bn:
            continue
        affine = bn_affine(graph, bn)
        if affine is None:
            continue
        fold = _fold_into_conv if producer.op_type == "Conv" else _fold_into_gemm
        if not fold(graph, producer, *affine):
            continue
        producer.outputs = [bn.outputs[0]]
        producer.origin = producer.origin + bn.origin
        graph.nodes.remove(bn)
        folded += 1
        producers = graph.producers()
        consumers = graph.consumers()
    if folded:
        graph.remove_unused_initializers()
    return folded
