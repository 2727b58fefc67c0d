"""A compile worker process (`python -m sartor.tactics.compile_worker`): reads compile requests
from its standard input and answers each on its standard output, one frame each way, until its
input closes. Each request is compiled into this process's Triton cache directory, which the
builder sets to its own (compile_pool.py).

Frames are a 4-byte length and a pickle: both ends are sartor's, in one build, over a pipe. The
worker's own prints go to its standard error, so that nothing but frames reaches the builder.
"""
from __future__ import annotations

import os
import pickle
import struct
import sys
from typing import BinaryIO

_LENGTH = struct.Struct("<I")


def write_frame(stream: BinaryIO, value: object) -> None:
    payload = pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
    stream.write(_LENGTH.pack(len(payload)) + payload)
    stream.flush()


def read_frame(stream: BinaryIO):
    """The next frame's value; raises EOFError when the stream ends (mid-frame too)."""
    header = stream.read(_LENGTH.size)
    if len(header) < _LENGTH.size:
        raise EOFError
    size, = _LENGTH.unpack(header)
    payload = stream.read(size)
    if len(payload) < size:
        raise EOFError
    return pickle.loads(payload)


def answer(request) -> dict:
    """{"ident", "hash", "seconds"} for a compiled request, {"ident", "error"} for one that failed."""
    from .kernel_requests import compile_request
    try:
        kernel_hash, seconds = compile_request(request)
    except Exception as exc:  # noqa: BLE001 - reported to the builder, which compiles it itself when timed
        return {"ident": request.ident, "error": " ".join(f"{type(exc).__name__}: {exc}".split())[:300]}
    return {"ident": request.ident, "hash": kernel_hash, "seconds": seconds}


def serve(requests: BinaryIO, answers: BinaryIO) -> None:
    while True:
        try:
            request = read_frame(requests)
        except EOFError:
            return
        write_frame(answers, answer(request))


def main() -> None:
    answers = os.fdopen(os.dup(sys.stdout.fileno()), "wb")
    sys.stdout = sys.stderr  # keep stray prints out of the frames
    os.dup2(sys.stderr.fileno(), 1)  # and the compiler's, written to file descriptor 1
    serve(sys.stdin.buffer, answers)


if __name__ == "__main__":
    main()
