"""Element types and precisions shared by every layer of sartor: the dtype tables, the precision
names and the numeric limits of the quantized formats. One copy here, imported by all."""
from __future__ import annotations

import torch

# ONNX TensorProto element types that sartor computes, mapped to torch and numpy.
ONNX_TO_TORCH = {
    1: torch.float32, 2: torch.uint8, 3: torch.int8, 5: torch.int16, 6: torch.int32,
    7: torch.int64, 9: torch.bool, 10: torch.float16, 11: torch.float64, 16: torch.bfloat16,
}
NUMPY_TO_TORCH = {
    "float32": torch.float32, "float16": torch.float16, "float64": torch.float64,
    "bfloat16": torch.bfloat16, "uint8": torch.uint8, "int8": torch.int8, "int16": torch.int16,
    "int32": torch.int32, "int64": torch.int64, "bool": torch.bool,
}
TORCH_TO_NUMPY = {v: k for k, v in NUMPY_TO_TORCH.items()}
ONNX_TO_NUMPY = {code: TORCH_TO_NUMPY[dtype] for code, dtype in ONNX_TO_TORCH.items()}
SUPPORTED_DTYPES = frozenset(NUMPY_TO_TORCH)
FLOAT_DTYPES = frozenset({"float32", "float16", "float64", "bfloat16"})

# Layer precisions a build can ask for.
PRECISIONS = ("fp32", "tf32", "fp16", "bf16", "int8", "fp8")
# The float dtype each float precision computes in (the quantized ones keep each constant's own).
PRECISION_DTYPES = {"fp32": torch.float32, "tf32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
# Precisions whose layers are calibrated and quantized (sartor/quant): INT8 and FP8 E4M3.
QUANTIZED_PRECISIONS = ("int8", "fp8")
# The op types of layers rewritten to run on quantized codes.
QUANTIZED_LAYERS = ("QConv", "QGemm")

FP16_MAX = 65504.0  # the largest finite float16
INT8_QMAX = 127  # symmetric INT8: codes -127..127
INT32_MAX = 2 ** 31 - 1  # the accumulator's (and a quantized bias's) limit
