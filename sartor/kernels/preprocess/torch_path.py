"""The preprocessing in torch ops, where the Triton kernel (letterbox.py) does not run: on the CPU
and without Triton. Same arguments as `letterbox_frames`: one antialiased bilinear resize, the
letterbox's pad, channel order, mean/std, layout and dtype, written into `out`.

On the CPU the resize reads and writes uint8 (torch's vectorised uint8 path, within two levels of
Pillow) and nothing is computed in float64; on CUDA it runs in float32 and is rounded to uint8
levels, as Pillow's is (within one level)."""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from ...data.preprocess import PreprocessSpec


def resized_levels(frames: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
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
    """…×3×h×w pixel levels in the spec's channel order → the spec's values (float32, or uint8
    levels for dtype=uint8)."""
    if identity:
        return levels
    x = levels.float() if levels.dtype != torch.float32 else levels
    out = (x - mean) / std  # the spec's (x - mean) / std in float32, as the CPU reference computes it
    return out.round_().clamp_(0, 255) if spec.dtype == "uint8" else out


def _normalize_into(out: torch.Tensor, levels: torch.Tensor, spec: PreprocessSpec, mean: torch.Tensor,
                    std: torch.Tensor) -> None:
    """`_normalized` for float32 output, written into `out` (a view of the input buffer) without
    temporaries: one or two passes over it instead of four, the same float32 arithmetic."""
    if spec.mean == (0.0, 0.0, 0.0):  # x - 0 is x exactly: one pass
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


def letterbox_torch(frames: torch.Tensor, frame_layout: str, frame_order: str, spec: PreprocessSpec,
                    resized: tuple[int, int], pad: tuple[int, int], out: torch.Tensor) -> torch.Tensor:
    """`letterbox_frames` (letterbox.py) in torch ops: a few launches where the kernel is one."""
    chw = frames if frame_layout == "chw" else frames.permute(0, 3, 1, 2)
    canvas = out if spec.layout == "nchw" else out.permute(0, 3, 1, 2)  # N×3×H×W view either way
    (new_h, new_w), (top, left) = resized, pad
    identity, mean, std, pad_values = _constants(spec, frames.device)
    levels = resized_levels(chw, (new_h, new_w))
    if frame_order != spec.channels:
        levels = levels.flip(-3)
    if (new_h, new_w) != tuple(canvas.shape[-2:]):  # the letterbox's bands around the image
        canvas[:, :, :top] = pad_values
        canvas[:, :, top + new_h:] = pad_values
        canvas[:, :, top:top + new_h, :left] = pad_values
        canvas[:, :, top:top + new_h, left + new_w:] = pad_values
    inside = canvas[:, :, top:top + new_h, left:left + new_w]
    if frames.device.type == "cpu" and spec.dtype == "float32" and not identity:
        _normalize_into(inside, levels, spec, mean, std)
    else:
        inside.copy_(_normalized(levels, spec, mean, std, identity))
    return out
