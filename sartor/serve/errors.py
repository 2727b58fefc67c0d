"""What a request can fail with, and how each failure maps to HTTP and gRPC status codes.

Every error carries a one-line message (a SartorError), so that a client sees one clear line.
"""
from __future__ import annotations

from ..errors import SartorError


class ServeError(SartorError):
    """Base class; `http_status` and `grpc_code` (a grpc.StatusCode name) say how to answer."""
    http_status = 400
    grpc_code = "INVALID_ARGUMENT"
    metric_reason = "OTHER"  # the `reason` label of nv_inference_request_failure


class InvalidRequest(ServeError):
    """Malformed request, unknown model/version/input, wrong shape, dtype or byte size."""


class ModelUnavailable(ServeError):
    """The model exists but is not ready (failed to load, unloaded, still loading)."""
    grpc_code = "UNAVAILABLE"


class QueueFull(ServeError):
    """The model's queue is at its bound: refused at once."""
    http_status = 503
    grpc_code = "UNAVAILABLE"
    metric_reason = "REJECTED"


class RequestTimeout(ServeError):
    """The request waited longer than its timeout before it could be run."""
    http_status = 504
    grpc_code = "DEADLINE_EXCEEDED"
    metric_reason = "CANCELED"


class ExecutionError(ServeError):
    """Running the engine failed (a bug or a device fault, not the request's fault)."""
    http_status = 500
    grpc_code = "INTERNAL"
    metric_reason = "BACKEND"


class RegionNotFound(ServeError):
    """A shared-memory region that is not registered (status, or a tensor that names it): Triton's
    NOT_FOUND, which its HTTP endpoint answers with 404."""
    http_status = 404
    grpc_code = "NOT_FOUND"


class RegionExists(ServeError):
    """A shared-memory region name that is already registered (Triton's ALREADY_EXISTS, HTTP 400)."""
    grpc_code = "ALREADY_EXISTS"


class Unsupported(ServeError):
    """A feature this server cannot offer here (CUDA shared memory without a GPU): Triton's
    UNSUPPORTED, HTTP 501 / gRPC UNIMPLEMENTED."""
    http_status = 501
    grpc_code = "UNIMPLEMENTED"


class BatcherClosed(Exception):
    """Internal: the batcher stopped taking requests (its model version was swapped or unloaded);
    the caller retries with the model now served."""
