"""The im2col tactic of few-channel INT8 (FP8) convolutions (a network's stem): the columns
[N·OH·OW, kh·kw·C] written once as codes (`sartor/kernels/conv/im2col.py`), then one implicit-GEMM
tile over them with the layer's epilogue; tactics "im2col_igemm." + the tile's fields.

A convolution reading few channels walks K in steps far narrower than the tensor cores' 32 bytes;
as explicit columns, K padded to a multiple of 32 and of the tile's BLOCK_K, the GEMM walks whole
K blocks with contiguous loads. Zero codes add nothing, so the output is the emulation's bit for
bit, as for the other tiles.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from ..kernels.conv.igemm import ConvGeometry, TileConfig, conv_igemm
from ..kernels.conv.im2col import im2col_codes
from ..kernels.registry import IM2COL_ROWS, Inline, LayerFacts, Tactic, register

IM2COL_MAX_CHANNELS = 16  # layers reading fewer channels are offered the tactic
IM2COL_K_MULTIPLE = 32  # bytes: the K step of 8-bit tensor-core products


@register
@dataclass(frozen=True)
class Im2colIgemm(Tactic):
    """Explicit im2col columns, then an implicit-GEMM tile over them: "im2col_igemm.128x128x64.w8.s3"."""
    tile: TileConfig

    FAMILY: ClassVar[str] = "im2col_igemm"
    SCHEME: ClassVar[tuple] = (Inline("tile", TileConfig),)
    WEIGHT_LAYOUT: ClassVar[str] = IM2COL_ROWS

    def describe(self, layer: LayerFacts) -> str:
        return f"{layer.codes} im2col + triton GEMM {self.tile.fields_text} + fused epilogue"


def im2col_weight(wq: torch.Tensor, tile: TileConfig) -> torch.Tensor:
    """[Cout, C, kh, kw] codes → [Cout, kh·kw·C] rows, K zero-padded to a multiple of 32 and of the
    tile's BLOCK_K: the GEMM kernel walks a K it can split into whole BLOCK_K blocks with contiguous
    loads, and any other K with a per-element gather (the stem's K = 147 padded to 160 had every
    tile of BLOCK_K 64 gathering)."""
    flat = wq.permute(0, 2, 3, 1).reshape(wq.shape[0], -1)
    multiple = math.lcm(IM2COL_K_MULTIPLE, tile.block_k)
    return _pad_columns(flat, -flat.shape[1] % multiple).contiguous()


def _pad_columns(t: torch.Tensor, extra: int) -> torch.Tensor:
    """Zero columns appended to a 2-D 8-bit tensor (INT8 or FP8: both encode zero as byte 0;
    padding goes through the bytes, which every torch release pads)."""
    return F.pad(t.view(torch.uint8), (0, extra)).view(t.dtype)


def im2col_conv(x: torch.Tensor, w_flat: torch.Tensor, bias: torch.Tensor | None, dequant_scale: torch.Tensor,
                geometry: ConvGeometry, tile: TileConfig, code: torch.dtype, epilogue: dict) -> torch.Tensor:
    """The columns of `x` at `geometry` as `code`s in one pass, then one GEMM with `epilogue`
    (conv_igemm's keyword arguments, input_inv_scale and qmin among them); channels-last output
    [N, Cout, OH, OW]."""
    columns = im2col_codes(x, geometry.kernel, geometry.strides, geometry.pads, geometry.dilations, geometry.out_hw,
                           w_flat.shape[1], code, epilogue["input_inv_scale"], epilogue["qmin"])
    y = conv_igemm(columns, w_flat, bias, ConvGeometry.gemm(), tile, dequant_scale=dequant_scale, **epilogue)
    n, (oh, ow) = x.shape[0], geometry.out_hw
    return y.view(n, oh, ow, -1).permute(0, 3, 1, 2)  # channels-last [N, Cout, OH, OW]
