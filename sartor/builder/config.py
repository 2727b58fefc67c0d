"""BuildConfig: every option of one build, in one place, with its defaults."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from ..errors import ConfigError
from ..ir.dtypes import FP16_MAX, PRECISIONS, QUANTIZED_PRECISIONS
from ..quant.auto_method import BUILD_METHODS
from ..quant.bias_correction import DEFAULT_BIAS_CORRECTION
from ..quant.calibrators import DEFAULT_PERCENTILE
from ..runtime.branch_streams import DEFAULT_MAX_TIMED, MAX_AUX_STREAMS

# What the layers that do not run INT8 may run at in an INT8 build (TensorRT: --int8 alone is FP32,
# --int8 --fp16 lets them run FP16). FP8 builds take the same setting, under the same name.
INT8_FALLBACK_PRECISIONS = ("fp32", "fp16", "bf16")
# The float precisions whose builds the accuracy planner serves too, keeping layers FP32
# (docs/decisions/0050-fp16-accuracy-targets.md).
PLANNED_FLOAT_PRECISIONS = ("fp16", "bf16")
PLANNED_PRECISIONS = (*QUANTIZED_PRECISIONS, *PLANNED_FLOAT_PRECISIONS)
# How hard tactic selection searches (0..5): 0 times nothing, 2 is the default (see tactics.select).
DEFAULT_BUILDER_EFFORT = 2
# The builds whose layers may run a kernel that takes part in programmatic dependent launch
# (builder/pdl.py): INT8 (FP8) layers, and FP16 (BF16) convolutions on the implicit GEMM.
PDL_PRECISIONS = (*QUANTIZED_PRECISIONS, *PLANNED_FLOAT_PRECISIONS)


@dataclass
class BuildConfig:
    model_path: str
    output_path: str
    device: str | None = None  # None: cuda when available, else cpu
    precision: str = "fp32"
    # One entry per profile: {"min": {name: shape}, "opt": {...}, "max": {...}}
    profiles: list = field(default_factory=list)
    layer_precision: dict = field(default_factory=dict)  # ONNX node name (glob) -> precision
    op_precision: dict = field(default_factory=dict)  # ONNX op type -> precision
    overflow_guard: bool = True
    overflow_threshold: float = FP16_MAX
    guard_samples: int = 2  # random batches at the opt shape used by the FP16 overflow guard
    seed: int = 0
    preprocess: str | None = None  # how images become the input, e.g. "letterbox=320,mean=0,std=255,rgb,nchw"
    # `uint8:720x1280[:bgr]`: the engine takes raw frames and applies `preprocess` as its first layer.
    input_format: str | None = None
    # `--nms conf=0.25,iou=0.45,max_det=300,topk=1000`: the YOLO head's decode and class-aware NMS
    # appended to the engine, its outputs four fixed-size tensors (ops/nms.py, passes/append_nms.py).
    nms: str | None = None
    builder_effort: int = DEFAULT_BUILDER_EFFORT
    # Globs over tactic names the builder never runs (`--exclude-tactic`): a kernel that faults the
    # GPU here ends the build (a TacticFaultError naming its layer), and this rebuilds without it.
    exclude_tactics: list = field(default_factory=list)
    timing_cache: str | None = None  # JSON file of tactic timings: read before tactic selection, merged after
    # CUDA builds store the compiled Triton kernels the engine runs at its profiles' min, opt and max
    # shapes, so that loading on a fresh machine JIT-compiles nothing there (other sizes inside a
    # profile may compile once; sartor/runtime/kernel_store.py); False keeps files small.
    embed_kernels: bool = True
    # An Ed25519 private key file (`sartor keygen`): the engine is written signed with it. Not
    # recorded in the engine's header: it says who vouches for the file, not how it was built.
    sign_key: str | None = None
    # INT8 (sartor/quant): calibration data (.npy/.npz of input samples, or a dataset), how many
    # samples, the threshold method (None: auto, docs/decisions/0029-auto-calibration-method.md)
    # and the calibration cache file.
    calib: str | None = None
    # Calibration data given from Python (`sartor.build(calib=array)`): a quant.python_data.PythonSamples.
    # `calib` then holds its label; the data itself is never written into the engine's header.
    calib_data: object = field(default=None, repr=False, compare=False)
    calib_size: int = 500
    calib_method: str | None = None
    percentile: float = DEFAULT_PERCENTILE
    calib_cache: str | None = None
    calib_balance_by: str | None = None  # draw the calibration images equally from each value of this attribute
    # Empirical bias correction of the INT8/FP8 layers (sartor/quant/bias_correction.py): each
    # layer's per-channel mean output shift, measured on --calib (or read from the calibration
    # cache), is subtracted from its bias. Q/DQ models are left alone.
    bias_correction: bool = DEFAULT_BIAS_CORRECTION
    # The precision of an INT8 build's other layers. None: FP16 on CUDA, FP32 on the CPU; setting
    # it makes CPU and CUDA engines run the same precisions, so that they can be compared.
    int8_fallback_precision: str | None = None
    # INT8 (FP8) builds: layers whose best kernel is faster at the fallback precision run there,
    # when that makes the whole engine faster (sartor/builder/speed_fallback.py).
    fallback_where_faster: bool = False
    # Time the layers that have one candidate kernel too (the INT8 emulation on the CPU), so that
    # every layer's time is in the engine; --fallback-where-faster sets it for its builds.
    time_every_layer: bool = False
    # Float builds that timed tactics: the engine timed end to end against its layers on their eager
    # kernels, a profile keeping those where they are faster (sartor/builder/eager_check.py).
    eager_check: bool = True
    # Builds on Hopper and newer: sartor's own Triton kernels of the INT8 (FP8) layers and of the
    # FP16 (BF16) convolutions are launched with programmatic dependent launch (builder/pdl.py), so
    # that each may start while the one before it ends. True: always; False: never; None (default):
    # where the engine measures faster with it, at the build (docs/decisions/0055).
    pdl: bool | None = None
    # CUDA builds that time tactics: two convolutions fused into one kernel where it times faster than
    # the two layers (builder/conv_chains.py). True: every such chain, without the whole-engine check;
    # False: none; None (default): kept where the whole engine also measures faster with them.
    conv_chains: bool | None = None
    # CUDA builds: the auxiliary streams its contexts run independent branches on, timed from 0 up to
    # this many (builder/aux_streams.py; 0: one stream, as before; docs/decisions/0056).
    max_aux_streams: int = DEFAULT_MAX_TIMED
    # The validation set (a dataset `sartor validate` reads): INT8 builds warn when calibration
    # misses one of its splits (by `split_by`, else `calib_balance_by`), and `accuracy_budget`
    # has the planner (sartor/builder/accuracy_planner.py) keep the most sensitive layers out of INT8 until
    # the metric drop against the FP32 ONNX model is within the budget overall and in every split.
    data: str | None = None
    split_by: str | None = None
    accuracy_budget: float | None = None
    # The planner's label-free target, instead of accuracy_budget: the engine's outputs against the
    # FP32 model's on up to cosine_samples held-out samples (images of --data, else samples of --calib
    # that calibration does not use); the worst output's mean per-sample cosine must reach min_cosine.
    min_cosine: float | None = None
    # The other label-free target: the SNR in dB of the engine's outputs against FP32 on the same
    # held-out samples; the worst output's (with `decoder`, the worst output group's) must reach it.
    min_snr: float | None = None
    # How many held-out samples either label-free target measures on (the name predates --min-snr).
    cosine_samples: int = 64
    # The label-free targets compare a detector's boxes and scores apart (yolo | boxes), as
    # `sartor sensitivity --decoder` does; None: each output on its own.
    decoder: str | None = None
    classes: list | None = None  # the class names of --data in the model's output order (as `sartor validate --classes`)

    def validate(self) -> None:
        if Path(self.output_path).resolve() == Path(self.model_path).resolve():
            raise ConfigError(f"output {self.output_path} is the model file itself: choose another output path")
        if self.precision not in PRECISIONS:
            raise ConfigError(f"precision {self.precision!r} is not one of {', '.join(PRECISIONS)}")
        for kind, table in (("layer", self.layer_precision), ("op", self.op_precision)):
            for key, value in table.items():
                if value not in PRECISIONS:
                    raise ConfigError(f"--{kind}-precision {key}={value}: precision must be one of {', '.join(PRECISIONS)}")
        if self.builder_effort not in range(6):
            raise ConfigError(f"--builder-effort {self.builder_effort} must be 0..5")
        for pattern in self.exclude_tactics:
            if not isinstance(pattern, str) or not pattern.strip():
                raise ConfigError(f"--exclude-tactic {pattern!r}: give a glob over tactic names, e.g. "
                                  f"'window_resident.*.row-pairs*'")
        if self.fallback_where_faster and self.precision not in QUANTIZED_PRECISIONS:
            raise ConfigError(f"--fallback-where-faster moves INT8 (FP8) layers to the fallback precision: it needs "
                              f"--precision int8 or fp8, not {self.precision}")
        if (not isinstance(self.max_aux_streams, int) or isinstance(self.max_aux_streams, bool)
                or not 0 <= self.max_aux_streams <= MAX_AUX_STREAMS):
            raise ConfigError(f"--max-aux-streams {self.max_aux_streams!r}: a whole number from 0 to {MAX_AUX_STREAMS}")
        if self.pdl and self.precision not in PDL_PRECISIONS:
            raise ConfigError(f"--pdl launches sartor's own kernels of the INT8 (FP8) layers and of FP16 (BF16) "
                              f"convolutions with programmatic dependent launch: it needs --precision "
                              f"{', '.join(PDL_PRECISIONS)}, not {self.precision}")
        if self.conv_chains and self.builder_effort < 1:
            raise ConfigError("--conv-chains fuses the chains that time faster than their two layers: it needs "
                              "--builder-effort 1 or more, not 0 (which times nothing)")
        if self.fallback_where_faster and self.builder_effort < 1:
            raise ConfigError("--fallback-where-faster compares the builder's timings: it needs --builder-effort 1 "
                              "or more, not 0 (which times nothing)")
        self.preprocess_spec()
        self.frame_format()
        self.nms_settings()
        self._validate_int8()

    def wants_int8(self) -> bool:
        return self.precision == "int8" or "int8" in (*self.layer_precision.values(), *self.op_precision.values())

    def wants_calibration(self) -> bool:
        """Whether any layer may run INT8 or FP8 (both need activation scales from calibration)."""
        asked = (self.precision, *self.layer_precision.values(), *self.op_precision.values())
        return any(p in QUANTIZED_PRECISIONS for p in asked)

    def planner_flag(self) -> str | None:
        """The planner target asked for, as its flag ("--min-snr 30"), or None: no planner."""
        for flag, value in (("--accuracy-budget", self.accuracy_budget), ("--min-cosine", self.min_cosine),
                            ("--min-snr", self.min_snr)):
            if value is not None:
                return f"{flag} {value:g}"
        return None

    def _wants_fp8(self) -> bool:
        return "fp8" in (self.precision, *self.layer_precision.values(), *self.op_precision.values())

    def _validate_int8(self) -> None:
        if self.int8_fallback_precision is not None:
            if self.int8_fallback_precision not in INT8_FALLBACK_PRECISIONS:
                raise ConfigError(f"--int8-fallback-precision {self.int8_fallback_precision!r} is not one of "
                                  f"{', '.join(INT8_FALLBACK_PRECISIONS)}")
            if self.precision not in QUANTIZED_PRECISIONS:
                raise ConfigError(f"--int8-fallback-precision sets the precision of the layers an INT8 (FP8) build "
                                  f"keeps out of INT8 (FP8): it needs --precision int8, not {self.precision} "
                                  f"(or --precision fp8)")
        if self.calib_method is not None and self.calib_method not in BUILD_METHODS:
            raise ConfigError(f"--calib-method {self.calib_method!r} is not one of {', '.join(BUILD_METHODS)}")
        if not 0.0 < self.percentile <= 100.0:
            raise ConfigError(f"--percentile {self.percentile:g} must be in (0, 100]")
        if self.calib_size < 1:
            raise ConfigError(f"--calib-size {self.calib_size} must be at least 1")
        self._validate_planner()
        if not self.wants_calibration():
            return
        cached = self.calib_cache is not None and Path(self.calib_cache).is_file()
        # Q/DQ models carry their INT8 scales (and run no layer FP8)
        if not self.calib and not cached and not _has_qdq(self.model_path):
            kind = "FP8" if self._wants_fp8() else "INT8"
            raise ConfigError(f"{kind} needs calibration: give --calib DATA (a .npy/.npz of input samples or a "
                              f"dataset)"
                              + (f"; --calib-cache {self.calib_cache} does not exist yet" if self.calib_cache else
                                 " or an existing --calib-cache FILE"))
        if self.calib and self.calib_data is None and not cached and not Path(self.calib).exists():
            raise ConfigError(f"--calib {self.calib}: not found")
        if self.calib_balance_by and not self.calib:
            raise ConfigError(f"--calib-balance-by {self.calib_balance_by} needs --calib DATA (an image dataset)")

    def _validate_planner(self) -> None:
        if self.cosine_samples < 1:
            raise ConfigError(f"--cosine-samples {self.cosine_samples} must be at least 1")
        targets = [flag for flag, value in (("--min-cosine", self.min_cosine), ("--min-snr", self.min_snr),
                                            ("--accuracy-budget", self.accuracy_budget)) if value is not None]
        if len(targets) > 1:
            count = "two" if len(targets) == 2 else "three"
            raise ConfigError(f"{' and '.join(targets)} are {count} planner targets: give one (the budget needs "
                              f"--data with labels or a reference; --min-cosine and --min-snr need no labels)")
        # `not 0 < x <= 1` also refuses NaN.
        if self.min_cosine is not None and not 0.0 < self.min_cosine <= 1.0:
            raise ConfigError(f"--min-cosine {self.min_cosine:g} must be in (0, 1]")
        if self.min_snr is not None and not abs(self.min_snr) < float("inf"):
            raise ConfigError(f"--min-snr {self.min_snr:g} must be a finite number of dB")
        if targets and self.precision not in PLANNED_PRECISIONS:
            raise ConfigError(f"{targets[0]} moves layers out of the build's reduced precision: it needs --precision "
                              f"int8, fp8, fp16 or bf16, not {self.precision} (FP32 is the reference it measures "
                              f"against)")
        if targets and self.precision in PLANNED_FLOAT_PRECISIONS and self.wants_calibration():
            # The float planner runs no calibration: its trial builds could not quantize those layers.
            raise ConfigError(f"{targets[0]} with --precision {self.precision} moves {self.precision.upper()} layers "
                              f"to FP32, and this build also pins layers to a quantized precision: build with "
                              f"--precision int8 (or fp8) and --int8-fallback-precision {self.precision} instead")
        if self.min_cosine is not None or self.min_snr is not None:
            flag = targets[0]
            if not self.calib and not self.data:
                # Never seeded random inputs: FP16's error depends on the activations' range, which
                # random inputs do not share with the user's (decision 0050).
                raise ConfigError(f"{flag} needs samples to measure on: --calib DATA (the samples calibration "
                                  f"does not use; every sample in an FP16/BF16 build) or --data VAL")
            if (self.precision in PLANNED_FLOAT_PRECISIONS and self.calib and self.calib_data is None
                    and not Path(self.calib).exists()):  # quantized builds check it beside their cache
                raise ConfigError(f"--calib {self.calib}: not found")
            if self.precision in PLANNED_FLOAT_PRECISIONS and self._calib_is_image_dataset() and not self.preprocess:
                # Quantized builds are told this by calibration; a float build reads --calib only here.
                raise ConfigError(f"--calib {self.calib} is an image dataset: give --preprocess to say how images "
                                  f"become the input (or a .npy/.npz of preprocessed samples)")
            if self.data and not self.preprocess:
                raise ConfigError(f"{flag} with --data needs --preprocess (how the --data images become the input)")
        elif self.decoder is not None:
            raise ConfigError(f"--decoder {self.decoder} groups the outputs --min-snr and --min-cosine compare: "
                              f"give one of them (`sartor validate --decoder` decodes for the metric)")
        if self.decoder is not None:
            from ..validate.sensitivity import check_decoder
            check_decoder(self.decoder)
        if self.accuracy_budget is not None:
            if not 0.0 <= self.accuracy_budget < float("inf"):
                raise ConfigError(f"--accuracy-budget {self.accuracy_budget:g} must be a finite value ≥ 0")
            if not self.data:
                raise ConfigError("--accuracy-budget needs --data VAL (the validation set the drop is measured on)")
            if not self.preprocess:
                raise ConfigError("--accuracy-budget needs --preprocess (how the --data images become the input)")
        if self.split_by and not self.data:
            raise ConfigError(f"--split-by {self.split_by} needs --data VAL")
        if self.data:
            if not self.wants_calibration() and not (targets and self.precision in PLANNED_FLOAT_PRECISIONS):
                raise ConfigError("--data is for INT8 builds and FP8 ones (calibration coverage, --accuracy-budget, "
                                  "--min-cosine, --min-snr) and for FP16/BF16 builds with one of those targets: "
                                  "use `sartor validate` to measure other engines")
            if not Path(self.data).exists():
                raise ConfigError(f"--data {self.data}: not found")

    def _calib_is_image_dataset(self) -> bool:
        from ..quant.data import ARRAY_SUFFIXES
        return bool(self.calib) and self.calib_data is None and Path(self.calib).suffix not in ARRAY_SUFFIXES

    def nms_settings(self):
        """The parsed --nms settings, or None."""
        if self.nms is None:
            return None
        from ..ops.nms import parse_nms
        return parse_nms(self.nms)

    def preprocess_spec(self):
        """The parsed --preprocess spec, or None; with several sizes (resolution buckets) the
        largest's: what calibration and the other single-spec readers take."""
        buckets = self.preprocess_buckets()
        return buckets.largest if buckets is not None else None

    def preprocess_buckets(self):
        """The --preprocess spec as resolution buckets (`letterbox=320|480|640` is three; one size is
        one), or None (sartor/data/buckets.py)."""
        if self.preprocess is None:
            return None
        from ..data.buckets import parse_buckets
        return parse_buckets(self.preprocess)

    def frame_format(self):
        """The parsed --input-format (a FrameFormat), or None: the model's own input."""
        if self.input_format is None:
            return None
        from ..data.frame_format import parse_frame_format
        frames = parse_frame_format(self.input_format)
        spec = self.preprocess_spec()
        if spec is None or spec.resize == "none":
            raise ConfigError(f"--input-format {frames.describe()} needs --preprocess with letterbox= or resize= "
                              f"(what the engine's first layer does to the frames)")
        buckets = self.preprocess_buckets()
        if len(buckets) > 1:
            raise ConfigError(f"--input-format {frames.describe()} takes frames of one size, which one bucket of "
                              f"--preprocess {buckets.describe()} would always take: give that one size (build one "
                              f"engine per frame size)")
        from ..data.buckets import BucketRefused
        try:
            buckets.route(*frames.size)  # a frame size the policy refuses is refused now, not at every frame
        except BucketRefused as exc:
            raise ConfigError(f"--input-format {frames.describe()}: {exc}") from None
        return frames

    def to_json(self) -> dict:
        data = asdict(replace(self, calib_data=None))  # the data from Python stays out (its label is in calib)
        data.pop("calib_data")
        return data


def _has_qdq(model_path) -> bool:
    from ..frontend.onnx import has_quantization_nodes
    return has_quantization_nodes(model_path)


def parse_precision_overrides(items: list[str] | None, flag: str) -> dict:
    table = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep or not key or not value:
            raise ConfigError(f"{flag} {item!r} must look like NAME=fp32")
        table[key.strip()] = value.strip().lower()
    return table


def check_preprocess(spec, inputs, profiles) -> None:
    """The preprocess spec must produce what the engine takes: the image input (the first 4-D input)
    has 3 channels where the layout puts them, the spec's dtype, and an H×W every profile admits."""
    if spec is None:
        return
    image = next((v for v in inputs if v.shape is not None and len(v.shape) == 4), None)
    if image is None:
        raise ConfigError(f"--preprocess {spec.describe()}: the model has no 4-D image input "
                          f"(inputs: {', '.join(v.name for v in inputs)})")
    channel_axis, hw_axes = (1, (2, 3)) if spec.layout == "nchw" else (3, (1, 2))
    if image.dtype != spec.dtype:
        raise ConfigError(f"--preprocess {spec.describe()} produces {spec.dtype} but input {image.name!r} "
                          f"takes {image.dtype}: add dtype={image.dtype}")
    for k, profile in enumerate(profiles):
        r = profile.shapes.get(image.name)
        if r is None:
            continue
        shape = f"{'x'.join(map(str, r.min))}" + ("" if r.min == r.max else f"..{'x'.join(map(str, r.max))}")
        if not r.min[channel_axis] <= 3 <= r.max[channel_axis]:
            raise ConfigError(f"--preprocess {spec.describe()} makes 3-channel {spec.layout.upper()} images but "
                              f"input {image.name!r} is {shape} in profile {k}: check nchw/nhwc")
        if spec.resize == "none":
            continue
        if not all(r.min[a] <= d <= r.max[a] for a, d in zip(hw_axes, spec.size)):
            h, w = spec.size
            ph = "x".join(str(r.min[a]) if r.min[a] == r.max[a] else f"{r.min[a]}..{r.max[a]}" for a in hw_axes)
            fixed = all(r.min[a] == r.max[a] for a in hw_axes)
            eh, ew = (r.min[a] for a in hw_axes)
            fix = (f"use {spec.resize}={eh}" + ("" if eh == ew else f"x{ew}") if fixed
                   else "use a size in that range")
            raise ConfigError(f"--preprocess {spec.describe()} makes {h}x{w} images but input {image.name!r} is "
                              f"{ph} (H x W) in profile {k} ({shape}): {fix}, or build the profile for {h}x{w}")
