"""Signed engines (runtime/engine_signature.py, deploy/signing.py): keys, signing, and loads with and
without a trust store. Tampering is done as an attacker would: the payload edited and its SHA-256
checksum recomputed, so that only the signature can tell."""
from __future__ import annotations

import hashlib
import stat
from pathlib import Path

import numpy as np
import pytest
import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

import sartor
from sartor.deploy.signing import generate_key, read_private_key, sign_engine
from sartor.errors import (
    DeviceError,
    EngineFileError,
    KeyFileError,
    OutputPathError,
    UntrustedEngineError,
)
from sartor.runtime import kernel_cache
from sartor.runtime.engine_file import open_engine, pack, read_engine, sign, unpack
from sartor.runtime.engine_signature import (
    SIGNATURE_BLOCK_BYTES,
    TRUST_ENV,
    TrustStore,
    key_fingerprint,
    read_public_key,
    trust_store,
)

CHECKSUM = 32


@pytest.fixture
def keys(tmp_path) -> dict:
    """Two key pairs: `a` (the trusted one in most tests) and `b`."""
    made = {}
    for name in ("a", "b"):
        path = tmp_path / "keys" / name
        path.parent.mkdir(exist_ok=True)
        made[name] = (path, generate_key(path))
    return made


@pytest.fixture
def trusted(tmp_path, keys) -> Path:
    """A trust store directory holding key a's public key only."""
    directory = tmp_path / "trust"
    directory.mkdir()
    (directory / "a.pub").write_bytes(Path(f"{keys['a'][0]}.pub").read_bytes())
    return directory


@pytest.fixture(autouse=True)
def _no_trust_env(monkeypatch):
    monkeypatch.delenv(TRUST_ENV, raising=False)


def _split(data: bytes) -> tuple[bytes, bytes]:
    """(payload without checksum, signature block) of a signed engine file."""
    return data[:-SIGNATURE_BLOCK_BYTES - CHECKSUM], data[-SIGNATURE_BLOCK_BYTES:]


def _with_checksum(body: bytes) -> bytes:
    return body + hashlib.sha256(body).digest()


def _edit_weights_keep_signature(signed: bytes) -> bytes:
    """A weight changed and the checksum recomputed; the old signature block kept."""
    body, block = _split(signed)
    header, tensors = unpack(_with_checksum(body))
    name = next(k for k in tensors if k.startswith("w/"))
    tensors[name] = tensors[name] + 1
    return pack(header, tensors) + block


# ---- keys -------------------------------------------------------------------------------------

def test_keygen_writes_a_private_key_only_its_owner_reads(tmp_path, keys):
    path, fingerprint = keys["a"]
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    public = Path(f"{path}.pub")
    assert b"BEGIN PUBLIC KEY" in public.read_bytes() and b"BEGIN PRIVATE KEY" in path.read_bytes()
    private = read_private_key(path)
    assert key_fingerprint(private) == key_fingerprint(read_public_key(public)) == fingerprint
    assert fingerprint.startswith("ed25519:") and len(fingerprint) == len("ed25519:") + 32
    assert fingerprint != keys["b"][1]
    assert not list(path.parent.glob(".*.tmp")), "no temporary left"


def test_keygen_never_replaces_a_key_unless_forced(keys):
    path, fingerprint = keys["a"]
    with pytest.raises(OutputPathError, match="exists: a key is not replaced"):
        generate_key(path)
    assert key_fingerprint(read_private_key(path)) == fingerprint
    path.chmod(0o644)  # a replaced file keeps its mode in write_atomic; a private key must not
    assert generate_key(path, overwrite=True) != fingerprint
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


@pytest.mark.parametrize("content,fragment", [
    (None, "signing key not found"), (b"not a key", "is not an Ed25519 private key"),
    ("public", "that is the public key")])
def test_bad_signing_keys_are_refused_in_one_line(tmp_path, keys, content, fragment):
    path = tmp_path / "bad.key"
    if content == "public":
        path = Path(f"{keys['a'][0]}.pub")
    elif content is not None:
        path.write_bytes(content)
    with pytest.raises(KeyFileError, match=fragment) as info:
        read_private_key(path)
    assert "\n" not in str(info.value)


# ---- signing ----------------------------------------------------------------------------------

def test_signing_appends_a_block_and_leaves_the_payload(plan_copy, keys, tmp_path):
    original = plan_copy.read_bytes()
    out = tmp_path / "signed.plan"
    signed = sign_engine(plan_copy, keys["a"][0], out)
    assert signed.fingerprint == keys["a"][1] and signed.replaced is None
    data = out.read_bytes()
    assert data[:len(original)] == original and len(data) == len(original) + SIGNATURE_BLOCK_BYTES
    assert plan_copy.read_bytes() == original, "-o leaves the input as it was"
    engine = read_engine(out)
    assert engine.signature.fingerprint == keys["a"][1]
    assert engine.digest == hashlib.sha256(original[:-CHECKSUM]).hexdigest(), "the identity is the payload's"


def test_signing_again_replaces_the_signature(plan_copy, keys):
    unsigned = len(plan_copy.read_bytes())
    sign_engine(plan_copy, keys["a"][0])
    again = sign_engine(plan_copy, keys["b"][0])
    assert again.replaced == keys["a"][1] and again.fingerprint == keys["b"][1]
    assert read_engine(plan_copy).signature.fingerprint == keys["b"][1]
    assert len(plan_copy.read_bytes()) == unsigned + SIGNATURE_BLOCK_BYTES, "one block, not two"


def test_a_corrupted_engine_is_not_signed(plan_copy, keys):
    data = bytearray(plan_copy.read_bytes())
    data[len(data) // 2] ^= 1
    plan_copy.write_bytes(bytes(data))
    with pytest.raises(EngineFileError, match="checksum mismatch"):
        sign_engine(plan_copy, keys["a"][0])
    assert plan_copy.read_bytes() == bytes(data)


# ---- loading ----------------------------------------------------------------------------------

def test_a_signed_engine_loads_under_each_form_of_trust_store(plan_copy, keys, trusted, tiny_engine, images):
    sign_engine(plan_copy, keys["a"][0])
    public = read_public_key(f"{keys['a'][0]}.pub")
    for trust in (trusted, str(trusted / "a.pub"), public, [public, f"{keys['b'][0]}.pub"],
                  TrustStore([public], "test")):
        engine = sartor.load(plan_copy, device="cpu", trust=trust)
        assert engine.signed_by == keys["a"][1]
    np.testing.assert_array_equal(engine.context().run({"images": images})["logits"],
                                  tiny_engine.context().run({"images": images})["logits"])


def test_without_a_trust_store_unsigned_and_signed_engines_load(plan_copy, keys):
    assert sartor.load(plan_copy, device="cpu").signed_by is None
    sign_engine(plan_copy, keys["b"][0])
    assert sartor.load(plan_copy, device="cpu").signed_by == keys["b"][1]


def test_an_unsigned_engine_is_refused_under_a_trust_store(plan_copy, trusted):
    with pytest.raises(UntrustedEngineError) as info:
        sartor.load(plan_copy, device="cpu", trust=trusted)
    message = str(info.value)
    assert "is not signed" in message and str(trusted) in message and "1 key(s)" in message
    assert "sartor sign" in message and "\n" not in message


def test_an_engine_signed_by_another_key_is_refused(plan_copy, keys, trusted):
    sign_engine(plan_copy, keys["b"][0])
    with pytest.raises(UntrustedEngineError, match=f"signed by key {keys['b'][1]}, which is not in the trust store"):
        sartor.load(plan_copy, device="cpu", trust=trusted)


def test_edited_weights_with_a_recomputed_checksum_are_refused(plan_copy, keys, trusted):
    sign_engine(plan_copy, keys["a"][0])
    plan_copy.write_bytes(_edit_weights_keep_signature(plan_copy.read_bytes()))
    for trust in (trusted, None):  # a signature that does not verify is refused with or without a store
        with pytest.raises(EngineFileError, match=f"signature by key {keys['a'][1]} that does not verify") as info:
            sartor.load(plan_copy, device="cpu", trust=trust)
        assert "\n" not in str(info.value)


def test_edited_weights_with_the_signature_dropped_are_refused_under_a_trust_store(plan_copy, keys, trusted):
    sign_engine(plan_copy, keys["a"][0])
    edited = _edit_weights_keep_signature(plan_copy.read_bytes())[:-SIGNATURE_BLOCK_BYTES]
    plan_copy.write_bytes(edited)
    with pytest.raises(UntrustedEngineError, match="is not signed"):
        sartor.load(plan_copy, device="cpu", trust=trusted)
    assert sartor.load(plan_copy, device="cpu").signed_by is None, "without a store it is an unsigned engine"


def test_edited_kernels_are_refused(plan_copy, keys, trusted):
    """A kernel file's bytes (here: a stand-in cubin) changed after signing, checksum recomputed."""
    header, tensors = unpack(plan_copy.read_bytes())
    kernels = {"__kernels__/" + "A" * 52 + "/_k.cubin": torch.arange(64, dtype=torch.uint8)}
    plan_copy.write_bytes(pack(header, {**tensors, **kernels}))
    sign_engine(plan_copy, keys["a"][0])
    body, block = _split(plan_copy.read_bytes())
    at = body.index(bytes(range(16, 32)))
    edited = bytearray(body)
    edited[at] ^= 0xFF
    plan_copy.write_bytes(_with_checksum(bytes(edited)) + block)
    with pytest.raises(EngineFileError, match="does not verify"):
        sartor.load(plan_copy, device="cpu", trust=trusted)


def test_a_wrong_signature_is_refused(plan_copy, keys):
    sign_engine(plan_copy, keys["a"][0])
    data = bytearray(plan_copy.read_bytes())
    data[-1] ^= 0x01  # inside the signature
    plan_copy.write_bytes(bytes(data))
    with pytest.raises(EngineFileError, match="does not verify"):
        sartor.load(plan_copy, device="cpu")


def test_a_signature_of_another_engine_is_refused(plan_copy, tiny_onnx, keys, trusted, tmp_path):
    """A valid block copied from another signed engine: it verifies for that engine only."""
    from conftest import MAX_SHAPES, MIN_SHAPES
    other = tmp_path / "other.plan"
    sartor.build(tiny_onnx, other, device="cpu", min_shapes=MIN_SHAPES, opt_shapes=MIN_SHAPES, max_shapes=MAX_SHAPES,
                 sign_key=keys["a"][0])
    assert sartor.load(other, device="cpu", trust=trusted).signed_by == keys["a"][1], "sartor.build signs"
    plan_copy.write_bytes(plan_copy.read_bytes() + other.read_bytes()[-SIGNATURE_BLOCK_BYTES:])
    with pytest.raises(EngineFileError, match="does not verify"):
        sartor.load(plan_copy, device="cpu", trust=trusted)


@pytest.mark.parametrize("cut", [1, SIGNATURE_BLOCK_BYTES - 8])
def test_a_cut_signature_block_is_refused_in_one_line(plan_copy, keys, cut):
    sign_engine(plan_copy, keys["a"][0])
    plan_copy.write_bytes(plan_copy.read_bytes()[:-cut])
    with pytest.raises(EngineFileError, match=f"signature block that is truncated \\({SIGNATURE_BLOCK_BYTES - cut} of"):
        sartor.load(plan_copy, device="cpu")


def test_trailing_bytes_are_not_a_signature(plan_copy):
    plan_copy.write_bytes(plan_copy.read_bytes() + b"\x00" * SIGNATURE_BLOCK_BYTES)
    with pytest.raises(EngineFileError, match=f"{SIGNATURE_BLOCK_BYTES} unexpected trailing bytes"):
        sartor.load(plan_copy, device="cpu")


def test_sign_refuses_trailing_bytes_rather_than_dropping_them(plan_copy):
    data = plan_copy.read_bytes() + b"junk"
    with pytest.raises(EngineFileError, match="unexpected trailing bytes"):
        sign(data, Ed25519PrivateKey.generate())


def test_untrusted_engines_are_refused_before_the_device_or_kernels(plan_copy, trusted, monkeypatch, tmp_path):
    """A CUDA engine carrying kernels, unsigned, on this machine (no GPU needed): the trust store
    refuses it first, so no fingerprint check, device or kernel installation is reached."""
    monkeypatch.setenv(kernel_cache.CACHE_ENV, str(tmp_path / "private"))
    header, tensors = unpack(plan_copy.read_bytes())
    header["fingerprint"] = dict(header["fingerprint"], kind="cuda", gpu="NVIDIA H200")
    header["kernels"] = {"embedded": True, "scheme": "triton-file-cache/1", "entries": []}
    plan_copy.write_bytes(pack(header, tensors))
    with pytest.raises(UntrustedEngineError):
        sartor.load(plan_copy, trust=trusted)
    assert not (tmp_path / "private").exists()
    if not torch.cuda.is_available():  # the check above can fail: without a store, the device is next
        with pytest.raises(DeviceError):
            sartor.load(plan_copy)


# ---- the trust store --------------------------------------------------------------------------

def test_sartor_trust_is_the_default_store(plan_copy, keys, trusted, monkeypatch):
    monkeypatch.setenv(TRUST_ENV, str(trusted))
    with pytest.raises(UntrustedEngineError, match=f"{TRUST_ENV}={trusted}"):
        sartor.load(plan_copy, device="cpu")
    sign_engine(plan_copy, keys["a"][0])
    assert sartor.load(plan_copy, device="cpu").signed_by == keys["a"][1]
    monkeypatch.setenv(TRUST_ENV, "")
    assert trust_store(None) is None, "an empty SARTOR_TRUST sets no store"


def test_openssh_public_keys_are_read(keys, tmp_path):
    from cryptography.hazmat.primitives import serialization
    public = read_private_key(keys["a"][0]).public_key()
    line = public.public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
    (tmp_path / "ssh.pub").write_bytes(line + b" someone@host\n")
    assert key_fingerprint(read_public_key(tmp_path / "ssh.pub")) == keys["a"][1]


@pytest.mark.parametrize("case,fragment", [
    ("missing", "trust store not found"), ("empty dir", "holds no .pub public key files"),
    ("not a key", "is not an Ed25519 public key"), ("private key", "is not an Ed25519 public key"),
    ("empty list", "empty list"), ("number", "not int"), ("empty path", "path is empty")])
def test_bad_trust_stores_are_refused_in_one_line(tmp_path, keys, case, fragment):
    spec = {"missing": tmp_path / "none", "empty dir": tmp_path, "not a key": tmp_path / "x.pub",
            "private key": keys["a"][0], "empty list": [], "number": 3, "empty path": ""}[case]
    if case == "not a key":
        (tmp_path / "x.pub").write_text("hello")
    with pytest.raises(KeyFileError, match=fragment) as info:
        trust_store(spec)
    assert "\n" not in str(info.value)


def test_a_directory_store_reads_only_pub_files(tmp_path, keys):
    directory = tmp_path / "store"
    directory.mkdir()
    for name in ("a", "b"):
        (directory / f"{name}.pub").write_bytes(Path(f"{keys[name][0]}.pub").read_bytes())
    (directory / "README").write_text("not a key")
    store = trust_store(directory)
    assert store.fingerprints == sorted([keys["a"][1], keys["b"][1]])


def test_open_engine_reports_the_checksum_and_signature(plan_copy, keys):
    before = open_engine(plan_copy.read_bytes())
    assert before.signature is None and len(before.checksum) == CHECKSUM
    sign_engine(plan_copy, keys["a"][0])
    after = open_engine(plan_copy.read_bytes())
    assert after.checksum == before.checksum and after.signature.fingerprint == keys["a"][1]


_WITHOUT_CRYPTOGRAPHY = r"""
import sys
sys.modules["cryptography"] = None  # as on a device where the package is not installed
import sartor
from sartor.errors import SartorError
plan, signed, trust = sys.argv[1:4]
sartor.load(plan, device="cpu")
print("unsigned loads")
for what, kwargs in (("signed", {"path": signed}), ("store", {"path": plan, "trust": trust})):
    try:
        sartor.load(kwargs.pop("path"), device="cpu", **kwargs)
    except SartorError as exc:
        print(what, "refused:", exc)
"""


def test_without_the_cryptography_package_unsigned_engines_load_and_signatures_say_what_is_missing(
        plan_copy, keys, trusted, tmp_path):
    import subprocess
    import sys
    signed = tmp_path / "signed.plan"
    sign_engine(plan_copy, read_private_key(keys["a"][0]), signed)
    run = subprocess.run([sys.executable, "-c", _WITHOUT_CRYPTOGRAPHY, str(plan_copy), str(signed), str(trusted)],
                         capture_output=True, text=True, timeout=120, check=False,
                         env={**__import__("os").environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])})
    assert run.returncode == 0, run.stderr[-2000:]
    lines = run.stdout.strip().splitlines()
    assert lines[0] == "unsigned loads"
    assert lines[1].startswith("signed refused:") and "needs the cryptography package" in lines[1]
    assert lines[2].startswith("store refused:") and "needs the cryptography package" in lines[2]
