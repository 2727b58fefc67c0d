"""The op families sartor ships, in one list: adding a family means adding it here."""
from __future__ import annotations

from functools import lru_cache

from .registry import OpRegistry, OpTable


def all_tables() -> list[OpTable]:
    from . import (
        attention,
        conv,
        conv_chain,
        detection,
        detection_head,
        elementwise,
        linalg,
        nms,
        norm,
        pool,
        preprocess,
        qdq,
        quantized,
        reduce,
        resize,
        rows,
        tensor,
    )
    return [elementwise.OPS, conv.OPS, conv_chain.OPS, pool.OPS, norm.OPS, linalg.OPS, reduce.OPS, tensor.OPS,
            resize.OPS, detection.OPS, detection_head.OPS, nms.OPS, quantized.OPS, qdq.OPS, preprocess.OPS,
            attention.OPS, rows.OPS]


@lru_cache(maxsize=1)
def default_registry() -> OpRegistry:
    """Every op family sartor ships; built once, read-only afterwards."""
    return OpRegistry(all_tables())
