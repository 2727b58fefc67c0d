"""sartor engines behind Ray Serve: `SartorDeployment`, one replica per GPU, several models per
replica (`@serve.multiplexed`, least recently used unloaded first, each load checked against a
memory budget) and requests of every model batched together (`@serve.batch`), grouped by model
and shape before they run.

    from sartor.integrations.ray_serve import sartor_app
    serve.run(sartor_app("/models", num_gpus=1, max_batch_size=16), route_prefix="/")

Routes, as `sartor serve` words them (KServe v2): GET /v2/health/live, /v2/health/ready,
/v2/models/{name}; POST /v2/models/{name}/infer (v2 tensors: JSON or binary data) and
/v2/models/{name}/infer_image (JPEG/PNG bytes; the engine's stored preprocessing; detections decoded).
Models are `{name: engine path}` or a Triton-layout repository (`{root}/{name}/{N}/model.plan`, the
highest N). Bad requests get 400 with {"error": one line}; an unknown model 404; a model that does
not fit the memory budget 507."""
from __future__ import annotations

import asyncio
import inspect
from collections import defaultdict
from pathlib import Path

import numpy as np

from ..extras import EXTRAS, require_extra

# The ray extra installs the serve extra too: this module serves through sartor.serve's repository.
require_extra("ray", "sartor.integrations.ray_serve", EXTRAS["ray"] + EXTRAS["serve"])

from ray import serve
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ..errors import ConfigError, SartorError
from ..runtime.engine import load
from ..serve.batcher import next_warm_size, release_cached_memory, warm_batch_sizes, warm_feeds
from ..serve.errors import InvalidRequest, ServeError
from ..serve.http_codec import encode_infer_response, parse_infer_request
from ..serve.image import prepare, respond
from ..serve.memory_budget import MemoryBudget, OverMemoryBudget, needs, parse_size
from ..serve.repository import Repository
from ..serve.shared_memory import ShmInput
from ..serve.tensors import kserve_datatype

MODEL_FILE = "model.plan"


class UnknownModel(ServeError):
    http_status = 404


class ServedEngine:
    """One loaded model on this replica: its engine, one context, and its hold on the budget.
    Ray Serve calls `__del__` when it unloads the model (least recently used first)."""

    def __init__(self, name: str, version: str, engine, on_unload, max_batch_size: int = 1) -> None:
        self.name, self.version, self.engine, self.on_unload = name, version, engine, on_unload
        self.preprocess, self.buckets = engine.preprocess, engine.buckets
        self.context = engine.context()
        self.max_batch = max(int(p.shapes[v.name].max[0]) for p in engine.profiles for v in engine.inputs[:1])
        self.warm_sizes = warm_batch_sizes(min(max_batch_size, self.max_batch))
        self.warm_up()

    def warm_up(self) -> None:
        """Each profile at min, opt and max, then every batch size `@serve.batch` forms (padded up to
        as `sartor serve`'s batcher does): a shape's first run captures a CUDA graph, which a request
        must not wait for."""
        self.context.warmup()
        for feeds in warm_feeds(self.engine, self.warm_sizes):
            self.context.run(feeds)
        release_cached_memory(str(self.engine.device))

    def metadata(self) -> dict:
        def tensors(values):
            return [{"name": v.name, "datatype": kserve_datatype(v.dtype),
                     "shape": [d if isinstance(d, int) else -1 for d in v.shape]} for v in values]
        return {"name": self.name, "versions": [self.version], "platform": "sartor_plan",
                "inputs": tensors(self.engine.inputs), "outputs": tensors(self.engine.outputs)}

    def run(self, feeds: dict) -> dict:
        outputs = self.context.run(feeds)  # numpy feeds give numpy outputs, on the host
        return {name: np.asarray(value) for name, value in outputs.items()}

    def __del__(self) -> None:
        self.on_unload(self)


def stacked(parts: list[dict], rows: int) -> dict:
    """Each input's rows from `parts` one after the other, then zero rows up to `rows`."""
    out = {}
    for name, first in parts[0].items():
        arrays = [p[name] for p in parts]
        filled = sum(len(a) for a in arrays)
        if rows > filled:
            arrays.append(np.zeros((rows - filled, *first.shape[1:]), first.dtype))
        out[name] = np.concatenate(arrays)
    return out


class SartorServer:
    """The deployment's class (see the module docstring); `sartor_app` binds it with its options."""

    def __init__(self, models, *, device: str | None = None, memory_budget: str | None = None,
                 max_models_per_replica: int = 3, max_batch_size: int = 8, batch_wait_timeout_s: float = 0.005,
                 trust=None) -> None:
        if device is None:
            import torch
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.device, self.trust = device, trust
        self.models = models if isinstance(models, dict) else None
        self.root = None if isinstance(models, dict) else Path(models)
        if self.root is not None and not self.root.is_dir():
            raise ConfigError(f"model repository {self.root} is not a directory")
        self.budget = MemoryBudget(parse_size(memory_budget, "memory_budget") if memory_budget else None)
        self.holders: dict[str, ServedEngine] = {}  # model name -> the loaded model its reservation is for

        async def load_model(name: str) -> ServedEngine:
            return await asyncio.to_thread(self._load, name)
        # Decorated here so that the replica's model count is an option, not a constant.
        self.model = serve.multiplexed(max_num_models_per_replica=max_models_per_replica)(load_model)
        self.max_batch_size = max_batch_size
        self.run_batch.set_max_batch_size(max_batch_size)
        self.run_batch.set_batch_wait_timeout_s(batch_wait_timeout_s)

    def _engine_path(self, name: str) -> tuple[str, Path]:
        if self.models is not None:
            if name not in self.models:
                raise UnknownModel(f"unknown model '{name}' (this deployment serves {', '.join(sorted(self.models))})")
            return "1", Path(self.models[name])
        model_dir = self.root / name
        versions = Repository.versions(model_dir, MODEL_FILE) if name and not name.startswith(".") else {}
        if not versions or model_dir.parent != self.root:
            raise UnknownModel(f"unknown model '{name}': no {self.root}/{name}/<version>/{MODEL_FILE}")
        version = max(versions)
        return str(version), versions[version]

    def _load(self, name: str) -> ServedEngine:
        version, path = self._engine_path(name)
        engine = load(path, device=self.device, trust=self.trust)
        self.budget.reserve(name, version, needs(engine, [(self.device, 1)]))
        served = self.holders[name] = ServedEngine(name, version, engine, self._unloaded, self.max_batch_size)
        return served

    def _unloaded(self, model: ServedEngine) -> None:
        # Serve calls __del__ on unloading and the collector again later, perhaps after a reload:
        # only the current holder's reservation is released.
        if self.holders.get(model.name) is model:
            del self.holders[model.name]
            self.budget.release(model.name)

    # ---- batching ------------------------------------------------------------------------------
    @serve.batch(max_batch_size=8, batch_wait_timeout_s=0.005)
    async def run_batch(self, requests: list[tuple[ServedEngine, dict]]) -> list:
        """Requests of one or more models: those of one model and one shape run together, in chunks
        of the engine's max batch; each gets its rows back, or the error of its run."""
        groups = defaultdict(list)
        for i, (model, feeds) in enumerate(requests):
            groups[(id(model), tuple((n, a.shape[1:], a.dtype.str) for n, a in sorted(feeds.items())))].append(i)
        results: list = [None] * len(requests)
        for members in groups.values():
            model = requests[members[0]][0]
            await asyncio.to_thread(self._run_group, model, [requests[i][1] for i in members], members, results)
        return results

    @staticmethod
    def _run_group(model: ServedEngine, feeds_list: list[dict], members: list[int], results: list) -> None:
        chunks, current, rows = [], [], 0
        for index, feeds in zip(members, feeds_list):
            n = len(next(iter(feeds.values())))
            if current and rows + n > model.max_batch:
                chunks.append(current)
                current, rows = [], 0
            current.append((index, feeds, n))
            rows += n
        chunks.append(current)
        for chunk in chunks:
            rows = sum(n for _, _, n in chunk)
            # Padded up to a warmed batch size: a new size would capture a CUDA graph first.
            batch = stacked([f for _, f, _ in chunk], next_warm_size(model.warm_sizes, rows))
            try:
                outputs = model.run(batch)
            except SartorError as exc:
                for index, _, _ in chunk:
                    results[index] = InvalidRequest(f"model '{model.name}': {exc}")
                continue
            start = 0
            for index, _, n in chunk:
                results[index] = {k: v[start:start + n] for k, v in outputs.items()}
                start += n

    async def infer(self, model: ServedEngine, feeds: dict) -> dict:
        result = await self.run_batch((model, feeds))
        if isinstance(result, Exception):
            raise result
        return result

    # ---- routes --------------------------------------------------------------------------------
    async def __call__(self, request: Request) -> Response:
        try:
            return await self._route(request)
        except OverMemoryBudget as exc:
            return JSONResponse({"error": str(exc)}, status_code=507)
        except ServeError as exc:
            return JSONResponse({"error": str(exc)}, status_code=exc.http_status)
        except SartorError as exc:
            return JSONResponse({"error": str(exc)}, status_code=400)

    async def _route(self, request: Request) -> Response:
        path = request.url.path[len(request.scope.get("root_path", "")):].rstrip("/")
        parts = path.split("/")[1:]
        if parts[:2] == ["v2", "health"] and len(parts) == 3 and parts[2] in ("live", "ready"):
            return Response(status_code=200)
        if len(parts) < 3 or parts[:2] != ["v2", "models"]:
            return JSONResponse({"error": f"no route {request.method} {path or '/'} (see /v2/models/NAME/infer "
                                          f"and /infer_image)"}, status_code=404)
        name, rest = parts[2], parts[3:]
        version = None
        if rest[:1] == ["versions"] and len(rest) >= 2:
            version, rest = rest[1], rest[2:]
        model = await self.model(name)
        if version is not None and version != model.version:
            raise UnknownModel(f"model '{name}' has no version {version} here (it serves {model.version})")
        if rest == [] and request.method == "GET":
            return JSONResponse(model.metadata())
        if rest == ["infer"] and request.method == "POST":
            return await self._infer_tensors(model, request)
        if rest == ["infer_image"] and request.method == "POST":
            body = await request.body()
            feeds, meta, options = await asyncio.to_thread(prepare, model, body, dict(request.query_params))
            outputs = await self.infer(model, feeds)
            return JSONResponse(respond(model, {k: v[0] for k, v in outputs.items()}, meta, options))
        return JSONResponse({"error": f"no route {request.method} {path}"}, status_code=404)

    async def _infer_tensors(self, model: ServedEngine, request: Request) -> Response:
        body = await request.body()
        parsed = parse_infer_request(body, request.headers.get("inference-header-content-length"))
        if any(isinstance(v, ShmInput) for v in parsed.inputs.values()):
            raise InvalidRequest("shared-memory inputs are not supported through Ray Serve: send the data")
        expected = {v.name: v for v in model.engine.inputs}
        unknown = sorted(set(parsed.inputs) - set(expected))
        missing = sorted(set(expected) - set(parsed.inputs))
        if unknown or missing:
            raise InvalidRequest(f"model '{model.name}' takes inputs {', '.join(expected)}; "
                                 + "; ".join(filter(None, [unknown and f"unknown: {', '.join(unknown)}",
                                                           missing and f"missing: {', '.join(missing)}"])))
        try:
            model.context.select_profile(model.context.check_inputs(parsed.inputs))
        except SartorError as exc:
            raise InvalidRequest(f"model '{model.name}': {exc}") from None
        outputs = await self.infer(model, {k: np.asarray(v) for k, v in parsed.inputs.items()})
        wanted = [n for n, _ in parsed.outputs]
        if wanted:
            absent = [n for n in wanted if n not in outputs]
            if absent:
                raise InvalidRequest(f"model '{model.name}' has no output {', '.join(absent)} (it has "
                                     f"{', '.join(outputs)})")
            outputs = {n: outputs[n] for n in wanted}
        body, headers = encode_infer_response(model.name, model.version, outputs, parsed)
        return Response(body, headers=headers)


SartorDeployment = serve.deployment(name="sartor", ray_actor_options={"num_gpus": 1})(SartorServer)


def sartor_app(models, *, num_gpus: float = 1, num_cpus: float = 1, num_replicas: int | str | None = None,
               autoscaling_config: dict | None = None, max_ongoing_requests: int | None = None, **options):
    """The application to `serve.run`: `num_gpus` per replica (1: one replica per GPU; 0 on CPU
    nodes), a fixed `num_replicas` or an `autoscaling_config` (e.g. {"min_replicas": 1,
    "max_replicas": 8, "target_ongoing_requests": 32}), and SartorServer's options.
    `max_ongoing_requests` (requests a replica holds at once) defaults to four batches' worth:
    Serve's own default (5) caps every batch at 5 requests, whatever `max_batch_size` says."""
    batch = options.get("max_batch_size", inspect.signature(SartorServer).parameters["max_batch_size"].default)
    deployment_options = {"ray_actor_options": {"num_gpus": num_gpus, "num_cpus": num_cpus},
                          "max_ongoing_requests": max_ongoing_requests or 4 * batch}
    if autoscaling_config is not None:
        deployment_options["autoscaling_config"] = autoscaling_config
    elif num_replicas is not None:
        deployment_options["num_replicas"] = num_replicas
    return SartorDeployment.options(**deployment_options).bind(models, **options)


__all__ = ["SartorDeployment", "SartorServer", "ServedEngine", "sartor_app"]
