"""Convolution family: Conv, ConvTranspose and the fused convolution the passes produce."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..kernels.conv.igemm import (ConvGeometry, TileConfig, candidate_tiles, conv_igemm, multiprocessors, pack_weight,
                                  padded_tap_tiles, row_tap_tiles, single_pass_tiles, split_k_tiles)
from ..kernels.conv.depthwise import (TRITON_DEPTHWISE, DepthwiseTile, depthwise_conv_nhwc, depthwise_supported,
                                      depthwise_tile_for, depthwise_tiles, pack_depthwise_weight)
from ..kernels.pointwise.epilogue import ACTIVATION_CODES, epilogue_supported, fused_epilogue, pixel_stride, triton
from ..kernels.registry import (CHANNELS_LAST, DEPTHWISE_TAPS, PACKED_K_MAJOR, REFERENCE, fixed_tactic,
                                tactic_for)
from .elementwise import apply_activation
from .registry import OpTable
from ..ir.dtypes import FLOAT_DTYPES
from .util import device_table, only_dtypes, programmatic_launch

OPS = OpTable("conv")

CONV_ATTRS = {"auto_pad": "NOTSET", "dilations": None, "group": 1, "kernel_shape": None,
              "pads": None, "strides": None}


def resolve_padding(in_spatial: list[int], kernel: list[int], strides: list[int], dilations: list[int],
                    pads: list[int] | None, auto_pad: str) -> tuple[list[int], list[int]]:
    """ONNX padding rules → (begin pads, end pads) per spatial dim."""
    n = len(kernel)
    if auto_pad in ("SAME_UPPER", "SAME_LOWER"):
        begin, end = [], []
        for size, k, s, d in zip(in_spatial, kernel, strides, dilations):
            out = -(-size // s)
            total = max((out - 1) * s + (k - 1) * d + 1 - size, 0)
            small, large = total // 2, total - total // 2
            begin.append(small if auto_pad == "SAME_UPPER" else large)
            end.append(large if auto_pad == "SAME_UPPER" else small)
        return begin, end
    if auto_pad == "VALID" or pads is None:
        return [0] * n, [0] * n
    return list(pads[:n]), list(pads[n:])


def _conv_func(rank: int):
    return {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}[rank]


def conv_geometry(x: torch.Tensor, w: torch.Tensor, attrs: dict) -> tuple[list, list, list, list]:
    """(strides, dilations, begin pads, end pads) of a convolution of `x` by `w` under ONNX rules."""
    spatial = x.dim() - 2
    kernel = list(attrs.get("kernel_shape") or w.shape[2:])
    strides = list(attrs.get("strides") or [1] * spatial)
    dilations = list(attrs.get("dilations") or [1] * spatial)
    begin, end = resolve_padding(list(x.shape[2:]), kernel, strides, dilations, attrs.get("pads"),
                                 attrs.get("auto_pad", "NOTSET"))
    return strides, dilations, begin, end


def conv_nd(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, attrs: dict) -> torch.Tensor:
    spatial = x.dim() - 2
    strides, dilations, begin, end = conv_geometry(x, w, attrs)
    if begin == end:
        padding = begin
    else:
        pad_arg = []
        for lo, hi in zip(reversed(begin), reversed(end)):
            pad_arg += [lo, hi]
        x = F.pad(x, pad_arg)
        padding = [0] * spatial
    if b is not None and b.dtype != x.dtype:
        b = b.to(x.dtype)
    return _conv_func(spatial)(x, w.to(x.dtype), b, strides, padding, dilations, attrs.get("group", 1))


@OPS.op("Conv", attrs=CONV_ATTRS, check=only_dtypes(set(FLOAT_DTYPES), (0, 1)))
def conv(inputs, attrs):
    x, w = inputs[0], inputs[1]
    b = inputs[2] if len(inputs) > 2 else None
    return conv_nd(x, w, b, attrs)


def _symmetric_padding(x, w, attrs):
    strides, dilations, begin, end = conv_geometry(x, w, attrs)
    return (begin, strides, dilations) if begin == end else None


def cudnn_fused_applicable(x, w, residual, attrs) -> bool:
    """cuDNN's conv+bias(+add)+ReLU fusion: ReLU epilogue, residual (if any) added before it."""
    if not x.is_cuda or x.dim() != 4 or attrs.get("activation") != "Relu":
        return False
    if residual is not None and (attrs.get("residual_after_activation") or residual.shape[1] != w.shape[0]):
        return False
    return _symmetric_padding(x, w, attrs) is not None


def _conv_cudnn_fused(x, w, b, residual, attrs):
    padding, strides, dilations = _symmetric_padding(x, w, attrs)
    group = attrs.get("group", 1)
    b = b.to(x.dtype) if b is not None else None
    if residual is None:
        return torch.cudnn_convolution_relu(x, w, b, strides, padding, dilations, group)
    return torch.cudnn_convolution_add_relu(x, w, residual.to(x.dtype).contiguous(memory_format=torch.channels_last),
                                            1.0, b, strides, padding, dilations, group)


def _conv_triton_epilogue(x, w, b, residual, attrs, out: torch.Tensor | None = None):
    """cuDNN's convolution, then the Triton epilogue in place or into `out`; None where the
    epilogue does not apply."""
    y = conv_nd(x, w, None, attrs)
    if residual is not None:
        residual = residual.to(y.dtype)
    if not epilogue_supported(y, residual) or (out is not None and y.shape != out.shape):
        return None
    return fused_epilogue(y, None if b is None else b.to(y.dtype), residual, attrs.get("activation"),
                          attrs.get("activation_alpha"), attrs.get("activation_beta"),
                          attrs.get("residual_after_activation", False), out=out)


def _conv_channels_last(x, w, b, residual, attrs):
    """CPU candidate: the convolution in channels-last layout (oneDNN's preferred one), the epilogue
    in torch, the output back in the input's memory format."""
    nhwc = x.is_contiguous(memory_format=torch.channels_last) and not x.is_contiguous()
    y = conv_nd(x.contiguous(memory_format=torch.channels_last), conv_weight_for_tactic(w, CHANNELS_LAST_TACTIC), b,
                attrs)
    y = y.contiguous(memory_format=torch.channels_last if nhwc else torch.contiguous_format)
    return _torch_epilogue(y, residual, attrs)


def _geometry_2d(x: torch.Tensor, w: torch.Tensor, attrs: dict) -> ConvGeometry:
    strides, dilations, begin, end = conv_geometry(x, w, attrs)
    kernel = w.shape[2:]
    out_hw = tuple((size + lo + hi - d * (k - 1) - 1) // s + 1
                   for size, lo, hi, d, k, s in zip(x.shape[2:], begin, end, dilations, kernel, strides))
    return ConvGeometry(tuple(kernel), tuple(strides), tuple(begin), tuple(dilations), out_hw)


def igemm_geometry(x: torch.Tensor, w: torch.Tensor, attrs: dict, require_cuda: bool = True) -> ConvGeometry | None:
    """The geometry the implicit-GEMM kernel needs, or None when it does not apply: it runs dense
    (group 1) 2-D convolutions of CUDA tensors (of any tensors under Triton's interpreter, for
    tests, with `require_cuda=False`)."""
    if triton is None or (require_cuda and not x.is_cuda) or x.dim() != 4 or attrs.get("group", 1) != 1:
        return None
    return _geometry_2d(x, w, attrs)


def depthwise_geometry(x: torch.Tensor, w: torch.Tensor, attrs: dict, require_cuda: bool = True,
                       supported=depthwise_supported) -> ConvGeometry | None:
    """The geometry the depthwise kernel needs, or None when it does not apply: 2-D convolutions
    with group = C = Cout (channel multiplier 1) of float channels-last CUDA tensors (any tensors
    under Triton's interpreter, with `require_cuda=False`; INT8 layers pass their own `supported`)
    and an epilogue the kernel knows."""
    if (require_cuda and not x.is_cuda) or not supported(x, w) or attrs.get("group", 1) != x.shape[1]:
        return None
    if attrs.get("activation") not in ACTIVATION_CODES:
        return None
    geometry = _geometry_2d(x, w, attrs)
    return geometry if min(geometry.out_hw) > 0 else None


def igemm_epilogue(attrs: dict) -> dict:
    """A fused layer's epilogue attributes as conv_igemm's keyword arguments."""
    return {"activation": attrs.get("activation"), "alpha": attrs.get("activation_alpha"),
            "beta": attrs.get("activation_beta"),
            "residual_after_activation": attrs.get("residual_after_activation", False)}


def _conv_igemm(x, w, b, residual, attrs, tile: TileConfig, out: torch.Tensor | None = None):
    """The Triton implicit-GEMM kernel with the whole epilogue (w packed by `pack_weight`), its
    result new or in `out`; None where the kernel does not apply."""
    geometry = igemm_geometry(x, w, attrs)
    if geometry is None:
        return None
    return conv_igemm(x, w, b, geometry, tile, residual=residual, out=out, pdl=programmatic_launch(x, attrs),
                      **igemm_epilogue(attrs))


def _conv_depthwise(x, w, b, residual, attrs, out: torch.Tensor | None = None, require_cuda: bool = True,
                    tile: DepthwiseTile | None = None):
    """The Triton depthwise kernel with the whole epilogue (in `tile`'s blocks, else TRITON_DEPTHWISE's),
    its result new or in `out`; None where the kernel does not apply (then the layer runs as "torch" does)."""
    geometry = depthwise_geometry(x, w, attrs, require_cuda)
    if geometry is None:
        return None
    if residual is not None and tuple(residual.shape) != (x.shape[0], x.shape[1], *geometry.out_hw):
        return None  # a broadcast residual: torch's epilogue handles it
    return depthwise_conv_nhwc(x, w, b, geometry, residual=residual, out=out, pdl=programmatic_launch(x, attrs),
                               tile=tile, **igemm_epilogue(attrs))


def _float_depthwise_tile(tactic: str | None) -> DepthwiseTile | None:
    """The blocks a FusedConv's tactic runs the float depthwise kernel in; None for another kernel and for
    a words tile (INT8 codes, which a float layer has not)."""
    tile = depthwise_tile_for(tactic)
    return tile if tile is not None and not tile.words else None


def conv_weight_for_tactic(w: torch.Tensor, tactic: str | None) -> torch.Tensor:
    """A FusedConv weight in the layout its tactic reads (the executor stores it so once, at load)."""
    layout = tactic_for(tactic).weight_layout
    if layout == CHANNELS_LAST and w.dim() == 4:
        return w.contiguous(memory_format=torch.channels_last)
    if layout == PACKED_K_MAJOR:
        return pack_weight(w)
    if layout == DEPTHWISE_TAPS and w.dim() == 4 and w.shape[1] == 1:
        return pack_depthwise_weight(w)
    return w


def fused_conv_into(inputs, attrs, out: torch.Tensor) -> torch.Tensor | None:
    """FusedConv written straight into `out` (a channel slice of a Concat's buffer) by the tactics
    whose last kernel can store there: the implicit GEMM, the depthwise kernel and the Triton
    epilogue. None for the others: the layer then runs as usual and the Concat copies its result."""
    x, w = inputs[0], inputs[1]
    b = inputs[2] if len(inputs) > 2 else None
    residual = inputs[3] if len(inputs) > 3 else None
    tactic = attrs.get("tactic", REFERENCE)
    if out.dtype != x.dtype or pixel_stride(out) is None:
        return None
    tile = tactic_for(tactic)
    if isinstance(tile, TileConfig):
        return _conv_igemm(x, w, b, residual, attrs, tile, out=out)
    depthwise_tile = _float_depthwise_tile(tactic)
    if depthwise_tile is not None:
        return _conv_depthwise(x, w, b, residual, attrs, out=out, tile=depthwise_tile)
    if tactic == TRITON_EPILOGUE and x.is_cuda:
        return _conv_triton_epilogue(x, w, b, residual, attrs, out=out)
    return None


# Implementations of one fused conv that the builder times against each other (tactics): on CUDA
# the library ones, the implicit-GEMM tiles ("igemm.…") and, for depthwise convs, the Triton
# depthwise kernel in its blocks ("depthwise.…"); on the CPU "torch" and "channels_last". "torch" is the reference.
TRITON_EPILOGUE = "triton_epilogue"
CUDNN_FUSED = "cudnn_fused"
CHANNELS_LAST_TACTIC = "channels_last"
fixed_tactic(TRITON_EPILOGUE, lambda layer: f"torch.conv ({layer.library}) + triton epilogue")
fixed_tactic(CUDNN_FUSED, "cudnn conv+bias(+add)+relu fused")
fixed_tactic(CHANNELS_LAST_TACTIC, lambda layer: f"torch.conv channels-last ({layer.library}) + torch epilogue",
             weight_layout=CHANNELS_LAST)
FUSED_CONV_TACTICS = (REFERENCE, TRITON_EPILOGUE, CUDNN_FUSED, CHANNELS_LAST_TACTIC, "igemm.*", TRITON_DEPTHWISE,
                      "depthwise.*")


def igemm_variant_tiles(tiles: list[TileConfig], x: torch.Tensor, w: torch.Tensor,
                        geometry: ConvGeometry) -> list[TileConfig]:
    """The variants of `tiles` worth timing for this convolution (or GEMM, a 2-D `x`) on its GPU:
    split-K where the tile grid leaves SMs idle, one pipeline stage where K is one block, a tap by
    tap walk where the channel count is no multiple of the K block, a filter row a step where the
    channels are few."""
    rows = x.shape[0] * geometry.out_hw[0] * geometry.out_hw[1]
    k_total = w.shape[1] * geometry.kernel[0] * geometry.kernel[1]
    return (split_k_tiles(tiles, rows, w.shape[0], k_total, multiprocessors(x.device))
            + single_pass_tiles(tiles, k_total)
            + padded_tap_tiles(tiles, w.shape[1], w.shape[0], eight_bit=w.element_size() == 1)
            + row_tap_tiles(tiles, w.shape[1], geometry.kernel, w.shape[0], eight_bit=w.element_size() == 1))


def applicable_conv_tactics(inputs, attrs, effort: int = 2) -> list[str]:
    """The candidates for one FusedConv with these arguments, the reference ("torch") first."""
    x, w = inputs[0], inputs[1]
    residual = inputs[3] if len(inputs) > 3 else None
    tactics = [REFERENCE]
    if not x.is_cuda:
        if x.dim() == 4:
            tactics.append(CHANNELS_LAST_TACTIC)
        return tactics
    # Channel slices of a channels-last buffer (Split outputs, a Concat's inputs written in place)
    # qualify too: the Triton kernels read any pixel stride, cuDNN copies them first.
    if x.dim() == 4 and pixel_stride(x) is not None:
        if triton is not None:
            tactics.append(TRITON_EPILOGUE)
        if cudnn_fused_applicable(x, w, residual, attrs):
            tactics.append(CUDNN_FUSED)
        geometry = igemm_geometry(x, w, attrs) if x.dtype in (torch.float16, torch.bfloat16) else None
        if geometry is not None:
            tiles = candidate_tiles(int8=False, effort=effort)
            tactics += [tile.name for tile in tiles + igemm_variant_tiles(tiles, x, w, geometry)]
        if depthwise_geometry(x, w, attrs) is not None:
            tactics += [TRITON_DEPTHWISE] + [tile.name for tile in depthwise_tiles(effort)]
    return tactics


@OPS.internal("FusedConv", tactics=applicable_conv_tactics, weight_for_tactic=conv_weight_for_tactic,
              write_into=fused_conv_into)
def fused_conv(inputs, attrs):
    """Conv (+bias) (+residual) (+activation); the residual adds before or after the activation."""
    x, w = inputs[0], inputs[1]
    b = inputs[2] if len(inputs) > 2 else None
    residual = inputs[3] if len(inputs) > 3 else None
    tactic = attrs.get("tactic", REFERENCE)
    if tactic == CUDNN_FUSED and cudnn_fused_applicable(x, w, residual, attrs):
        return _conv_cudnn_fused(x, w, b, residual, attrs)
    if tactic == TRITON_EPILOGUE and x.is_cuda:
        y = _conv_triton_epilogue(x, w, b, residual, attrs)
        if y is not None:
            return y
    if tactic == CHANNELS_LAST_TACTIC and not x.is_cuda and x.dim() == 4:
        return _conv_channels_last(x, w, b, residual, attrs)
    depthwise_tile = _float_depthwise_tile(tactic)
    if depthwise_tile is not None:
        y = _conv_depthwise(x, w, b, residual, attrs, tile=depthwise_tile)
        if y is not None:
            return y
    tile = tactic_for(tactic)
    if isinstance(tile, TileConfig):
        y = _conv_igemm(x, w, b, residual, attrs, tile)
        if y is not None:
            return y
    return _torch_epilogue(conv_nd(x, w, b, attrs), residual, attrs)


def _torch_epilogue(y, residual, attrs):
    """(+ residual) (+ activation) (+ residual), as a FusedConv's attributes say, in torch."""
    activation = attrs.get("activation")
    if residual is not None and not attrs.get("residual_after_activation", False):
        y = y + residual.to(y.dtype)
    if activation:
        y = apply_activation(y, activation, attrs.get("activation_alpha"), attrs.get("activation_beta"))
    if residual is not None and attrs.get("residual_after_activation", False):
        y = y + residual.to(y.dtype)
    return y


CONV_TRANSPOSE_ATTRS = dict(CONV_ATTRS, output_padding=None, output_shape=None)


@OPS.op("ConvTranspose", attrs=CONV_TRANSPOSE_ATTRS, check=only_dtypes(set(FLOAT_DTYPES), (0, 1)))
def conv_transpose(inputs, attrs):
    x, w = inputs[0], inputs[1]
    b = inputs[2] if len(inputs) > 2 else None
    spatial = x.dim() - 2
    kernel = list(attrs.get("kernel_shape") or w.shape[2:])
    strides = list(attrs.get("strides") or [1] * spatial)
    dilations = list(attrs.get("dilations") or [1] * spatial)
    out_pad = list(attrs.get("output_padding") or [0] * spatial)
    in_sizes = list(x.shape[2:])
    full = [(i - 1) * s + op + (k - 1) * d + 1 for i, s, op, k, d in zip(in_sizes, strides, out_pad, kernel, dilations)]
    if attrs.get("output_shape"):
        target = list(attrs["output_shape"])[-spatial:]
        # A negative total (output_shape beyond the full result) extends the output at the end.
        total = [f - t for f, t in zip(full, target)]
        if attrs.get("auto_pad") == "SAME_LOWER":
            begin = [t - int(t / 2) for t in total]
        else:
            begin = [int(t / 2) for t in total]
        end = [t - bg for t, bg in zip(total, begin)]
    elif attrs.get("auto_pad") in ("SAME_UPPER", "SAME_LOWER"):
        target = [i * s for i, s in zip(in_sizes, strides)]
        total = [f - t for f, t in zip(full, target)]
        if attrs["auto_pad"] == "SAME_UPPER":
            begin = [t // 2 for t in total]
        else:
            begin = [t - t // 2 for t in total]
        end = [t - bg for t, bg in zip(total, begin)]
    elif attrs.get("pads") and attrs.get("auto_pad", "NOTSET") == "NOTSET":
        begin, end = list(attrs["pads"][:spatial]), list(attrs["pads"][spatial:])
    else:
        begin, end = [0] * spatial, [0] * spatial
    fn = {1: F.conv_transpose1d, 2: F.conv_transpose2d, 3: F.conv_transpose3d}[spatial]
    if min(begin + end) >= 0:
        y = fn(x, w.to(x.dtype), None if b is None else b.to(x.dtype), strides, 0, out_pad, attrs.get("group", 1),
               dilations)
        # Crop the padding afterwards: handles asymmetric pads and output_padding in one place.
        index = [slice(None), slice(None)]
        for size, lo, hi in zip(y.shape[2:], begin, end):
            index.append(slice(lo, size - hi))
        return y[tuple(index)]
    # Negative padding grows the output: zeros beyond the full result, then the bias everywhere.
    y = fn(x, w.to(x.dtype), None, strides, 0, out_pad, attrs.get("group", 1), dilations)
    pad_arg = []
    for lo, hi in zip(reversed(begin), reversed(end)):
        pad_arg += [-lo, -hi]
    y = F.pad(y, pad_arg)
    return y if b is None else y + b.to(y.dtype).reshape((1, -1) + (1,) * spatial)


@OPS.op("Col2Im", attrs={"dilations": None, "pads": None, "strides": None}, host_inputs=(1, 2))
def col2im(inputs, attrs):
    """Sum sliding blocks [N, C * prod(block), L] back into images [N, C, *image_shape], any rank."""
    x = inputs[0]
    image = [int(v) for v in inputs[1].reshape(-1).tolist()]
    block = [int(v) for v in inputs[2].reshape(-1).tolist()]
    n_dims = len(image)
    dilations = list(attrs["dilations"] or [1] * n_dims)
    strides = list(attrs["strides"] or [1] * n_dims)
    pads = list(attrs["pads"] or [0] * (2 * n_dims))
    counts = [(size + pads[i] + pads[i + n_dims] - d * (k - 1) - 1) // s + 1
              for i, (size, k, d, s) in enumerate(zip(image, block, dilations, strides))]
    n, c = x.shape[0], x.shape[1] // math.prod(block)
    cols = x.reshape(n, c, math.prod(block) * math.prod(counts))

    def scatter_table() -> torch.Tensor:
        """(target pixel, source column) of every kept tap, as one [2, K] table."""
        # Per dim: image coordinate of (kernel offset, block position), broadcast over all dims.
        kernel_grid = torch.meshgrid(*[torch.arange(k) for k in block], indexing="ij")
        block_grid = torch.meshgrid(*[torch.arange(c) for c in counts], indexing="ij")
        flat = torch.zeros(math.prod(block), math.prod(counts), dtype=torch.int64)
        valid = torch.ones_like(flat, dtype=torch.bool)
        for i in range(n_dims):
            coord = (block_grid[i].reshape(1, -1) * strides[i] - pads[i]
                     + kernel_grid[i].reshape(-1, 1) * dilations[i])
            valid &= (coord >= 0) & (coord < image[i])
            flat = flat * image[i] + coord
        keep = valid.reshape(-1)
        return torch.stack([flat.reshape(-1)[keep], torch.nonzero(keep).reshape(-1)])

    table = device_table(("Col2Im", tuple(image), tuple(block), tuple(dilations), tuple(strides), tuple(pads)),
                         scatter_table, x.device)
    out = torch.zeros(n, c, math.prod(image), dtype=x.dtype, device=x.device)
    out.index_add_(2, table[0], cols.index_select(2, table[1]))
    return out.reshape([n, c] + image)
