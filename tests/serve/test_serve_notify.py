"""`sartor serve` as a systemd service: the sd_notify protocol against a fake NOTIFY_SOCKET (a real
datagram socket: READY=1 once the models are warm, WATCHDOG=1 pings, STOPPING=1 on SIGTERM), a
server killed with SIGKILL brought back by a supervisor with Restart=always's behaviour, and the
unit `--systemd-unit` prints."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import uuid
from contextlib import closing

import pytest
from release_helpers import HOST, get_json, sartor_process, stop, wait_for_line
from serve_helpers import BATCHING, add_model, wait_for

from sartor.serve.notify import notify, watchdog_interval


def _datagram_socket(abstract: bool, tmp_path) -> tuple[socket.socket, str]:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    if abstract:
        name = f"@sartor-test-{uuid.uuid4().hex}"
        sock.bind("\0" + name[1:])
    else:
        name = str(tmp_path / "notify.sock")
        sock.bind(name)
    sock.settimeout(120)
    return sock, name


@pytest.mark.parametrize("abstract", [True, False], ids=["abstract", "path"])
def test_notify_sends_one_datagram(tmp_path, abstract):
    sock, name = _datagram_socket(abstract, tmp_path)
    with closing(sock):
        assert notify("READY=1\nSTATUS=x", {"NOTIFY_SOCKET": name})
        assert sock.recv(4096) == b"READY=1\nSTATUS=x"
    assert not notify("READY=1", {})  # no socket: nothing to do


def test_watchdog_interval_is_half_of_what_systemd_asks_of_this_process():
    assert watchdog_interval({"WATCHDOG_USEC": "30000000"}) == 15.0
    assert watchdog_interval({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": str(os.getpid())}) == 15.0
    assert watchdog_interval({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": "1"}) is None  # another process's
    assert watchdog_interval({"WATCHDOG_USEC": "soon"}) is None and watchdog_interval({}) is None


def _messages(sock: socket.socket, until: str, limit: int = 200) -> list[str]:
    seen = []
    for _ in range(limit):
        seen.append(sock.recv(4096).decode())
        if seen[-1].startswith(until):
            return seen
    raise AssertionError(f"no {until} among {seen}")


def test_the_watchdog_protocol_against_a_fake_notify_socket(tiny_plan, tmp_path):
    add_model(tmp_path / "repo", "tiny", tiny_plan, BATCHING)
    sock, name = _datagram_socket(True, tmp_path)
    with closing(sock):
        process = sartor_process("serve", "--model-repository", tmp_path / "repo", "--http-port", 0, "--grpc-port", -1,
                                 "--metrics-port", -1, env={"NOTIFY_SOCKET": name, "WATCHDOG_USEC": "400000"})
        try:
            port = int(wait_for_line(process.stdout, r"serving on HTTP 127\.0\.0\.1:(\d+)", process).group(1))
            first = _messages(sock, "READY=1")
            assert len(first) == 1 and "STATUS=serving 1 model version(s)" in first[0]  # nothing before READY
            assert get_json(f"http://{HOST}:{port}/v2/models/tiny/ready")[0] == 200  # warm before READY
            pings = _messages(sock, "WATCHDOG=1") + _messages(sock, "WATCHDOG=1")
            assert pings[-1] == "WATCHDOG=1"
            process.send_signal(signal.SIGTERM)
            assert any(m.startswith("STOPPING=1") for m in _messages(sock, "STOPPING=1"))
            assert process.wait(60) == 0  # a graceful stop
        finally:
            stop(process)


def _free_port() -> int:
    with closing(socket.socket()) as probe:
        probe.bind((HOST, 0))
        return probe.getsockname()[1]


def test_a_server_killed_with_sigkill_comes_back_under_its_supervisor(tiny_plan, tmp_path):
    """The supervisor does what systemd does with Restart=always: start the command again whenever
    it exits; READY=1 on the notify socket says the new process serves."""
    add_model(tmp_path / "repo", "tiny", tiny_plan, BATCHING)
    sock, name = _datagram_socket(True, tmp_path)
    port = _free_port()
    command = [sys.executable, "-m", "sartor", "serve", "--model-repository", str(tmp_path / "repo"),
               "--http-port", str(port), "--grpc-port", "-1", "--metrics-port", "-1"]
    env = dict(os.environ, NOTIFY_SOCKET=name)
    children: list[subprocess.Popen] = []
    done = threading.Event()

    def supervise() -> None:
        while not done.is_set():
            child = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            children.append(child)
            child.wait()

    supervisor = threading.Thread(target=supervise, daemon=True)
    supervisor.start()
    with closing(sock):
        try:
            _messages(sock, "READY=1")
            assert get_json(f"http://{HOST}:{port}/v2/models/tiny/ready")[0] == 200
            first = children[0]
            first.send_signal(signal.SIGKILL)
            assert first.wait(30) == -signal.SIGKILL
            _messages(sock, "READY=1")  # the restarted server, ready again
            assert len(children) == 2 and children[1].pid != first.pid
            assert get_json(f"http://{HOST}:{port}/v2/models/tiny/ready")[0] == 200
        finally:
            done.set()
            for child in children:
                if child.poll() is None:
                    child.terminate()
                    child.wait(60)
            supervisor.join(60)
            wait_for(lambda: all(c.poll() is not None for c in children), what="the supervised servers to end")


def test_systemd_unit_runs_the_command_it_was_given(tmp_path, cli, monkeypatch):
    repo = tmp_path / "repo"
    repo.mkdir()
    monkeypatch.chdir(tmp_path)
    result = cli("serve", "--model-repository", "repo", "--host", "0.0.0.0", "--systemd-unit")
    assert result.code == 0, result
    lines = result.out.splitlines()
    for expected in ("Type=notify", "WatchdogSec=30", "Restart=always", "KillSignal=SIGTERM"):
        assert expected in lines
    exec_start = next(line for line in lines if line.startswith("ExecStart="))
    assert exec_start == (f"ExecStart={sys.executable} -m sartor serve --model-repository {repo} --host 0.0.0.0")
