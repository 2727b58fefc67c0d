"""A convolution whose only reader is an unpadded 1×1 convolution of the same kind becomes one
ConvChain layer with it (`ops/conv_chain.py`): its output is then never stored.

Both layers are QConv (INT8, each writing codes) or both FusedConv of one float precision: in a
YOLO backbone each stride-2 3×3 and the 1×1 that opens the next C2f block; in its head the box
and class branches' last 3×3 and 1×1. Or the first is a QConv writing float and the second an
FP16/BF16 FusedConv (a mixed chain): an INT8 layer before a float output head, where the head's
last 1×1 stays float (docs/decisions/0045-int8-placement-rules.md). The first layer is dense (group 1), of at most
MAX_CHAIN_CHANNELS output channels, reading no graph input, with no residual, projection or
carried max pool; the second is a 1×1 at stride 1, unpadded, with neither either. FP8 layers, and
INT8 layers of different qmin, are left apart. Where a layer could be the second of one chain and
the first of the next (1×1 → 1×1 → 1×1), the first chain in graph order takes it.

The pass fires only where the builder asks: `builder/conv_chains.py` times each chain's kernel
against its two layers' winners and fuses the chains that were faster.
"""
from __future__ import annotations

from ..ir import Graph, Node
from ..ir.dtypes import PRECISION_DTYPES, TORCH_TO_NUMPY
from ..kernels.conv.chain import MAX_CHAIN_CHANNELS
from ..ops.conv_chain import CHAIN, OWN_RUN_ATTRS
from ..ops.fp8 import is_fp8
from ..ops.fused_pool import MAX_POOL_ATTRS
from ..ops.quantized import PROJECTION_FIRST_INPUT
from .base import single_consumer

CHAIN_LAYERS = ("QConv", "FusedConv")
MIXED_CHAIN = ("QConv", "FusedConv")  # an INT8 layer writing float, then the float layer reading it
FLOAT_CHAIN_PRECISIONS = ("fp16", "bf16")  # a float chain's, and a mixed chain's second layer
RESIDUAL_INPUT = 3


def _dense_weight(graph: Graph, node: Node):
    """The layer's weight, when it is a constant 4-D weight of a dense (group 1) convolution, else None."""
    weight = graph.constant(node.inputs[1]) if len(node.inputs) > 1 else None
    if weight is None or weight.ndim != 4 or node.attrs.get("group", 1) != 1:
        return None
    return weight


def _plain_layer(node: Node) -> bool:
    """No residual, projection or carried max pool; not FP8."""
    residual = len(node.inputs) > RESIDUAL_INPUT and node.inputs[RESIDUAL_INPUT]
    projection = len(node.inputs) > PROJECTION_FIRST_INPUT
    return not residual and not projection and not any(key in node.attrs for key in MAX_POOL_ATTRS) \
        and not is_fp8(node.attrs)


def _chain_reader(graph: Graph, node: Node) -> bool:
    """A 1×1 layer at stride 1, unpadded and undilated, that can close a chain."""
    weight = _dense_weight(graph, node)
    attrs = node.attrs
    return (node.op_type in CHAIN_LAYERS and weight is not None and tuple(weight.shape[2:]) == (1, 1)
            and _plain_layer(node) and list(attrs.get("strides") or [1, 1]) == [1, 1]
            and not any(attrs.get("pads") or [0, 0, 0, 0]) and list(attrs.get("dilations") or [1, 1]) == [1, 1])


def _chain_opener(graph: Graph, node: Node) -> bool:
    weight = _dense_weight(graph, node)
    return (weight is not None and weight.shape[0] <= MAX_CHAIN_CHANNELS and _plain_layer(node)
            and node.inputs[0] not in graph.input_names())


def _same_numbers(first: Node, second: Node, layer_precision: dict) -> bool:
    """INT8 layers that hand on codes with one qmin; float layers of one precision; or an INT8 layer
    that writes float to an FP16/BF16 layer (mixed)."""
    if (first.op_type, second.op_type) == MIXED_CHAIN:
        return (first.attrs.get("output_inv_scale") is None
                and layer_precision.get(second.name) in FLOAT_CHAIN_PRECISIONS)
    if first.op_type != second.op_type:
        return False
    if first.op_type == "QConv":
        return (first.attrs.get("output_inv_scale") is not None and second.attrs.get("output_inv_scale") is not None
                and first.attrs.get("qmin", -127) == second.attrs.get("qmin", -127))
    return layer_precision.get(first.name, "fp32") == layer_precision.get(second.name, "fp32") \
        and layer_precision.get(first.name) in FLOAT_CHAIN_PRECISIONS


def chain_pairs(graph: Graph, layer_precision: dict) -> list[tuple[Node, Node]]:
    """The (first, second) layers that can become chains (module docstring), no layer in two."""
    producers, consumers = graph.producers(), graph.consumers()
    pairs, taken = [], set()
    for first in graph.nodes:
        if first.op_type not in CHAIN_LAYERS or first.name in taken or not _chain_opener(graph, first):
            continue
        second = single_consumer(graph, first.outputs[0], consumers)
        if second is None or second.inputs[0] != first.outputs[0]:
            continue
        if producers.get(second.inputs[0]) is not first or not _chain_reader(graph, second):
            continue
        if not _same_numbers(first, second, layer_precision):
            continue
        pairs.append((first, second))
        taken.update((first.name, second.name))
    return pairs


def chain_name(first: Node, second: Node) -> str:
    return f"{first.name}+{second.name}"


def _own_attrs(node: Node) -> dict:
    return {key: value for key, value in node.attrs.items() if key not in OWN_RUN_ATTRS}


def fuse_conv_chain(graph: Graph, first: Node, second: Node, layer_precision: dict | None = None) -> Node:
    """Replace the two layers by their ConvChain, where the first stood; returns it. A mixed chain
    records its second layer's op and float (from `layer_precision`, which it then needs)."""
    attrs = {"layers": first.op_type, "first_inputs": len(first.inputs), "first": _own_attrs(first),
             "second": _own_attrs(second)}
    if first.op_type != second.op_type:
        precision = (layer_precision or {}).get(second.name)
        if precision not in FLOAT_CHAIN_PRECISIONS:
            raise ValueError(f"a mixed chain's float layer {second.name!r} runs FP16 or BF16, not {precision}")
        attrs.update(second_layers=second.op_type, second_dtype=TORCH_TO_NUMPY[PRECISION_DTYPES[precision]])
    chain = Node(CHAIN, chain_name(first, second), inputs=list(first.inputs) + list(second.inputs[1:]),
                 outputs=list(second.outputs), attrs=attrs, origin=first.origin + second.origin)
    graph.nodes[graph.nodes.index(first)] = chain
    graph.nodes.remove(second)
    graph.value_info.pop(first.outputs[0], None)
    return chain
