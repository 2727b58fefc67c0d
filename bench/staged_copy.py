"""Decision 0068 measured: an engine run from a tensor of the caller's (the copy writes the input as its
readers take it) against a plain copy into the engine's own buffer and a run from it (the copied run's
work before), against a run from that buffer with nothing copied, and against the caller's one reused tensor
in a context that binds it (decision 0069: read where it is), timed in turns over one stretch.

    PYTHONPATH=. python bench/staged_copy.py --onnx samples/yolo/yolo11n_scenes.onnx --batch 32 --size 640 \\
        --precisions fp16,int8 [--effort 0] [--rounds 5] [--iterations 100] [--device cuda] [--out DIR]

INT8 engines are calibrated on 32 uniform images of the input size (the copy's speed does not depend
on the scales). Prints one line per engine (ms, medians over all rounds) and writes staged_copy.json.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import sartor  # noqa: E402
from h200_table import paired_timings  # noqa: E402

WAYS = ("staged", "plain", "in_place", "reused")


def engine_ways(plan: Path, device: str, shape: tuple) -> dict:
    """The three timed calls of one engine, on one input tensor, checked to give the same outputs."""
    engine = sartor.load(str(plan), device=device)
    ctx = engine.context(bound_graphs=0)  # its copied runs are copies: a reused tensor is not bound (0069)
    binding = engine.context()
    name = engine.inputs[0].name
    x = torch.rand(*shape, device=device)
    bound = ctx.input_buffers({name: shape})
    bound[name].copy_(x)
    first = {k: v.clone() for k, v in ctx.run({name: x}).items()}
    again = ctx.run(bound)
    same = all(torch.equal(first[k], again[k]) for k in first)
    # paired_timings' names: a copied run (staged), the engine's own buffer, a plain copy into it
    return {"same_outputs": same, "ways": {
        "copied": lambda: ctx.run({name: x}),
        "bound": lambda: ctx.run(bound),
        "plain": lambda: (bound[name].copy_(x), ctx.run(bound)),
        "reused": lambda: binding.run({name: x})}}


def timed_in_turns(engines: dict, batch: int, device: str, rounds: int, iterations: int) -> dict:
    """{engine: {way: median ms over all rounds}}: each round times every engine every way
    (h200_table's paired_timings)."""
    paired = paired_timings({key: entry["ways"] for key, entry in engines.items()}, batch, iterations, rounds, device)
    return {key: {"staged": figures["median_ms"], "plain": figures["plain_copy"]["median_ms"],
                  "in_place": figures["bound_input"]["median_ms"], "reused": figures["reused_buffer"]["median_ms"]}
            for key, figures in paired.items()}


def engine_arguments(parser: argparse.ArgumentParser, rounds: int) -> argparse.ArgumentParser:
    """The options of the benches that build one model's engines in several precisions and time them
    in turns: --onnx, --batch, --size, --precisions, --effort, --rounds, --device, --out."""
    parser.add_argument("--onnx", required=True)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--size", type=int, default=640)
    parser.add_argument("--precisions", default="fp16,int8")
    parser.add_argument("--effort", type=int, default=None)
    parser.add_argument("--rounds", type=int, default=rounds)
    parser.add_argument("--device", default="cuda", help="cpu: a check of the script")
    parser.add_argument("--out", default=None)
    return parser


def main(argv: list[str] | None = None) -> dict:
    parser = engine_arguments(argparse.ArgumentParser(description=__doc__.splitlines()[0]), rounds=5)
    parser.add_argument("--iterations", type=int, default=100)
    args = parser.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="staged_copy_"))
    import onnx
    name = onnx.load(args.onnx, load_external_data=False).graph.input[0].name
    shape = (args.batch, 3, args.size, args.size)
    shapes = {name: shape}
    calib = work / "calib.npy"
    np.save(calib, np.random.default_rng(0).random((32, 3, args.size, args.size), dtype=np.float32))
    engines = {}
    for precision in args.precisions.split(","):
        plan = work / f"{precision}.plan"
        flags = {"calib": str(calib), "calib_size": 32} if precision in ("int8", "fp8") else {}
        if args.effort is not None:
            flags["builder_effort"] = args.effort
        sartor.build(args.onnx, str(plan), device=args.device, precision=precision, min_shapes=shapes,
                     opt_shapes=shapes, max_shapes=shapes, **flags)
        engines[precision] = engine_ways(plan, args.device, shape)
    medians = timed_in_turns(engines, args.batch, args.device, args.rounds, args.iterations)
    result = {"onnx": args.onnx, "shape": list(shape), "rounds": args.rounds, "iterations": args.iterations,
              "device": torch.cuda.get_device_name() if args.device == "cuda" else args.device,
              "engines": {key: dict(medians[key], same_outputs=engines[key]["same_outputs"]) for key in engines}}
    for key, figures in result["engines"].items():
        print(f"{Path(args.onnx).stem} {key} b{args.batch}: staged copy {figures['staged']:.4f} ms, plain copy + run "
              f"{figures['plain']:.4f}, in place {figures['in_place']:.4f}, reused and bound {figures['reused']:.4f}; "
              f"same outputs {figures['same_outputs']}")
    if "fp16" in medians and "int8" in medians:
        print("FP16 ÷ INT8: " + ", ".join(f"{way} {medians['fp16'][way] / medians['int8'][way]:.3f}" for way in WAYS))
    if args.out:
        Path(args.out, "staged_copy.json").write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
