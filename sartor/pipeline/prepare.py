"""The engine's stored preprocessing (`PreprocessSpec`) applied with torch on the frames' device,
written straight into the engine's input buffer: one antialiased bilinear resize (Pillow's filter,
so the pixels equal `sartor.data.preprocess` on the CPU and lie within one level of it on the GPU),
the letterbox's pad, channel order, mean/std, layout and dtype.

On the CPU the resize reads and writes uint8 (torch's vectorised uint8 path) and nothing is
computed in float64; on CUDA it runs in float32 and is rounded to uint8 levels, as Pillow's is."""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from ..data.preprocess import ImageMeta, PreprocessSpec, placement
from ..errors import DataError
from ..ir.dtypes import NUMPY_TO_TORCH

def _resized(frames: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """N×3×H×W uint8 → N×3×h×w uint8 levels (float32 on CUDA, exact integers), bilinear with
    antialiasing when shrinking."""
    if tuple(frames.shape[-2:]) == tuple(size):
        return frames
    if frames.device.type == "cpu":
        return F.interpolate(frames.contiguous(memory_format=torch.channels_last), size=size, mode="bilinear",
                             antialias=True, align_corners=False)
    out = F.interpolate(frames.float(), size=size, mode="bilinear", antialias=True, align_corners=False)
    return out.round_().clamp_(0, 255)


def _normalized(levels: torch.Tensor, spec: PreprocessSpec, mean: torch.Tensor, std: torch.Tensor,
                identity: bool) -> torch.Tensor:
    """…×3×h×w pixel levels → the spec's values (float32, or uint8 levels for dtype=uint8)."""
    if spec.channels == "bgr":
        levels = levels.flip(-3)
    if identity:
        return levels
    x = levels.float() if levels.dtype != torch.float32 else levels
    out = (x - mean) / std  # the spec's (x - mean) / std in float32, as the CPU reference computes it
    return out.round_().clamp_(0, 255) if spec.dtype == "uint8" else out


def _normalize_into(out: torch.Tensor, levels: torch.Tensor, spec: PreprocessSpec, mean: torch.Tensor,
                    std: torch.Tensor, identity: bool) -> None:
    """The CPU's float32 case of `_normalized`, written into `out` (a view of the input buffer)
    without temporaries: one or two passes over it instead of four, the same float32 arithmetic."""
    if spec.channels == "bgr":
        levels = levels.flip(-3)
    if identity:
        out.copy_(levels)
    elif spec.mean == (0.0, 0.0, 0.0):  # x - 0 is x exactly: one pass
        torch.div(levels, std, out=out)
    else:
        torch.sub(levels, mean, out=out)
        out.div_(std)


@functools.lru_cache(maxsize=16)
def _constants(spec: PreprocessSpec, device: torch.device) -> tuple:
    """(identity, mean, std, the pad's values) of `spec` on `device`: made once, not copied to the
    device with every batch."""
    identity = spec.mean == (0.0, 0.0, 0.0) and spec.std == (1.0, 1.0, 1.0)
    mean = torch.tensor(spec.mean, dtype=torch.float32, device=device).view(3, 1, 1)
    std = torch.tensor(spec.std, dtype=torch.float32, device=device).view(3, 1, 1)
    pad_values = _normalized(torch.full((3, 1, 1), float(spec.pad_value), device=device), spec, mean, std, identity)
    return identity, mean, std, pad_values


def input_tensor(spec: PreprocessSpec, batch: int, device: torch.device) -> torch.Tensor:
    """A new tensor of the shape and dtype `spec` produces for `batch` images (resize modes only)."""
    shape = spec.input_shape(batch)
    if shape is None:
        raise DataError("preprocess 'none' keeps each image's size: there is no fixed input shape")
    return torch.empty(shape, dtype=NUMPY_TO_TORCH[spec.dtype], device=device)


def prepare_batch(frames: list[torch.Tensor], names: list[str], spec: PreprocessSpec,
                  out: torch.Tensor | None = None,
                  orig_sizes: list[tuple[int, int] | None] | None = None) -> tuple[torch.Tensor, list[ImageMeta]]:
    """3×H×W uint8 RGB frames → (the batch as `spec` says, one ImageMeta each). `out` (e.g. the
    engine's bound input buffer, `ExecutionContext.input_buffers`) receives it in place when given;
    it must have the spec's shape for len(frames) images, dtype and the frames' device. Frames of
    one size are resized and normalised together: a camera's batch is a few operations, not a few
    per frame. `orig_sizes` gives the (H, W) of frames decoded at a reduced scale (`DecodedFrame.
    orig_size`): the geometry and the metas follow the image's own size."""
    if not frames:
        raise DataError("prepare_batch got no frames")
    device = frames[0].device
    for frame, name in zip(frames, names):
        if frame.dim() != 3 or frame.shape[0] != 3 or frame.dtype != torch.uint8 or frame.device != device:
            raise DataError(f"{name}: frame of shape {tuple(frame.shape)} {frame.dtype} on {frame.device} is not "
                            f"3×H×W uint8 on {device}")
    sizes = [(int(f.shape[1]), int(f.shape[2])) for f in frames]
    originals = [o or size for o, size in zip(orig_sizes or [None] * len(frames), sizes)]
    if spec.resize == "none":
        if len(set(sizes)) > 1:
            raise DataError(f"frames of different sizes cannot share a batch with preprocess {spec.describe()!r} "
                            f"({', '.join(f'{n} {h}x{w}' for n, (h, w) in zip(names[:5], sizes))}): "
                            f"use letterbox= or resize=")
        h, w = sizes[0]
        shape = (len(frames), 3, h, w) if spec.layout == "nchw" else (len(frames), h, w, 3)
    else:
        shape = spec.input_shape(len(frames))
    target = out if out is not None else torch.empty(shape, dtype=NUMPY_TO_TORCH[spec.dtype], device=device)
    if tuple(target.shape) != tuple(shape) or target.dtype != NUMPY_TO_TORCH[spec.dtype] or target.device != device:
        raise DataError(f"preprocess output buffer is {tuple(target.shape)} {target.dtype} on {target.device}; "
                        f"{spec.describe()!r} makes {tuple(shape)} {NUMPY_TO_TORCH[spec.dtype]} on {device}")
    identity, mean, std, pad_values = _constants(spec, device)
    canvas = target if spec.layout == "nchw" else target.permute(0, 3, 1, 2)  # N×3×H×W view either way
    groups: dict[tuple, list[int]] = {}
    for i, key in enumerate(zip(sizes, originals)):
        groups.setdefault(key, []).append(i)
    metas: list[ImageMeta | None] = [None] * len(frames)
    for (_, (h, w)), members in groups.items():
        place = placement(h, w, spec)
        (new_h, new_w), (top, left), (out_h, out_w) = place.resized, place.pad, place.input_size
        rows = slice(members[0], members[-1] + 1) if members == list(range(members[0], members[-1] + 1)) \
            else torch.tensor(members, device=device)
        stacked = frames[members[0]][None] if len(members) == 1 else torch.stack([frames[i] for i in members])
        levels = _resized(stacked, (new_h, new_w))
        if (new_h, new_w) != (out_h, out_w):  # the letterbox's bands around the image
            canvas[rows, :, :top] = pad_values
            canvas[rows, :, top + new_h:] = pad_values
            canvas[rows, :, top:top + new_h, :left] = pad_values
            canvas[rows, :, top:top + new_h, left + new_w:] = pad_values
        at = (rows, slice(None), slice(top, top + new_h), slice(left, left + new_w))
        if device.type == "cpu" and spec.dtype == "float32" and isinstance(rows, slice):
            _normalize_into(canvas[at], levels, spec, mean, std, identity)
        else:
            canvas[at] = _normalized(levels, spec, mean, std, identity)
        for i in members:
            metas[i] = place.meta(names[i], (h, w))
    return target, metas
