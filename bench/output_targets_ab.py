"""A later graph's outputs written where the context keeps them (decision 0070) against copied there, in
turns in one process: one engine loaded twice, the second with its layers' `write_outputs` taken away
(what every engine did before 0070).

    PYTHONPATH=. python bench/output_targets_ab.py --onnx samples/yolo/yolo11n_scenes.onnx \\
        [--precisions fp16,int8] [--batches 1,32] [--nms | --no-nms] [--rounds 5] [--iterations 200] [--out DIR]

Engines at 640, batch 1..max(--batches), kernels chosen at the largest, the builder's default effort; with
`--nms` (the default) the in-engine NMS's four outputs, without it the YOLO decode's raw head. INT8 is
calibrated on 32 random images. Each context is warmed (the largest batch captured first, as `warmup`
does), then each batch runs from one reused tensor, so that it is a bound graph after the first: median ms
of the CUDA-graph replays, each way timed in turn, and whether both ways returned the same outputs.
Writes output_targets_ab.json to --out.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

import sartor  # noqa: E402
from h200_table import timed  # noqa: E402
from pipeline_e2e import NMS  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--onnx", default=str(ROOT / "samples/yolo/yolo11n_scenes.onnx"))
    parser.add_argument("--precisions", default="fp16,int8")
    parser.add_argument("--batches", default="1,32")
    parser.add_argument("--nms", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--iterations", type=int, default=200)
    parser.add_argument("--out", default=".")
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    largest = max(batches)
    work = Path(tempfile.mkdtemp(prefix="output_targets_"))
    calib = work / "calib.npy"
    np.save(calib, np.random.default_rng(0).random((32, 3, 640, 640), dtype=np.float32))
    shape = lambda b: {"images": (b, 3, 640, 640)}  # noqa: E731
    print(torch.cuda.get_device_name(), "torch", torch.__version__, "CUDA", torch.version.cuda, flush=True)
    rows = []
    for precision in args.precisions.split(","):
        plan = work / f"{precision}.plan"
        started = time.perf_counter()
        flags = {"calib": str(calib), "calib_size": 32} if precision == "int8" else {}
        sartor.build(args.onnx, str(plan), device="cuda", precision=precision, min_shapes=shape(1),
                     opt_shapes=shape(largest), max_shapes=shape(largest), nms=NMS if args.nms else None, **flags)
        print(f"built {precision} in {time.perf_counter() - started:.0f} s", flush=True)
        contexts = {}
        for way in ("written", "copied"):
            engine = sartor.load(str(plan))
            if way == "copied":  # before 0070: no layer writes into the shared buffers
                for step in engine.executor.steps:
                    step.write_outputs = None
            contexts[way] = engine.context()
            contexts[way].warmup()
        writers = [s.node.op_type for s in contexts["written"].engine.executor.steps if s.write_outputs is not None]
        for batch in batches:
            slot = torch.rand(*shape(batch)["images"], device="cuda")
            outputs = {}
            for way, ctx in contexts.items():
                for _ in range(3):  # copied, then bound at the second sighting, then replayed
                    outputs[way] = {name: value.clone() for name, value in ctx.run({"images": slot}).items()}
            same = all(torch.equal(outputs["written"][name], outputs["copied"][name]) for name in outputs["written"])
            medians = {way: [] for way in contexts}
            for _ in range(args.rounds):
                for way, ctx in contexts.items():
                    medians[way].append(timed(lambda: ctx.run({"images": slot}), batch, args.iterations)["median_ms"])
            row = {"precision": precision, "batch": batch, "nms": args.nms, "writers": writers, "same_outputs": same,
                   **{f"{way}_ms": round(statistics.median(values), 4) for way, values in medians.items()},
                   "rounds_ms": medians}
            rows.append(row)
            print(f"ROW {precision} b{batch}: written {row['written_ms']:.4f} ms, copied {row['copied_ms']:.4f} ms, "
                  f"same outputs {same}; layers that write: {writers}", flush=True)
    Path(args.out, "output_targets_ab.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
