"""JPEG files → boxes with the pipeline's files read ahead on a thread of their own, against the same
pipeline reading each batch's files on its worker before decoding them, as it did before (issue 30).

One process, one engine; the two ways alternate (A B A B ...) so the machine's drift falls on both.
Each run is `sartor bench --end-to-end`'s `end_to_end` (steady state after a first pass).

    PYTHONPATH=. python bench/jpeg_read_ahead.py ENGINE.plan --images DIR [--rounds 3] [--batch 32]"""
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
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--passes", type=int, default=4)
    args = parser.parse_args()
    engine = sartor.load(args.engine)
    files = image_files(args.images)
    read_ahead = pipeline_module._files_read_ahead
    ways = {"files read ahead (now)": read_ahead,
            "files read by the worker (before)": lambda chunks, reader, frame_order: chunks}
    rates: dict[str, list[float]] = {name: [] for name in ways}
    for _ in range(args.rounds):
        for name, way in ways.items():
            pipeline_module._files_read_ahead = way
            result = end_to_end(engine, files, batch=args.batch, passes=args.passes)
            rates[name].append(result.frames_per_s)
            print(f"{name}: {result.frames_per_s:,.0f} frames/s, p50 {result.batch_ms_p50} ms, "
                  f"stages {result.stages_ms}", flush=True)
    pipeline_module._files_read_ahead = read_ahead
    print(f"| way | frames/s, median of {args.rounds} | each run |\n|---|---|---|")
    for name, values in rates.items():
        print(f"| {name} | {statistics.median(values):,.0f} | {', '.join(f'{v:,.0f}' for v in values)} |")


if __name__ == "__main__":
    main()
