"""The pipeline's side of engines that take raw uint8 frames (`--input-format uint8:HxW`): the
decoded frames are only laid out as the engine's N×H×W×3 input (the engine preprocesses them
inside its CUDA graph), and each frame's letterbox metadata is still computed here, so boxes map
back to the original image. A frame of another size fails alone, naming its size."""
from __future__ import annotations

import torch

from ..data.frame_format import FrameFormat
from ..data.preprocess import ImageMeta, PreprocessSpec, placement
from ..errors import ConfigError, DataError


def frames_batch_range(engine, name: str, frames: FrameFormat, profile: int | None) -> tuple[int, int, int]:
    """(profile, min batch, max batch) of the first profile (or `profile`) holding the frames input."""
    for k, candidate in enumerate(engine.profiles):
        r = candidate.shapes.get(name)
        if (profile is None or k == profile) and r is not None:
            return k, int(r.min[0]), int(r.max[0])
    raise ConfigError(f"profile {profile} does not hold the frames input {name!r}")


def wrong_sizes(frames: list[torch.Tensor], names: list[str], expected: FrameFormat) -> dict[int, str]:
    """Position → why, for the decoded frames (3×H×W; None for one that failed to decode) that are
    not of the engine's frame size."""
    h, w = expected.size
    return {i: f"{name}: a {int(f.shape[1])}x{int(f.shape[2])} frame, but the engine takes {h}x{w} frames "
               f"(built with --input-format {expected.describe()})"
            for i, (f, name) in enumerate(zip(frames, names)) if f is not None and tuple(f.shape[1:]) != (h, w)}


def frames_tensor(frames: FrameFormat, rows: int, device: torch.device) -> torch.Tensor:
    return torch.empty(frames.shape(rows), dtype=torch.uint8, device=device)


def lay_out_frames(decoded: list[torch.Tensor], names: list[str], spec: PreprocessSpec, frames: FrameFormat,
                   out: torch.Tensor) -> tuple[torch.Tensor, list[ImageMeta]]:
    """3×H×W RGB frames of the engine's size → `out` (N×H×W×3 in the engine's channel order) and
    each frame's ImageMeta for the engine's own preprocessing."""
    if len(decoded) != out.shape[0]:
        raise DataError(f"{len(decoded)} frames for a buffer of {out.shape[0]}")
    # One copy into `out`: the frames as H×W×3 views (contiguous for raw frames, whose 3×H×W form
    # is itself a view) stacked straight into it.
    torch.stack([f.permute(1, 2, 0) for f in decoded], out=out)
    if frames.order == "bgr":
        out.copy_(out.flip(-1))
    place = placement(*frames.size, spec)
    return out, [place.meta(name, frames.size) for name in names]
