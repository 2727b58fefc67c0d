"""One batch's device-to-device output copies, gathered from the requests' sinks and issued
together.

With CUDA shared memory each response's output rows go into the client's own region. Issued one
`copy_` per request, that was a launch and main-process time per request
(docs/decisions/0017-serve-batched-copies-sleeping-waits.md). Here the sinks only add
(target, source) pairs; the batcher's worker then issues them as one multi-tensor copy per device
and dtype (`torch._foreach_copy_`) on its current stream, behind the batch that made the sources,
and synchronizes each stream once before any response goes out.
"""
from __future__ import annotations


class DeviceCopies:
    def __init__(self) -> None:
        self._pairs: list = []

    def add(self, target, source) -> None:
        """Queue `target.copy_(source)` (torch tensors of one device, dtype and size)."""
        if target.device != source.device or target.dtype != source.dtype or target.shape != source.shape:
            raise ValueError(f"device copy: target {target.dtype} {tuple(target.shape)} on {target.device}, "
                             f"source {source.dtype} {tuple(source.shape)} on {source.device}")
        self._pairs.append((target, source))

    def __len__(self) -> int:
        return len(self._pairs)

    def run(self) -> None:
        """Issue every queued copy and wait for them: one multi-tensor launch per (device, dtype),
        then each CUDA device's current stream synchronized once."""
        if not self._pairs:
            return
        import torch
        groups: dict = {}
        for target, source in self._pairs:
            targets, sources = groups.setdefault((target.device, target.dtype), ([], []))
            targets.append(target)
            sources.append(source)
        self._pairs = []
        for targets, sources in groups.values():
            torch._foreach_copy_(targets, sources)
        wait_for_devices({device for device, _ in groups})


def wait_for_tensors(tensors) -> None:
    """Wait, asleep, for the work queued on the current stream of each CUDA device these torch
    tensors live on (none for CPU tensors). The batcher's worker copies a CUDA batch's outputs to
    the host after this; that copy's own synchronization would spin a core for the whole batch
    (docs/decisions/0017-serve-batched-copies-sleeping-waits.md)."""
    wait_for_devices({t.device for t in tensors})


def wait_for_devices(devices) -> None:
    """Wait, asleep, for the work queued on the current stream of each CUDA device among these
    torch devices (CPU ones have none)."""
    cuda = [device for device in devices if device.type == "cuda"]
    if cuda:
        import torch
        for device in cuda:
            wait_asleep(torch.cuda.current_stream(device))


def wait_asleep(stream) -> None:
    """Wait for the work queued on a CUDA `stream` with the thread asleep. A stream's synchronize
    spins a core for as long as the GPU runs (CUDA's default where a process has fewer contexts than
    CPUs), and the batcher's worker waits out whole batches here, on cores that the frontend
    processes and the clients share."""
    import torch
    done = torch.cuda.Event(blocking=True)
    done.record(stream)
    done.synchronize()
