"""Empirical bias correction of INT8 and FP8 layers (Nagel et al. 2019, "Data-Free Quantization
Through Weight Equalization and Bias Correction", section 4.2; AIMET's "empirical bias correction").

Per-channel weight quantization shifts each output channel's mean: E[W_q x] ≠ E[W x]. With few taps
per output (depthwise convolutions: 9 products per output) the rounding errors of one channel do
not average out and the shift is a visible fraction of the channel's spread. Subtracting the
shift from the layer's bias removes it:

    correction[c] = E over calibration batches and spatial positions of (y_q[c] - y_float[c])
    bias'[c]      = bias[c] - correction[c]

Each quantized layer and its float original both read the *float* model's input to the layer, so
that only the layer's own weight and input quantization is measured.

A sequential variant, which measured each layer again on its input as the quantized, already
corrected layers before it produce it, was tried and removed (commit 785582c has it): it helped
with mse thresholds and wrecked entropy (docs/decisions/0002-bias-correction-opt-in.md).

y_q is the layer's output as the engine computes it
(`ops/quantized.py`'s exact INT8/FP8 emulation, with the layer's own scales, INT32/FP32 bias and
dequantization), taken before the activation and the residual add: the bias is added before
both, so the pre-activation mean is what the bias can correct. The float output is the float
layer's (float32), without its activation and residual.

Each layer's correction depends on the model (its weights), the calibration samples, the layer's
format (INT8 or FP8) and its input scale (a pass-through group can raise it). The calibration cache
stores them under exactly that key (`cache.py`), so that a build from the cache gets the same biases
bit for bit.

Models quantized with Q/DQ nodes are left alone: their scales (and biases) come from the file.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import torch

from ..ir import Graph, Node
from ..ir.dtypes import INT32_MAX, QUANTIZED_LAYERS, QUANTIZED_PRECISIONS
from ..ops import fp8
from ..ops.conv import conv_nd
from ..ops.quantized import qconv, qgemm
from ..ops import default_registry
from ..ops.util import tensor_from_numpy
from ..runtime.executor import Executor
from .calibrate import batch_to_device
from .plan import CONV_OPS
from .quantize import folded_gemm_weight

# Off unless --bias-correction: neutral with the default threshold method (mse), at the cost of a
# pass over the calibration samples (docs/decisions/0002-bias-correction-opt-in.md).
DEFAULT_BIAS_CORRECTION = False
# The epilogue that follows the bias: measured without it (the bias is added before all of it).
EPILOGUE_ATTRS = ("activation", "activation_alpha", "activation_beta", "residual_after_activation", "residual_scale",
                  "output_scale", "output_inv_scale", "tactic", "tactic_by_profile")


@dataclass
class LayerCorrection:
    """One layer's per-output-channel correction (float64), the key it is valid for, and the
    layer's float pre-activation output RMS (the scale the log relates the correction to)."""
    layer: str
    fmt: str  # "int8" or "fp8"
    input_scale: float
    correction: np.ndarray
    output_rms: float = 0.0

    def relative(self) -> float:
        """The largest |correction| in units of the layer's output RMS."""
        peak = float(np.abs(self.correction).max()) if self.correction.size else 0.0
        return peak / self.output_rms if self.output_rms > 0 else 0.0


@dataclass
class _Measured:
    """What one layer accumulates over the batches."""
    node: Node  # the quantized layer (QConv/QGemm)
    conv: bool
    weight: torch.Tensor  # float32 [M, ...], on the measuring device
    bias: torch.Tensor | None  # float64 [M], on the measuring device
    float_attrs: dict
    q_inputs: list
    q_attrs: dict
    diff_sum: torch.Tensor | None = None
    square_sum: float = 0.0
    count: int = 0


def layer_format(node: Node) -> str:
    return "fp8" if fp8.is_fp8(node.attrs) else "int8"


def correctable_layers(graph: Graph, float_graph: Graph) -> list[Node]:
    """The quantized layers (QConv/QGemm) of `graph` that `float_graph` holds as float conv/gemm
    layers of the same name (so not the layers folded from Q/DQ nodes)."""
    float_nodes = {n.name: n for n in float_graph.nodes}
    return [n for n in graph.nodes if n.op_type in QUANTIZED_LAYERS and n.name in float_nodes
            and float_nodes[n.name].op_type not in QUANTIZED_LAYERS]


def _float_layer(float_graph: Graph, node: Node) -> tuple[bool, torch.Tensor, torch.Tensor | None, dict]:
    """(is a convolution, float32 weight, float64 bias or None, filled attributes) of the float
    original: conv weight as in the model, gemm weight as [M, K] with alpha/beta folded in."""
    conv = node.op_type in CONV_OPS
    if conv:
        w = np.asarray(float_graph.constant(node.inputs[1]), dtype=np.float64)
        name = node.inputs[2] if len(node.inputs) > 2 else ""
        b = np.asarray(float_graph.constant(name), dtype=np.float64).reshape(-1) if name else None
    else:
        w, b = folded_gemm_weight(float_graph, node)
    attrs = default_registry()[node.op_type].fill_attrs(node.attrs) if conv else {}
    # float32 weights (a float32 convolution, as the float model runs; its rounding is far below
    # the quantization error measured), float64 bias.
    weight = torch.from_numpy(np.ascontiguousarray(w, dtype=np.float32))
    return conv, weight, None if b is None else torch.from_numpy(b), attrs


def _quantized_inputs(graph: Graph, node: Node, device: torch.device) -> list:
    """The QConv/QGemm's inputs after x: weight, bias (or None), no residual, dequant scale."""
    def tensor(name: str):
        return tensor_from_numpy(graph.initializers[name]).to(device) if name else None
    return [tensor(node.inputs[1]), tensor(node.inputs[2]), None, tensor(node.inputs[4])]


def _pre_activation(layer: _Measured, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(quantized, float) pre-activation outputs of the layer on input `x`, channels on axis 1
    (conv) or last (gemm)."""
    if layer.conv:
        y_q = qconv([x] + layer.q_inputs, layer.q_attrs)
        y_f = conv_nd(x.float(), layer.weight, None, layer.float_attrs).to(torch.float64)
        if layer.bias is not None:
            y_f = y_f + layer.bias.reshape(1, -1, *([1] * (y_f.dim() - 2)))
    else:
        y_q = qgemm([x] + layer.q_inputs, layer.q_attrs)
        y_f = torch.matmul(x.float(), layer.weight.t()).to(torch.float64)
        if layer.bias is not None:
            y_f = y_f + layer.bias
    return y_q, y_f


def _channel_sums(y: torch.Tensor, axis: int) -> torch.Tensor:
    """Per-channel sums over every other axis, float64, on the host."""
    return y.to(torch.float64).movedim(axis, 0).reshape(y.shape[axis], -1).sum(dim=1).cpu()


def _add(total: torch.Tensor | None, part: torch.Tensor) -> torch.Tensor:
    return part if total is None else total + part


def _accumulate(layer: _Measured, x: torch.Tensor) -> None:
    y_q, y_f = _pre_activation(layer, x)
    axis = 1 if layer.conv else y_f.dim() - 1
    layer.diff_sum = _add(layer.diff_sum, _channel_sums(y_q.to(torch.float64) - y_f, axis))
    layer.square_sum += float(y_f.square().sum())
    layer.count += y_f.numel() // y_f.shape[axis]


def measure_corrections(graph: Graph, float_graph: Graph, float_weights: dict, batches: Iterable[dict],
                        device: torch.device) -> dict[str, LayerCorrection]:
    """{layer: correction} for every quantized layer of `graph` with a float original in
    `float_graph`, over `batches` run through the float model."""
    layers: dict[str, _Measured] = {}
    originals = {n.name: n for n in float_graph.nodes}
    for node in correctable_layers(graph, float_graph):
        original = originals[node.name]
        conv, w, b, float_attrs = _float_layer(float_graph, original)
        q_attrs = {k: v for k, v in node.attrs.items() if k not in EPILOGUE_ATTRS}
        layers[node.name] = _Measured(node, conv, w.to(device), None if b is None else b.to(device), float_attrs,
                                      _quantized_inputs(graph, node, device), q_attrs)
    if not layers:
        return {}
    executor = Executor(float_graph, float_weights, device)

    def before(index, step, args):
        layer = layers.get(step.node.name)
        if layer is not None:
            _accumulate(layer, args[0])

    with torch.inference_mode():
        for batch in batches:
            executor.run(batch_to_device(batch, device), before=before)
    corrections = {}
    for name, layer in layers.items():
        if layer.count == 0:  # never reached (a branch the batches did not run): nothing measured
            continue
        mean = (layer.diff_sum / layer.count).numpy()
        rms = float(np.sqrt(layer.square_sum / (layer.count * max(len(mean), 1))))
        corrections[name] = LayerCorrection(name, layer_format(layer.node), float(layer.node.attrs["input_scale"]),
                                            mean, rms)
    return corrections


def apply_corrections(graph: Graph, corrections: dict[str, LayerCorrection]) -> int:
    """Subtract each correction from its quantized layer's bias, in place (a layer without a bias
    gets one); returns how many layers changed. INT8 biases are INT32 in units of the dequant
    scale, so the correction is rounded to that step; FP8 biases are float32."""
    changed = 0
    for node in graph.nodes:
        fix = corrections.get(node.name)
        if fix is None or node.op_type not in QUANTIZED_LAYERS:
            continue
        dequant = np.asarray(graph.initializers[node.inputs[4]], dtype=np.float64)
        old = graph.initializers.get(node.inputs[2]) if node.inputs[2] else None
        base = np.zeros(len(dequant)) if old is None else np.asarray(old, dtype=np.float64)
        if layer_format(node) == "fp8":
            new = (base - fix.correction).astype(np.float32)
            suffix = "b_fp32"
        else:
            new = np.clip(np.rint(base - fix.correction / dequant), -INT32_MAX, INT32_MAX).astype(np.int32)
            suffix = "b_int32"
        if old is not None and np.array_equal(new, old):
            continue
        name = node.inputs[2] or graph.fresh_name(f"{node.name}.{suffix}")
        graph.initializers[name] = new
        node.inputs[2] = name
        changed += 1
    return changed


def corrections_to_json(corrections: dict[str, LayerCorrection]) -> dict:
    """{format: {layer: {"input_scale", "input_scale_hex", "output_rms", "correction", "correction_hex"}}} (the
    calibration cache's "bias_correction"; the hex spellings are what is read back)."""
    data: dict[str, dict] = {}
    for name in sorted(corrections):
        fix = corrections[name]
        values = [float(v) for v in fix.correction]
        data.setdefault(fix.fmt, {})[name] = {
            "input_scale": fix.input_scale, "input_scale_hex": float(fix.input_scale).hex(),
            "output_rms": float(fix.output_rms), "correction": values, "correction_hex": [v.hex() for v in values]}
    return data


def corrections_from_json(data: dict) -> dict[tuple[str, str], LayerCorrection]:
    """{(format, layer): correction} from the cache's "bias_correction" (hex spellings read);
    raises ValueError/TypeError/KeyError on a malformed entry (the cache reader reports it)."""
    out = {}
    for fmt, layers in data.items():
        for name, entry in layers.items():
            scale = float.fromhex(entry["input_scale_hex"]) if "input_scale_hex" in entry else float(entry["input_scale"])
            values = ([float.fromhex(v) for v in entry["correction_hex"]] if "correction_hex" in entry
                      else [float(v) for v in entry["correction"]])
            if "correction" in entry and [float(v) for v in entry["correction"]] != values:
                raise ValueError(f"bias correction of {name} ({fmt}): \"correction\" and \"correction_hex\" differ")
            out[(str(fmt), str(name))] = LayerCorrection(str(name), str(fmt), scale, np.asarray(values, np.float64),
                                                         float(entry.get("output_rms", 0.0)))
    return out


def stored_for(graph: Graph, float_graph: Graph, stored: dict[tuple[str, str], LayerCorrection]
               ) -> tuple[dict[str, LayerCorrection], list[str]]:
    """(the stored corrections valid for this build's quantized layers, the layers without one):
    valid means same layer, same format, same input scale bit for bit, and one value per channel."""
    found, missing = {}, []
    for node in correctable_layers(graph, float_graph):
        fix = stored.get((layer_format(node), node.name))
        channels = len(graph.initializers[node.inputs[4]])
        if fix is not None and fix.input_scale == float(node.attrs["input_scale"]) and fix.correction.size == channels:
            found[node.name] = fix
        else:
            missing.append(node.name)
    return found, missing


def summary(corrections: dict[str, LayerCorrection], changed: int, source: str) -> tuple[str, dict]:
    """The build log line and the engine header's record."""
    counts = {fmt: sum(1 for c in corrections.values() if c.fmt == fmt) for fmt in QUANTIZED_PRECISIONS}
    largest = max(corrections.values(), key=LayerCorrection.relative, default=None)
    record = {"layers": changed, "measured": len(corrections), "source": source,
              "int8_layers": counts["int8"], "fp8_layers": counts["fp8"],
              "largest_relative": None if largest is None else round(largest.relative(), 6),
              "largest_layer": None if largest is None else largest.layer}
    kinds = ", ".join(f"{n} {fmt.upper()}" for fmt, n in counts.items() if n)
    line = f"bias correction: {changed} layer(s) corrected ({kinds or 'none'}; {source})"
    if largest is not None and largest.output_rms > 0:
        line += (f"; largest correction {largest.relative():.3g} × the layer's output RMS "
                 f"({largest.layer})")
    elif largest is not None:
        peak = float(np.abs(largest.correction).max()) if largest.correction.size else 0.0
        line += f"; largest correction {peak:.3g} ({largest.layer})"
    return line, record
