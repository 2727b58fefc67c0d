"""Swin-T's window attention layers alone, every Attention tactic (issue 34 part 2): FP16, batch 64,
each stage's windows and heads, q/k_t/v as the views of the qkv projection the engine passes, the
per-window bias, the output written rows before heads (passes/fold_attention_transpose.py) and
merged into channels as the graph's Reshape does (a copy where a tactic returns a transposed view).
Each tactic's call is captured in a CUDA graph of 20 calls and replayed; per layer: the median of
the replays. Also checks every tactic against the reference (max abs difference).

    PYTHONPATH=. python bench/attention_short.py [--out $OUT] [--batch 64]
"""
from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

from sartor.ops import default_registry

ATTENTION = default_registry()["Attention"]
TOKENS, HEAD_DIM = 49, 32
# (stage, windows per image, heads, layers of the stage)
STAGES = ((1, 64, 3, 2), (2, 16, 6, 2), (3, 4, 12, 6), (4, 1, 24, 2))


def operands(batch: int, windows: int, heads: int, generator: torch.Generator) -> list:
    qkv = torch.randn(batch * windows, TOKENS, 3, heads, HEAD_DIM, generator=generator).half().cuda()
    q, k, v = qkv.permute(2, 0, 3, 1, 4)  # as the export's Reshape → Transpose → Split → Squeeze
    bias = (torch.randn(1, windows, heads, TOKENS, TOKENS, generator=generator) * 3).half().cuda()
    return [q, k.transpose(-1, -2), v, bias]


def layer(inputs: list, attrs: dict, channels: int):
    def run():
        out = ATTENTION.impl(inputs, attrs)
        return out.reshape(out.shape[0], TOKENS, channels)  # the heads merged: a view or a copy
    return run


def replay_ms(fn, calls: int = 20, replays: int = 15) -> float:
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    samples = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) / calls)
    return statistics.median(samples)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--batch", type=int, default=64)
    args = parser.parse_args()
    generator = torch.Generator().manual_seed(0)
    rows, totals = [], {}
    for stage, windows, heads, layers in STAGES:
        inputs = operands(args.batch, windows, heads, generator)
        attrs = {"scale": HEAD_DIM ** -0.5, "windows": windows, "rows_before_heads": 1}
        tactics = ATTENTION.tactics(inputs, attrs)
        reference = ATTENTION.impl(inputs, dict(attrs, tactic="torch")).float()
        for tactic in tactics:
            call = layer(inputs, dict(attrs, tactic=tactic), heads * HEAD_DIM)
            error = (call().float().reshape(reference.shape) - reference).abs().max().item()
            ms = replay_ms(call)
            totals[tactic] = totals.get(tactic, 0.0) + ms * layers
            rows.append({"stage": stage, "windows": windows, "heads": heads, "tactic": tactic, "ms": round(ms, 4),
                         "max_abs_error": round(error, 5)})
            print(f"stage {stage} W={windows:2d} heads={heads:2d} {tactic:24s} {ms:.4f} ms  err {error:.2e}", flush=True)
    best = sum(min(r["ms"] for r in rows if r["stage"] == stage) * layers for stage, _, _, layers in STAGES)
    print("12 layers (depths 2, 2, 6, 2), per tactic where offered at every stage:")
    for tactic, ms in totals.items():
        print(f"  {tactic:24s} {ms:.3f} ms")
    print(f"  best per stage          {best:.3f} ms")
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "attention_short.json").write_text(json.dumps({"rows": rows, "totals": totals}, indent=1))


if __name__ == "__main__":
    main()
