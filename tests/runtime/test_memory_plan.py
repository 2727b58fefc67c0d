"""The activation arena: planned from lifetimes, at each layer's planned precision."""
from __future__ import annotations

from conftest import MAX_SHAPES, MIN_SHAPES, OPT_SHAPES

import sartor
from sartor.runtime.memory_plan import Block, plan_offsets


def _arena(header: dict) -> int:
    return header["memory"]["profiles"][0]["arena_bytes"]


def test_fp16_layers_plan_half_the_bytes_of_fp32_layers(tiny_onnx, tmp_path):
    built = {p: sartor.build(str(tiny_onnx), str(tmp_path / f"{p}.plan"), device="cpu", precision=p,
                             min_shapes=MIN_SHAPES, opt_shapes=OPT_SHAPES, max_shapes=MAX_SHAPES, builder_effort=0)
             for p in ("fp32", "fp16")}
    fp32, fp16 = _arena(built["fp32"].header), _arena(built["fp16"].header)
    assert 0 < fp16 < fp32
    assert abs(fp16 * 2 - fp32) <= 0.1 * fp32  # alignment padding aside, half


def test_blocks_alive_together_never_overlap_and_dead_ones_share():
    blocks = [Block("a", 1000, 0, 1), Block("b", 1000, 1, 2), Block("c", 1000, 2, 3)]
    offsets, arena = plan_offsets(blocks)
    assert offsets["a"] != offsets["b"] and offsets["b"] != offsets["c"]
    assert offsets["a"] == offsets["c"]  # a is dead when c is written
    assert arena == 2 * 1024  # two live 1000-byte blocks, each aligned to 256
