"""RowGather: the rows of a [..., C] tensor picked through a constant per-image table, made by
passes/gather_rows.py from a chain of data-movement ops that keeps the last axis (Swin's cyclic
shift and window partition, and their reverse) so that one copy replaces the chain's several.

Attributes: `rows_in`, the input's rows per image; `shape`, the output's shape for one image, its
axis `batch_axis` growing with the images. Input 1 is the table: int64, the output's rows per
image, each an input row of the same image.
"""
from __future__ import annotations

import torch

from ..errors import InputError
from .registry import OpTable

OPS = OpTable("rows")


def images_of(x: torch.Tensor, rows_in: int) -> int:
    """How many images of `rows_in` rows of x's last axis x holds."""
    rows = x.numel() // x.shape[-1] if x.dim() and x.shape[-1] else 0
    if rows_in <= 0 or rows % rows_in:
        raise InputError(f"RowGather: {rows} rows of {tuple(x.shape)} are not whole images of {rows_in} rows")
    return rows // rows_in


def output_shape(shape: list, batch_axis: int, images: int) -> list[int]:
    """The gathered output's shape for `images` images."""
    out = [int(d) for d in shape]
    out[batch_axis] *= images
    return out


def rows_through(x: torch.Tensor, table: torch.Tensor, rows_in: int) -> torch.Tensor:
    """x's rows through `table`, per image: [images · len(table), C]."""
    images = images_of(x, rows_in)
    picked = x.reshape(images, rows_in, x.shape[-1]).index_select(1, table.to(x.device, torch.int64))
    return picked.reshape(-1, x.shape[-1])


def gather_rows(x: torch.Tensor, table: torch.Tensor, rows_in: int, shape: list, batch_axis: int) -> torch.Tensor:
    """x's rows through `table`, per image, in the output shape."""
    return rows_through(x, table, rows_in).reshape(output_shape(shape, batch_axis, images_of(x, rows_in)))


@OPS.internal("RowGather")
def row_gather(inputs, attrs):
    x, table = inputs[:2]
    return gather_rows(x, table, attrs["rows_in"], attrs["shape"], attrs["batch_axis"])
