"""Real `sartor deploy` processes: one killed with SIGKILL at each of its steps leaves `current`
naming a whole release (the old one or the new one) that a running server keeps serving; and a good
release swapped in under load, with a real `sartor serve` and clients looping through the swap,
drops no request."""
from __future__ import annotations

import os
import signal
import threading

import numpy as np
import pytest
from release_helpers import (
    HOST,
    build_bundle,
    sartor_process,
    start_server,
    stop,
    wait_for_line,
)
from serve_helpers import images, running, wait_for

import sartor
from sartor.deploy.releases import (
    ENGINE_FILE,
    PAUSE_ENVIRONMENT,
    current_id,
    release_dir,
)
from sartor.deploy.update import PAUSE_STEPS, DeployOptions, deploy

# (step, whether `current` names the new release once the deploy is killed there)
STEPS = [("staged", False), ("preflighted", False), ("published", False), ("swap-link-made", False),
         ("swapped", True), ("rollback-link-made", True), ("rolled-back", False)]


@pytest.fixture(scope="module")
def builds(tmp_path_factory) -> dict:
    work = tmp_path_factory.mktemp("kills")
    return {"v1": build_bundle(work, "v1", seed=0), "v2": build_bundle(work, "v2", seed=1)}


def test_the_steps_are_the_ones_the_deploy_pauses_at():
    assert [step for step, _ in STEPS] == list(PAUSE_STEPS)


def _infer(server) -> np.ndarray:
    import tritonclient.http as httpclient
    client = httpclient.InferenceServerClient(server.http_url, network_timeout=30.0)
    try:
        tensor = httpclient.InferInput("images", [1, 3, 16, 16], "FP32")
        tensor.set_data_from_numpy(images(1, 0))
        return client.infer("tiny", [tensor]).as_numpy("logits")
    finally:
        client.close()


def test_a_deploy_killed_at_each_step_leaves_a_serving_model(builds, tmp_path):
    model = tmp_path / "tiny"
    assert deploy(builds["v1"][0], tmp_path, "tiny", DeployOptions(takt_runs=2)).passed
    # The served one polls the root; the watched one (a real `sartor serve`) never does, so a watch against
    # it fails and rolls back.
    unwatched, port = start_server(tmp_path, "--poll-interval", "0")
    with running(tmp_path, poll_interval=0.1) as server:
        for step, swapped in STEPS:
            before = current_id(model)
            engine = builds["v2"][0] if before == 1 or before % 2 else builds["v1"][0]
            watch = ["--server", f"{HOST}:{port}", "--watch", "2"] if step.startswith("roll") else []
            process = sartor_process("deploy", engine, "--root", tmp_path, "--name", "tiny", "--takt-runs", 2, *watch,
                                     env={PAUSE_ENVIRONMENT: step})
            try:
                wait_for_line(process.stderr, f"paused at {step}", process)
                process.send_signal(signal.SIGKILL)
                assert process.wait(30) == -signal.SIGKILL
            finally:
                stop(process)
            now = current_id(model)  # a link to a whole release, never a broken one
            assert (release_dir(model, now) / ENGINE_FILE).is_file()
            assert (now != before) == swapped, (step, before, now)
            wait_for(lambda now=now: server.repository.is_ready("tiny", str(now)), timeout=60,
                     what=f"release {now} served")
            expected = sartor.load(release_dir(model, now) / ENGINE_FILE, device="cpu").context().run(
                {"images": images(1, 0)})["logits"]
            np.testing.assert_allclose(_infer(server), expected, rtol=1e-5, atol=1e-6)
    stop(unwatched)
    # the next deploy clears what the killed ones left, and works
    report = deploy(builds["v2"][0], tmp_path, "tiny", DeployOptions(takt_runs=2))
    assert report.passed
    assert not [p for p in (model / "releases").iterdir() if p.name.startswith(".")]


def test_a_good_release_swaps_under_load_without_a_dropped_request(builds, tmp_path):
    import tritonclient.http as httpclient
    assert deploy(builds["v1"][0], tmp_path, "tiny", DeployOptions(takt_runs=2)).passed
    x = images(1, 3)
    outputs = {version: sartor.load(plan, device="cpu").context().run({"images": x})["logits"]
               for version, plan in (("1", builds["v1"][0]), ("2", builds["v2"][0]))}
    server, port = start_server(tmp_path, "--poll-interval", "0.2")
    stopping, failures, answers = threading.Event(), [], []

    def client_loop(k: int) -> None:
        client = httpclient.InferenceServerClient(f"{HOST}:{port}", network_timeout=60.0)
        try:
            while not stopping.is_set():
                tensor = httpclient.InferInput("images", list(x.shape), "FP32")
                tensor.set_data_from_numpy(x)
                try:
                    logits = client.infer("tiny", [tensor]).as_numpy("logits")
                except Exception as exc:  # noqa: BLE001 (any failure at all is what the test counts)
                    failures.append(repr(exc))
                    continue
                answers.append(next((v for v, want in outputs.items() if np.allclose(logits, want, atol=1e-5)), "?"))
        finally:
            client.close()

    threads = [threading.Thread(target=client_loop, args=(k,)) for k in range(4)]
    try:
        for t in threads:
            t.start()
        wait_for(lambda: len(answers) >= 20, timeout=60, what="requests served by release 1")
        deployed = sartor_process("deploy", builds["v2"][0], "--root", tmp_path, "--name", "tiny", "--takt-runs", 2,
                                  "--server", f"{HOST}:{port}", "--watch", "3")
        out, err = deployed.communicate(timeout=300)
        assert deployed.returncode == 0, (out, err)
        assert "PASS: tiny release 2 is current" in out
        count = len(answers)
        wait_for(lambda: len(answers) >= count + 20, timeout=60, what="requests after the swap")
    finally:
        stopping.set()
        for t in threads:
            t.join(60)
        server.send_signal(signal.SIGTERM)
        assert server.wait(60) == 0
        stop(server)
    assert not failures, failures[:5]
    assert "?" not in answers and answers[0] == "1" and answers[-1] == "2"
    switched = answers.index("2")
    assert set(answers[switched:]) <= {"1", "2"} and answers[-20:] == ["2"] * 20
    assert os.readlink(tmp_path / "tiny" / "current") == "releases/2"
