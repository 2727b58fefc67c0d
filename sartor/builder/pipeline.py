"""The builder: the one place that calls import → passes → profiles → precision → (INT8/FP8:
calibrate → planner → quantize; FP16/BF16 with an accuracy target: planner) → tactics (CUDA: and
the convolution chains) → memory plan → (CUDA: the engine-level checks, kernels) → engine file.
Each stage is a plain function; this file only sequences them and records what they did."""
from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from ..errors import ConfigError
from ..frontend import import_onnx
from ..ir import Graph, verify_graph
from ..ir.dtypes import NUMPY_TO_TORCH, QUANTIZED_PRECISIONS
from ..kernels.registry import LayerFacts, tactic_for
from ..kernels.common.pdl import pdl_available
from ..kernels.common.tile_steps import sums_decoded
from ..kernels.detection.greedy_nms import MAX_CANDIDATES
from ..ops.fp8 import is_fp8
from ..ops.fused_pool import MAX_POOL_ATTRS, max_pool_label
from ..ops.quantized import ACCUMULATOR_BOUND
from ..ops.util import tensor_from_numpy
from ..passes import optimize
from ..progress import advance_of
from ..passes.append_nms import append_nms, yolo_head_output
from ..passes.bound_accumulators import bound_accumulators
from ..passes.fuse_projected_residual import fuse_projected_residual
from ..passes.fuse_conv_chain import chain_pairs
from ..passes.frame_input import PREPROCESS_LAYER, accept_frames
from ..passes.fuse_linear_bias import fuse_linear_bias
from ..passes.fuse_add_layernorm import fuse_add_layernorm
from ..passes.fuse_layernorm_rows import fuse_layernorm_rows
from ..passes.gather_rows import gather_rows
from ..passes.fuse_stem_max_pool import fuse_stem_max_pool
from ..passes.quantize_in_preprocess import quantize_in_preprocess
from ..runtime.engine_file import check_writable, pack, sign, write_atomic
from ..runtime.executor import Executor
from ..runtime.fingerprint import device_fingerprint, parse_device
from ..runtime.graph_codec import encode_graph
from ..runtime.kernel_store import describe_record, not_embedded, pack_kernels
from ..runtime.memory_plan import lifetimes, plan_offsets
from ..runtime.profiles import Profile, make_profile
from ..tactics import (TacticSelection, TimingCache, family_seconds, record_tactics, select_tactics_by_profile,
                       summary_by_profile)
from ..version import __version__
from .buckets import bucket_profiles
from .config import PDL_PRECISIONS, BuildConfig, check_preprocess
from .aux_streams import choose_aux_streams
from .conv_chains import ChainChoice, chain_halves, check_chains, choose_conv_chains
from .pdl import check_pdl_device, check_programmatic_launch, clear_programmatic_launch, mark_programmatic_launch
from .capture_check import check_capture
from .eager_check import check_against_eager
from .kernels import CaptureUnavailable, capture_kernels
from .precision import (
    base_precision,
    overflowing_layers,
    plan_precision,
    unmatched_overrides,
)

Progress = Callable[[str], None]
# Where the eager check runs (tests add "cpu"): a CPU build's reference kernels are its eager ones.
EAGER_CHECK_DEVICES = ("cuda",)
# Layer attributes shown by `inspect` besides the activation: the epilogue order, INT8/FP8 scales,
# the FP8 format, a projection's and a carried max pool's (`ops/fused_pool.py`).
LAYER_ATTRS = ("residual_after_activation", "input_scale", "residual_scale", "output_scale", "qformat",
               "projection_strides", "projection_input_scale", *MAX_POOL_ATTRS)


@dataclass
class BuildResult:
    path: str
    header: dict
    onnx_nodes: int
    layers: int
    seconds: float
    stage_seconds: dict = field(default_factory=dict)
    # The tactics stage by tactic family: {family: {"seconds", "compile_s", "time_s", "candidates"}}.
    tactic_seconds: dict = field(default_factory=dict)
    log: list = field(default_factory=list)
    warnings: list = field(default_factory=list)  # lines also in `log`


@dataclass(frozen=True)
class Reproducible:
    """What a reproducible build (`sartor build --bundle`, `sartor rebuild`: sartor/deploy/) records
    in place of its circumstances, so that two builds of one bundle write the same bytes: the
    bundle's build time, no build duration, and each path under a prefix as its label (as a
    compiler's -ffile-prefix-map). docs/decisions/0026-reproducible-bundle-builds.md lists why."""
    built_at: str
    path_labels: dict = field(default_factory=dict)  # path or directory prefix -> what the header says


def _label_paths(value, labels: dict):
    """`value` (a header: dicts, lists, strings) with every labelled path prefix replaced, longest
    first (the caller orders `labels`)."""
    if isinstance(value, str):  # a path, or a log line naming one
        for prefix, label in labels.items():
            value = value.replace(prefix, label)
        return value
    if isinstance(value, dict):
        return {key: _label_paths(v, labels) for key, v in value.items()}
    if isinstance(value, list):
        return [_label_paths(v, labels) for v in value]
    return value


def _random_feeds(graph: Graph, shapes: dict, device: torch.device, generator: torch.Generator) -> dict:
    feeds = {}
    for info in graph.inputs:
        dtype = NUMPY_TO_TORCH[info.dtype]
        shape = shapes[info.name]
        if dtype.is_floating_point:
            feeds[info.name] = torch.rand(shape, generator=generator, dtype=torch.float32).to(dtype).to(device)
        else:
            feeds[info.name] = torch.zeros(shape, dtype=dtype, device=device)
    return feeds


def _tactic(node, device: torch.device) -> str:
    """What runs the layer, in words (the timed choice for layers with tactics: the registry's
    description of it); for a QConv carrying its max pool (`ops/fused_pool.py`), where the pool runs."""
    tactic = tactic_for(node.attrs.get("tactic"))
    words = tactic.describe(LayerFacts(node.op_type, is_fp8(node.attrs), "projection_strides" in node.attrs,
                                       device.type))
    pool = max_pool_label(node.attrs)
    if pool is None:
        return words
    if tactic.fuses_max_pool:
        return f"{words}, max pool {pool} in the epilogue (only pooled codes stored)"
    return f"{words}, then max pool {pool} ({'triton channels-last' if device.type == 'cuda' else 'torch'})"


def _tactics_by_profile(node, selections: list[TacticSelection]) -> dict:
    """A layer record's per-profile choices (engines with several profiles, layers with tactics):
    {"tactic_by_profile": [{"tactic", "timings_ms", "rejected", "source"} or None per profile]}."""
    if "tactic_by_profile" not in node.attrs:
        return {}
    return {"tactic_by_profile": [selection.layers.get(node.name) for selection in selections]}


def _tactics_record(config: BuildConfig, selections: list[TacticSelection]) -> dict:
    record = {"builder_effort": config.builder_effort, "timed": sum(s.timed for s in selections),
              "from_timing_cache": sum(s.cached for s in selections), "timing_cache": config.timing_cache}
    if config.exclude_tactics:
        record["excluded"] = list(config.exclude_tactics)
    if len(selections) > 1:
        record["by_profile"] = [{"timed": s.timed, "from_timing_cache": s.cached} for s in selections]
    return record


def _memory_plan(graph: Graph, weights: dict, profiles: list[Profile], device: torch.device,
                 generator: torch.Generator, layer_precision: dict) -> dict:
    """Arena size per profile from the lifetimes and sizes of activations at the max shapes, each
    layer at its planned precision (an FP16 layer's outputs take half an FP32 layer's bytes)."""
    executor = Executor(graph, weights, device, layer_precision)
    plans = []
    for k, profile in enumerate(profiles):
        sizes: dict[str, int] = {}

        def observe(index, step, outputs, sizes=sizes):
            if step.on_host:
                return
            for name, t in zip(step.node.outputs, outputs):
                if name and isinstance(t, torch.Tensor):
                    sizes[name] = t.numel() * t.element_size()

        with torch.inference_mode():
            executor.run(_random_feeds(graph, profile.max_shapes(), device, generator), observe=observe, profile=k)
        _, arena = plan_offsets(lifetimes(executor.steps, sizes, {v.name for v in graph.outputs}))
        naive = sum(sizes.values())
        plans.append({"arena_bytes": int(arena), "unplanned_bytes": int(naive), "shapes": "max"})
    return {"profiles": plans}


def _profile_shapes(profile: Profile) -> list[dict]:
    """min, opt and max of a profile, each once (Triton specializes on sizes, so each may differ)."""
    picks = [{name: getattr(r, pick) for name, r in profile.shapes.items()} for pick in ("min", "opt", "max")]
    return [shapes for k, shapes in enumerate(picks) if shapes not in picks[:k]]


def _embed_kernels(config: BuildConfig, header: dict, tensors: dict, device: torch.device, profiles: list[Profile],
                   graph: Graph, generator: torch.Generator, log: list) -> tuple[dict, dict]:
    """The header record and tensors of the compiled Triton kernels the engine runs (CUDA builds)."""
    if not config.embed_kernels:
        record, kernel_tensors = not_embedded("built with --no-embed-kernels"), {}
    else:
        try:
            import triton
        except ImportError:
            triton = None
        if triton is None:
            record, kernel_tensors = not_embedded("triton is not installed"), {}
        else:
            def feeds_of_profile(k: int) -> list[dict]:
                return [_random_feeds(graph, shapes, device, generator) for shapes in _profile_shapes(profiles[k])]
            try:
                entries, runs = capture_kernels(header, tensors, device, feeds_of_profile)
            except CaptureUnavailable as exc:
                record, kernel_tensors = not_embedded(str(exc)), {}
            else:
                record, kernel_tensors = pack_kernels(entries, triton.__version__)
                record["capture_runs"] = runs
    log.append(f"kernels: {describe_record(record)}")
    return record, kernel_tensors


def _append_nms(config: BuildConfig, graph: Graph, plan, log: list) -> dict:
    """`--nms`: the NMS layer after the head (after calibration and quantization, which compare the
    raw head with the FP32 model's), in float32; its header record."""
    settings = config.nms_settings()
    head = append_nms(graph, settings)
    verify_graph(graph)
    node = graph.nodes[-1]
    plan.layers[node.name] = "fp32"
    plan.reasons[node.name] = "NMS boxes and IoU in float32, as torchvision computes them"
    classes = graph.shape_of(head)[1] - 4
    log.append(f"nms: {settings.describe()} after {head} ({classes} classes): each image's {settings.topk} best "
               f"(anchor, class) candidates over conf={settings.conf:g} go through NMS (at most {MAX_CANDIDATES}); an "
               f"image with more candidates keeps only those {settings.topk}, so its detections may differ from NMS "
               f"over all of them")
    return dict(settings.to_json(), head_output=head, classes=classes, outputs=list(node.outputs))


def _choose_chains(config: BuildConfig, graph: Graph, weights: dict, selections: list, profiles: list[Profile],
                   device: torch.device, generator: torch.Generator, plan, cache: TimingCache, on_layer,
                   log: list) -> ChainChoice:
    """Fuse the convolution chains that time faster as one kernel (builder/conv_chains.py), their
    precision and reason moved to the chain's name; one log line of every chain's times. Returns
    the choice (its `fused`: the chains fused)."""
    feeds = (_random_feeds(graph, p.opt_shapes(), device, generator) for p in profiles)
    choice = choose_conv_chains(graph, weights, selections, feeds, device, plan.layers,
                                effort=config.builder_effort, cache=cache, reasons=plan.reasons,
                                time_single=config.time_every_layer, exclude=config.exclude_tactics,
                                on_layer=on_layer)
    log.append(f"chains: {len(choice.fused)} of {len(choice.timings)} convolution chain(s) run as one kernel, timed "
               f"against their two layers (builder/conv_chains.py): "
               + "; ".join(timing.describe() for timing in choice.timings))
    return choice


def build(config: BuildConfig, progress: Progress | None = None, warn: Callable[[str], None] | None = None,
          reproducible: Reproducible | None = None) -> BuildResult:
    """Build the engine file `config` describes. `progress(stage)` is called as each stage starts, and
    its `advance(done, total, detail)`, when it has one (sartor.progress.ProgressReport), inside the
    long stages (each calibration batch, each layer the tactics stage reaches);
    `warn(line)` with each warning, which also goes to the build log and BuildResult.warnings.
    `reproducible`: record its build time and path labels instead of this build's (see Reproducible)."""
    # Imported here: deploy's bundles call this builder, so deploy is imported after it.
    from ..deploy.signing import read_private_key, sign_engine
    signing_key = read_private_key(config.sign_key) if config.sign_key else None  # refused before the build
    if config.fallback_where_faster:
        from .speed_fallback import build_with_fallback_where_faster
        config.validate()
        result = build_with_fallback_where_faster(config, lambda one: build(one, progress, warn))
        if signing_key is not None:  # the kept engine's header was rewritten after its build signed it
            sign_engine(config.output_path, signing_key)
        return result
    progress = progress or (lambda stage: None)
    advance = advance_of(progress)
    warnings: list[str] = []

    def warn_and_keep(line: str) -> None:
        warnings.append(line)
        if warn is not None:
            warn(line)
    config.validate()
    check_writable(config.output_path)
    timing_cache = None
    if config.timing_cache is not None:  # read (and refused when corrupt) before the long stages
        check_writable(config.timing_cache)
        timing_cache = TimingCache(config.timing_cache)
    device = parse_device(config.device)
    if config.pdl:
        check_pdl_device(device)
    if config.conv_chains and device.type != "cuda":
        raise ConfigError(f"--conv-chains fuses convolutions into sartor's CUDA kernels; {device} is not a CUDA device")
    started = time.perf_counter()
    stage_seconds: dict[str, float] = {}
    log: list[str] = []

    def stage(name):
        progress(name)
        stage_seconds[name] = time.perf_counter()

    def done(name):
        stage_seconds[name] = round(time.perf_counter() - stage_seconds[name], 3)

    stage("import")
    imported = import_onnx(config.model_path)
    graph = imported.graph
    onnx_nodes = len(graph.nodes)
    done("import")

    stage("profiles")
    declared = {v.name: v.shape for v in graph.inputs}
    specs = config.profiles or [{"min": {}, "opt": {}, "max": {}}]
    preprocess, buckets = config.preprocess_spec(), config.preprocess_buckets()
    if buckets is not None and len(buckets) > 1:  # a profile per size (docs/decisions/0037-resolution-buckets.md)
        profiles = bucket_profiles(buckets, graph.inputs, specs, log)
    else:
        profiles = [make_profile(declared, p.get("min", {}), p.get("opt", {}), p.get("max", {})) for p in specs]
        check_preprocess(preprocess, graph.inputs, profiles)
    done("profiles")

    stage("optimize")
    report = optimize(graph)
    if not config.wants_calibration():
        # After the INT8 planner's decision is known to be "none": it quantizes bias-free MatMuls only.
        # gather_rows after fuse_add_layernorm, whose LayerNorms its chains start from; then the row
        # gathers fold into those LayerNorms.
        for float_only in (fuse_linear_bias, fuse_add_layernorm, gather_rows, fuse_layernorm_rows):
            fused = float_only(graph)
            if fused:
                report.rewrites[float_only.__name__] = fused
    verify_graph(graph)
    for name, count in report.rewrites.items():
        log.append(f"pass {name}: {count} rewrite(s)")
    log.extend(report.notes)  # Q/DQ models: pairs folded and left as fake quantization
    if config.nms is not None:
        yolo_head_output(graph)  # refused now, not after calibration; the layer is appended after quantization
    done("optimize")

    stage("precision")
    missing = unmatched_overrides(graph, config)
    if missing:
        raise ConfigError(f"precision override(s) match no layer: {', '.join(missing)}")
    generator = torch.Generator().manual_seed(config.seed)
    weights = {name: tensor_from_numpy(a) for name, a in graph.initializers.items()}
    overflow = {}
    if base_precision(config, device) == "fp16" and config.overflow_guard:
        samples = [_random_feeds(graph, profiles[0].opt_shapes(), device, generator) for _ in range(config.guard_samples)]
        overflow = overflowing_layers(graph, weights, samples, config.overflow_threshold, device)
    plan = plan_precision(graph, config, overflow, device)
    for name, reason in plan.reasons.items():
        log.append(f"layer {name} runs {plan.layers[name]}: {reason}")
    done("precision")

    calibration = planner = None
    if any(p in QUANTIZED_PRECISIONS for p in plan.layers.values()):
        from .quantization_stages import quantize_for_build, thresholds_for_build
        stage("calibrate")
        amax, calibration = thresholds_for_build(graph, weights, config, imported.sha256, device, profiles, log,
                                                 warn_and_keep, advance, plan.layers)
        done("calibrate")
        if config.planner_flag() is not None:
            stage("planner")
            from .accuracy_planner import plan_for_target
            plan, planner = plan_for_target(graph, weights, plan, amax, calibration, config, imported.sha256, device,
                                            profiles, log, run_build=build)
            done("planner")
        stage("quantize")
        # The bias correction compares each rewritten layer with its float original.
        float_graph, float_weights = (graph.copy(), weights) if config.bias_correction else (graph, weights)
        quantize_for_build(graph, plan.layers, amax, log)
        done("quantize")
        stage("bias")
        from .quantization_stages import correct_biases_for_build
        corrected = correct_biases_for_build(graph, float_graph, float_weights, config, imported.sha256, device,
                                             profiles, log)
        if calibration is not None and corrected is not None:
            calibration["bias_correction"] = corrected
        projected = fuse_projected_residual(graph)
        if projected:
            log.append(f"quantize: {projected} 1×1 layer(s) computed inside the layer that reads them as residual "
                       f"(projected residuals, passes/fuse_projected_residual.py)")
        pooled = fuse_stem_max_pool(graph)
        if pooled:
            log.append(f"quantize: {pooled} max pool(s) carried by the stem whose codes they read, pooled inside its "
                       f"kernel where that tactic wins (passes/fuse_stem_max_pool.py)")
        weights = {name: tensor_from_numpy(a) for name, a in graph.initializers.items()}
        done("bias")
    elif config.planner_flag() is not None:  # an FP16 (BF16) build: the planner keeps layers FP32, nothing calibrated
        stage("planner")
        from .accuracy_planner import plan_for_target
        plan, planner = plan_for_target(graph, weights, plan, {}, None, config, imported.sha256, device, profiles, log,
                                        run_build=build)
        done("planner")

    nms = _append_nms(config, graph, plan, log) if config.nms is not None else None
    bounded = bound_accumulators(graph)
    if bounded:
        decoded = sum(sums_decoded(node.attrs.get(ACCUMULATOR_BOUND)) for node in graph.nodes)
        log.append(f"quantize: {decoded} of {bounded} INT8 layer(s) decode their int32 sums from bits, their bound "
                   f"below 2^22 (passes/bound_accumulators.py)")
    frames = config.frame_format()
    if frames is not None:  # after calibration, which reads samples of the model's own input
        profiles = accept_frames(graph, profiles, preprocess, frames)
        plan.layers[PREPROCESS_LAYER] = "fp32"
        plan.reasons[PREPROCESS_LAYER] = f"raw frames in (--input-format {frames.describe()}): --preprocess applied"
        log.append(f"input: raw frames {frames.describe()}, {preprocess.describe()} applied by the first layer")
        if quantize_in_preprocess(graph):
            plan.reasons[PREPROCESS_LAYER] += "; writes the INT8 codes its readers take"
            log.append("quantize: the preprocessing layer writes the INT8 codes of the layers that read the image, "
                       "which no longer quantize it (passes/quantize_in_preprocess.py)")
    stage("tactics")
    selections = [TacticSelection()]
    apart = None  # with chains fused: the build as it was without them
    choice = None  # the chains timed, where some were fused
    # Chains are chosen against the layers' winners: the trial selection reads those from a cache.
    chains = config.conv_chains is not False and config.builder_effort > 0 and device.type == "cuda" \
        and bool(chain_pairs(graph, plan.layers))
    selection_cache = TimingCache() if chains and timing_cache is None else timing_cache
    if config.builder_effort > 0:
        def on_layer(i: int, n: int, name: str) -> None:  # layer i of n reached: i - 1 done
            advance(i - 1, n, f"layer {i} of {n}: {name}")

        # Each profile's winners at its own opt shapes; feeds made one profile at a time (a batch-256
        # input is large).
        feeds = (_random_feeds(graph, p.opt_shapes(), device, generator) for p in profiles)
        selections = select_tactics_by_profile(graph, weights, feeds, device, plan.layers,
                                               channels_last=device.type == "cuda", tf32=config.precision == "tf32",
                                               effort=config.builder_effort, cache=selection_cache,
                                               time_single=config.time_every_layer, exclude=config.exclude_tactics,
                                               on_layer=on_layer)
        if chains:
            # The build without chains, for the whole engines' comparison after the memory plan.
            apart = (graph.copy(), copy.deepcopy(selections), dict(plan.layers), dict(plan.reasons))
            choice = _choose_chains(config, graph, weights, selections, profiles, device, generator, plan,
                                    selection_cache, on_layer, log)
            if not choice.fused:
                apart = None
            elif config.conv_chains:  # asked for: kept without the whole engines' comparison
                apart = None
                log.append("chains check: not run, --conv-chains keeps every chain that timed faster")
    record_tactics(graph, selections)
    used = set().union(*(s.exclusions_used for s in selections))
    for pattern in config.exclude_tactics if config.builder_effort > 0 else ():
        if pattern not in used:
            line = (f"warning: --exclude-tactic {pattern!r} matched no candidate of any layer (tactic names read "
                    f"like igemm.128x128x64.w8.s3; `sartor inspect` shows each layer's)")
            log.append(line)
            warn_and_keep(line)
    if config.pdl:
        log.append(f"pdl: {mark_programmatic_launch(graph)} layer(s) launched with programmatic dependent launch "
                   f"(--pdl)")
    tactics = selections[0].layers
    log.append(summary_by_profile(selections) if config.builder_effort > 0 else
               "tactics: builder effort 0, nothing timed (every layer runs its reference kernel)")
    if timing_cache is not None and (timing_cache.new or not Path(config.timing_cache).exists()):
        timing_cache.save()
    done("tactics")

    stage("memory")
    memory = _memory_plan(graph, weights, profiles, device, generator, plan.layers)
    done("memory")

    def engine_header() -> tuple[dict, dict]:
        graph_header, tensors = encode_graph(graph)
        layers = [{"name": n.name, "op": n.op_type, "origin": n.origin, "precision": plan.layers[n.name],
                   "reason": plan.reasons.get(n.name, ""), "tactic": _tactic(n, device),
                   "tactic_timings_ms": tactics.get(n.name, {}).get("timings_ms", {}),
                   "tactic_rejected": tactics.get(n.name, {}).get("rejected", {}),
                   "tactic_source": tactics.get(n.name, {}).get("source"),
                   **_tactics_by_profile(n, selections),
                   "attrs": {k: v for k, v in n.attrs.items() if k.startswith("activation") or k in LAYER_ATTRS}}
                  for n in graph.nodes]
        seconds = round(time.perf_counter() - started, 3)
        timing = ({"built_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "build_seconds": seconds,
                   "tactic_seconds": family_seconds(selections)}
                  if reproducible is None else {"built_at": reproducible.built_at})
        header = {
            "format": "sartor-engine",
            "fingerprint": device_fingerprint(device),
            "device": str(device),
            "channels_last": device.type == "cuda",
            "profiles": [p.to_json() for p in profiles],
            "graph": graph_header,
            "layers": layers,
            "memory": memory,
            "tactics": _tactics_record(config, selections),
            "build_config": {**{k: v for k, v in config.to_json().items() if k != "sign_key"},
                             "model_path": str(config.model_path), "output_path": str(config.output_path)},
            # What the layers outside INT8 (FP8) ran at, also when the device chose it (build_config holds None then).
            "int8_fallback_precision": base_precision(config, device) if config.precision in QUANTIZED_PRECISIONS
            else None,
            "build_log": log,
            "preprocess": preprocess.to_json() if preprocess is not None else None,  # the largest bucket's
            **({"preprocess_buckets": [b.to_json() for b in buckets.specs]} if buckets is not None and len(buckets) > 1
               else {}),
            "input_format": frames.to_json() if frames is not None else None,
            "nms": nms,
            "planner": planner,
            "provenance": {"onnx_sha256": imported.sha256, "onnx_opset": imported.source_opset,
                           "onnx_producer": imported.producer, "onnx_nodes": onnx_nodes,
                           **timing, "sartor": __version__, "calibration": calibration},
        }
        if reproducible is not None:
            header = _label_paths(header, reproducible.path_labels)
        return header, tensors

    def opt_feeds(k: int) -> dict:  # random inputs at profile k's opt shapes, for the end-to-end checks below
        return _random_feeds(graph, profiles[k].opt_shapes(), device, generator)

    # The default: the engine timed with PDL and without, PDL kept where it wins (the PDL check below).
    pdl_timed = config.pdl is None and config.builder_effort > 0 and config.precision in PDL_PRECISIONS \
        and pdl_available(device)
    chains_check = None
    if apart is not None:
        stage("chains check")  # before the PDL check and the kernels: both follow the graph kept
        states = {True: (graph, selections, dict(plan.layers), dict(plan.reasons), memory)}

        def state_with(kept) -> tuple:
            """The build with no chain fused (False) or only those named (a tuple), settled as the tactics
            stage settles the graph it keeps; made once each."""
            if kept not in states:
                if kept is False:
                    g, sel, layers, reasons = apart
                else:  # a copy of the build without chains, then the chains named fused into it
                    g, sel, layers, reasons = apart[0].copy(), copy.deepcopy(apart[1]), dict(apart[2]), dict(apart[3])
                    choice.fuse_only(g, sel, layers, reasons, kept)
                record_tactics(g, sel)
                states[kept] = (g, sel, layers, reasons, _memory_plan(g, weights, profiles, device, generator, layers))
            return states[kept]

        def use_chains(kept) -> None:
            nonlocal graph, selections, tactics, memory
            graph, selections, layers, reasons, memory = state_with(kept)
            if config.pdl or pdl_timed:  # where PDL will be timed, both engines are timed with it
                mark_programmatic_launch(graph)
            tactics = selections[0].layers
            plan.layers.clear()
            plan.layers.update(layers)
            plan.reasons.clear()
            plan.reasons.update(reasons)

        if pdl_timed:
            mark_programmatic_launch(graph)
        chains_check = check_chains(engine_header, use_chains, device, opt_feeds, log, warn_and_keep,
                                    chain_halves(choice.fused))
        if pdl_timed:
            clear_programmatic_launch(graph)  # the PDL check decides
            chains_check["pdl"] = True
        done("chains check")

    eager = None
    if config.eager_check and config.builder_effort > 0 and device.type in EAGER_CHECK_DEVICES \
            and not any(p in QUANTIZED_PRECISIONS for p in plan.layers.values()):
        stage("eager check")
        eager = check_against_eager(graph, selections, engine_header, device, opt_feeds, log, warn_and_keep)
        done("eager check")

    pdl_check = None
    if pdl_timed:
        stage("pdl check")  # before the kernels are embedded: PDL's are other compiled kernels
        pdl_check = check_programmatic_launch(graph, engine_header, device, opt_feeds, log, warn_and_keep)
        done("pdl check")

    aux = None
    if config.max_aux_streams > 0 and config.builder_effort > 0 and device.type == "cuda":
        stage("aux streams")  # after the PDL marks: the engine timed is the one written
        aux = choose_aux_streams(engine_header, device, opt_feeds, log, config.max_aux_streams, warn_and_keep)
        done("aux streams")

    kernels = None
    if device.type == "cuda":
        stage("kernels")
        kernels = _embed_kernels(config, *engine_header(), device, profiles, graph, generator, log)
        done("kernels")
        stage("capture")
        capture = check_capture(*engine_header(), device, opt_feeds, log, warn_and_keep)
        done("capture")

    stage("serialize")
    header, tensors = engine_header()
    if eager is not None:
        header["eager_check"] = eager
    if pdl_check is not None:
        header["pdl_check"] = pdl_check
    if chains_check is not None:
        header["chains_check"] = chains_check
    if aux is not None:
        header["aux_streams"] = aux
    if kernels is not None:
        header["capture"] = capture
        header["kernels"], kernel_tensors = kernels
        tensors = {**tensors, **kernel_tensors}
    data = pack(header, tensors)
    write_atomic(config.output_path, data if signing_key is None else sign(data, signing_key))
    done("serialize")
    return BuildResult(str(config.output_path), header, onnx_nodes, len(graph.nodes),
                       round(time.perf_counter() - started, 3), stage_seconds, family_seconds(selections), log,
                       warnings)
