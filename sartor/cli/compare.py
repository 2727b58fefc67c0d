"""`sartor compare MODEL.onnx PLAN`: the engine against ONNX Runtime FP32 on the same inputs.

Exit status 0 when every output is within tolerance, 1 when one is not (max|a-b| > atol + rtol·max|ref|).
"""
from __future__ import annotations

from ..errors import ConfigError
from ..runtime import load
from ..validate.compare import compare_with_onnxruntime
from .common import (
    add_trust_arg,
    console,
    fmt_float,
    fmt_shape,
    parse_inputs,
    print_json,
    table,
    text,
)

DESCRIPTION = ("Run the ONNX model (ONNX Runtime, FP32, CPU) and the engine on the same inputs and compare "
               "their outputs; exit 1 when an output is over tolerance.")


def add_parser(subparsers, parents) -> None:
    p = subparsers.add_parser("compare", parents=parents, help="Compare an engine with ONNX Runtime FP32",
                              description=DESCRIPTION)
    p.add_argument("model", metavar="MODEL.onnx", help="the ONNX model the engine was built from")
    p.add_argument("plan", metavar="PLAN", help="the engine file")
    p.add_argument("--input", action="append", default=[], metavar="NAME=FILE.npy",
                   help="an input array (repeatable); inputs not given are seeded random at profile 0's opt shape")
    p.add_argument("--batch", type=int, help="batch size (dim 0) of the random inputs")
    p.add_argument("--seed", type=int, default=0, help="seed of the random inputs (default 0)")
    p.add_argument("--rtol", type=float, default=1e-4, help="relative tolerance, times max|ref| (default 1e-4)")
    p.add_argument("--atol", type=float, default=1e-5, help="absolute tolerance (default 1e-5)")
    p.add_argument("--device", help="cpu or cuda[:N] (default: the kind the engine was built for)")
    add_trust_arg(p)
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=run)


def run(args) -> int:
    if args.rtol < 0 or args.atol < 0:
        raise ConfigError("--rtol and --atol must not be negative")
    if args.batch is not None and args.batch < 1:
        raise ConfigError(f"--batch must be at least 1, not {args.batch}")
    engine = load(args.plan, device=args.device, trust=args.trust)
    feeds = parse_inputs(args.input, [v.name for v in engine.inputs])
    report = compare_with_onnxruntime(args.model, engine, feeds, batch=args.batch, seed=args.seed,
                                      rtol=args.rtol, atol=args.atol)
    if args.json:
        print_json(dict(report.to_json(), model=str(args.model), engine=str(args.plan), device=str(engine.device)))
        return 0 if report.passed else 1
    out = console()
    source = f"random (seed {report.seed})" if report.random_inputs else "from files"
    out.print(text("inputs " + source + ": " + ", ".join(f"{k} {fmt_shape(s)}" for k, s in report.inputs.items())))
    rows = table(f"Engine vs ONNX Runtime FP32 (rtol {args.rtol:g}, atol {args.atol:g})", "output", "shape",
                 "max abs", "max rel", "tolerance", "cosine", "argmax agree", "result")
    for o in report.outputs:
        agree = "-" if o.argmax_agreement is None else f"{100 * o.argmax_agreement:.2f}%"
        result = "[green]PASS[/]" if o.passed else "[red]FAIL[/]"
        rows.add_row(text(o.name), fmt_shape(o.shape), fmt_float(o.max_abs), fmt_float(o.max_rel),
                     fmt_float(o.tolerance), fmt_float(o.cosine, ".6f"), agree, result)
    out.print(rows)
    for o in report.outputs:
        if o.note:
            out.print(text(f"{o.name}: {o.note}"))
    failed = [o.name for o in report.outputs if not o.passed]
    if failed:
        out.print(text(f"FAIL: {len(failed)} of {len(report.outputs)} output(s) over tolerance: {', '.join(failed)}"))
        return 1
    out.print(text(f"PASS: all {len(report.outputs)} output(s) within tolerance"))
    return 0
