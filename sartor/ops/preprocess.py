"""`Preprocess`: the first layer of an engine that takes raw uint8 frames (`--input-format uint8`).
It applies the engine's stored `--preprocess` to N×H×W×3 frames and writes the model's input, so
decoding is all that stays outside the engine's CUDA graph. The torch ops are its reference
(`kernels/preprocess/torch_path.py`); on CUDA with Triton the fused kernel's tiles are its tactics.

With `output_inv_scale` (set by passes/quantize_in_preprocess.py where INT8 layers alone read the
image) it writes the image's INT8 codes, as those layers would quantize it, and they read them as
they are: the float image is never written nor read."""
from __future__ import annotations

import functools

import torch

from ..data.preprocess import parse_preprocess, placement
from ..ir.dtypes import INT8_QMAX, NUMPY_TO_TORCH
from ..kernels.preprocess.letterbox import (
    PREPROCESS_TILES,
    InputCodes,
    PreprocessTile,
    kernel_supports,
    letterbox_frames,
    preprocess_kernel_available,
)
from ..kernels.preprocess.torch_path import letterbox_torch
from ..kernels.registry import tactic_for
from .quantized import quantize
from .registry import OpTable

OPS = OpTable("preprocess")
_spec = functools.lru_cache(maxsize=16)(parse_preprocess)  # parsed once, not at every run


def preprocess_tactics(inputs: list, attrs: dict, effort: int = 2) -> list[str]:
    """"torch" (the reference) and, on CUDA with Triton, the fused kernel's tiles for a spec it computes."""
    if inputs[0].is_cuda and preprocess_kernel_available() and kernel_supports(_spec(attrs["spec"])):
        return ["torch", *(tile.name for tile in PREPROCESS_TILES)]
    return ["torch"]


def input_codes(attrs: dict) -> InputCodes | None:
    """The input quantization of the INT8 layers reading the output, where the layer writes their
    codes (attributes `output_inv_scale`, `qmin`), else None."""
    if attrs.get("output_inv_scale") is None:
        return None
    return InputCodes(attrs["output_inv_scale"], attrs.get("qmin", -INT8_QMAX))


def _image_buffer(frames: torch.Tensor, spec, dtype: torch.dtype) -> torch.Tensor:
    """The N images' buffer. On CUDA an NCHW image is written channels-last (the kernel stores
    through strides): the layers after it read that, so the executor makes no copy of the image."""
    out = torch.empty(spec.input_shape(int(frames.shape[0])), dtype=dtype, device=frames.device)
    if frames.is_cuda and spec.layout == "nchw":
        out = out.contiguous(memory_format=torch.channels_last)
    return out


@OPS.internal("Preprocess", tactics=preprocess_tactics)
def preprocess(inputs, attrs):
    """attrs: `spec` (the --preprocess text), `frame_order` (rgb | bgr), `tactic`, and where it writes
    INT8 codes `output_scale`, `output_inv_scale`, `qmin`."""
    frames = inputs[0]
    spec = _spec(attrs["spec"])
    _, h, w, _ = frames.shape
    place = placement(int(h), int(w), spec)
    codes = input_codes(attrs)
    values = NUMPY_TO_TORCH[spec.dtype]
    tile = tactic_for(attrs.get("tactic"))
    if isinstance(tile, PreprocessTile) and preprocess_kernel_available() and kernel_supports(spec):
        out = _image_buffer(frames, spec, values if codes is None else torch.int8)
        return letterbox_frames(frames, "hwc", attrs["frame_order"], spec, place.resized, place.pad, out, tile, codes)
    out = letterbox_torch(frames, "hwc", attrs["frame_order"], spec, place.resized, place.pad,
                          _image_buffer(frames, spec, values))
    # The reference's codes are the reading layer's own quantization of the float image (as_int8).
    return out if codes is None else quantize(out, codes.inv_scale, codes.qmin)
