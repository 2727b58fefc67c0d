"""A frontend process of `sartor serve --frontends N`: a fresh interpreter that frontend_pool.py starts
(as multiprocessing's "spawn" would, never a fork of the process that holds CUDA state).

It listens on the server's HTTP and gRPC ports beside its siblings (SO_REUSEPORT: the kernel spreads
connections), decodes inference requests with the same code as the in-process frontends, and hands
them to the main process over its channel (ipc.py): body tensors as raw bytes, shared-memory tensors
as references. The main process validates, batches, runs and replies; errors come back as the same
ServeError classes, so status codes and messages match the in-process server.

Everything else (health, metadata, config, statistics, repository, shared-memory registration, the
image route) is state of the main process: those requests are passed through unchanged to the main
process's own HTTP and gRPC frontends on private Unix-domain sockets, and their answers back.

The process never loads an engine and never initialises CUDA (it starts with CUDA_VISIBLE_DEVICES
empty).
"""
from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import re
import signal

import grpc
from aiohttp import ClientSession, ClientTimeout, UnixConnector, web
from tritonclient.grpc import service_pb2 as pb
from yarl import URL

from .admission import BodyAdmission
from .errors import InvalidRequest, ModelUnavailable
from .grpc_frontend import SERVICE, GrpcFrontend, safe_deserializer, wrap_unary_handler
from .http_frontend import HttpFrontend, error_middleware
from .ipc import (Channel, RemoteInternalError, encode_regions, encode_tensors, error_of, group_members,
                  grouped_frames, outcome_of, payload_bytes, request_payload_limit)

log = logging.getLogger("sartor.serve")
LOCAL_GRPC = ("ModelInfer", "ModelStreamInfer")
IMAGE_ROUTE = re.compile(r"/v2/models/([^/]+)(?:/versions/([^/]+))?/infer_image")
REQUEST_HEADERS = ("Content-Type", "Inference-Header-Content-Length", "Accept-Encoding")
RESPONSE_HEADERS = ("Content-Type", "Content-Encoding", "Inference-Header-Content-Length", "Allow")
UNLIMITED = [("grpc.max_receive_message_length", -1), ("grpc.max_send_message_length", -1)]


class RemoteCore:
    """`InferenceCore.infer` as the frontends call it, answered by the main process. The requests made
    in one loop iteration leave in one grouped frame (more where they exceed `payload_limit`, which
    the main process's channel enforces)."""

    def __init__(self, payload_limit: int, max_queue_size: int = 1024) -> None:
        self.payload_limit = payload_limit
        # The queues are the main process's: here, bodies being received are bounded per model by
        # max_queue_size alone (admission.py), so this process holds at most that many per model.
        self.max_queue_size = max_queue_size
        self.admission = BodyAdmission()
        self.channel: Channel | None = None
        self._ids = itertools.count(1)
        self._waiting: dict[int, asyncio.Future] = {}
        self._unsent: dict[int, tuple[dict, list]] = {}  # id -> (request header, payload buffers)
        self.stop_requested = asyncio.Event()
        self.grace = 5.0

    def admit(self, name: str, version: str | None):
        return self.admission.reading((name, version), f"model '{name}'", lambda: 0, self.max_queue_size)

    async def infer(self, name: str, version: str | None, inputs: dict, outputs: list[str] | None = None,
                    timeout_us=None, client_deadline_s: float | None = None, output_regions: dict | None = None):
        channel = self.channel
        if channel is None or channel.transport is None:
            raise ModelUnavailable("the server is shutting down")
        described, buffers = encode_tensors(inputs)
        if payload_bytes(described) > self.payload_limit:
            raise InvalidRequest(f"the request's tensors ({payload_bytes(described)} bytes) exceed the "
                                 f"{self.payload_limit}-byte limit of the frontend channel")
        request_id = next(self._ids)
        future = asyncio.get_running_loop().create_future()
        self._waiting[request_id] = future
        self._unsent[request_id] = ({"k": "i", "id": request_id, "model": name, "version": version,
                                     "inputs": described, "outputs": outputs,
                                     "regions": encode_regions(output_regions), "timeout": timeout_us,
                                     "deadline": client_deadline_s}, buffers)
        if len(self._unsent) == 1:
            asyncio.get_running_loop().call_soon(self._send_requests)
        try:
            return await future
        except asyncio.CancelledError:
            if self._unsent.pop(request_id, None) is None:
                channel.send({"k": "c", "id": request_id})  # the main process drops it from the queue
            raise
        finally:
            self._waiting.pop(request_id, None)

    def _send_requests(self) -> None:
        unsent, self._unsent = self._unsent, {}
        if not unsent or self.channel is None:
            return
        for header, buffers in grouped_frames("g", list(unsent.values()), self.payload_limit):
            self.channel.send(header, tuple(buffers))

    def on_frame(self, header: dict, payload: memoryview) -> None:
        kind = header.get("k")
        if kind == "G":
            self._answer_group(header, payload)
        elif kind == "stop":
            self.grace = float(header.get("grace", self.grace))
            self.stop_requested.set()
        else:
            self._answer(header, payload)

    def _answer_group(self, header: dict, payload: memoryview) -> None:
        try:
            members = group_members(header, payload)
        except Exception as exc:  # noqa: BLE001 (which bytes are whose is unknown: all it names fail)
            entries = header.get("rs")
            named = [e.get("id") for e in entries if isinstance(e, dict)] if isinstance(entries, list) else []
            self._fail(named, exc)
            return
        for entry, part in members:
            self._answer(entry, part)

    def _answer(self, header: dict, payload: memoryview) -> None:
        request_id = header.get("id")
        future = self._waiting.get(request_id) if isinstance(request_id, int) else None
        if future is None or future.done():
            return  # its caller went away
        kind = header.get("k")
        try:
            if kind == "r":
                # The outputs view the frame's buffer; it lives as long as they do.
                future.set_result(outcome_of(header, payload))
            elif kind == "e":
                future.set_exception(error_of(header))
            else:
                raise ValueError(f"an answer of kind {kind!r}")
        except Exception as exc:  # noqa: BLE001 (the request fails rather than wait forever)
            self._fail([request_id], exc)

    def _fail(self, request_ids: list, exc: Exception) -> None:
        """Requests whose answer arrived but cannot be read: each fails with a 500 / INTERNAL."""
        message = " ".join(f"internal error: the main process's answer cannot be read: "
                           f"{type(exc).__name__}: {exc}".split())
        log.error("%s (request ids %s)", message, request_ids)
        for request_id in request_ids:
            future = self._waiting.pop(request_id, None) if isinstance(request_id, int) else None
            if future is not None and not future.done():
                future.set_exception(RemoteInternalError(message))

    def on_lost(self) -> None:
        for future in self._waiting.values():
            if not future.done():
                future.set_exception(ModelUnavailable("the server's main process went away"))
        self.stop_requested.set()


# ---- what is passed through to the main process ------------------------------------------------------------

class HttpPassThrough:
    """Non-inference HTTP requests, sent as they came to the main process's HTTP frontend."""

    def __init__(self, frontend: HttpFrontend, socket_path: str) -> None:
        self.frontend = frontend
        self.socket_path = socket_path
        self.session: ClientSession | None = None

    async def handle(self, request: web.Request) -> web.Response:
        if self.session is None:
            self.session = ClientSession(connector=UnixConnector(path=self.socket_path), auto_decompress=False,
                                         timeout=ClientTimeout(total=None), skip_auto_headers=("Accept-Encoding",
                                                                                               "User-Agent"))
        image = IMAGE_ROUTE.fullmatch(request.path) if request.method == "POST" else None
        # An image body is held, until its answer, like an inference body (admission.py).
        held = self.frontend.core.admit(image.group(1), image.group(2)) if image else contextlib.nullcontext()
        with held:
            body = await self.frontend._body(request)  # the same size limit and messages as the frontend's own
            headers = {k: request.headers[k] for k in REQUEST_HEADERS if k in request.headers}
            async with self.session.request(request.method, URL("http://sartor" + request.raw_path, encoded=True),
                                            data=body, headers=headers) as answer:
                payload = await answer.read()
                kept = {k: answer.headers[k] for k in RESPONSE_HEADERS if k in answer.headers}
                return web.Response(status=answer.status, body=payload, headers=kept)

    async def close(self, app=None) -> None:
        if self.session is not None:
            await self.session.close()
            self.session = None


def http_app(core: RemoteCore, max_request_bytes: int, control_socket: str) -> web.Application:
    frontend = HttpFrontend(core, max_request_bytes)
    passthrough = HttpPassThrough(frontend, control_socket)
    app = web.Application(client_max_size=max_request_bytes, middlewares=[error_middleware])
    for prefix in ("/v2/models/{model}", "/v2/models/{model}/versions/{version}"):
        app.router.add_post(prefix + "/infer", frontend.infer)
    app.router.add_route("*", "/{tail:.*}", passthrough.handle)
    app.on_cleanup.append(passthrough.close)
    return app


def _pass_through(channel: grpc.aio.Channel, method: str):
    call = channel.unary_unary(f"/{SERVICE}/{method}")  # bytes in, bytes out

    async def handler(request: bytes, context):
        try:
            return await call(request, timeout=context.time_remaining())
        except grpc.aio.AioRpcError as exc:
            await context.abort(exc.code(), exc.details() or "")
    return handler


def grpc_handler(core: RemoteCore, control: grpc.aio.Channel):
    """ModelInfer and ModelStreamInfer decoded here (GrpcFrontend on the RemoteCore); every other method
    passed through as bytes to the main process's gRPC frontend."""
    servicer = GrpcFrontend(core)
    handlers = {}
    for method in pb.DESCRIPTOR.services_by_name["GRPCInferenceService"].methods:
        if method.name not in LOCAL_GRPC:
            handlers[method.name] = grpc.unary_unary_rpc_method_handler(_pass_through(control, method.name))
            continue
        kwargs = {"request_deserializer": safe_deserializer(getattr(pb, method.input_type.name)),
                  "response_serializer": getattr(pb, method.output_type.name).SerializeToString}
        if method.name == "ModelStreamInfer":
            handlers[method.name] = grpc.stream_stream_rpc_method_handler(servicer.ModelStreamInfer, **kwargs)
        else:
            handlers[method.name] = grpc.unary_unary_rpc_method_handler(wrap_unary_handler(servicer.ModelInfer), **kwargs)
    return grpc.method_handlers_generic_handler(SERVICE, handlers)


# ---- the process ---------------------------------------------------------------------------------------------

async def _serve(settings: dict) -> None:
    loop = asyncio.get_running_loop()
    core = RemoteCore(request_payload_limit(settings["max_request_bytes"]), settings.get("max_queue_size", 1024))
    _, channel = await loop.create_unix_connection(lambda: Channel(core.on_frame, core.on_lost), settings["ipc"])
    core.channel = channel
    loop.add_signal_handler(signal.SIGTERM, core.stop_requested.set)
    host, runner, server, control = settings["host"], None, None, None
    try:
        if settings["http_port"] is not None:
            runner = web.AppRunner(http_app(core, settings["max_request_bytes"], settings["control_http"]),
                                   access_log=None, handle_signals=False, shutdown_timeout=settings["grace"])
            await runner.setup()
            await web.TCPSite(runner, host, settings["http_port"], reuse_address=True, reuse_port=True).start()
        if settings["grpc_port"] is not None:
            control = grpc.aio.insecure_channel("unix:" + settings["control_grpc"], options=UNLIMITED)
            server = grpc.aio.server(options=[("grpc.max_receive_message_length", settings["max_request_bytes"]),
                                              ("grpc.max_send_message_length", -1), ("grpc.so_reuseport", 1)],
                                     maximum_concurrent_rpcs=settings["grpc_max_concurrent"])
            server.add_generic_rpc_handlers((grpc_handler(core, control),))
            if not server.add_insecure_port(f"{host}:{settings['grpc_port']}"):
                raise OSError(f"cannot listen for grpc on {host}:{settings['grpc_port']}")
            await server.start()
    except (OSError, RuntimeError) as exc:
        channel.send({"k": "failed", "index": settings["index"], "message": " ".join(str(exc).split())})
        channel.close()
        raise SystemExit(1) from None
    channel.send({"k": "hello", "index": settings["index"], "pid": os.getpid()})
    await core.stop_requested.wait()
    # Refuse new connections, let requests in flight finish (the main process still answers them).
    if server is not None:
        await server.stop(core.grace)
    if runner is not None:
        await runner.cleanup()
    if control is not None:
        await control.close()
    channel.close()


def worker_main(settings: dict) -> None:
    """The process entry point. `settings`: plain JSON values only (index, socket paths, host, ports,
    limits, log level)."""
    os.environ["CUDA_VISIBLE_DEVICES"] = ""  # before anything could initialise CUDA
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the main process, which stops us
    logging.basicConfig(level=settings.get("log_level", logging.WARNING),
                        format=f"%(asctime)s %(levelname)s %(name)s[frontend {settings['index']}]: %(message)s")
    try:
        asyncio.run(_serve(settings))
    except SystemExit:
        raise
    except Exception:
        log.exception("frontend %d failed", settings["index"])
        raise SystemExit(1) from None
