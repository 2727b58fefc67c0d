"""`sartor serve --engine-processes K`: K engine processes (shards), each a whole server of its own
(repository, engine instances, batchers, shared-memory registry and `--frontends N` frontend
processes) on the same HTTP and gRPC ports (SO_REUSEPORT), so that the per-request work of the
event loop, which one process does for every request otherwise, is spread over K processes.

This process (the parent) starts them, restarts one that dies, serves /metrics summed over them,
and stops them. The shards keep their registrations, loads and unloads in step themselves
(peers.py). Each shard loads its own copy of every engine: K times the device memory, and K
batchers, so a batch holds only the requests that reached one shard.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ..errors import ConfigError
from .frontend_pool import reserve_ports
from .peers import QUERY_TIMEOUT_S, PeerFailed, Siblings, parse_sample, peer_request, sum_metrics
from .restarts import Restarts

log = logging.getLogger("sartor.serve")
START_TIMEOUT_S = 600.0  # each shard loads and warms up every model before it reports ready
STOP_EXTRA_S = 10.0  # past the grace period, before a shard that has not exited is killed
SHARD_COMMAND = ("import json, sys; from sartor.serve.shard_process import shard_main; "
                 "shard_main(json.loads(sys.argv[1]))")


class ShardPool:
    def __init__(self, options) -> None:
        self.options = options
        self._dir = tempfile.mkdtemp(prefix="sartor-shards-")
        self._reserved: list[socket.socket] = []
        self._processes: dict[int, subprocess.Popen] = {}
        self._restarts = Restarts("engine process", self._processes, self._spawn)
        self.peers = Siblings({index: self.peer_path(index) for index in range(options.engine_processes)})
        self.http_port: int | None = None
        self.grpc_port: int | None = None

    def peer_path(self, index: int) -> str:
        return os.path.join(self._dir, f"peer-{index}")

    def failure_path(self, index: int) -> str:
        """Where shard `index` writes the one line it failed to start with."""
        return os.path.join(self._dir, f"failure-{index}")

    @property
    def pids(self) -> list[int]:
        return [self._processes[i].pid for i in sorted(self._processes)]

    # ---- start ------------------------------------------------------------------------------------------
    async def start(self) -> None:
        """Ports resolved here (port 0 becomes one port for every shard), then every shard started and
        waited for until it has loaded its models and listens."""
        o = self.options
        self._reserved, self.http_port, self.grpc_port = reserve_ports(o)
        for index in range(o.engine_processes):
            self._spawn(index)
        await self._wait_ready(range(o.engine_processes))
        self._restarts.start()

    def _spawn(self, index: int) -> None:
        o = self.options
        shard_options = dataclasses.replace(o, http_port=self.http_port, grpc_port=self.grpc_port, metrics_port=None,
                                            engine_processes=1)
        settings = {"index": index, "options": dataclasses.asdict(shard_options), "peer": self.peer_path(index),
                    "siblings": {j: self.peer_path(j) for j in range(o.engine_processes) if j != index},
                    "failure": self.failure_path(index), "parent": os.getpid(),
                    "log_level": logging.getLogger("sartor").getEffectiveLevel()}
        package_root = str(Path(__file__).resolve().parents[2])
        path = os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")]))
        if os.path.exists(self.peer_path(index)):
            os.unlink(self.peer_path(index))  # a dead shard's socket
        self._processes[index] = subprocess.Popen([sys.executable, "-c", SHARD_COMMAND, json.dumps(settings)],
                                                  env=dict(os.environ, PYTHONPATH=path), stdin=subprocess.DEVNULL)

    def ready(self, index: int) -> bool:
        """Whether shard `index` has loaded its models and listens."""
        try:
            status, _ = peer_request(self.peer_path(index), "GET", "/ready", timeout=5.0)
        except OSError:
            return False
        return status == 200

    async def _wait_ready(self, indices) -> None:
        """Until each of these shards is ready; ConfigError, with its reason, where one exits first."""
        loop = asyncio.get_running_loop()
        waiting = set(indices)
        end = time.monotonic() + START_TIMEOUT_S
        while waiting:
            for index in sorted(waiting):
                process = self._processes[index]
                if process.poll() is not None:
                    raise ConfigError(f"engine process {index} failed to start: {self._failure(index, process)}")
                if await loop.run_in_executor(None, self.ready, index):
                    waiting.discard(index)
            if time.monotonic() > end:
                raise ConfigError(f"engine processes {sorted(waiting)} did not start within {START_TIMEOUT_S:.0f} s")
            if waiting:
                await asyncio.sleep(0.05)

    def _failure(self, index: int, process: subprocess.Popen) -> str:
        try:
            with open(self.failure_path(index), encoding="utf-8") as f:
                return f.read().strip()
        except OSError:  # it died before it could say (killed, or a crash below Python)
            return f"exit code {process.returncode}"

    # ---- life -------------------------------------------------------------------------------------------------
    def render(self) -> str:
        """/metrics: every shard's, summed (blocking: call off the event loop)."""
        texts = []
        for index in sorted(self._processes):
            try:
                texts.append(self.peers.call(index, "GET", "/metrics", timeout=QUERY_TIMEOUT_S).decode())
            except PeerFailed as exc:  # a shard restarting: its share is missing, not the answer
                log.warning("metrics without %s", exc)
        return sum_metrics(texts)

    def get(self, name: str, labels: dict) -> float:
        """One series' value summed over the shards, as Metrics.get reads this process's (0 when
        no shard has it)."""
        wanted = {k: str(v) for k, v in labels.items()}
        for line in self.render().splitlines():
            sample = parse_sample(line)
            if sample is not None and sample[0] == name and sample[1] == wanted:
                return sample[2]
        return 0.0

    def frontend_pids(self) -> list[int]:
        """Every shard's frontend processes' ids."""
        pids = []
        for index in sorted(self._processes):
            try:
                pids += json.loads(self.peers.call(index, "GET", "/frontend_pids", timeout=QUERY_TIMEOUT_S))
            except PeerFailed as exc:
                log.warning("frontend processes of %s unknown", exc)
        return pids

    def index(self) -> list[dict]:
        """The repository index as the first shard that answers sees it."""
        for index in sorted(self._processes):
            try:
                return json.loads(self.peers.call(index, "GET", "/index", timeout=QUERY_TIMEOUT_S))
            except PeerFailed:
                continue
        return []

    # ---- stop -------------------------------------------------------------------------------------------------
    async def stop(self, grace: float) -> None:
        """SIGTERM: each shard drains as `sartor serve` does on Ctrl-C; one that has not exited after
        the grace period is killed."""
        self._restarts.stop()
        for process in self._processes.values():
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        end = time.monotonic() + grace + STOP_EXTRA_S
        while any(p.poll() is None for p in self._processes.values()) and time.monotonic() < end:
            await asyncio.sleep(0.05)
        for process in self._processes.values():
            if process.poll() is None:
                log.warning("engine process (pid %d) did not exit: killed", process.pid)
                process.kill()
                process.wait(5)
        self._processes.clear()
        for sock in self._reserved:
            sock.close()
        shutil.rmtree(self._dir, ignore_errors=True)
