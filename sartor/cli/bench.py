"""`sartor bench PLAN`: latency percentiles and throughput, with and without host↔device copies."""
from __future__ import annotations

from ..errors import ConfigError
from ..runtime import load
from ..runtime.benchmark import benchmark
from ..runtime.profiles import parse_shape_spec
from .common import add_trust_arg, console, fmt_shape, key_values, print_json, table

DESCRIPTION = ("Time an engine: p50/p90/p99 latency and throughput, with host↔device copies (numpy in/out) "
               "and without (device tensors in, outputs left on the device). With --end-to-end --images DIR: "
               "image files to results through the engine's stored preprocessing (decode, preprocess, infer, "
               "post-process), beside each stage alone and the engine alone; with --end-to-end --video FILE "
               "[--streams N]: N video streams decoded at once, their frames batched together into the engine.")


def add_parser(subparsers, parents) -> None:
    p = subparsers.add_parser("bench", parents=parents, help="Time an engine", description=DESCRIPTION)
    p.add_argument("plan", metavar="PLAN", help="the engine file")
    p.add_argument("--shapes", metavar="NAME:8x3x320x320[,...]",
                   help="input shapes (default: profile 0's opt shapes)")
    p.add_argument("--iterations", type=int, default=100, help="timed runs per mode (default 100)")
    p.add_argument("--warmup", type=int, default=10, help="untimed runs before timing, per mode (default 10)")
    p.add_argument("--device", help="cpu or cuda[:N] (default: the kind the engine was built for)")
    add_trust_arg(p)
    p.add_argument("--seed", type=int, default=0, help="seed of the random inputs (default 0)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("--aux-streams", type=int, default=None, metavar="N",
                   help="run the engine's independent branches on N more CUDA streams (0 to 8; default: the "
                        "count its build chose, `sartor inspect` shows it; CUDA engines, ignored on the CPU; "
                        "like trtexec --maxAuxStreams)")
    p.add_argument("--per-layer", action="store_true",
                   help="a profiling run apart from the timed one: each layer's median time, share, tactic, "
                        "precision and ONNX nodes, slowest first")
    p.add_argument("--nvtx", action="store_true",
                   help="with --per-layer on CUDA: an NVTX range per layer, named after it, for Nsight Systems")
    p.add_argument("--end-to-end", action="store_true",
                   help="time image files to results through sartor.Pipeline (needs --images)")
    p.add_argument("--images", metavar="DIR", help="with --end-to-end: a folder of JPEG/PNG files (read below it)")
    p.add_argument("--video", metavar="FILE", action="append",
                   help="with --end-to-end: a video file (H.264/H.265 MP4, ...); repeat for one stream per file")
    p.add_argument("--streams", type=int,
                   help="with --end-to-end --video: concurrent streams, each its own decoder thread (default: one "
                        "per --video file; with one file, N copies of it)")
    p.add_argument("--video-decoder", default="auto", choices=("auto", "pyav", "nvdec"),
                   help="with --video: pyav (CPU threads) or nvdec (PyNvVideoCodec; auto: nvdec for a CUDA engine "
                        "when it is installed)")
    p.add_argument("--batch", type=int, help="with --end-to-end: images per batch (default: the profile's, up to 32)")
    p.add_argument("--passes", type=int, default=3,
                   help="with --end-to-end: passes over the images; the first is reported apart (default 3)")
    p.add_argument("--decoder", default="auto", choices=("auto", "yolo", "none"),
                   help="with --end-to-end: post-processing (auto: yolo for one [B, 4+C, N] output)")
    p.add_argument("--max-downscale", metavar="X|any",
                   help="with --end-to-end: the most a frame may be shrunk to fit the engine's largest resolution "
                        "bucket, instead of the engine's policy (a factor ≥ 1, or any)")
    p.add_argument("--host-decode-share", default="0", metavar="S|auto",
                   help="with --end-to-end --images on a CUDA engine: decode this share (0 to 1) of each batch's "
                        "JPEGs on the host's CPUs while nvJPEG decodes the rest (default 0: nvJPEG alone); auto: "
                        "the share whose batches come out fastest, timed over the first batches")
    p.add_argument("--host-decode-threads", type=int, metavar="N",
                   help="with --host-decode-share: the host threads that decode (default: the CPUs this process "
                        "may use)")
    p.set_defaults(func=run)


def parse_host_share(text: str) -> float | str:
    if text == "auto":
        return text
    try:
        return float(text)
    except ValueError:
        raise ConfigError(f"--host-decode-share {text!r} is neither a share (0 to 1) nor auto") from None


def run(args) -> int:
    args.host_decode_share = parse_host_share(args.host_decode_share)
    if args.aux_streams is not None and (args.per_layer or args.end_to_end or args.images or args.video
                             or args.streams is not None):
        raise ConfigError("--aux-streams goes with the engine's own benchmark (not --per-layer or --end-to-end)")
    if args.host_decode_threads is not None and not args.host_decode_share:
        raise ConfigError("--host-decode-threads goes with --host-decode-share (a share above 0, or auto)")
    if args.host_decode_share and (args.video or not args.images):
        raise ConfigError("--host-decode-share goes with --end-to-end --images (JPEG files; video frames are decoded "
                          "by their stream's decoder)")
    if args.per_layer:
        from .bench_layers import run_per_layer
        return run_per_layer(args)
    if args.nvtx:
        raise ConfigError("--nvtx goes with --per-layer (the timed runs replay CUDA graphs, where ranges show nothing)")
    if args.video or args.streams is not None:
        return run_video_end_to_end(args)
    if args.end_to_end or args.images:
        return run_end_to_end(args)
    if args.max_downscale is not None:
        raise ConfigError("--max-downscale goes with --end-to-end (frames routed to the engine's resolution buckets)")
    shapes = parse_shape_spec(args.shapes) if args.shapes else None
    engine = load(args.plan, device=args.device, trust=args.trust)
    result = benchmark(engine, shapes, iterations=args.iterations, warmup=args.warmup, seed=args.seed,
                       aux_streams=args.aux_streams)
    if args.json:
        print_json(dict(result.to_json(), engine=str(args.plan)))
        return 0
    out = console()
    out.print(key_values("Benchmark", [
        ("engine", args.plan), ("device", result.device),
        ("shapes", ", ".join(f"{k} {fmt_shape(v)}" for k, v in result.shapes.items())),
        ("profile", result.profile), ("batch", result.batch),
        ("iterations", f"{result.iterations} timed after {result.warmup} warm-up, per mode"),
        *([("streams", f"the context's and {result.aux_streams} auxiliary")] if result.aux_streams else []),
    ]))
    rows = table("Latency (ms) and throughput", "mode", "p50", "p90", "p99", "mean", "min", "inputs/s")
    for mode, stats in (("with host↔device copies", result.with_copies), ("device only", result.device_only)):
        rows.add_row(mode, *(f"{v:.3f}" for v in (stats.p50_ms, stats.p90_ms, stats.p99_ms, stats.mean_ms,
                                                    stats.min_ms)), f"{stats.throughput:.1f}")
    out.print(rows)
    return 0


def run_end_to_end(args) -> int:
    from ..pipeline.benchmark import end_to_end, image_files
    if not args.end_to_end or not args.images:
        raise ConfigError("--end-to-end and --images DIR go together")
    files = image_files(args.images)
    engine = load(args.plan, device=args.device, trust=args.trust)
    result = end_to_end(engine, files, batch=args.batch, passes=args.passes, decoder=args.decoder,
                        max_downscale=args.max_downscale, host_decode_share=args.host_decode_share,
                        host_decode_threads=args.host_decode_threads)
    if args.json:
        print_json(dict(result.to_json(), engine=str(args.plan)))
        return 0
    out = console()
    out.print(key_values("End to end", [
        ("engine", args.plan), ("device", result.device), ("images", f"{result.images} from {args.images}"),
        ("batch", result.batch), ("post-processing", result.decoder),
        *([("host decode", host_share_line(result))] if result.host_decode_share else []),
        *([("buckets", ", ".join(f"{size}: {n} images" for size, n in result.buckets.items())
            + f"; stages timed at {result.stage_bucket}")] if len(result.buckets) > 1 else []),
        ("first pass", f"{result.first_pass_s:.2f} s (warm-up: graph capture and kernel loads on a GPU; "
                       f"reported apart)"),
        ("steady state", f"{result.frames_per_s:.1f} frames/s over {result.passes - 1} "
                         f"pass{'es' if result.passes > 2 else ''} as one stream, from its first batch's results; "
                         f"a batch every {result.batch_ms_p50:.2f} ms (p99 {result.batch_ms_p99:.2f})"),
        ("engine alone", f"{result.engine_frames_per_s:.1f} frames/s (input already in place)"),
        ("decode alone", f"{result.decode_frames_per_s:.1f} frames/s ({result.decode_workers} batches at once, "
                         f"as the pipeline's workers decode)"),
        ("of the lower", f"{result.ceiling_share:.1%} (steady state ÷ the lower of the engine and the decode alone)"),
        *([("hardware queues", f"{result.hardware_queues} (CUDA_DEVICE_MAX_CONNECTIONS: the streams' work queues)")]
          if result.hardware_queues is not None else []),
    ]))
    rows = table("One batch through each stage alone (ms)", "read", "decode", "preprocess", "infer", "post")
    rows.add_row(*(f"{result.stages_ms[k]:.3f}" for k in ("read", "decode", "preprocess", "infer", "post")))
    out.print(rows)
    return 0


def run_video_end_to_end(args) -> int:
    from ..pipeline.video_benchmark import video_end_to_end
    if not args.end_to_end or not args.video:
        raise ConfigError("--end-to-end and --video FILE go together (--streams too)")
    if args.images:
        raise ConfigError("--images and --video: time one or the other")
    engine = load(args.plan, device=args.device, trust=args.trust)
    result = video_end_to_end(engine, args.video, streams=args.streams, batch=args.batch, passes=args.passes,
                              decoder=args.decoder, video_decoder=args.video_decoder,
                              max_downscale=args.max_downscale)
    if args.json:
        print_json(dict(result.to_json(), engine=str(args.plan)))
        return 0
    out = console()
    out.print(key_values("End to end, video", [
        ("engine", args.plan), ("device", result.device),
        ("streams", (f"{result.streams} ({', '.join(result.videos)}), decoded by {result.video_decoder}, "
                     f"{result.frames} frames a pass")),
        ("batch", f"{result.batch} frames across the streams"), ("post-processing", result.decoder),
        ("first pass", (f"{result.first_pass_s:.2f} s (warm-up: graph capture, kernel loads, decoder start; "
                        f"reported apart)")),
        ("steady state", (f"{result.frames_per_s:.1f} frames/s over {result.passes - 1} "
                          f"pass{'es' if result.passes > 2 else ''}; a frame's latency from its decoder to its "
                          f"result {result.latency_ms_p50:.2f} ms (p99 {result.latency_ms_p99:.2f})")),
        ("engine alone", f"{result.engine_frames_per_s:.1f} frames/s (input already in place)"),
    ]))
    rows = table("One batch through each stage alone (ms)", "decode", "preprocess", "infer", "post")
    rows.add_row(*(f"{result.stages_ms[k]:.3f}" for k in ("decode", "preprocess", "infer", "post")))
    out.print(rows)
    return 0


def host_share_line(result) -> str:
    line = (f"{result.host_share_chosen:.0%} of the JPEGs on {result.host_decode_threads} host threads, "
            f"the rest by nvJPEG")
    if result.host_decode_share != "auto":
        return line
    timed = ", ".join(f"{float(share):.0%} {ms:.3f}" for share, ms in result.host_share_ms_per_frame.items())
    return f"{line}; chosen by timing the warm-up's batches (ms a frame: {timed})"

