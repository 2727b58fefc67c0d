"""Where sartor's Triton kernels run: on CUDA tensors, and on CPU tensors under Triton's interpreter."""
from __future__ import annotations

import os

import torch


def kernel_runs_on(tensor: torch.Tensor) -> bool:
    """Where a layer that chose a Triton kernel runs it: CUDA tensors, and any under Triton's
    interpreter (the op tests on the CPU), never meta tensors (shape runs). Tactic lists offer the
    kernels on CUDA alone."""
    return tensor.is_cuda or (tensor.device.type == "cpu" and os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"))
