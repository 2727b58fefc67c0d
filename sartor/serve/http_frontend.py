"""KServe v2 over HTTP/REST (aiohttp), plus the metrics endpoint.

    GET  /v2/health/live | /v2/health/ready                server live / ready
    GET  /v2                                               server metadata
    GET  /v2/models/{m}[/versions/{v}]                     model metadata
    GET  /v2/models/{m}[/versions/{v}]/ready               model ready (200, else 400)
    GET  /v2/models/{m}[/versions/{v}]/config              model configuration (JSON of ModelConfig)
    GET  /v2/models[/{m}[/versions/{v}]]/stats             statistics
    POST /v2/models/{m}[/versions/{v}]/infer               inference (JSON or binary tensor data)
    POST /v2/models/{m}[/versions/{v}]/infer_image         image bytes in, detections or outputs out
    POST /v2/repository/index                              repository index
    POST /v2/repository/models/{m}/load | /unload          load (newest version) / unload
    GET  /v2/systemsharedmemory[/region/{r}]/status        registered system shared-memory regions
    POST /v2/systemsharedmemory/region/{r}/register        {"key", "offset", "byte_size"}
    POST /v2/systemsharedmemory[/region/{r}]/unregister    one region, or all of them
    .../v2/cudasharedmemory/...                            the same for CUDA shared memory; register takes
                                                           {"raw_handle": {"b64"}, "device_id", "byte_size"}
    GET  /metrics                                          (metrics port) Prometheus text format

Errors are `{"error": "<one line>"}` with 400 (bad request, unknown or unavailable model), 404 (a
shared-memory region that is not registered), 501 (CUDA shared memory without a GPU), 503 (queue
full, or full counting the bodies being received: refused before the body is read, admission.py), 504 (timed out in the queue) or 500 (the engine failed).
"""
from __future__ import annotations

import asyncio
import base64
import binascii
import json
import logging
import re

from aiohttp import web
from aiohttp.web_protocol import RequestPayloadError
from google.protobuf import json_format

from ..errors import SartorError
from . import image as image_route
from .errors import InvalidRequest, ServeError
from .http_codec import compress, encode_infer_response, parse_infer_request

log = logging.getLogger("sartor.serve")
OFFLOAD_BYTES = 1 << 20  # parse and encode bodies larger than this off the event loop


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": " ".join(str(message).split())}, status=status)


@web.middleware
async def error_middleware(request: web.Request, handler):
    try:
        return await handler(request)
    except ServeError as exc:
        return _error(exc.http_status, str(exc))
    except SartorError as exc:
        return _error(400, str(exc))
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return _error(exc.status, exc.text or exc.reason)
    except asyncio.CancelledError:
        raise
    except Exception as exc:
        log.exception("HTTP %s %s failed", request.method, request.path)
        return _error(500, f"internal error: {type(exc).__name__}: {exc}")


class HttpFrontend:
    def __init__(self, core, max_request_bytes: int) -> None:
        self.core = core
        self.max_request_bytes = max_request_bytes

    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.max_request_bytes, middlewares=[error_middleware])
        r = app.router
        r.add_get("/v2/health/live", self.live)
        r.add_get("/v2/health/ready", self.ready)
        r.add_get("/v2", self.server_metadata)
        r.add_get("/v2/models/stats", self.stats)
        r.add_post("/v2/repository/index", self.index)
        r.add_post("/v2/repository/models/{model}/load", self.load)
        r.add_post("/v2/repository/models/{model}/unload", self.unload)
        for prefix in ("/v2/systemsharedmemory", "/v2/cudasharedmemory"):
            r.add_get(prefix + "/status", self.shm_status)
            r.add_get(prefix + "/region/{region}/status", self.shm_status)
            r.add_post(prefix + "/region/{region}/register", self.shm_register)
            r.add_post(prefix + "/unregister", self.shm_unregister)
            r.add_post(prefix + "/region/{region}/unregister", self.shm_unregister)
        for prefix in ("/v2/models/{model}", "/v2/models/{model}/versions/{version}"):
            r.add_get(prefix, self.model_metadata)
            r.add_get(prefix + "/ready", self.model_ready)
            r.add_get(prefix + "/config", self.model_config)
            r.add_get(prefix + "/stats", self.stats)
            r.add_post(prefix + "/infer", self.infer)
            r.add_post(prefix + "/infer_image", self.infer_image)
        return app

    @staticmethod
    def _target(request: web.Request) -> tuple[str, str | None]:
        return request.match_info["model"], request.match_info.get("version")

    async def _body(self, request: web.Request) -> bytes:
        length = request.content_length
        if length is not None and length > self.max_request_bytes:
            raise InvalidRequest(f"request body of {length} bytes exceeds the limit of {self.max_request_bytes} "
                                 f"bytes (--max-request-bytes)")
        try:
            body = await request.read()
        except web.HTTPRequestEntityTooLarge:
            raise InvalidRequest(f"request body exceeds the limit of {self.max_request_bytes} bytes "
                                 f"(--max-request-bytes)") from None
        except RequestPayloadError as exc:  # a corrupt gzip/deflate body, a broken chunked encoding
            message = re.sub(r"^\d+, message:\s*", "", " ".join(str(exc).split()))
            raise InvalidRequest(f"the request body cannot be read: {message}") from None
        return body  # aiohttp has undone Content-Encoding gzip/deflate (within client_max_size)

    async def _json_body(self, request: web.Request) -> dict:
        body = await self._body(request)
        if not body.strip():
            return {}
        try:
            value = json.loads(body)
        except (ValueError, RecursionError):
            raise InvalidRequest("malformed JSON request body") from None
        if not isinstance(value, dict):
            raise InvalidRequest("the request body must be a JSON object")
        return value

    @staticmethod
    async def _offload(size: int, fn, *args):
        if size > OFFLOAD_BYTES:
            return await asyncio.get_running_loop().run_in_executor(None, fn, *args)
        return fn(*args)

    # ---- health and metadata --------------------------------------------------------------------------
    async def live(self, request):
        return web.Response(status=200) if self.core.live() else _error(503, "the server is not live")

    async def ready(self, request):
        return web.Response(status=200) if self.core.ready() else _error(503, "the server is not ready")

    async def server_metadata(self, request):
        return web.json_response(self.core.server_metadata())

    async def model_metadata(self, request):
        name, version = self._target(request)
        return web.json_response(self.core.repository.served(name, version).metadata())

    async def model_ready(self, request):
        name, version = self._target(request)
        self.core.repository.served(name, version)  # raises with the reason when not ready
        return web.Response(status=200)

    async def model_config(self, request):
        name, version = self._target(request)
        config = self.core.repository.served(name, version).config
        return web.json_response(json_format.MessageToDict(config, preserving_proto_field_name=True))

    async def stats(self, request):
        name, version = request.match_info.get("model"), request.match_info.get("version")
        return web.json_response({"model_stats": self.core.statistics(name, version)})

    # ---- repository -----------------------------------------------------------------------------------
    async def index(self, request):
        body = await self._json_body(request)
        ready = body.get("ready", False)
        if not isinstance(ready, bool):
            raise InvalidRequest("\"ready\" must be true or false")
        return web.json_response(self.core.repository.index(ready_only=ready))

    async def load(self, request):
        await self._json_body(request)
        name = request.match_info["model"]
        await asyncio.get_running_loop().run_in_executor(None, self.core.load_model, name)
        return web.Response(status=200)

    async def unload(self, request):
        await self._json_body(request)
        await asyncio.get_running_loop().run_in_executor(None, self.core.unload_model, request.match_info["model"])
        return web.Response(status=200)

    # ---- shared memory ---------------------------------------------------------------------------------
    @staticmethod
    def _shm_kind(request: web.Request) -> str:
        return "cuda" if request.path.startswith("/v2/cudasharedmemory") else "system"

    async def shm_status(self, request):
        return web.json_response(self.core.shared_memory.status(self._shm_kind(request),
                                                                request.match_info.get("region")))

    async def shm_register(self, request):
        body = await self._json_body(request)
        name = request.match_info["region"]
        registry = self.core.shared_memory
        if self._shm_kind(request) == "system":
            args = (registry.register_system, name, body.get("key"), body.get("offset", 0), body.get("byte_size"))
        else:
            handle = body.get("raw_handle")
            if not isinstance(handle, dict) or not isinstance(handle.get("b64"), str):
                raise InvalidRequest(f"region '{name}': \"raw_handle\" must be {{\"b64\": \"<base64 of the "
                                     f"cudaIpcMemHandle_t>\"}}")
            try:
                raw = base64.b64decode(handle["b64"], validate=True)
            except (binascii.Error, ValueError):
                raise InvalidRequest(f"region '{name}': raw_handle.b64 is not base64") from None
            args = (registry.register_cuda, name, raw, body.get("device_id", 0), body.get("byte_size"))
        # Opening a CUDA IPC handle may initialise CUDA: off the event loop.
        await asyncio.get_running_loop().run_in_executor(None, *args)
        return web.Response(status=200)

    async def shm_unregister(self, request):
        await self._json_body(request)
        await asyncio.get_running_loop().run_in_executor(None, self.core.shared_memory.unregister,
                                                         self._shm_kind(request), request.match_info.get("region"))
        return web.Response(status=200)

    # ---- inference ------------------------------------------------------------------------------------
    async def infer(self, request):
        name, version = self._target(request)
        with self.core.admit(name, version):  # before the body is read: admission.py
            body = await self._body(request)
            parsed = await self._offload(len(body), parse_infer_request, body,
                                         request.headers.get("Inference-Header-Content-Length"))
            del body
        outcome = await self.core.infer(name, version, parsed.inputs, [n for n, _ in parsed.outputs] or None,
                                        parsed.timeout_us, output_regions=parsed.output_regions)
        size = sum(a.nbytes for n, a in outcome.outputs.items() if n not in outcome.shared_memory)
        payload, headers = await self._offload(size, encode_infer_response, outcome.model.name,
                                               outcome.model.version, outcome.outputs, parsed,
                                               outcome.shared_memory)
        payload, encoding = await self._offload(len(payload), compress, payload, request.headers.get("Accept-Encoding"))
        if encoding:
            headers["Content-Encoding"] = encoding
        return web.Response(body=payload, headers=headers)

    async def infer_image(self, request):
        name, version = self._target(request)
        model = self.core.repository.served(name, version)
        loop = asyncio.get_running_loop()
        query = dict(request.query)
        with self.core.admit(name, version):
            body = await self._body(request)
            inputs, meta, options = await loop.run_in_executor(None, image_route.prepare, model, body, query)
        timeout = query.get("timeout")
        try:
            timeout = int(timeout) if timeout is not None else None
        except ValueError:
            raise InvalidRequest(f"query parameter timeout={timeout!r} must be an integer (microseconds)") from None
        outcome = await self.core.infer(model.name, version, inputs, None, timeout)
        result = await loop.run_in_executor(None, image_route.respond, outcome.model, outcome.outputs, meta, options)
        return web.json_response(result)


def metrics_app(metrics) -> web.Application:
    """/metrics from `metrics.render()`: this process's Metrics, or the sum over the engine processes
    (shards.ShardPool, which asks each of them), so it runs off the event loop."""
    async def handler(request):
        text = await asyncio.get_running_loop().run_in_executor(None, metrics.render)
        return web.Response(body=text.encode(),
                            headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})

    app = web.Application()
    app.router.add_get("/metrics", handler)
    return app
