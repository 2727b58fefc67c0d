"""Ed25519 signatures of engine files, and the trust store that says whose signatures a load accepts.

An engine's SHA-256 is a checksum: it catches corruption, but anyone who edits a file can recompute
it. A signature binds the payload to a private key. It is a detached block after the checksum:

    ... payload ... | SHA-256 checksum (32) | SIGNATURE_MAGIC (8) | Ed25519 public key (32) | signature (64)

signed over SIGNED_CONTEXT + the checksum, i.e. over the digest of the whole payload (magic, format
version, header, weights and embedded kernels). Why a block and not a new format version:
docs/decisions/0021-signed-engines-private-kernel-cache.md.

Key files are PEM: PKCS #8 for private keys, SubjectPublicKeyInfo for public ones (an OpenSSH
`ssh-ed25519` public key line is read too). A key's fingerprint is `ed25519:` and the first 32 hex
digits of the SHA-256 of its 32 raw bytes.
"""
from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from ..errors import EngineFileError, KeyFileError, UntrustedEngineError

SIGNATURE_MAGIC = b"SARSIG\x00\x01"
_PUBLIC_KEY_BYTES, _SIGNATURE_BYTES = 32, 64
SIGNATURE_BLOCK_BYTES = len(SIGNATURE_MAGIC) + _PUBLIC_KEY_BYTES + _SIGNATURE_BYTES
# Domain separation: a signing key used for engines signs nothing else by accident.
SIGNED_CONTEXT = b"sartor engine payload SHA-256\n"
TRUST_ENV = "SARTOR_TRUST"
PUBLIC_KEY_SUFFIX = ".pub"


def require_cryptography(purpose: str) -> None:
    """Signatures need the `cryptography` package; an engine loaded without a trust store, and
    unsigned, needs nothing from it, so a runtime without it still loads and runs engines."""
    try:
        import cryptography  # noqa: F401
    except ImportError:
        raise KeyFileError(f"{purpose} needs the cryptography package (pip install cryptography)") from None


def _raw_public(public_key) -> bytes:
    from cryptography.hazmat.primitives import serialization
    return public_key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def fingerprint_of_raw(raw: bytes) -> str:
    return "ed25519:" + hashlib.sha256(raw).hexdigest()[:32]


def key_fingerprint(key) -> str:
    """The fingerprint of an Ed25519 public key, or of a private key's public half."""
    public = key.public_key() if hasattr(key, "sign") else key
    return fingerprint_of_raw(_raw_public(public))


@dataclass(frozen=True)
class Signature:
    """An engine's signature block: who signed (their public key) and the signature itself."""
    public_key: bytes
    signature: bytes

    @property
    def fingerprint(self) -> str:
        return fingerprint_of_raw(self.public_key)

    def verifies(self, checksum: bytes) -> bool:
        require_cryptography(f"checking the signature by {self.fingerprint}")
        from cryptography.exceptions import InvalidSignature
        from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
        try:
            Ed25519PublicKey.from_public_bytes(self.public_key).verify(self.signature, SIGNED_CONTEXT + checksum)
        except (InvalidSignature, ValueError):
            return False
        return True


def signature_block(private_key, checksum: bytes) -> bytes:
    """The block to append after an engine's checksum, signed with `private_key` (Ed25519)."""
    return SIGNATURE_MAGIC + _raw_public(private_key.public_key()) + private_key.sign(SIGNED_CONTEXT + checksum)


def parse_signature_block(trailer: bytes, where: str) -> Signature:
    """The signature in the bytes after an engine's checksum; a line when they are not one."""
    if not trailer.startswith(SIGNATURE_MAGIC[:len(trailer)]) or len(trailer) < len(SIGNATURE_MAGIC):
        raise EngineFileError(f"{where} has {len(trailer)} unexpected trailing bytes")
    if len(trailer) != SIGNATURE_BLOCK_BYTES:
        state = "truncated" if len(trailer) < SIGNATURE_BLOCK_BYTES else "followed by unexpected bytes"
        raise EngineFileError(f"{where} has a signature block that is {state} ({len(trailer)} of "
                              f"{SIGNATURE_BLOCK_BYTES} bytes)")
    start = len(SIGNATURE_MAGIC)
    return Signature(trailer[start:start + _PUBLIC_KEY_BYTES], trailer[start + _PUBLIC_KEY_BYTES:])


# ---- key files --------------------------------------------------------------------------------

def read_public_key(path: str | os.PathLike):
    """An Ed25519 public key from a PEM (SubjectPublicKeyInfo) or OpenSSH `.pub` file."""
    require_cryptography(f"reading the public key {path}")
    from cryptography.exceptions import UnsupportedAlgorithm
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
    data = _read_key_bytes(path, "public key")
    try:
        key = (serialization.load_ssh_public_key(data) if data.lstrip().startswith(b"ssh-")
               else serialization.load_pem_public_key(data))
    except (ValueError, TypeError, UnsupportedAlgorithm):
        key = None
    if not isinstance(key, Ed25519PublicKey):
        raise KeyFileError(f"{path} is not an Ed25519 public key (PEM or OpenSSH); `sartor keygen` writes one")
    return key


def _read_key_bytes(path: str | os.PathLike, what: str) -> bytes:
    path = Path(path)
    if path.is_dir():
        raise KeyFileError(f"{what} {path} is a directory, not a key file")
    try:
        return path.read_bytes()
    except FileNotFoundError:
        raise KeyFileError(f"{what} not found: {path}") from None
    except OSError as exc:
        raise KeyFileError(f"cannot read {what} {path}: {exc.strerror or exc}") from None


# ---- trust store ------------------------------------------------------------------------------

class TrustStore:
    """The public keys whose signatures a load accepts, by raw bytes; `source` names where they came from."""

    def __init__(self, keys: Iterable, source: str) -> None:
        self.keys = {_raw_public(key): key for key in keys}
        self.source = source

    @property
    def fingerprints(self) -> list[str]:
        return sorted(fingerprint_of_raw(raw) for raw in self.keys)

    def describe(self) -> str:
        return f"{self.source}: {len(self.keys)} key(s)"

    def check(self, signature: Signature | None, where: str) -> None:
        """Refuse, in one line, an engine this store does not vouch for (its signature already verified)."""
        if signature is None:
            raise UntrustedEngineError(f"{where} is not signed, and a trust store is set ({self.describe()}): "
                                       f"only engines signed by its keys load (`sartor sign ENGINE --key KEY`)")
        if signature.public_key not in self.keys:
            raise UntrustedEngineError(f"{where} is signed by key {signature.fingerprint}, which is not in the "
                                       f"trust store ({self.describe()})")


def _keys_in_directory(directory: Path) -> list:
    files = sorted(p for p in directory.iterdir() if p.name.endswith(PUBLIC_KEY_SUFFIX) and p.is_file())
    if not files:
        raise KeyFileError(f"trust store {directory} holds no {PUBLIC_KEY_SUFFIX} public key files")
    return [read_public_key(p) for p in files]


def trust_store(trust) -> TrustStore | None:
    """The trust store a load uses: `trust` (a directory of .pub files, one .pub file, a public key
    object, a TrustStore, or a list of these); when None, $SARTOR_TRUST (a directory or file); None
    when neither is set."""
    if trust is None:
        value = os.environ.get(TRUST_ENV, "")
        if not value:
            return None
        store = trust_store(value)
        store.source = f"{TRUST_ENV}={value}"
        return store
    require_cryptography("a trust store")
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
    if isinstance(trust, TrustStore):
        return trust
    if isinstance(trust, Ed25519PublicKey):
        return TrustStore([trust], f"key {key_fingerprint(trust)}")
    if isinstance(trust, (str, os.PathLike)):
        path = Path(trust)
        if not str(trust):
            raise KeyFileError("the trust store path is empty")
        if path.is_dir():
            return TrustStore(_keys_in_directory(path), str(path))
        if not path.exists():
            raise KeyFileError(f"trust store not found: {path}")
        return TrustStore([read_public_key(path)], str(path))
    if isinstance(trust, Iterable) and not isinstance(trust, (bytes, dict)):
        stores = [trust_store(item) for item in trust]
        if not stores:
            raise KeyFileError("the trust store is an empty list: no engine could load")
        return TrustStore([k for s in stores for k in s.keys.values()], ", ".join(s.source for s in stores))
    raise KeyFileError(f"trust must be a directory, a .pub file or Ed25519 public keys, not {type(trust).__name__}")
