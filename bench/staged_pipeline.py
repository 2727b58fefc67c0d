"""Raw frames → boxes through `Pipeline`, its batches prepared in the engine's staged form (INT8 stem
codes, channels-last float16; decision 0068) against the same Pipeline preparing float32 batches that
the engine's copy converts, in turns over one stretch, FP16 and INT8 engines of one model.

    PYTHONPATH=. python bench/staged_pipeline.py --onnx samples/yolo/yolo11n_scenes.onnx --batch 32 \\
        [--precisions fp16,int8] [--effort 0] [--count 1024] [--rounds 3] [--out DIR]

Frames: 1280×720 crops of scikit-image's photos (bench/make_frames.py), decoded onto the GPU as H×W×3
uint8 tensors (a camera SDK's frames), cycled to --count a pass. Engines: `--preprocess
letterbox=640,mean=0,std=255,rgb,nchw --nms` (only kept boxes leave), batch 1..B, kernels chosen at B;
INT8 calibrated on 32 of the frames through that preprocessing. Per engine: frames/s of each way
(median of the rounds), the engine alone on its bound input, and whether the two ways kept the same
boxes. Writes staged_pipeline.json.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

import sartor  # noqa: E402
from pipeline_e2e import NMS, cycled, device_frames, per_call_ms, read_frames, summary  # noqa: E402
from sartor.data.preprocess import parse_preprocess  # noqa: E402
from sartor.pipeline import Pipeline, prepare_batch  # noqa: E402
from staged_copy import engine_arguments  # noqa: E402

WAYS = ("staged", "float")


def build(onnx: str, precision: str, batch: int, size: int, spec: str, calib: Path, effort: int | None,
          work: Path, device: str) -> Path:
    plan = work / f"{precision}.plan"
    shape = lambda b: {"images": (b, 3, size, size)}  # noqa: E731
    flags = {"calib": str(calib), "calib_size": 32} if precision == "int8" else {}
    if effort is not None:
        flags["builder_effort"] = effort
    start = time.perf_counter()
    sartor.build(onnx, str(plan), device=device, precision=precision, min_shapes=shape(1), opt_shapes=shape(batch),
                 max_shapes=shape(batch), preprocess=spec, nms=NMS, **flags)
    print(f"built {precision} in {time.perf_counter() - start:.0f} s", flush=True)
    return plan


def pipelines(engine, batch: int) -> dict:
    """The two ways: the Pipeline as it is (staged) and the same with staging off (float batches)."""
    staged = Pipeline(engine, batch_size=batch)
    floats = Pipeline(engine, batch_size=batch)
    for bucket in floats._buckets:
        bucket.staged = None
    return {"staged": staged, "float": floats}


def boxes(results) -> list:
    return [(r.error, None if r.detections is None else np.asarray(r.detections.boxes).round(3).tolist())
            for r in results]


def main(argv: list[str] | None = None) -> dict:
    parser = engine_arguments(argparse.ArgumentParser(description=__doc__.splitlines()[0]), rounds=3)
    parser.add_argument("--count", type=int, default=1024)
    args = parser.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="staged_pipeline_"))
    subprocess.run([sys.executable, str(ROOT / "bench" / "make_frames.py"), str(work / "frames"), "--count", "32"],
                   check=True)
    device = torch.device(args.device)
    raw = device_frames(read_frames(work / "frames"), device)
    spec_text = f"letterbox={args.size},mean=0,std=255,rgb,nchw"
    images, _ = prepare_batch([f.permute(2, 0, 1) for f in raw], [str(i) for i in range(len(raw))],
                              parse_preprocess(spec_text))
    np.save(work / "calib.npy", images.cpu().numpy())
    items = cycled(raw, args.count)
    result = {"onnx": args.onnx, "batch": args.batch, "size": args.size, "count": args.count, "rounds": args.rounds,
              "gpu": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "torch": torch.__version__,
              "engines": {}}
    for precision in args.precisions.split(","):
        engine = sartor.load(build(args.onnx, precision, args.batch, args.size, spec_text, work / "calib.npy",
                                   args.effort, work, args.device), device=args.device)
        ways = pipelines(engine, args.batch)
        forms = {way: str(p._buckets[0].staged) for way, p in ways.items()}
        same = boxes(ways["staged"].run(items[:2 * args.batch])) == boxes(ways["float"].run(items[:2 * args.batch]))
        rates = {way: [] for way in WAYS}
        for _ in range(args.rounds):
            for way in WAYS:
                ways[way].run(items[:args.batch])  # the stream warm again after the other way
                if device.type == "cuda":
                    torch.cuda.synchronize()
                start = time.perf_counter()
                ways[way].run(items)
                rates[way].append(args.count / (time.perf_counter() - start))
        ctx = engine.context()
        bound = ctx.input_buffers({"images": (args.batch, 3, args.size, args.size)})
        bound["images"].copy_(torch.cat([images] * (args.batch // len(images) + 1))[:args.batch])
        alone = summary(per_call_ms(lambda: ctx.run(bound), 200), args.batch)
        entry = {"frames_per_s": {way: round(statistics.median(r), 1) for way, r in rates.items()},
                 "rounds_per_s": {way: [round(x, 1) for x in r] for way, r in rates.items()},
                 "engine_alone_per_s": alone["per_s"], "same_boxes": same, "staging": forms["staged"]}
        result["engines"][precision] = entry
        print(f"{Path(args.onnx).stem} {precision} b{args.batch}: raw frames → boxes, staged "
              f"{entry['frames_per_s']['staged']:.0f} frames/s, float {entry['frames_per_s']['float']:.0f}; "
              f"engine alone {alone['per_s']:.0f}; same boxes {same}", flush=True)
        if args.out:
            Path(args.out, "staged_pipeline.json").write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
