"""Reading a file's bytes for the pipeline (`sources._read_file`, through `read_source`): whole,
from a file that grew after its size was read, from a pipe written in pieces, and the errors a user
meets."""
from __future__ import annotations

import os
import threading

import numpy as np
import pytest

from sartor.pipeline import sources
from sartor.pipeline.sources import jpeg_marks, read_source

JPEG_LIKE = b"\xff\xd8\xff" + bytes(range(256)) * 40 + b"\xff\xd9"


def test_a_file_is_read_whole_with_its_jpeg_marks(tmp_path):
    path = tmp_path / "a.jpg"
    path.write_bytes(JPEG_LIKE)
    source = read_source(path, 0)
    assert source.error is None and bytes(source.encoded.numpy()) == JPEG_LIKE
    assert source.marks == (True, True) and source.name == str(path)
    assert source.encoded.numpy().flags.writeable  # a buffer a tensor may be made over without a copy


def test_a_file_that_grew_after_its_size_was_read_is_read_to_its_new_end(tmp_path, monkeypatch):
    path = tmp_path / "growing.jpg"
    path.write_bytes(JPEG_LIKE)
    fstat = os.fstat

    def fstat_then_grow(fd):
        status = fstat(fd)
        with open(path, "ab") as f:  # written after the size was taken, before the read
            f.write(b"tail" * 300_000)
        return status
    monkeypatch.setattr(sources.os, "fstat", fstat_then_grow)
    assert bytes(sources._read_file(path)) == JPEG_LIKE + b"tail" * 300_000


def test_a_pipe_written_in_pieces_is_read_to_its_end(tmp_path):
    fifo = tmp_path / "camera.pipe"
    os.mkfifo(fifo)
    pieces = [JPEG_LIKE[:1000], JPEG_LIKE[1000:5000], JPEG_LIKE[5000:]]

    def write() -> None:
        with open(fifo, "wb", buffering=0) as f:
            for piece in pieces:
                f.write(piece)
    writer = threading.Thread(target=write)
    writer.start()
    data = sources._read_file(fifo)  # fstat gives 0 for a pipe: short reads until its writer closes it
    writer.join()
    assert bytes(data) == JPEG_LIKE


def test_an_empty_file_a_directory_and_a_missing_file_are_failed_items(tmp_path):
    empty = tmp_path / "empty.jpg"
    empty.write_bytes(b"")
    assert read_source(empty, 0).error == f"image {empty} is empty"
    assert read_source(tmp_path, 1).error == f"image {tmp_path} is a directory, not an image file"
    missing = tmp_path / "missing.jpg"
    assert read_source(missing, 2).error == f"image {missing} cannot be read: No such file or directory"


@pytest.mark.parametrize("size", [1, 4096, 1 << 20])
def test_sizes_around_pages_read_exactly(tmp_path, size):
    path = tmp_path / "f.bin"
    payload = os.urandom(size)
    path.write_bytes(payload)
    assert bytes(sources._read_file(path)) == payload


@pytest.mark.parametrize("data, marks", [
    (JPEG_LIKE, (True, True)),  # the end-of-image marker last
    (JPEG_LIKE + b"\0" * 1000, (True, True)),  # followed by a little padding
    (JPEG_LIKE + b"\0" * 1100, (True, False)),  # too far from the end to be looked for
    (JPEG_LIKE[:-2], (True, False)),  # truncated
    (b"\x89PNG\r\n\x1a\n" + bytes(100), (False, False)),
])
def test_jpeg_marks_find_the_start_and_an_end_marker_near_the_end(data, marks):
    assert jpeg_marks(data) == marks
    assert jpeg_marks(bytearray(data)) == marks
    assert jpeg_marks(np.frombuffer(data, np.int8)) == marks  # raw bytes compared, whatever the item format
