"""A bound on the int32 sums of each INT8 layer, from its weights: where every sum (with its bias)
stays below 2^22 in magnitude, the layer's kernels turn their sums into float32 by decoding bits
instead of a conversion instruction (`kernels/common/tile_steps.py`, SUMS_DECODED).

An INT8 layer's epilogue converts one int32 sum per output value to float32 before scaling it, and
Hopper issues those conversions at an eighth of a float add's rate
(docs/decisions/0013-decoded-accumulators.md). The sum plus 0x4B400000, read as float bits, is
1.5·2^23 + sum exactly while |sum| < 2^22: an integer add (which the bias's add absorbs) and a
float subtraction instead.

The bound holds for any input: each input code lies in [-128, 127] (both sartor's calibration, at
[-127, 127], and Q/DQ models' int8, at [-128, 127]; zero padding adds nothing), so output channel
c's sum is at most 128 · Σ|w_c| + |bias_c|. A projected layer (`passes/fuse_projected_residual.py`)
decodes its projection's sums the same way, so its bound covers both products. FP8 layers sum in
float32 and get none. Layers of small K always qualify (K ≤ 256: 256 · 127 · 128 < 2^22), as do
most 3×3 layers of trained networks, whose weights sit far below the per-channel maximum.

Runs after everything that sets a quantized layer's weights or biases (quantization, bias
correction, the projection fusion, or a Q/DQ model's folding) and before tactics: the bound is an
attribute of the layer (ACCUMULATOR_BOUND) that every tactic's kernel and the timing cache read.
"""
from __future__ import annotations

import numpy as np

from ..ir import Graph, Node
from ..ir.dtypes import QUANTIZED_LAYERS
from ..ops.fp8 import is_fp8
from ..ops.quantized import ACCUMULATOR_BOUND, PROJECTION_FIRST_INPUT

# The largest |code| an INT8 layer's input can hold: int8's -128 (Q/DQ models saturate there).
LARGEST_INPUT_CODE = 128


def product_bound(weight_codes: np.ndarray, bias: np.ndarray | None) -> int:
    """max over output channels (axis 0) of LARGEST_INPUT_CODE · Σ|w| + |bias|, exactly (int64)."""
    w = np.abs(np.asarray(weight_codes, dtype=np.int64).reshape(weight_codes.shape[0], -1)).sum(axis=1)
    total = w * LARGEST_INPUT_CODE
    if bias is not None:
        total = total + np.abs(np.asarray(bias, dtype=np.int64).reshape(-1))
    return int(total.max()) if total.size else 0


def layer_bound(graph: Graph, node: Node) -> int | None:
    """The bound of an INT8 QConv/QGemm (of its projection too, if it has one); None where its
    weight or bias is not a constant of the graph."""
    products = [node.inputs[1:3]]
    if len(node.inputs) > PROJECTION_FIRST_INPUT and node.inputs[PROJECTION_FIRST_INPUT]:
        products.append(node.inputs[PROJECTION_FIRST_INPUT + 1:PROJECTION_FIRST_INPUT + 3])
    bounds = []
    for names in products:
        weight_name, bias_name = (list(names) + [""])[:2]  # a QGemm's bias may be absent altogether
        weight = graph.constant(weight_name)
        bias = graph.constant(bias_name) if bias_name else None
        if weight is None or (bias_name and bias is None):
            return None
        bounds.append(product_bound(weight, bias))
    return max(bounds)


def bound_accumulators(graph: Graph) -> int:
    """Record each INT8 layer's bound (attrs[ACCUMULATOR_BOUND]); returns how many layers got one."""
    bounded = 0
    for node in graph.nodes:
        if node.op_type not in QUANTIZED_LAYERS:
            continue
        node.attrs.pop(ACCUMULATOR_BOUND, None)  # a bound from before a weight changed never stays
        if is_fp8(node.attrs):
            continue
        bound = layer_bound(graph, node)
        if bound is not None:
            node.attrs[ACCUMULATOR_BOUND] = bound
            bounded += 1
    return bounded
