"""Page-locked buffers that the host decode pool writes frames into, each reused once the upload
that read it has finished.

A frame decoded on the host reaches the device by an asynchronous copy only from page-locked memory.
Allocating that memory for every frame, even through torch's caching host allocator, costs a
pool of many threads much of its rate (docs/decisions/0059-host-jpegs-through-simplejpeg.md).
So the pool keeps its own buffers: a thread takes a free one, decodes into it, and the caller
records an event on its stream after queueing the upload; the buffer is free again once that event
has completed. A buffer taken and never uploaded (a batch abandoned by an error) stays taken; the
pool allocates up to `MAX_SLOTS`, and past that a frame gets memory of its own, as before."""
from __future__ import annotations

import math
import threading

import torch

MAX_SLOTS = 128  # batches of 32 decoded ahead (read_ahead.py) while the last one's uploads finish
ROUND_BYTES = 1 << 20  # buffers sized in whole MiB, so frames of nearby sizes share them


class PinnedSlot:
    """One page-locked buffer, taken by a pool thread until `uploaded` (by the caller) or `release`."""

    def __init__(self, nbytes: int, pin_memory: bool = True, new_event=torch.cuda.Event) -> None:
        self.buffer = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin_memory)
        self.new_event = new_event
        self.event: torch.cuda.Event | None = None
        self.taken = True

    def free(self) -> bool:
        return not self.taken and (self.event is None or self.event.query())

    def uploaded(self, stream: torch.cuda.Stream | None = None) -> None:
        """The caller has queued the copy that reads this buffer on `stream` (None: the current one)."""
        if self.event is None:
            self.event = self.new_event()
        self.event.record(stream)
        self.taken = False  # after the record: a thread that sees it free also sees the event

    def release(self) -> None:
        """Nothing will read this buffer (its frame failed after it was taken)."""
        self.taken = False


class PinnedSlots:
    """The buffers of one pipeline's pool, shared by its threads. `pin_memory` and `new_event` are
    for tests without a GPU (pageable buffers, events of their own)."""

    def __init__(self, max_slots: int = MAX_SLOTS, pin_memory: bool = True, new_event=torch.cuda.Event) -> None:
        self.max_slots, self.pin_memory, self.new_event = max_slots, pin_memory, new_event
        self._slots: list[PinnedSlot] = []
        self._lock = threading.Lock()

    def take(self, shape: tuple[int, ...]) -> tuple[torch.Tensor, PinnedSlot | None]:
        """A uint8 tensor of `shape` in page-locked memory and the slot it lies in (None: memory of
        its own, every slot being taken or in flight)."""
        nbytes = math.prod(shape)
        with self._lock:
            slot = next((s for s in self._slots if s.buffer.numel() >= nbytes and s.free()), None)
            if slot is not None:
                slot.taken = True
            elif len(self._slots) < self.max_slots:
                slot = self._new_slot(nbytes)
                self._slots.append(slot)
            else:  # frames grew: a free buffer too small for them gives way to one that fits
                small = next((i for i, s in enumerate(self._slots) if s.free()), None)
                if small is not None:
                    slot = self._slots[small] = self._new_slot(nbytes)
        if slot is None:
            return torch.empty(shape, dtype=torch.uint8, pin_memory=self.pin_memory), None
        return slot.buffer[:nbytes].view(shape), slot

    def _new_slot(self, nbytes: int) -> PinnedSlot:
        return PinnedSlot(-(-nbytes // ROUND_BYTES) * ROUND_BYTES, self.pin_memory, self.new_event)

    def __len__(self) -> int:
        return len(self._slots)
