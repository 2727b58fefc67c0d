"""`sartor run PLAN --input NAME=FILE.npy`: run an engine once and show (or save) its outputs."""
from __future__ import annotations

import time

import numpy as np

from ..runtime import load
from ..runtime.engine_file import check_writable, npz_bytes, write_atomic
from ..runtime.sample_inputs import random_inputs
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
    p.add_argument("--json", action="store_true",
                   help="print the outputs' summary (names, shapes, dtypes, min/max/mean, time) as one JSON document")
    p.set_defaults(func=run)


def output_stats(value) -> dict:
    """Name-free summary of one output: shape, dtype, min/max/mean (None for empty or non-numeric)."""
    array = np.asarray(value)
    numeric = bool(array.size) and array.dtype.kind in "fiub"
    stats = (float(array.min()), float(array.max()), float(array.astype(np.float64).mean())) if numeric \
        else (None, None, None)
    return {"shape": list(array.shape), "dtype": str(array.dtype), "min": stats[0], "max": stats[1], "mean": stats[2]}


def run(args) -> int:
    if args.output:
        check_writable(args.output)
    engine = load(args.plan, device=args.device, trust=args.trust)
    # With --json, stdout holds the JSON document only: notes go to stderr.
    out = console()
    notes = console(stderr=True) if args.json else out
    feeds = parse_inputs(args.input, [v.name for v in engine.inputs])
    random_seed = None
    if not args.input:
        feeds, random_seed = random_inputs(engine, seed=args.seed), args.seed
        notes.print(text(f"no --input given: random inputs (seed {args.seed}) at "
                         + ", ".join(f"{k} {fmt_shape(v.shape)}" for k, v in feeds.items())))
    started = time.perf_counter()
    outputs = engine.context().run(feeds)  # numpy out: the copy back (and so the device's work) is timed
    seconds = time.perf_counter() - started
    summary = {name: output_stats(value) for name, value in outputs.items()}
    if args.output:
        write_atomic(args.output, npz_bytes(outputs))
    if args.json:
        print_json({"schema": "sartor-run/1", "engine": str(args.plan), "device": str(engine.device),
                    "inputs": {k: {"shape": list(np.shape(v)), "dtype": str(np.asarray(v).dtype)}
                               for k, v in feeds.items()},
                    "random_seed": random_seed, "seconds": seconds,
                    "outputs": [dict(name=name, **stats) for name, stats in summary.items()],
                    "saved_to": args.output})
        return 0
    rows = table("Outputs", "name", "shape", "dtype", "min", "max", "mean")
    for name, stats in summary.items():
        rows.add_row(text(name), fmt_shape(stats["shape"]), stats["dtype"],
                     *(fmt_float(stats[k], ".4g") for k in ("min", "max", "mean")))
    out.print(rows)
    out.print(text(f"one run: {seconds * 1e3:.3f} ms (first run of this process: includes warm-up)"))
    if args.output:
        out.print(text(f"saved {len(outputs)} output(s) to {args.output}"))
    return 0
