"""The SPPF chain check shared by the pool kernel's tests and the quantized pass-through's: three
5×5 pools written through slices of one channels-last buffer. Not a test module (no test_ prefix)."""
from __future__ import annotations

import torch

from sartor.kernels.pool.max_pool import POOL_TILES
from sartor.ops.pool import max_pool

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

SPPF_POOL = {"kernel_shape": [5, 5], "strides": [1, 1], "pads": [2, 2, 2, 2], "tactic": POOL_TILES[0].name}


def assert_sppf_chain_in_one_buffer(first: torch.Tensor) -> torch.Tensor:
    """Three 5×5 pools chained through slices of one channels-last buffer of `first`'s dtype (float
    or quantized codes) give exactly the reference pools; returns the buffer."""
    from sartor.ops.pool import max_pool_into
    buffer = torch.zeros(2, 24, 7, 7).to(first.dtype).contiguous(memory_format=torch.channels_last).to(DEVICE)
    buffer[:, :6] = first.to(DEVICE)
    expected = [first]
    for k in range(1, 4):
        expected.append(max_pool([expected[-1]], dict(SPPF_POOL, tactic="torch")))
        written = max_pool_into([buffer[:, 6 * (k - 1):6 * k]], SPPF_POOL, buffer[:, 6 * k:6 * (k + 1)])
        assert written is not None and written.data_ptr() == buffer[:, 6 * k:].data_ptr()
    assert torch.equal(buffer.cpu().float(), torch.cat(expected, 1).float())
    return buffer
