"""The channel between a frontend process and the main process (`--frontends N`): framed messages on
a Unix-domain socket, and what inference requests, replies and errors look like on it.

A frame is `<II` (header bytes, payload bytes), a JSON header, then the payload: the raw tensors the
header describes, back to back. Nothing is pickled; the header holds names, shapes, dtypes, sizes and
shared-memory references only. Frames read off the socket are sliced without a copy where they
arrived whole, and a large frame is read straight into a buffer of its own size, so a tensor crosses
the socket with no copy beyond the kernel's. Frames sent in one event-loop iteration go out in one
write (the main process answers many requests per wake-up).

    worker -> main   {"k": "hello", "index", "pid"}               after binding its ports
                     {"k": "i", "id", "model", "version", "inputs", "outputs", "regions", "timeout",
                      "deadline"}                                 an inference request
                     {"k": "g", "rs": [request, ...]}             the requests of one wake-up (each
                                                                  an "i" header; payloads in order)
                     {"k": "c", "id"}                             its caller went away
    main -> worker   {"k": "r", "id", "model", "version", "outputs"}   the reply
                     {"k": "e", "id", "error", "message"}         the request failed
                     {"k": "G", "rs": [reply or error, ...]}      the answers of one wake-up
                     {"k": "stop", "grace"}                       finish what runs, then exit

Grouping exists for the main process's CPU: one header to parse, one batcher lock and one frame to
write per wake-up rather than per request. Each member keeps its own id, error, timeout and
cancellation.

Frames are bounded (`frame_limit`): a sender splits a group that would exceed its peer's limit, and
a receiver closes the channel on a frame that asks for more (a corrupt length prefix; the worker is
then restarted as a dead one is). A frame whose header cannot be read is dropped: its length prefix
was good, so the next frame starts where it ends.
"""
from __future__ import annotations

import asyncio
import json
import logging
import struct
from dataclasses import dataclass, field

import numpy as np

from ..errors import SartorError
from . import errors as serve_errors
from .errors import InvalidRequest, ServeError
from .shared_memory import ShmInput, ShmRef
from .tensors import TO_NUMPY, element_count

log = logging.getLogger("sartor.serve")
PREFIX = struct.Struct("<II")
READ_BUFFER = 256 << 10
OWN_BUFFER_FROM = 64 << 10  # a frame at least this large is read into a buffer of its own
# Room for a frame's JSON header beside its payload. A member's header names its tensors, shapes and
# dtypes (well under 16 KiB); groups hold at most MAX_GROUP members, so their headers stay within it.
HEADER_ROOM = 16 << 20
MAX_GROUP = 1024
# A request body's tensors decode to at most 8 bytes per byte of body: a one-byte varint in a gRPC
# INT64/UINT64/FP64 field, "0," in JSON decoded as an 8-byte type (4x); binary data is 1:1.
REQUEST_EXPANSION = 8
# Replies carry model outputs, which no option bounds; 2 GiB is far above a vision model's outputs
# for one request, and below the 4 GiB the prefix's payload field can state. Larger outputs can be
# asked for in shared memory, where they do not cross the channel.
REPLY_PAYLOAD_LIMIT = 2 << 30
WIRE_DTYPES = {np.dtype(name).str: np.dtype(name) for name in TO_NUMPY.values()}
# The request errors a reply may carry, by class name: the worker raises the same class, so that its
# frontends answer with the same HTTP status and gRPC code as the in-process server.
ERRORS = {cls.__name__: cls for cls in vars(serve_errors).values()
          if isinstance(cls, type) and issubclass(cls, ServeError)}


class RemoteInternalError(ServeError):
    """An unexpected failure in the main process, already worded as the in-process frontends word it."""
    http_status = 500
    grpc_code = "INTERNAL"


# ---- frames ---------------------------------------------------------------------------------------------

def request_payload_limit(max_request_bytes: int) -> int:
    """The most payload bytes one request (and one group of requests) carries on the channel."""
    return REQUEST_EXPANSION * max_request_bytes


def frame_limit(payload_limit: int) -> int:
    """The largest frame a receiver accepts when its peer keeps payloads within `payload_limit`."""
    return PREFIX.size + HEADER_ROOM + payload_limit


REPLY_FRAME_LIMIT = frame_limit(REPLY_PAYLOAD_LIMIT)


def frame(header: dict, buffers: tuple = ()) -> list:
    """The pieces of one frame (header bytes first, then the payload buffers as they are)."""
    head = json.dumps(header, separators=(",", ":")).encode()
    size = sum(memoryview(b).nbytes for b in buffers)
    return [PREFIX.pack(len(head), size) + head, *buffers]


def parse(data) -> tuple[dict, memoryview]:
    """(header, payload) of one whole frame."""
    view = memoryview(data)
    head, size = PREFIX.unpack_from(view)
    start = PREFIX.size + head
    header = json.loads(bytes(view[PREFIX.size:start]))
    if not isinstance(header, dict):
        raise ValueError(f"a frame header is a JSON object, not {type(header).__name__}")
    return header, view[start:start + size]


def grouped_frames(kind: str, members: list[tuple[dict, list]], payload_limit: int):
    """The frames ({"k": kind, "rs": headers}, buffers) that carry `members` (header, payload buffers):
    as few as keep each within `payload_limit` payload bytes and MAX_GROUP members. A member larger
    than the limit on its own is the caller's to refuse before it is queued."""
    headers, buffers, size = [], [], 0
    for header, pieces in members:
        nbytes = sum(memoryview(piece).nbytes for piece in pieces)
        if headers and (size + nbytes > payload_limit or len(headers) == MAX_GROUP):
            yield {"k": kind, "rs": headers}, buffers
            headers, buffers, size = [], [], 0
        headers.append(header)
        buffers.extend(pieces)
        size += nbytes
    if headers:
        yield {"k": kind, "rs": headers}, buffers


class Channel(asyncio.BufferedProtocol):
    """One end of a frame stream. `on_frame(header, payload)` runs on the event loop for each frame;
    `on_lost()` once the connection is gone. A frame larger than `max_frame` bytes closes it."""

    def __init__(self, on_frame, on_lost=None, max_frame: int = REPLY_FRAME_LIMIT) -> None:
        self.on_frame, self.on_lost = on_frame, on_lost
        self.max_frame = max_frame
        self._refused = False  # an oversized frame arrived: the rest of the stream is not read
        self.transport: asyncio.Transport | None = None
        self._buffer = bytearray(READ_BUFFER)
        self._start = self._end = 0
        self._own: bytearray | None = None  # a large frame being read into its own buffer
        self._own_filled = 0
        self._outgoing: list = []
        self._flush_scheduled = False
        self.closed = asyncio.Event()

    # ---- reading --------------------------------------------------------------------------------------
    def connection_made(self, transport) -> None:
        self.transport = transport

    def get_buffer(self, sizehint: int) -> memoryview:
        if self._own is not None:
            return memoryview(self._own)[self._own_filled:]
        if self._end == len(self._buffer):
            self._compact()
        return memoryview(self._buffer)[self._end:]

    def _compact(self) -> None:
        pending = self._end - self._start
        self._buffer[:pending] = self._buffer[self._start:self._end]
        self._start, self._end = 0, pending

    def buffer_updated(self, nbytes: int) -> None:
        if self._refused:
            return
        if self._own is not None:
            self._own_filled += nbytes
            if self._own_filled < len(self._own):
                return
            whole, self._own = self._own, None
            self._deliver(whole)
            return
        self._end += nbytes
        self._take_frames()

    def _take_frames(self) -> None:
        view = memoryview(self._buffer)
        while self._end - self._start >= PREFIX.size:
            head, size = PREFIX.unpack_from(view, self._start)
            total = PREFIX.size + head + size
            if total > self.max_frame:
                self._refuse(total)
                return
            available = self._end - self._start
            if available >= total:
                # Copied out: the read buffer is reused. Only small frames (or the rare large one
                # that arrived whole) take this path.
                data = bytes(view[self._start:self._start + total])
                self._start += total
                self._deliver(data)
                continue
            if total >= OWN_BUFFER_FROM or total > len(self._buffer) - self._start:
                self._own = bytearray(total)
                self._own[:available] = view[self._start:self._end]
                self._own_filled = available
                self._start = self._end = 0
            break
        if self._start == self._end:
            self._start = self._end = 0

    def _refuse(self, total: int) -> None:
        log.error("a frontend channel frame of %d bytes exceeds the limit of %d bytes: closing the channel",
                  total, self.max_frame)
        self._refused = True
        self._start = self._end = 0
        if self.transport is not None:
            self.transport.close()

    def _deliver(self, data) -> None:
        try:
            header, payload = parse(data)
        except Exception as exc:  # noqa: BLE001 (the length prefix was good: the stream stays in step)
            log.warning("a frontend channel frame was dropped: its header cannot be read (%s)",
                        " ".join(f"{type(exc).__name__}: {exc}".split()))
            return
        try:
            self.on_frame(header, payload)
        except Exception:
            log.exception("a frontend channel message could not be handled")

    def eof_received(self):
        return False  # close the transport

    def connection_lost(self, exc) -> None:
        self.transport = None
        self.closed.set()
        if self.on_lost is not None:
            self.on_lost()

    # ---- writing --------------------------------------------------------------------------------------
    def send(self, header: dict, buffers: tuple = ()) -> None:
        """Queue one frame; frames queued in one loop iteration leave in one write."""
        if self.transport is None:
            return
        self._outgoing.extend(frame(header, buffers))
        if not self._flush_scheduled:
            self._flush_scheduled = True
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_scheduled = False
        pieces, self._outgoing = self._outgoing, []
        if self.transport is None or self.transport.is_closing():
            return
        small: list = []
        for piece in pieces:
            if memoryview(piece).nbytes >= OWN_BUFFER_FROM:
                # A large tensor goes out as it is (the transport sends it without joining it to the
                # small pieces; what the kernel does not take at once is buffered).
                if small:
                    self.transport.write(b"".join(small))
                    small = []
                self.transport.write(piece)
            else:
                small.append(piece)
        if small:
            self.transport.write(b"".join(small))

    def close(self) -> None:
        if self.transport is not None:
            self._flush()
            self.transport.close()


# ---- tensors ----------------------------------------------------------------------------------------------

def _raw(array: np.ndarray) -> memoryview:
    """The little-endian bytes of an array, a view where it is already contiguous little-endian."""
    data = np.ascontiguousarray(array)
    data = data.astype(data.dtype.newbyteorder("<"), copy=False)
    return memoryview(data.reshape(-1).view(np.uint8))


def _wire_dtype(text: str) -> np.dtype:
    dtype = WIRE_DTYPES.get(text)
    if dtype is None:
        raise InvalidRequest(f"datatype {text!r} cannot cross the frontend channel")
    return dtype


def _array(payload: memoryview, offset: int, dtype: np.dtype, shape: list) -> np.ndarray:
    count = element_count(tuple(shape))
    return np.frombuffer(payload, dtype=dtype, count=count, offset=offset).reshape(shape)


def encode_tensors(tensors: dict) -> tuple[list, list]:
    """(descriptors, payload buffers) of name -> np.ndarray or ShmInput."""
    described, buffers = [], []
    for name, value in tensors.items():
        if isinstance(value, ShmInput):
            ref = value.ref
            described.append({"name": name, "dtype": np.dtype(value.dtype).newbyteorder("<").str,
                              "shape": list(value.shape), "region": [ref.region, ref.byte_size, ref.offset, ref.where]})
            continue
        raw = _raw(value)
        described.append({"name": name, "dtype": value.dtype.newbyteorder("<").str, "shape": list(value.shape),
                          "bytes": raw.nbytes})
        buffers.append(raw)
    return described, buffers


def decode_tensors(described: list, payload: memoryview) -> dict:
    """The inverse of encode_tensors: read-only arrays viewing the payload, or ShmInput."""
    tensors, offset = {}, 0
    for entry in described:
        dtype, shape = _wire_dtype(entry["dtype"]), entry["shape"]
        if "region" in entry:
            region, byte_size, ref_offset, where = entry["region"]
            tensors[entry["name"]] = ShmInput(ShmRef(region, byte_size, ref_offset, where), tuple(shape), dtype)
            continue
        tensors[entry["name"]] = _array(payload, offset, dtype, shape)
        offset += entry["bytes"]
    return tensors


def encode_regions(regions: dict | None) -> dict:
    return {name: [r.region, r.byte_size, r.offset, r.where] for name, r in (regions or {}).items()}


def decode_regions(encoded: dict | None) -> dict:
    return {name: ShmRef(*fields) for name, fields in (encoded or {}).items()}


def payload_bytes(described: list) -> int:
    """The payload bytes of tensor descriptors (inputs of a request, outputs of a reply)."""
    return sum(entry.get("bytes", 0) for entry in described)


def group_members(header: dict, payload: memoryview) -> list[tuple[dict, memoryview]]:
    """(header, payload) of each member of a grouped frame."""
    found, offset = [], 0
    for entry in header["rs"]:
        # A request's payload is its inputs'; a reply's its outputs' (an error's none).
        size = payload_bytes(entry["inputs"] if "inputs" in entry else entry.get("outputs") or ())
        found.append((entry, payload[offset:offset + size]))
        offset += size
    return found


# ---- replies --------------------------------------------------------------------------------------------

@dataclass
class RemoteModel:
    """What the frontends read of the model that answered: its name and version."""
    name: str
    version: str


@dataclass
class RemoteOutcome:
    """InferOutcome as the worker sees it (the frontends read only these fields)."""
    model: RemoteModel
    outputs: dict
    shared_memory: dict = field(default_factory=dict)


def reply(request_id: int, outcome) -> tuple[dict, list]:
    """The reply frame of an InferOutcome: outputs written to shared memory carry their byte count only."""
    described, buffers = [], []
    for name, array in outcome.outputs.items():
        entry = {"name": name, "dtype": array.dtype.newbyteorder("<").str, "shape": list(array.shape)}
        if name in outcome.shared_memory:
            entry["written"] = outcome.shared_memory[name]
        else:
            raw = _raw(array)
            entry["bytes"] = raw.nbytes
            buffers.append(raw)
        described.append(entry)
    header = {"k": "r", "id": request_id, "model": outcome.model.name, "version": outcome.model.version,
              "outputs": described}
    return header, buffers


def outcome_of(header: dict, payload: memoryview) -> RemoteOutcome:
    outputs, written, offset = {}, {}, 0
    for entry in header["outputs"]:
        dtype, shape = _wire_dtype(entry["dtype"]), entry["shape"]
        if "written" in entry:
            # In the client's region already: the response needs its datatype and shape only.
            outputs[entry["name"]] = np.broadcast_to(np.zeros((), dtype), shape)
            written[entry["name"]] = entry["written"]
            continue
        outputs[entry["name"]] = _array(payload, offset, dtype, shape)
        offset += entry["bytes"]
    return RemoteOutcome(RemoteModel(header["model"], header["version"]), outputs, written)


def error_header(request_id: int, exc: BaseException) -> dict:
    if isinstance(exc, ServeError) and type(exc).__name__ in ERRORS:
        kind = type(exc).__name__
    elif isinstance(exc, SartorError):
        kind = "SartorError"
    else:
        # Worded as the in-process frontends word an unexpected failure.
        return {"k": "e", "id": request_id, "error": "internal",
                "message": " ".join(f"internal error: {type(exc).__name__}: {exc}".split())}
    return {"k": "e", "id": request_id, "error": kind, "message": str(exc)}


def error_of(header: dict) -> Exception:
    kind, message = header.get("error"), header.get("message", "")
    if kind in ERRORS:
        return ERRORS[kind](message)
    if kind == "SartorError":
        return SartorError(message)
    return RemoteInternalError(message)
