"""An engine file damaged or edited anywhere is refused with one SartorError, never an internal
error: bits flipped in the header length, and header fields removed or given another type with the
checksum recomputed (a SHA-256 checksum proves a file whole, not who wrote it: a signature does)."""
from __future__ import annotations

import struct

import pytest

import sartor
from sartor.errors import SartorError
from sartor.runtime.engine_file import IMPLAUSIBLE_HEADER_BYTES, MAGIC, pack, read_engine_file


@pytest.mark.parametrize("byte", range(8))
def test_a_flipped_bit_in_the_header_length_is_refused_in_one_line(tiny_plan, tmp_path, byte):
    data = bytearray(tiny_plan.read_bytes())
    data[len(MAGIC) + 4 + byte] ^= 0x80
    damaged = tmp_path / "damaged.plan"
    damaged.write_bytes(bytes(data))
    with pytest.raises(SartorError) as refused:
        sartor.load(damaged, device="cpu")
    assert "\n" not in str(refused.value) and str(damaged) in str(refused.value)
    length = struct.unpack_from("<Q", data, len(MAGIC) + 4)[0]
    if length > IMPLAUSIBLE_HEADER_BYTES:
        assert "is corrupted: its header length" in str(refused.value)


def _edits(header: dict):
    """(what, edited header) pairs: each top-level field removed, then given a wrong type."""
    for key in sorted(header):
        if key in ("fingerprint",):
            continue
        removed = dict(header)
        del removed[key]
        yield f"without {key}", removed
        for wrong in ("text", 7, [], {}):
            if type(wrong) is not type(header[key]):
                yield f"{key} as {type(wrong).__name__}", dict(header, **{key: wrong})


def test_edited_header_fields_are_refused_in_one_line(tiny_plan, tmp_path):
    header, tensors = read_engine_file(tiny_plan)
    internal = []
    refused = 0
    for what, edited in _edits(header):
        path = tmp_path / "edited.plan"
        path.write_bytes(pack(edited, tensors))  # the checksum recomputed: the file is "whole"
        try:
            engine = sartor.load(path, device="cpu")
        except SartorError as exc:
            assert "\n" not in str(exc), what
            refused += 1
            continue
        except Exception as exc:  # noqa: BLE001 - what this test exists to catch
            internal.append(f"{what}: {type(exc).__name__}: {exc}")
            continue
        del engine  # a field the loader does not need may go: the engine still loads
    assert not internal, internal
    assert refused >= 10
