"""JPEG files → boxes through the Pipeline alone, per count of preparing workers (issue 30: on a host
that holds the Pipeline, do three workers contend for the interpreter lock more than they overlap?).

Each figure is `benchmark.steady_state` over the files cycled `--passes` times, the Pipeline as
`sartor bench --end-to-end` makes it, with `PREPARE_AHEAD` set to each of `--workers` before it is
made (the batches prepared at once, and the staging buffers one more than that). Rounds alternate
the counts, so drift shows as spread. Nothing else runs: run it under `py-spy record --gil` to see
which Python holds the lock (`bench/py_spy_summary.py` reads the raw output).

    PYTHONPATH=. python bench/pipeline_workers.py ENGINE.plan --images DIR [--workers 2,3] [--rounds 3]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import sartor  # noqa: E402
from sartor.pipeline import pipeline as pipeline_module  # noqa: E402
from sartor.pipeline.benchmark import bench_pipeline, image_files, steady_state  # noqa: E402
from sartor.runtime.hardware_queues import in_effect  # noqa: E402


def pipeline_with(engine, workers: int):
    """The end-to-end bench's Pipeline with `workers` batches prepared at once."""
    kept = pipeline_module.PREPARE_AHEAD
    pipeline_module.PREPARE_AHEAD = workers
    try:
        return bench_pipeline(engine, None, "auto")[0]
    finally:
        pipeline_module.PREPARE_AHEAD = kept


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("engine")
    parser.add_argument("--images", required=True)
    parser.add_argument("--workers", default="2,3")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--passes", type=int, default=6, help="passes over the files each figure times")
    args = parser.parse_args()

    engine = sartor.load(args.engine)
    files = image_files(args.images)
    pipelines = {w: pipeline_with(engine, int(w)) for w in args.workers.split(",")}
    for pipeline in pipelines.values():
        steady_state(pipeline, list(files), pipeline.batch_size)  # warm-up: graphs captured, decoders made
    device = next(iter(pipelines.values())).device
    queues = in_effect() if device.type == "cuda" else None
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"{name}, torch {torch.__version__}, {len(files)} files, hardware queues {queues}", flush=True)
    for r in range(1, args.rounds + 1):
        row = {w: steady_state(p, list(files) * args.passes, p.batch_size)[0] for w, p in pipelines.items()}
        print(f"round {r}: " + ", ".join(f"{w} workers {fps:,.0f} frames/s" for w, fps in row.items()), flush=True)


if __name__ == "__main__":
    main()
