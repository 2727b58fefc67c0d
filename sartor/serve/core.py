"""What both frontends call: server and model metadata, inference with retries across a version
swap, timeouts, statistics. Frontends only translate wire formats to and from these calls."""
from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass

import numpy as np

from ..version import __version__
from .errors import BatcherClosed, InvalidRequest, ModelUnavailable, RequestTimeout, ServeError
from .repository import Repository, ServedModel

SERVER_NAME = "sartor"
EXTENSIONS = ["model_repository", "schedule_policy", "model_configuration", "binary_tensor_data", "parameters",
              "statistics", "infer_image"]
COMPLETION_GRACE_S = 1.0  # how long past its deadline a request that already runs may take
SWAP_RETRIES = 8


@dataclass
class InferOutcome:
    model: ServedModel
    outputs: dict  # name -> np.ndarray, in the engine's output order, filtered to those requested


class InferenceCore:
    def __init__(self, repository: Repository, metrics, default_timeout_s: float | None = None) -> None:
        self.repository = repository
        self.metrics = metrics
        self.default_timeout_s = default_timeout_s

    # ---- server -------------------------------------------------------------------------------------
    def server_metadata(self) -> dict:
        return {"name": SERVER_NAME, "version": __version__, "extensions": list(EXTENSIONS)}

    def live(self) -> bool:
        return True

    def ready(self) -> bool:
        return self.repository.ready

    # ---- inference ----------------------------------------------------------------------------------
    def _timeout(self, model: ServedModel, timeout_us) -> float | None:
        if timeout_us is not None:
            if (isinstance(timeout_us, bool) or not isinstance(timeout_us, (int, float)) or not math.isfinite(timeout_us)
                    or timeout_us < 0):
                raise InvalidRequest(f"parameter timeout {timeout_us!r} must be a non-negative number of microseconds")
        configured = model.settings.default_timeout_s
        default = configured if configured is not None else self.default_timeout_s
        if timeout_us and (configured is None or model.settings.allow_timeout_override):
            return float(timeout_us) / 1e6
        return default

    async def infer(self, name: str, version: str | None, inputs: dict[str, np.ndarray],
                    outputs: list[str] | None = None, timeout_us=None, client_deadline_s: float | None = None
                    ) -> InferOutcome:
        """Validate, queue, await. `client_deadline_s`: seconds the client still waits (gRPC deadline)."""
        start = time.monotonic()
        model = None
        try:
            for _ in range(SWAP_RETRIES):
                model = self.repository.served(name, version)
                batch = model.check_inputs(inputs)
                if outputs:
                    model.check_outputs(outputs)
                timeout_s = self._timeout(model, timeout_us)
                if client_deadline_s is not None:
                    client_deadline_s = max(client_deadline_s, 0.0)
                    timeout_s = client_deadline_s if timeout_s is None else min(timeout_s, client_deadline_s)
                deadline = start + timeout_s if timeout_s is not None else None
                try:
                    future = model.batcher.submit(inputs, batch, deadline)
                    break
                except BatcherClosed:
                    await asyncio.sleep(0.001)
            else:
                raise ModelUnavailable(f"model '{name}' is being reloaded; retry")
            wait = None if deadline is None else max(deadline - time.monotonic(), 0.0) + COMPLETION_GRACE_S
            try:
                result = await asyncio.wait_for(asyncio.wrap_future(future), wait)
            except asyncio.TimeoutError:
                raise RequestTimeout(f"model '{name}': the request timed out after {timeout_s * 1e3:.0f} ms") from None
        except ServeError as exc:
            if model is not None:
                self.metrics.inc("nv_inference_request_failure",
                                 {"model": model.name, "version": model.version, "reason": exc.metric_reason})
            raise
        labels = {"model": model.name, "version": model.version}
        self.metrics.inc("nv_inference_request_success", labels)
        self.metrics.inc("nv_inference_request_duration_us", labels, (time.monotonic() - start) * 1e6)
        model.last_inference_ms = int(time.time() * 1000)
        wanted = outputs or list(result.outputs)
        return InferOutcome(model, {n: np.asarray(result.outputs[n]) for n in wanted})

    # ---- statistics -----------------------------------------------------------------------------------
    def statistics(self, name: str | None = None, version: str | None = None) -> list[dict]:
        """Triton's model statistics (JSON form of inference.ModelStatistics)."""
        models = [self.repository.served(name, version)] if name else self.repository.served_models()
        stats = []
        for m in sorted(models, key=lambda m: m.name):
            labels = {"model": m.name, "version": m.version}
            get = lambda metric: self.metrics.get(metric, labels)  # noqa: E731
            failures = sum(self.metrics.get("nv_inference_request_failure", dict(labels, reason=r))
                           for r in ("OTHER", "REJECTED", "CANCELED", "BACKEND"))
            executions = int(get("nv_inference_exec_count"))
            successes = int(get("nv_inference_request_success"))
            duration = lambda count, metric: {"count": int(count), "ns": int(get(metric) * 1000)}  # noqa: E731
            stats.append({
                "name": m.name, "version": m.version, "last_inference": m.last_inference_ms,
                "inference_count": int(get("nv_inference_count")), "execution_count": executions,
                "inference_stats": {
                    "success": duration(successes, "nv_inference_request_duration_us"),
                    "fail": {"count": int(failures), "ns": 0},
                    "queue": duration(successes, "nv_inference_queue_duration_us"),
                    "compute_input": duration(executions, "nv_inference_compute_input_duration_us"),
                    "compute_infer": duration(executions, "nv_inference_compute_infer_duration_us"),
                    "compute_output": duration(executions, "nv_inference_compute_output_duration_us"),
                },
            })
        return stats
