"""Writes into a client's CUDA shared-memory region: a host array's copy must wait for that copy only,
never for the engine's batch running meanwhile on its own stream (a device-wide synchronize there
stalled every response behind a batch); a batch's device rows are queued and issued together behind
it (DeviceCopies). GPU only."""
from __future__ import annotations

import time

import numpy as np
import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("CUDA shared memory needs a GPU", allow_module_level=True)
pytest.importorskip("tritonclient")  # sartor.serve's protocol types (the routine carries .whl/serve)

from sartor.serve.device_copies import DeviceCopies  # noqa: E402
from sartor.serve.shared_memory import CudaRegion  # noqa: E402

BUSY_S = 1.0  # GPU time of the stand-in batch


class OwnMemoryIpc:
    """Stands in for cudaIpcOpenMemHandle: the region is device memory of this process (a handle cannot
    be opened by the process that made it)."""

    def __init__(self, memory) -> None:
        self.memory = memory

    def open(self, raw_handle: bytes, device_id: int, name: str):
        return self.memory.data_ptr(), self.memory.numel()

    def as_tensor(self, ptr: int, size: int, device_id: int):
        return self.memory[:size]

    def close(self, ptr: int, device_id: int) -> None:
        pass


def _cycles_per_second() -> float:
    torch.cuda.synchronize()
    start = time.monotonic()
    torch.cuda._sleep(10_000_000)
    torch.cuda.synchronize()
    return 10_000_000 / max(time.monotonic() - start, 1e-6)


def test_output_write_does_not_wait_for_a_batch_on_another_stream():
    memory = torch.zeros(4096, dtype=torch.uint8, device="cuda")
    region = CudaRegion("out", b"\0" * 64, 0, 4096, OwnMemoryIpc(memory))
    values = np.arange(1000, dtype=np.float32)
    region.write(0, values)  # the first write makes its stream
    engine = torch.cuda.Stream()  # what an engine's context runs on (torch's default-priority pool)
    cycles = int(_cycles_per_second() * BUSY_S)
    with torch.cuda.stream(engine):
        torch.cuda._sleep(cycles)  # a batch that keeps the GPU busy for about BUSY_S
    start = time.monotonic()
    region.write(8, values[::-1].copy())
    took = time.monotonic() - start
    busy = not engine.query()
    engine.synchronize()
    assert busy, "the stand-in batch ended before the write: the check proves nothing"
    assert took < BUSY_S / 4, f"the write waited {took:.2f} s: for the batch on the engine's stream"
    written = memory[8:8 + values.nbytes].cpu().numpy().view(np.float32)
    np.testing.assert_array_equal(written, values[::-1])


def test_tensor_write_is_queued_behind_its_batch_and_synchronized_once():
    """The batcher's worker writes a batch's output rows into CUDA regions device to device
    (CudaRegion.write_tensor): queued in the batch's DeviceCopies without waiting, then issued on
    the worker's current stream behind the work that made them, and complete when that returns."""
    memory = torch.zeros(4096, dtype=torch.uint8, device="cuda")
    region = CudaRegion("out", b"\0" * 64, 0, 4096, OwnMemoryIpc(memory))
    # Made, and the copy run once, before the stand-in batch: a kernel's first launch loads its
    # module, which waits for the work in flight (CUDA's lazy loading; the H200 run of session 16
    # failed so), and that would be the test's wait, not the write's.
    rows = torch.arange(1000, dtype=torch.float32, device="cuda")
    warm = DeviceCopies()
    region.write_tensor(16, rows, warm)
    warm.run()
    memory.zero_()
    torch.cuda.synchronize()
    cycles = int(_cycles_per_second() * BUSY_S)
    torch.cuda._sleep(cycles)  # the batch, still running on the current stream
    copies = DeviceCopies()
    start = time.monotonic()
    region.write_tensor(16, rows, copies)
    took = time.monotonic() - start
    assert len(copies) == 1 and took < BUSY_S / 4, f"the write waited {took:.2f} s"
    busy = not torch.cuda.current_stream().query()
    assert busy, "the stand-in batch ended before the write: the check proves nothing"
    copies.run()
    assert torch.cuda.current_stream().query()
    written = memory[16:16 + 4000].cpu().numpy().view(np.float32)
    np.testing.assert_array_equal(written, np.arange(1000, dtype=np.float32))
