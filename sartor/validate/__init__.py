"""Checks of a built engine against its ONNX model."""
from .compare import ComparisonReport, OutputComparison, compare_outputs, compare_with_onnxruntime, random_inputs

__all__ = ["ComparisonReport", "OutputComparison", "compare_outputs", "compare_with_onnxruntime", "random_inputs"]
