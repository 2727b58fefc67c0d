"""`sartor sensitivity MODEL.onnx --calib DATA`: which layers INT8 hurts most, and which overflow FP16."""
from __future__ import annotations

import argparse
import math

from ..builder.config import CALIB_METHODS
from ..quant.calibrators import DEFAULT_PERCENTILE
from .common import console, fmt_float, key_values, print_json, table, text

DESCRIPTION = "Rank layers by how much INT8 alone in that layer degrades the outputs (SNR vs FP32)."
EPILOG = """\
Each conv/gemm layer that can run INT8 is quantized alone (everything else FP32) and the model
outputs on the calibration samples are compared with FP32: SNR = 10·log10(Σref² / Σ(ref−out)²).
The lowest SNRs come first: pin those with `sartor build --layer-precision NODE=fp16`. The
"FP32 peak" column is each layer's largest |output|; above 65504 it overflows FP16.
"""


def add_parser(subparsers, parents) -> None:
    p = subparsers.add_parser("sensitivity", parents=parents, help=DESCRIPTION.rstrip("."), description=DESCRIPTION,
                              epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", metavar="MODEL.onnx", help="the ONNX model")
    p.add_argument("--calib", required=True, metavar="DATA",
                   help="samples: .npy/.npz of preprocessed inputs, or an image dataset with --preprocess")
    p.add_argument("--calib-size", type=int, default=64, metavar="N", help="samples to use (default 64)")
    p.add_argument("--calib-method", type=str.lower, choices=CALIB_METHODS, default=None,
                   help="threshold method (default entropy)")
    p.add_argument("--percentile", type=float, default=DEFAULT_PERCENTILE, metavar="P",
                   help=f"percentile for --calib-method percentile (default {DEFAULT_PERCENTILE})")
    p.add_argument("--calib-balance-by", metavar="ATTRIBUTE",
                   help="image datasets: draw the samples equally from each value of this image attribute")
    p.add_argument("--calib-cache", metavar="FILE", help="take the thresholds from this cache when it exists")
    p.add_argument("--preprocess", metavar="SPEC", help="how images become the input (image datasets)")
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N] (default cpu)")
    p.add_argument("--top", type=int, default=0, metavar="N", help="show only the N least robust layers")
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")
    p.set_defaults(func=run)


def _db(value: float) -> str:
    return "inf" if value == math.inf else fmt_float(value, ".1f")


def run(args) -> int:
    from ..errors import ConfigError
    from ..quant.sensitivity import analyze
    if args.calib_size < 1:
        raise ConfigError(f"--calib-size {args.calib_size} must be at least 1")
    err = console(stderr=True)
    with err.status("calibrating") as status:
        report = analyze(args.model, args.calib, args.calib_size, args.calib_method, args.percentile,
                         args.calib_cache, args.preprocess, args.device,
                         on_layer=lambda k, n, name: status.update(f"layer {k + 1}/{n}: {name}"),
                         balance_by=args.calib_balance_by)
    rows = report.layers[:args.top] if args.top > 0 else report.layers
    if args.json:
        print_json(dict(report.to_json(), layers=[r.to_json() for r in rows]))
        return 0
    out = console()
    out.print(key_values("INT8 sensitivity", [
        ("samples", report.samples), ("thresholds", report.method),
        ("default INT8 plan", f"SNR {_db(report.all_int8_snr_db)} dB, cosine {fmt_float(report.all_int8_cosine, '.5f')}"),
        ("FP16 overflow", ", ".join(report.fp16_overflow) or "none"),
    ]))
    t = table("Layers, least robust first", "#", "layer", "op", "ONNX nodes", "SNR dB", "cosine", "default",
              "FP32 peak")
    for k, r in enumerate(rows):
        peak = fmt_float(r.fp32_peak, ".4g") + (" (overflows FP16)" if r.overflows_fp16 else "")
        t.add_row(str(k + 1), text(r.name), r.op, text(", ".join(r.origin)), _db(r.snr_db),
                  fmt_float(r.cosine, ".5f"), text(r.default), peak)
    out.print(t)
    return 0
