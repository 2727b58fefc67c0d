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
