"""Programmatic dependent launch (PDL; Hopper and newer): a kernel launched with it may start while
the kernel before it in the stream still runs, so its programs are resident and waiting when that
kernel ends, instead of being launched then. At batch 1 an engine is a chain of short kernels,
and the gap between two of them is a large share of each (ResNet-50 INT8: about 55 kernels;
docs/decisions/kernel-programmatic-launch.md).

A kernel that takes part calls `await_previous_kernel(PDL)` before any access to memory that a
kernel writes (activations, outputs, residuals, workspaces, counters): it waits there until the
previous kernel has finished and its writes are visible, then lets the next kernel launch.
Waiting before every such load and store keeps the usual stream order for everything the kernel
reads and writes (also buffers the memory plan reuses), and since every such kernel waits before
it can finish, a later kernel that reads an output from further back still sees it. What comes
before the wait runs while the previous kernel ends: index arithmetic, and loads of the engine's
constants (weights, biases, scales), which no kernel writes (the resident GEMM and window tiles
load their weight tile there). Only kernels that make this call may be launched with
`launch_options(True)`.
"""
from __future__ import annotations

import torch

from ..pointwise.epilogue import triton
from .cache_keys import settle_cache_keys

gdc_wait = gdc_launch_dependents = None
if triton is not None:
    import triton.language as tl
    try:
        from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
    except ImportError:  # a Triton without grid dependency control: no PDL
        pass

    @triton.jit
    def await_previous_kernel(PDL: tl.constexpr):
        if PDL:
            gdc_wait()
            gdc_launch_dependents()

MIN_CAPABILITY = (9, 0)


def pdl_available(device: torch.device | str) -> bool:
    """Whether kernels on `device` can be launched with PDL: CUDA of compute capability 9.0 or newer,
    and a Triton with grid dependency control."""
    device = torch.device(device)
    return (gdc_wait is not None and device.type == "cuda" and torch.cuda.is_available()
            and torch.cuda.get_device_capability(device) >= MIN_CAPABILITY)


def launch_options(pdl: bool) -> dict:
    """The launch keyword arguments of a kernel that calls `await_previous_kernel(PDL=pdl)`."""
    return {"launch_pdl": True} if pdl else {}


settle_cache_keys(globals())  # last, once every Triton function above exists (common/cache_keys.py)
