"""Request bodies are admitted against the model's queue room before they are read: a request that
finds the queue (plus the bodies already being received) full gets 503 without its body being read,
and a flood of large requests against a real server process leaves its memory bounded by the queue."""
from __future__ import annotations

import json
import os
import re
import select
import socket
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import onnx
import pytest
from conftest import make_model, save
from onnx import TensorProto, helper
from serve_helpers import HOST, add_model, running, wait_for

QUEUE_2 = """max_batch_size: 2
dynamic_batching { max_queue_delay_microseconds: 1000 default_queue_policy { max_queue_size: 2 } }
"""


def _headers(port: int, model: str, length: int | None, extra: str = "", route: str = "infer") -> bytes:
    size = f"Content-Length: {length}\r\n" if length is not None else "Transfer-Encoding: chunked\r\n"
    return (f"POST /v2/models/{model}/{route} HTTP/1.1\r\nHost: {HOST}:{port}\r\n"
            f"Content-Type: application/json\r\n{size}{extra}\r\n").encode()


def _status(sock: socket.socket) -> tuple[int, str]:
    """The status and JSON error of the response on `sock` (read until the body is complete)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            break
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    status = int(head.split()[1])
    match = re.search(rb"Content-Length: (\d+)", head, re.IGNORECASE)
    want = int(match.group(1)) if match else 0
    while len(body) < want:
        chunk = sock.recv(65536)
        if not chunk:
            break
        body += chunk
    return status, json.loads(body).get("error", "") if body else ""


def test_a_full_queue_refuses_before_the_body_is_read(tmp_path, tiny_plan):
    """Two requests queued behind a paused batcher: a third announces a 1 MB body and sends none of
    it, and is answered 503 anyway (the old server waited for the body before any check)."""
    from serve_helpers import fill_queue_and_expect_refusal
    root = tmp_path / "repo"
    add_model(root, "tiny", tiny_plan, "max_batch_size: 4\ndynamic_batching { default_queue_policy { "
              "max_queue_size: 2 } }\n")
    with running(root) as server:
        batcher = server.repository.served("tiny").batcher
        batcher.pause()
        threads, _ = fill_queue_and_expect_refusal(server, batcher)
        try:
            with socket.create_connection((HOST, server.http_port), timeout=30) as sock:
                sock.sendall(_headers(server.http_port, "tiny", 1 << 20))
                status, message = _status(sock)
            assert status == 503
            assert "queue is full (2 requests waiting and 0 being received" in message
            assert "the body was not read" in message
        finally:
            batcher.resume()
            for t in threads:
                t.join(30)


def test_bodies_being_received_count_against_the_queue(tmp_path, tiny_plan):
    """One request queued and one whose body is still arriving fill a queue of 2: a third is refused
    before its body; once the arriving one is refused for its shape or answered, room comes back."""
    root = tmp_path / "repo"
    add_model(root, "tiny", tiny_plan, "max_batch_size: 4\ndynamic_batching { default_queue_policy { "
              "max_queue_size: 2 } }\n")
    with running(root) as server:
        served = server.repository.served("tiny")
        served.batcher.pause()
        body = json.dumps({"inputs": [{"name": "images", "datatype": "FP32", "shape": [1, 3, 16, 16],
                                       "data": [0.0] * 768}]}).encode()
        results = []
        waiter = threading.Thread(target=lambda: results.append(_post(server.http_port, body)))
        waiter.start()
        wait_for(lambda: served.batcher.pending == 1, what="one queued request")
        slow = socket.create_connection((HOST, server.http_port), timeout=30)
        try:
            slow.sendall(_headers(server.http_port, "tiny", len(body)) + body[:100])
            key = (served.name, served.version)
            wait_for(lambda: server.core.admission.reading_count(key) == 1, what="a body being received")
            with socket.create_connection((HOST, server.http_port), timeout=30) as third:
                third.sendall(_headers(server.http_port, "tiny", len(body)))
                status, message = _status(third)
            assert status == 503 and "1 requests waiting and 1 being received, of max_queue_size 2" in message
            slow.sendall(body[100:])  # now whole: it is queued (the queue's second place)
            wait_for(lambda: served.batcher.pending == 2, what="the second request queued")
            assert server.core.admission.reading_count(key) == 0
        finally:
            served.batcher.resume()
            waiter.join(30)
        assert _status(slow)[0] == 200 and results == [200]
        slow.close()


def _post(port: int, body: bytes, model: str = "tiny") -> int:
    with socket.create_connection((HOST, port), timeout=60) as sock:
        sock.sendall(_headers(port, model, len(body)) + body)
        return _status(sock)[0]


def test_a_chunked_body_is_read_with_the_size_cap(tmp_path, tiny_plan):
    """No Content-Length: the body is read up to --max-request-bytes and refused past it."""
    root = tmp_path / "repo"
    add_model(root, "tiny", tiny_plan, QUEUE_2)
    with running(root, max_request_bytes=4096) as server:
        with socket.create_connection((HOST, server.http_port), timeout=30) as sock:
            sock.sendall(_headers(server.http_port, "tiny", None))
            chunk = b"x" * 1000
            try:
                for _ in range(10):
                    sock.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                sock.sendall(b"0\r\n\r\n")
            except (BrokenPipeError, ConnectionResetError):
                pass  # refused mid-body: the answer is still there to read
            status, message = _status(sock)
        assert status == 400 and "exceeds the limit of 4096 bytes (--max-request-bytes)" in message
        assert server.core.admission.reading_count(("tiny", "1")) == 0


# ---- a real server process under a flood of large requests -------------------------------------------------

SIDE = 512  # 3 x 512 x 512 float32: a 3 MB tensor per request


def _large_input_plan(directory: Path) -> Path:
    import sartor
    nodes = [helper.make_node("GlobalAveragePool", ["images"], ["p"], name="pool"),
             helper.make_node("Flatten", ["p"], ["scores"], name="flatten", axis=1)]
    model = make_model(nodes, [helper.make_tensor_value_info("images", TensorProto.FLOAT, ["batch", 3, SIDE, SIDE])],
                       [helper.make_tensor_value_info("scores", TensorProto.FLOAT, ["batch", 3])], name="large")
    onnx.checker.check_model(model)
    out = directory / "large.plan"
    shape = (1, 3, SIDE, SIDE)
    sartor.build(save(model, directory / "large.onnx"), out, device="cpu", min_shapes={"images": shape},
                 opt_shapes={"images": shape}, max_shapes={"images": (2, 3, SIDE, SIDE)})
    return out


def _memory_kib(pid: int) -> dict:
    with open(f"/proc/{pid}/status") as handle:
        return {k: int(v.split()[0]) for k, v in (line.split(":", 1) for line in handle) if k in ("VmRSS", "VmHWM")}


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads the server's memory from /proc")
def test_a_flood_of_large_requests_leaves_memory_bounded_by_the_queue(tmp_path):
    root = tmp_path / "repo"
    add_model(root, "large", _large_input_plan(tmp_path), QUEUE_2)
    x = np.random.default_rng(0).standard_normal((1, 3, SIDE, SIDE)).astype(np.float32)
    header = json.dumps({"inputs": [{"name": "images", "datatype": "FP32", "shape": list(x.shape),
                                     "parameters": {"binary_data_size": x.nbytes}}]}).encode()
    body = header + x.tobytes()
    process = subprocess.Popen([sys.executable, "-m", "sartor", "serve", "--model-repository", str(root),
                                "--http-port", "0", "--grpc-port", "-1", "--metrics-port", "-1", "--poll-interval", "0"],
                               stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                               env=dict(os.environ, PYTHONUNBUFFERED="1"))
    try:
        line = ""
        while "serving on" not in line:
            line = process.stdout.readline()
            assert line or process.poll() is None, "the server exited before serving"
        port = int(re.search(r"HTTP 127\.0\.0\.1:(\d+)", line).group(1))
        assert _post_binary(port, body, len(header)) == 200  # warm: the first request's allocations
        before = _memory_kib(process.pid)["VmRSS"]
        clients = 48
        start = threading.Barrier(clients)
        statuses: list[int] = []

        def flood(_: int) -> None:
            start.wait()
            statuses.append(_post_binary(port, body, len(header)))

        threads = [threading.Thread(target=flood, args=(k,)) for k in range(clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        grown_mib = (_memory_kib(process.pid)["VmHWM"] - before) / 1024
    finally:
        process.terminate()
        process.wait(30)
        process.stdout.close()
    assert len(statuses) == clients and set(statuses) <= {200, 503}, statuses
    assert statuses.count(503) > 0 and statuses.count(200) > 0, statuses
    # At most 2 queued, 2 being received and a batch of 2 running, a few copies each: far below the
    # 48 bodies (144 MB) the server held when it read every body before its queue check.
    body_mib = len(body) / 2**20
    assert grown_mib < 20 * body_mib, f"the server grew by {grown_mib:.0f} MiB for {clients} requests of {body_mib:.1f} MiB"


def _post_binary(port: int, body: bytes, header_length: int) -> int:
    extra = f"Inference-Header-Content-Length: {header_length}\r\n"
    with socket.create_connection((HOST, port), timeout=120) as sock:
        sock.sendall(_headers(port, "large", len(body), extra).replace(b"application/json", b"application/octet-stream"))
        try:
            sock.sendall(body)
        except (BrokenPipeError, ConnectionResetError):
            pass  # refused before the body: the answer is still there to read
        return _status(sock)[0]


@pytest.mark.parametrize("route", ["infer", "infer_image"])
def test_frontend_processes_bound_the_bodies_they_receive(tmp_path, tiny_plan, route):
    """--frontends 2 with a queue of 1: each frontend process receives at most one body per model at
    a time, so of three requests whose bodies are all still arriving, one at least is refused (two
    land on one process) before its body is read. The image route (passed through to the main
    process) is bounded the same way."""
    root = tmp_path / "repo"
    add_model(root, "tiny", tiny_plan, "max_batch_size: 4\n")
    body = json.dumps({"inputs": [{"name": "images", "datatype": "FP32", "shape": [1, 3, 16, 16],
                                   "data": [0.0] * 768}]}).encode()
    with running(root, frontends=2, max_queue_size=1, metrics_port=None) as server:
        sockets = [socket.create_connection((HOST, server.http_port), timeout=60) for _ in range(3)]
        try:
            for sock in sockets:
                sock.sendall(_headers(server.http_port, "tiny", len(body), route=route) + body[:100])
            # No body is whole yet, so the refusal comes now: wait for it before completing any.
            answered, _, _ = select.select(sockets, [], [], 60)
            assert answered, "no request was refused while three bodies were arriving"
            statuses = []
            for sock in sockets:
                try:
                    sock.sendall(body[100:])
                except (BrokenPipeError, ConnectionResetError):
                    pass
                statuses.append(_status(sock))
        finally:
            for sock in sockets:
                sock.close()
    answered = 400 if route == "infer_image" else 200  # JSON is no image: refused by the main process
    assert min(s for s, _ in statuses) == answered and 503 in [s for s, _ in statuses], statuses
    refused = next(m for s, m in statuses if s == 503)
    assert "model 'tiny': the queue is full (0 requests waiting and 1 being received, of max_queue_size 1)" in refused
