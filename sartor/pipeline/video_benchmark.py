"""`sartor bench --end-to-end --video FILE [--streams N]`: N video streams decoded at once (N copies
of one file, or N files), each on a decoder thread of its own, their frames batched together into
the engine through `Pipeline`, timed as a user sees them.

- passes: every stream from its first frame to its last, `passes` times; the first pass (graph
  capture, kernel loads, buffers, decoder start-up) is reported apart, the others make the steady
  state: frames/s over all streams, and each frame's latency from leaving its decoder to its result
  (p50, p99).
- stages: one batch through each stage alone, synchronised: decode (one stream's decoder over its
  first few batches' frames, its time per frame times the batch), preprocess, infer, post; and the
  engine alone at the same batch.
"""
from __future__ import annotations

import itertools
import os
import statistics
import time
from dataclasses import asdict, dataclass, field

from ..errors import ConfigError, DataError
from .benchmark import bench_pipeline, median_ms, percentile, stages_after_decode
from .decode import decode_frames
from .streams import ConcurrentStreams
from .video import VideoSource, choose_video_decoder

DECODE_SAMPLE_BATCHES = 4  # the decode stage is timed over this many batches' worth of one stream's frames


@dataclass
class VideoEndToEndResult:
    device: str
    video_decoder: str  # pyav (CPU threads) or nvdec
    streams: int
    videos: list
    frames: int  # one pass, all streams
    batch: int
    passes: int
    decoder: str  # the post-processing
    first_pass_s: float
    frames_per_s: float  # steady state: passes after the first, all streams together
    latency_ms_p50: float  # one frame, from leaving its decoder to its result; steady state
    latency_ms_p99: float
    engine_frames_per_s: float  # the engine alone, its input already in place
    stages_ms: dict = field(default_factory=dict)  # one batch through each stage alone

    def to_json(self) -> dict:
        return asdict(self)


def stream_files(videos: list, streams: int | None) -> list[str]:
    """One path per stream: `streams` copies of one file, or the files given, one stream each."""
    if not videos:
        raise ConfigError("--video FILE is needed")
    if streams is not None and streams < 1:
        raise ConfigError(f"--streams must be at least 1, not {streams}")
    for path in videos:
        if not os.path.isfile(path):
            raise ConfigError(f"--video {path}: " + ("a folder, not a video file" if os.path.isdir(path)
                                                     else "no such file"))
    if len(videos) == 1:
        return [os.fspath(videos[0])] * (streams or 1)
    if streams not in (None, len(videos)):
        raise ConfigError(f"--streams {streams} with {len(videos)} --video files: give one file (played "
                          f"{streams} times) or {streams} files")
    return [os.fspath(v) for v in videos]


def _streams(paths: list[str], device, video_decoder: str) -> ConcurrentStreams:
    return ConcurrentStreams([VideoSource(p, device=device, decoder=video_decoder, name=f"stream {k}: {p}")
                              for k, p in enumerate(paths)])


def _one_pass(pipeline, paths: list[str], video_decoder: str) -> tuple[int, float, list[float]]:
    """(frames, seconds, each frame's latency in ms) of every stream played once."""
    streams = _streams(paths, pipeline.device, video_decoder)
    latencies, start = [], time.perf_counter()
    for result in pipeline.stream(streams):
        latencies.append((time.perf_counter() - streams.decoded_at[result.name]) * 1e3)
    return len(latencies), time.perf_counter() - start, latencies


def video_end_to_end(engine, videos: list, streams: int | None = None, batch: int | None = None, passes: int = 3,
                     stage_repeats: int = 5, decoder: str = "auto",
                     video_decoder: str = "auto", max_downscale: float | str | None = None) -> VideoEndToEndResult:
    if passes < 2:
        raise ConfigError(f"--passes must be at least 2 (the first is reported apart), not {passes}")
    paths = stream_files(videos, streams)
    pipeline, post, decoder = bench_pipeline(engine, batch, decoder, max_downscale)
    device = pipeline.device
    video_decoder = choose_video_decoder(video_decoder, device)

    frames, first_pass_s, _ = _one_pass(pipeline, paths, video_decoder)
    if not frames:
        raise DataError(f"--video {paths[0]}: no frames decoded")
    total_s, latencies = 0.0, []
    for _ in range(passes - 1):
        _, seconds, pass_latencies = _one_pass(pipeline, paths, video_decoder)
        total_s += seconds
        latencies += pass_latencies

    # each stage alone: one stream's decoder over its first frames (opening the file included, as
    # a stream starts), then the first batch of them; never the whole clip in memory
    rows = max(pipeline.batch_size, pipeline.min_batch)
    first = VideoSource(paths[0], device=device, decoder=video_decoder)
    clip = list(itertools.islice(first, rows * DECODE_SAMPLE_BATCHES))
    decode_ms = median_ms(lambda: sum(1 for _ in itertools.islice(first, len(clip))), device, stage_repeats)
    decode_ms_per_frame = decode_ms / len(clip)
    chunk = (clip * (rows // len(clip) + 1))[:rows]
    decoded = decode_frames(chunk, device, pipeline.buckets, pipeline.fast_decode)
    stages, engine_frames_per_s = stages_after_decode(engine, pipeline, post, decoded, stage_repeats)
    stages = {"decode": round(decode_ms_per_frame * rows, 4)} | stages
    return VideoEndToEndResult(str(device), video_decoder, len(paths), sorted(set(paths)), frames,
                               pipeline.batch_size, passes, decoder, round(first_pass_s, 3),
                               round(frames * (passes - 1) / total_s, 1), round(statistics.median(latencies), 3),
                               round(percentile(latencies, 0.99), 3), engine_frames_per_s, stages)
