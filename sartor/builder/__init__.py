"""The builder: ONNX model -> engine file (`pipeline.build`), the one place that runs frontend, passes,
calibration and tactics. It needs the build extra (onnx, onnxruntime); the runtime never imports it."""
from ..extras import require_extra

require_extra("build", "building an engine")

from .config import BuildConfig
from .pipeline import BuildResult, build

__all__ = ["BuildConfig", "BuildResult", "build"]
