"""A QConv carrying the max pool that alone read its codes (`passes/fuse_stem_max_pool.py`): the
attributes that say so, and whether the pooled resident-window tiles (`kernels/window/resident.py`,
"max-pool") compute that pool inside the layer's kernel, storing only the pooled codes. Every other
tactic of such a layer runs the layer, then the pool (`ops/quantized.py`, qconv)."""
from __future__ import annotations

from ..kernels.window.resident import FUSED_POOL_KERNEL, FUSED_POOL_PADS, FUSED_POOL_STRIDES

# QConv attribute -> the MaxPool attribute it holds.
MAX_POOL_ATTRS = {"max_pool_kernel_shape": "kernel_shape", "max_pool_strides": "strides", "max_pool_pads": "pads"}


def fused_max_pool(attrs: dict) -> dict | None:
    """The MaxPool attributes (kernel_shape, strides, pads) of a layer carrying its pool, else None."""
    if attrs.get("max_pool_kernel_shape") is None:
        return None
    return {pool_name: [int(v) for v in attrs[name]] for name, pool_name in MAX_POOL_ATTRS.items()}


def without_max_pool(attrs: dict) -> dict:
    """The layer's own attributes, the pool's left out."""
    return {name: value for name, value in attrs.items() if name not in MAX_POOL_ATTRS}


def pool_in_kernel(pool: dict | None) -> bool:
    """Whether the pooled window tiles compute this max pool (3 × 3 at stride 2, padding 1)."""
    return (pool is not None and tuple(pool["kernel_shape"]) == FUSED_POOL_KERNEL
            and tuple(pool["strides"]) == FUSED_POOL_STRIDES and tuple(pool["pads"]) == FUSED_POOL_PADS)


def max_pool_label(attrs: dict) -> str | None:
    """The pool in a layer's timing signature and description, e.g. "3x3/2,2/1,1,1,1"; None without one."""
    pool = fused_max_pool(attrs)
    if pool is None:
        return None
    return "/".join(sep.join(map(str, pool[key])) for key, sep in
                    (("kernel_shape", "x"), ("strides", ","), ("pads", ",")))
