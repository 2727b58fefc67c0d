"""`sartor run PLAN --input NAME=FILE.npy`: run an engine once and show (or save) its outputs."""
from __future__ import annotations

import numpy as np

from ..runtime import load
from ..runtime.engine_file import check_writable, write_atomic
from ..runtime.sample_inputs import random_inputs
from .common import (
    add_trust_arg,
    console,
    fmt_float,
    fmt_shape,
    npz_bytes,
    parse_inputs,
    table,
    text,
)

DESCRIPTION = "Run an engine once on inputs from .npy files and print (or save) its outputs."


def add_parser(subparsers, parents) -> None:
    p = subparsers.add_parser("run", parents=parents, help=DESCRIPTION.rstrip("."), description=DESCRIPTION)
    p.add_argument("plan", metavar="PLAN", help="the engine file")
    p.add_argument("--input", action="append", default=[], metavar="NAME=FILE.npy",
                   help="an input array (repeatable); with no --input at all, seeded random inputs at "
                        "profile 0's opt shapes are used")
    p.add_argument("--output", metavar="OUT.npz", help="save the outputs here (written atomically)")
    p.add_argument("--device", help="cpu or cuda[:N] (default: the kind the engine was built for)")
    add_trust_arg(p)
    p.add_argument("--seed", type=int, default=0, help="seed of the random inputs (default 0)")
    p.set_defaults(func=run)


def run(args) -> int:
    if args.output:
        check_writable(args.output)
    engine = load(args.plan, device=args.device, trust=args.trust)
    out = console()
    feeds = parse_inputs(args.input, [v.name for v in engine.inputs])
    if not args.input:
        feeds = random_inputs(engine, seed=args.seed)
        out.print(text(f"no --input given: random inputs (seed {args.seed}) at "
                       + ", ".join(f"{k} {fmt_shape(v.shape)}" for k, v in feeds.items())))
    outputs = engine.context().run(feeds)
    rows = table("Outputs", "name", "shape", "dtype", "min", "max", "mean")
    for name, value in outputs.items():
        array = np.asarray(value)
        numeric = array.size and array.dtype.kind in "fiub"
        stats = (array.min(), array.max(), array.astype(np.float64).mean()) if numeric else (None, None, None)
        rows.add_row(text(name), fmt_shape(array.shape), str(array.dtype),
                     *(fmt_float(None if s is None else float(s), ".4g") for s in stats))
    out.print(rows)
    if args.output:
        write_atomic(args.output, npz_bytes(outputs))
        out.print(text(f"saved {len(outputs)} output(s) to {args.output}"))
    return 0
