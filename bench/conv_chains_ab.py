"""Convolution chains on and off, timed in one process (issue 33; builder/conv_chains.py).

Each model, batch and precision is built three times from one timing cache: by default (its chains kept only
where its own check found the whole engine faster with them: `builder/conv_chains.py` `check_chains`, printed
with the PDL check), with `--conv-chains` (every chain that timed faster than its two layers, no whole-engine
check) and with `--no-conv-chains` (every chain two layers). The builds after the first time nothing new:
their layers come from the cache. The last two engines are then timed in turn, ROUNDS times each, as
CUDA-graph replays with the input already in the engine's buffer (median ms of each round;
`bench/h200_table.py`'s `timed`). INT8 is calibrated on 64 street scenes, as in the table. Prints each build's
chains lines and one row per engine pair: whether the default build's check kept the chains, and whether they
pay when timed apart from it.

    PYTHONPATH=. python bench/conv_chains_ab.py --models yolov8n,yolo11n --batches 1,32 --precisions fp16,int8
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import sartor  # noqa: E402
from h200_int8 import scene_images  # noqa: E402
from h200_table import timed  # noqa: E402

ONNX = {"yolov8n": ROOT / "samples/yolo/yolov8n_scenes.onnx", "yolo11n": ROOT / "samples/yolo/yolo11n_scenes.onnx",
        "detector": ROOT / "samples/detector/sample_detector.onnx"}
SIZE = {"yolov8n": 640, "yolo11n": 640, "detector": 320}


def build(onnx: Path, plan: Path, precision: str, shape: tuple, calib: Path, cache: Path, effort: int | None,
          conv_chains: bool | None) -> str:
    started = time.perf_counter()
    kwargs = {"calib": str(calib), "calib_size": 64} if precision == "int8" else {}
    if effort is not None:
        kwargs["builder_effort"] = effort
    result = sartor.build(str(onnx), str(plan), device="cuda", precision=precision, min_shapes={"images": shape},
                          opt_shapes={"images": shape}, max_shapes={"images": shape}, timing_cache=str(cache),
                          conv_chains=conv_chains, **kwargs)
    chains = " | ".join(line for line in result.header["build_log"] if line.startswith("chains")) or "no chains line"
    pdl = result.header.get("pdl_check") or {}
    return (f"{time.perf_counter() - started:.0f} s; pdl kept {pdl.get('kept')} ({pdl.get('layers')} layers); "
            f"chains check {result.header.get('chains_check')}; {chains}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="yolov8n,yolo11n")
    parser.add_argument("--batches", default="1")
    parser.add_argument("--precisions", default="fp16,int8")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--iterations", type=int, default=300)
    parser.add_argument("--effort", type=int, default=None, help="builder effort (default: the builder's)")
    parser.add_argument("--work", default="/tmp/conv_chains_ab")
    args = parser.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    print(torch.cuda.get_device_name(), "torch", torch.__version__, "CUDA", torch.version.cuda, flush=True)
    for model in args.models.split(","):
        size = SIZE[model]
        calib = work / f"calib_{size}.npy"
        if not calib.exists():
            np.save(calib, scene_images(64, 50_000, size, False))
        for batch in map(int, args.batches.split(",")):
            shape = (batch, 3, size, size)
            for precision in args.precisions.split(","):
                cache = work / f"timing_{model}_{precision}_b{batch}.json"
                cache.unlink(missing_ok=True)
                plans = {}
                for variant, asked in (("default", None), ("chains", True), ("apart", False)):
                    plans[variant] = work / f"{model}_{precision}_b{batch}_{variant}.plan"
                    line = build(ONNX[model], plans[variant], precision, shape, calib, cache, args.effort, asked)
                    print(f"{model} {precision} b{batch} {variant}: {line[:2400]}", flush=True)
                default = sartor.load(str(plans.pop("default"))).header.get("chains_check") or {}
                engines = {variant: sartor.load(str(plan)) for variant, plan in plans.items()}
                contexts = {variant: engine.context() for variant, engine in engines.items()}
                x = torch.rand(*shape, device="cuda")
                bound = {}
                for variant, ctx in contexts.items():
                    bound[variant] = ctx.input_buffers({"images": shape})
                    bound[variant]["images"].copy_(x)
                    ctx.run(bound[variant])
                medians = {variant: [] for variant in contexts}
                for _ in range(args.rounds):
                    for variant, ctx in contexts.items():
                        medians[variant].append(timed(lambda: ctx.run(bound[variant]), batch,
                                                      args.iterations)["median_ms"])
                chains, apart = (statistics.median(medians[v]) for v in ("chains", "apart"))
                layers = {v: sum(1 for n in e.graph.nodes if n.op_type == "ConvChain") for v, e in engines.items()}
                print(f"ROW {model} {precision} b{batch}: chains {chains:.4f} ms ({layers['chains']} chain layers) "
                      f"apart {apart:.4f} ms; the default build's check kept them: {default.get('kept')}; "
                      f"rounds {medians}", flush=True)


if __name__ == "__main__":
    main()
