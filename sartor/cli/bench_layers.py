"""`sartor bench PLAN --per-layer`: each layer's median time, share, tactic, precision and ONNX
nodes, slowest first, from a profiling run apart from the timed one (sartor/runtime/layer_profile.py)."""
from __future__ import annotations

from ..errors import ConfigError
from ..runtime import load
from ..runtime.layer_profile import profile_layers
from ..runtime.profiles import parse_shape_spec
from .common import console, fmt_shape, key_values, print_json, table, text


def run_per_layer(args) -> int:
    if args.end_to_end or args.images:
        raise ConfigError("--per-layer times the engine's layers; it does not go with --end-to-end or --images")
    shapes = parse_shape_spec(args.shapes) if args.shapes else None
    engine = load(args.plan, device=args.device, trust=args.trust)
    result = profile_layers(engine, shapes, iterations=args.iterations, warmup=args.warmup, seed=args.seed,
                            nvtx=args.nvtx)
    if args.json:
        print_json({"schema": "sartor-layer-profile/1", "engine": str(args.plan), **result.to_json()})
        return 0
    out = console()
    out.print(key_values("Per-layer profile", [
        ("engine", args.plan), ("device", result.device),
        ("shapes", ", ".join(f"{k} {fmt_shape(v)}" for k, v in result.shapes.items())),
        ("profile", result.profile),
        ("iterations", f"{result.iterations} eager runs after {result.warmup} warm-up; medians per layer"),
        ("layers total", (f"{result.total_ms:.3f} ms (a profiled run {result.run_median_ms:.3f} ms; eager "
                          f"launches and timing cost more than `sartor bench`'s latency: compare shares)")),
        ("NVTX", "a range per layer, named after it" if result.nvtx else "off (--nvtx for Nsight Systems)"),
    ]))
    rows = table("Layers, slowest first", "#", "layer", "op", "median ms", "share", "tactic", "precision",
                 "fused from (ONNX nodes)")
    for rank, layer in enumerate(result.layers, 1):
        rows.add_row(str(rank), text(layer.name), text(layer.op), f"{layer.median_ms:.4f}", f"{layer.share:.1%}",
                     text("host" if layer.on_host else layer.tactic), text(layer.precision),
                     text(", ".join(layer.origin)))
    out.print(rows)
    return 0
