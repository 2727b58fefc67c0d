"""`Preprocess`: the first layer of an engine that takes raw uint8 frames (`--input-format uint8`).
It applies the engine's stored `--preprocess` to N×H×W×3 frames and writes the model's input, so
decoding is all that stays outside the engine's CUDA graph. The torch ops are its reference
(`kernels/preprocess/torch_path.py`); on CUDA with Triton the fused kernel's tiles are its tactics."""
from __future__ import annotations

import functools

import torch

from ..data.preprocess import parse_preprocess, placement
from ..ir.dtypes import NUMPY_TO_TORCH
from ..kernels.preprocess.letterbox import (
    PREPROCESS_TILES,
    PreprocessTile,
    kernel_supports,
    letterbox_frames,
    preprocess_kernel_available,
)
from ..kernels.preprocess.torch_path import letterbox_torch
from ..kernels.registry import tactic_for
from .registry import OpTable

OPS = OpTable("preprocess")
_spec = functools.lru_cache(maxsize=16)(parse_preprocess)  # parsed once, not at every run


def preprocess_tactics(inputs: list, attrs: dict, effort: int = 2) -> list[str]:
    """"torch" (the reference) and, on CUDA with Triton, the fused kernel's tiles for a spec it computes."""
    if inputs[0].is_cuda and preprocess_kernel_available() and kernel_supports(_spec(attrs["spec"])):
        return ["torch", *(tile.name for tile in PREPROCESS_TILES)]
    return ["torch"]


@OPS.internal("Preprocess", tactics=preprocess_tactics)
def preprocess(inputs, attrs):
    """attrs: `spec` (the --preprocess text), `frame_order` (rgb | bgr), `tactic`."""
    frames = inputs[0]
    spec = _spec(attrs["spec"])
    n, h, w, _ = frames.shape
    place = placement(int(h), int(w), spec)
    out = torch.empty(spec.input_shape(int(n)), dtype=NUMPY_TO_TORCH[spec.dtype], device=frames.device)
    if frames.is_cuda and spec.layout == "nchw":
        # Written channels-last (the kernel stores through strides): the layers after it read that,
        # so the executor makes no copy of the image.
        out = out.contiguous(memory_format=torch.channels_last)
    tile = tactic_for(attrs.get("tactic"))
    if isinstance(tile, PreprocessTile) and preprocess_kernel_available() and kernel_supports(spec):
        return letterbox_frames(frames, "hwc", attrs["frame_order"], spec, place.resized, place.pad, out, tile)
    return letterbox_torch(frames, "hwc", attrs["frame_order"], spec, place.resized, place.pad, out)
