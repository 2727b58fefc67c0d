"""NVDEC video streams to boxes with PyNvVideoCodec's SimpleDecoder (decoding in the calling
thread, the default) against its ThreadedDecoder (decoding ahead on a thread of its own), in one
process over one engine: `video_end_to_end` at each read-ahead, 0 being SimpleDecoder; with
`--copies stack,clone`, also each way of copying a call's frames off the decoder's surfaces (one
stack a call, as the pipeline does, or a clone a frame, as it did), the ways alternating.

    python bench/nvdec_read_ahead.py ENGINE.plan clip.mp4 [--streams 1,8,32] [--read-ahead 0,32] [--switch-interval-ms 5]
        [--copies stack,clone] [--rounds 2]"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import sartor  # noqa: E402
from sartor.pipeline import video_nvdec  # noqa: E402
from sartor.pipeline.video_benchmark import video_end_to_end  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("engine")
    parser.add_argument("video")
    parser.add_argument("--streams", default="1,8,32")
    parser.add_argument("--read-ahead", default="0,32")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--passes", type=int, default=3)
    parser.add_argument("--switch-interval-ms", type=float, default=None,
                        help="Python's switch interval (default 5 ms): how long a decoder thread back from the "
                             "decoder may wait for the GIL while another runs Python (bench/gil_handoff.py)")
    parser.add_argument("--copies", default="stack", help="stack, clone or both, comma-separated")
    parser.add_argument("--rounds", type=int, default=1)
    args = parser.parse_args()
    copies = {"stack": video_nvdec.copied_frames,
              "clone": lambda batch: [torch.from_dlpack(frame).clone() for frame in batch]}
    if args.switch_interval_ms is not None:
        sys.setswitchinterval(args.switch_interval_ms / 1e3)
    engine = sartor.load(args.engine)
    print("| streams | read-ahead | copies | frames/s | first pass s | p50 / p99 ms | decode stage ms a batch | "
          "engine alone |")
    print("|---|---|---|---|---|---|---|---|")
    for _ in range(args.rounds):
        for streams in (int(s) for s in args.streams.split(",")):
            for read_ahead in (int(r) for r in args.read_ahead.split(",")):
                for way in args.copies.split(","):
                    video_nvdec.READ_AHEAD_FRAMES = read_ahead
                    video_nvdec.copied_frames = copies[way]
                    row(engine, args, streams, read_ahead, way)
    video_nvdec.copied_frames = copies["stack"]


def row(engine, args, streams: int, read_ahead: int, way: str) -> None:
    try:
        r = video_end_to_end(engine, [args.video], streams=streams, batch=args.batch, passes=args.passes,
                             video_decoder="nvdec")
    except Exception as exc:  # noqa: BLE001 - the other rows are still worth timing
        print(f"| {streams} | {read_ahead} | {way} | failed: {type(exc).__name__}: {str(exc)[:200]} |||||", flush=True)
        return
    print(f"| {streams} | {read_ahead} | {way} | {r.frames_per_s:,.0f} | {r.first_pass_s:.2f} | "
          f"{r.latency_ms_p50:.1f} / {r.latency_ms_p99:.1f} | {r.stages_ms.get('decode', float('nan')):.1f} | "
          f"{r.engine_frames_per_s:,.0f} |", flush=True)


if __name__ == "__main__":
    main()
