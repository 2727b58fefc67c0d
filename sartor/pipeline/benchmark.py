"""`sartor bench --end-to-end`: image files to results through `Pipeline`, timed as a user sees
them, beside each stage alone and the engine alone.

- passes: the whole list of images run through the pipeline `passes` times; the first pass (CUDA
  graph capture, kernel loads, buffer allocation) is reported apart, the others make the steady
  state: frames/s and the per-batch takt (median and p99 of one batch's time in the stream). The
  steady passes run as one stream, as a camera's frames keep coming, timed from its first batch's
  results: the pipeline fills once, as it does on a device, and not once a pass (its workers'
  batches in flight, which a pass of 16 batches would pay again at every start).
- stages: one batch through each stage alone, synchronised, `stage_repeats` times: read (file
  bytes), decode, preprocess (into the engine's input), infer (the engine on that input), post
  (the decoder, and the copy of what it keeps to the host).
- engine: the engine alone on its own input buffer, at the same batch.
- decoders: that batch's decode run back to back on as many threads as the pipeline has workers,
  each on a stream of its own (on CUDA, each thread's batches on an nvJPEG decoder of its own): the
  decode alone, as the pipeline could feed it; `ceiling_share` is the steady state's frames/s over
  the lower of that and the engine alone.
- host_decode_share "auto": the first pass, and more passes until the pipeline has chosen its share
  (`host_share.py`), are the warm-up; the steady state runs at the share chosen.

With resolution buckets the passes route every image as the pipeline does (`buckets`: how many
images each bucket ran); the stages and the engine alone are timed in the bucket most images went
to (`stage_bucket`), on a batch of that bucket's images.
"""
from __future__ import annotations

import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from ..errors import ConfigError
from ..runtime.benchmark import synchronize
from ..runtime.hardware_queues import in_effect
from .decode import decode_frames
from .detections import EngineNms, YoloNms
from .pipeline import Pipeline
from .prepare import prepare_batch
from .sources import read_sources

IN_ENGINE_NMS = "in-engine nms"  # the decoder an engine built with --nms reports
IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".bmp", ".webp")
MAX_SEARCH_PASSES = 20  # warm-up passes more than the first, for "auto" to time every candidate share


def image_files(folder: str | Path) -> list[Path]:
    """The image files directly in `folder` or below it, sorted; none is an error."""
    root = Path(folder)
    if not root.is_dir():
        raise ConfigError(f"--images {folder}: not a folder")
    files = sorted(p for p in root.rglob("*") if p.suffix.lower() in IMAGE_SUFFIXES and p.is_file())
    if not files:
        raise ConfigError(f"--images {folder}: no image files ({', '.join(IMAGE_SUFFIXES)}) in it")
    return files


def median_ms(fn, device: torch.device, repeats: int) -> float:
    fn()
    synchronize(device)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        synchronize(device)
        times.append((time.perf_counter() - start) * 1e3)
    return round(statistics.median(times), 4)


@dataclass
class EndToEndResult:
    device: str
    images: int
    batch: int
    passes: int
    decoder: str
    first_pass_s: float
    frames_per_s: float  # steady state: passes after the first
    batch_ms_p50: float  # one batch's time in the stream, steady state
    batch_ms_p99: float
    engine_frames_per_s: float  # the engine alone, its input already in place
    stages_ms: dict = field(default_factory=dict)  # one batch through each stage alone
    buckets: dict = field(default_factory=dict)  # "HxW" input size -> images a pass ran at it
    stage_bucket: str = ""  # the input size the stages and the engine alone were timed at
    host_decode_share: float | str = 0.0  # of the JPEGs nvJPEG would decode, the share decoded on the host
    host_share_chosen: float | None = None  # the share the steady state ran at ("auto" chose it)
    host_share_ms_per_frame: dict = field(default_factory=dict)  # "auto": each candidate's median, warm-up
    host_decode_threads: int | None = None  # the host pool's threads (None: no pool)
    decode_frames_per_s: float = 0.0  # the decode alone, `decode_workers` batches at once
    decode_workers: int = 0
    ceiling_share: float = 0.0  # frames_per_s ÷ the lower of the engine and the decode alone
    hardware_queues: int | None = None  # CUDA's hardware work queues for this process's streams (CUDA only)

    def to_json(self) -> dict:
        return asdict(self)


def bench_pipeline(engine, batch: int | None, decoder: str, max_downscale: float | str | None = None,
                   host_decode_share: float | str = 0.0,
                   host_decode_threads: int | None = None) -> tuple[Pipeline, object, str]:
    """(the pipeline, its post-processing or None, the post-processing's name) for `--decoder`."""
    nms = YoloNms()
    head = next((o for o in engine.outputs if o.shape is not None and len(o.shape) == 3), None)
    if decoder not in ("auto", "yolo", "none"):
        raise ConfigError(f"--decoder {decoder!r} is not one of auto, yolo, none")
    if engine.nms is not None and decoder != "none":  # NMS inside the engine: only what it kept is copied out
        decoder, nms = IN_ENGINE_NMS, EngineNms(engine.nms)
    if decoder == "auto":
        decoder = "yolo" if head is not None and len(engine.outputs) == 1 else "none"
    post = nms if decoder != "none" else None
    return (Pipeline(engine, batch_size=batch, decoder=post, host_outputs=post is None, max_downscale=max_downscale,
                     host_decode_share=host_decode_share, host_decode_threads=host_decode_threads), post, decoder)


def stages_after_decode(engine, pipeline: Pipeline, post, decoded: list, repeats: int) -> tuple[dict, float]:
    """({preprocess, infer, post: ms of one batch alone}, the engine alone in frames/s) on `decoded`,
    one batch of decoded frames, all of one bucket (the pipeline routes them)."""
    device = pipeline.device
    frames, names, sizes = [d.pixels for d in decoded], [d.name for d in decoded], [d.size for d in decoded]
    spec, profile, _ = pipeline.bucket_profile(pipeline.bucket_of(*sizes[0]))
    shape = spec.input_shape(len(frames))
    context = engine.context(profile)
    buffer = context.input_buffers({pipeline.input_name: shape})[pipeline.input_name] if shape else None
    prepared, metas = prepare_batch(frames, names, spec, buffer, orig_sizes=sizes)
    outputs = context.run({pipeline.input_name: prepared})
    stages = {"preprocess": median_ms(lambda: prepare_batch(frames, names, spec, buffer, orig_sizes=sizes), device,
                                       repeats),
              "infer": median_ms(lambda: context.run({pipeline.input_name: prepared}), device, repeats)}
    if post is not None:
        stages["post"] = median_ms(lambda: post(outputs, metas), device, repeats)
    else:
        stages["post"] = median_ms(lambda: {k: v.cpu() for k, v in outputs.items()}, device, repeats)
    engine_ms = median_ms(lambda: context.run({pipeline.input_name: prepared}), device, max(repeats, 20))
    return stages, round(len(frames) * 1e3 / engine_ms, 1)


def decoders_frames_per_s(decode, frames: int, device: torch.device, workers: int, repeats: int) -> float:
    """Frames/s of `decode` (one batch of `frames`) run `repeats` times back to back on each of
    `workers` threads at once, each thread on a stream of its own (CUDA) and waiting for its own work."""
    def batches() -> None:
        stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        with torch.cuda.stream(stream) if stream is not None else nullcontext():
            for _ in range(repeats):
                decode()
                if stream is not None:
                    stream.synchronize()
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="sartor-bench-decode") as pool:
        start = time.perf_counter()
        for future in [pool.submit(batches) for _ in range(workers)]:
            future.result()  # a decode that raised raises here
        seconds = time.perf_counter() - start
    return round(workers * repeats * frames / seconds, 1)


def percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]


def steady_state(pipeline: Pipeline, items: list, batch: int) -> tuple[float, list[float]]:
    """(frames/s, each batch's ms) of `items` through the pipeline as one stream, timed from the
    first batch's results (the pipeline filled) to the last; from the stream's start when it is one
    batch."""
    start = time.perf_counter()
    marks = []  # when each batch's last result came out
    for index, _ in enumerate(pipeline.stream(items)):
        if (index + 1) % batch == 0 or index + 1 == len(items):
            marks.append(time.perf_counter())
    if len(marks) < 2:
        return len(items) / (marks[0] - start), [(marks[0] - start) * 1e3]
    batch_times = [(b - a) * 1e3 for a, b in zip(marks, marks[1:])]
    return (len(items) - min(batch, len(items))) / (marks[-1] - marks[0]), batch_times


def end_to_end(engine, files: list, batch: int | None = None, passes: int = 3, stage_repeats: int = 10,
               decoder: str = "auto", max_downscale: float | str | None = None,
               host_decode_share: float | str = 0.0, host_decode_threads: int | None = None) -> EndToEndResult:
    if passes < 2:
        raise ConfigError(f"--passes must be at least 2 (the first is reported apart), not {passes}")
    pipeline, post, decoder = bench_pipeline(engine, batch, decoder, max_downscale, host_decode_share,
                                             host_decode_threads)
    device = pipeline.device
    batch = pipeline.batch_size

    # whole passes: the first apart, then the steady state, each batch's time between results
    start = time.perf_counter()
    ran_at = ["x".join(map(str, result.meta.input_size)) for result in pipeline.stream(files)]  # each file's bucket
    for _ in range(MAX_SEARCH_PASSES):
        if pipeline.host_share_chosen is not None:
            break
        for _ in pipeline.stream(files):  # "auto" still timing its candidates: warm-up too
            pass
    first_pass_s = time.perf_counter() - start
    routed = {size: ran_at.count(size) for size in sorted(set(ran_at))}
    frames_per_s, batch_times = steady_state(pipeline, files * (passes - 1), batch)

    # each stage alone on a batch of the images of the bucket most of them ran in
    stage_bucket = max(routed, key=lambda size: routed[size])
    of_bucket = [f for f, size in zip(files, ran_at) if size == stage_bucket]
    bucket = next(k for k, s in enumerate(pipeline.buckets.specs) if f"{s.height}x{s.width}" == stage_bucket) \
        if len(pipeline.buckets) > 1 else 0
    rows = max(batch, pipeline.bucket_profile(bucket)[2])
    chunk = (of_bucket * (rows // len(of_bucket) + 1))[:rows]
    sources = read_sources(chunk)
    share = pipeline.host_share_chosen
    if share is None:
        raise ConfigError(f"--host-decode-share auto: no share chosen after {MAX_SEARCH_PASSES + 1} passes over "
                          f"{len(files)} images; give more images (each share is timed over several batches)")
    decode = lambda: decode_frames(sources, device, pipeline.buckets, pipeline.fast_decode,  # noqa: E731
                                   share, pipeline.host_pool, pipeline.host_slots)
    decoded = decode()
    bad = [d.error for d in decoded if d.error is not None]
    if bad:
        raise ConfigError(f"--images: {bad[0]}")
    stages = {"read": median_ms(lambda: read_sources(chunk), device, stage_repeats),
              "decode": median_ms(decode, device, stage_repeats)}
    decode_rate = decoders_frames_per_s(decode, len(sources), device, pipeline.prepare_ahead, stage_repeats)
    after, engine_frames_per_s = stages_after_decode(engine, pipeline, post, decoded, stage_repeats)
    return EndToEndResult(str(device), len(files), batch, passes, decoder, round(first_pass_s, 3),
                          round(frames_per_s, 1), round(statistics.median(batch_times), 3),
                          round(percentile(batch_times, 0.99), 3), engine_frames_per_s, stages | after,
                          routed, stage_bucket, pipeline.host_decode_share, share,
                          pipeline.host_share_search.medians_ms() if pipeline.host_share_search else {},
                          pipeline.host_decode_threads, decode_rate, pipeline.prepare_ahead,
                          round(frames_per_s / min(engine_frames_per_s, decode_rate), 3),
                          in_effect() if device.type == "cuda" else None)
