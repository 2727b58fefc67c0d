"""`Pipeline(engine)`: paths, image bytes or raw frames in; per item its outputs (and detections,
given a decoder) in original-image coordinates out.

Each batch is read, decoded and preprocessed by one of three worker threads (on CUDA, each on a
stream of its own, its JPEGs on whichever of the device's two nvJPEG decoders is free; two workers
for a CPU engine) into one of four staging buffers, three batches at once, while the engine runs the
batch before them; the engine then reads the staging buffer inside the same stream order: copied
into its bound input at a buffer's first run, read where it is from its second (decision 0069). On
CUDA a batch is prepared in the form the engine reads (an INT8 stem's codes, channels-last float16:
`staging_for`, decision 0068).

Failed items (unreadable, corrupt, truncated, wrong shape) never stop the items beside
them from being decoded; what happens to them is `skip_bad`: False (the default) raises one
`DataError` naming every failed item of the batch before that batch runs; True returns them as
results with `error` set, in their place, and runs the rest.

A last batch smaller than the profile's minimum batch is filled up to it with copies of its first
frame, whose outputs are dropped.

A video file (`run("clip.mp4")`) or a `VideoSource` is decoded on a thread of its own while the
batches before run; its frames are named by file, index and time (`video.py`).

An engine with resolution buckets (`--preprocess letterbox=320|480|640,...`) runs each frame in the
bucket `Buckets.route` picks by its size: the smallest that holds it whole, else the one shrinking
it least within `max_downscale`; a frame no bucket takes fails as a corrupt one does, its reason
the refusal's one line. A batch of mixed sizes is split into one sub-batch per bucket (each
prepared into that bucket's staging buffer and run by the context bound to its profile); results
come back in input order (docs/decisions/0037-resolution-buckets.md)."""
from __future__ import annotations

import itertools
import os
import threading
import warnings
import weakref
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import nullcontext
from dataclasses import InitVar, dataclass, field

import torch

from ..data.buckets import BucketRefused, Buckets
from ..data.preprocess import ImageMeta, PreprocessSpec, import_cv2, parse_max_downscale
from ..errors import ConfigError, DataError
from ..runtime.hardware_queues import fewer_than_wanted
from ..runtime.launchers import usable_cpus
from . import decode
from .decode import DECODERS_PER_DEVICE, decode_frames, start_host_share
from .detections import EngineNms, YoloNms
from .host_share import BatchTimer, HostShareSearch, candidates_for
from .pinned_slots import PinnedSlots
from .prepare import Staging, input_tensor, prepare_batch, staging_for
from .raw_frames import frames_batch_range, frames_tensor, lay_out_frames, wrong_sizes
from .read_ahead import Chunk, chunks_of, read_ahead
from .sources import FRAME_ORDERS, FrameSource, read_sources
from .streams import ConcurrentStreams
from .video import VideoSource, is_video_path

DEFAULT_MAX_BATCH = 32
# Batches prepared at once on worker threads. nvJPEG's batched call holds its thread for most of the
# decode: two decoders (decode.py) run two decodes at once (decision 0064), and a third worker has its
# batch ready for the first decoder its holder gives back, while that holder runs its batch's Python
# after the call (decision 0065). For a CPU engine, whose workers' decode and letterbox take cores
# from the engine itself, two.
PREPARE_AHEAD = 3
HOST_PREPARE_AHEAD = 2


@dataclass
class PipelineResult:
    """One item's result: `outputs` (name → this item's numpy array), `detections` when the pipeline
    has a decoder, `meta` (maps network-input boxes back to the original image), or `error`."""
    name: str
    meta: ImageMeta | None = None
    outputs: dict = field(default_factory=dict)
    detections: object | None = None
    error: str | None = None


@dataclass
class _Bucket:
    """One resolution bucket as the pipeline runs it: its spec, the profile and the context bound to
    it, its minimum batch, and a staging buffer per batch in flight, with the event that frees it.
    `staged`: the form the engine takes its input in, which the batches are prepared in, or None."""
    spec: PreprocessSpec
    profile: int
    min_batch: int
    context: object
    slots: InitVar[int]
    staged: Staging | None = None
    staging: list = field(init=False)
    staging_free: list = field(init=False)

    def __post_init__(self, slots: int) -> None:
        self.staging, self.staging_free = [None] * slots, [None] * slots


@dataclass
class _Group:
    """A chunk's frames of one bucket: their positions in the chunk, in order, and their batch."""
    bucket: int
    positions: list[int]
    batch: torch.Tensor
    metas: list[ImageMeta]


@dataclass
class _Prepared:
    names: list[str]
    failures: dict[int, str]  # position in the chunk → reason
    groups: list[_Group]  # one per bucket the chunk's good frames went to, smallest bucket first
    ready: torch.cuda.Event | None
    host_share: float = 0.0  # of the chunk's JPEGs for nvJPEG, the share decoded on the host


@dataclass
class _Launched:
    """A batch whose runs are queued: its outputs per group, copied where the next run cannot
    overwrite them, and the event after which they are there."""
    prepared: _Prepared
    outputs: list[dict]
    done: torch.cuda.Event | None


def image_input(engine, needed_by: str = "a pipeline"):
    """The engine's one 4-D image input; anything else is refused, naming what `needed_by` it."""
    images = [v for v in engine.inputs if v.shape is not None and len(v.shape) == 4]
    if len(engine.inputs) != 1 or len(images) != 1:
        listing = ", ".join(f"{v.name} {list(v.shape) if v.shape is not None else '?'}" for v in engine.inputs)
        raise ConfigError(f"{needed_by} needs an engine with one 4-D image input; this one takes {listing}")
    return images[0]


def choose_batch(engine, name: str, spec: PreprocessSpec, requested: int | None = None,
                 profile: int | None = None) -> tuple[int, int, int]:
    """(batch, profile, min batch) for images of the spec's size: the first profile (or `profile`)
    that admits the size and, when a batch is `requested`, that batch; else its max batch, capped at
    DEFAULT_MAX_BATCH. With preprocess 'none' images keep their sizes, so the batch is 1."""
    probe = spec.input_shape(1)
    candidates = []
    for k, candidate in enumerate(engine.profiles):
        r = candidate.shapes.get(name)
        if (profile is not None and k != profile) or r is None:
            continue
        if probe is None or all(lo <= d <= hi for d, lo, hi in zip(probe[1:], r.min[1:], r.max[1:])):
            candidates.append((k, int(r.min[0]), int(r.max[0])))
    if not candidates:
        shape = "x".join(map(str, probe[1:])) if probe is not None else "(each image's size)"
        ranges = "; ".join(f"profile {k}: {p.describe()}" for k, p in enumerate(engine.profiles))
        raise ConfigError(f"preprocess {spec.describe()} makes {shape} inputs, which no profile of the engine "
                          f"admits ({ranges})")
    if spec.resize == "none":
        if requested not in (None, 1):
            raise ConfigError(f"batch size {requested}: with preprocess 'none' images differ in size, so the "
                              f"batch is 1")
        k, lo, _ = candidates[0]
        return 1, k, lo
    if requested is None:
        k, lo, hi = candidates[0]
        return min(hi, max(lo, DEFAULT_MAX_BATCH)), k, lo
    for k, lo, hi in candidates:
        if 1 <= requested <= hi:
            return requested, k, lo
    top = max(hi for _, _, hi in candidates)
    raise ConfigError(f"batch size {requested} is outside 1..{top} (the engine's max batch {top} for "
                      f"{spec.describe()!r} inputs)")


def _admits(engine, name: str, spec: PreprocessSpec, profile: int) -> bool:
    """Whether profile `profile` admits the input size `spec` makes (any size with 'none')."""
    if not 0 <= profile < len(engine.profiles):
        return False  # choose_batch then says what the engine's profiles admit
    probe, r = spec.input_shape(1), engine.profiles[profile].shapes.get(name)
    return r is not None and (probe is None or all(lo <= d <= hi for d, lo, hi in zip(probe[1:], r.min[1:], r.max[1:])))


class Pipeline:
    """Run an engine over images with its stored preprocessing (`sartor build --preprocess ...`).

    `decoder(outputs, metas) -> list` turns a batch's outputs (batch first) into one result per
    image: numpy arrays (e.g. `sartor.validate.decoders.decode_yolo`), or with `host_outputs=False`
    the engine's own device tensors, valid during the call (e.g. `YoloNms()`, which sends only
    the kept boxes to the host), and results then carry no outputs. Without a decoder, results carry
    outputs only. An engine built with `--nms` decodes itself: without a decoder, or with a
    `YoloNms` (whose settings the engine's own then replace), its results carry the detections it
    kept (`EngineNms`). `frame_order` is the channel order of raw frames (`rgb` or `bgr`, as OpenCV gives them).
    `fast_decode` (the default) decodes JPEGs by nvJPEG on CUDA and, on the host, at 1/2, 1/4 or 1/8
    scale when the preprocessing shrinks them that much (half the CPU time per 720p frame, mAP
    within noise: docs/decisions/0025-cpu-fast-decode.md); False gives the reference's values for
    encoded images on any device (Pillow's decode and resize on the host). `host_decode_share` (0 to
    1; CUDA engines with `fast_decode`): that share of each batch's JPEGs is decoded on the host by
    `host_decode_threads` threads (default: the CPUs this process may use) while nvJPEG decodes the
    rest, which shares the GPU with the engine; a CPU engine decodes every frame on the host anyway.
    "auto": the share is chosen by timing the first batches (`host_share.py`; `host_share_chosen`
    once chosen).

    Resolution buckets: frames go to the engine's buckets (`engine.buckets`) by size, under the
    engine's `max_downscale` policy unless `max_downscale` is given (a factor ≥ 1, or "any");
    `preprocess=` (one spec) or `profile=` narrows them to one size. `batch_size` is the frames read
    a step, which every bucket's profile must admit; a step's frames of one bucket run together."""

    def __init__(self, engine, *, batch_size: int | None = None, profile: int | None = None,
                 decoder: Callable | None = None, frame_order: str = "rgb", skip_bad: bool = False,
                 preprocess: PreprocessSpec | None = None, overlap: bool = True,
                 host_outputs: bool = True, fast_decode: bool = True,
                 max_downscale: float | str | None = None, host_decode_share: float | str = 0.0,
                 host_decode_threads: int | None = None) -> None:
        if host_decode_share != "auto" and (isinstance(host_decode_share, str)
                                            or not 0.0 <= host_decode_share <= 1.0):
            raise ConfigError(f"host_decode_share {host_decode_share!r} must be between 0 and 1, or 'auto'")
        if host_decode_threads is not None and host_decode_threads < 1:
            raise ConfigError(f"host_decode_threads {host_decode_threads} must be at least 1")
        buckets = Buckets((preprocess,)) if preprocess is not None else engine.buckets
        if buckets is None:
            raise ConfigError("the engine records no preprocessing: rebuild it with --preprocess (e.g. "
                              "letterbox=640,mean=0,std=255,rgb,nchw), or pass preprocess=")
        if max_downscale is not None:
            buckets = buckets.with_max_downscale(parse_max_downscale(str(max_downscale), "max_downscale"))
        spec = buckets.largest
        if frame_order not in FRAME_ORDERS:
            raise ConfigError(f"frame order {frame_order!r} is not one of {', '.join(FRAME_ORDERS)}")
        if spec.resampler == "cv2":
            import_cv2()  # missing OpenCV is one error here, not a failure per image on the worker thread
        if getattr(engine, "nms", None) is not None and (decoder is None or isinstance(decoder, YoloNms)):
            decoder = EngineNms(engine.nms)  # the engine ran the NMS itself: its kept boxes are the detections
        self.engine, self.decoder = engine, decoder
        if not host_outputs and decoder is None:
            raise ConfigError("host_outputs=False needs a decoder: the outputs would not leave the device")
        self.frame_order, self.skip_bad, self.overlap, self.host_outputs = frame_order, skip_bad, overlap, host_outputs
        image = image_input(engine)
        # An engine built with --input-format uint8 takes decoded frames and preprocesses them itself.
        self.frames = engine.input_format
        if self.frames is not None and preprocess is not None and preprocess != engine.preprocess:
            raise ConfigError(f"this engine preprocesses its frames itself ({engine.preprocess}): preprocess= "
                              f"{preprocess} cannot apply")
        if self.frames is None and spec.dtype != image.dtype:
            raise ConfigError(f"preprocess {spec.describe()} produces {spec.dtype} but input {image.name!r} "
                              f"is {image.dtype}")
        self.input_name = image.name
        if self.frames is None:
            if profile is not None:  # one profile: the buckets of the size it admits
                buckets = Buckets(tuple(s for s in buckets.specs if _admits(engine, image.name, s, profile)) or
                                  (buckets.largest,))  # none: choose_batch names the profile's ranges
            if batch_size is None:  # the largest every bucket admits
                batch_size = min(choose_batch(engine, image.name, s, None, profile)[0] for s in buckets.specs)
            chosen = [choose_batch(engine, image.name, s, batch_size, profile) for s in buckets.specs]
            self.batch_size = chosen[0][0]
        else:
            try:  # the frames' one size under the policy: refused here, not at every frame
                buckets.route(*self.frames.size)
            except BucketRefused as exc:
                raise ConfigError(f"frames of the engine's input format {self.frames.describe()}: {exc}") from None
            k, lo, max_batch = frames_batch_range(engine, image.name, self.frames, profile)
            if batch_size is not None and not 1 <= batch_size <= max_batch:
                raise ConfigError(f"batch size {batch_size} is outside 1..{max_batch}, what the engine's profile "
                                  f"{k} admits for {self.frames.describe()} frames")
            self.batch_size = batch_size or min(max_batch, max(lo, DEFAULT_MAX_BATCH))
            chosen = [(self.batch_size, k, lo)]
        self.buckets, self.spec = buckets, buckets.largest
        self.device = torch.device(engine.device)
        if self.device.type == "cuda" and (reason := fewer_than_wanted()) is not None:
            warnings.warn(reason, RuntimeWarning, stacklevel=2)  # once per place, as warnings go
        # batches prepared at once with overlap, and the staging buffers they and the engine's run take
        self.prepare_ahead = PREPARE_AHEAD if self.device.type == "cuda" else HOST_PREPARE_AHEAD
        self.staging_slots = self.prepare_ahead + 1
        self._buckets = [_Bucket(s, k, lo, engine.context(k), self.staging_slots)
                         for s, (_, k, lo) in zip(buckets.specs, chosen)]
        if self.frames is None:
            # Prepared as the engine's copy would write them (an INT8 stem's codes, channels-last
            # float16), the batches are copied in as they are: fewer bytes written, then moved.
            for bucket in self._buckets:
                shape = bucket.spec.input_shape(max(self.batch_size, bucket.min_batch))
                if shape is not None:
                    forms = bucket.context.staged_forms({image.name: shape})
                    bucket.staged = staging_for(bucket.spec, forms.get(image.name), self.device)
        # The largest bucket's, as a pipeline of one size has them.
        self.profile, self.min_batch, self.context = chosen[-1][1], chosen[-1][2], self._buckets[-1].context
        self.fast_decode = fast_decode
        shared = decode.nvjpeg_decodes(self.device) and fast_decode  # else every frame is the host's anyway
        self.host_decode_share = host_decode_share if shared else 0.0
        self.host_share_search = (HostShareSearch(candidates_for(self.batch_size))
                                  if self.host_decode_share == "auto" else None)
        self.host_pool, self.host_slots, self.host_decode_threads = None, None, None
        if self.host_decode_share != 0:
            self.host_decode_threads = host_decode_threads or usable_cpus()
            self.host_pool = ThreadPoolExecutor(max_workers=self.host_decode_threads,
                                                 thread_name_prefix="sartor-host-decode")
            weakref.finalize(self, self.host_pool.shutdown, wait=False)
            self.host_slots = PinnedSlots()  # the page-locked buffers its frames are decoded into
        # With overlap, batches are prepared on a stream of the preparing thread's own, ordered against
        # the engine's runs by events; without, on the current stream, in the calling thread.
        self._prepare_on_streams = self.device.type == "cuda" and overlap
        self._streams = threading.local()
        self.stream_priority = 0  # of the preparation streams
        # With overlap on CUDA, batch n+1's run is queued before batch n's results are finished; a
        # host run has finished when it returns, so there is nothing to overlap it with.
        self.launch_ahead = overlap and self.device.type == "cuda"
        self._lock = threading.Lock()

    @property
    def host_share_chosen(self) -> float | None:
        """The host share batches are decoded with now; None while "auto" is still timing candidates."""
        if self.host_share_search is not None:
            return self.host_share_search.chosen
        return self.host_decode_share

    def _next_share(self) -> float:
        """The host share the next batch decodes at ("auto": the search's next)."""
        return self.host_share_search.next_share() if self.host_share_search else self.host_decode_share

    @property
    def _host_spec(self) -> Buckets | None:
        """What a frame decoded on the host is sized for: a raw-frames engine resizes frames itself."""
        return self.buckets if self.frames is None else None

    def _start_host_share(self, sources: list[FrameSource], share: float) -> dict[int, Future]:
        return start_host_share(sources, self.device, self._host_spec, share, self.host_pool, self.host_slots)

    # ---- routing ---------------------------------------------------------------------------
    def bucket_of(self, h: int, w: int) -> int:
        """The index (in `buckets.specs`) of the bucket an h×w frame runs in; BucketRefused (a
        DataError) when none takes it."""
        return 0 if self.frames is not None else self.buckets.route(h, w)

    def bucket_profile(self, bucket: int) -> tuple[PreprocessSpec, int, int]:
        """(spec, profile, min batch) of bucket `bucket`."""
        b = self._buckets[bucket]
        return b.spec, b.profile, b.min_batch

    # ---- preparing a batch (worker thread) -------------------------------------------------
    def _preparation_stream(self) -> torch.cuda.Stream | None:
        """This thread's preparation stream (with overlap on CUDA), made on its first batch."""
        if not self._prepare_on_streams:
            return None
        stream = getattr(self._streams, "stream", None)
        if stream is None:
            stream = self._streams.stream = torch.cuda.Stream(self.device, priority=self.stream_priority)
        return stream

    def _buffer(self, bucket: _Bucket, slot: int, rows: int) -> torch.Tensor | None:
        shape = bucket.spec.input_shape(rows)
        if shape is None:
            return None
        buffer = bucket.staging[slot]
        if buffer is None or buffer.shape[0] < rows:
            capacity = max(self.batch_size, bucket.min_batch)
            buffer = bucket.staging[slot] = (
                frames_tensor(self.frames, capacity, self.device) if self.frames is not None
                else bucket.staged.tensor(capacity, self.device) if bucket.staged is not None
                else input_tensor(bucket.spec, capacity, self.device))
        return buffer[:rows]

    @property
    def batch_size_rows(self) -> int:
        return max(self.batch_size, self.min_batch)

    def _prepare(self, chunk: Chunk, slot: int) -> _Prepared:
        sources = read_sources(chunk.items, self.frame_order, chunk.first)
        names = [s.name for s in sources]
        stream = self._preparation_stream()
        with torch.cuda.stream(stream) if stream is not None else nullcontext():
            for bucket in self._buckets if stream is not None else ():
                if bucket.staging_free[slot] is not None:
                    stream.wait_event(bucket.staging_free[slot])  # the engine has copied this buffer out
            # A raw-frames engine takes frames of its declared size and resizes them itself: files are
            # decoded at their own size (nvJPEG still, on CUDA), never resized or at a reduced scale.
            share = self._next_share() if chunk.share is None else chunk.share
            decoded = decode_frames(sources, self.device, self._host_spec, self.fast_decode, share, self.host_pool,
                                    self.host_slots, on_host=chunk.on_host)
            failures = {i: d.error for i, d in enumerate(decoded) if d.error is not None}
            if self.frames is not None:
                failures |= wrong_sizes([d.pixels if d.error is None else None for d in decoded], names, self.frames)
            by_bucket: dict[int, list[int]] = {}
            routes: dict[tuple[int, int], int | BucketRefused] = {}  # a camera's batch has one size
            for i, d in enumerate(decoded):
                if i in failures:
                    continue
                size = d.size
                if size not in routes:
                    try:
                        routes[size] = self.bucket_of(*size)
                    except BucketRefused as exc:  # decoded elsewhere than on the host (nvJPEG, raw frames)
                        routes[size] = exc
                route = routes[size]
                if isinstance(route, BucketRefused):
                    failures[i] = f"{names[i]}: {route}"
                else:
                    by_bucket.setdefault(route, []).append(i)
            groups = []
            for k in sorted(by_bucket):
                group = self._prepare_group(k, by_bucket[k], decoded, names, slot)
                if isinstance(group, DataError):
                    failures |= {i: str(group) for i in by_bucket[k]}
                else:
                    groups.append(group)
            ready = None
            if stream is not None and groups:
                ready = torch.cuda.Event()
                ready.record(stream)
        return _Prepared(names, failures, groups, ready, share)

    def _prepare_group(self, k: int, members: list[int], decoded: list, names: list[str],
                       slot: int) -> _Group | DataError:
        """The frames at `members` prepared into bucket k's staging buffer, or why they could not be."""
        bucket = self._buckets[k]
        frames = [decoded[i].pixels for i in members]
        frame_names = [names[i] for i in members]
        sizes = [decoded[i].size for i in members]
        rows = max(len(frames), bucket.min_batch)
        frames += [frames[0]] * (rows - len(frames))  # filled to the profile's minimum batch
        frame_names += [frame_names[0]] * (rows - len(frame_names))
        sizes += [sizes[0]] * (rows - len(sizes))
        try:
            staged = bucket.staged
            batch, metas = (
                prepare_batch(frames, frame_names, staged.spec if staged else bucket.spec,
                              self._buffer(bucket, slot, rows), orig_sizes=sizes, codes=staged and staged.codes)
                if self.frames is None
                else lay_out_frames(frames, frame_names, bucket.spec, self.frames, self._buffer(bucket, slot, rows)))
        except DataError as exc:
            return exc
        return _Group(k, members, batch, metas[:len(members)])

    # ---- running ---------------------------------------------------------------------------
    def _refuse_failures(self, prepared: _Prepared) -> None:
        if prepared.failures and not self.skip_bad:
            listed = "; ".join(prepared.failures[i] for i in sorted(prepared.failures))
            raise DataError(f"{len(prepared.failures)} of {len(prepared.names)} images failed: {listed} "
                            f"(skip_bad=True runs the others)")

    def _launch(self, prepared: _Prepared, slot: int) -> _Launched:
        """Run the engine on each group of the batch and start its outputs' way out, without waiting
        for the device: host copies (or, for a decoder of device tensors, device copies) that the
        next batch's run cannot overwrite, so the caller can launch it before finishing this one."""
        self._refuse_failures(prepared)
        # Few torch calls here: nearly each one lets a worker take the interpreter lock, and this
        # thread then waits to get it back (decision 0065).
        current = torch.cuda.current_stream(self.device) if self.device.type == "cuda" else None
        if prepared.ready is not None:
            current.wait_event(prepared.ready)
        staged = []
        for group in prepared.groups:  # one run per bucket, results placed back in input order
            bucket = self._buckets[group.bucket]
            outputs = bucket.context.run({self.input_name: group.batch}, staged=bucket.staged is not None)
            if current is not None:
                freed = bucket.staging_free[slot] = torch.cuda.Event()
                freed.record(current)
            rows = len(group.positions)  # a whole batch (a camera's) is staged as it is, a short one cut
            staged.append({name: self._stage(t if t.shape[0] == rows else t[:rows]) for name, t in outputs.items()})
        done = None
        if current is not None:
            done = torch.cuda.Event()
            done.record(current)
        return _Launched(prepared, staged, done)

    def _stage(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.device.type != "cuda":  # a run's outputs may be its context's buffers, which the next run reuses
            return tensor.clone() if self.launch_ahead else tensor
        if self.host_outputs or isinstance(self.decoder, EngineNms):
            return tensor.to("cpu", non_blocking=True)  # pinned by torch: the copy waits for nothing on the host
        return tensor.clone()

    def _finish(self, launched: _Launched) -> list[PipelineResult]:
        prepared = launched.prepared
        results = [PipelineResult(name) for name in prepared.names]
        for i, reason in prepared.failures.items():
            results[i].error = reason
        if launched.done is not None and (self.host_outputs or isinstance(self.decoder, EngineNms)):
            launched.done.synchronize()  # the host copies have landed
        for group, outputs in zip(prepared.groups, launched.outputs):
            if self.host_outputs:
                host = {name: t.numpy() for name, t in outputs.items()}
                detections = self.decoder(host, group.metas) if self.decoder is not None else None
            else:
                host = {}
                detections = self.decoder(outputs, group.metas)
            for k, i in enumerate(group.positions):
                results[i].meta = group.metas[k]
                results[i].outputs = {name: value[k] for name, value in host.items()}
                if detections is not None:
                    results[i].detections = detections[k]
        return results

    def stream(self, items: Iterable) -> Iterator[PipelineResult]:
        """Results in item order, batch by batch; with `overlap`, the next three batches (two for a
        CPU engine) are prepared on worker threads while this one runs, else each batch is prepared
        and run in the calling thread (the lowest latency for one frame at a time). `items` may also
        be one video's path or a `VideoSource`: its frames, decoded on a thread of their own."""
        source = self._frames_of(items)
        frames = iter(source)
        try:
            yield from self._batches(chunks_of(frames, self.batch_size))
        finally:
            if isinstance(source, ConcurrentStreams):
                frames.close()  # stop the decoder threads now, also when a batch raised

    def _batches(self, chunks: Iterator[Chunk]) -> Iterator[PipelineResult]:
        with self._lock:
            # "auto" host share: each batch's time to its share
            timer = BatchTimer(self.host_share_search, self.prepare_ahead if self.overlap else 1,
                               DECODERS_PER_DEVICE if self.overlap else 1)
            if not self.overlap:
                for chunk in chunks:
                    timer.start()
                    prepared = self._prepare(chunk, 0)
                    yield from self._finish(self._launch(prepared, 0))
                    timer.batch_finished(prepared.host_share, len(prepared.names))
                return
            # Batches n+1 to n+3 are prepared on the workers while n runs, and n+1 is launched before
            # n's results are finished, so the device never waits for the host between two batches.
            # A chunk of frames already on the engine's device has nothing to decode or copy in: it is
            # prepared in the calling thread once the batch before is launched, as a worker would only
            # contend with this thread for the interpreter lock
            # (docs/decisions/0051-inline-prepare-of-device-frames.md).
            with ThreadPoolExecutor(max_workers=self.prepare_ahead, thread_name_prefix="sartor-pipeline") as pool, \
                    ThreadPoolExecutor(max_workers=1, thread_name_prefix="sartor-read") as reader:
                # Files are read, and their host share started decoding, batches ahead (read_ahead.py).
                pooled = self.host_pool is not None
                chunks = read_ahead(chunks, reader, self.frame_order, self._next_share if pooled else None,
                                    self._start_host_share if pooled else None)
                try:
                    yield from self._overlapped(chunks, pool, timer)
                finally:
                    chunks.close()  # a stream stopped early: what was read ahead gives its buffers back

    def _overlapped(self, chunks: Iterator[Chunk], pool: ThreadPoolExecutor,
                    timer: BatchTimer) -> Iterator[PipelineResult]:
        # The batches started, in order: [chunk, staging slot, its prepare's Future, or None for a
        # chunk of device frames, prepared in this thread when the batch before is launched]. Batch j
        # takes slot j mod staging_slots and is started once batch j - staging_slots, the slot's last
        # user, is launched: its prepare waits (on the device) for that run to release the staging buffer.
        started: deque[list] = deque()
        slots = (index % self.staging_slots for index in itertools.count())

        def start_more() -> None:
            while len(started) < self.prepare_ahead:
                chunk = next(chunks, None)
                if chunk is None:
                    return
                slot = next(slots)
                inline = self._on_device(chunk.items)
                started.append([chunk, slot, None if inline else pool.submit(self._prepare, chunk, slot)])

        start_more()
        running: _Launched | None = None
        while started:
            chunk, slot, pending = started.popleft()
            prepared = (pending if pending is not None else _prepared_now(self._prepare, chunk, slot)).result()
            start_more()
            if running is not None and prepared.failures and not self.skip_bad:
                yield from self._finish(running)  # the batch before is returned, then this one refused
                running = None
            launched = self._launch(prepared, slot)
            if started and started[0][2] is None:  # device frames next: prepared now, the engine busy
                started[0][2] = _prepared_now(self._prepare, started[0][0], started[0][1])
            if running is not None:
                yield from self._finish(running)
                timer.batch_finished(prepared.host_share, len(running.prepared.names))
            running = launched
            if not self.launch_ahead:
                yield from self._finish(running)
                timer.batch_finished(prepared.host_share, len(prepared.names))
                running = None
        if running is not None:
            yield from self._finish(running)

    def _on_device(self, chunk: list) -> bool:
        """Whether every item of the chunk is a frame already in the engine's CUDA memory (a camera
        SDK's or NVDEC's frames): preparing it only launches a copy."""
        if self.device.type != "cuda":
            return False
        frames = [item.frame if isinstance(item, FrameSource) else item for item in chunk]
        return all(isinstance(f, torch.Tensor) and f.device == self.device and f.dim() == 3 for f in frames)

    def _frames_of(self, items) -> Iterable:
        if isinstance(items, (str, os.PathLike)):
            if not is_video_path(items):
                return [items]  # one image
            items = VideoSource(items, device=self.device)
        if isinstance(items, VideoSource):
            return ConcurrentStreams([items])
        return items

    def run(self, items: Iterable) -> list[PipelineResult]:
        return list(self.stream(items))


def _prepared_now(prepare: Callable, *args) -> Future:
    """`prepare(*args)` run in this thread, as a Future (its exception too, raised at `result()`,
    where a worker's would be)."""
    future: Future = Future()
    try:
        future.set_result(prepare(*args))
    except Exception as exc:  # noqa: BLE001 - re-raised by result(), in the order a worker's would be
        future.set_exception(exc)
    return future
