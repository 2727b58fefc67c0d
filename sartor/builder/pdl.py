"""--pdl: the INT8 (FP8) layers whose kernel takes part in programmatic dependent launch
(`kernels/common/pdl.py`) are marked to be launched with it (for the resident-window tiles, their GEMM
after the pixel packing). The layers that run another tactic (the emulation, cuBLAS, im2col, the
pixel windows' implicit-GEMM tiles: kernels that do not wait for their predecessor as PDL
requires) keep the ordinary launch."""
from __future__ import annotations

import torch

from ..errors import ConfigError
from ..ir import Graph
from ..ir.dtypes import QUANTIZED_LAYERS
from ..kernels.common.pdl import MIN_CAPABILITY, pdl_available
from ..ops.quantized import own_kernel_tactic



def check_pdl_device(device: torch.device) -> None:
    """--pdl on a device without it is refused, before the build's long stages."""
    if not pdl_available(device):
        major, minor = MIN_CAPABILITY
        raise ConfigError(f"--pdl (programmatic dependent launch) needs a CUDA device of compute capability "
                          f"{major}.{minor} or newer and a Triton with grid dependency control; {device} has not")


def mark_programmatic_launch(graph: Graph) -> int:
    """Mark (attrs["pdl"]) the quantized layers whose chosen kernel takes part at some profile (at a
    profile that runs another tactic the op launches as usual: it applies the mark to these kernels
    only); returns how many."""
    marked = 0
    for node in graph.nodes:
        if node.op_type not in QUANTIZED_LAYERS:
            continue
        tactics = node.attrs.get("tactic_by_profile") or [node.attrs.get("tactic")]
        if any(own_kernel_tactic(tactic) for tactic in tactics):
            node.attrs["pdl"] = True
            marked += 1
    return marked
