"""`sartor serve` over a release root (`sartor deploy`'s layout): the current release served, a
release that does not run here replaced by one that does, version_policy refused there; and, in
Triton's layout, version_policy honoured (latest 1, one specific version) or refused, and config
fields that serve does not act on refused rather than ignored."""
from __future__ import annotations

import json

import pytest
from release_helpers import build_bundle
from serve_helpers import BATCHING, add_model, running

from sartor.deploy.releases import release_dir
from sartor.deploy.update import DeployOptions, deploy


@pytest.fixture(scope="module")
def builds(tmp_path_factory) -> dict:
    work = tmp_path_factory.mktemp("root_builds")
    return {"v1": build_bundle(work, "v1", seed=0)[0], "v2": build_bundle(work, "v2", seed=1)[0]}


def _index(server) -> dict:
    return {row["name"]: row for row in server.index()}


def test_a_release_root_serves_current_or_the_release_that_runs_here(builds, tmp_path):
    for plan in (builds["v1"], builds["v2"]):
        assert deploy(plan, tmp_path, "tiny", DeployOptions(takt_runs=2)).passed
    add_model(tmp_path, "triton", builds["v1"], BATCHING)  # both layouts in one repository
    with running(tmp_path) as server:
        index = _index(server)
        assert index["tiny"]["version"] == "2" and index["tiny"]["state"] == "READY"
        assert index["triton"]["version"] == "1"
    path = release_dir(tmp_path / "tiny", 2) / "release.json"
    record = json.loads(path.read_text())
    record["fingerprint"]["arch"] = "riscv64"  # release 2 now claims another machine's CPU
    path.write_text(json.dumps(record))
    with running(tmp_path) as server:
        assert _index(server)["tiny"]["version"] == "1"
    record["fingerprint"]["kind"] = "cuda"
    for release in (1, 2):
        (release_dir(tmp_path / "tiny", release) / "release.json").write_text(json.dumps(record))
    with running(tmp_path) as server:
        row = _index(server)["tiny"]
        assert row["state"] == "UNAVAILABLE" and "no other release runs here" in row["reason"]
    (tmp_path / "tiny" / "config.pbtxt").write_text("version_policy { latest { num_versions: 1 } }\n")
    with running(tmp_path) as server:
        assert "version_policy does not apply to a release root" in _index(server)["tiny"]["reason"]


POLICIES = [
    ("", "2"),
    ("version_policy { latest { num_versions: 1 } }", "2"),
    ("version_policy { specific { versions: [1] } }", "1"),
]
REFUSED = [
    ("version_policy { latest { num_versions: 2 } }", "version_policy latest { num_versions: 2 } serves several"),
    ("version_policy { all { } }", "version_policy all { } serves several versions"),
    ("version_policy { specific { versions: [1, 2] } }", "specific { versions: [1, 2] } serves several"),
    ("version_policy { specific { versions: [7] } }", "no version directory that its version_policy names"),
    ("sequence_batching { }", "sets sequence_batching, which sartor serve does not act on"),
    ("dynamic_batching { priority_levels: 2 }", "sets dynamic_batching.priority_levels, which"),
    ("dynamic_batching { default_queue_policy { timeout_action: DELAY } }", "default_queue_policy.timeout_action"),
    ("model_warmup [{ name: \"w\" }]", "sets model_warmup"),
    ('parameters { key: "colour" value { string_value: "red" } }', "sets parameters['colour']"),
    ('input [{ name: "images" data_type: TYPE_FP32 dims: [3, 8, 8] }]', "has dims [3, 8, 8] in the config but the"),
]


@pytest.mark.parametrize("config, served", POLICIES, ids=["none", "latest-1", "specific-1"])
def test_version_policy_chooses_the_served_version(builds, tmp_path, config, served):
    add_model(tmp_path, "tiny", builds["v1"], BATCHING + config, version=1)
    add_model(tmp_path, "tiny", builds["v2"], None, version=2)
    with running(tmp_path) as server:
        row = _index(server)["tiny"]
        assert row["state"] == "READY" and row["version"] == served


@pytest.mark.parametrize("config, fragment", REFUSED, ids=[r[0].split("{")[0].strip() + str(i) for i, r in
                                                            enumerate(REFUSED)])
def test_config_fields_serve_cannot_honour_are_refused(builds, tmp_path, config, fragment):
    add_model(tmp_path, "tiny", builds["v1"], "max_batch_size: 4\n" + config, version=1)
    add_model(tmp_path, "tiny", builds["v2"], None, version=2)
    with running(tmp_path) as server:
        rows = [r for r in server.index() if r["name"] == "tiny"]
        assert all(r["state"] == "UNAVAILABLE" for r in rows)
        reason = " ".join(r["reason"] for r in rows)
        assert fragment in reason and "\n" not in reason, reason
