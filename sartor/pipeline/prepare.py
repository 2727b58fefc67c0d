"""The engine's stored preprocessing (`PreprocessSpec`) applied with torch on the frames' device,
written straight into the engine's input buffer: one antialiased bilinear resize (Pillow's filter,
so the pixels equal `sartor.data.preprocess` on the CPU and lie within one level of it on the GPU),
the letterbox's pad, channel order, mean/std, layout and dtype.

On the CPU the resize reads and writes uint8 (torch's vectorised uint8 path) and nothing is
computed in float64; on CUDA it runs in float32 and is rounded to uint8 levels, as Pillow's is."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..data.preprocess import ImageMeta, PreprocessSpec, placement
from ..errors import DataError

TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "uint8": torch.uint8}


def _resized(frame: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """3×H×W uint8 → 3×h×w uint8 levels (float32 on CUDA, exact integers), bilinear with
    antialiasing when shrinking."""
    if tuple(frame.shape[1:]) == tuple(size):
        return frame
    if frame.device.type == "cpu":
        return F.interpolate(frame[None].contiguous(memory_format=torch.channels_last), size=size,
                             mode="bilinear", antialias=True, align_corners=False)[0]
    out = F.interpolate(frame[None].float(), size=size, mode="bilinear", antialias=True, align_corners=False)[0]
    return out.round_().clamp_(0, 255)


def _normalized(levels: torch.Tensor, spec: PreprocessSpec, mean: torch.Tensor, std: torch.Tensor,
                identity: bool) -> torch.Tensor:
    """3×h×w pixel levels → the spec's values (float32, or uint8 levels for dtype=uint8)."""
    if spec.channels == "bgr":
        levels = levels.flip(0)
    if identity:
        return levels
    x = levels.float() if levels.dtype != torch.float32 else levels
    out = (x - mean) / std  # the spec's (x - mean) / std in float32, as the CPU reference computes it
    return out.round_().clamp_(0, 255) if spec.dtype == "uint8" else out


def input_tensor(spec: PreprocessSpec, batch: int, device: torch.device) -> torch.Tensor:
    """A new tensor of the shape and dtype `spec` produces for `batch` images (resize modes only)."""
    shape = spec.input_shape(batch)
    if shape is None:
        raise DataError("preprocess 'none' keeps each image's size: there is no fixed input shape")
    return torch.empty(shape, dtype=TORCH_DTYPES[spec.dtype], device=device)


def prepare_batch(frames: list[torch.Tensor], names: list[str], spec: PreprocessSpec,
                  out: torch.Tensor | None = None) -> tuple[torch.Tensor, list[ImageMeta]]:
    """3×H×W uint8 RGB frames → (the batch as `spec` says, one ImageMeta each). `out` (e.g. the
    engine's bound input buffer, `ExecutionContext.input_buffers`) receives it in place when given;
    it must have the spec's shape for len(frames) images, dtype and the frames' device."""
    if not frames:
        raise DataError("prepare_batch got no frames")
    device = frames[0].device
    if spec.resize == "none":
        sizes = {tuple(f.shape[1:]) for f in frames}
        if len(sizes) > 1:
            raise DataError(f"frames of different sizes cannot share a batch with preprocess {spec.describe()!r} "
                            f"({', '.join(f'{n} {f.shape[1]}x{f.shape[2]}' for n, f in zip(names, frames[:5]))}): "
                            f"use letterbox= or resize=")
        (h, w), = sizes
        shape = (len(frames), 3, h, w) if spec.layout == "nchw" else (len(frames), h, w, 3)
        target = out if out is not None else torch.empty(shape, dtype=TORCH_DTYPES[spec.dtype], device=device)
    else:
        target = out if out is not None else input_tensor(spec, len(frames), device)
        shape = spec.input_shape(len(frames))
    if tuple(target.shape) != tuple(shape) or target.dtype != TORCH_DTYPES[spec.dtype] or target.device != device:
        raise DataError(f"preprocess output buffer is {tuple(target.shape)} {target.dtype} on {target.device}; "
                        f"{spec.describe()!r} makes {tuple(shape)} {TORCH_DTYPES[spec.dtype]} on {device}")
    identity = spec.mean == (0.0, 0.0, 0.0) and spec.std == (1.0, 1.0, 1.0)
    mean = torch.tensor(spec.mean, dtype=torch.float32, device=device).view(3, 1, 1)
    std = torch.tensor(spec.std, dtype=torch.float32, device=device).view(3, 1, 1)
    pad_level = torch.full((3, 1, 1), float(spec.pad_value), device=device)
    pad_values = _normalized(pad_level, spec, mean, std, identity)
    metas = []
    for i, (frame, name) in enumerate(zip(frames, names)):
        if frame.dim() != 3 or frame.shape[0] != 3 or frame.dtype != torch.uint8:
            raise DataError(f"{name}: frame of shape {tuple(frame.shape)} {frame.dtype} is not 3×H×W uint8")
        place = placement(int(frame.shape[1]), int(frame.shape[2]), spec)
        (new_h, new_w), (top, left) = place.resized, place.pad
        canvas = target[i] if spec.layout == "nchw" else target[i].permute(2, 0, 1)  # 3×H×W view either way
        values = _normalized(_resized(frame, (new_h, new_w)), spec, mean, std, identity)
        if (new_h, new_w) != place.input_size:  # the letterbox's bands around the image
            out_h, out_w = place.input_size
            canvas[:, :top].copy_(pad_values.expand(3, top, out_w))
            canvas[:, top + new_h:].copy_(pad_values.expand(3, out_h - top - new_h, out_w))
            canvas[:, top:top + new_h, :left].copy_(pad_values.expand(3, new_h, left))
            canvas[:, top:top + new_h, left + new_w:].copy_(pad_values.expand(3, new_h, out_w - left - new_w))
        canvas[:, top:top + new_h, left:left + new_w].copy_(values)
        metas.append(place.meta(name, (int(frame.shape[1]), int(frame.shape[2]))))
    return target, metas
