"""What keeps the engine processes of `sartor serve --engine-processes K` in step (shards.py starts them).

The kernel hands each client connection to any shard's frontends, and a client registers a
shared-memory region (or loads a model) through one connection and infers through others. So each
registration, unregistration, load and unload is applied in the shard that received it and then in
every sibling before it is answered, and model statistics and metrics are summed over the shards.

Each shard answers its siblings on a Unix socket of its own (PeerServer: HTTP with JSON bodies,
served by threads of its own, not by the event loop). A shard that waits on a sibling therefore
never waits on an event loop that may itself be waiting on this shard.
"""
from __future__ import annotations

import base64
import http.client
import json
import logging
import socket
import socketserver
import threading
import urllib.parse
from http.server import BaseHTTPRequestHandler
from typing import Callable

from .errors import ServeError

log = logging.getLogger("sartor.serve")
PEER_TIMEOUT_S = 600.0  # a sibling's model load warms every profile up, which can take minutes
QUERY_TIMEOUT_S = 10.0  # statistics, metrics, the index: a sibling that takes longer is left out


class PeerFailed(ServeError):
    """A sibling engine process refused or failed what this one did: the change is rolled back."""
    http_status = 500
    grpc_code = "INTERNAL"


class _UnixConnection(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: float) -> None:
        super().__init__("localhost", timeout=timeout)
        self._path = path

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(self.timeout)
        self.sock.connect(self._path)


def peer_request(path: str, method: str, route: str, body: dict | None = None,
                 timeout: float = PEER_TIMEOUT_S) -> tuple[int, bytes]:
    """(status, body) of one request to the PeerServer on `path` (blocking: call off the event loop,
    or where a short wait is acceptable)."""
    connection = _UnixConnection(path, timeout)
    try:
        payload = json.dumps(body).encode() if body is not None else None
        connection.request(method, route, body=payload, headers={"Content-Type": "application/json"})
        response = connection.getresponse()
        return response.status, response.read()
    finally:
        connection.close()


def _error_text(status: int, data: bytes) -> str:
    try:
        return json.loads(data)["error"]
    except (ValueError, KeyError, TypeError):
        return f"status {status}"


class Siblings:
    """The other shards' PeerServer sockets, by shard index."""

    def __init__(self, paths: dict[int, str]) -> None:
        self.paths = dict(paths)

    def call(self, index: int, method: str, route: str, body: dict | None = None,
             timeout: float = PEER_TIMEOUT_S) -> bytes:
        try:
            status, data = peer_request(self.paths[index], method, route, body, timeout)
        except OSError as exc:
            raise PeerFailed(f"engine process {index} did not answer: {exc}") from None
        if status != 200:
            raise PeerFailed(f"engine process {index}: {_error_text(status, data)}")
        return data

    def statistics(self, rows: list[dict], name: str | None, version: str | None) -> list[dict]:
        """`rows` (this shard's statistics) summed with every sibling's."""
        shards = [rows]
        query = urllib.parse.urlencode({k: v for k, v in (("name", name), ("version", version)) if v})
        for index in sorted(self.paths):
            try:
                shards.append(json.loads(self.call(index, "GET", "/statistics?" + query, timeout=QUERY_TIMEOUT_S)))
            except PeerFailed as exc:  # a sibling restarting: its share is missing, not the answer
                log.warning("statistics without %s", exc)
        return sum_statistics(shards)

    def apply_everywhere(self, route: str, body: dict, undo_route: str | None = None,
                         undo_body: dict | None = None, undo_here: Callable[[], None] | None = None) -> None:
        """POST `route` to every sibling (this shard has applied it already). Where one fails, the
        siblings that applied it get `undo_route`, this shard runs `undo_here`, and PeerFailed is raised."""
        done = []
        for index in sorted(self.paths):
            try:
                self.call(index, "POST", route, body)
            except PeerFailed:
                if undo_route is not None:
                    for applied in done:
                        try:
                            self.call(applied, "POST", undo_route, undo_body)
                        except PeerFailed as exc:
                            log.error("undoing %s: %s", route, exc)
                if undo_here is not None:
                    undo_here()
                raise
            done.append(index)


ROUTE_KINDS = {"/register_system": "system", "/register_cuda": "cuda"}


class RegistrationLog:
    """The shared-memory registrations in force in this shard, as the requests that re-create them:
    a shard that restarts replays a sibling's (replay_registrations)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entries: dict[str, tuple[str, dict]] = {}

    def added(self, route: str, body: dict) -> None:
        with self._lock:
            self._entries[body["name"]] = (route, body)

    def removed(self, kind: str, name: str | None) -> None:
        with self._lock:
            for entry_name, (route, _) in list(self._entries.items()):
                if ROUTE_KINDS[route] == kind and name in (None, entry_name):
                    del self._entries[entry_name]

    def entries(self) -> list[tuple[str, dict]]:
        with self._lock:
            return list(self._entries.values())


def apply_registration(registry, route: str, body: dict) -> None:
    """One registration request (a route and its body, as siblings send it) on `registry`."""
    if route == "/register_system":
        registry.register_system(body["name"], body["key"], body["offset"], body["byte_size"])
    else:
        registry.register_cuda(body["name"], base64.b64decode(body["raw_handle"]), body["device_id"],
                               body["byte_size"])


def replay_registrations(registry, registrations: RegistrationLog, siblings: Siblings) -> int:
    """Register here what the first sibling that answers has registered (a shard that restarted:
    clients registered their regions once, through whichever shard). Returns how many."""
    for index in sorted(siblings.paths):
        try:
            entries = json.loads(siblings.call(index, "GET", "/registrations", timeout=QUERY_TIMEOUT_S))
        except PeerFailed:
            continue
        for route, body in entries:
            try:
                apply_registration(registry, route, body)
                registrations.added(route, body)
            except ServeError as exc:
                log.warning("region '%s' not registered again here: %s", body["name"], exc)
        return len(entries)
    return 0


class MirroredRegistry:
    """The shared-memory registry of one shard, whose registrations and unregistrations its siblings
    apply too; reads (leases, status) stay local."""

    def __init__(self, local, siblings: Siblings, registrations: RegistrationLog) -> None:
        self.local = local
        self.siblings = siblings
        self.registrations = registrations

    def __getattr__(self, name: str):
        return getattr(self.local, name)

    def _everywhere(self, route: str, body: dict) -> None:
        apply_registration(self.local, route, body)
        kind = ROUTE_KINDS[route]
        self.siblings.apply_everywhere(route, body, "/unregister", {"kind": kind, "name": body["name"]},
                                       lambda: self.local.unregister(kind, body["name"]))
        self.registrations.added(route, body)

    def register_system(self, name: str, key: str, offset: int, byte_size: int) -> None:
        self._everywhere("/register_system", {"name": name, "key": key, "offset": offset, "byte_size": byte_size})

    def register_cuda(self, name: str, raw_handle: bytes, device_id: int, byte_size: int) -> None:
        if not isinstance(raw_handle, (bytes, bytearray)):  # the registry's own message for it
            self.local.register_cuda(name, raw_handle, device_id, byte_size)
        self._everywhere("/register_cuda", {"name": name, "raw_handle": base64.b64encode(bytes(raw_handle)).decode(),
                                            "device_id": device_id, "byte_size": byte_size})

    def unregister(self, kind: str, name: str | None = None) -> list[str]:
        removed = self.local.unregister(kind, name)
        self.registrations.removed(kind, name)
        self.siblings.apply_everywhere("/unregister", {"kind": kind, "name": name})
        return removed


def _sum_into(total, part):
    """`part` added to `total`, leaf by leaf (numbers summed; the same keys on both sides)."""
    if isinstance(total, dict):
        return {key: _sum_into(total[key], part[key]) if key in part else total[key] for key in total}
    if isinstance(total, (int, float)) and not isinstance(total, bool):
        return total + part
    return total


def sum_statistics(rows: list[list[dict]]) -> list[dict]:
    """Triton's model statistics of several shards as one: counts and durations summed per model
    version, the last inference the latest of them."""
    merged: dict[tuple, dict] = {}
    for shard in rows:
        for row in shard:
            key = (row["name"], row["version"])
            if key not in merged:
                merged[key] = row
                continue
            latest = max(merged[key]["last_inference"], row["last_inference"])
            merged[key] = dict(_sum_into(merged[key], row), last_inference=latest)
    return [merged[key] for key in sorted(merged)]


def sum_metrics(texts: list[str]) -> str:
    """Prometheus text of several shards as one: each series' samples summed (the counters, the
    histograms' buckets, sums and counts, and the gauges, which count requests pending and device
    memory held by each shard), the HELP and TYPE lines once."""
    order: list[str] = []
    samples: dict[str, float] = {}
    for text in texts:
        for line in text.splitlines():
            if not line:
                continue
            if line.startswith("#"):
                if line not in samples:
                    samples[line] = None
                    order.append(line)
                continue
            series, _, value = line.rpartition(" ")
            if series not in samples:
                samples[series] = 0.0
                order.append(series)
            samples[series] += float(value)
    lines = [key if samples[key] is None else f"{key} {_number(samples[key])}" for key in order]
    return "\n".join(lines) + "\n"


def parse_sample(line: str) -> tuple[str, dict, float] | None:
    """(name, labels, value) of one Prometheus sample line as metrics.py writes it, or None (a
    comment or a blank line)."""
    if not line or line.startswith("#"):
        return None
    series, _, value = line.rpartition(" ")
    name, _, labels = series.partition("{")
    pairs = {}
    for pair in filter(None, labels.rstrip("}").split('",')):
        key, _, text = pair.partition("=")
        pairs[key] = text.strip('"')
    return name, pairs, float(value)


def _number(value: float) -> str:
    return str(int(value)) if value == int(value) else repr(value)


class PeerServer:
    """This shard's answers to its siblings (and to the parent process, which asks for metrics and
    readiness) on a Unix socket: the registry's and repository's own operations, unmirrored, this
    shard's statistics and metrics, and whether it has started."""

    def __init__(self, path: str, registry, registrations: RegistrationLog, repository,
                 statistics: Callable[..., list[dict]], render_metrics: Callable[[], str],
                 frontend_pids: Callable[[], list[int]]) -> None:
        self.path = path
        self.ready = threading.Event()

        def register(route: str, body: dict) -> None:
            apply_registration(registry, route, body)
            registrations.added(route, body)

        def unregister(body: dict) -> None:
            registry.unregister(body["kind"], body["name"])
            registrations.removed(body["kind"], body["name"])

        routes = {
            "/register_system": lambda b: register("/register_system", b),
            "/register_cuda": lambda b: register("/register_cuda", b),
            "/unregister": unregister,
            "/load": lambda b: repository.load(b["name"]),
            "/unload": lambda b: repository.unload(b["name"]),
        }
        queries = {
            "/statistics": lambda q: statistics(q.get("name") or None, q.get("version") or None),
            "/registrations": lambda q: registrations.entries(),
            "/index": lambda q: repository.index(),
            "/frontend_pids": lambda q: frontend_pids(),
        }
        ready = self.ready

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:  # the server's log has its own lines
                pass

            def _answer(self, status: int, body: bytes, kind: str = "application/json") -> None:
                self.send_response(status)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def _fail(self, exc: Exception) -> None:
                self._answer(exc.http_status if isinstance(exc, ServeError) else 500,
                             json.dumps({"error": str(exc)}).encode())

            def do_GET(self) -> None:
                url = urllib.parse.urlsplit(self.path)
                query = dict(urllib.parse.parse_qsl(url.query))
                try:
                    if url.path == "/ready":
                        self._answer(200 if ready.is_set() else 503, b"{}")
                    elif url.path in queries:
                        self._answer(200, json.dumps(queries[url.path](query)).encode())
                    elif url.path == "/metrics":
                        self._answer(200, render_metrics().encode(), "text/plain; version=0.0.4")
                    else:
                        self._answer(404, json.dumps({"error": f"no route {url.path}"}).encode())
                except Exception as exc:  # noqa: BLE001 (answered to the sibling)
                    self._fail(exc)

            def do_POST(self) -> None:
                route = routes.get(self.path)
                if route is None:
                    self._answer(404, json.dumps({"error": f"no route {self.path}"}).encode())
                    return
                try:
                    body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
                    route(body)
                    self._answer(200, b"{}")
                except Exception as exc:  # noqa: BLE001 (answered to the sibling)
                    self._fail(exc)

        class UnixServer(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
            daemon_threads = True

        self._server = UnixServer(path, Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True, name="sartor-serve-peers")

    def start(self) -> "PeerServer":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def link_shard(core, siblings: Siblings, path: str, frontend_pids: Callable[[], list[int]]) -> PeerServer:
    """Make `core` (one shard's InferenceCore) apply its registrations, loads and unloads in the
    siblings too and sum its statistics over all shards; returns its PeerServer on `path` (not
    started), which answers the siblings with the unmirrored operations. Registrations a sibling
    holds already are replayed here first (a restarted shard)."""
    local_registry = core.shared_memory
    registrations = RegistrationLog()
    replayed = replay_registrations(local_registry, registrations, siblings)
    if replayed:
        log.info("%d shared-memory region(s) registered again from a sibling", replayed)
    core.shared_memory = MirroredRegistry(local_registry, siblings, registrations)
    core.siblings = siblings
    return PeerServer(path, local_registry, registrations, core.repository, core.local_statistics,
                      core.metrics.render, frontend_pids)
