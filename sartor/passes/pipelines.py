"""Named pass sequences. The builder runs `OPTIMIZE`; tests run each pass alone as well."""
from __future__ import annotations

from ..ir import Graph
from .base import Pass, PipelineReport, run_passes
from .cleanup_reshapes import cleanup_reshapes
from .eliminate_dead_nodes import eliminate_dead_nodes
from .fold_batchnorm import fold_batchnorm
from .fold_constants import fold_constants
from .fuse_activation_patterns import fuse_activation_patterns
from .fuse_conv_activation import fuse_conv_activation
from .fuse_residual_add import fuse_residual_add
from .remove_identities import remove_identities

SIMPLIFY: list[Pass] = [fold_constants, remove_identities, cleanup_reshapes, eliminate_dead_nodes]
FUSE: list[Pass] = [fold_batchnorm, fuse_activation_patterns, fuse_conv_activation, fuse_residual_add,
                    fuse_conv_activation]
OPTIMIZE: list[Pass] = SIMPLIFY + FUSE + [eliminate_dead_nodes]


def optimize(graph: Graph, verify: bool = False) -> PipelineReport:
    return run_passes(graph, OPTIMIZE, verify=verify)
