"""`sartor serve --engine-processes K`: K whole servers (shards) on the same ports, kept in step by
peers.py. Round trips through both shards, a region registered through one connection used through
others (whichever shard they reach), statistics and metrics summed over the shards, loads and unloads
applied everywhere, a killed shard restarted with the regions registered again, a sibling's refusal
rolled back, and the option's errors. CPU engines, loopback only."""
from __future__ import annotations

import os
import signal
import urllib.request
import uuid

import numpy as np
import pytest
from serve_helpers import (BATCHING, HOST, add_model, grpc_client, grpc_infer, http_client, http_infer, images,
                           publish_version, reference, run_threads, running, wait_for)
from serve_helpers import plan_v2  # noqa: F401, F811  (a fixture, used by name)

from sartor.errors import ConfigError

pytest.importorskip("grpc")
import tritonclient.grpc as grpcclient  # noqa: E402
import tritonclient.http as httpclient  # noqa: E402

from sartor.serve import ServeOptions  # noqa: E402
from sartor.serve.peers import (MirroredRegistry, PeerFailed, RegistrationLog, Siblings, peer_request,  # noqa: E402
                                sum_metrics, sum_statistics)
from sartor.serve.shared_memory import SharedMemoryRegistry  # noqa: E402


def close(a, b) -> None:
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.fixture(scope="module")
def repo(tmp_path_factory, tiny_plan):
    root = tmp_path_factory.mktemp("shards") / "repo"
    add_model(root, "tiny", tiny_plan, BATCHING)
    add_model(root, "tiny_b", tiny_plan, BATCHING)
    return root


@pytest.fixture(scope="module")
def server(repo):
    with running(repo, frontends=2, engine_processes=2) as server:
        yield server


def shard_get(server, index: int, route: str):
    import json
    status, data = peer_request(server._shards.peer_path(index), "GET", route, timeout=10.0)
    assert status == 200, (route, data)
    return json.loads(data)


def local_count(server, index: int, model: str = "tiny") -> int:
    rows = shard_get(server, index, f"/statistics?name={model}")
    return rows[0]["inference_count"]


def many_connections(server, count: int, infer_and_check) -> list:
    """`infer_and_check(client, lib, k)` 3 times in each of `count` threads, a new connection each
    time (the kernel picks a listening process per connection), gRPC in odd threads and HTTP in
    even ones; the failures."""
    failures = []

    def client_thread(k: int) -> None:
        try:
            for _ in range(3):
                client, lib = (grpc_client(server), grpcclient) if k % 2 else (http_client(server), httpclient)
                infer_and_check(client, lib, k)
                client.close()
        except Exception as exc:  # noqa: BLE001 (returned)
            failures.append(exc)

    run_threads(client_thread, count, timeout=90)
    return failures


def check_images(xs, plan):
    """infer_and_check for many_connections: thread k sends xs[k] in the body."""
    wants = [reference(plan, x) for x in xs]

    def infer_and_check(client, lib, k: int) -> None:
        result = grpc_infer(client, xs[k]) if lib is grpcclient else http_infer(client, xs[k])
        close(result.as_numpy("logits"), wants[k])
    return infer_and_check


# ---- options -----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("count", [0, 17, True])
def test_engine_processes_out_of_range_is_one_line_error(tmp_path, count):
    with pytest.raises(ConfigError, match=rf"^--engine-processes {count} must be in 1\.\.16$"):
        ServeOptions(str(tmp_path), engine_processes=count).check()


def test_engine_processes_need_frontend_processes(tmp_path):
    with pytest.raises(ConfigError, match=r"^--engine-processes 2 needs --frontends 2 or more: "):
        ServeOptions(str(tmp_path), engine_processes=2, frontends=1).check()


# ---- pure parts ----------------------------------------------------------------------------------------------

def test_metrics_of_the_shards_are_summed_series_by_series():
    a = ("# HELP nv_inference_count n\n# TYPE nv_inference_count counter\n"
         'nv_inference_count{model="m",version="1"} 3\nnv_inference_count{model="n",version="1"} 1\n')
    b = ("# HELP nv_inference_count n\n# TYPE nv_inference_count counter\n"
         'nv_inference_count{model="m",version="1"} 4\nnv_gpu{x="1"} 0.5\n')
    assert sum_metrics([a, b]).splitlines() == [
        "# HELP nv_inference_count n", "# TYPE nv_inference_count counter",
        'nv_inference_count{model="m",version="1"} 7', 'nv_inference_count{model="n",version="1"} 1',
        'nv_gpu{x="1"} 0.5']


def test_statistics_of_the_shards_are_summed_per_model_version():
    def row(name, count, ns, last):
        return {"name": name, "version": "1", "last_inference": last, "inference_count": count,
                "execution_count": count, "inference_stats": {"success": {"count": count, "ns": ns}}}
    merged = sum_statistics([[row("m", 2, 100, 5), row("n", 1, 7, 9)], [row("m", 3, 50, 8)]])
    assert merged == [row("m", 5, 150, 8), row("n", 1, 7, 9)]


def test_a_sibling_that_refuses_rolls_the_registration_back(tmp_path):
    shm = pytest.importorskip("tritonclient.utils.shared_memory")
    key = f"/sartor_sh_{uuid.uuid4().hex[:10]}"
    handle = shm.create_shared_memory_region("r", key, 64)
    local = SharedMemoryRegistry()
    registrations = RegistrationLog()
    mirrored = MirroredRegistry(local, Siblings({1: str(tmp_path / "no-such-socket")}), registrations)
    try:
        with pytest.raises(PeerFailed, match=r"^engine process 1 did not answer: "):
            mirrored.register_system("r", key, 0, 64)
        assert local.status("system") == [] and registrations.entries() == []
    finally:
        local.close()
        shm.destroy_shared_memory_region(handle)


# ---- one engine process on its own ----------------------------------------------------------------------------

def shard_settings(repo, tmp_path, http_port: int) -> dict:
    import dataclasses
    options = ServeOptions(str(repo), host=HOST, http_port=http_port, grpc_port=0, metrics_port=None,
                           poll_interval=None, frontends=2)
    return {"index": 0, "options": dataclasses.asdict(options), "peer": str(tmp_path / "peer"), "siblings": {},
            "failure": str(tmp_path / "failure"), "parent": os.getpid(), "log_level": 30}


def run_shard(settings: dict, timeout: float = 120.0):
    import json
    import subprocess
    import sys
    from sartor.serve.shards import SHARD_COMMAND
    return subprocess.run([sys.executable, "-c", SHARD_COMMAND, json.dumps(settings)], timeout=timeout,
                          capture_output=True, text=True)


def test_an_engine_process_that_cannot_start_says_why_in_one_line(repo, tmp_path):
    import socket
    taken = socket.socket()  # listening without SO_REUSEPORT: no one else can bind the port
    taken.bind((HOST, 0))
    taken.listen()
    try:
        done = run_shard(shard_settings(repo, tmp_path, taken.getsockname()[1]))
    finally:
        taken.close()
    assert done.returncode == 1, done.stderr[-2000:]
    message = (tmp_path / "failure").read_text()
    assert message.startswith(f"cannot listen for http on {HOST}:") and "\n" not in message


def test_an_engine_process_exits_when_its_parent_is_gone(repo, tmp_path):
    """Its parent killed (no SIGTERM to pass on): the shard stops serving and exits on its own."""
    import json
    import subprocess
    import sys
    settings = shard_settings(repo, tmp_path, 0)
    # The parent: starts the shard with its own pid as the parent's, waits until it serves, exits at once.
    parent = ("import json, os, subprocess, sys, time\n"
              "from sartor.serve.peers import peer_request\n"
              "from sartor.serve.shards import SHARD_COMMAND\n"
              "s = json.loads(sys.argv[1]); s['parent'] = os.getpid()\n"
              "p = subprocess.Popen([sys.executable, '-c', SHARD_COMMAND, json.dumps(s)], stdout=subprocess.DEVNULL)\n"
              "print(p.pid, flush=True)\n"
              "end = time.monotonic() + 120\n"
              "while time.monotonic() < end:\n"
              "    try:\n"
              "        if peer_request(s['peer'], 'GET', '/ready', timeout=2)[0] == 200:\n"
              "            print('serving', flush=True)\n"
              "            break\n"
              "    except OSError: pass\n"
              "    time.sleep(0.1)\n"
              "os._exit(0)\n")
    done = subprocess.run([sys.executable, "-c", parent, json.dumps(settings)], capture_output=True, text=True,
                          timeout=150)
    shard, state = done.stdout.split()[:2]
    assert state == "serving", done.stderr[-2000:]
    shard = int(shard)

    def gone() -> bool:
        try:
            os.kill(shard, 0)
        except ProcessLookupError:
            return True
        return False
    wait_for(gone, timeout=60, what="the orphaned engine process to exit")


# ---- a server of two engine processes ----------------------------------------------------------------------

def test_stop_leaves_no_engine_process(repo):
    # Before the module's server starts: `running` waits for every server thread of this process to end.
    with running(repo, frontends=2, engine_processes=2, metrics_port=None) as server:
        pids = list(server.engine_pids)
        assert len(pids) == 2
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_engine_processes_load_longer_than_the_endpoints_deadline(repo, tiny_plan, monkeypatch):
    """Engine processes load and warm up their models before they listen (the sample detector's 32 batch
    sizes took 53 s on the H200, where the endpoints' 60 s deadline then failed a server of two): only
    shards.START_TIMEOUT_S bounds that."""
    import sartor.serve.server as server_module
    monkeypatch.setattr(server_module, "ENDPOINTS_START_TIMEOUT_S", 0.2)  # a shard takes seconds to start
    with running(repo, frontends=2, engine_processes=2, metrics_port=None) as server:
        x = images(2, seed=3)
        close(grpc_infer(grpc_client(server), x).as_numpy("logits"), reference(tiny_plan, x))


def test_round_trips_reach_both_engine_processes(server, tiny_plan):
    assert len(server.engine_pids) == 2 and os.getpid() not in server.engine_pids
    h, g = http_client(server), grpc_client(server)
    assert h.is_server_ready() and g.is_model_ready("tiny")
    h.close()
    g.close()
    before = [local_count(server, i) for i in range(2)]
    xs = [images(1 + k % 4, seed=200 + k) for k in range(12)]
    failures = many_connections(server, len(xs), check_images(xs, tiny_plan))
    assert not failures, failures[:3]
    served = [local_count(server, i) - before[i] for i in range(2)]
    assert sum(served) == 3 * sum(x.shape[0] for x in xs), served
    assert served[0] > 0 and served[1] > 0, served  # 36 connections all on one shard: chance 2^-35


def test_statistics_and_metrics_sum_the_engine_processes(server):
    grpc_infer(grpc_client(server), images(2, seed=1))
    shares = [local_count(server, i) for i in range(2)]
    h = http_client(server)
    assert h.get_inference_statistics("tiny")["model_stats"][0]["inference_count"] == sum(shares)
    assert grpc_client(server).get_inference_statistics("tiny").model_stats[0].inference_count == sum(shares)
    h.close()
    text = urllib.request.urlopen(f"http://{HOST}:{server.metrics_port}/metrics", timeout=10).read().decode()
    line = next(x for x in text.splitlines() if x.startswith('nv_inference_count{model="tiny",version="1"}'))
    assert float(line.rpartition(" ")[2]) == sum(shares)
    assert text.count("# TYPE nv_inference_count ") == 1


def test_a_region_registered_once_serves_every_connection(server, tiny_plan):
    shm = pytest.importorskip("tritonclient.utils.shared_memory")
    key = f"/sartor_sh_{uuid.uuid4().hex[:10]}"
    x = images(2, seed=77)
    region = shm.create_shared_memory_region("in", key, x.nbytes)
    shm.set_shared_memory_region(region, [x])
    h = http_client(server)
    try:
        h.register_system_shared_memory("shard_in", key, x.nbytes)
        for index in range(2):  # in force in both shards, whichever one the registration reached
            assert [body["name"] for _, body in shard_get(server, index, "/registrations")] == ["shard_in"]

        want = reference(tiny_plan, x)

        def infer_and_check(client, lib, k: int) -> None:
            tensor = lib.InferInput("images", list(x.shape), "FP32")
            tensor.set_shared_memory("shard_in", x.nbytes)
            close(client.infer("tiny", [tensor]).as_numpy("logits"), want)

        failures = many_connections(server, 8, infer_and_check)
        assert not failures, failures[:3]
        grpc_client(server).unregister_system_shared_memory("shard_in")
        for index in range(2):
            assert shard_get(server, index, "/registrations") == []
    finally:
        h.unregister_system_shared_memory()
        h.close()
        shm.destroy_shared_memory_region(region)


def test_unload_and_load_reach_every_engine_process(server):
    g = grpc_client(server)
    g.unload_model("tiny_b")
    for index in range(2):
        states = {r["name"]: r["state"] for r in shard_get(server, index, "/index")}
        assert states["tiny_b"] == "UNAVAILABLE" and states["tiny"] == "READY", (index, states)
    g.load_model("tiny_b")
    for index in range(2):
        assert {r["name"]: r["state"] for r in shard_get(server, index, "/index")}["tiny_b"] == "READY"
    g.close()


def test_a_new_version_loaded_under_load_loses_no_request(server, repo, tiny_plan, plan_v2):  # noqa: F811
    """Clients on fresh connections (so on both engine processes) while a load, applied in both,
    swaps tiny_b to version 2: every answer is version 1's or 2's exactly, none fails, and once the
    load is answered both engine processes serve version 2."""
    import threading
    import time
    pool = [images(1 + i % 3, seed=500 + i) for i in range(6)]
    expected = {"1": [reference(tiny_plan, x) for x in pool], "2": [reference(plan_v2, x) for x in pool]}
    stop, lock = threading.Event(), threading.Lock()
    errors: list = []
    seen = {"1": 0, "2": 0}

    def load(k: int) -> None:
        end = time.monotonic() + 90
        while not stop.is_set() and time.monotonic() < end:
            client = grpc_client(server)
            try:
                for _ in range(4):
                    j = (k + seen["1"] + seen["2"]) % len(pool)
                    result = grpc_infer(client, pool[j], model="tiny_b")
                    version = result.get_response().model_version
                    np.testing.assert_allclose(result.as_numpy("logits"), expected[version][j], rtol=1e-5, atol=1e-6)
                    with lock:
                        seen[version] += 1
            except Exception as exc:  # noqa: BLE001 (reported below)
                errors.append(repr(exc))
            client.close()

    threads = [threading.Thread(target=load, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    try:
        wait_for(lambda: seen["1"] >= 20, what="load on version 1")
        publish_version(repo, "tiny_b", plan_v2, 2)
        grpc_client(server).load_model("tiny_b")
        for index in range(2):
            rows = {(r["version"], r["state"]) for r in shard_get(server, index, "/index") if r["name"] == "tiny_b"}
            assert ("2", "READY") in rows, (index, rows)
        served_at_swap = seen["2"]
        wait_for(lambda: seen["2"] >= served_at_swap + 20, what="load on version 2")
    finally:
        stop.set()
        for t in threads:
            t.join(60)
    assert not errors, errors[:3]
    assert seen["1"] >= 20 and seen["2"] >= 20


def test_a_killed_engine_process_comes_back_with_the_regions(server, tiny_plan):
    shm = pytest.importorskip("tritonclient.utils.shared_memory")
    key = f"/sartor_sh_{uuid.uuid4().hex[:10]}"
    region = shm.create_shared_memory_region("in", key, 64)
    h = http_client(server)
    try:
        h.register_system_shared_memory("kept", key, 64)
        victim = server.engine_pids[1]
        os.kill(victim, signal.SIGKILL)
        wait_for(lambda: len(server.engine_pids) == 2 and victim not in server.engine_pids
                 and server._shards.ready(1), timeout=120, what="the engine process to be restarted")
        assert [body["name"] for _, body in shard_get(server, 1, "/registrations")] == ["kept"]
        xs = [images(1, seed=300 + k) for k in range(8)]
        failures = many_connections(server, len(xs), check_images(xs, tiny_plan))
        assert not failures, failures[:3]
    finally:
        h.unregister_system_shared_memory()
        h.close()
        shm.destroy_shared_memory_region(region)


def shard_pids_serving(root) -> list[int]:
    """The engine processes whose settings name this repository (from /proc)."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read().decode(errors="replace")
        except OSError:
            continue
        if "shard_main" in cmdline and str(root) in cmdline:
            pids.append(int(entry))
    return pids


def test_cli_serves_from_engine_processes_until_sigint(tmp_path, tiny_plan):
    import re
    import subprocess
    import sys
    root = tmp_path / "repo"
    add_model(root, "tiny", tiny_plan, BATCHING)
    process = subprocess.Popen([sys.executable, "-m", "sartor", "serve", "--model-repository", str(root),
                                "--http-port", "0", "--grpc-port", "0", "--metrics-port", "-1", "--poll-interval", "0",
                                "--engine-processes", "2", "--frontends", "2"],
                               stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                               env=dict(os.environ, PYTHONUNBUFFERED="1"))
    try:
        lines = []
        while not lines or "serving on" not in lines[-1]:
            lines.append(process.stdout.readline())
            if not lines[-1] and process.poll() is not None:
                break
        match = re.search(r"HTTP 127\.0\.0\.1:(\d+), gRPC 127\.0\.0\.1:(\d+)", lines[-1])
        assert match, (lines, process.poll())
        assert any("tiny" in line and "READY" in line for line in lines), lines  # the engine processes' index
        assert len(shard_pids_serving(root)) == 2
        with urllib.request.urlopen(f"http://{HOST}:{match.group(1)}/v2/health/ready", timeout=20) as response:
            assert response.status == 200
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=60) == 0
        assert shard_pids_serving(root) == []
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(10)
        process.stdout.close()
