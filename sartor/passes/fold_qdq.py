"""Q/DQ models: DQ(Q(x)) → Conv/Gemm/MatMul ← DQ(W_int8) becomes a QConv/QGemm layer with the
model's scales, the same layer `sartor.quant.quantize_graph` makes from sartor's own calibration
(see `sartor/ops/quantized.py`).

A layer folds when
- its data input is DequantizeLinear(QuantizeLinear(x)), both quantizing per tensor with one
  float32 scale and a symmetric zero point (int8 with 0, or uint8 with 128): the layer reads x
  and quantizes it with that scale;
- its weights are DequantizeLinear of a constant int8 (or uint8 with zero point 128) tensor with
  zero points 0, per tensor (broadcast to the output channels) or per output channel;
- its bias, if any, is a float constant or DequantizeLinear of a constant: INT32 at scale
  scale_x · scale_w[c], as TensorRT does (the model's INT32 values are kept when the model
  quantized the bias at exactly that scale, as ONNX Runtime's quantizer does).
The fused epilogue (activation, residual) is kept, so Conv → Relu → Q → DQ → … folds whole once
`fuse_conv_activation` has run (and `drop_redundant_qdq` has removed a Q/DQ pair between the two).

Asymmetric activation zero points are not folded: sartor's INT8 kernels are symmetric. Such layers
run as the model gives them (Q/DQ as fake quantization in float), and an explicit --precision int8
build refuses them (`sartor.quant.qdq`).

Then a folded layer's output is written as INT8 when every reader is a folded layer quantizing it
with the same scale, or a QuantizeLinear doing so (int8, zero point 0): those Qs go, and the
DequantizeLinear after them reads the layer's INT8 output directly.

Folded layers saturate to [-128, 127] as QuantizeLinear does (`qmin` = -128) and are planned INT8
whatever the build precision: the model chose them.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..ir import Graph, Node, ValueInfo
from ..ir.dtypes import INT32_MAX, QUANTIZED_LAYERS
from .qdq_params import (
    QDQ_QMIN,
    SYMMETRIC_ZERO_POINT,
    fake_quant_params,
    qparams,
    quantized_by,
)

CONV_OPS = ("Conv", "FusedConv")
FOLDABLE = CONV_OPS + ("Gemm", "FusedGemm", "MatMul")
QDQ_OPS = ("QuantizeLinear", "DequantizeLinear")
ONNX_QUANT_OPS = QDQ_OPS + ("DynamicQuantizeLinear", "QLinearConv", "QLinearMatMul", "ConvInteger", "MatMulInteger")
CONV_ATTR_KEYS = ("auto_pad", "dilations", "group", "kernel_shape", "pads", "strides")
EPILOGUE_KEYS = ("activation", "activation_alpha", "activation_beta", "residual_after_activation")
SYMMETRIC_NOTE = "sartor's INT8 kernels are symmetric (zero point 0 for int8, 128 for uint8)"


@dataclass
class _Fold:
    source: str  # the float tensor the activation Q reads
    scale: np.float32
    weight: np.ndarray  # int8, [M, C/group, *k] or [M, K]
    weight_scale: np.ndarray  # float32 [M]
    bias: np.ndarray | None  # int32 [M]
    dequant: np.ndarray  # float32 [M]: scale · weight_scale
    origin: list


class NotFolded(str):
    """Why a layer with a dequantized data input was not folded (a one-line reason)."""
    asymmetric = False


def _asymmetric(reason: str) -> NotFolded:
    why = NotFolded(reason)
    why.asymmetric = True
    return why


def _inv(scale: float) -> float:
    return float(np.float32(1.0 / np.float64(scale)))


def _out_axis(node: Node) -> int:
    """The output-channel axis of the layer's weight as the model stores it."""
    if node.op_type in CONV_OPS:
        return 0
    if node.op_type == "MatMul":
        return 1
    return 0 if node.attrs.get("transB", 0) else 1


def _weight(graph: Graph, node: Node, producers: dict) -> tuple[np.ndarray, np.ndarray, Node] | NotFolded:
    """(int8 weight in the QConv/QGemm layout, float32 per-output-channel scale, the DQ)."""
    name = node.inputs[1] if len(node.inputs) > 1 else ""
    dq = producers.get(name)
    if dq is None or dq.op_type != "DequantizeLinear":
        return NotFolded("its weights are not a DequantizeLinear output (the model does not quantize them)")
    raw = graph.constant(dq.inputs[0])
    params = qparams(graph, dq)
    if raw is None or params is None:
        return NotFolded(f"weight DequantizeLinear {dq.name} does not read constant integers with constant scales")
    if raw.dtype.name not in SYMMETRIC_ZERO_POINT or not params.symmetric():
        return NotFolded(f"weight zero point {params.describe_zero_point()} of {dq.name} is not symmetric "
                         f"(int8 weights need zero point 0)")
    if params.scale.dtype != np.float32:
        return NotFolded(f"weight scale of {dq.name} is {params.scale.dtype}, not float32")
    if node.op_type in CONV_OPS and raw.ndim < 3:
        return NotFolded("its weights are not a convolution kernel")
    if node.op_type not in CONV_OPS and raw.ndim != 2:
        return NotFolded(f"its weight has rank {raw.ndim}, not 2")
    axis = _out_axis(node)
    m = raw.shape[axis]
    if params.scale.size == 1:
        scale = np.full(m, params.scale.reshape(-1)[0], dtype=np.float32)
    elif params.axis % raw.ndim == axis and params.scale.size == m:
        scale = params.scale.reshape(-1).astype(np.float32)
    else:
        return NotFolded(f"{dq.name} scales weights along axis {params.axis}, not per output channel (axis {axis})")
    if not np.all(np.isfinite(scale)) or np.any(scale == 0):
        return NotFolded(f"weight scales of {dq.name} include zero or non-finite values")
    q = raw.astype(np.int16) - (128 if raw.dtype == np.uint8 else 0)
    if axis == 1:  # Gemm with transB=0 and MatMul store [K, M]
        q = q.T
    return np.ascontiguousarray(q.astype(np.int8)), scale, dq


def _bias(graph: Graph, node: Node, dequant: np.ndarray, producers: dict) -> tuple[np.ndarray | None, list] | NotFolded:
    name = node.inputs[2] if len(node.inputs) > 2 and node.op_type != "MatMul" else ""
    if not name:
        return None, []
    m = dequant.shape[0]
    gemm = node.op_type not in CONV_OPS
    beta = float(node.attrs.get("beta", 1.0)) if gemm else 1.0
    exact_scale = not gemm or (beta == 1.0 and float(node.attrs.get("alpha", 1.0)) == 1.0)
    dq = producers.get(name)
    origin = []
    if graph.is_constant(name):
        values = np.asarray(graph.constant(name), dtype=np.float64)
    elif dq is not None and dq.op_type == "DequantizeLinear" and graph.is_constant(dq.inputs[0]) \
            and qparams(graph, dq) is not None:
        raw, params = graph.constant(dq.inputs[0]), qparams(graph, dq)
        origin = dq.origin
        if raw.dtype == np.int32 and np.all(params.zero_point == 0) and raw.size in (1, m) and exact_scale \
                and params.scale.size in (1, m) and raw.ndim <= 1 \
                and np.array_equal(np.broadcast_to(params.scale.reshape(-1).astype(np.float32), (m,)), dequant):
            return np.broadcast_to(raw.reshape(-1), (m,)).astype(np.int32), origin
        axis = params.axis % raw.ndim if raw.ndim else 0
        shape = [1] * raw.ndim
        if params.scale.size > 1:
            shape[axis] = -1
        zp = params.zero_point.reshape(shape) if params.zero_point.size > 1 else params.zero_point.reshape(())
        scale = params.scale.reshape(shape) if params.scale.size > 1 else params.scale.reshape(())
        values = ((raw.astype(np.float32) - zp.astype(np.float32)) * scale.astype(np.float32)).astype(np.float64)
    else:
        return NotFolded("its bias is neither a constant nor a DequantizeLinear of one")
    if gemm and (values.ndim > 2 or values.size not in (1, m) or (values.ndim == 2 and values.shape[0] != 1)):
        return NotFolded(f"its bias has shape {list(values.shape)}, not one value per output")
    values = np.broadcast_to(values.reshape(-1) * beta, (m,))
    q = np.rint(values / dequant.astype(np.float64))
    return np.clip(q, -INT32_MAX, INT32_MAX).astype(np.int32), origin


def _plan(graph: Graph, node: Node, producers: dict) -> _Fold | NotFolded | None:
    """How `node` folds, or why it cannot (NotFolded), or None when its data input is not
    dequantized (the model does not quantize this layer)."""
    if node.op_type not in FOLDABLE or not node.inputs:
        return None
    x = node.inputs[0]
    dq = producers.get(x)
    if dq is None or dq.op_type != "DequantizeLinear":
        return None
    pair = quantized_by(graph, x, producers)
    if pair is None:
        return NotFolded(f"its input DequantizeLinear {dq.name} reads {dq.inputs[0]!r}, which no QuantizeLinear "
                         f"produces")
    q, dq = pair
    params = fake_quant_params(graph, q, dq)
    if params is None:
        single = qparams(graph, q)
        if single is not None and not single.per_tensor:
            return NotFolded(f"{q.name} quantizes per axis: activations need one scale per tensor")
        return NotFolded(f"{q.name} → {dq.name} do not share one constant float32 scale and zero point")
    if not params.symmetric():
        return _asymmetric(f"activation zero point {params.describe_zero_point()} of {q.name} is asymmetric; "
                           f"{SYMMETRIC_NOTE}")
    scale = np.float32(params.scale.reshape(-1)[0])
    if not (np.isfinite(scale) and scale > 0):
        return NotFolded(f"activation scale {scale} of {q.name} is not a positive number")
    source = q.inputs[0]
    if graph.dtype_of(source) not in (None, "float32"):
        return NotFolded(f"{q.name} quantizes a {graph.dtype_of(source)} tensor, not float32")
    if node.op_type in ("Gemm", "FusedGemm"):
        if node.attrs.get("transA", 0):
            return NotFolded("transA=1")
        if len(node.inputs) > 3 and any(node.inputs[3:]):
            return NotFolded("it has a residual input")
    weight = _weight(graph, node, producers)
    if isinstance(weight, NotFolded):
        return weight
    wq, weight_scale, wdq = weight
    if node.op_type in ("Gemm", "FusedGemm") and float(node.attrs.get("alpha", 1.0)) != 1.0:
        weight_scale = (weight_scale.astype(np.float64) * float(node.attrs["alpha"])).astype(np.float32)
    dequant = (scale * weight_scale).astype(np.float32)
    bias = _bias(graph, node, dequant, producers)
    if isinstance(bias, NotFolded):
        return bias
    bq, bias_origin = bias
    origin = list(dict.fromkeys(q.origin + dq.origin + wdq.origin + bias_origin))
    return _Fold(source, scale, wq, weight_scale, bq, dequant, origin)


def _rewrite(graph: Graph, node: Node, fold: _Fold) -> None:
    """In place, in the form `sartor.quant.quantize._rewrite` gives calibrated layers."""
    conv = node.op_type in CONV_OPS
    residual = node.inputs[3] if conv and len(node.inputs) > 3 else ""
    names = {}
    for suffix, array in (("w_int8", fold.weight), ("b_int32", fold.bias), ("dequant_scale", fold.dequant)):
        if array is not None:
            names[suffix] = graph.fresh_name(f"{node.name}.{suffix}")
            graph.initializers[names[suffix]] = array
    attrs = {k: node.attrs[k] for k in CONV_ATTR_KEYS if conv and k in node.attrs}
    attrs.update({k: node.attrs[k] for k in EPILOGUE_KEYS if k in node.attrs})
    if conv:  # as quantize records it: some tactics store the weight flattened
        attrs["kernel_shape"] = [int(k) for k in fold.weight.shape[2:]]
    attrs.update(input_scale=float(fold.scale), input_inv_scale=_inv(fold.scale), weight_scale=fold.weight_scale,
                 residual_scale=None, output_scale=None, output_inv_scale=None, qmin=QDQ_QMIN)
    node.op_type = "QConv" if conv else "QGemm"
    node.inputs = [fold.source, names["w_int8"], names.get("b_int32", ""), residual, names["dequant_scale"]]
    node.attrs = attrs
    node.origin = node.origin + [o for o in fold.origin if o not in node.origin]


def _int8_reader_scale(graph: Graph, reader: Node, value: str, outputs: set) -> float | None:
    """The scale with which `reader` quantizes `value` when it is a folded layer reading it as its
    data input, or an int8 QuantizeLinear with zero point 0; None for any other reader."""
    if reader.op_type in QUANTIZED_LAYERS:
        if reader.attrs.get("qmin") != QDQ_QMIN or reader.inputs[0] != value or value in reader.inputs[1:]:
            return None
        return reader.attrs["input_scale"]
    if reader.op_type != "QuantizeLinear" or reader.inputs[0] != value or reader.outputs[0] in outputs:
        return None
    params = qparams(graph, reader)
    if params is None or not params.per_tensor or params.dtype != "int8" or not params.symmetric() \
            or params.scale.dtype != np.float32 or reader.attrs.get("precision") not in (None, 0, 1):
        return None
    return float(params.scale.reshape(-1)[0])


def _store_int8(graph: Graph) -> int:
    """Folded layers whose every reader quantizes their output with one scale write INT8."""
    stored = 0
    outputs = graph.output_names()
    consumers = graph.consumers()
    for node in [n for n in graph.nodes if n.op_type in QUANTIZED_LAYERS and n.attrs.get("qmin") == QDQ_QMIN]:
        value = node.outputs[0]
        if node.attrs.get("output_scale") is not None or value in outputs or not consumers.get(value):
            continue
        readers = consumers[value]
        scales = {_int8_reader_scale(graph, r, value, outputs) for r in readers}
        if len(scales) != 1 or None in scales:
            continue
        scale = scales.pop()
        node.attrs["output_scale"], node.attrs["output_inv_scale"] = scale, _inv(scale)
        for reader in readers:
            if reader.op_type == "QuantizeLinear":  # its readers take the INT8 output as it is
                graph.nodes.remove(reader)
                graph.replace_uses(reader.outputs[0], value)
        info = graph.value_info.get(value)
        graph.value_info[value] = ValueInfo(value, "int8", info.shape if info else None)
        stored += 1
    return stored


def fold_qdq(graph: Graph) -> int:
    folded = 0
    producers = graph.producers()
    for node in list(graph.nodes):
        fold = _plan(graph, node, producers)
        if isinstance(fold, _Fold):
            _rewrite(graph, node, fold)
            folded += 1
    stored = _store_int8(graph)
    if folded or stored:
        graph.remove_unused_initializers()
    return folded + stored


# ---- what the build log and the precision plan read ----------------------------------------------

def why_not_folded(graph: Graph, node: Node, producers: dict | None = None) -> NotFolded | None:
    """Why a conv/gemm layer whose data input is dequantized was not folded; None for other layers."""
    fold = _plan(graph, node, producers if producers is not None else graph.producers())
    return fold if isinstance(fold, NotFolded) else None


def is_qdq_model(graph: Graph) -> bool:
    """The graph holds ONNX quantization ops or layers folded from them: the model is quantized
    explicitly, and its layers run INT8 exactly where it says."""
    return any(n.op_type in ONNX_QUANT_OPS or (n.op_type in QUANTIZED_LAYERS and n.attrs.get("qmin") == QDQ_QMIN)
               for n in graph.nodes)


def qdq_census(graph: Graph) -> dict:
    counts = {op: 0 for op in QDQ_OPS}
    for node in graph.nodes:
        if node.op_type in counts:
            counts[node.op_type] += 1
    return counts


def qdq_notes(graph: Graph, before: dict) -> list[str]:
    """Build-log lines after the passes: Q/DQ pairs folded, Q/DQ pairs left as fake quantization,
    and why each dequantized conv/gemm layer that stayed float was not folded."""
    if not any(before.values()):
        return []
    after = qdq_census(graph)
    layers = [n for n in graph.nodes if n.op_type in QUANTIZED_LAYERS and n.attrs.get("qmin") == QDQ_QMIN]
    int8_tensors = sum(1 for n in layers if n.attrs.get("output_scale") is not None)
    q_before, q_after = before["QuantizeLinear"], after["QuantizeLinear"]
    summary = (f"qdq: the model has {q_before} QuantizeLinear and {before['DequantizeLinear']} DequantizeLinear; "
               f"{len(layers)} conv/gemm layer(s) folded into QConv/QGemm with its scales, {int8_tensors} of them "
               f"writing INT8; {q_before - q_after} Q/DQ pair(s) folded, {q_after} run as fake quantization in float "
               f"(computed as given, not fused)")
    lines = [summary]
    producers = graph.producers()
    for node in graph.nodes:
        why = why_not_folded(graph, node, producers)
        if why is not None:
            lines.append(f"qdq: layer {node.name} ({node.op_type}) not folded, runs as given: {why}")
    return lines
