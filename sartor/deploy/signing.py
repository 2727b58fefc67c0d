"""Signing keys and signed engines: `sartor keygen`, `sartor sign`, `sartor build --sign-key`.

A key pair is two PEM files: KEY, the Ed25519 private key (PKCS #8, unencrypted, mode 0600), and
KEY.pub, its public key (SubjectPublicKeyInfo), which goes into the devices' trust stores. The
signature format and its verification are in runtime/engine_signature.py; this module is what only
the machine that signs needs.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from ..errors import EngineFileError, KeyFileError, OutputPathError
from ..runtime.engine_file import open_engine, sign, write_atomic
from ..runtime.engine_signature import (
    PUBLIC_KEY_SUFFIX,
    key_fingerprint,
    require_cryptography,
)

PRIVATE_KEY_MODE = 0o600


def public_key_path(key_path: str | os.PathLike) -> Path:
    return Path(f"{key_path}{PUBLIC_KEY_SUFFIX}")


def generate_key(path: str | os.PathLike, overwrite: bool = False) -> str:
    """Write a new Ed25519 key pair to `path` (private, 0600) and `path`.pub; returns its fingerprint.
    An existing key is never replaced unless `overwrite`: losing it orphans every engine it signed."""
    require_cryptography("making a signing key")
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
    path = Path(path)
    public = public_key_path(path)
    if not overwrite:
        for existing in (path, public):
            if existing.exists() or existing.is_symlink():
                raise OutputPathError(f"{existing} exists: a key is not replaced (pass --force to write a new one)")
    key = Ed25519PrivateKey.generate()
    private_pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                    serialization.NoEncryption())
    public_pem = key.public_key().public_bytes(serialization.Encoding.PEM,
                                               serialization.PublicFormat.SubjectPublicKeyInfo)
    write_atomic(path, private_pem, mode=PRIVATE_KEY_MODE)
    write_atomic(public, public_pem)
    return key_fingerprint(key)


def read_private_key(path: str | os.PathLike):
    """An Ed25519 private key from a PEM (PKCS #8) or OpenSSH private key file, unencrypted."""
    require_cryptography(f"signing with {path}")
    from cryptography.exceptions import UnsupportedAlgorithm
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
    path = Path(path)
    if path.is_dir():
        raise KeyFileError(f"signing key {path} is a directory, not a key file")
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise KeyFileError(f"signing key not found: {path}") from None
    except OSError as exc:
        raise KeyFileError(f"cannot read signing key {path}: {exc.strerror or exc}") from None
    try:
        key = (serialization.load_ssh_private_key(data, password=None) if b"OPENSSH PRIVATE KEY" in data
               else serialization.load_pem_private_key(data, password=None))
    except TypeError:  # a password is needed
        raise KeyFileError(f"signing key {path} is encrypted; sartor reads unencrypted keys (keep them 0600)") from None
    except (ValueError, UnsupportedAlgorithm):
        key = None
    if not isinstance(key, Ed25519PrivateKey):
        hint = " (that is the public key: sign with the private one)" if path.name.endswith(PUBLIC_KEY_SUFFIX) else ""
        raise KeyFileError(f"{path} is not an Ed25519 private key{hint}; `sartor keygen -o KEY` writes one")
    return key


@dataclass(frozen=True)
class Signed:
    output: str
    fingerprint: str
    replaced: str | None  # the fingerprint of the signature it had, if any


def sign_engine(engine: str | os.PathLike, key, output: str | os.PathLike | None = None) -> Signed:
    """Sign the engine file `engine` with `key` (a private key or its file) into `output` (by default
    in place). The engine is checked first (checksum, and any signature it has must verify)."""
    key = key if hasattr(key, "sign") else read_private_key(key)
    if not Path(engine).is_file():
        raise EngineFileError(f"engine file not found: {engine}")
    data = Path(engine).read_bytes()
    checked = open_engine(data, str(engine))
    signed = sign(data, key, str(engine))
    destination = Path(output) if output is not None else Path(engine)
    write_atomic(destination, signed)
    return Signed(str(destination), key_fingerprint(key), checked.signature.fingerprint if checked.signature else None)
