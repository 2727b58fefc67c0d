"""The 3 × 3 / 2 max pool that alone reads an INT8 stem's codes is carried by the stem's QConv
(`ops/fused_pool.py`), whose pooled window tiles (`kernels/window/resident.py`, "max-pool") pool inside
the convolution's kernel and store only the pooled codes.

ResNet-50's stem at batch 256 writes 205 MB of INT8 codes that its max pool reads back at once
(docs/decisions/0011-stem-max-pool-in-the-stem-kernel.md). The pooled tiles walk row pairs down
strips of the image: each pooled row is the max of a pair's two
rows and the row above them, each pooled column of three output columns, and only a quarter of the
codes is stored. Every other tactic of the layer runs the convolution, then the pool, so the
builder's timing decides between the two.

The numbers do not change: the pool compares codes, the kernel compares the values it would have
requantized (requantizing is monotonic), and both keep the max.

Fires where the QConv writes INT8 codes, has no residual or projection, is one the window tiles run
(up to 4 input channels: `quantized_window.window_applies_to_weight`), and its output goes to one
MaxPool alone (not a graph output) that pools 3 × 3 at stride 2 with padding 1, floor mode,
undilated, without an Indices output. Runs after quantization and the other QConv rewrites, before
the accumulators' bound and tactics.
"""
from __future__ import annotations

from ..ir import Graph, Node
from ..ops.fp8 import is_fp8
from ..ops.fused_pool import MAX_POOL_ATTRS, fused_max_pool, pool_in_kernel
from ..ops.quantized import PROJECTION_FIRST_INPUT
from ..ops.quantized_window import window_applies_to_weight
from .base import single_consumer

LAYER, POOL = "QConv", "MaxPool"


def _pool_attrs(pool: Node) -> dict | None:
    """The MaxPool's kernel_shape, strides and pads where it is a plain 2-D floor-mode pool with
    explicit pads and without Indices, else None."""
    attrs = pool.attrs
    kernel = list(attrs.get("kernel_shape") or [])
    if (len(kernel) != 2 or attrs.get("auto_pad", "NOTSET") != "NOTSET" or attrs.get("ceil_mode", 0)
            or list(attrs.get("dilations") or [1, 1]) != [1, 1] or attrs.get("_with_indices")
            or any(pool.outputs[1:])):
        return None
    return {"kernel_shape": kernel, "strides": list(attrs.get("strides") or [1, 1]),
            "pads": list(attrs.get("pads") or [0, 0, 0, 0])}


def _fusable_layer(graph: Graph, node: Node) -> bool:
    """An INT8 QConv writing codes, without residual, projection or a pool already, that the window
    tiles run."""
    if (node.op_type != LAYER or fused_max_pool(node.attrs) is not None or len(node.inputs) < 5 or node.inputs[3]
            or any(node.inputs[PROJECTION_FIRST_INPUT:])):
        return False
    weight = graph.constant(node.inputs[1])
    return (weight is not None and not is_fp8(node.attrs) and node.attrs.get("output_inv_scale") is not None
            and window_applies_to_weight(tuple(weight.shape), node.attrs))


def fuse_stem_max_pool(graph: Graph) -> int:
    """Give each fusable QConv its MaxPool (module docstring); returns how many were fused."""
    fused = 0
    consumers = graph.consumers()
    for layer in list(graph.nodes):
        if not _fusable_layer(graph, layer):
            continue
        pool = single_consumer(graph, layer.outputs[0], consumers)
        pool_attrs = _pool_attrs(pool) if pool is not None and pool.op_type == POOL else None
        if not pool_in_kernel(pool_attrs):
            continue
        layer.attrs = dict(layer.attrs, **{name: pool_attrs[key] for name, key in MAX_POOL_ATTRS.items()})
        graph.value_info.pop(layer.outputs[0], None)
        layer.outputs = [pool.outputs[0]]
        layer.origin = layer.origin + pool.origin
        graph.nodes.remove(pool)
        consumers = graph.consumers()
        fused += 1
    return fused
