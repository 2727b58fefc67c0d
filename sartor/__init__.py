"""sartor: compile an ONNX vision model into an engine tailored to one device."""
from __future__ import annotations

import os

from .errors import MissingExtraError, SartorError
from .runtime import Engine, ExecutionContext, load
from .runtime.hardware_queues import request_connections
from .version import __version__

request_connections()  # before this process starts CUDA, or never (hardware_queues.py)


def build(model: str, output: str, *, device: str | None = None, precision: str | None = None,
          min_shapes: dict | None = None, opt_shapes: dict | None = None, max_shapes: dict | None = None,
          profiles: list | None = None, layer_precision: dict | None = None, op_precision: dict | None = None,
          overflow_guard: bool | None = None, preprocess=None, calib=None,
          calib_size: int | None = None, calib_method: str | None = None, percentile: float | None = None,
          calib_cache: str | None = None, builder_effort: int | None = None, timing_cache: str | None = None,
          calib_balance_by: str | None = None, data: str | None = None, split_by: str | None = None,
          accuracy_budget: float | None = None, classes: list | None = None,
          int8_fallback_precision: str | None = None, min_cosine: float | None = None,
          cosine_samples: int | None = None, embed_kernels: bool | None = None, min_snr: float | None = None,
          decoder: str | None = None, bias_correction: bool | None = None,
          fallback_where_faster: bool | None = None, pdl: bool | None = None, conv_chains: bool | None = None,
          exclude_tactics: list | None = None, bundle: str | None = None, sign_key: str | None = None,
          nms: str | None = None, eager_check: bool | None = None, max_aux_streams: int | None = None):
    """Build an engine file, as `sartor build` does; returns the BuildResult.

    Options left at None take BuildConfig's defaults (the one place they are written). Each option
    is the `sartor build` flag of the same name unless noted:
    - Shapes are {input name: tuple}; `profiles` is a list of {"min": ..., "opt": ..., "max": ...}
      for several profiles (then leave min/opt/max_shapes out).
    - `preprocess`: a spec such as "letterbox=640,mean=0,std=255,rgb,nchw" (or a PreprocessSpec),
      stored in the engine; "letterbox=320|480|640,..." (or a `sartor.data.buckets.Buckets`) builds
      one profile per size, the resolution buckets `sartor.Pipeline` routes frames to.
    - INT8 (`precision="int8"`) takes `calib` and/or `calib_cache`. `calib` is a path (a .npy/.npz
      of input samples, an image folder, a COCO/ImageFolder dataset or a manifest) or the samples
      themselves: a numpy array or torch tensor [N, ...] like the input, a dict of them by input
      name, or a list/iterable of arrays, PIL images or image paths (images read with
      `preprocess`); see `sartor/quant/python_data.py`. `calib_method` defaults to "auto". `builder_effort` (0..5) and `timing_cache` (a JSON file) are
      `--builder-effort` and `--timing-cache`.
    - `calib_balance_by`, `data`, `split_by`, `accuracy_budget`; `classes` is `--classes` (the
      class names of `data`). Warnings (a split of `data` that calibration missed) are in the
      result's `warnings` and build log.
    - `int8_fallback_precision` ("fp32", "fp16" or "bf16"): what an INT8 build's other layers run
      at (by default FP16 on CUDA, FP32 on the CPU).
    - `min_cosine` and `cosine_samples`: the planner's label-free target (the engine's outputs
      against FP32 on held-out samples), instead of `accuracy_budget`. `min_snr`: the other
      label-free target (the worst output's SNR in dB against FP32 on the same samples).
      `decoder`: compare a detector's boxes and scores apart for those targets. All three targets
      also plan `precision="fp16"` and `"bf16"` builds (layers kept FP32; `calib` or `data` then
      gives the samples, all of them, as nothing is calibrated).
    - `embed_kernels=False` is `--no-embed-kernels`: a CUDA engine then does not carry its compiled
      Triton kernels (a smaller file; the first run on a fresh machine compiles them).
    - `bias_correction=True`: each INT8/FP8 layer's per-channel mean output error against FP32,
      measured on `calib`, is subtracted from its bias.
    - `fallback_where_faster=True`: INT8 (FP8) layers whose best kernel is faster at the fallback
      precision run there, if the whole engine gets faster.
    - `pdl=True` (INT8/FP8/FP16/BF16 on compute capability 9.0+): sartor's own kernels (the
      quantized layers', the float convolutions' implicit GEMM and depthwise kernel, max pools and
      nearest upsamples) are launched with programmatic
      dependent launch; `pdl=False`: never; left out, where the engine measures faster with it at
      the build (timed end to end, recorded in the header's `pdl_check`).
    - `conv_chains=True` (CUDA, builder effort 1+): every two convolutions in a row that time faster as
      one kernel run as one; `conv_chains=False`: never; left out, those chains are kept where the
      whole engine also measures faster with them (recorded in the header's `chains_check`).
    - `max_aux_streams` (CUDA): the engine is timed with 0 to this many auxiliary streams for its
      independent branches and its contexts run the fastest count (`Engine.aux_streams`).
    - `exclude_tactics` is `--exclude-tactic`, as a list of globs over tactic names the builder
      never runs.
    - `bundle` is `--bundle DIR`: a provenance bundle written beside the engine (the result is then
      a `deploy.BundleResult`, the engine's BuildResult in its `build`).
    - `sign_key` is `--sign-key`: an Ed25519 private key file (`sartor keygen`) the engine is
      signed with, for devices that load with a trust store (`sartor.load(trust=...)`).
    - `nms` is `--nms` ("conf=0.25,iou=0.45,max_det=300,topk=1000"): the YOLO head's decode and
      class-aware NMS inside the engine, whose outputs become num_detections, detection_boxes,
      detection_scores and detection_classes.
    """
    try:
        from .builder import BuildConfig
        from .builder import build as run_build
    except MissingExtraError as exc:  # a runtime install: one line naming the build extra
        raise exc.for_feature("sartor.build") from None
    if profiles is None and (min_shapes or opt_shapes or max_shapes):
        profiles = [{"min": min_shapes or {}, "opt": opt_shapes or {}, "max": max_shapes or {}}]
    if preprocess is not None and not isinstance(preprocess, str):
        preprocess = preprocess.describe()
    def as_text(value):
        return None if value is None else str(value)
    calib_data = None
    if calib is not None and not isinstance(calib, (str, os.PathLike)):
        from .quant.python_data import PythonSamples
        calib_data = PythonSamples(calib)
        calib = calib_data.label
    options = {
        "device": device, "precision": precision, "profiles": profiles,
        "layer_precision": None if layer_precision is None else dict(layer_precision),
        "op_precision": None if op_precision is None else dict(op_precision),
        "overflow_guard": overflow_guard, "preprocess": preprocess, "calib": as_text(calib),
        "nms": nms,
        "calib_size": calib_size, "calib_method": calib_method, "percentile": percentile,
        "calib_cache": as_text(calib_cache), "builder_effort": builder_effort,
        "timing_cache": as_text(timing_cache), "calib_balance_by": calib_balance_by, "data": as_text(data),
        "split_by": split_by, "accuracy_budget": accuracy_budget,
        "classes": None if classes is None else list(classes),
        "int8_fallback_precision": int8_fallback_precision, "min_cosine": min_cosine,
        "cosine_samples": cosine_samples, "embed_kernels": embed_kernels, "min_snr": min_snr, "decoder": decoder,
        "bias_correction": bias_correction, "fallback_where_faster": fallback_where_faster, "pdl": pdl,
        "conv_chains": conv_chains,
        "exclude_tactics": None if exclude_tactics is None else list(exclude_tactics),
        "sign_key": as_text(sign_key), "eager_check": eager_check, "max_aux_streams": max_aux_streams,
    }
    config = BuildConfig(model_path=str(model), output_path=str(output), calib_data=calib_data,
                         **{key: value for key, value in options.items() if value is not None})
    if bundle is not None:
        from .deploy import build_bundle
        return build_bundle(config, bundle)
    return run_build(config)


def __getattr__(name: str):
    # The pipeline imports torchvision's decoders: loaded on first use, not by `import sartor`.
    if name == "Pipeline":
        from .pipeline import Pipeline
        return Pipeline
    raise AttributeError(f"module 'sartor' has no attribute {name!r}")


__all__ = ["Engine", "ExecutionContext", "Pipeline", "SartorError", "__version__", "build", "load"]
