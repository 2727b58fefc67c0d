"""`sartor bench PLAN`: latency percentiles and throughput, with and without host↔device copies."""
from __future__ import annotations

from ..runtime import load
from ..runtime.benchmark import benchmark
from ..runtime.profiles import parse_shape_spec
from .common import console, fmt_shape, key_values, print_json, table

DESCRIPTION = ("Time an engine: p50/p90/p99 latency and throughput, with host↔device copies (numpy in/out) "
               "and without (device tensors in, outputs left on the device).")


def add_parser(subparsers, parents) -> None:
    p = subparsers.add_parser("bench", parents=parents, help="Time an engine", description=DESCRIPTION)
    p.add_argument("plan", metavar="PLAN", help="the engine file")
    p.add_argument("--shapes", metavar="NAME:8x3x320x320[,...]",
                   help="input shapes (default: profile 0's opt shapes)")
    p.add_argument("--iterations", type=int, default=100, help="timed runs per mode (default 100)")
    p.add_argument("--warmup", type=int, default=10, help="untimed runs before timing, per mode (default 10)")
    p.add_argument("--device", help="cpu or cuda[:N] (default: the kind the engine was built for)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random inputs (default 0)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=run)


def run(args) -> int:
    shapes = parse_shape_spec(args.shapes) if args.shapes else None
    engine = load(args.plan, device=args.device)
    result = benchmark(engine, shapes, iterations=args.iterations, warmup=args.warmup, seed=args.seed)
    if args.json:
        print_json(dict(result.to_json(), engine=str(args.plan)))
        return 0
    out = console()
    out.print(key_values("Benchmark", [
        ("engine", args.plan), ("device", result.device),
        ("shapes", ", ".join(f"{k} {fmt_shape(v)}" for k, v in result.shapes.items())),
        ("profile", result.profile), ("batch", result.batch),
        ("iterations", f"{result.iterations} timed after {result.warmup} warm-up, per mode"),
    ]))
    rows = table("Latency (ms) and throughput", "mode", "p50", "p90", "p99", "mean", "min", "inputs/s")
    for mode, stats in (("with host↔device copies", result.with_copies), ("device only", result.device_only)):
        rows.add_row(mode, *(f"{v:.3f}" for v in (stats.p50_ms, stats.p90_ms, stats.p99_ms, stats.mean_ms,
                                                    stats.min_ms)), f"{stats.throughput:.1f}")
    out.print(rows)
    return 0
