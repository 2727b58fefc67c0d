"""`sartor sensitivity MODEL.onnx --calib DATA [--precision fp8]`: which layers INT8 (FP8) hurts most,
and which overflow FP16."""
from __future__ import annotations

import argparse
import math

from ..ir.dtypes import QUANTIZED_PRECISIONS
from ..progress import ProgressReport
from ..validate.sensitivity import DEFAULT_SAMPLES
from .common import (
    add_calibration_args,
    console,
    fmt_float,
    key_values,
    print_json,
    table,
    text,
)

DESCRIPTION = "Rank layers by how much INT8 (or FP8) alone in that layer degrades the outputs (SNR vs FP32)."
EPILOG = """\
Each conv/gemm layer that can run INT8 (--precision fp8: FP8 E4M3) is quantized alone (everything
else FP32) and the model outputs on the calibration samples are compared with FP32:
SNR = 10·log10(Σref² / Σ(ref−out)²).
The lowest SNRs come first: pin those with `sartor build --layer-precision NODE=fp16`. The
"FP32 peak" column is each layer's largest |output|; above 65504 it overflows FP16.

Detectors: one SNR over a YOLO head [B, 4+C, N] hears only the box coordinates (hundreds of pixels)
and not the class scores (0..1). --decoder yolo (or boxes, for graphs that end in boxes [B,N,4] and
scores [B,N,C]) compares boxes and scores apart, each with its own SNR, and ranks each layer by the
worse of the two; both are shown. Other outputs are compared each on its own.

--precision fp8 ranks the same layers quantized to FP8 E4M3 (scales amax/448 from the same
calibration) instead of INT8: the ranking `sartor build --precision fp8 --min-cosine/--min-snr/
--accuracy-budget` plans with.
"""


def add_parser(subparsers, parents) -> None:
    p = subparsers.add_parser("sensitivity", parents=parents, help=DESCRIPTION.rstrip("."), description=DESCRIPTION,
                              epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", metavar="MODEL.onnx", help="the ONNX model")
    add_calibration_args(p, DEFAULT_SAMPLES, required=True,
                         cache_help="take the thresholds from this cache when it exists (it is never written)")
    p.add_argument("--decoder", metavar="yolo|boxes",
                   help="detectors: compare boxes and scores apart, each against its own FP32 values, and rank by "
                        "the worse (yolo: the raw [B, 4+C, N] head; boxes: boxes [B,N,4] with scores), so that box "
                        "coordinates in pixels do not drown the scores' error; default: all outputs as one")
    p.add_argument("--precision", default="int8", type=str.lower, choices=QUANTIZED_PRECISIONS,
                   help="the quantized format each layer is tried in (default int8; fp8: FP8 E4M3)")
    p.add_argument("--preprocess", metavar="SPEC", help="how images become the input (image datasets)")
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N] (default cpu)")
    p.add_argument("--top", type=int, default=0, metavar="N", help="show only the N least robust layers")
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")
    p.set_defaults(func=run)


def _db(value: float) -> str:
    return "inf" if value == math.inf else fmt_float(value, ".1f")


def run(args) -> int:
    from ..errors import ConfigError
    from ..validate.sensitivity import analyze, check_decoder
    if args.calib_size < 1:
        raise ConfigError(f"--calib-size {args.calib_size} must be at least 1")
    check_decoder(args.decoder)
    # A live bar on a terminal, a line every few seconds in a log (sartor/progress.py).
    with ProgressReport("sensitivity") as progress:
        progress("calibrate and rank")
        report = analyze(args.model, args.calib, args.calib_size, args.calib_method, args.percentile,
                         args.calib_cache, args.preprocess, args.device,
                         on_layer=lambda k, n, name: progress.advance(k, n, f"layer {k + 1} of {n}: {name}"),
                         balance_by=args.calib_balance_by, decoder=args.decoder, precision=args.precision)
    rows = report.layers[:args.top] if args.top > 0 else report.layers
    if args.json:
        print_json(dict(report.to_json(), layers=[r.to_json() for r in rows]))
        return 0
    out = console()
    groups = list(report.all_int8_groups)
    ranked_by = (f"worst of {', '.join(groups)} SNR (--decoder {report.decoder})" if report.decoder
                 else "SNR of all outputs together")
    word = report.precision.upper()
    out.print(key_values(f"{word} sensitivity", [
        ("samples", report.samples), ("thresholds", report.method), ("ranked by", ranked_by),
        (f"default {word} plan", f"SNR {_db(report.all_int8_snr_db)} dB, cosine {fmt_float(report.all_int8_cosine, '.5f')}"
         + "".join(f"; {g} {_db(v['snr_db'])} dB" for g, v in report.all_int8_groups.items())),
        ("FP16 overflow", ", ".join(report.fp16_overflow) or "none"),
    ]))
    t = table("Layers, least robust first", "#", "layer", "op", "ONNX nodes", "SNR dB",
              *(f"{g} SNR dB" for g in groups), "cosine", "default", "FP32 peak")
    for k, r in enumerate(rows):
        peak = fmt_float(r.fp32_peak, ".4g") + (" (overflows FP16)" if r.overflows_fp16 else "")
        t.add_row(str(k + 1), text(r.name), r.op, text(", ".join(r.origin)), _db(r.snr_db),
                  *(_db(r.groups[g]["snr_db"]) for g in groups), fmt_float(r.cosine, ".5f"), text(r.default), peak)
    out.print(t)
    return 0
