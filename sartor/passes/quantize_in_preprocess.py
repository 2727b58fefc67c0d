"""The Preprocess layer of a raw-frames INT8 engine writes its image as the INT8 codes its readers
take, and those readers skip their own input quantization.

Without it the layer writes the float image (4 bytes a value) and the INT8 stem reads it back to
quantize it as it loads: the image crosses memory twice as floats. With it the layer stores one
byte a value, and a QConv or QGemm whose input arrives as codes reads them as they are
(`ops/quantized.py` `as_quantized`; every kernel's QUANTIZE_INPUT follows the input's dtype).

The numbers do not change: the codes are the readers' own quantization of the float value the
layer would have written, round(x · inv_scale) of the float32 product, half to even, saturated to
[qmin, 127] (`ops/quantized.py` `quantize`; the kernel's `quantize_int8`), and the readers
dequantize with the same scale (their dequant scales and biases were made with it).

Fires where the Preprocess layer's output is no graph output and every reader is an INT8 (not FP8)
QConv or QGemm reading it as its data input only (not as a residual or a projection's input), all
with one per-tensor input scale and saturation bound, and the spec makes float values (float32 or
float16; a uint8 image is no INT8 layer's float input). Runs after `frame_input.accept_frames`,
which adds the layer after quantization.
"""
from __future__ import annotations

from numbers import Real

from ..data.preprocess import parse_preprocess
from ..ir import Graph, Node, ValueInfo
from ..ir.dtypes import INT8_QMAX
from ..ops.fp8 import is_fp8

LAYER = "Preprocess"
READERS = ("QConv", "QGemm")
FLOAT_IMAGES = ("float32", "float16")


def _reader_quantization(reader: Node, value: str) -> tuple | None:
    """(scale, inv_scale, qmin) with which `reader` quantizes `value`, where it is an INT8 layer
    reading it as its data input only and quantizing per tensor; else None."""
    if reader.op_type not in READERS or is_fp8(reader.attrs) or reader.inputs[0] != value:
        return None
    if value in reader.inputs[1:]:  # a residual or a projection's input is read in its own way
        return None
    scale, inv_scale = reader.attrs.get("input_scale"), reader.attrs.get("input_inv_scale")
    if not (isinstance(scale, Real) and isinstance(inv_scale, Real)):  # the kernel writes per-tensor codes only
        return None
    return float(scale), float(inv_scale), int(reader.attrs.get("qmin", -INT8_QMAX))


def shared_quantization(readers: list[Node], value: str) -> tuple | None:
    """The one input quantization (scale, inv_scale, qmin) every one of `readers` applies to `value`,
    where each is an INT8 layer reading it as its data input only; else None. Also read by the
    runtime, whose copy of such a graph input writes these codes (`runtime/executor.py` `staged_form`)."""
    found = {_reader_quantization(reader, value) for reader in readers}
    return found.pop() if len(found) == 1 and None not in found else None


def _shared_quantization(graph: Graph, layer: Node, consumers: dict) -> tuple | None:
    """The one input quantization every reader of `layer`'s image applies, or None."""
    image = layer.outputs[0]
    readers = consumers.get(image, [])
    if not readers or image in graph.output_names():
        return None
    return shared_quantization(readers, image)


def quantize_in_preprocess(graph: Graph) -> int:
    """Make each Preprocess layer whose readers all quantize its image alike write their codes
    (module docstring); returns how many do."""
    rewritten = 0
    consumers = graph.consumers()
    for layer in graph.nodes:
        if layer.op_type != LAYER or layer.attrs.get("output_inv_scale") is not None:
            continue
        if parse_preprocess(layer.attrs["spec"]).dtype not in FLOAT_IMAGES:
            continue
        quantization = _shared_quantization(graph, layer, consumers)
        if quantization is None:
            continue
        scale, inv_scale, qmin = quantization
        layer.attrs = dict(layer.attrs, output_scale=scale, output_inv_scale=inv_scale, qmin=qmin)
        image = layer.outputs[0]
        info = graph.value_info.get(image)
        graph.value_info[image] = ValueInfo(image, "int8", info.shape if info else None)
        rewritten += 1
    return rewritten
