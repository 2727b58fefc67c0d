"""`sartor deploy`: the release layout, preflight (a bad release is never swapped in), the trust store,
the health watch against a running server and its rollback, leftovers of a killed deploy, and which
release serves when `current` does not run on this machine (known good, newest, rebuild, one line)."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
from release_helpers import build_bundle

import sartor
from sartor.deploy.golden import read_npz
from sartor.deploy.manifest import write_manifest
from sartor.deploy.releases import (
    CURRENT,
    KNOWN_GOOD,
    ReleaseError,
    choose_release,
    current_id,
    fingerprint_key,
    release_dir,
    swap_link,
)
from sartor.deploy.update import DeployOptions, check_current, deploy
from sartor.runtime.engine_file import npz_bytes
from sartor.runtime.fingerprint import device_fingerprint, parse_device


@pytest.fixture(scope="module")
def builds(tmp_path_factory) -> dict:
    """Two versions of the tiny classifier (other weights), each an engine with its bundle beside it."""
    work = tmp_path_factory.mktemp("releases")
    return {"v1": build_bundle(work, "v1", seed=0), "v2": build_bundle(work, "v2", seed=1)}


def fast(**kwargs) -> DeployOptions:
    return DeployOptions(takt_runs=3, **kwargs)


def test_a_deploy_makes_a_release_and_swaps_current(builds, tmp_path):
    model = tmp_path / "tiny"
    first = deploy(builds["v1"][1], tmp_path, "tiny", fast())  # a bundle: its engine is found beside it
    assert first.passed and first.release == 1 and first.previous is None and not first.rebuilt
    second = deploy(builds["v2"][0], tmp_path, "tiny", fast())  # a bare engine
    assert second.passed and second.release == 2 and second.previous == 1
    assert os.readlink(model / CURRENT) == "releases/2" and current_id(model) == 2
    assert (release_dir(model, 1) / "bundle" / "manifest.json").is_file()
    assert (release_dir(model, 2) / "model.plan").read_bytes() == builds["v2"][0].read_bytes()
    preflight = json.loads((release_dir(model, 1) / "preflight.json").read_text())
    names = [c["name"] for c in preflight["checks"]]
    assert preflight["passed"] and names == ["bundle", "signature", "fingerprint", "load", "warm-up", "golden", "takt"]
    assert preflight["takt"]["p50_ms"] > 0 and preflight["takt"]["batch"] == 2
    bare = json.loads((release_dir(model, 2) / "preflight.json").read_text())
    assert "no bundle, so no reference outputs" in bare["checks"][-2]["detail"]
    release = json.loads((release_dir(model, 2) / "release.json").read_text())
    assert release["fingerprint"]["kind"] == "cpu" and release["release"] == 2
    key = fingerprint_key(device_fingerprint(parse_device("cpu")))
    assert os.readlink(model / KNOWN_GOOD / key) == "../releases/2"
    assert choose_release(model).release == 2 and choose_release(model).note is None


def _tampered_golden(bundle: Path, into: Path) -> Path:
    """The bundle with its stored golden outputs changed and its manifest rewritten (the manifest
    proves a bundle whole, not who wrote it): a release whose golden check must fail."""
    copy = into / "tampered.bundle"
    shutil.copytree(bundle, copy)
    outputs = read_npz(copy / "golden" / "engine_outputs.npz")
    (copy / "golden" / "engine_outputs.npz").write_bytes(npz_bytes({k: -v + 1.0 for k, v in outputs.items()}))
    write_manifest(copy)
    return copy


def test_a_release_failing_its_golden_outputs_is_never_swapped_in(builds, tmp_path, cli):
    root = tmp_path / "root"
    root.mkdir()
    assert deploy(builds["v1"][0], root, "tiny", fast()).passed
    bad = _tampered_golden(builds["v2"][1], tmp_path)
    result = cli("deploy", builds["v2"][0], "--bundle", bad, "--root", root, "--name", "tiny", "--takt-runs", "2")
    assert result.code == 1, result
    fail = [line for line in result.out.splitlines() if line.startswith("FAIL")]
    assert len(fail) == 1 and "release 2 failed preflight (golden:" in fail[0] and "release 1 stays current" in fail[0]
    model = root / "tiny"
    assert current_id(model) == 1 and not release_dir(model, 2).exists()
    assert [p.name for p in (model / "releases").iterdir()] == ["1"]  # no staging directory left


def test_an_engine_that_is_not_the_bundles_fails_preflight(builds, tmp_path):
    report = deploy(builds["v2"][0], tmp_path, "tiny", fast(), bundle=builds["v1"][1])
    assert not report.passed and not report.swapped and report.preflight.failure.name == "bundle"
    assert "is not the engine bundle" in report.preflight.failure.detail
    assert not (tmp_path / "tiny" / CURRENT).exists()


def test_with_a_trust_store_only_signed_engines_pass_preflight(builds, tmp_path):
    from sartor.deploy.signing import generate_key, sign_engine
    keys = tmp_path / "keys"
    keys.mkdir()
    generate_key(tmp_path / "signer")
    shutil.copy(tmp_path / "signer.pub", keys / "signer.pub")
    unsigned = deploy(builds["v1"][0], tmp_path, "tiny", fast(trust=str(keys)))
    assert not unsigned.passed and unsigned.preflight.failure.name == "signature"
    signed = tmp_path / "signed.plan"
    sign_engine(builds["v1"][0], tmp_path / "signer", signed)
    report = deploy(signed, tmp_path, "tiny", fast(trust=str(keys)), bundle=builds["v1"][1])
    assert report.passed, report.preflight.failure  # the bundle's engine, with a signature block added
    assert "a key of the trust store" in report.preflight.checks[1].detail


def test_leftovers_of_a_killed_deploy_are_removed(builds, tmp_path):
    assert deploy(builds["v1"][0], tmp_path, "tiny", fast()).passed
    model = tmp_path / "tiny"
    (model / "releases" / ".staging-2-999").mkdir()
    os.symlink("releases/1", model / ".current.999.tmp")
    report = deploy(builds["v2"][0], tmp_path, "tiny", fast())
    assert report.passed and report.release == 2 and len(report.leftovers) == 2
    assert sorted(p.name for p in model.iterdir()) == [".deploy.lock", "current", "known-good", "releases"]


def test_swap_link_replaces_the_link_in_one_rename(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    swap_link(tmp_path / "link", "a")
    swap_link(tmp_path / "link", "b")
    assert os.readlink(tmp_path / "link") == "b" and sorted(p.name for p in tmp_path.iterdir()) == ["a", "b", "link"]


def _alien(model: Path, release: int) -> None:
    """Make a release's recorded fingerprint another machine's (a CPU of another architecture)."""
    path = release_dir(model, release) / "release.json"
    record = json.loads(path.read_text())
    record["fingerprint"]["arch"] = "riscv64"
    path.write_text(json.dumps(record))


def test_when_current_does_not_run_here_another_release_or_a_rebuild_serves(builds, tmp_path):
    model = tmp_path / "tiny"
    assert deploy(builds["v1"][1], tmp_path, "tiny", fast()).passed
    assert deploy(builds["v2"][1], tmp_path, "tiny", fast()).passed
    _alien(model, 2)
    choice = choose_release(model)
    assert choice.release == 1 and "current release 2 was built for" in choice.note
    assert "serving release 1 (the newest release that runs here)" in choice.note
    _alien(model, 1)
    with pytest.raises(ReleaseError) as info:
        choose_release(model)
    message = str(info.value)
    assert "riscv64" in message and "this machine is [cpu" in message and "--allow-rebuild" in message
    assert "\n" not in message
    with pytest.raises(ReleaseError):
        check_current(tmp_path, "tiny", fast())  # a rebuild is not allowed
    rebuilt = check_current(tmp_path, "tiny", fast(allow_rebuild=True))
    assert rebuilt.release == 3 and rebuilt.deploy.rebuilt and current_id(model) == 3
    assert choose_release(model).release == 3
    engine = sartor.load(release_dir(model, 3) / "model.plan", device="cpu")
    feeds = read_npz(release_dir(model, 3) / "bundle" / "golden" / "inputs.npz")
    stored = read_npz(release_dir(model, 3) / "bundle" / "golden" / "engine_outputs.npz")
    np.testing.assert_array_equal(engine.context().run(feeds)["logits"], stored["logits"])


def test_check_points_current_at_the_release_that_runs_here(builds, tmp_path, cli):
    model = tmp_path / "tiny"
    assert deploy(builds["v1"][0], tmp_path, "tiny", fast()).passed
    assert deploy(builds["v2"][0], tmp_path, "tiny", fast()).passed
    result = cli("deploy", "--check", "--root", tmp_path, "--name", "tiny")
    assert result.code == 0 and "current release 2 runs on this machine" in result.out
    _alien(model, 2)
    result = cli("deploy", "--check", "--root", tmp_path, "--name", "tiny")
    assert result.code == 0 and "serving release 1" in " ".join(result.out.split()) and current_id(model) == 1


def test_the_watch_rolls_back_a_release_the_server_does_not_serve(builds, tmp_path):
    from serve_helpers import running
    model = tmp_path / "tiny"
    assert deploy(builds["v1"][0], tmp_path, "tiny", fast()).passed
    with running(tmp_path, poll_interval=None) as server:  # never polls: release 2 is never served
        report = deploy(builds["v2"][0], tmp_path, "tiny", fast(server=server.http_url, watch_seconds=1.0))
    assert report.swapped and report.rolled_back and not report.passed and not report.known_good
    assert "did not serve tiny version 2" in report.watch.detail
    assert current_id(model) == 1 and (release_dir(model, 2) / "rolled-back.json").is_file()
    key = fingerprint_key(device_fingerprint(parse_device("cpu")))
    assert os.readlink(model / KNOWN_GOOD / key) == "../releases/1"
    with running(tmp_path, poll_interval=0.1) as server:
        report = deploy(builds["v2"][0], tmp_path, "tiny", fast(server=server.http_url, watch_seconds=1.5))
        assert report.passed and report.release == 3 and report.known_good, report.watch
        assert server.repository.served("tiny").version == "3"


CLI_ERRORS = [
    (["deploy", "{missing}", "--root", "{root}", "--name", "tiny"], "not found"),
    (["deploy", "{engine}", "--root", "{missing}", "--name", "tiny"], "is not a directory"),
    (["deploy", "{engine}", "--root", "{root}", "--name", ".hidden"], "is not a model name"),
    (["deploy", "{engine}", "--root", "{root}", "--name", "tiny", "--watch", "5"], "--watch needs --server"),
    (["deploy", "{engine}", "--root", "{root}", "--name", "tiny", "--check"], "--check deploys nothing"),
    (["deploy", "--root", "{root}", "--name", "tiny"], "give ENGINE_OR_BUNDLE"),
    (["deploy", "--check", "--root", "{root}", "--name", "tiny"], "is not a deployed model"),
    (["deploy", "{engine}", "--root", "{root}", "--name", "tiny", "--bundle", "{engine}"], "is not a bundle"),
    (["deploy", "{engine}", "--root", "{root}", "--name", "tiny", "--min-cosine", "2"], "--min-cosine 2 must be"),
]


@pytest.mark.parametrize("argv, fragment", CLI_ERRORS, ids=[e[1] for e in CLI_ERRORS])
def test_deploy_usage_errors_are_one_line(builds, tmp_path, cli, argv, fragment):
    values = {"missing": tmp_path / "missing", "root": tmp_path, "engine": builds["v1"][0]}
    result = cli(*[a.format(**values) for a in argv])
    assert result.code == 2, result
    assert len(result.error_lines) == 1 and fragment in result.error_lines[0], result
