"""ConvChain: a convolution and the unpadded 1×1 convolution that alone reads it, as one layer.

Made by the builder from two QConv layers (INT8), two FusedConv layers (FP16/BF16), or a QConv writing
float and the FP16/BF16 FusedConv reading it (a mixed chain), where one kernel for both was timed faster
than the two layers' own winners (`builder/conv_chains.py`, `passes/fuse_conv_chain.py`). Its inputs are
the first layer's, then the second's after its data input; its attributes name the layers' op
("layers"; a mixed chain's second in "second_layers", with the float it computes in, "second_dtype"), how
many inputs are the first's ("first_inputs") and each layer's own attributes ("first", "second"). A
mixed chain's second layer's constants are stored in that float, its first layer's as they are
(`chain_constant_dtype`): the layer precision of a chain is its first layer's.

The reference runs the two layers one after the other, each by its reference (a mixed chain's
intermediate rounded to the float its second layer reads), so a chain computes what the two layers
computed. The kernel (`kernels/conv/chain.py`) gives the same numbers: INT8 bit
for bit, floats up to the order of their float32 sums.
"""
from __future__ import annotations

import torch

from ..kernels.conv.chain import (CHAIN_FLOAT_DTYPES, ChainLayer, ChainTile, chain_applies, chain_tiles,
                                  conv_chain)
from ..kernels.conv.igemm import pack_weight
from ..kernels.pointwise.epilogue import pixel_stride
from ..kernels.registry import REFERENCE, tactic_for
from .conv import fused_conv, igemm_geometry
from .quantized import ACCUMULATOR_BOUND, qconv, qlayer_output_dtype
from .registry import NUMPY_TO_TORCH, OpTable
from .util import programmatic_launch

OPS = OpTable("conv_chain")
CHAIN = "ConvChain"
LAYER_IMPLS = {"QConv": qconv, "FusedConv": fused_conv}
# Per-layer attributes of a chain's layers that belong to how the layer ran on its own (the chain has its
# own tactic and its own programmatic-launch mark).
OWN_RUN_ATTRS = ("tactic", "tactic_by_profile", "pdl")


def chain_layers(attrs: dict) -> tuple[str, str]:
    """The first and the second layer's op types."""
    return attrs["layers"], attrs.get("second_layers", attrs["layers"])


def chain_constant_dtype(position: int, attrs: dict, compute_dtype: torch.dtype | None) -> torch.dtype | None:
    """The float dtype a chain's constant input is stored in (OpDef.constant_dtype): the chain's compute
    dtype, but in a mixed chain the second layer's float for its weight and bias, and the INT8 layer's
    own dtypes (int8 weight, int32 bias, float32 scale) for its constants."""
    if "second_dtype" not in attrs:
        return compute_dtype
    return NUMPY_TO_TORCH[attrs["second_dtype"]] if position >= attrs["first_inputs"] else None


def chain_parts(inputs: list, attrs: dict) -> tuple[list, list, dict, dict]:
    """(first layer's inputs, second layer's inputs after its data input, first's and second's attributes)."""
    split = attrs["first_inputs"]
    return list(inputs[:split]), list(inputs[split:]), dict(attrs["first"]), dict(attrs["second"])


def _input(values: list, index: int) -> torch.Tensor | None:
    return values[index] if len(values) > index else None


def _chain_layer(values: list, attrs: dict, quantized: bool) -> ChainLayer:
    """A layer's bias, scale and epilogue from its inputs (QConv: x, w, bias, residual, scale;
    FusedConv: x, w, bias) and attributes."""
    common = dict(activation=attrs.get("activation"), alpha=attrs.get("activation_alpha"),
                  beta=attrs.get("activation_beta"))
    if not quantized:
        return ChainLayer(_input(values, 2), None, **common)
    return ChainLayer(_input(values, 2), values[4], **common, input_inv_scale=attrs.get("input_inv_scale"),
                      output_inv_scale=attrs.get("output_inv_scale"), accumulator_bound=attrs.get(ACCUMULATOR_BOUND))


def _chain_kernel(inputs: list, attrs: dict, out: torch.Tensor | None = None) -> torch.Tensor | None:
    """The chain by the kernel where its tactic is a chain tile, or None: for the reference, and where
    the kernel does not apply to these tensors (or `out`, where given, is not of the dtype the chain
    writes). The first weight comes as stored for the tile (`chain_weight_for_tactic`)."""
    tile = tactic_for(attrs.get("tactic"))
    if not isinstance(tile, ChainTile):
        return None
    first_inputs, second_rest, first, second = chain_parts(inputs, attrs)
    first_op, second_op = chain_layers(attrs)
    quantized, second_quantized = first_op == "QConv", second_op == "QConv"
    x, w1, w2 = first_inputs[0], first_inputs[1], second_rest[0]
    geometry = igemm_geometry(x, w1, first, require_cuda=False)
    if not chain_applies(x, w1, w2, geometry):
        return None
    second_values = [None, *second_rest]
    if second_quantized:
        out_dtype = qlayer_output_dtype(second)
    elif quantized and w2.dtype in CHAIN_FLOAT_DTYPES:  # mixed: the second layer's float
        out_dtype = w2.dtype
    elif not quantized and x.dtype in CHAIN_FLOAT_DTYPES and w2.dtype == x.dtype:
        out_dtype = x.dtype
    else:
        return None
    if out is not None and out.dtype != out_dtype:
        return None
    return conv_chain(x, w1, w2.contiguous(), geometry, _chain_layer(first_inputs, first, quantized),
                      _chain_layer(second_values, second, second_quantized), tile, qmin=first.get("qmin", -127),
                      out_dtype=out_dtype, out=out, pdl=programmatic_launch(x, attrs))


def chain_tactics(inputs, attrs, effort: int = 2) -> list[str]:
    """The reference (the two layers in turn) and, on CUDA where the kernel applies, its tiles."""
    names = [REFERENCE]
    first_inputs, second_rest, first, _ = chain_parts(inputs, attrs)
    x, w1, w2 = first_inputs[0], first_inputs[1], second_rest[0]
    first_op, second_op = chain_layers(attrs)
    float_chain = first_op == "FusedConv"
    if not x.is_cuda or (float_chain and x.dtype not in CHAIN_FLOAT_DTYPES):
        return names
    if second_op == "FusedConv" and w2.dtype not in CHAIN_FLOAT_DTYPES:
        return names
    if chain_applies(x, w1, w2, igemm_geometry(x, w1, first)):
        names += [tile.name for tile in chain_tiles(effort, w2.shape[0], w1.shape[1], tuple(w1.shape[2:]),
                                                    eight_bit=not float_chain)]
    return names


def chain_weight_for_tactic(w: torch.Tensor, tactic: str | None) -> torch.Tensor:
    """The first layer's weight as the kernel reads it (packed K-major), as built for the reference."""
    return pack_weight(w) if isinstance(tactic_for(tactic), ChainTile) and w.dim() == 4 else w


def conv_chain_into(inputs, attrs, out: torch.Tensor) -> torch.Tensor | None:
    """The chain written straight into `out` (a channel slice of a Concat's buffer, e.g. a C2f's cv1
    output under its Split) by the kernel, which stores any pixel stride, as its second layer alone
    would have been. None for the reference and where the kernel does not apply: the layer then runs
    as usual and the Concat copies its result (a copy kernel the two layers did not need)."""
    return None if pixel_stride(out) is None else _chain_kernel(inputs, attrs, out)


@OPS.internal(CHAIN, tactics=chain_tactics, weight_for_tactic=chain_weight_for_tactic, write_into=conv_chain_into,
              constant_dtype=chain_constant_dtype)
def conv_chain_layer(inputs, attrs):
    """The two layers (module docstring): by the kernel where the tactic is a chain tile and it
    applies, else one after the other by their references."""
    y = _chain_kernel(inputs, attrs)
    if y is not None:
        return y
    first_inputs, second_rest, first, second = chain_parts(inputs, attrs)
    first_op, second_op = chain_layers(attrs)
    middle = LAYER_IMPLS[first_op](first_inputs, dict(first, tactic=REFERENCE))
    if first_op != second_op:  # mixed: the INT8 layer's float output as its float reader takes it
        middle = middle.to(second_rest[0].dtype)
    return LAYER_IMPLS[second_op]([middle, *second_rest], dict(second, tactic=REFERENCE))
