"""`sartor serve --frontends N`: HTTP and gRPC in N processes sharing the ports (SO_REUSEPORT), the
main process batching and running. Round trips against ctx.run, system shared memory through a
worker, both workers serving, errors as the in-process server words them, a dead worker restarted,
and nothing left behind by stop(). CPU engines, loopback only."""
from __future__ import annotations

import contextlib
import http.client
import json
import os
import signal
import threading
import time
import urllib.request
import uuid
from pathlib import Path

import numpy as np
import pytest
from serve_helpers import (BATCHING, HOST, add_model, fill_queue_and_expect_refusal, grpc_client, grpc_infer,
                           http_client, http_infer, images, reference, running, run_threads, wait_for)

from sartor.errors import ConfigError

grpc = pytest.importorskip("grpc")
import tritonclient.grpc as grpcclient  # noqa: E402
import tritonclient.http as httpclient  # noqa: E402
from tritonclient.utils import InferenceServerException  # noqa: E402

QUEUE_OF_TWO = ("max_batch_size: 4\ndynamic_batching { max_queue_delay_microseconds: 1000 "
                "default_queue_policy { max_queue_size: 2 } }\n")


def close(a, b) -> None:
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def make_repo(root: Path, plan: Path) -> Path:
    add_model(root, "tiny", plan, BATCHING + "instance_group [{ count: 2 }]\n")
    add_model(root, "tiny_q", plan, QUEUE_OF_TWO)
    return root


@pytest.fixture(scope="module")
def repo(tmp_path_factory, tiny_plan) -> Path:
    return make_repo(tmp_path_factory.mktemp("frontends") / "repo", tiny_plan)


@pytest.fixture(scope="module")
def server(repo):
    with running(repo, frontends=2) as server:
        yield server


@contextlib.contextmanager
def started(repo: Path, **options):
    """A second server beside the module's: not `running`, which waits for every server thread to end
    (the module server's too)."""
    from sartor.serve import ServeOptions, Server
    settings = dict(host=HOST, http_port=0, grpc_port=0, metrics_port=None, poll_interval=None)
    server = Server(ServeOptions(str(repo), **dict(settings, **options))).start()
    try:
        yield server
    finally:
        server.stop(grace=2.0)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def frontend_counts(server) -> dict:
    """sartor_frontend_request_count per frontend index, from the metrics port."""
    with urllib.request.urlopen(f"http://{HOST}:{server.metrics_port}/metrics", timeout=10) as response:
        text = response.read().decode()
    counts = {}
    for line in text.splitlines():
        if line.startswith("sartor_frontend_request_count{"):
            index = line.split('frontend="')[1].split('"')[0]
            counts[index] = float(line.rsplit(" ", 1)[1])
    return counts


def raw_http(port: int, method: str, path: str, body: bytes = b"", headers: dict | None = None):
    conn = http.client.HTTPConnection(HOST, port, timeout=20)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


# ---- options ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("count", [0, 65, -1])
def test_frontends_out_of_range_is_one_line_error(tmp_path, count):
    from sartor.serve import ServeOptions
    with pytest.raises(ConfigError, match=rf"^--frontends {count} must be in 1\.\.64$"):
        ServeOptions(str(tmp_path), frontends=count).check()


def test_a_port_in_use_is_a_one_line_error(tmp_path, tiny_plan):
    import socket
    from sartor.serve import ServeOptions, Server
    taken = socket.socket()
    taken.bind((HOST, 0))
    taken.listen()
    try:
        options = ServeOptions(str(make_repo(tmp_path / "repo", tiny_plan)), host=HOST, http_port=taken.getsockname()[1],
                               grpc_port=0, metrics_port=None, poll_interval=None, frontends=2)
        with pytest.raises(ConfigError, match=rf"^cannot listen for http on {HOST}:{taken.getsockname()[1]}: "):
            Server(options).start(load=False)
    finally:
        taken.close()


def child_pids() -> set[int]:
    """This process's living children (a zombie is not one: /proc lists it until it is reaped, so reaped
    is what is checked)."""
    found = set()
    for tasks in Path(f"/proc/{os.getpid()}/task").iterdir():
        with contextlib.suppress(FileNotFoundError):
            found.update(int(pid) for pid in (tasks / "children").read_text().split())
    return found


def test_endpoints_that_do_not_start_in_time_are_a_one_line_error_and_leave_nothing(tmp_path, tiny_plan,
                                                                                    monkeypatch):
    import sartor.serve.server as server_module
    from sartor.serve import ServeOptions, Server
    # Frontend processes import grpc, aiohttp and torch before they listen: seconds, never 0.2 s.
    monkeypatch.setattr(server_module, "ENDPOINTS_START_TIMEOUT_S", 0.2)
    before = child_pids()
    options = ServeOptions(str(make_repo(tmp_path / "repo", tiny_plan)), host=HOST, http_port=0, grpc_port=0,
                           metrics_port=None, poll_interval=None, frontends=2)
    with pytest.raises(ConfigError, match=r"^the server's endpoints did not start within 0\.2 s$"):
        Server(options).start(load=False)
    wait_for(lambda: not (child_pids() - before), timeout=30, what="the frontend processes to be stopped")
    wait_for(lambda: not [t for t in threading.enumerate() if t.name.startswith("sartor-serve")], timeout=20,
             what="the server's threads to end")


# ---- round trips ------------------------------------------------------------------------------------------

def test_http_and_grpc_round_trips_match_ctx_run(server, tiny_plan):
    assert len(server.frontend_pids) == 2 and os.getpid() not in server.frontend_pids
    h, g = http_client(server), grpc_client(server)
    assert h.is_server_live() and h.is_server_ready() and h.is_model_ready("tiny")
    assert g.is_server_ready() and g.is_model_ready("tiny") and not g.is_model_ready("tiny", "7")
    for batch in (1, 2, 4):
        x = images(batch, seed=batch)
        want = reference(tiny_plan, x)
        for binary in (True, False):
            result = http_infer(h, x, binary=binary, request_id=f"r{batch}")
            close(result.as_numpy("logits"), want)
            assert result.get_response()["id"] == f"r{batch}" and result.get_response()["model_version"] == "1"
        result = grpc_infer(g, x, request_id=f"g{batch}")
        close(result.as_numpy("logits"), want)
        assert result.get_response().id == f"g{batch}"
    # Compressed bodies, decoded and encoded by the worker.
    x = images(3, seed=7)
    tensor = httpclient.InferInput("images", list(x.shape), "FP32")
    tensor.set_data_from_numpy(x)
    result = h.infer("tiny", [tensor], request_compression_algorithm="gzip", response_compression_algorithm="deflate")
    close(result.as_numpy("logits"), reference(tiny_plan, x))
    # A stream through the worker: every request answered with its id.
    answers = []
    g.start_stream(callback=lambda result, error: answers.append((result, error)))
    xs = [images(1, seed=30 + s) for s in range(3)]
    for i, x in enumerate(xs):
        tensor = grpcclient.InferInput("images", list(x.shape), "FP32")
        tensor.set_data_from_numpy(x)
        g.async_stream_infer("tiny", [tensor], request_id=str(i))
    wait_for(lambda: len(answers) == 3, what="3 stream responses")
    g.stop_stream()
    by_id = {result.get_response().id: result for result, error in answers if error is None}
    for i, x in enumerate(xs):
        close(by_id[str(i)].as_numpy("logits"), reference(tiny_plan, x))
    # Calls the workers pass through to the main process.
    assert h.get_model_metadata("tiny")["inputs"] == [{"name": "images", "datatype": "FP32", "shape": [-1, 3, 16, 16]}]
    assert g.get_model_config("tiny").config.max_batch_size == 4
    assert {r["name"] for r in h.get_model_repository_index()} == {"tiny", "tiny_q"}
    assert h.get_inference_statistics("tiny")["model_stats"][0]["inference_count"] >= 1 + 2 + 4
    assert g.get_server_metadata().name == "sartor"
    h.close()
    g.close()


def test_system_shared_memory_through_a_worker(server, tiny_plan):
    shm = pytest.importorskip("tritonclient.utils.shared_memory")
    key_in, key_out = (f"/sartor_fe_{uuid.uuid4().hex[:10]}" for _ in range(2))
    inp = shm.create_shared_memory_region("in", key_in, 4 * 3 * 16 * 16 * 4)
    out = shm.create_shared_memory_region("out", key_out, 4 * 10 * 4)
    h, g = http_client(server), grpc_client(server)
    try:
        h.register_system_shared_memory("fe_in", key_in, 4 * 3 * 16 * 16 * 4)
        g.register_system_shared_memory("fe_out", key_out, 4 * 10 * 4)
        assert {r["name"] for r in h.get_system_shared_memory_status()} == {"fe_in", "fe_out"}
        for client, lib, batch in ((h, httpclient, 2), (g, grpcclient, 3)):
            x = images(batch, seed=40 + batch)
            shm.set_shared_memory_region(inp, [x])
            tensor = lib.InferInput("images", list(x.shape), "FP32")
            tensor.set_shared_memory("fe_in", x.nbytes)
            output = lib.InferRequestedOutput("logits")
            output.set_shared_memory("fe_out", batch * 10 * 4)
            result = client.infer("tiny", [tensor], outputs=[output])
            if client is h:  # in the region, not in the response: name, datatype and shape only
                assert result.get_output("logits") == {"name": "logits", "datatype": "FP32", "shape": [batch, 10]}
            close(shm.get_contents_as_numpy(out, np.float32, [batch, 10]), reference(tiny_plan, x))
        # A region that is not registered: the main process's answer, through the worker.
        tensor = httpclient.InferInput("images", [1, 3, 16, 16], "FP32")
        tensor.set_shared_memory("nope", 3 * 16 * 16 * 4)
        with pytest.raises(InferenceServerException, match="nope") as info:
            h.infer("tiny", [tensor])
        assert info.value.status() == "404"
    finally:
        h.unregister_system_shared_memory()
        shm.destroy_shared_memory_region(inp)
        shm.destroy_shared_memory_region(out)
        h.close()
        g.close()


def test_concurrent_clients_are_spread_over_both_frontends(server, tiny_plan):
    before = frontend_counts(server)
    xs = [images(1 + k % 4, seed=100 + k) for k in range(12)]
    wants = [reference(tiny_plan, x) for x in xs]
    failures = []

    def client_thread(k: int) -> None:
        # A connection per client: the kernel picks a listening process per connection.
        try:
            for _ in range(4):
                if k % 2:
                    client = grpc_client(server)
                    close(grpc_infer(client, xs[k]).as_numpy("logits"), wants[k])
                else:
                    client = http_client(server)
                    close(http_infer(client, xs[k]).as_numpy("logits"), wants[k])
                client.close()
        except Exception as exc:  # noqa: BLE001 (reported below)
            failures.append(exc)

    run_threads(client_thread, len(xs), timeout=60)
    assert not failures, failures[:3]
    after = frontend_counts(server)
    served = {k: after.get(k, 0) - before.get(k, 0) for k in ("0", "1")}
    assert sum(served.values()) == 12 * 4, served
    assert served["0"] > 0 and served["1"] > 0, served  # 48 connections all on one: chance 2^-47


def test_queue_full_is_still_503_and_unavailable(server):
    batcher = server.repository.served("tiny_q").batcher
    batcher.pause()
    try:
        threads, queued = fill_queue_and_expect_refusal(server, batcher, model="tiny_q")
    finally:
        batcher.resume()
    for t in threads:
        t.join(20)
    assert len(queued) == 2


def _errors_of(server) -> list:
    """What a set of bad requests gets back: (status or code, message) each."""
    h, g = http_client(server), grpc_client(server)
    found = []
    bad_shape = np.zeros((1, 3, 5, 5), np.float32)
    for call in (lambda: http_infer(h, bad_shape), lambda: grpc_infer(g, bad_shape),
                 lambda: http_infer(h, images(1, 0), model="ghost"), lambda: grpc_infer(g, images(1, 0), model="ghost"),
                 lambda: http_infer(h, images(9, 0)), lambda: grpc_infer(g, images(1, 0), model_version="3"),
                 lambda: http_infer(h, images(1, 0), parameters={"timeout": "soon"}),
                 lambda: h.get_model_metadata("ghost"), lambda: g.get_model_config("ghost")):
        with pytest.raises(InferenceServerException) as info:
            call()
        found.append((info.value.status(), info.value.message()))
    tensor = grpcclient.InferInput("images", [1, 3, 16, 16], "FP32")
    tensor.set_data_from_numpy(images(1, 0))
    with pytest.raises(InferenceServerException) as info:
        g.infer("tiny", [tensor], outputs=[grpcclient.InferRequestedOutput("nope")])
    found.append((info.value.status(), info.value.message()))
    for body, headers in ((b"{not json", {}), (b'{"inputs": []}', {}),
                          (b"xx", {"Inference-Header-Content-Length": "9"})):
        status, answer = raw_http(server.http_port, "POST", "/v2/models/tiny/infer", body, headers)
        found.append((status, json.loads(answer)["error"]))
    found.append(raw_http(server.http_port, "GET", "/v2/models/tiny/infer")[0])  # wrong method
    h.close()
    g.close()
    return found


def test_bad_requests_answer_as_the_in_process_server(server, repo):
    with started(repo) as in_process:
        want = _errors_of(in_process)
    got = _errors_of(server)
    assert got == want
    assert want[0][0] == "400" and "outside the allowed ranges" in want[0][1]
    assert want[-1] == 405


def test_a_dead_frontend_is_restarted_and_stop_leaves_nothing(tmp_path, tiny_plan):
    repo = make_repo(tmp_path / "repo", tiny_plan)
    with started(repo, frontends=2) as server:
        first = list(server.frontend_pids)
        victim = first[0]
        os.kill(victim, signal.SIGKILL)
        pids = wait_for(lambda: len(server.frontend_pids) == 2 and victim not in server.frontend_pids
                        and list(server.frontend_pids), timeout=40, what="the frontend to be restarted")
        assert not alive(victim) and first[1] in pids
        h, g = http_client(server), grpc_client(server)
        x = images(2, seed=1)
        for _ in range(6):  # new connections: each lands on either process
            close(http_infer(h, x).as_numpy("logits"), reference(tiny_plan, x))
            close(grpc_infer(g, x).as_numpy("logits"), reference(tiny_plan, x))
        h.close()
        g.close()
        # stop() drains: a request queued when it is called is still answered.
        batcher = server.repository.served("tiny").batcher
        batcher.pause()
        answered = []
        request = threading.Thread(target=lambda: answered.append(http_infer(http_client(server), x)))
        request.start()
        wait_for(lambda: batcher.pending == 1, what="a queued request")
        stopping = threading.Thread(target=server.stop, kwargs={"grace": 5.0})
        stopping.start()
        time.sleep(0.5)
        batcher.resume()
        request.join(20)
        stopping.join(30)
        assert not stopping.is_alive() and len(answered) == 1
        close(answered[0].as_numpy("logits"), reference(tiny_plan, x))
        port = server.http_port
        everyone = first + pids
    assert not [pid for pid in everyone if alive(pid)]  # exited and reaped (a zombie still counts as alive)
    # The ports are free again.
    with pytest.raises(ConnectionRefusedError):
        raw_http(port, "GET", "/v2/health/live")
