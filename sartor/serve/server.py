"""The server: the repository, the batchers, and the HTTP, gRPC and metrics endpoints on one asyncio
event loop in a background thread. `Server(options).start()` returns once the ports are bound and the
repository's first load is done; `stop()` drains the queues and closes everything."""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from dataclasses import dataclass

import grpc
from aiohttp import web

from ..errors import ConfigError
from .config import check_devices
from .core import InferenceCore
from .frontend_pool import FrontendPool
from .grpc_frontend import GrpcFrontend, generic_handler
from .http_frontend import HttpFrontend, metrics_app
from .metrics import Metrics
from .repository import Repository
from .shards import ShardPool

log = logging.getLogger("sartor.serve")
SHUTDOWN_GRACE_S = 5.0  # how long requests in flight may take to finish once stop() is called
# Binding the ports and starting the frontend processes; a server's own models load after it. Engine
# processes (--engine-processes) load and warm up their models before they listen, which takes as long
# as the models' warm-up (most of a minute for a detector warmed up at many batch sizes), so their start is
# bounded by shards.START_TIMEOUT_S instead.
ENDPOINTS_START_TIMEOUT_S = 60.0
MAX_ENGINE_PROCESSES = 16


@dataclass
class ServeOptions:
    model_repository: str
    host: str = "127.0.0.1"
    http_port: int | None = 8000  # 0: any free port; None: no HTTP endpoint
    grpc_port: int | None = 8001
    metrics_port: int | None = 8002
    devices: list[str] | None = None  # None: each engine on the device kind it was built for
    poll_interval: float | None = 5.0  # seconds between repository scans; None or 0: no polling
    max_queue_size: int = 1024  # per model, unless its config sets default_queue_policy.max_queue_size
    request_timeout: float | None = 60.0  # seconds; a request's `timeout` parameter overrides it
    max_request_bytes: int = 64 << 20
    grpc_max_concurrent: int | None = None
    frontends: int = 1  # >1: HTTP and gRPC in that many processes (frontend_pool.py); 1: in this process
    engine_processes: int = 1  # >1: that many whole servers on the same ports (shards.py), each with `frontends`
    trust: str | None = None  # --trust: a directory of .pub files or one; None: $SARTOR_TRUST, else no trust store
    memory_budget: int | None = None  # bytes per device for all models together (memory_budget.py); None: no limit
    allow_rebuild: bool = False  # a release root's model none of whose releases runs here is rebuilt at start

    def check(self) -> None:
        for label, port in (("--http-port", self.http_port), ("--grpc-port", self.grpc_port),
                            ("--metrics-port", self.metrics_port)):
            if port is not None and not 0 <= port <= 65535:
                raise ConfigError(f"{label} {port} must be in 0..65535")
        if isinstance(self.frontends, bool) or not isinstance(self.frontends, int) or not 1 <= self.frontends <= 64:
            raise ConfigError(f"--frontends {self.frontends} must be in 1..64")
        if (isinstance(self.engine_processes, bool) or not isinstance(self.engine_processes, int)
                or not 1 <= self.engine_processes <= MAX_ENGINE_PROCESSES):
            raise ConfigError(f"--engine-processes {self.engine_processes} must be in 1..{MAX_ENGINE_PROCESSES}")
        if self.engine_processes > 1 and self.frontends < 2:
            raise ConfigError(f"--engine-processes {self.engine_processes} needs --frontends 2 or more: each engine "
                              f"process's frontend processes share the ports")
        if self.memory_budget is not None and self.memory_budget <= 0:
            raise ConfigError(f"--memory-budget {self.memory_budget} must be more than 0 bytes")
        if self.max_queue_size < 1:
            raise ConfigError(f"--max-queue-size {self.max_queue_size} must be at least 1")
        if self.max_request_bytes < 1024:
            raise ConfigError(f"--max-request-bytes {self.max_request_bytes} must be at least 1024")
        if self.poll_interval is not None and self.poll_interval < 0:
            raise ConfigError(f"--poll-interval {self.poll_interval} must be >= 0")
        if self.request_timeout is not None and self.request_timeout < 0:
            raise ConfigError(f"--request-timeout {self.request_timeout} must be >= 0")
        self.devices = check_devices(self.devices)


class Server:
    def __init__(self, options: ServeOptions) -> None:
        options.check()
        self.options = options
        self.metrics = Metrics()
        self.repository = Repository(options.model_repository, self.metrics, devices=options.devices,
                                     max_queue_size=options.max_queue_size, poll_interval=options.poll_interval or None,
                                     trust=options.trust, memory_budget=options.memory_budget,
                                     allow_rebuild=options.allow_rebuild)
        self.core = InferenceCore(self.repository, self.metrics, options.request_timeout or None)
        self.http_port = self.grpc_port = self.metrics_port = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._runners: list[web.AppRunner] = []
        self._grpc: grpc.aio.Server | None = None
        self._pool: FrontendPool | None = None
        self._shards: ShardPool | None = None
        self._stopped = threading.Event()

    # ---- life cycle ---------------------------------------------------------------------------------
    def start(self, load: bool = True) -> "Server":
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True, name="sartor-serve-loop")
        self._thread.start()
        limit = None if self.options.engine_processes > 1 else ENDPOINTS_START_TIMEOUT_S
        starting = asyncio.run_coroutine_threadsafe(self._start_endpoints(), self._loop)
        try:
            try:
                starting.result(limit)
            except concurrent.futures.TimeoutError:
                starting.cancel()  # not left pending on the loop that stop() ends; stop() stops what it started
                raise ConfigError(f"the server's endpoints did not start within {limit:g} s") from None
        except BaseException:
            self.stop()
            raise
        if load and self._shards is None:  # shards load their own
            self.repository.load_all()
            self.repository.start_polling()
        return self

    async def _start_endpoints(self) -> None:
        o = self.options
        if o.engine_processes > 1:
            await self._start_shards()
            return
        sites = []
        in_process = o.frontends == 1
        if o.http_port is not None and in_process:
            sites.append(("http", HttpFrontend(self.core, o.max_request_bytes).app(), o.http_port))
        if o.metrics_port is not None:
            sites.append(("metrics", metrics_app(self.metrics), o.metrics_port))
        for label, app, port in sites:
            await self._site(label, app, port)
        if o.grpc_port is not None and in_process:
            server = grpc.aio.server(options=[("grpc.max_receive_message_length", o.max_request_bytes),
                                              ("grpc.max_send_message_length", -1),
                                              ("grpc.so_reuseport", 0)],
                                     maximum_concurrent_rpcs=o.grpc_max_concurrent)
            server.add_generic_rpc_handlers((generic_handler(GrpcFrontend(self.core)),))
            try:
                bound = server.add_insecure_port(f"{o.host}:{o.grpc_port}")
            except RuntimeError as exc:
                raise ConfigError(f"cannot listen for grpc on {o.host}:{o.grpc_port}: {exc}") from None
            if not bound:
                raise ConfigError(f"cannot listen for grpc on {o.host}:{o.grpc_port}")
            await server.start()
            self._grpc = server
            self.grpc_port = bound
        if not in_process:
            self._pool = FrontendPool(self.core, self.metrics, o)
            await self._pool.start()
            self.http_port, self.grpc_port = self._pool.http_port, self._pool.grpc_port

    async def _site(self, label: str, app: web.Application, port: int) -> None:
        o = self.options
        runner = web.AppRunner(app, access_log=None, handle_signals=False, shutdown_timeout=SHUTDOWN_GRACE_S)
        await runner.setup()
        self._runners.append(runner)
        site = web.TCPSite(runner, o.host, port, reuse_address=True)
        try:
            await site.start()
        except OSError as exc:
            raise ConfigError(f"cannot listen for {label} on {o.host}:{port}: {exc.strerror or exc}") from None
        bound = runner.addresses[-1][1] if runner.addresses else port
        setattr(self, f"{label}_port", bound)

    async def _start_shards(self) -> None:
        """--engine-processes K: this process only starts the shards and sums their metrics."""
        self._shards = ShardPool(self.options)
        await self._shards.start()
        # This process serves nothing: its counters are the shards', summed (Metrics.get and render).
        self.metrics = self._shards
        self.http_port, self.grpc_port = self._shards.http_port, self._shards.grpc_port
        if self.options.metrics_port is not None:
            await self._site("metrics", metrics_app(self.metrics), self.options.metrics_port)

    async def _stop_endpoints(self, grace: float) -> None:
        if self._shards is not None:
            await self._shards.stop(grace)
            self._shards = None
        if self._pool is not None:  # first: its workers' requests in flight need this process
            await self._pool.stop(grace)
            self._pool = None
        if self._grpc is not None:
            await self._grpc.stop(grace)
            self._grpc = None
        for runner in self._runners:
            await runner.cleanup()
        self._runners.clear()

    async def _close_executor(self) -> None:
        await self._loop.shutdown_default_executor()

    def stop(self, grace: float = 5.0) -> None:
        """Refuse new connections, let requests in flight finish (up to `grace` s), drain the queues."""
        if self._stopped.is_set():
            return
        self._stopped.set()
        if self._loop is not None and self._loop.is_running():
            try:
                asyncio.run_coroutine_threadsafe(self._stop_endpoints(grace), self._loop).result(grace + 10)
            except Exception:
                log.exception("stopping the endpoints failed")
        self.repository.shutdown(timeout=grace)
        # After the batchers have drained: a region still leased is closed when its request ends.
        self.core.shared_memory.close()
        if self._loop is not None and self._loop.is_running():
            try:
                asyncio.run_coroutine_threadsafe(self._close_executor(), self._loop).result(grace + 10)
            except Exception:
                log.exception("stopping the executor failed")
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
            if self._thread is not None:
                self._thread.join(10)
            if not self._loop.is_running():
                self._loop.close()

    def wait(self) -> None:
        """Block until stop() (from another thread or a signal handler)."""
        while not self._stopped.wait(0.5):
            pass

    def __enter__(self) -> "Server":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # ---- helpers --------------------------------------------------------------------------------------
    def answers(self, timeout: float = 5.0) -> bool:
        """Whether the event loop that serves the endpoints runs callbacks (the watchdog's check)."""
        loop = self._loop
        if loop is None or not loop.is_running() or self._stopped.is_set():
            return False

        async def nothing() -> bool:
            return True
        try:
            return asyncio.run_coroutine_threadsafe(nothing(), loop).result(timeout)
        except (concurrent.futures.TimeoutError, concurrent.futures.CancelledError, RuntimeError):
            return False

    def index(self) -> list[dict]:
        """The repository index (with --engine-processes K, as the first engine process sees it)."""
        return self._shards.index() if self._shards is not None else self.repository.index()

    @property
    def engine_pids(self) -> list[int]:
        """The engine processes' ids (--engine-processes K > 1), else []."""
        return self._shards.pids if self._shards is not None else []

    @property
    def frontend_pids(self) -> list[int]:
        """The frontend processes' ids (--frontends N > 1), else []."""
        if self._shards is not None:
            return self._shards.frontend_pids()
        return self._pool.pids if self._pool is not None else []

    @property
    def http_url(self) -> str:
        return f"{self.options.host}:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"{self.options.host}:{self.grpc_port}"
