"""Named pass sequences. The builder runs `OPTIMIZE`; tests run each pass alone as well."""
from __future__ import annotations

from ..ir import Graph
from .base import Pass, PipelineReport, run_passes
from .cleanup_reshapes import cleanup_reshapes
from .conv_as_fused_conv import conv_as_fused_conv
from .drop_redundant_qdq import drop_redundant_qdq
from .eliminate_dead_nodes import eliminate_dead_nodes
from .fold_batchnorm import fold_batchnorm
from .fold_constants import fold_constants
from .fold_matmul_batchnorm import fold_matmul_batchnorm
from .fold_qdq import fold_qdq, qdq_census, qdq_notes
from .fuse_activation_patterns import fuse_activation_patterns
from .fuse_attention import fuse_attention
from .fuse_window_attention import fuse_window_attention
from .fold_attention_transpose import fold_attention_transpose
from .fuse_conv_activation import fuse_conv_activation
from .fuse_residual_add import fuse_residual_add
from .fuse_yolo_head import fuse_yolo_head
from .remove_identities import remove_identities

SIMPLIFY: list[Pass] = [fold_constants, remove_identities, cleanup_reshapes, eliminate_dead_nodes]
FUSE: list[Pass] = [fold_batchnorm, fold_matmul_batchnorm, drop_redundant_qdq, fuse_activation_patterns,
                    fuse_window_attention, fuse_attention, fold_attention_transpose, fuse_conv_activation,
                    fuse_residual_add, fuse_conv_activation, fuse_yolo_head]
# Q/DQ models: after fusion, so that the folded INT8 layers keep their activation and residual.
QUANTIZED: list[Pass] = [fold_qdq]
# Last: every pass that looks for a plain Conv has run.
PROMOTE: list[Pass] = [conv_as_fused_conv]
OPTIMIZE: list[Pass] = SIMPLIFY + FUSE + QUANTIZED + PROMOTE + [eliminate_dead_nodes]


def optimize(graph: Graph, verify: bool = False) -> PipelineReport:
    """Run `OPTIMIZE`; for Q/DQ models the report's notes say what became of the Q/DQ nodes."""
    before = qdq_census(graph)
    report = run_passes(graph, OPTIMIZE, verify=verify)
    report.notes.extend(qdq_notes(graph, before))
    return report
