"""Rewrite the layers planned INT8 into QConv/QGemm layers with INT8 weights (see
`sartor/ops/quantized.py` for what they compute).

- Weights: symmetric per-output-channel INT8, scale_c = max|w_c| / 127 (float32), q =
  clamp(round_half_even(w / scale_c), -127, 127). A channel of zeros gets scale 1.
- Activations: symmetric per-tensor INT8, scale = amax / 127 (float32), from calibration.
- Bias: INT32, round_half_even(b / (scale_x · scale_w[c])), saturated to the INT32 range.
- A tensor is *stored* INT8 (its producer re-quantizes its output) when an INT8 layer produces
  it, it is no graph output, and every reader is an INT8 layer reading it as its data input or
  as its residual. Otherwise INT8 layers write FP32 and their readers quantize on entry.
"""
from __future__ import annotations

import numpy as np

from ..errors import ConfigError
from ..ir import Graph, Node, ValueInfo
from ..ops.quantized import QMAX
from .plan import CONV_OPS, int8_positions, int8_unsupported

INT32_MAX = 2 ** 31 - 1
Q_LAYERS = ("QConv", "QGemm")
CONV_ATTR_KEYS = ("auto_pad", "dilations", "group", "kernel_shape", "pads", "strides")
EPILOGUE_KEYS = ("activation", "activation_alpha", "activation_beta", "residual_after_activation")


def activation_scale(amax: float) -> tuple[float, float]:
    """(scale, 1/scale) as float32 values (Python floats that are exact float32 numbers)."""
    if not (amax > 0.0 and np.isfinite(amax)):
        amax = 1.0  # never non-zero in calibration: any scale quantizes zeros to zero
    scale = np.float32(np.float64(amax) / QMAX)
    if scale == 0:  # amax below 127 · the smallest float32
        scale = np.float32(np.finfo(np.float32).tiny)
    return float(scale), float(np.float32(1.0 / np.float64(scale)))


def quantize_weight(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per-output-channel (axis 0) symmetric INT8: (int8 weights, float32 scales)."""
    w64 = np.asarray(w, dtype=np.float64)
    flat = w64.reshape(w64.shape[0], -1)
    maxabs = np.abs(flat).max(axis=1) if flat.shape[1] else np.zeros(w64.shape[0])
    scale = (maxabs / QMAX).astype(np.float32)
    scale[scale == 0] = 1.0
    q = np.clip(np.rint(flat / scale.astype(np.float64)[:, None]), -QMAX, QMAX).astype(np.int8)
    return q.reshape(w64.shape), scale


def quantize_bias(b: np.ndarray | None, dequant_scale: np.ndarray) -> np.ndarray | None:
    if b is None:
        return None
    q = np.rint(np.asarray(b, dtype=np.float64) / dequant_scale.astype(np.float64))
    return np.clip(q, -INT32_MAX, INT32_MAX).astype(np.int32)


def _stored_int8(graph: Graph, int8_nodes: dict[str, Node], amax: dict) -> set[str]:
    outputs = graph.output_names()
    consumers = graph.consumers()
    stored = set()
    for node in int8_nodes.values():
        value = node.outputs[0]
        readers = consumers.get(value, [])
        if not value or value in outputs or not readers or value not in amax:
            continue
        if all(r.name in int8_nodes and all(r.inputs[p] != value for p in range(len(r.inputs))
                                            if p not in int8_positions(r)) for r in readers):
            stored.add(value)
    return stored


def _gemm_weight(graph: Graph, node: Node) -> tuple[np.ndarray, np.ndarray | None]:
    """(weight as [M, K] with alpha folded in, bias [M] with beta folded in, or None)."""
    w = np.asarray(graph.constant(node.inputs[1]), dtype=np.float64)
    if node.op_type == "MatMul":
        return w.T, None
    if not node.attrs.get("transB", 0):
        w = w.T
    w = w * float(node.attrs.get("alpha", 1.0))
    bias = node.inputs[2] if len(node.inputs) > 2 else ""
    if not bias:
        return w, None
    c = np.asarray(graph.constant(bias), dtype=np.float64).reshape(-1) * float(node.attrs.get("beta", 1.0))
    return w, np.broadcast_to(c, (w.shape[0],)).copy()


def quantize_graph(graph: Graph, layer_precision: dict[str, str], amax: dict[str, float]) -> dict:
    """Rewrite every layer planned "int8" in place; returns {"layers": n, "int8_tensors": [...]}
    counting every INT8 layer of the result (layers folded from a Q/DQ model are INT8 already)."""
    int8_nodes = {n.name: n for n in graph.nodes if layer_precision.get(n.name) == "int8"
                  and n.op_type not in Q_LAYERS}
    for node in int8_nodes.values():
        why = int8_unsupported(graph, node)
        if why is not None:
            raise ConfigError(f"layer {node.name} ({node.op_type}) cannot run INT8: {why}")
        for position in int8_positions(node):
            if node.inputs[position] not in amax:
                raise ConfigError(f"the calibration has no threshold for tensor {node.inputs[position]!r} read by "
                                  f"layer {node.name}: recalibrate (delete the calibration cache)")
    stored = _stored_int8(graph, int8_nodes, amax)
    for node in int8_nodes.values():
        _rewrite(graph, node, amax, stored)
    for value in stored:
        info = graph.value_info.get(value)
        graph.value_info[value] = ValueInfo(value, "int8", info.shape if info else None)
    graph.remove_unused_initializers()
    layers = [n for n in graph.nodes if n.op_type in Q_LAYERS]
    stored |= {n.outputs[0] for n in layers if n.attrs.get("output_scale") is not None}
    return {"layers": len(layers), "int8_tensors": sorted(stored)}


def _rewrite(graph: Graph, node: Node, amax: dict, stored: set) -> None:
    x = node.inputs[0]
    input_scale, input_inv = activation_scale(amax[x])
    conv = node.op_type in CONV_OPS
    if conv:
        w = np.asarray(graph.constant(node.inputs[1]), dtype=np.float64)
        bias_name = node.inputs[2] if len(node.inputs) > 2 else ""
        bias = np.asarray(graph.constant(bias_name), dtype=np.float64).reshape(-1) if bias_name else None
        residual = node.inputs[3] if len(node.inputs) > 3 else ""
    else:
        w, bias = _gemm_weight(graph, node)
        residual = ""
    wq, weight_scale = quantize_weight(w)
    dequant = (np.float32(input_scale) * weight_scale).astype(np.float32)
    bq = quantize_bias(bias, dequant)

    names = {}
    for suffix, array in (("w_int8", wq), ("b_int32", bq), ("dequant_scale", dequant)):
        if array is not None:
            names[suffix] = graph.fresh_name(f"{node.name}.{suffix}")
            graph.initializers[names[suffix]] = array
    attrs = {k: node.attrs[k] for k in CONV_ATTR_KEYS if conv and k in node.attrs}
    attrs.update({k: node.attrs[k] for k in EPILOGUE_KEYS if k in node.attrs})
    if conv:  # recorded because some tactics store the weight flattened (see ops/quantized.py)
        attrs["kernel_shape"] = [int(k) for k in wq.shape[2:]]
    attrs.update(input_scale=input_scale, input_inv_scale=input_inv, weight_scale=weight_scale,
                 residual_scale=None, output_scale=None, output_inv_scale=None)
    if residual and residual in stored:
        attrs["residual_scale"] = activation_scale(amax[residual])[0]
    out = node.outputs[0]
    if out in stored:
        attrs["output_scale"], attrs["output_inv_scale"] = activation_scale(amax[out])
    node.op_type = "QConv" if conv else "QGemm"
    node.inputs = [x, names["w_int8"], names.get("b_int32", ""), residual, names["dequant_scale"]]
    node.attrs = attrs
