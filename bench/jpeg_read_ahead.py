"""JPEG files → boxes with the pipeline's files read ahead on a thread of their own, and a batch's
host share started decoding when its files are read (read_ahead.py), against the same pipeline
reading each batch's files on its worker and starting its host share with its nvJPEG decode, as it
did before (issue 30), at each host share asked.

One process, one engine; the two ways alternate (A B A B ...) so the machine's drift falls on both.
Each run is `sartor bench --end-to-end`'s `end_to_end` (steady state after a first pass).

`--switch-interval-ms` sets Python's switch interval first (default 5 ms): how long a thread back from
native code (a host decode) may wait for the GIL while another runs Python (bench/gil_handoff.py).

    PYTHONPATH=. python bench/jpeg_read_ahead.py ENGINE.plan --images DIR [--shares 0,0.25] [--rounds 3]"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import sartor  # noqa: E402
from sartor.pipeline import pipeline as pipeline_module  # noqa: E402
from sartor.pipeline.benchmark import end_to_end, image_files  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("engine")
    parser.add_argument("--images", required=True)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--shares", default="0")
    parser.add_argument("--switch-interval-ms", type=float, default=None)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--passes", type=int, default=4)
    args = parser.parse_args()
    if args.switch_interval_ms is not None:
        sys.setswitchinterval(args.switch_interval_ms / 1e3)
    engine = sartor.load(args.engine)
    files = image_files(args.images)
    read_ahead = pipeline_module.read_ahead
    ways = {"read ahead (now)": read_ahead, "read by the worker (before)": lambda chunks, *args, **kwargs: chunks}
    rates: dict[tuple[str, float], list[float]] = {}
    for _ in range(args.rounds):
        for share in (float(s) for s in args.shares.split(",")):
            for name, way in ways.items():
                pipeline_module.read_ahead = way
                result = end_to_end(engine, files, batch=args.batch, passes=args.passes, host_decode_share=share)
                rates.setdefault((name, share), []).append(result.frames_per_s)
                print(f"{name}, share {share:g}: {result.frames_per_s:,.0f} frames/s, p50 {result.batch_ms_p50} ms, "
                      f"engine alone {result.engine_frames_per_s:,.0f} frames/s, stages {result.stages_ms}", flush=True)
    pipeline_module.read_ahead = read_ahead
    print(f"| files and host share | host share | frames/s, median of {args.rounds} | each run |\n|---|---|---|---|")
    for (name, share), values in rates.items():
        print(f"| {name} | {share:g} | {statistics.median(values):,.0f} | {', '.join(f'{v:,.0f}' for v in values)} |")

if __name__ == "__main__":
    main()
