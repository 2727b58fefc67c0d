"""Plan one activation arena from tensor lifetimes: each intermediate gets an offset such that
tensors alive at the same time never overlap (greedy, largest first, TensorRT-style)."""
from __future__ import annotations

from dataclasses import dataclass

ALIGNMENT = 256


@dataclass(frozen=True)
class Block:
    name: str
    size: int
    first: int  # step that writes it
    last: int  # last step that reads it


def _align(n: int) -> int:
    return (n + ALIGNMENT - 1) // ALIGNMENT * ALIGNMENT


def plan_offsets(blocks: list[Block]) -> tuple[dict[str, int], int]:
    """Offsets per block and the arena size."""
    placed: list[tuple[int, int, Block]] = []  # (offset, size, block)
    offsets: dict[str, int] = {}
    for block in sorted(blocks, key=lambda b: (-b.size, b.first)):
        size = _align(block.size)
        live = sorted((o, s) for o, s, other in placed if not (other.last < block.first or block.last < other.first))
        offset = 0
        for o, s in live:
            if offset + size <= o:
                break
            offset = max(offset, o + s)
        placed.append((offset, size, block))
        offsets[block.name] = offset
    arena = max((o + s for o, s, _ in placed), default=0)
    return offsets, arena


def lifetimes(steps, sizes: dict[str, int], graph_outputs: set[str]) -> list[Block]:
    """Blocks for every device intermediate, given the executor's steps and observed byte sizes."""
    first: dict[str, int] = {}
    last: dict[str, int] = {}
    for index, step in enumerate(steps):
        for name in step.node.outputs:
            if name in sizes:
                first.setdefault(name, index)
                last.setdefault(name, index)
        for name in step.node.present_inputs():
            if name in first:
                last[name] = index
    end = len(steps)
    return [Block(name, sizes[name], first[name], end if name in graph_outputs else last[name]) for name in first]


def memory_by_profile(header: dict, weight_bytes: int, extra_weight_bytes: int = 0) -> list[dict]:
    """Device bytes an engine needs at each profile's max shapes, from its header: the weights every
    context shares (`extra_weight_bytes`: the copies some profiles' tactics read in another layout,
    known once the engine is loaded), and what each context adds: the activation arena, the input
    buffers and the tactics' workspace (0 where the build recorded none)."""
    dtypes = {v["name"]: v.get("dtype", "float32") for v in header.get("graph", {}).get("inputs", [])}
    plans = header.get("memory", {}).get("profiles", [])
    rows = []
    for k, profile in enumerate(header.get("profiles", [])):
        plan = plans[k] if k < len(plans) else {}
        inputs = 0
        for name, ranges in profile.items():
            count = 1
            for d in ranges["max"]:
                count *= int(d)
            inputs += count * _itemsize(dtypes.get(name, "float32"))
        arena, workspace = int(plan.get("arena_bytes", 0)), int(plan.get("workspace_bytes", 0))
        weights = int(weight_bytes) + int(extra_weight_bytes)
        rows.append({"profile": k, "weight_bytes": weights, "arena_bytes": arena, "input_bytes": inputs,
                     "workspace_bytes": workspace, "context_bytes": arena + inputs + workspace,
                     "total_bytes": weights + arena + inputs + workspace})
    return rows


def _itemsize(dtype: str) -> int:
    import numpy as np
    try:
        return np.dtype(dtype).itemsize
    except TypeError:
        return 2 if "16" in dtype else 1 if "8" in dtype else 4  # bfloat16, float8 names numpy lacks
