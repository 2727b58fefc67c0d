"""Rewrite the layers planned INT8 into QConv/QGemm layers with INT8 weights (see
`sartor/ops/quantized.py` for what they compute).

- Weights: symmetric per-output-channel INT8, scale_c = max|w_c| / 127 (float32), q =
  clamp(round_half_even(w / scale_c), -127, 127). A channel of zeros gets scale 1.
- Activations: symmetric per-tensor INT8, scale = amax / 127 (float32), from calibration.
- Bias: INT32, round_half_even(b / (scale_x · scale_w[c])), saturated to the INT32 range.
- A tensor is *stored* INT8 (its producer re-quantizes its output) when an INT8 layer produces
  it, it is no graph output, and every reader is an INT8 layer reading it as its data input or
  as its residual (a Shape or Size reader reads no values, and does not count). Otherwise INT8
  layers write FP32 and their readers quantize on entry.

Layers planned "fp8" become the same QConv/QGemm with `qformat="fp8e4m3"` (`sartor/ops/fp8.py`):
- Weights: per output channel, scale_c = max|w_c| / 448 (float32), q = e4m3(clamp(w / scale_c,
  ±448)), w / scale_c rounded to float32 first, then to e4m3 (nearest, ties to even). A channel of
  zeros gets scale 1. Stored as float8_e4m3fn (the engine file keeps the bytes).
- Activations: per tensor, scale = amax / 448 (float32), from the same calibration.
- Bias: float32, added after dequantization (no integer bias).
- Stored FP8 under the rule above, with FP8 in place of INT8: a tensor passes between two layers
  quantized only when both sides use the same format.

Pass-through layers: a MaxPool, Concat, Split or nearest Resize (Upsample) between INT8 layers
runs on the INT8 codes when its every data input is produced by an INT8 layer (or another
pass-through layer) and its every output is read only by INT8 layers (as data or residual) or
pass-through layers, none being a graph output. Those layers only select, copy and move values,
and quantization is monotonic (q(max(a, b)) = max(q(a), q(b))) and elementwise, so on codes that
share one scale they compute exactly the codes of their float results (a linear or cubic Resize
mixes values and stays float). The tensors such layers connect form one *scale group*
with one scale: the largest calibrated amax among them (TensorRT requantizes a Concat's inputs to a
common scale the same way). The producers requantize to it in their epilogue and the readers read
with it. For a chain conv → MaxPool → conv that is the pool output's own amax, so the engine's
numbers are those it computes without pass-through. FP8 passes through the same way (a common
scale, e4m3 rounding is monotonic too); a layer never mixes the formats.
"""
from __future__ import annotations

import numpy as np

from ..errors import ConfigError
from ..ir import Graph, Node, ValueInfo
from ..ir.dtypes import INT8_QMAX, INT32_MAX, QUANTIZED_LAYERS, QUANTIZED_PRECISIONS
from ..ops import fp8
from .plan import CONV_OPS, SHAPE_ONLY_OPS, int8_positions, quantized_unsupported
# Layers that only select or move values: they can run on INT8 (FP8) codes (module docstring).
# Resize and Upsample only in nearest mode (`_copies_values`); linear and cubic ones mix values.
PASS_THROUGH_OPS = ("MaxPool", "Concat", "Split", "Resize", "Upsample")
CONV_ATTR_KEYS = ("auto_pad", "dilations", "group", "kernel_shape", "pads", "strides")
EPILOGUE_KEYS = ("activation", "activation_alpha", "activation_beta", "residual_after_activation")


def activation_scale(amax: float, qmax: float = INT8_QMAX) -> tuple[float, float]:
    """(scale, 1/scale) as float32 values (Python floats that are exact float32 numbers): scale =
    amax / qmax, qmax 127 for INT8, 448 for FP8."""
    if not (amax > 0.0 and np.isfinite(amax)):
        amax = 1.0  # never non-zero in calibration: any scale quantizes zeros to zero
    scale = np.float32(np.float64(amax) / qmax)
    if scale == 0:  # amax below qmax · the smallest float32
        scale = np.float32(np.finfo(np.float32).tiny)
    return float(scale), float(np.float32(1.0 / np.float64(scale)))


def _per_channel(w: np.ndarray, qmax: float) -> tuple[np.ndarray, np.ndarray]:
    """(the weights as [output channels, rest] in float64, float32 scales max|w_c| / qmax); a channel
    of zeros gets scale 1."""
    w64 = np.asarray(w, dtype=np.float64)
    flat = w64.reshape(w64.shape[0], -1)
    maxabs = np.abs(flat).max(axis=1) if flat.shape[1] else np.zeros(w64.shape[0])
    scale = (maxabs / qmax).astype(np.float32)
    scale[scale == 0] = 1.0
    return flat, scale


def quantize_weight(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per-output-channel (axis 0) symmetric INT8: (int8 weights, float32 scales)."""
    flat, scale = _per_channel(w, INT8_QMAX)
    q = np.clip(np.rint(flat / scale.astype(np.float64)[:, None]), -INT8_QMAX, INT8_QMAX).astype(np.int8)
    return q.reshape(np.shape(w)), scale


def quantize_weight_fp8(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per-output-channel (axis 0) E4M3: (ml_dtypes float8_e4m3fn weights, float32 scales)."""
    flat, scale = _per_channel(w, fp8.FP8_MAX)
    q = fp8.quantize_fp8_numpy(flat / scale.astype(np.float64)[:, None])
    return q.reshape(np.shape(w)), scale


def quantize_bias(b: np.ndarray | None, dequant_scale: np.ndarray) -> np.ndarray | None:
    if b is None:
        return None
    q = np.rint(np.asarray(b, dtype=np.float64) / dequant_scale.astype(np.float64))
    return np.clip(q, -INT32_MAX, INT32_MAX).astype(np.int32)


def _data_inputs(node: Node) -> list[str]:
    """The inputs a pass-through layer moves values of (a Split's sizes are not data)."""
    return [v for v in node.inputs if v] if node.op_type == "Concat" else node.inputs[:1]


def _reads_quantized(reader: Node, value: str, fmt: str, quantized: dict, formats: dict, passing: dict) -> bool:
    """`reader` reads `value` only where it takes codes of format `fmt`: an INT8 (FP8) layer's data
    input or residual, a pass-through layer's data input."""
    if reader.name in quantized:
        positions = int8_positions(reader)
        return formats[reader.name] == fmt and all(reader.inputs[p] != value for p in range(len(reader.inputs))
                                                   if p not in positions)
    if reader.name in passing:
        return passing[reader.name] == fmt and value in _data_inputs(reader)
    return False


def _carried(value: str, fmt: str, graph_outputs: set, consumers: dict, quantized: dict, formats: dict,
             passing: dict) -> bool:
    """`value` can be stored as codes of format `fmt`: no graph output, read, and only by layers
    that take it so. Shape and Size readers take only its shape, which codes keep (an attention
    block sizes its reshapes from its input's Shape)."""
    readers = [r for r in consumers.get(value, []) if r.op_type not in SHAPE_ONLY_OPS]
    return bool(value) and value not in graph_outputs and bool(readers) and all(
        _reads_quantized(r, value, fmt, quantized, formats, passing) for r in readers)


def _copies_values(node: Node) -> bool:
    """A Resize or Upsample whose every output value is a copy of an input value: nearest mode,
    and no tf_crop_and_resize (it writes `extrapolation_value` outside the crop). The attribute
    defaults are ONNX's: both ops default to nearest."""
    if node.attrs.get("mode", "nearest") != "nearest":
        return False
    return node.op_type == "Upsample" or node.attrs.get("coordinate_transformation_mode") != "tf_crop_and_resize"


def _passes_through(node: Node) -> bool:
    if node.op_type == "MaxPool":
        return not node.attrs.get("_with_indices") and len([o for o in node.outputs if o]) == 1
    if node.op_type in ("Resize", "Upsample"):
        return _copies_values(node)
    return node.op_type in PASS_THROUGH_OPS


def _pass_through_layers(graph: Graph, quantized: dict[str, Node], formats: dict[str, str]) -> dict[str, str]:
    """layer name → format ("int8" or "fp8") of the pass-through layers (see the module's
    docstring). The largest set that satisfies the rule: every candidate whose inputs come quantized
    is assumed in, then those with an input or output that cannot be carried are dropped until none is."""
    producers = graph.producers()
    consumers = graph.consumers()
    graph_outputs = graph.output_names()
    passing: dict[str, str] = {}

    def source_format(value: str) -> str | None:
        producer = producers.get(value)
        if producer is None:
            return None
        return formats.get(producer.name) if producer.name in quantized else passing.get(producer.name)

    for node in graph.nodes:  # topological: a candidate's producers are decided before it
        if _passes_through(node):
            sources = {source_format(v) for v in _data_inputs(node)}
            if len(sources) == 1 and None not in sources:
                passing[node.name] = sources.pop()
    nodes = {n.name: n for n in graph.nodes}
    changed = True
    while changed:
        changed = False
        for name, fmt in list(passing.items()):
            node = nodes[name]
            values = _data_inputs(node) + [o for o in node.outputs if o]
            if any(source_format(v) != fmt for v in _data_inputs(node)) or not all(
                    _carried(v, fmt, graph_outputs, consumers, quantized, formats, passing) for v in values):
                del passing[name]
                changed = True
    return passing


def _group_thresholds(graph: Graph, passing: dict[str, str], amax: dict) -> dict:
    """`amax` with every tensor of a scale group (the tensors pass-through layers connect) given
    the group's threshold: the largest calibrated one among them. Every group holds a calibrated
    tensor: its last tensors are read by INT8 layers, whose inputs calibration covers."""
    parent: dict[str, str] = {}

    def root(value: str) -> str:
        while parent.setdefault(value, value) != value:
            parent[value] = parent[parent[value]]
            value = parent[value]
        return value

    for node in graph.nodes:
        if node.name in passing:
            values = _data_inputs(node) + [o for o in node.outputs if o]
            for value in values[1:]:
                parent[root(value)] = root(values[0])
    groups: dict[str, list[str]] = {}
    for value in parent:
        groups.setdefault(root(value), []).append(value)
    shared = dict(amax)
    for members in groups.values():
        calibrated = [amax[v] for v in members if v in amax]
        if calibrated:
            shared.update({v: max(calibrated) for v in members})
    return shared


def shared_thresholds(graph: Graph, layer_precision: dict[str, str], amax: dict[str, float]) -> tuple[dict, set]:
    """(`amax` as `quantize_graph` would apply it for this plan: each scale group's tensors at the
    group's threshold; the tensors it would store quantized): what a simulation of the plan must
    use to match the engine."""
    formats = {n.name: layer_precision[n.name] for n in graph.nodes
               if layer_precision.get(n.name) in QUANTIZED_PRECISIONS and n.op_type not in QUANTIZED_LAYERS}
    quantized = {n.name: n for n in graph.nodes if n.name in formats}
    passing = _pass_through_layers(graph, quantized, formats)
    shared = _group_thresholds(graph, passing, amax)
    return shared, _stored_quantized(graph, quantized, formats, shared, passing)


def _stored_quantized(graph: Graph, quantized: dict[str, Node], formats: dict[str, str], amax: dict,
                      passing: dict[str, str]) -> set[str]:
    """The tensors written quantized: produced and read only by layers of one format (`formats`:
    layer name → "int8" or "fp8"; `passing`: the pass-through layers and theirs), each INT8 (FP8)
    layer reading it as data input or residual."""
    graph_outputs = graph.output_names()
    consumers = graph.consumers()
    stored = set()
    writers = [(node, formats[node.name]) for node in quantized.values()]
    writers += [(node, passing[node.name]) for node in graph.nodes if node.name in passing]
    for node, fmt in writers:
        for value in (o for o in node.outputs if o):
            if value in amax and _carried(value, fmt, graph_outputs, consumers, quantized, formats, passing):
                stored.add(value)
    return stored


def folded_gemm_weight(graph: Graph, node: Node) -> tuple[np.ndarray, np.ndarray | None]:
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


def quantize_graph(graph: Graph, layer_precision: dict[str, str], amax: dict[str, float],
                   pass_through: bool = True) -> dict:
    """Rewrite every layer planned "int8" or "fp8" in place; returns {"layers": n, "int8_tensors":
    [...], "fp8_layers": n, "fp8_tensors": [...], "pass_through": {layer: format}} counting every
    INT8 (FP8) layer of the result (layers folded from a Q/DQ model are INT8 already) and every
    tensor stored quantized. `pass_through=False` keeps MaxPool/Concat/Split/Resize in floating point."""
    formats = {n.name: layer_precision[n.name] for n in graph.nodes
               if layer_precision.get(n.name) in QUANTIZED_PRECISIONS and n.op_type not in QUANTIZED_LAYERS}
    quantized = {n.name: n for n in graph.nodes if n.name in formats}
    for node in quantized.values():
        why = quantized_unsupported(graph, node, formats[node.name])
        if why is not None:
            raise ConfigError(f"layer {node.name} ({node.op_type}) cannot run {formats[node.name].upper()}: {why}")
        for position in int8_positions(node):
            if node.inputs[position] not in amax:
                raise ConfigError(f"the calibration has no threshold for tensor {node.inputs[position]!r} read by "
                                  f"layer {node.name}: recalibrate (delete the calibration cache)")
    passing = _pass_through_layers(graph, quantized, formats) if pass_through else {}
    amax = _group_thresholds(graph, passing, amax)
    stored = _stored_quantized(graph, quantized, formats, amax, passing)
    stored_fp8 = {n.outputs[0] for n in quantized.values() if n.outputs[0] in stored and formats[n.name] == "fp8"}
    stored_fp8 |= {o for n in graph.nodes if passing.get(n.name) == "fp8" for o in n.outputs if o in stored}
    for node in quantized.values():
        _rewrite(graph, node, amax, stored, formats[node.name] == "fp8")
    for value in stored:
        info = graph.value_info.get(value)
        dtype = fp8.numpy_dtype().name if value in stored_fp8 else "int8"
        graph.value_info[value] = ValueInfo(value, dtype, info.shape if info else None)
    graph.remove_unused_initializers()
    layers = [n for n in graph.nodes if n.op_type in QUANTIZED_LAYERS]
    written = {n.outputs[0] for n in layers if n.attrs.get("output_scale") is not None}
    fp8_layers = [n for n in layers if fp8.is_fp8(n.attrs)]
    fp8_written = {n.outputs[0] for n in fp8_layers if n.outputs[0] in written}
    moved = {o for n in graph.nodes if n.name in passing for o in n.outputs if o}
    return {"layers": len(layers) - len(fp8_layers), "int8_tensors": sorted((written | moved) - fp8_written - stored_fp8),
            "fp8_layers": len(fp8_layers), "fp8_tensors": sorted(fp8_written | (moved & stored_fp8)),
            "pass_through": passing}


def _rewrite(graph: Graph, node: Node, amax: dict, stored: set, is_fp8: bool) -> None:
    x = node.inputs[0]
    qmax = fp8.FP8_MAX if is_fp8 else INT8_QMAX
    input_scale, input_inv = activation_scale(amax[x], qmax)
    conv = node.op_type in CONV_OPS
    if conv:
        w = np.asarray(graph.constant(node.inputs[1]), dtype=np.float64)
        bias_name = node.inputs[2] if len(node.inputs) > 2 else ""
        bias = np.asarray(graph.constant(bias_name), dtype=np.float64).reshape(-1) if bias_name else None
        residual = node.inputs[3] if len(node.inputs) > 3 else ""
    else:
        w, bias = folded_gemm_weight(graph, node)
        residual = ""
    wq, weight_scale = quantize_weight_fp8(w) if is_fp8 else quantize_weight(w)
    dequant = (np.float32(input_scale) * weight_scale).astype(np.float32)
    if is_fp8:
        bias32 = None if bias is None else bias.astype(np.float32)
        arrays = (("w_fp8", wq), ("b_fp32", bias32), ("dequant_scale", dequant))
    else:
        arrays = (("w_int8", wq), ("b_int32", quantize_bias(bias, dequant)), ("dequant_scale", dequant))

    names = {}
    for suffix, array in arrays:
        if array is not None:
            names[suffix] = graph.fresh_name(f"{node.name}.{suffix}")
            graph.initializers[names[suffix]] = array
    weight_name, bias_name = arrays[0][0], arrays[1][0]
    attrs = {k: node.attrs[k] for k in CONV_ATTR_KEYS if conv and k in node.attrs}
    attrs.update({k: node.attrs[k] for k in EPILOGUE_KEYS if k in node.attrs})
    if conv:  # recorded because some tactics store the weight flattened (see ops/quantized.py)
        attrs["kernel_shape"] = [int(k) for k in wq.shape[2:]]
    attrs.update(input_scale=input_scale, input_inv_scale=input_inv, weight_scale=weight_scale,
                 residual_scale=None, output_scale=None, output_inv_scale=None)
    if is_fp8:
        attrs["qformat"] = fp8.QFORMAT
    if residual and residual in stored:
        attrs["residual_scale"] = activation_scale(amax[residual], qmax)[0]
    out = node.outputs[0]
    if out in stored:
        attrs["output_scale"], attrs["output_inv_scale"] = activation_scale(amax[out], qmax)
    node.op_type = "QConv" if conv else "QGemm"
    node.inputs = [x, names[weight_name], names.get(bias_name, ""), residual, names["dequant_scale"]]
    node.attrs = attrs
