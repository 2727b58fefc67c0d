"""JPEG files → boxes through the Pipeline alone, per count of preparing workers (issue 30: on a host
that holds the Pipeline, do three workers contend for the interpreter lock more than they overlap?).

Each figure is `benchmark.steady_state` over the files cycled `--passes` times, the Pipeline as
`sartor bench --end-to-end` makes it, with `PREPARE_AHEAD` set to each of `--workers` before it is
made (the batches prepared at once, and the staging buffers one more than that). `--reads` compares
ways of reading a file: `bytearray` (the Pipeline's up to session 52: a zeroed bytearray, its fresh
pages touched by the fill, with the interpreter lock held) and `numpy` (the Pipeline's now: an
uninitialised numpy array, its pages first touched by the read, with the lock released). Rounds
alternate the counts and the reads, so drift shows as spread. Nothing else runs: run it under
`py-spy record --gil` to see which Python holds the lock (`bench/py_spy_summary.py` reads the raw
output).

    PYTHONPATH=. python bench/pipeline_workers.py ENGINE.plan --images DIR [--workers 2,3] [--rounds 3]
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import sartor  # noqa: E402
from sartor.pipeline import pipeline as pipeline_module  # noqa: E402
from sartor.pipeline import sources  # noqa: E402
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


def read_into_bytearray(path) -> np.ndarray:
    """A regular file's bytes read into a zeroed bytearray, as the Pipeline read them up to session 52."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    try:
        data = bytearray(os.fstat(fd).st_size)
        return np.frombuffer(data, np.uint8)[:os.readv(fd, [data])]
    finally:
        os.close(fd)


READS = {"bytearray": read_into_bytearray, "numpy": sources._read_file}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("engine")
    parser.add_argument("--images", required=True)
    parser.add_argument("--workers", default="2,3")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--passes", type=int, default=6, help="passes over the files each figure times")
    parser.add_argument("--reads", default="numpy",
                        help=f"comma-separated, of {', '.join(READS)} (numpy: the Pipeline's)")
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
        row = {}
        for read in args.reads.split(","):
            sources._read_file = READS[read]
            for w, pipeline in pipelines.items():
                row[f"{w} workers, {read}"] = steady_state(pipeline, list(files) * args.passes, pipeline.batch_size)[0]
        print(f"round {r}: " + ", ".join(f"{k} {fps:,.0f}" for k, fps in row.items()) + " frames/s", flush=True)


if __name__ == "__main__":
    main()
