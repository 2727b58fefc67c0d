"""Where a copied run's time goes beyond an in-place run's (issue 33; decision 0068): the host's part.

Session 65 (an H100, batch 32) timed a copied INT8 run 0.113 ms over in place, of which the device work
(the quantizing copy 0.066 ms, less the stem's 0.012 on codes) explains about 0.054; FP16's copied run was
0.018 over in place. Each timed call starts on an idle GPU (events around one call, then a sync), so the
host's time before the call's first kernel is in the figure. This measures it, for the sample detector
and YOLO11n, FP16 and INT8, at batches 1 and 32 (default effort; INT8 calibrated on 32 random images):

- copied, in place, and a plain copy before an in-place run (median ms of CUDA events, ITERATIONS calls);
- the host's microseconds to issue the copy-in alone: the INT8 quantizing copy (a Triton launch) and
  `Tensor.copy_` of the same input (a torch launch), measured with the host clock, the GPU kept busy;
- the host's microseconds of a whole copied `run` and of an in-place `run`, likewise.

    PYTHONPATH=. python bench/copy_in_latency.py [--models detector,yolo11n] [--batches 1,32] [--out DIR]
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

from sartor.ops.quantized import quantize_into  # noqa: E402

ONNX = {"detector": ROOT / "samples/detector/sample_detector.onnx",
        "yolo11n": ROOT / "samples/yolo/yolo11n_scenes.onnx", "yolov8n": ROOT / "samples/yolo/yolov8n_scenes.onnx"}
SIZE = {"detector": 320, "yolo11n": 640, "yolov8n": 640}
ITERATIONS = 300


def host_us(fn, calls: int = 200) -> float:
    """Median host microseconds to issue `fn`, with a long kernel queued ahead so that the GPU never
    waits for the host and the host never waits for the GPU."""
    samples = []
    for _ in range(calls):
        torch.cuda._sleep(2_000_000)  # a spin kernel of about a millisecond: the queue stays busy
        t0 = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t0) * 1e6)
        torch.cuda.synchronize()
    return round(statistics.median(samples), 1)


def measure(model: str, batch: int, precision: str, work: Path) -> dict:
    size = SIZE[model]
    shape = (batch, 3, size, size)
    plan = work / f"{model}_{precision}_b{batch}.plan"
    kwargs = {}
    if precision == "int8":
        calib = work / f"calib_{size}.npy"
        if not calib.exists():  # one set a size, for every batch
            np.save(calib, np.random.default_rng(0).random((32, 3, size, size), dtype=np.float32))
        kwargs = {"calib": str(calib), "calib_size": 32}
    sartor.build(str(ONNX[model]), str(plan), device="cuda", precision=precision, min_shapes={"images": shape},
                 opt_shapes={"images": shape}, max_shapes={"images": shape}, **kwargs)
    engine = sartor.load(str(plan))
    ctx = engine.context(bound_graphs=0)
    x = torch.rand(*shape, device="cuda")
    ctx.run({"images": x})
    own = ctx.input_buffers({"images": shape})
    own["images"].copy_(x)
    ctx.run(own)
    row = {"copied_ms": timed(lambda: ctx.run({"images": x}), batch, ITERATIONS)["median_ms"],
           "in_place_ms": timed(lambda: ctx.run(own), batch, ITERATIONS)["median_ms"],
           "plain_copy_ms": timed(lambda: (own["images"].copy_(x), ctx.run(own)), batch, ITERATIONS)["median_ms"],
           "host_us": {"copied_run": host_us(lambda: ctx.run({"images": x})),
                       "in_place_run": host_us(lambda: ctx.run(own)),
                       "torch_copy": host_us(lambda: own["images"].copy_(x, non_blocking=True))}}
    form = ctx.staged_forms({"images": shape}).get("images")
    row["staged_form"] = None if form is None else {"dtype": str(form.dtype), "codes": form.codes}
    if form is not None and form.codes is not None:
        codes = torch.empty(shape, dtype=torch.int8, device="cuda")
        row["host_us"]["quantizing_copy"] = host_us(lambda: quantize_into(x, codes, *form.codes))
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="detector,yolo11n")
    parser.add_argument("--batches", default="1,32")
    parser.add_argument("--precisions", default="fp16,int8")
    parser.add_argument("--out", default=".")
    args = parser.parse_args()
    print(torch.cuda.get_device_name(), "torch", torch.__version__, "CUDA", torch.version.cuda, flush=True)
    rows = {}
    with tempfile.TemporaryDirectory() as work:
        for model in args.models.split(","):
            for batch in map(int, args.batches.split(",")):
                for precision in args.precisions.split(","):
                    key = f"{model} b{batch} {precision}"
                    rows[key] = measure(model, batch, precision, Path(work))
                    print("ROW", key, json.dumps(rows[key]), flush=True)
    Path(args.out, "copy_in_latency.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
