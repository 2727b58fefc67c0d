"""One JPEG file → boxes at batch 1, frame after frame, against the engine alone at batch 1 (issue 30's
bar: within 0.5 ms of the engine). `Pipeline(batch_size=1, overlap=False)` reads, decodes (nvJPEG),
letterboxes, runs and returns each frame's detections in the calling thread, as a camera's loop
that needs each frame's boxes before the next; the engine alone runs a letterboxed frame already in
its input. Medians and p99 of `--repeats` calls each, after a warm-up, rounds alternating.

    PYTHONPATH=. python bench/batch1_latency.py ENGINE.plan --images DIR [--repeats 200] [--rounds 2]
"""
from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import sartor  # noqa: E402
from pipeline_e2e import per_call_ms, summary  # noqa: E402
from sartor.pipeline import Pipeline  # noqa: E402
from sartor.pipeline.benchmark import image_files  # noqa: E402
from sartor.runtime.hardware_queues import in_effect  # noqa: E402


def engine_alone_ms(single: Pipeline, repeats: int) -> dict:
    """The pipeline's engine at batch 1 on the frame its last run letterboxed into the bound input."""
    prepared = single.context.input_buffers({single.input_name: single.spec.input_shape(1)})
    return summary(per_call_ms(lambda: single.context.run(prepared), repeats, warmup=10), 1)


def one_file_at_a_time_ms(single: Pipeline, files: list, repeats: int) -> dict:
    """`files` through the batch-1 pipeline one call each, in turn."""
    turns = itertools.cycle(files)
    return summary(per_call_ms(lambda: single.run([next(turns)]), repeats, warmup=10), 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("engine")
    parser.add_argument("--images", required=True)
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    engine = sartor.load(args.engine)
    single = Pipeline(engine, batch_size=1, overlap=False)
    files = image_files(args.images)
    found = single.run([files[0]])[0].detections
    print(f"batch 1 on {single.device}, {in_effect()} hardware queues, "
          f"{len(found) if found is not None else 'no'} boxes in {files[0].name}", flush=True)
    for r in range(1, args.rounds + 1):
        engine_ms = engine_alone_ms(single, args.repeats)
        pipeline_ms = one_file_at_a_time_ms(single, files, args.repeats)
        print(f"round {r}: JPEG file → boxes median {pipeline_ms['median_ms']:.3f} ms "
              f"(p99 {pipeline_ms['p99_ms']:.3f}); engine alone {engine_ms['median_ms']:.3f} ms "
              f"(p99 {engine_ms['p99_ms']:.3f}); over it "
              f"{pipeline_ms['median_ms'] - engine_ms['median_ms']:.3f} ms", flush=True)


if __name__ == "__main__":
    main()
