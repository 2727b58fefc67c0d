"""Seeded random inputs that fit an engine: for compare, run and bench when the user gives none."""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from ..errors import InputError

if TYPE_CHECKING:
    from .engine import Engine


def random_inputs(engine: "Engine", batch: int | None = None, seed: int = 0, shapes: dict | None = None) -> dict:
    """Seeded random inputs at the engine's profile-0 opt shapes (`shapes` overrides per input,
    `batch` overrides dim 0): uniform [0, 1) for floats, zeros for integers and booleans."""
    rng = np.random.default_rng(seed)
    opt = engine.profiles[0].opt_shapes()
    declared = {v.name: v for v in engine.inputs}
    feeds = {}
    for name, info in declared.items():
        shape = tuple((shapes or {}).get(name) or opt.get(name) or info.shape or ())
        if not all(isinstance(d, int) for d in shape):
            raise InputError(f"input {name!r} has no concrete shape: give it with --input")
        if batch is not None and len(shape) >= 1:
            shape = (int(batch),) + tuple(shape[1:])
        if info.dtype in ("float32", "float16", "float64"):
            feeds[name] = rng.random(shape, dtype=np.float64).astype(info.dtype)
        elif info.dtype == "bfloat16":
            raise InputError(f"input {name!r} is bfloat16, which numpy cannot hold: give it as a torch tensor")
        else:
            feeds[name] = np.zeros(shape, dtype=info.dtype)
    return feeds
