"""`infer_on_ray`: image paths over a Ray cluster through `SartorPredictor`, one actor per GPU
(`num_gpus=1`) for a CUDA engine, CPU actors for a CPU engine; what `sartor infer --ray` runs.

The paths go in as blocks of `rows_per_batch` rows, each one Ray batch, so that every actor's
Pipeline cuts the same batches as the single process does over the same list (the CPU's sums and
CUDA's kernels may differ in the last bits between batch sizes). Results come back to the driver
(detections and class scores are small) with the batch columns `SartorPredictor` returns and
each row's input position. Why: docs/decisions/0046-infer-on-ray.md."""
from __future__ import annotations

import re
import socket

import numpy as np

from ..errors import ConfigError, DataError, SartorError
from ..extras import require_extra
from .ray_data import SartorPredictor

INDEX = "__sartor_index__"  # the input position, so that rows are put back in order whatever Ray does


def cluster(address: str | None):
    """The `ray` module, connected to the cluster at `address` (None: $RAY_ADDRESS, a running local
    cluster, else a new local one), or this process's connection when it already has one."""
    require_extra("ray", "sartor infer --ray")
    import ray
    if ray.is_initialized():
        return ray
    if address not in (None, "auto", "local"):
        _reachable(address)
    try:
        ray.init(address=address, include_dashboard=False, log_to_driver=False, configure_logging=False)
    except (ConnectionError, ValueError, RuntimeError, TimeoutError) as exc:
        where = address or "the local machine (no --ray-address, no $RAY_ADDRESS)"
        raise ConfigError(f"no Ray cluster at {where}: {' '.join(str(exc).split()) or type(exc).__name__}") from exc
    return ray


def _reachable(address: str, seconds: float = 5.0) -> None:
    """Refuse an address nothing answers at: `ray.init` itself retries such a one for minutes."""
    host, sep, port = address.removeprefix("ray://").rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ConfigError(f"--ray-address {address}: give HOST:PORT (the head's GCS port, 6379 by default), "
                          f"ray://HOST:PORT, 'auto' or 'local'")
    try:
        socket.create_connection((host, int(port)), timeout=seconds).close()
    except OSError as exc:
        raise ConfigError(f"no Ray cluster at {address}: {exc.strerror or exc}") from exc


def actors_for(ray, device_kind: str, concurrency: int | None) -> tuple[int, int]:
    """(actors, GPUs per actor): one actor per GPU of the cluster for a CUDA engine, one per CPU for a
    CPU engine, unless `concurrency` says how many; more than the cluster has would wait forever."""
    resources = ray.cluster_resources()
    gpus, cpus = int(resources.get("GPU", 0)), int(resources.get("CPU", 0))
    if device_kind == "cuda":
        if gpus == 0:
            raise ConfigError("the engine is a CUDA engine and the Ray cluster has no GPU "
                              "(build one for the CPU to run it on CPU actors)")
        have, what = gpus, "GPU"
    else:
        have, what = max(cpus, 1), "CPU"
    if concurrency is not None and not 1 <= concurrency <= have:
        raise ConfigError(f"--concurrency {concurrency}: the Ray cluster has {have} {what}(s), and each actor "
                          f"takes one")
    return concurrency or have, 1 if device_kind == "cuda" else 0


def path_blocks(paths: list[str], rows_per_batch: int) -> list[tuple[list[str], np.ndarray]]:
    """`paths` cut into blocks of `rows_per_batch` (the last shorter), each with its rows' INDEX
    column: the batches both `sartor infer` paths hand to SartorPredictor."""
    return [(paths[i:i + rows_per_batch], np.arange(i, min(i + rows_per_batch, len(paths)), dtype=np.int64))
            for i in range(0, len(paths), rows_per_batch)]


def predictions(ray, engine_path: str, paths: list[str], *, rows_per_batch: int, actors: int, gpus_per_actor: int,
                predictor_options: dict):
    """The Ray Dataset of SartorPredictor's result columns (and INDEX: each row's place in `paths`),
    not run yet; `paths` must be readable at the same names on every node (absolute paths on a
    shared volume)."""
    import pyarrow as pa
    blocks = [pa.table({"path": block, INDEX: index}) for block, index in path_blocks(paths, rows_per_batch)]
    return ray.data.from_arrow(blocks).map_batches(
        SartorPredictor, fn_constructor_args=(engine_path,), fn_constructor_kwargs=predictor_options,
        batch_size=rows_per_batch, concurrency=actors, num_gpus=gpus_per_actor, batch_format="numpy")


def infer_on_ray(ray, engine_path: str, paths: list[str], **options) -> list[dict]:
    """`predictions` run: each batch's columns, in the order they finished; an error an actor
    raised comes back as the SartorError it was."""
    try:
        return list(predictions(ray, engine_path, paths, **options).iter_batches(batch_size=None,
                                                                                 batch_format="numpy"))
    except (ray.exceptions.RayError, ray.data.exceptions.UserCodeException) as exc:
        raise sartor_error(exc) from exc


def sartor_error(exc: Exception) -> SartorError:
    """The sartor error an actor raised (Ray passes it on as text inside its own), or the Ray error's
    first line when an actor failed some other way."""
    found = re.findall(r"sartor\.errors\.(\w+): (.+)", str(exc))
    if found:
        name, message = found[-1]
        return DataError(message) if name == "DataError" else ConfigError(message)
    first = next((line for line in str(exc).splitlines() if line.strip()), type(exc).__name__)
    return ConfigError(f"the Ray run failed: {first.strip()}")
