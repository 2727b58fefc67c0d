"""The engine's stored preprocessing (`PreprocessSpec`) applied on the frames' device, written
straight into the engine's input buffer: one antialiased bilinear resize (Pillow's filter), the
letterbox's pad, channel order, mean/std, layout and dtype.

On CUDA with Triton that is one kernel launch per frame size (`kernels/preprocess/letterbox.py`,
Pillow's pixels); elsewhere torch ops (`kernels/preprocess/torch_path.py`: uint8 on the CPU, float32
rounded to levels on CUDA)."""
from __future__ import annotations

from dataclasses import dataclass, replace
from functools import partial

import torch

from ..data.preprocess import DTYPES, ImageMeta, PreprocessSpec, placement
from ..errors import ConfigError, DataError
from ..ir.dtypes import NUMPY_TO_TORCH, TORCH_TO_NUMPY
from ..kernels.preprocess.letterbox import InputCodes, kernel_supports, letterbox_frames, preprocess_kernel_available
from ..kernels.preprocess.torch_path import letterbox_torch
from ..runtime.executor import StagedForm


def uses_kernel(device: torch.device, spec: PreprocessSpec | None = None) -> bool:
    """Whether prepare_batch runs the Triton kernel on `device` by default: on CUDA with Triton, for
    a spec the kernel computes (not resampler=cv2, which the torch ops do on the same device)."""
    return device.type == "cuda" and preprocess_kernel_available() and (spec is None or kernel_supports(spec))


def input_tensor(spec: PreprocessSpec, batch: int, device: torch.device) -> torch.Tensor:
    """A new tensor of the shape and dtype `spec` produces for `batch` images (resize modes only)."""
    shape = spec.input_shape(batch)
    if shape is None:
        raise DataError("preprocess 'none' keeps each image's size: there is no fixed input shape")
    return torch.empty(shape, dtype=NUMPY_TO_TORCH[spec.dtype], device=device)


@dataclass(frozen=True)
class Staging:
    """How a batch is prepared for an engine that takes it in a staged form (`ExecutionContext.
    staged_forms`, docs/decisions/0068): the spec with that form's dtype, the INT8 codes to write
    (or None), and whether the buffer is channels-last."""
    spec: PreprocessSpec
    codes: InputCodes | None
    channels_last: bool

    def tensor(self, batch: int, device: torch.device) -> torch.Tensor:
        """A new buffer of this form for `batch` images."""
        dtype = torch.int8 if self.codes is not None else NUMPY_TO_TORCH[self.spec.dtype]
        layout = torch.channels_last if self.channels_last else torch.contiguous_format
        return torch.empty(self.spec.input_shape(batch), dtype=dtype, device=device, memory_format=layout)


def staging_for(spec: PreprocessSpec, form: StagedForm | None, device: torch.device) -> Staging | None:
    """The Staging the preprocessing kernel writes `form` in, or None where the batch is prepared as
    `spec` says: no form, no kernel on `device` for `spec`, or a form it does not write (a dtype
    `--preprocess` has no name for)."""
    if form is None or spec.resize == "none" or not uses_kernel(device, spec):
        return None
    if form.codes is not None:
        return Staging(spec, InputCodes(*form.codes), channels_last=False)
    dtype = TORCH_TO_NUMPY.get(form.dtype)
    if dtype not in DTYPES or (form.channels_last and spec.layout != "nchw"):
        return None
    return Staging(replace(spec, dtype=dtype), None, form.channels_last)


def stack_frames(frames: list[torch.Tensor]) -> torch.Tensor:
    """Frames of one shape and dtype as one N×… tensor: a view when they are evenly spaced views
    of one storage (a batched decoder's frames of one size), else a copy (torch.stack)."""
    first = frames[0]
    if len(frames) == 1:
        return first[None]
    start, step, item = first.data_ptr(), frames[1].data_ptr() - first.data_ptr(), first.element_size()
    if step > 0 and step % item == 0:
        shape, strides, storage = first.shape, first.stride(), first.untyped_storage().data_ptr()
        if all(f.shape == shape and f.stride() == strides and f.data_ptr() == start + i * step
               and f.untyped_storage().data_ptr() == storage for i, f in enumerate(frames)):
            return first.as_strided((len(frames), *shape), (step // item, *strides))
    return torch.stack(frames)


def prepare_batch(frames: list[torch.Tensor], names: list[str], spec: PreprocessSpec,
                  out: torch.Tensor | None = None, *, kernel: bool | None = None,
                  orig_sizes: list[tuple[int, int] | None] | None = None,
                  codes: InputCodes | None = None) -> tuple[torch.Tensor, list[ImageMeta]]:
    """3×H×W uint8 RGB frames → (the batch as `spec` says, one ImageMeta each). `out` (e.g. the
    engine's bound input buffer, `ExecutionContext.input_buffers`) receives it in place when given;
    it must have the spec's shape for len(frames) images, dtype and the frames' device. Frames of
    one size are prepared together: a camera's batch is one kernel launch (`kernel`: None picks
    the Triton kernel on CUDA with Triton, else torch ops; True or False forces one). `orig_sizes`
    gives the (H, W) of frames decoded at a reduced scale (`DecodedFrame.orig_size`): the geometry
    and the metas follow the image's own size. With `codes` (the Triton kernel only), `out` is int8 and
    receives the INT8 codes the layer reading the batch would quantize it to (an engine's staged
    form, `ExecutionContext.staged_forms`)."""
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
    dtype = torch.int8 if codes is not None else NUMPY_TO_TORCH[spec.dtype]
    target = out if out is not None else torch.empty(shape, dtype=dtype, device=device)
    if tuple(target.shape) != tuple(shape) or target.dtype != dtype or target.device != device:
        raise DataError(f"preprocess output buffer is {tuple(target.shape)} {target.dtype} on {target.device}; "
                        f"{spec.describe()!r} makes {tuple(shape)} {dtype}{' codes' if codes else ''} on {device}")
    if (kernel or codes is not None) and not kernel_supports(spec):
        raise ConfigError(f"preprocess {spec.describe()!r}: the fused preprocessing kernel resamples with Pillow's "
                          f"filter only; leave kernel= unset (and codes= out) to run resampler=cv2 through torch ops")
    use_kernel = uses_kernel(device, spec) if kernel is None else kernel
    if codes is not None and not use_kernel:
        raise ConfigError("prepare_batch: INT8 codes are written by the fused preprocessing kernel only "
                          "(kernel=False, or no Triton)")
    prepare = (partial(letterbox_frames, codes=codes) if codes is not None else letterbox_frames) if use_kernel \
        else letterbox_torch
    groups: dict[tuple, list[int]] = {}
    for i, key in enumerate(zip(sizes, originals)):
        groups.setdefault(key, []).append(i)
    metas: list[ImageMeta | None] = [None] * len(frames)
    for (_, (h, w)), members in groups.items():
        place = placement(h, w, spec)
        stacked = stack_frames([frames[i] for i in members])
        if members == list(range(members[0], members[-1] + 1)):
            prepare(stacked, "chw", "rgb", spec, place.resized, place.pad, target[members[0]:members[-1] + 1])
        else:  # frames of this size interleaved with others: prepared apart, then placed
            rows = torch.tensor(members, device=device)
            part = torch.empty((len(members), *target.shape[1:]), dtype=target.dtype, device=device)
            target.index_copy_(0, rows, prepare(stacked, "chw", "rgb", spec, place.resized, place.pad, part))
        for i in members:
            metas[i] = place.meta(names[i], (h, w))
    return target, metas
