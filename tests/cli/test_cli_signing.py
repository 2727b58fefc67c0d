"""`sartor keygen`, `sartor sign`, `sartor build --sign-key` and `--trust` on the subcommands that
load engines: exit 0 when the engine is signed by a trusted key, 2 with one line otherwise."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import MAX_SHAPES, MIN_SHAPES, OPT_SHAPES, assert_cli_error, shape_flag
from serve_helpers import BATCHING, add_model

from sartor.runtime.engine_file import read_engine, read_engine_file
from sartor.runtime.engine_signature import TRUST_ENV


@pytest.fixture(autouse=True)
def _no_trust_env(monkeypatch):
    monkeypatch.delenv(TRUST_ENV, raising=False)


@pytest.fixture
def key(cli, tmp_path) -> tuple[Path, str]:
    """A key pair made by `sartor keygen`, and its fingerprint as printed."""
    path = tmp_path / "keys" / "signer"
    path.parent.mkdir()
    result = cli("keygen", "-o", path)
    assert result.code == 0, result
    fingerprint = result.out.split("key fingerprint ")[1].split()[0]
    return path, fingerprint


@pytest.fixture
def trust_dir(key, tmp_path) -> Path:
    directory = tmp_path / "trust"
    directory.mkdir()
    (directory / "signer.pub").write_bytes(Path(f"{key[0]}.pub").read_bytes())
    return directory


def test_keygen_writes_the_pair_and_refuses_to_replace_it(cli, key):
    path, fingerprint = key
    assert fingerprint.startswith("ed25519:") and Path(f"{path}.pub").is_file()
    assert_cli_error(cli("keygen", "-o", path), "exists: a key is not replaced", "--force")
    replaced = cli("keygen", "-o", path, "--force")
    assert replaced.code == 0 and fingerprint not in replaced.out, replaced


def test_sign_then_run_with_trust(cli, key, trust_dir, plan_copy, tmp_path):
    assert_cli_error(cli("run", plan_copy, "--trust", trust_dir), "is not signed", str(trust_dir))
    out = tmp_path / "signed.plan"
    result = cli("sign", plan_copy, "--key", key[0], "-o", out)
    assert result.code == 0 and f"signed {out} with key {key[1]}" in result.out, result
    assert read_engine(plan_copy).signature is None, "-o leaves the input unsigned"
    for argv in (["run", out], ["bench", out, "--iterations", "1", "--warmup", "0"], ["inspect", out]):
        ran = cli(*argv, "--trust", trust_dir)
        assert ran.code == 0, (argv, ran)
    in_place = cli("sign", plan_copy, "--key", key[0])
    assert in_place.code == 0 and read_engine(plan_copy).signature.fingerprint == key[1], in_place


def test_every_engine_loading_subcommand_refuses_an_untrusted_engine(cli, trust_dir, plan_copy, tiny_onnx, tmp_path):
    for argv in (["run", plan_copy], ["bench", plan_copy, "--iterations", "1"], ["inspect", plan_copy],
                 ["inspect", plan_copy, "--json"], ["compare", tiny_onnx, plan_copy],
                 ["validate", plan_copy, "--data", tmp_path]):
        result = cli(*argv, "--trust", trust_dir)
        assert_cli_error(result, "is not signed")
        assert result.out == "", argv


def test_sartor_trust_applies_to_the_command_line(cli, key, trust_dir, plan_copy, monkeypatch):
    monkeypatch.setenv(TRUST_ENV, str(trust_dir))
    assert_cli_error(cli("run", plan_copy), "is not signed", f"{TRUST_ENV}={trust_dir}")
    assert cli("sign", plan_copy, "--key", key[0]).code == 0
    assert cli("run", plan_copy).code == 0


def test_a_key_not_in_the_store_is_named(cli, trust_dir, plan_copy, tmp_path):
    other = tmp_path / "other"
    assert cli("keygen", "-o", other).code == 0
    assert cli("sign", plan_copy, "--key", other).code == 0
    line = assert_cli_error(cli("run", plan_copy, "--trust", trust_dir), "which is not in the trust store")
    assert "ed25519:" in line


@pytest.mark.parametrize("case,fragment", [("missing key", "signing key not found"),
                                           ("public key", "that is the public key"),
                                           ("missing engine", "engine file not found")])
def test_sign_errors_exit_2_in_one_line(cli, key, plan_copy, tmp_path, case, fragment):
    engine = tmp_path / "none.plan" if case == "missing engine" else plan_copy
    signing_key = {"missing key": tmp_path / "none.key", "public key": f"{key[0]}.pub"}.get(case, key[0])
    before = plan_copy.read_bytes()
    assert_cli_error(cli("sign", engine, "--key", signing_key), fragment)
    assert plan_copy.read_bytes() == before


@pytest.mark.parametrize("store,fragment", [("missing", "trust store not found"), ("empty", "holds no .pub")])
def test_bad_trust_stores_exit_2_in_one_line(cli, plan_copy, tmp_path, store, fragment):
    path = tmp_path / store
    if store == "empty":
        path.mkdir()
    assert_cli_error(cli("run", plan_copy, "--trust", path), fragment)


def test_inspect_shows_the_signer(cli, key, plan_copy):
    unsigned = cli("inspect", plan_copy, "--json")
    assert json.loads(unsigned.out)["signature"]["signed"] is False
    assert "not signed" in cli("inspect", plan_copy).out
    cli("sign", plan_copy, "--key", key[0])
    shown = cli("inspect", plan_copy)
    assert shown.code == 0 and f"signed by key {key[1]}" in shown.out, shown
    info = json.loads(cli("inspect", plan_copy, "--json").out)["signature"]
    assert info["signed"] is True and info["fingerprint"] == key[1] and len(info["checksum"]) == 64


def test_build_sign_key(cli, key, trust_dir, tiny_onnx, tmp_path):
    shapes = ["--min-shapes", shape_flag(MIN_SHAPES), "--opt-shapes", shape_flag(OPT_SHAPES),
              "--max-shapes", shape_flag(MAX_SHAPES)]
    out = tmp_path / "built.plan"
    result = cli("build", tiny_onnx, "-o", out, "--device", "cpu", *shapes, "--sign-key", key[0])
    assert result.code == 0, result
    assert read_engine(out).signature.fingerprint == key[1]
    assert "sign_key" not in read_engine_file(out)[0]["build_config"], "the key's path is not in the engine"
    assert cli("run", out, "--trust", trust_dir).code == 0
    missing = tmp_path / "never.plan"
    assert_cli_error(cli("build", tiny_onnx, "-o", missing, "--device", "cpu", *shapes, "--sign-key",
                         tmp_path / "none.key"), "signing key not found")
    assert not missing.exists(), "refused before building"


def test_serve_trust(cli, key, trust_dir, plan_copy, tmp_path):
    root = tmp_path / "repo"
    add_model(root, "tiny", plan_copy, BATCHING)
    refused = cli("serve", "--model-repository", root, "--dry-run", "--trust", trust_dir)
    assert refused.code == 1 and "UNAVAILABLE" in refused.out and "not signed" in refused.out, refused
    assert cli("sign", root / "tiny" / "1" / "model.plan", "--key", key[0]).code == 0
    served = cli("serve", "--model-repository", root, "--dry-run", "--trust", trust_dir)
    assert served.code == 0 and "READY" in served.out, served
    assert_cli_error(cli("serve", "--model-repository", root, "--dry-run", "--trust", tmp_path / "none"),
                     "trust store not found")
