"""The engine container: never pickle, always checksummed, optionally signed.

    MAGIC (8) | format version (u32 LE) | header length (u64 LE) | header (UTF-8 JSON)
    | weights length (u64 LE) | weights (safetensors) | SHA-256 checksum of everything before (32)
    [ | signature block (engine_signature.py: the signer's Ed25519 public key and signature) ]

Loading checks the magic, the version, the length fields, the checksum and the signature (when
there is one, or when a trust store asks for one) before it parses anything, so a truncated,
corrupted, tampered or foreign file is refused with one line and nothing from it is used. The
checksum is not a signature: anyone can recompute it; only the signature says who made the file.
"""
from __future__ import annotations

import hashlib
import io
import json
import os
import signal
import stat
import struct
import tempfile
import threading
import zipfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from ..errors import EngineFileError, OutputPathError
from .engine_signature import (
    Signature,
    TrustStore,
    parse_signature_block,
    signature_block,
)

MAGIC = b"SARTOR\x00E"
FORMAT_VERSION = 2
# What an engine of an older format lacks, said in its refusal. 2: tactics are named in the
# registry's scheme (`kernels/registry.py`); version 1 engines name them in the scheme before it.
OLDER_FORMATS = {1: "its layers' tactics are named in sartor's scheme before the tactic registry"}
_DIGEST = 32
# A header length no engine has: a flipped high bit, reported as corruption rather than truncation.
IMPLAUSIBLE_HEADER_BYTES = 1 << 40
_PICKLE_PREFIXES = (b"\x80\x02", b"\x80\x03", b"\x80\x04", b"\x80\x05", b"PK\x03\x04")


def pack(header: dict, weights: dict[str, torch.Tensor]) -> bytes:
    header_bytes = json.dumps(header, sort_keys=True).encode("utf-8")
    weight_bytes = save_safetensors({k: v.detach().cpu().contiguous() for k, v in weights.items()})
    body = (MAGIC + struct.pack("<I", FORMAT_VERSION) + struct.pack("<Q", len(header_bytes)) + header_bytes
            + struct.pack("<Q", len(weight_bytes)) + weight_bytes)
    return body + hashlib.sha256(body).digest()


@dataclass(frozen=True)
class EngineFile:
    """An engine file read and checked: its header and tensors, the SHA-256 checksum of its payload
    (the engine's identity: the private kernel cache is keyed by it) and its signature, if any."""
    header: dict
    tensors: dict
    checksum: bytes
    signature: Signature | None

    @property
    def digest(self) -> str:
        return self.checksum.hex()


def _payload_end(data: bytes, where: str) -> int:
    """Where the checksum ends, checking magic, version and lengths; one line when they are wrong."""
    if data.startswith(_PICKLE_PREFIXES):
        raise EngineFileError(f"{where} is a pickle/zip file, not a sartor engine; sartor never unpickles files")
    if not data:
        raise EngineFileError(f"{where} is empty, not a sartor engine")
    if len(data) < len(MAGIC) + 4 and MAGIC.startswith(data[:len(MAGIC)]):
        raise EngineFileError(f"{where} is truncated ({len(data)} bytes)")
    if data[:len(MAGIC)] != MAGIC:
        raise EngineFileError(f"{where} is not a sartor engine (bad magic)")
    version = struct.unpack_from("<I", data, len(MAGIC))[0]
    if version != FORMAT_VERSION:
        why = f" ({OLDER_FORMATS[version]})" if version in OLDER_FORMATS else ""
        raise EngineFileError(f"{where} has engine format version {version}{why}; this sartor reads version "
                              f"{FORMAT_VERSION}: rebuild the engine from its ONNX model")
    offset = len(MAGIC) + 4
    try:
        header_len = struct.unpack_from("<Q", data, offset)[0]
        if header_len > IMPLAUSIBLE_HEADER_BYTES:
            raise EngineFileError(f"{where} is corrupted: its header length {header_len} is larger than any engine "
                                  f"({len(data)} bytes here)")
        offset += 8 + header_len
        weights_len = struct.unpack_from("<Q", data, offset)[0]
        offset += 8
    except struct.error:
        # Cut inside the header: the full size is unknown, but not what it must at least be.
        at_least = max(offset, len(MAGIC) + 12) + 8 + _DIGEST
        raise EngineFileError(f"{where} is truncated ({len(data)} bytes; an engine needs at least {at_least})") from None
    expected_end = offset + weights_len + _DIGEST
    if len(data) < expected_end:
        raise EngineFileError(f"{where} is truncated ({len(data)} of {expected_end} bytes)")
    return expected_end


def open_engine(data: bytes, where: str = "engine", trust: TrustStore | None = None) -> EngineFile:
    """Check and read an engine file's bytes. A signature that does not verify is refused always;
    with a `trust` store, so is an unsigned engine or one signed by a key the store lacks."""
    end = _payload_end(data, where)
    body, checksum = data[:end - _DIGEST], data[end - _DIGEST:end]
    signature = parse_signature_block(data[end:], where) if len(data) > end else None
    if hashlib.sha256(body).digest() != checksum:
        raise EngineFileError(f"{where} failed its integrity check (SHA-256 checksum mismatch): corrupted or "
                              f"tampered")
    if signature is not None and not signature.verifies(checksum):
        raise EngineFileError(f"{where} has a signature by key {signature.fingerprint} that does not verify: the "
                              f"engine was changed after it was signed, or the signature is corrupted")
    if trust is not None:
        trust.check(signature, where)
    offset = len(MAGIC) + 4
    header_len = struct.unpack_from("<Q", data, offset)[0]
    offset += 8
    header_bytes = data[offset:offset + header_len]
    offset += header_len
    weights_len = struct.unpack_from("<Q", data, offset)[0]
    offset += 8
    try:
        header = json.loads(header_bytes.decode("utf-8"))
        weights = load_safetensors(bytes(data[offset:offset + weights_len]))
    except Exception as exc:
        raise EngineFileError(f"{where} passes its checksum but is unreadable ({type(exc).__name__})") from None
    return EngineFile(header, weights, checksum, signature)


def unpack(data: bytes, where: str = "engine") -> tuple[dict, dict[str, torch.Tensor]]:
    """The header and tensors of an engine file's bytes (checked as `open_engine` does, no trust store)."""
    engine = open_engine(data, where)
    return engine.header, engine.tensors


def sign(data: bytes, private_key, where: str = "engine") -> bytes:
    """The engine file `data` signed with `private_key` (Ed25519): its checksum is checked, any
    signature it had is dropped, and a new block is appended. The payload is unchanged."""
    end = _payload_end(data, where)
    checksum = data[end - _DIGEST:end]
    if hashlib.sha256(data[:end - _DIGEST]).digest() != checksum:
        raise EngineFileError(f"{where} failed its integrity check (SHA-256 checksum mismatch): corrupted or "
                              f"tampered; not signed")
    if len(data) > end:
        parse_signature_block(data[end:], where)  # a block, not other bytes, is what gets replaced
    return data[:end] + signature_block(private_key, checksum)


def read_engine(path: str | os.PathLike, trust: TrustStore | None = None) -> EngineFile:
    path = Path(path)
    if not path.is_file():
        raise EngineFileError(f"engine file not found: {path}")
    return open_engine(path.read_bytes(), str(path), trust)


def read_engine_file(path: str | os.PathLike, trust: TrustStore | None = None) -> tuple[dict, dict[str, torch.Tensor]]:
    engine = read_engine(path, trust)
    return engine.header, engine.tensors


def _check_parent(path: Path, parent: Path) -> None:
    if parent.is_dir():
        return
    for above in [parent, *parent.parents]:
        if above.exists():
            if not above.is_dir():
                raise OutputPathError(f"cannot write {path}: {above} is a file, not a directory")
            break
    raise OutputPathError(f"cannot write {path}: directory {parent} does not exist")


def _umask() -> int:
    """The process's umask, read without changing it where Linux says it (os.umask can only set)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _output_target(path: Path) -> Path:
    """The file to write for `path`. A symlink is written through (its target, created if missing),
    as `cp` and shell redirection do; a directory, device, FIFO or socket is refused, because a
    rename over it would replace the node with a regular file."""
    if path.is_symlink():
        target = Path(os.path.realpath(path))
        if target.is_symlink():  # a loop of links
            raise OutputPathError(f"cannot write {path}: it is a symbolic link that resolves to no file")
        path = target
    try:
        mode = os.stat(path).st_mode
    except (FileNotFoundError, NotADirectoryError):  # nothing there yet; _check_parent words a bad parent
        return path
    except OSError as exc:
        raise OutputPathError(f"cannot write {path}: {exc.strerror or exc}") from None
    if stat.S_ISDIR(mode):
        raise OutputPathError(f"cannot write {path}: it is a directory")
    if not stat.S_ISREG(mode):
        kind = ("a character device" if stat.S_ISCHR(mode) else "a block device" if stat.S_ISBLK(mode)
                else "a FIFO" if stat.S_ISFIFO(mode) else "a socket" if stat.S_ISSOCK(mode) else "a special file")
        raise OutputPathError(f"cannot write {path}: it is {kind}, not a regular file (sartor renames a finished "
                              f"file over the name, which would replace it)")
    return path


@contextmanager
def termination_cleans_up():
    """SIGTERM (what systemd, Docker and Kubernetes send) while a temporary file or directory exists
    raises SystemExit(143) in the main thread, so the `finally` removing it runs before the process
    ends, as on Ctrl-C. A handler the application installed itself is left in place."""
    if threading.current_thread() is not threading.main_thread() or \
            signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        yield
        return

    def terminate(signum, frame):
        raise SystemExit(128 + signum)
    signal.signal(signal.SIGTERM, terminate)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


def write_atomic(path: str | os.PathLike, data: bytes, mode: int | None = None) -> None:
    """Write to a temporary file beside `path`, then rename: no half-written file under the name,
    and none left beside it when the write fails or the process is told to stop. The new file gets
    `mode` when given (a private key's 0600: the temporary never has more), else the mode of the
    file it replaces, else the umask's; a symlink is written through."""
    path = Path(path)
    target = _output_target(path)
    parent = target.parent if str(target.parent) else Path(".")
    _check_parent(target, parent)
    try:
        mode = stat.S_IMODE(os.stat(target).st_mode) if mode is None else mode
    except (FileNotFoundError, NotADirectoryError):
        mode = 0o666 & ~_umask()
    tmp = None
    with termination_cleans_up():
        try:
            fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=parent)
            with os.fdopen(fd, "wb") as handle:
                handle.write(data)
                handle.flush()
                os.fchmod(handle.fileno(), mode)
                os.fsync(handle.fileno())
            os.replace(tmp, target)
            tmp = None
        except OSError as exc:
            raise OutputPathError(f"cannot write {path}: {exc.strerror or exc}") from None
        finally:
            if tmp is not None:
                Path(tmp).unlink(missing_ok=True)


def check_writable(path: str | os.PathLike) -> None:
    """Fail before a long build rather than after it."""
    path = _output_target(Path(path))
    parent = path.parent if str(path.parent) else Path(".")
    _check_parent(path, parent)
    if not os.access(parent, os.W_OK):
        raise OutputPathError(f"cannot write {path}: directory {parent} is not writable")


def npz_bytes(arrays: dict) -> bytes:
    """An .npz archive in memory (as numpy.savez writes it, no pickle), for write_atomic; any array
    name works."""
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", compression=zipfile.ZIP_STORED, allowZip64=True) as archive:
        for name, array in arrays.items():
            with archive.open(f"{name}.npy", "w", force_zip64=True) as handle:
                np.lib.format.write_array(handle, np.asanyarray(array), allow_pickle=False)
    return buffer.getvalue()
