"""A pipeline's items cut into batch-sized chunks, and files read (and their host share started
decoding) batches ahead of the decode that needs them.

A file read leaves the interpreter lock, so on a thread of its own it runs beside the decode of the
batch before rather than in front of it. The JPEGs a batch gives the host decode pool (decision
0057) start decoding as soon as their files are read: each frame holds one core for its whole
decode, and started with the batch's own nvJPEG decode that latency would sit in front of every batch.
A chunk without paths (frames, bytes, a camera's live frames) is passed on at once, after the ones
read before it: nothing live is waited for early."""
from __future__ import annotations

import os
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Executor, Future
from dataclasses import dataclass

from .sources import FrameSource, read_sources

READ_AHEAD_CHUNKS = 2  # batches of files read ahead of the one being decoded


@dataclass
class Chunk:
    """One batch's items (FrameSources once read ahead) and the index of its first item; once read
    ahead, also the host share it decodes at and that share's decodes, started (`on_host`)."""
    items: list
    first: int
    share: float | None = None  # None: chosen when the batch is prepared
    on_host: dict[int, Future] | None = None


def chunks_of(items: Iterable, size: int) -> Iterator[Chunk]:
    """Chunks of up to `size` items, in order."""
    chunk, first = [], 0
    for index, item in enumerate(items):
        chunk.append(item)
        if len(chunk) == size:
            yield Chunk(chunk, first)
            chunk, first = [], index + 1
    if chunk:
        yield Chunk(chunk, first)


def read_ahead(chunks: Iterator[Chunk], reader: Executor, frame_order: str,
               choose_share: Callable[[], float] | None = None,
               start_host: Callable[[list[FrameSource], float], dict[int, Future]] | None = None,
               depth: int = READ_AHEAD_CHUNKS) -> Iterator[Chunk]:
    """`chunks` in order, those holding paths read into FrameSources up to `depth` chunks ahead on
    `reader`. With `choose_share`, every chunk's host share is chosen here, in order, in the thread
    that iterates; a chunk read ahead has `start_host(sources, share)` called on `reader` once its
    files are read (its `on_host`)."""
    ahead: deque[tuple[Chunk, Future]] = deque()

    def handed(pair: tuple[Chunk, Future]) -> Chunk:
        chunk, read = pair
        chunk.items, chunk.on_host = read.result()
        return chunk

    try:
        for chunk in chunks:
            if choose_share is not None:
                chunk.share = choose_share()
            if not any(isinstance(item, (str, os.PathLike)) for item in chunk.items):
                while ahead:
                    yield handed(ahead.popleft())
                yield chunk
                continue
            ahead.append((chunk, reader.submit(_read, chunk, frame_order, start_host)))
            if len(ahead) > depth:
                yield handed(ahead.popleft())
        while ahead:
            yield handed(ahead.popleft())
    finally:
        for _, read in ahead:  # read ahead, never handed on (the stream stopped): buffers back to the pool
            _abandon(read)


def _read(chunk: Chunk, frame_order: str, start_host) -> tuple[list[FrameSource], dict[int, Future] | None]:
    sources = read_sources(chunk.items, frame_order, chunk.first)
    on_host = start_host(sources, chunk.share) if start_host is not None and chunk.share else None
    return sources, on_host


def _abandon(read: Future) -> None:
    """Wait for a chunk read ahead and its host decodes, and give their page-locked buffers back
    (a buffer taken and never uploaded stays taken otherwise: pinned_slots.py)."""
    try:
        _, on_host = read.result()
    except Exception:  # noqa: BLE001 - its read failed: nothing of it was started
        return
    for future in (on_host or {}).values():
        try:
            frame = future.result()
        except Exception:  # noqa: BLE001 - a decode that raised holds no buffer
            continue
        if frame.pinned is not None:
            frame.pinned.release()
