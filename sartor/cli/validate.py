"""`sartor validate PLAN --data D`: the task metric of the engine and of its FP32 ONNX reference,
overall and per split, and the accuracy gate.

Exit status 0 when every split's drop (reference − engine) is within --max-drop (or no --max-drop
is given), 1 when one is over, 2 on a usage or data error.
"""
from __future__ import annotations

import argparse
from pathlib import Path

from ..errors import ConfigError
from ..runtime import load
from ..runtime.engine_file import check_writable
from ..validate.ap import AP_METHODS, DEFAULT_AP_METHOD
from ..validate.decoders import DEFAULT_CONF, DEFAULT_IOU, DEFAULT_MAX_DET
from ..validate.metrics import DEFAULT_PSEUDO_CONF
from .common import add_trust_arg, console, print_json, table, text

DESCRIPTION = ("Compute the task metric (top-1, COCO mAP) of an engine and of its FP32 ONNX reference on the "
               "same images, overall and per split; exit 1 when a split drops more than --max-drop.")
EPILOG = """\
data:
  --data takes an ImageFolder tree (one folder per class), a COCO .json (or a folder holding one),
  or a .jsonl/.csv manifest (path, label, and any attribute columns such as lighting). Without
  labels the FP32 reference's outputs are the ground truth: top-1 agreement for classifiers,
  pseudo-label mAP (reference detections with score >= --pseudo-conf) for detectors.

splits:
  --split-by lighting scores each value of an image attribute (a COCO image field or a manifest
  column) on its own; the gate applies to every split and to the whole set.

AP methods (detection, --ap-method):
{ap_methods}

decoders (detection):
  yolo     raw YOLOv8/YOLO11 head [B, 4+C, N]
  boxes    boxes [B,N,4] xyxy + scores [B,N,C] (or [B,N] + classes [B,N]), or one [B,N,6]
  mod:fn   your function fn(outputs: dict[str, ndarray], metas: list[ImageMeta]) -> list[Detections]
  (default: recognised from the output shapes)
"""


def ap_methods_help() -> str:
    return "\n".join(f"  {m.name:<12} {m.summary}" for m in AP_METHODS.values())


def add_parser(subparsers, parents) -> None:
    p = subparsers.add_parser("validate", parents=parents, help="Task metric of an engine vs its FP32 reference",
                              description=DESCRIPTION, epilog=EPILOG.format(ap_methods=ap_methods_help()),
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("plan", metavar="PLAN", help="the engine file")
    p.add_argument("--data", required=True, metavar="D", help="dataset: image folder, COCO .json or manifest")
    p.add_argument("--reference", metavar="MODEL.onnx",
                   help="the FP32 ONNX reference (default: the model the engine was built from)")
    p.add_argument("--task", choices=("classify", "detect"), help="default: from the dataset or the outputs")
    p.add_argument("--split-by", metavar="ATTRIBUTE", help="score each value of this image attribute on its own")
    p.add_argument("--max-drop", type=float, metavar="X",
                   help="fail (exit 1) when reference − engine exceeds X in any split (e.g. 0.008)")
    p.add_argument("--report", metavar="report.html", help="write a self-contained HTML report here")
    p.add_argument("--json", action="store_true", help="print the report as JSON instead of a table")
    p.add_argument("--batch", type=int, metavar="N", help="images per run (default: the profile's max batch, ≤ 32)")
    p.add_argument("--decoder", metavar="yolo|boxes|module:function", help="how detections are decoded")
    p.add_argument("--preprocess", metavar="SPEC",
                   help="override the engine's preprocessing, e.g. letterbox=640,mean=0,std=255,rgb,nchw")
    p.add_argument("--max-downscale", metavar="X|any",
                   help="the most an image may be shrunk to fit the engine's largest resolution bucket, instead of "
                        "the engine's policy (a factor ≥ 1, or any); an image shrunk more is refused")
    p.add_argument("--classes", metavar="FILE|a,b,c",
                   help="class names in the model's output order (a file with one per line, or a comma list)")
    p.add_argument("--conf", type=float, default=DEFAULT_CONF,
                   help=f"detection score threshold before NMS (default {DEFAULT_CONF})")
    p.add_argument("--iou", type=float, default=DEFAULT_IOU, help=f"NMS IoU threshold (default {DEFAULT_IOU})")
    p.add_argument("--max-det", type=int, default=DEFAULT_MAX_DET,
                   help=f"detections kept per image (default {DEFAULT_MAX_DET})")
    # Not argparse choices: an unknown name is refused by validate() in one line, from Python too.
    p.add_argument("--ap-method", default=DEFAULT_AP_METHOD, metavar="|".join(AP_METHODS),
                   help=f"how a detector's mAP is computed (default {DEFAULT_AP_METHOD}; see AP methods below)")
    p.add_argument("--pseudo-conf", type=float, default=DEFAULT_PSEUDO_CONF,
                   help=f"without labels: reference detections at or above this score are the ground truth "
                        f"(default {DEFAULT_PSEUDO_CONF})")
    p.add_argument("--device", help="cpu or cuda[:N] (default: the kind the engine was built for)")
    add_trust_arg(p)
    p.add_argument("--fast-decode", action="store_true",
                   help="decode the engine's images as sartor.Pipeline does by default (nvJPEG on a CUDA engine; on "
                        "the host, JPEGs at 1/2, 1/4 or 1/8 scale when the resize shrinks them that much) instead "
                        "of exactly as the reference: to measure what the deployed decoders cost in accuracy")
    p.set_defaults(func=run)


def read_class_names(value: str | None) -> list[str] | None:
    if not value:
        return None
    path = Path(value)
    if path.is_file():
        try:
            names = [line.strip() for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"--classes {value}: cannot read it ({exc})") from None
    elif "," in value or not (path.suffix or path.parent != Path(".")):
        names = [n.strip() for n in value.split(",") if n.strip()]
    else:
        raise ConfigError(f"--classes {value}: file not found")
    if not names:
        raise ConfigError(f"--classes {value} names no class")
    return names


def _fmt(value, digits: int = 4) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def run(args) -> int:
    from ..validate.report import write_html_report
    from ..validate.runner import validate
    if args.max_drop is not None and args.max_drop < 0:
        raise ConfigError(f"--max-drop {args.max_drop} must not be negative")
    if args.report:
        check_writable(args.report)
    engine = load(args.plan, device=args.device, trust=args.trust)
    report = validate(engine, args.data, reference=args.reference, task=args.task, split_by=args.split_by,
                      max_drop=args.max_drop, batch=args.batch, decoder=args.decoder, preprocess=args.preprocess,
                      device=args.device, conf=args.conf, iou=args.iou, max_det=args.max_det,
                      pseudo_conf=args.pseudo_conf, class_names=read_class_names(args.classes),
                      progress=True, fast_decode=args.fast_decode, max_downscale=args.max_downscale,
                      ap_method=args.ap_method)
    if args.report:
        write_html_report(report, args.report)
    code = 0 if report.passed else 1
    if args.json:
        print_json(dict(report.to_json(), report_html=str(args.report) if args.report else None))
        return code
    out = console()
    mode = "labels" if report.mode == "labels" else "no labels: reference outputs as ground truth"
    out.print(text(f"{report.task} on {report.data}: {report.overall.images} images ({mode}); preprocess "
                   f"{report.preprocess}" + (f"; decoder {report.decoder}" if report.decoder else "")
                   + f"; batch {report.batch}; {report.device} {report.precision}"
                   + ("; fast decode" if report.options.get("fast_decode") else "")))
    gate = f" (gate: drop ≤ {report.max_drop:g})" if report.gated else ""
    ap = f" ({report.ap_method} AP)" if report.ap_method else ""
    out.print(text(f"{report.metric}{ap}, engine vs ONNX Runtime FP32 reference{gate}"))
    rows = table(None, "split", "images", "reference", "engine", "drop", "result")
    for split in [report.overall, *report.splits]:
        if not report.gated:
            result = "-"
        else:
            result = "[green]PASS[/]" if split.passed else "[red]FAIL[/]"
        drop = "-" if split.drop is None else f"{split.drop:+.4f}"
        rows.add_row(text(split.name), str(split.images), _fmt(split.reference), _fmt(split.engine), drop, result)
    out.print(rows)
    for note in report.notes:
        out.print(text(f"note: {note}"))
    if args.report:
        out.print(text(f"report written to {args.report}"))
    if not report.gated:
        out.print(text("not gated: give --max-drop to fail on a drop"))
        return 0
    failed = report.failed_splits
    if failed:
        worst = max(failed, key=lambda s: s.drop)
        out.print(text(f"FAIL: {report.metric} drops more than {report.max_drop:g} in {len(failed)} split(s): "
                       f"{', '.join(s.name for s in failed)} (worst {worst.name}: {worst.drop:+.4f})"))
        return 1
    out.print(text(f"PASS: every drop is within {report.max_drop:g}"))
    return 0
