"""The op families sartor ships, in one list: adding a family means adding it here."""
from __future__ import annotations

from .registry import OpTable


def all_tables() -> list[OpTable]:
    from . import (
        conv,
        detection,
        detection_head,
        elementwise,
        linalg,
        norm,
        pool,
        qdq,
        quantized,
        reduce,
        resize,
        tensor,
    )
    return [elementwise.OPS, conv.OPS, pool.OPS, norm.OPS, linalg.OPS, reduce.OPS, tensor.OPS, resize.OPS,
            detection.OPS, detection_head.OPS, quantized.OPS, qdq.OPS]
