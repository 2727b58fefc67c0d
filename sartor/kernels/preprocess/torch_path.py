"""The preprocessing in torch ops, where the Triton kernel (letterbox.py) does not run: on the CPU
and without Triton. Same arguments as `letterbox_frames`: one antialiased bilinear resize, the
letterbox's pad, channel order, mean/std, layout and dtype, written into `out`.

On the CPU the resize reads and writes uint8 (torch's vectorised uint8 path, within two levels of
Pillow) and nothing is computed in float64; on CUDA it runs in float32 and is rounded to uint8
levels, as Pillow's is (within one level). With `resampler=cv2` the CPU calls cv2.resize itself
(the reference's pixels exactly), CUDA torch's bilinear without antialiasing, the same half-pixel
sampling as INTER_LINEAR in float32 (within one level of OpenCV's 11-bit fixed point)."""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from ...data.preprocess import PreprocessSpec, resize_pixels


def resized_levels(frames: torch.Tensor, size: tuple[int, int], resampler: str = "pillow") -> torch.Tensor:
    """N×3×H×W uint8 → N×3×h×w uint8 levels (float32 on CUDA, exact integers), bilinear with
    antialiasing when shrinking (Pillow's), or without (`resampler` "cv2", OpenCV's INTER_LINEAR)."""
    if tuple(frames.shape[-2:]) == tuple(size):
        return frames
    if resampler == "cv2":
        if frames.device.type == "cpu":
            h, w = size
            return torch.stack([torch.from_numpy(resize_pixels(f.permute(1, 2, 0).numpy(), w, h, "cv2")).permute(2, 0, 1)
                                for f in frames])
        return float_levels(frames, size, antialias=False)
    if frames.device.type == "cpu":
        return F.interpolate(frames.contiguous(memory_format=torch.channels_last), size=size, mode="bilinear",
                             antialias=True, align_corners=False)
    return float_levels(frames, size, antialias=True)


def float_levels(frames: torch.Tensor, size: tuple[int, int], antialias: bool) -> torch.Tensor:
    """The CUDA resize: bilinear in float32, rounded to uint8 levels (kept float32)."""
    out = F.interpolate(frames.float(), size=size, mode="bilinear", antialias=antialias, align_corners=False)
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
    """`letterbox_frames` (letterbox.py) in torch ops: a few launches where the kernel is one. A
    negative `pad` is a centre crop: the resized image's rows and columns before it are dropped."""
    chw = frames if frame_layout == "chw" else frames.permute(0, 3, 1, 2)
    canvas = out if spec.layout == "nchw" else out.permute(0, 3, 1, 2)  # N×3×H×W view either way
    (new_h, new_w), (top, left) = resized, pad
    identity, mean, std, pad_values = _constants(spec, frames.device)
    levels = resized_levels(chw, (new_h, new_w), spec.resampler)
    if frame_order != spec.channels:
        levels = levels.flip(-3)
    if top < 0 or left < 0:  # the crop: only what lands inside the canvas
        out_h, out_w = canvas.shape[-2:]
        skip_h, skip_w = max(0, -top), max(0, -left)
        levels = levels[:, :, skip_h:skip_h + out_h, skip_w:skip_w + out_w]
        top, left = max(0, top), max(0, left)
        new_h, new_w = levels.shape[-2:]
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
