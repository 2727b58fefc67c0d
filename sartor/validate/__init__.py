"""Checks of a built engine against its ONNX model."""
from .compare import (
    ComparisonReport,
    OutputComparison,
    compare_outputs,
    compare_with_onnxruntime,
    random_inputs,
)
from .decoders import Detections
from .runner import SplitResult, ValidationReport, validate

__all__ = ["ComparisonReport", "Detections", "OutputComparison", "SplitResult", "ValidationReport", "compare_outputs",
           "compare_with_onnxruntime", "random_inputs", "validate"]
