"""Does an engine honour a green-context stream (issue 30)? Its rate alone on an ordinary stream and
on a stream of a green context of fewer SMs, replayed as a CUDA graph and run eagerly: a fenced run
is slower in proportion. bench/green_context_decode.py found the graph's rate unchanged at 64 SMs.

    PYTHONPATH=. python bench/green_context_probe.py ENGINE.plan [--sms 64]
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import sartor  # noqa: E402
from green_context_decode import GreenStreams, matmul_ms  # noqa: E402
from sartor.runtime.context import ExecutionContext  # noqa: E402


def rate(ctx, feed: dict, stream, batch: int, runs: int = 30) -> float:
    with torch.cuda.stream(stream):
        for _ in range(5):
            ctx.run(feed)
        stream.synchronize()
        start = time.perf_counter()
        for _ in range(runs):
            ctx.run(feed)
        stream.synchronize()
    return batch * runs / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("engine")
    parser.add_argument("--sms", type=int, default=64)
    parser.add_argument("--batch", type=int, default=32)
    args = parser.parse_args()
    engine = sartor.load(args.engine)
    spec = engine.inputs[0]
    shape = (args.batch, *engine.profiles[0].shapes[spec.name].max[1:])
    feed = {spec.name: torch.rand(shape, device="cuda").to(getattr(torch, spec.dtype))}
    green, sms = GreenStreams().stream(args.sms)
    plain = torch.cuda.Stream()
    print(f"matmul: all {matmul_ms(plain):.3f} ms, {sms} SMs {matmul_ms(green):.3f} ms", flush=True)
    for graphs in (True, False):
        ctx = ExecutionContext(engine, use_cuda_graphs=graphs)
        for label, stream in (("all", plain), (f"{sms} SMs", green), ("all", plain), (f"{sms} SMs", green)):
            try:
                print(f"graphs {graphs}, {label}: {rate(ctx, feed, stream, args.batch):,.0f} frames/s", flush=True)
            except Exception as exc:  # noqa: BLE001 - a way the engine cannot run is the result
                print(f"graphs {graphs}, {label}: {type(exc).__name__}: {str(exc)[:200]}", flush=True)


if __name__ == "__main__":
    main()
