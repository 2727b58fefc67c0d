"""Encoded images to uint8 RGB frames on the device that preprocesses them.

Two ways, and `orig_size` keeps the file's own size for the geometry either way:
- fast (the default): on CUDA, JPEGs go to nvJPEG in one batched call, to a free one of the
  device's decoders, queued on that decoder's own stream, which the caller's stream waits for,
  without a host wait (`nvjpeg_batched.py`;
  torchvision's `decode_jpeg(..., device="cuda")` where that binding cannot load; when that call
  fails, each JPEG is decoded alone, so one corrupt file fails only itself). On the host, a JPEG
  is decoded at 1/2, 1/4 or 1/8 scale in the DCT domain (libjpeg's scaled IDCT, the scale
  `Image.draft` picks) when the spec shrinks it at least that much, at the smallest such scale
  still at least the letterbox's size, and torch's resize (`prepare`) does what is left: by
  libjpeg-turbo through simplejpeg, with the GIL released (`turbo_jpeg.py`), else by Pillow
  (libjpeg-turbo, libpng), to the same pixels. Its pixels are not the reference's (a DCT
  low-pass, nvJPEG's IDCT, other rounding): docs/decisions/0025-cpu-fast-decode.md gives the
  accuracy it costs.
- exact (`fast=False`), on any device: Pillow's decode and Pillow's bilinear resize to the spec's
  size on the host, the values of `sartor.data.preprocess` exactly, so `sartor validate` scores the
  engine, not a decoder or a resize filter.
With `host_share` on CUDA, a share of each call's JPEGs is decoded the fast host way by a pool of
threads while nvJPEG decodes the rest: nvJPEG shares the GPU with the engine and slows beside it,
host threads do not (DALI's hw_decoder_load splits a batch the same way).
EXIF orientation is not applied, as in `sartor.data.preprocess`."""
from __future__ import annotations

import io
import threading
import warnings
from collections.abc import Callable, Iterator
from concurrent.futures import Executor, Future
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial

import numpy as np
import torch
from PIL import Image, UnidentifiedImageError

from ..data.buckets import BucketRefused, Buckets
from ..data.preprocess import PreprocessSpec, placement, resize_pixels
from ..errors import ConfigError, DataError
from . import turbo_jpeg
from .nvjpeg_batched import NvjpegBatched
from .pinned_slots import PinnedSlot, PinnedSlots
from .sources import JPEG_MAGIC, FrameSource


@dataclass
class DecodedFrame:
    """An item after decoding: `pixels` is 3×H×W uint8 RGB on the target device (channels first, the
    layout torch's resize reads; possibly a non-contiguous view), or None with `error` set."""
    name: str
    pixels: torch.Tensor | None
    error: str | None = None
    orig_size: tuple[int, int] | None = None  # (H, W) of the image; None: the pixels' own size
    pinned: PinnedSlot | None = None  # the pool's page-locked buffer the pixels lie in, until uploaded

    @property
    def size(self) -> tuple[int, int]:
        """(H, W) of the image as stored, whatever scale it was decoded at."""
        return self.orig_size or (int(self.pixels.shape[1]), int(self.pixels.shape[2]))


def _image_io():
    """torchvision.io, imported on first use: running engines needs no torchvision, decoding does."""
    try:
        import torchvision.io
    except ImportError as exc:
        raise ConfigError(f"decoding images needs torchvision ({exc}): pip install torchvision matching your "
                          f"torch, or pass decoded H×W×3 uint8 frames") from None
    return torchvision.io


class ImageTooLarge(DataError):
    """An image over the pixel limit a caller sets (`decode_on_host(max_pixels=)`)."""


# Pillow hands its pixels out as a read-only array; the pipeline only reads frames, so torch shares
# it rather than copying it again, and the one warning torch gives about that is not shown.
warnings.filterwarnings("ignore", message="The given NumPy array is not writable", category=UserWarning)


def _host_tensor(image: Image.Image) -> torch.Tensor:
    """An RGB image → 3×H×W uint8, a channels-last view of Pillow's one copy out (the layout torch's
    uint8 resize reads without another copy)."""
    return torch.from_numpy(np.asarray(image)).permute(2, 0, 1)


def decode_on_host(encoded, spec: PreprocessSpec | Buckets | None = None, fast: bool = False,
                   max_pixels: int | None = None, allocate: Callable[[tuple], np.ndarray] | None = None
                   ) -> tuple[torch.Tensor, tuple[int, int]]:
    """Image file bytes → (3×H×W uint8 RGB on the CPU, (H, W) as stored) through Pillow. With a spec
    that resizes, the frame comes out resized exactly as the reference resizes it, or with `fast`
    (JPEGs) at the smallest DCT scale still at least that size; with Buckets, as the spec of the
    bucket its size routes to (`Buckets.route`, which the caller repeats on the size), and one no
    bucket takes is refused (BucketRefused) before it is decoded. A file that is not an image,
    corrupt or truncated, or over `max_pixels`, is a DataError whose one line is the reason alone
    (the caller names the image). A JPEG on the fast path goes to libjpeg-turbo without Pillow when
    it can (`turbo_jpeg`: the same pixels, the GIL released), into `allocate(shape)` when given."""
    data = encoded.numpy().tobytes() if isinstance(encoded, torch.Tensor) else bytes(encoded)
    if fast and data[:3] == JPEG_MAGIC:
        decoded = _turbo_jpeg(data, spec, max_pixels, allocate)
        if decoded is not None:
            return decoded
    try:
        with warnings.catch_warnings():
            if max_pixels is not None:  # a server refuses what Pillow would only warn about
                warnings.simplefilter("error", Image.DecompressionBombWarning)
            with Image.open(io.BytesIO(data)) as image:
                width, height = image.size
                if max_pixels is not None and width * height > max_pixels:
                    raise ImageTooLarge(f"image of {width}x{height} pixels exceeds {max_pixels} pixels")
                exact_size = None
                if isinstance(spec, Buckets):
                    spec = spec.spec_for(height, width)
                if spec is not None and spec.resize != "none":
                    new_h, new_w = placement(height, width, spec).resized
                    if fast and image.format == "JPEG":
                        image.draft("RGB", (new_w, new_h))  # a no-op unless it shrinks by 2, 4 or 8
                    elif not fast:
                        exact_size = (new_w, new_h)
                image.load()
                rgb = image.convert("RGB") if image.mode != "RGB" else image
                if exact_size is not None and rgb.size != exact_size:  # the reference's own resize and filter
                    if spec.resampler == "cv2":
                        resized = resize_pixels(np.asarray(rgb), *exact_size, "cv2")  # a new, writable array
                        return torch.from_numpy(resized).permute(2, 0, 1), (height, width)
                    rgb = rgb.resize(exact_size, Image.Resampling.BILINEAR)
                return _host_tensor(rgb), (height, width)
    except (UnidentifiedImageError, ImportError):
        # ImportError: format plugins that other libraries patch into Image.open (ultralytics adds
        # a HEIF fallback) fail that way on bytes no reader recognises.
        raise DataError("Pillow cannot identify it") from None
    except BucketRefused:
        raise
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        raise DataError(" ".join(str(exc).split()) or type(exc).__name__) from None


def _turbo_jpeg(data: bytes, spec, max_pixels: int | None, allocate) -> tuple[torch.Tensor, tuple[int, int]] | None:
    """`decode_on_host`'s fast JPEG path through libjpeg-turbo; None where Pillow takes the file."""
    size = turbo_jpeg.header(data)
    if size is None:
        return None
    height, width = size
    if max_pixels is not None and width * height > max_pixels:
        raise ImageTooLarge(f"image of {width}x{height} pixels exceeds {max_pixels} pixels")
    if isinstance(spec, Buckets):
        spec = spec.spec_for(height, width)
    target = placement(height, width, spec).resized if spec is not None and spec.resize != "none" else None
    pixels = turbo_jpeg.decode(data, turbo_jpeg.draft_size(height, width, target), allocate)
    return None if pixels is None else (torch.from_numpy(pixels).permute(2, 0, 1), (height, width))


def _failure(source: FrameSource, exc: Exception) -> DecodedFrame:
    reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return DecodedFrame(source.name, None, f"image {source.name} is corrupt, truncated or not an image: {reason}")


def start_host_share(sources: list[FrameSource], device: torch.device, spec: PreprocessSpec | Buckets | None,
                     host_share: float, host_pool: Executor, host_slots: PinnedSlots | None = None
                     ) -> dict[int, Future]:
    """The host pool's decodes of `host_share` of the JPEGs nvJPEG would take (the last of them),
    started now: {index in `sources`: future DecodedFrame}, for `decode_frames(on_host=)`. Started
    ahead of their batch, they decode while the batches before it run."""
    device = torch.device(device)
    _, host_jpegs = split_for_host(_nvjpeg_indices(sources, device, True), host_share)
    return _submit_to_host(sources, host_jpegs, device, spec, host_pool, host_slots)


def _submit_to_host(sources: list[FrameSource], indices: list[int], device: torch.device, spec,
                    host_pool: Executor | None, host_slots: PinnedSlots | None) -> dict[int, Future]:
    # The pool's threads decode on the host and never touch the device's streams.
    host_step = partial(_pinned_host_frame, slots=host_slots) if device.type == "cuda" else _host_frame
    return {i: host_pool.submit(host_step, sources[i], spec, True) for i in indices}


def _nvjpeg_indices(sources: list[FrameSource], device: torch.device, fast: bool) -> list[int]:
    """The indices of the sources nvJPEG decodes: whole JPEGs, with `fast`, on CUDA."""
    if not (nvjpeg_decodes(device) and fast):
        return []
    return [i for i, s in enumerate(sources) if s.error is None and s.frame is None and all(s.jpeg_marks())]


def decode_frames(sources: list[FrameSource], device: torch.device, spec: PreprocessSpec | Buckets | None = None,
                  fast: bool = True, host_share: float = 0.0, host_pool: Executor | None = None,
                  host_slots: PinnedSlots | None = None, on_host: dict[int, Future] | None = None
                  ) -> list[DecodedFrame]:
    """One DecodedFrame per source, in order; failures carry their reason and never raise. `fast`:
    JPEGs through nvJPEG on CUDA, and on the host at a DCT scale when `spec` allows; not `fast`:
    everything through Pillow on the host, resized as the reference resizes it when `spec` is
    given (see the module's docstring). Without `spec`, host frames keep their own size. With
    Buckets, a host-decoded image goes by the spec of its bucket, and one that no bucket takes
    fails (its reason the refusal's line) without being decoded; frames decoded elsewhere are
    routed by the caller. `host_share` (with `host_pool`): that fraction of the JPEGs nvJPEG
    would take, the last of them, go to the host pool instead, decoded while nvJPEG runs; on CUDA
    into `host_slots`' page-locked buffers when given. `on_host`: those decodes already started
    (`start_host_share`), in place of `host_share`."""
    device = torch.device(device)
    whole_jpegs = _nvjpeg_indices(sources, device, fast)
    if on_host is None:
        _, host_jpegs = split_for_host(whole_jpegs, host_share if host_pool is not None else 0.0)
        on_host = _submit_to_host(sources, host_jpegs, device, spec, host_pool, host_slots)
    gpu_jpegs = [i for i in whole_jpegs if i not in on_host]
    taken = set(whole_jpegs) | on_host.keys()  # decoded by nvJPEG or the host pool, below
    decoded: list[DecodedFrame | None] = [None] * len(sources)
    for i, source in enumerate(sources):
        if i in taken:
            continue
        if source.error is not None:
            decoded[i] = DecodedFrame(source.name, None, source.error)
        elif source.frame is not None:
            if source.ready is not None:  # written on another thread's stream: this one waits for it
                torch.cuda.current_stream(source.frame.device).wait_event(source.ready)
            decoded[i] = DecodedFrame(source.name, source.frame.to(device, non_blocking=True).permute(2, 0, 1))
        elif nvjpeg_decodes(device) and fast and source.jpeg_marks()[0]:  # not whole: no end marker
            decoded[i] = DecodedFrame(source.name, None, f"image {source.name} is corrupt, truncated or not an "
                                                         f"image: no JPEG end-of-image marker (truncated)")
        else:
            decoded[i] = _uploaded(_host_frame(source, spec, fast), device)
    if gpu_jpegs:
        _decode_jpegs_on_gpu([sources[i] for i in gpu_jpegs], device, gpu_jpegs, decoded)
    for i in sorted(on_host):  # uploaded here, on the caller's stream, in order
        decoded[i] = _uploaded(on_host[i].result(), device)
    return decoded


def nvjpeg_decodes(device: torch.device) -> bool:
    """Whether JPEGs for `device` go to nvJPEG (one place, which the CPU tests stand nvJPEG in for)."""
    return device.type == "cuda"


def split_for_host(jpegs: list[int], host_share: float) -> tuple[list[int], list[int]]:
    """(for nvJPEG, for the host): the last round(share × n) of `jpegs` go to the host."""
    on_host = round(len(jpegs) * host_share)
    return jpegs[:len(jpegs) - on_host], jpegs[len(jpegs) - on_host:]


def _uploaded(frame: DecodedFrame, device: torch.device) -> DecodedFrame:
    if frame.pixels is not None:
        frame.pixels = frame.pixels.to(device, non_blocking=True)
    if frame.pinned is not None:  # its buffer is free once the copy just queued has run, on the stream it ran on
        frame.pinned.uploaded(torch.cuda.current_stream(device) if device.type == "cuda" else None)
        frame.pinned = None
    return frame


def _host_frame(source: FrameSource, spec, fast: bool, allocate=None) -> DecodedFrame:
    """The source decoded on the host (`decode_on_host`), its pixels left there; a failure carries its reason."""
    try:
        pixels, size = decode_on_host(source.encoded, spec, fast, allocate=allocate)
    except BucketRefused as exc:
        return DecodedFrame(source.name, None, f"{source.name}: {exc}")
    except DataError as exc:
        return _failure(source, exc)
    return DecodedFrame(source.name, pixels, orig_size=size)


UNPOOLED = PinnedSlots(max_slots=0)  # no buffers kept: page-locked memory of its own for every frame


def _pinned_host_frame(source: FrameSource, spec, fast: bool, slots: PinnedSlots | None = None) -> DecodedFrame:
    """`_host_frame` with its pixels in page-locked memory (one of `slots`' buffers when given), so
    that their upload is an asynchronous copy rather than the calling thread staging pageable bytes.
    libjpeg-turbo decodes straight into that memory; a frame Pillow decodes is copied in by numpy,
    on this thread alone (a torch CPU copy would start an intra-op thread team from every pool
    thread at once, and the teams would oversubscribe the cores the pool decodes on)."""
    slots = UNPOOLED if slots is None else slots
    taken: list[tuple[torch.Tensor, PinnedSlot | None]] = []

    def allocate(shape: tuple) -> np.ndarray:
        taken.append(slots.take(shape))
        return taken[-1][0].numpy()

    frame = _host_frame(source, spec, fast, allocate)
    pinned, slot = taken[-1] if taken else (None, None)
    if frame.pixels is None or pinned is None or frame.pixels.data_ptr() != pinned.data_ptr():
        if slot is not None:
            slot.release()  # libjpeg-turbo gave the file up to Pillow, or it failed
        if frame.pixels is None:
            return frame
        hwc = frame.pixels.permute(1, 2, 0)  # the decoder's own interleaved layout
        pinned, slot = slots.take(tuple(hwc.shape))
        np.copyto(pinned.numpy(), hwc.numpy())
    frame.pixels, frame.pinned = pinned.permute(2, 0, 1), slot
    return frame


# nvJPEG decoders a device's pipelines share: one handle's batched calls run one at a time. Two
# decodes run at once (docs/decisions/0064-two-workers-two-nvjpeg-decoders.md); the pipeline's third
# worker takes whichever is given back first (0065).
DECODERS_PER_DEVICE = 2


@dataclass
class GpuJpegDecoder:
    """One nvJPEG decoder of a device: its binding (a handle and its decode states) and the stream it
    decodes on (None: the caller's)."""
    binding: NvjpegBatched
    stream: torch.cuda.Stream | None = None


class GpuJpegDecoders:
    """The nvJPEG decoders of one device. A batch takes a free one for its call and gives it back
    after, so batches on several threads decode at once, each on its own decoder; decoders are made
    on first need, up to `limit` (fewer where making one fails: the batch then waits for a free one)."""

    def __init__(self, make: Callable[[], GpuJpegDecoder], first: GpuJpegDecoder | None = None,
                 limit: int = DECODERS_PER_DEVICE):
        self._make, self.limit = make, limit
        self._free: list[GpuJpegDecoder] = [first] if first is not None else []
        self.made = len(self._free)
        self._changed = threading.Condition()

    @contextmanager
    def take(self) -> Iterator[GpuJpegDecoder]:
        decoder = self._acquire()
        try:
            yield decoder
        finally:
            with self._changed:
                self._free.append(decoder)
                self._changed.notify()

    def _acquire(self) -> GpuJpegDecoder:
        while True:
            with self._changed:
                while not self._free and self.made >= self.limit:
                    self._changed.wait()
                if self._free:
                    return self._free.pop()  # the one given back last: its buffers are the warmest
                self.made += 1
            try:
                return self._make()
            except (ConfigError, DataError, OSError, RuntimeError):
                with self._changed:  # e.g. out of device memory: the decoders made so far are the limit
                    self.made -= 1
                    self.limit = self.made
                    if not self.made:
                        raise
                    self._changed.notify_all()


# One set per device, shared by the pipelines of a process (torchvision keeps one decoder too); None
# where the binding cannot load, and torchvision decodes.
_BATCHED: dict[torch.device, GpuJpegDecoders | None] = {}
_BATCHED_LOCK = threading.Lock()


def _device_key(device: torch.device) -> torch.device:
    return torch.device("cuda", device.index if device.index is not None else torch.cuda.current_device())


def set_gpu_jpeg_decoders(device: torch.device, make: Callable[[], GpuJpegDecoder],
                          limit: int = DECODERS_PER_DEVICE) -> None:
    """From now on every pipeline of this process decodes its JPEGs on `device` with decoders that
    `make` makes (another nvJPEG backend, stream or count of states: what the benchmarks compare),
    up to `limit` at once. Batches decoding now finish on the decoders they took."""
    key = _device_key(device)
    with _BATCHED_LOCK:
        _BATCHED[key] = GpuJpegDecoders(make, make(), limit=limit)


def _batched_decoder(device: torch.device) -> GpuJpegDecoders | None:
    key = _device_key(device)
    with _BATCHED_LOCK:
        if key not in _BATCHED:
            def make() -> GpuJpegDecoder:
                return GpuJpegDecoder(NvjpegBatched(key), torch.cuda.Stream(key))
            try:
                _BATCHED[key] = GpuJpegDecoders(make, make())
            except (ConfigError, DataError, OSError) as exc:
                warnings.warn(f"sartor's nvJPEG binding is unavailable ({exc}); "
                              f"JPEGs go through torchvision's decode_jpeg", RuntimeWarning, stacklevel=2)
                _BATCHED[key] = None
        return _BATCHED[key]


def _decode_jpegs_on_gpu(sources: list[FrameSource], device: torch.device, slots: list[int],
                         decoded: list) -> None:
    """The sources' frames (3×H×W views) from one batched nvJPEG call into `decoded[slots]`. sartor's
    binding queues the decode on the decoder's own stream, which the caller's stream then waits for
    by an event, and the host does not wait (torchvision's call does); its frames are torchvision's
    to the bit (decision 0062). On a stream of its own the next batch's decode need not wait behind
    this batch's preprocessing, nor behind the engine freeing a staging buffer, as it would on the
    caller's. torchvision's `decode_jpeg` where the binding cannot load. One bad file fails the
    call: then each file is decoded alone by the same decoder, so it fails only itself (and no frame
    comes from torchvision's decoders, deprecated since torchvision 0.29, where the binding loads)."""
    decoders = _batched_decoder(device)
    try:
        frames = _decode_in_one_call([s.encoded for s in sources], device, decoders)
    except DataError:
        for slot, source in zip(slots, sources):
            try:
                (frame,) = _decode_in_one_call([source.encoded], device, decoders)
            except DataError as exc:
                decoded[slot] = _failure(source, exc)
                continue
            decoded[slot] = DecodedFrame(source.name, frame)
        return
    for slot, source, frame in zip(slots, sources, frames):
        decoded[slot] = DecodedFrame(source.name, frame)


def _decode_in_one_call(encoded: list, device: torch.device, decoders: GpuJpegDecoders | None) -> list[torch.Tensor]:
    """`encoded` decoded in one call: by the binding's `decoders`, or torchvision's where it cannot load.
    DataError when a file cannot be decoded."""
    if decoders is not None:
        return _binding_frames(decoders, encoded, device)
    io = _image_io()
    try:
        return io.decode_jpeg(encoded, mode=io.ImageReadMode.RGB, device=device)
    except RuntimeError as exc:  # torchvision's way of saying a file is bad
        raise DataError(str(exc)) from exc


def _binding_frames(decoders: GpuJpegDecoders, encoded: list, device: torch.device) -> list[torch.Tensor]:
    """`encoded` decoded by one call on a free decoder of the binding, as 3×H×W views; DataError when
    the call fails."""
    caller = torch.cuda.current_stream(device) if device.type == "cuda" else None
    with decoders.take() as decoder:
        stream = decoder.stream or caller
        jpegs = decoder.binding.decode_batch(encoded, stream)
        if stream is not caller:  # recorded before another batch can queue on the decoder's stream
            for memory in [jpegs.batch] if jpegs.batch is not None else jpegs.frames:
                memory.record_stream(caller)  # allocated on the decoder's stream, read on the caller's
            done = torch.cuda.Event()
            done.record(stream)
            caller.wait_event(done)
    if jpegs.batch is not None:  # views of one tensor, which prepare_batch takes whole again
        return list(jpegs.batch.permute(0, 3, 1, 2).unbind(0))
    return [frame.permute(2, 0, 1) for frame in jpegs.frames]
