"""Builds of models quantized with Q/DQ nodes (explicit quantization, as TensorRT calls it).

The model says which layers run INT8 and with which scales; `sartor/passes/fold_qdq.py` turns
them into QConv/QGemm layers during the passes. So in such a build:
- the folded layers run INT8 whatever --precision says, and nothing is calibrated (--calib is not
  needed; the builder skips calibration);
- no other layer runs INT8: the model left it in float (`--layer-precision X=int8` is not applied);
- the ONNX quantization ops left in the graph (fake quantization around float layers) compute in
  FP32 even in FP16 builds, since a 16-bit scale would change their codes;
- --precision int8 refuses a model whose quantized layers have asymmetric activation zero points
  (sartor's INT8 kernels are symmetric) rather than silently leaving them in float.
"""
from __future__ import annotations

from ..errors import ConfigError
from ..ir import Graph, Node
from ..ir.dtypes import QUANTIZED_LAYERS
from ..passes.fold_qdq import ONNX_QUANT_OPS, is_qdq_model, why_not_folded
from ..passes.qdq_params import QDQ_QMIN

__all__ = ["explicit_int8_unsupported", "fixed_precision", "is_qdq_model", "refuse_asymmetric"]

SYMMETRIC_HINT = ("quantize with symmetric activations (ONNX Runtime: quantize_static(..., extra_options="
                  "{'ActivationSymmetric': True})), or build without --precision int8 to run the Q/DQ nodes as "
                  "given (fake quantization in float)")


def fixed_precision(node: Node, base: str) -> tuple[str, str] | None:
    """(precision, reason) for the layers whose precision a Q/DQ model fixes; None for the rest."""
    if node.op_type in QUANTIZED_LAYERS and node.attrs.get("qmin") == QDQ_QMIN:
        return "int8", "quantized by the model (Q/DQ): INT8 with its scales"
    if node.op_type in ONNX_QUANT_OPS and base in ("fp16", "bf16"):
        return "fp32", "ONNX quantization op: its scales and rounding stay FP32"
    return None


def explicit_int8_unsupported(graph: Graph, node: Node) -> str | None:
    """Why a conv/gemm layer of a Q/DQ model does not run INT8 (None for other models)."""
    if not is_qdq_model(graph):
        return None
    why = why_not_folded(graph, node)
    if why is not None:
        return f"its Q/DQ nodes do not fold: {why}"
    return ("the model is quantized with Q/DQ nodes and leaves this layer in float (layers run INT8 where the "
            "model's Q/DQ put them)")


def refuse_asymmetric(graph: Graph) -> None:
    """--precision int8: a Q/DQ layer with an asymmetric activation zero point is refused, in one line."""
    producers = graph.producers()
    refused = [(node, why) for node in graph.nodes
               if (why := why_not_folded(graph, node, producers)) is not None and why.asymmetric]
    if refused:
        node, why = refused[0]
        more = f" (and {len(refused) - 1} more layer(s) alike)" if len(refused) > 1 else ""
        raise ConfigError(f"--precision int8: layer {node.name} ({node.op_type}): {why}{more}: {SYMMETRIC_HINT}")
