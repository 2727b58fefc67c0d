"""sartor: compile an ONNX vision model into an engine tailored to one device."""
from __future__ import annotations

from .errors import SartorError
from .runtime import Engine, ExecutionContext, load
from .version import __version__


def build(model: str, output: str, *, device: str | None = None, precision: str = "fp32",
          min_shapes: dict | None = None, opt_shapes: dict | None = None, max_shapes: dict | None = None,
          profiles: list | None = None, layer_precision: dict | None = None, op_precision: dict | None = None,
          overflow_guard: bool = True, preprocess: str | None = None, calib: str | None = None,
          calib_size: int = 500, calib_method: str | None = None, percentile: float = 99.99,
          calib_cache: str | None = None, builder_effort: int | None = None, timing_cache: str | None = None,
          calib_balance_by: str | None = None, data: str | None = None, split_by: str | None = None,
          accuracy_budget: float | None = None, classes: list | None = None):
    """Build an engine file, as `sartor build` does; returns the BuildResult.

    Shapes are {input name: tuple}; `profiles` is a list of {"min": ..., "opt": ..., "max": ...}
    for several profiles (then leave min/opt/max_shapes out). `preprocess` is a spec such as
    "letterbox=640,mean=0,std=255,rgb,nchw" (a PreprocessSpec is accepted too), stored in the engine.
    INT8 (`precision="int8"`) takes `calib` (a .npy/.npz of input samples or a dataset) and/or
    `calib_cache`, as `sartor build --calib/--calib-cache` do. `builder_effort` (0..5, default 2) and
    `timing_cache` (a JSON file) are `--builder-effort` and `--timing-cache`. `calib_balance_by`,
    `data`, `split_by` and `accuracy_budget` are `--calib-balance-by`, `--data`, `--split-by` and
    `--accuracy-budget` (`classes`: the class names of `data`, as `--classes`); warnings (a split of `data` that calibration missed) are in the result's
    `warnings` and build log.
    """
    from .builder import BuildConfig
    from .builder import build as run_build
    from .builder.config import DEFAULT_BUILDER_EFFORT
    if profiles is None and (min_shapes or opt_shapes or max_shapes):
        profiles = [{"min": min_shapes or {}, "opt": opt_shapes or {}, "max": max_shapes or {}}]
    config = BuildConfig(model_path=str(model), output_path=str(output), device=device, precision=precision,
                         profiles=profiles or [], layer_precision=dict(layer_precision or {}),
                         op_precision=dict(op_precision or {}), overflow_guard=overflow_guard,
                         preprocess=preprocess if preprocess is None or isinstance(preprocess, str)
                         else preprocess.describe(),
                         calib=None if calib is None else str(calib), calib_size=calib_size, calib_method=calib_method,
                         percentile=percentile, calib_cache=None if calib_cache is None else str(calib_cache),
                         builder_effort=DEFAULT_BUILDER_EFFORT if builder_effort is None else builder_effort,
                         timing_cache=None if timing_cache is None else str(timing_cache),
                         calib_balance_by=calib_balance_by, data=None if data is None else str(data), split_by=split_by,
                         accuracy_budget=accuracy_budget, classes=None if classes is None else list(classes))
    return run_build(config)


__all__ = ["Engine", "ExecutionContext", "SartorError", "__version__", "build", "load"]
