"""The main process's side of `sartor serve --frontends N`: N frontend processes (workers.py) that
listen on the HTTP and gRPC ports together, and what they need from here.

The main process keeps the repository, the batchers, the shared-memory registry and the metrics port.
Each worker connects to one Unix-domain socket here (its channel, ipc.py) and sends inference
requests; they go through `InferenceCore.infer` as the in-process frontends' do. Other calls reach this
process's own HTTP and gRPC frontends on private Unix-domain sockets (the workers pass them through).

Ports: each requested port is first bound here (SO_REUSEPORT, not listening), so that port 0 becomes
one concrete port for every worker and a port in use fails at start; the socket is kept until stop.
A worker that dies is restarted under the same index (the others keep serving meanwhile).
"""
from __future__ import annotations

import asyncio
import logging
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc
from aiohttp import web

from ..errors import ConfigError, SartorError
from .core import GroupMember
from .grpc_frontend import GrpcFrontend, generic_handler
from .http_frontend import HttpFrontend
from .errors import InvalidRequest
from .restarts import Restarts
from .ipc import (REPLY_PAYLOAD_LIMIT, Channel, decode_regions, decode_tensors, error_header, frame_limit,
                  group_members, grouped_frames, reply, request_payload_limit)
from .workers import UNLIMITED

log = logging.getLogger("sartor.serve")
START_TIMEOUT_S = 50.0  # a worker imports grpc, aiohttp and sartor (torch) before it binds
STOP_EXTRA_S = 5.0  # past the grace period, before a worker that has not exited is terminated
# A fresh interpreter, as multiprocessing's "spawn" starts one, but without re-running the parent's
# __main__ module in it (an unguarded script would start servers recursively) and without pickling:
# the settings travel as JSON on the command line.
WORKER_COMMAND = "import json, sys; from sartor.serve.workers import worker_main; worker_main(json.loads(sys.argv[1]))"


def reserve_port(host: str, port: int, label: str) -> socket.socket:
    """A bound, non-listening SO_REUSEPORT socket on (host, port): the workers bind beside it."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as exc:
        raise ConfigError(f"cannot listen for {label} on {host}:{port}: {exc.strerror or exc}") from None
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind(address)
    except OSError as exc:
        sock.close()
        raise ConfigError(f"cannot listen for {label} on {host}:{port}: {exc.strerror or exc}") from None
    return sock


def reserve_ports(options) -> tuple[list[socket.socket], int | None, int | None]:
    """The reserved sockets (kept until stop) and the HTTP and gRPC ports they hold, None where the
    endpoint is off: port 0 resolved to the one port every process that serves binds."""
    reserved, ports = [], []
    for label, port in (("http", options.http_port), ("grpc", options.grpc_port)):
        if port is None:
            ports.append(None)
            continue
        reserved.append(reserve_port(options.host, port, label))
        ports.append(reserved[-1].getsockname()[1])
    return reserved, ports[0], ports[1]


class _Link:
    """One worker's channel, as the main process sees it: its requests in flight, by id. Grouped
    requests ("g") are tracked as GroupMembers without a task each; single ones ("i", and members
    that must retry across a version swap) as tasks. Every answer of one loop iteration leaves in one
    grouped frame."""

    def __init__(self, pool: "FrontendPool") -> None:
        self.pool = pool
        self.index: int | None = None
        # A worker keeps its request frames within this limit; a larger frame is a corrupt stream.
        self.channel = Channel(self.on_frame, self.on_lost,
                               max_frame=frame_limit(request_payload_limit(pool.options.max_request_bytes)))
        self.tasks: dict[int, asyncio.Task] = {}
        self.members: dict[int, GroupMember] = {}
        self.series: tuple = ()  # its metrics key, once it said hello
        self._arrived: list[GroupMember] = []  # decoded, started once the frames of this read are in
        self._answers: list[tuple[dict, list]] = []  # (reply or error header, payload buffers)

    def on_frame(self, header: dict, payload: memoryview) -> None:
        kind = header.get("k")
        if kind == "g":
            self.on_group(header, payload)
        elif kind == "i":
            self.pool.metrics.inc("sartor_frontend_request_count", self.series)
            self.start_task(header["id"], self.infer(header, payload))
        elif kind == "c":
            request_id = header.get("id")
            task = self.tasks.get(request_id)
            if task is not None:
                task.cancel()
            elif request_id in self.members:
                self.pool.core.cancel_member(self.members[request_id])
        elif kind == "hello":
            self.index = int(header["index"])
            self.series = self.pool.metrics.key({"frontend": str(self.index)})
            self.pool.hello(self, int(header["pid"]))
        elif kind == "failed":
            self.pool.failures[int(header["index"])] = str(header.get("message", ""))

    def start_task(self, request_id: int, coroutine) -> None:
        task = asyncio.get_running_loop().create_task(coroutine)
        self.tasks[request_id] = task
        task.add_done_callback(lambda _: self.tasks.pop(request_id, None))

    # ---- grouped requests ---------------------------------------------------------------------------
    def on_group(self, header: dict, payload: memoryview) -> None:
        entries = group_members(header, payload)
        self.pool.metrics.inc("sartor_frontend_request_count", self.series, len(entries))
        group = []
        for entry, part in entries:
            request_id = entry["id"]
            try:
                inputs = decode_tensors(entry["inputs"], part)
            except Exception as exc:  # noqa: BLE001 (this member's answer; the others go on)
                self.answered_with(request_id, exc)
                continue
            member = GroupMember(request_id, entry["model"], entry["version"], inputs, entry["outputs"] or None,
                                 entry["timeout"], entry["deadline"], decode_regions(entry["regions"]))
            self.members[request_id] = member
            group.append(member)
        # Started together with the other groups of this socket read: a frontend's wake-up often
        # holds one request, a read of the channel many frames.
        if group and not self._arrived:
            asyncio.get_running_loop().call_soon(self._start_arrived)
        self._arrived.extend(group)

    def _start_arrived(self) -> None:
        arrived, self._arrived = self._arrived, []
        for member in self.pool.core.start_group(arrived, self.member_answered):
            self.members.pop(member.key, None)
            self.start_task(member.key, self.infer_member(member))

    def member_answered(self, member: GroupMember, answer) -> None:
        if self.members.get(member.key) is member:
            del self.members[member.key]
        if answer is not None:  # None: cancelled, its caller went away
            self.answered_with(member.key, answer)

    async def infer_member(self, member: GroupMember) -> None:
        try:
            outcome = await self.pool.core.infer_member(member)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 (the request's answer)
            self.answered_with(member.key, exc)
            return
        self.answered_with(member.key, outcome)

    # ---- single requests ------------------------------------------------------------------------------
    async def infer(self, header: dict, payload: memoryview) -> None:
        try:
            inputs = decode_tensors(header["inputs"], payload)
            outcome = await self.pool.core.infer(header["model"], header["version"], inputs, header["outputs"] or None,
                                                 header["timeout"], header["deadline"],
                                                 output_regions=decode_regions(header["regions"]))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 (the request's answer)
            self.answered_with(header["id"], exc)
            return
        self.answered_with(header["id"], outcome)

    # ---- answers --------------------------------------------------------------------------------------
    def answered_with(self, request_id: int, answer) -> None:
        """Queue the reply (an InferOutcome) or error of a request; those of one loop iteration leave
        together in one grouped frame."""
        if isinstance(answer, BaseException):
            if not isinstance(answer, SartorError):
                log.error("inference for a frontend failed", exc_info=answer)
            self._answers.append((error_header(request_id, answer), []))
        else:
            try:
                header, buffers = reply(request_id, answer)
            except Exception as exc:  # noqa: BLE001 (an output that cannot cross the channel)
                self.answered_with(request_id, exc)
                return
            size = sum(memoryview(b).nbytes for b in buffers)
            if size > REPLY_PAYLOAD_LIMIT:
                self.answered_with(request_id, InvalidRequest(
                    f"the outputs ({size} bytes) exceed the {REPLY_PAYLOAD_LIMIT}-byte limit of the frontend "
                    "channel; ask for them in shared memory"))
                return
            self._answers.append((header, buffers))
        if len(self._answers) == 1:
            asyncio.get_running_loop().call_soon(self._send_answers)

    def _send_answers(self) -> None:
        answers, self._answers = self._answers, []
        if len(answers) == 1:
            self.channel.send(*answers[0])
            return
        for header, buffers in grouped_frames("G", answers, REPLY_PAYLOAD_LIMIT):
            self.channel.send(header, buffers)

    def on_lost(self) -> None:
        for task in list(self.tasks.values()):
            task.cancel()  # nobody is left to answer
        for member in list(self.members.values()):
            self.pool.core.cancel_member(member)
        self.pool.lost(self)


class FrontendPool:
    def __init__(self, core, metrics, options) -> None:
        self.core, self.metrics, self.options = core, metrics, options
        self.failures: dict[int, str] = {}
        self._dir = tempfile.mkdtemp(prefix="sartor-serve-")
        self._reserved: list[socket.socket] = []
        self._processes: dict[int, subprocess.Popen] = {}
        self._pids: dict[int, int] = {}
        self._links: set[_Link] = set()
        self._ipc_server: asyncio.AbstractServer | None = None
        self._runner: web.AppRunner | None = None
        self._grpc: grpc.aio.Server | None = None
        self._started = False  # a worker that dies before then fails start(); after, it is restarted
        self._restarts = Restarts("frontend", self._processes, self._spawn, lambda index: self._pids.pop(index, None))
        self.http_port: int | None = None
        self.grpc_port: int | None = None

    def _path(self, name: str) -> str:
        return os.path.join(self._dir, name)

    @property
    def pids(self) -> list[int]:
        """The frontend processes' ids, by index (those that said hello)."""
        return [self._pids[i] for i in sorted(self._pids)]

    # ---- start ------------------------------------------------------------------------------------------
    async def start(self) -> None:
        o = self.options
        self._reserved, self.http_port, self.grpc_port = reserve_ports(o)
        await self._start_control()
        self._ipc_server = await asyncio.get_running_loop().create_unix_server(self._connection, self._path("ipc"))
        for index in range(o.frontends):
            self._spawn(index)
        end = time.monotonic() + START_TIMEOUT_S
        while len(self._pids) < o.frontends:
            for index, process in self._processes.items():
                if process.poll() is not None and index not in self._pids:
                    detail = self.failures.get(index) or f"exit code {process.returncode}"
                    raise ConfigError(f"frontend process {index} failed to start: {detail}")
            if time.monotonic() > end:
                raise ConfigError(f"frontend processes did not start within {START_TIMEOUT_S:.0f} s")
            await asyncio.sleep(0.02)
        self._started = True
        self._restarts.start()

    async def _start_control(self) -> None:
        """This process's own frontends, reachable by the workers only."""
        o = self.options
        self._runner = web.AppRunner(HttpFrontend(self.core, o.max_request_bytes).app(), access_log=None,
                                     handle_signals=False)
        await self._runner.setup()
        await web.UnixSite(self._runner, self._path("http")).start()
        self._grpc = grpc.aio.server(options=UNLIMITED)
        self._grpc.add_generic_rpc_handlers((generic_handler(GrpcFrontend(self.core)),))
        self._grpc.add_insecure_port("unix:" + self._path("grpc"))
        await self._grpc.start()

    def _connection(self) -> Channel:
        link = _Link(self)
        self._links.add(link)
        return link.channel

    def _spawn(self, index: int) -> None:
        o = self.options
        settings = {"index": index, "ipc": self._path("ipc"), "control_http": self._path("http"),
                    "control_grpc": self._path("grpc"), "host": o.host, "http_port": self.http_port,
                    "grpc_port": self.grpc_port, "max_request_bytes": o.max_request_bytes,
                    "max_queue_size": o.max_queue_size,
                    "grpc_max_concurrent": o.grpc_max_concurrent, "grace": 5.0,
                    "log_level": logging.getLogger("sartor").getEffectiveLevel()}
        package_root = str(Path(__file__).resolve().parents[2])  # where `import sartor` found this copy
        path = os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")]))
        # No GPU is visible to a worker: CUDA cannot be initialised there, whatever gets imported.
        env = dict(os.environ, PYTHONPATH=path, CUDA_VISIBLE_DEVICES="")
        self._processes[index] = subprocess.Popen([sys.executable, "-c", WORKER_COMMAND, json.dumps(settings)],
                                                  env=env, stdin=subprocess.DEVNULL)

    # ---- life -------------------------------------------------------------------------------------------------
    def hello(self, link: _Link, pid: int) -> None:
        self._pids[link.index] = pid
        log.info("frontend %d (pid %d) listening", link.index, pid)

    def lost(self, link: _Link) -> None:
        self._links.discard(link)

    # ---- stop -------------------------------------------------------------------------------------------------
    async def stop(self, grace: float) -> None:
        """Workers stop taking connections and finish what they run (this process still answers them),
        then exit; those that do not are terminated, then killed."""
        self._restarts.stop()
        for link in list(self._links):
            link.channel.send({"k": "stop", "grace": grace})
        for index, process in self._processes.items():
            if index not in self._pids and process.poll() is None:
                process.terminate()  # not serving yet (a failed start): nothing to drain
        await self._wait_exit(grace + STOP_EXTRA_S)
        for signal_them in ("terminate", "kill"):
            alive = [p for p in self._processes.values() if p.poll() is None]
            if not alive:
                break
            log.warning("%d frontend process(es) did not exit: %s", len(alive), signal_them)
            for process in alive:
                getattr(process, signal_them)()
            await self._wait_exit(2.0)
        self._processes.clear()
        self._pids.clear()
        for link in list(self._links):
            link.channel.close()
        if self._ipc_server is not None:
            self._ipc_server.close()
        if self._grpc is not None:
            await self._grpc.stop(0)
        if self._runner is not None:
            await self._runner.cleanup()
        for sock in self._reserved:
            sock.close()
        shutil.rmtree(self._dir, ignore_errors=True)

    async def _wait_exit(self, timeout: float) -> None:
        end = time.monotonic() + timeout
        while any(p.poll() is None for p in self._processes.values()) and time.monotonic() < end:
            await asyncio.sleep(0.02)
