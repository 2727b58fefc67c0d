"""`sartor build MODEL.onnx -o OUT.plan`: compile an ONNX model into an engine file."""
from __future__ import annotations

import argparse
import time
from pathlib import Path

from ..builder import BuildConfig
from ..builder import build as run_build
from ..builder.accuracy_planner import cosine_text
from ..builder.config import (
    DEFAULT_BUILDER_EFFORT,
    INT8_FALLBACK_PRECISIONS,
    PRECISIONS,
    parse_precision_overrides,
)
from ..data.buckets import preprocess_line
from ..errors import ConfigError
from ..progress import ProgressReport
from ..quant.auto_method import BUILD_METHODS, DEFAULT_BUILD_METHOD
from ..runtime.fingerprint import describe
from ..runtime.kernel_store import describe_record
from ..runtime.profiles import Profile, parse_shape_spec
from .common import (
    add_calibration_args,
    console,
    describe_precision,
    fmt_bytes,
    key_values,
    print_json,
    table,
    text,
)
from .build_summary import summary_json
from .inspect import calibration_line, planner_candidates, reduced_precision
from .validate import read_class_names

SHAPE_KINDS = {"--min-shapes": "min", "--opt-shapes": "opt", "--max-shapes": "max", "--profile": "profile"}

DESCRIPTION = "Compile an ONNX model into an engine file for one device."
EPILOG = """\
shapes and profiles:
  Dynamic inputs need a shape range: --min-shapes, --opt-shapes and --max-shapes take
  NAME:1x3x320x320 (comma-separate several inputs). Kernels are chosen at the opt shape; a run
  outside min..max is refused. Give just one of the three for a fixed shape.

  --profile starts a new optimization profile: the --min/--opt/--max-shapes after it belong to
  that profile, those before the first --profile to profile 0. Example with two profiles:

    sartor build m.onnx -o m.plan \\
      --min-shapes images:1x3x320x320 --opt-shapes images:1x3x320x320 --max-shapes images:4x3x320x320 \\
      --profile \\
      --min-shapes images:8x3x320x320 --opt-shapes images:16x3x320x320 --max-shapes images:32x3x320x320

  A run uses the first profile that admits its shapes (or the one its context is bound to).

precision overrides:
  --layer-precision NODE=fp32 pins ONNX nodes (glob on node names, e.g. '/head/*=fp32');
  --op-precision LayerNormalization=fp32 pins every node of an op type. An override that matches
  no layer is an error.

preprocessing:
  --preprocess records how an image becomes the input (comma-separated tokens):
    letterbox=N or HxW   keep the aspect ratio, scale to fit, pad centered with 114 (pad=V to change)
    resize=HxW           stretch to HxW;  none: use images as they are (default)
    mean=M or M1:M2:M3   subtract (default 0), in 0..255 pixel units
    std=S or S1:S2:S3    then divide (default 1)
    rgb | bgr            channel order (default rgb);  nchw | nhwc  layout (default nchw)
    dtype=float32|float16|uint8
    max_downscale=X|any  the most a frame may be shrunk to fit (default: any with one size)
  The size must match the image input's H and W in every profile.

resolution buckets:
  --preprocess letterbox=320|480|640,... builds one profile per size (the shape flags give the
  batch range once, at one of the sizes, and each size gets it; or give one --profile per size).
  sartor.Pipeline, validate, bench --end-to-end and serve's image route run each frame in the
  smallest bucket that holds it whole; a frame larger than every bucket goes to the one that
  shrinks it least if that shrinks it at most max_downscale (default 1 with several sizes: never),
  else it is refused in one line, not shrunk. max_downscale=2 lets a 1280x720 camera frame into
  the 640 bucket; Pipeline(max_downscale=...) and --max-downscale override it at run time.
  Example: --preprocess letterbox=320|480|640,mean=0,std=255,max_downscale=3 --min-shapes
  images:1x3x640x640 --opt-shapes images:8x3x640x640 --max-shapes images:32x3x640x640

detections:
  --nms conf=0.25,iou=0.45,max_det=300,topk=1000 appends to a YOLOv8/YOLO11 detector (the raw
  [B, 4+C, anchors] head) the decoding of its boxes and class-aware NMS with torchvision's greedy
  semantics, as TensorRT's EfficientNMS plugin: every (anchor, class) over conf is a candidate,
  the topk best per image (at most 4096) go through NMS, the max_det first kept are written. The
  engine's outputs become num_detections [B] int32, detection_boxes [B,max_det,4] (x1,y1,x2,y2 in
  input pixels), detection_scores [B,max_det], detection_classes [B,max_det] int32; all fixed-size,
  so on CUDA the NMS runs inside the engine's CUDA graph. Add "agnostic" for class-agnostic NMS.
  Above topk candidates, only the topk best are considered (the build log says so).

INT8:
  --precision int8 --calib DATA runs Conv/Gemm/MatMul layers with constant weights in INT8
  (per-channel weight scales, per-tensor activation scales from calibration) and the others in
  FP16 on CUDA, FP32 on the CPU (--int8-fallback-precision fp32|fp16|bf16 sets it, e.g. to compare
  CPU and CUDA engines layer for layer). DATA is a .npy (one input: [N, ...] samples) or .npz (one array
  per input) of preprocessed samples, or an image dataset read with --preprocess. The final
  conv/gemm of each output branch stays out of INT8, and so do the layers inside a branch that feeds
  only one head, unless a decode averages that head (a YOLO box head; decision 0045); pin a layer
  with --layer-precision NODE=int8; --layer-precision NODE=fp16 keeps any layer out. --calib-cache
  FILE is written after calibrating and read (skipping calibration) when it exists; delete it to
  recalibrate.

  --bias-correction (off by default): each INT8/FP8 layer's per-channel mean output error against
  FP32 (before its activation, on the --calib samples) is subtracted from its bias. The
  corrections are stored in --calib-cache; a build from a cache without them needs --calib.
  Q/DQ models are left alone.

  --calib-balance-by lighting draws the calibration images equally from each value of an image
  attribute. --data VAL (a dataset as `sartor validate` takes) with --split-by lighting: a split of
  VAL that the calibration sample misses, or holds under 25% of its fair share of, is warned about
  (build log and stderr). --accuracy-budget 0.008 measures the engine's metric drop against the
  FP32 ONNX model on VAL (overall and per split) and keeps the most INT8-sensitive layers at FP16
  (FP32 on the CPU) until every drop is within the budget; the build fails when even no INT8 layer
  at all misses it. `sartor inspect` shows the layers kept and why, and each measured iteration.
  --min-cosine 0.99 (instead of --accuracy-budget) needs no labels: the same search, until every
  output's mean per-sample cosine against FP32 reaches 0.99 on --cosine-samples held-out samples
  (VAL when given, else --calib samples beyond the calibration draw; never a calibration sample).
  --min-snr 30 (instead of either) needs no labels either: the same search on the same held-out
  samples, until every output's SNR against FP32, 10·log10(Σref² / Σ(ref−out)²) over the samples,
  reaches 30 dB. --decoder yolo|boxes makes both label-free targets compare a detector's boxes and
  scores apart (as `sartor sensitivity --decoder`), so that box coordinates in pixels do not drown
  the scores' error; the worst group decides.

FP8:
  --precision fp8 --calib DATA quantizes the same layers to FP8 E4M3 instead (per-channel weight
  scales max|w|/448, per-tensor activation scales amax/448 from the same calibration options,
  float32 bias), with the same output-head rule and --int8-fallback-precision for the other
  layers; --layer-precision NODE=fp8 or --op-precision Conv=fp8 pins layers in any build. On the
  CPU FP8 layers run an exact emulation; on CUDA the FP8 tensor-core kernel needs compute
  capability 8.9 or newer (elsewhere the emulation runs). --accuracy-budget, --min-cosine and
  --min-snr plan FP8 builds as they plan INT8 ones: the layers FP8 hurts most (ranked as `sartor
  sensitivity --precision fp8` ranks them) move to the fallback precision.

FP16/BF16 accuracy targets:
  --precision fp16 (or bf16) with --min-cosine C, --min-snr DB or --accuracy-budget X keeps the
  layers FP16 hurts most at FP32 until the target holds: each layer is ranked by the output SNR
  with it alone at FP16 (every other layer FP32), then the same search as for INT8 builds. The
  held-out samples are every sample of --calib DATA (up to --cosine-samples; nothing is
  calibrated), or of --data VAL; one of them is required: seeded random inputs are never used.
  FP16 typically reaches a cosine of 0.9995..0.99999 against FP32; --min-cosine 0.9999 asks for
  more than that on the models it misses. --timing-cache FILE lets the trial builds and the final
  one share tactic timings (each trial then times only the layers it moved).

tactics:
  Each fused convolution is timed at the opt shape with every implementation that applies (CUDA:
  torch, triton_epilogue, cudnn_fused; CPU: torch, channels_last); those whose output differs from
  the reference are rejected, the fastest is kept. --builder-effort 0 times nothing (the reference
  kernel everywhere), 1 times briefly, 2 is the default, 3..5 time longer. --timing-cache FILE keeps
  the timings (JSON, per device fingerprint, shareable between machines): layers timed before on this
  device are not timed again. Delete the file to start over.

kernels:
  A CUDA build runs the finished engine once at each profile's min, opt and max shapes and stores
  the compiled Triton kernels it ran (GPU binary and metadata, no host code) in the engine file.
  Loading installs them into a private cache keyed by the engine's checksum (never Triton's
  user-wide cache), so the first run on a fresh machine compiles nothing at those shapes (other
  sizes inside a profile may compile once; set SARTOR_NO_KERNEL_INSTALL=1 to compile them there
  instead). --no-embed-kernels leaves them out (smaller file). `sartor inspect` shows them.

signing:
  --sign-key KEY signs the engine with an Ed25519 private key from `sartor keygen -o KEY`; devices
  with a trust store (`--trust DIR`, SARTOR_TRUST) load only engines signed by its keys.
"""


class _ShapeEvent(argparse.Action):
    """Records --min/--opt/--max-shapes and --profile in command-line order."""

    def __call__(self, parser, namespace, values, option_string=None):
        events = list(getattr(namespace, self.dest, None) or [])
        events.append((SHAPE_KINDS[option_string], values))
        setattr(namespace, self.dest, events)


def add_parser(subparsers, parents) -> None:
    p = subparsers.add_parser("build", parents=parents, help=DESCRIPTION.rstrip("."), description=DESCRIPTION,
                              epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", metavar="MODEL.onnx", help="the ONNX model")
    p.add_argument("-o", "--output", required=True, metavar="OUT.plan", help="where to write the engine")
    p.add_argument("--device", help="cpu or cuda[:N] (default: cuda when available, else cpu)")
    p.add_argument("--precision", default="fp32", type=str.lower, choices=PRECISIONS,
                   help="precision of the layers not pinned otherwise (default fp32)")
    p.add_argument("--int8-fallback-precision", type=str.lower, choices=INT8_FALLBACK_PRECISIONS,
                   help="with --precision int8 or fp8: the precision of the layers that do not run INT8 (FP8) "
                        "(default fp16 on CUDA, fp32 on the CPU; give one to make CPU and CUDA engines comparable)")
    for flag, kind in (("--min-shapes", "min"), ("--opt-shapes", "opt"), ("--max-shapes", "max")):
        p.add_argument(flag, action=_ShapeEvent, dest="shape_events", metavar="NAME:1x3x320x320[,...]",
                       help=f"{kind} shapes of the current profile")
    p.add_argument("--profile", action=_ShapeEvent, dest="shape_events", nargs=0,
                   help="start a new profile: the shape flags after it belong to it")
    p.add_argument("--layer-precision", action="append", default=[], metavar="NODE=PRECISION",
                   help="pin ONNX nodes matching a glob to a precision (repeatable)")
    p.add_argument("--op-precision", action="append", default=[], metavar="OP=PRECISION",
                   help="pin every node of an op type to a precision (repeatable)")
    p.add_argument("--preprocess", metavar="SPEC",
                   help="how images become the input, stored in the engine for `sartor validate`, e.g. "
                        "letterbox=640,mean=0,std=255,rgb,nchw or resize=224x224,mean=123.675:116.28:103.53,"
                        "std=58.395:57.12:57.375; letterbox=320|480|640,... builds resolution buckets (see "
                        "'preprocessing' and 'resolution buckets' below)")
    p.add_argument("--input-format", metavar="uint8:HxW[:bgr]",
                   help="the engine takes raw uint8 frames N×H×W×3 of this size (RGB unless :bgr) and applies "
                        "--preprocess as its first layer, inside its CUDA graph (e.g. uint8:720x1280); the "
                        "profiles' batch ranges carry over")
    p.add_argument("--nms", metavar="SPEC",
                   help="append the YOLO head's decode and class-aware NMS to the engine: its outputs become "
                        "num_detections, detection_boxes, detection_scores, detection_classes (fixed size), e.g. "
                        "conf=0.25,iou=0.45,max_det=300,topk=1000[,agnostic] (see 'detections' below)")
    add_calibration_args(p, BuildConfig.calib_size, required=False,
                         cache_help="calibration cache: read when it exists (calibration skipped), written otherwise",
                         methods=BUILD_METHODS, default_method=DEFAULT_BUILD_METHOD)
    p.add_argument("--bias-correction", action=argparse.BooleanOptionalAction, default=BuildConfig.bias_correction,
                   help="INT8/FP8: subtract each quantized layer's per-channel mean output shift, measured on --calib "
                        "(or read from --calib-cache), from its bias (default: "
                        f"{'on' if BuildConfig.bias_correction else 'off'})")
    p.add_argument("--builder-effort", type=int, choices=range(6), default=DEFAULT_BUILDER_EFFORT, metavar="0..5",
                   help=f"how hard to search for the fastest kernels: 0 no timing, 1 quick, {DEFAULT_BUILDER_EFFORT} "
                        f"default, up to 5 (more warm-up and iterations)")
    p.add_argument("--fallback-where-faster", action="store_true",
                   help="INT8/FP8: run a layer at the fallback precision where its best kernel is faster there and "
                        "the whole engine gets faster, every layer if that is fastest (three builds; the engine "
                        "records the comparison)")
    p.add_argument("--pdl", action=argparse.BooleanOptionalAction, default=None,
                   help="compute capability 9.0+: launch sartor's own Triton kernels (INT8/FP8 layers, FP16/BF16 "
                        "convolutions on the implicit GEMM) with programmatic dependent launch, each starting while "
                        "the one before it ends (--no-pdl: never; default: where the whole engine measures faster "
                        "with it, timed at the build)")
    p.add_argument("--conv-chains", action=argparse.BooleanOptionalAction, default=None,
                   help="CUDA: run two convolutions in a row as one kernel where that times faster than the two "
                        "layers (--no-conv-chains: never; default: those, kept where the whole engine also "
                        "measures faster with them, timed at the build)")
    p.add_argument("--max-aux-streams", type=int, default=BuildConfig.max_aux_streams, metavar="N",
                   help=f"CUDA: time the engine with 0 to N auxiliary streams for its independent branches and "
                        f"keep the fastest as its contexts' default (trtexec's --maxAuxStreams; 0: one stream; "
                        f"default {BuildConfig.max_aux_streams})")
    p.add_argument("--timing-cache", metavar="FILE",
                   help="tactic timing cache: read before tactic selection, new timings merged in after")
    p.add_argument("--exclude-tactic", action="append", default=[], metavar="PATTERN",
                   help="a glob over tactic names (`sartor inspect` lists them) the builder never runs, e.g. "
                        "'window_resident.*.row-pairs*' after a build stopped on a kernel that faulted the GPU; repeatable")
    p.add_argument("--data", metavar="VAL",
                   help="INT8: the validation set (COCO, ImageFolder or manifest) for the split coverage check and "
                        "--accuracy-budget; any planner target (INT8, FP8, FP16, BF16): the held-out samples")
    p.add_argument("--split-by", metavar="ATTRIBUTE", help="with --data: the image attribute that splits it")
    p.add_argument("--classes", metavar="FILE|a,b,c",
                   help="with --data: its class names in the model's output order (as `sartor validate --classes`)")
    p.add_argument("--accuracy-budget", type=float, metavar="X",
                   help="INT8/FP8 (FP16/BF16: to FP32): keep the most sensitive layers out of the build's precision "
                        "until the metric drop against the FP32 ONNX model on --data is at most X overall and in "
                        "every split (e.g. 0.008)")
    p.add_argument("--min-cosine", type=float, metavar="C",
                   help="INT8/FP8 (FP16/BF16: to FP32), no labels needed: keep the most sensitive layers out of the "
                        "build's precision until, for every output, the mean per-sample cosine against FP32 on "
                        "held-out samples (--data, else --calib samples that calibration does not use: all of them "
                        "in an FP16/BF16 build) is at least C (e.g. 0.99 for INT8, 0.9999 for FP16)")
    p.add_argument("--min-snr", type=float, metavar="DB",
                   help="INT8/FP8 (FP16/BF16: to FP32), no labels needed: keep the most sensitive layers out of the "
                        "build's precision "
                        "until every output's SNR against FP32 on the held-out samples of --min-cosine is at least "
                        "DB decibels (e.g. 30)")
    p.add_argument("--cosine-samples", type=int, default=BuildConfig.cosine_samples, metavar="N",
                   help=f"held-out samples --min-cosine and --min-snr are measured on (default "
                        f"{BuildConfig.cosine_samples})")
    p.add_argument("--decoder", metavar="yolo|boxes",
                   help="with --min-snr or --min-cosine: compare a detector's boxes and scores apart (yolo: the raw "
                        "[B, 4+C, N] head; boxes: boxes [B,N,4] with scores); default: each output as a whole")
    p.add_argument("--no-eager-check", action="store_true",
                   help="do not time the engine against its layers on their eager (cuDNN/cuBLAS/torch) kernels at the "
                        "end of the build (a profile where those are faster keeps them)")
    p.add_argument("--no-overflow-guard", action="store_true",
                   help="in fp16 builds, do not keep layers whose outputs overflow FP16 in FP32")
    p.add_argument("--no-embed-kernels", action="store_true",
                   help="CUDA: do not store the compiled Triton kernels in the engine (a smaller file; the first "
                        "run on a machine whose Triton cache lacks them JIT-compiles them)")
    p.add_argument("--bundle", metavar="DIR",
                   help="also write a provenance bundle to DIR (a new directory, or one file when it ends in .tar): "
                        "the model, options, calibration and timing caches, golden outputs; `sartor rebuild DIR` "
                        "rebuilds the engine from it")
    p.add_argument("--sign-key", metavar="KEY", help="sign the engine with this Ed25519 private key (`sartor keygen`)")
    p.add_argument("--json", action="store_true",
                   help="print the build summary as one JSON document on stdout (progress and warnings go to stderr)")
    p.set_defaults(func=run, shape_events=None)


def profiles_from_events(events: list[tuple[str, object]] | None) -> list[dict]:
    """The shape flags, in order, as BuildConfig profiles: a --profile starts the next profile."""
    profiles = [{"min": {}, "opt": {}, "max": {}}]
    opened = False  # a leading --profile just opens profile 0

    def empty(profile):
        return not any(profile.values())

    for kind, value in events or []:
        if kind == "profile":
            if empty(profiles[-1]):
                if len(profiles) == 1 and not opened:
                    opened = True
                    continue
                raise ConfigError(f"profile {len(profiles) - 1} has no shapes: give --min-shapes/--opt-shapes/"
                                  f"--max-shapes after each --profile")
            profiles.append({"min": {}, "opt": {}, "max": {}})
            continue
        shapes = parse_shape_spec(value)
        if not shapes:
            raise ConfigError(f"--{kind}-shapes {value!r} names no input")
        current = profiles[-1][kind]
        for name, shape in shapes.items():
            if name in current:
                raise ConfigError(f"--{kind}-shapes gives input {name!r} twice in profile {len(profiles) - 1}")
            current[name] = shape
    if empty(profiles[-1]):
        if len(profiles) > 1 or opened:
            raise ConfigError(f"profile {len(profiles) - 1} has no shapes: give --min-shapes/--opt-shapes/"
                              f"--max-shapes after each --profile")
        return []
    return profiles


def config_from_args(args) -> BuildConfig:
    return BuildConfig(
        model_path=args.model, output_path=args.output, device=args.device, precision=args.precision,
        profiles=profiles_from_events(args.shape_events),
        layer_precision=parse_precision_overrides(args.layer_precision, "--layer-precision"),
        op_precision=parse_precision_overrides(args.op_precision, "--op-precision"),
        overflow_guard=not args.no_overflow_guard, eager_check=not args.no_eager_check, preprocess=args.preprocess,
        input_format=args.input_format,
        nms=args.nms,
        calib=args.calib, calib_size=args.calib_size, calib_method=args.calib_method, percentile=args.percentile,
        calib_cache=args.calib_cache, builder_effort=args.builder_effort, timing_cache=args.timing_cache,
        calib_balance_by=args.calib_balance_by, int8_fallback_precision=args.int8_fallback_precision,
        data=args.data, split_by=args.split_by,
        accuracy_budget=args.accuracy_budget, classes=read_class_names(args.classes),
        min_cosine=args.min_cosine, cosine_samples=args.cosine_samples, embed_kernels=not args.no_embed_kernels,
        min_snr=args.min_snr, decoder=args.decoder, bias_correction=args.bias_correction,
        fallback_where_faster=args.fallback_where_faster, pdl=args.pdl, conv_chains=args.conv_chains,
        max_aux_streams=args.max_aux_streams,
        exclude_tactics=args.exclude_tactic,
        sign_key=args.sign_key)


def run(args) -> int:
    config = config_from_args(args)
    out = console()
    # A live bar on a terminal; in a log a line per stage and, inside long stages, every few seconds.
    report = ProgressReport("build")
    current: dict = {}

    def finish_stage() -> None:
        if current:
            report.print(f"  done {current['name']:<10} {time.perf_counter() - current['start']:.3f} s")

    def on_stage(name: str) -> None:
        finish_stage()
        current.update(name=name, start=time.perf_counter())
        report(name)

    on_stage.advance = report.advance  # per layer and per calibration batch (builder.build's `advance`)
    with report:
        if args.bundle:
            from ..deploy import build_bundle
            bundled = build_bundle(config, args.bundle, progress=on_stage, warn=report.print)
            result = bundled.build
        else:
            result = run_build(config, progress=on_stage, warn=report.print)
        finish_stage()
    bundle = {"path": str(bundled.path), "files": bundled.files, "bytes": bundled.bytes} if args.bundle else None
    if args.json:
        print_json(summary_json(result, bundle))
        return 0
    print_summary(out, result)
    if args.bundle:
        out.print(text(f"bundle: {bundled.path} ({bundled.files} files, {fmt_bytes(bundled.bytes)}); "
                       f"`sartor rebuild {bundled.path} -o OUT.plan` rebuilds the engine"))
    return 0


def precision_mix(layers: list[dict]) -> str:
    counts: dict[str, int] = {}
    for layer in layers:
        counts[layer["precision"]] = counts.get(layer["precision"], 0) + 1
    return ", ".join(f"{p} {n}" for p, n in sorted(counts.items(), key=lambda kv: -kv[1]))


def _drop(value) -> str:
    return "-" if value is None else f"{value:.4f}"


def _db(value) -> str:
    return "nan" if value is None else f"{value:.2f} dB"


def print_summary(out, result) -> None:
    header = result.header
    profiles = [Profile.from_json(p) for p in header["profiles"]]
    size = Path(result.path).stat().st_size if Path(result.path).is_file() else 0
    arenas = [p.get("arena_bytes", 0) for p in header.get("memory", {}).get("profiles", [])]
    rows = [
        ("engine", f"{result.path} ({fmt_bytes(size)})"),
        ("device", f"{header['device']}: {describe(header['fingerprint'])}"),
        ("precision", describe_precision(header)),
        ("ONNX nodes", result.onnx_nodes),
        ("layers", f"{result.layers} after fusion"),
        ("precision mix", precision_mix(header["layers"])),
    ]
    rows += [(f"profile {k}", p.describe()) for k, p in enumerate(profiles)]
    if header.get("preprocess"):
        rows.append(("preprocess", preprocess_line(header)))
    if header.get("input_format"):
        rows.append(("input", f"raw frames {header['input_format']['text']} (N×H×W×3), preprocessed in the engine"))
    calibration = header["provenance"].get("calibration")
    if calibration:
        rows.append(("calibration", calibration_line(calibration)))
        for attribute, counts in (calibration.get("splits") or {}).items():
            rows.append((f"calibration by {attribute}", ", ".join(f"{v} {n}" for v, n in counts.items())))
    planner = header.get("planner")
    word = reduced_precision(planner).upper() if planner else ""
    if planner and planner.get("target") == "min_snr":
        rows.append(("min SNR", f"{planner['min_snr']:g} dB on {planner['held_out']['samples']} held-out samples: "
                                f"{len(planner['kept_out'])} of {planner_candidates(planner)} {word} layer(s) kept at "
                                f"{planner['precision']} after {len(planner['iterations'])} measurement(s); "
                                + ", ".join(f"{k} {_db(v['snr_db'])}" for k, v in planner["outputs"].items())))
    elif planner and planner.get("target") == "min_cosine":
        rows.append(("min cosine", f"{planner['min_cosine']:g} on {planner['held_out']['samples']} held-out samples: "
                                   f"{len(planner['kept_out'])} of {planner_candidates(planner)} {word} layer(s) "
                                   f"kept at {planner['precision']} after {len(planner['iterations'])} measurement(s); "
                                   + ", ".join(f"{k} mean {cosine_text(v['mean'])} (min {cosine_text(v['min'])})"
                                               for k, v in planner["outputs"].items())))
    elif planner:
        rows.append(("accuracy budget", f"{planner['budget']:g} {planner['metric']}: {len(planner['kept_out'])} of "
                                        f"{planner_candidates(planner)} {word} layer(s) kept at {planner['precision']} "
                                        f"after {len(planner['iterations'])} measurement(s); drop "
                                        + ", ".join(f"{k} {_drop(v)}" for k, v in planner["drops"].items())))
    if "kernels" in header:
        rows.append(("kernels", describe_record(header["kernels"], header["fingerprint"].get("kind", "cuda"))))
    rows += [("activation arena", ", ".join(fmt_bytes(a) for a in arenas) or "-"),
             ("build seconds", f"{result.seconds:.3f}")]
    out.print(key_values("Build summary", rows))
    stages = table("Stage seconds", *result.stage_seconds.keys())
    stages.add_row(*(f"{s:.3f}" for s in result.stage_seconds.values()))
    out.print(stages)
    if result.tactic_seconds:
        families = table("Tactics stage by family", "family", "seconds", "compiling", "timing", "candidates timed")
        for family, entry in result.tactic_seconds.items():
            families.add_row(family, f"{entry['seconds']:.3f}", f"{entry['compile_s']:.3f}", f"{entry['time_s']:.3f}",
                             str(entry["candidates"]))
        out.print(families)
    out.print("[bold]Build log[/]")
    if not result.log:
        out.print("  (nothing to report)")
    for line in result.log:
        out.print(text(f"  {line}"))
    pinned = [layer for layer in header["layers"] if layer["precision"] != header["build_config"]["precision"]]
    if not pinned and header["build_config"]["precision"] != "fp32":
        out.print(f"  every layer runs {header['build_config']['precision']}")
