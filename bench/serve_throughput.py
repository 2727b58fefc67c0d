"""`sartor serve` throughput against concurrency (1..256), with and without dynamic batching.

Builds a model repository around one engine (`<name>_batched` with dynamic batching, `<name>_single`
without; `--variants` picks), starts the server in this process on loopback, and drives it with
Triton clients. The load generator (`--load-generator`):

- `python` (the default): tritonclient in several client processes (threads within each, one client
  per thread, synchronous requests), needing nothing beyond the serve extras;
- `perf_analyzer`: Triton's own load generator, one run per concurrency level.
  It is looked for at `--perf-analyzer`, then on PATH, then at `.cache/perf_analyzer/perf_analyzer`
  in this tree, where `bash scripts/install_perf_analyzer.sh` puts it (a machine without internet
  needs that folder copied along: nothing is downloaded here).

`--shared-memory none,system,cuda` (one or several, each measured in turn on the same server) passes
the tensors in the request body, in POSIX shared memory, or in CUDA shared memory (cudaIpc handles;
the client process allocates on GPU 0). With the python load generator every client thread creates
and registers its own input and output regions (names and keys carry the process id and thread
number) and unregisters them at the end of its level; perf_analyzer does the same per run.

A measurement (one mode, model and level) goes through stages, each printed with the elapsed time
as it ends: client processes started, clients connected (and their regions registered), warm-up
done, measured, drained. Warm-up starts once every client thread is ready, so a slow set-up (CUDA
contexts in many processes) never eats the measured window. Each measurement has its own wall-clock
budget (`--measure-budget-s`) and every request a client-side timeout (`--request-timeout-s`): past
its budget the measurement is recorded as `{"error": "timed out after S s at stage X"}`, the stacks
of this process and of the clients are written under --out/stacks/, the clients are killed and the
next measurement starts. `--budget-s` bounds the whole run: what no longer fits is recorded as
skipped. results.json (and results.md) are rewritten after every measurement; progress.json names
the stage in progress (what a caller that had to kill this process reads). SIGUSR1 writes this
process's stacks to --out/stacks/main_<pid>.txt.

Reports inferences/s and p50/p90/p99 latency per concurrency level, and from the server's own
metrics the batches it ran over the measurement (count, mean size, compute time).

For the GPU (not run in CI):

    PYTHONPATH=. python bench/serve_throughput.py --plan resnet50_fp16.plan --out $OUT \
        --device cuda:0 --instances 2 --max-queue-delay-us 500 --protocol grpc [--load-generator perf_analyzer]

`--url HOST:PORT` measures a server that is already running (then --models names its models).
"""
from __future__ import annotations

import argparse
import contextlib
import csv
import faulthandler
import glob
import json
import multiprocessing as mp
from multiprocessing import resource_tracker
import os
import queue as queue_lib
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

LEVELS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
MODES = ("none", "system", "cuda")
VARIANTS = ("batched", "single")
SHM_KEY_PREFIX = "/sartor_bench_"
# The server's counters read before and after each measurement: what it batched and ran meanwhile.
SERVER_COUNTERS = ("nv_inference_exec_count", "nv_inference_count", "nv_inference_compute_infer_duration_us",
                   "nv_inference_queue_duration_us", "nv_inference_request_success")


def make_repository(plan: Path, root: Path, max_batch: int, delay_us: int, instances: int, device: str | None,
                    variants: tuple = VARIANTS) -> list[str]:
    """A model repository serving `plan` once per variant; `device`: cpu, cuda:N, or several GPUs
    ("cuda:0,cuda:1": `instances` instances on each, Triton's instance_group gpus)."""
    name = plan.stem.replace(".", "_")
    devices = [d.strip() for d in device.split(",")] if device else []
    gpus = (f" gpus: [{', '.join(d.partition(':')[2] or '0' for d in devices)}]"
            if devices and all(d.startswith("cuda") for d in devices) else "")
    group = f"instance_group [{{ count: {instances}{gpus} }}]\n"
    configs = {"batched": f"max_batch_size: {max_batch}\ndynamic_batching {{ max_queue_delay_microseconds: "
                          f"{delay_us} }}\n{group}",
               "single": f"max_batch_size: {max_batch}\n{group}"}
    models = {f"{name}_{variant}": configs[variant] for variant in variants}
    for model, config in models.items():
        (root / model / "1").mkdir(parents=True)
        shutil.copyfile(plan, root / model / "1" / "model.plan")
        (root / model / "config.pbtxt").write_text(config)
    return list(models)


def request_inputs(metadata: dict, batch: int, protocol: str, seed: int = 0):
    if protocol == "grpc":
        import tritonclient.grpc as client_lib
    else:
        import tritonclient.http as client_lib
    rng = np.random.default_rng(seed)
    inputs = []
    for spec in metadata["inputs"]:
        shape = [batch if d == -1 and i == 0 else (d if d > 0 else 1) for i, d in enumerate(spec["shape"])]
        dtype = NUMPY[spec["datatype"]]
        data = rng.standard_normal(shape).astype(dtype) if dtype in (np.float32, np.float16) else np.zeros(shape, dtype)
        tensor = client_lib.InferInput(spec["name"], shape, spec["datatype"])
        if protocol == "grpc":
            tensor.set_data_from_numpy(data)
        else:
            tensor.set_data_from_numpy(data, binary_data=True)
        tensor._sartor_data = data  # for Regions: the same values, in shared memory
        inputs.append(tensor)
    return inputs


NUMPY = {"FP32": np.float32, "FP16": np.float16, "INT64": np.int64, "INT32": np.int32, "UINT8": np.uint8}


def tensor_bytes(spec: dict, batch: int) -> int:
    """Bytes of one request's tensor (batch dim -1 -> batch; another dynamic dim counts as 1)."""
    shape = [batch if d == -1 and i == 0 else (d if d > 0 else 1) for i, d in enumerate(spec["shape"])]
    return int(np.prod(shape)) * np.dtype(NUMPY[spec["datatype"]]).itemsize


class Regions:
    """One client thread's shared-memory regions (one per input and output), registered with the
    server under names of its own; `close()` unregisters and frees them. `timeout_s` bounds each
    registration call (gRPC's client_timeout; an HTTP client has its network timeout)."""

    def __init__(self, client, protocol: str, kind: str, metadata: dict, batch: int, inputs, tag: str,
                 timeout_s: float | None = None, cuda_lock=None) -> None:
        if protocol == "grpc":
            import tritonclient.grpc as client_lib
        else:
            import tritonclient.http as client_lib
        self.client, self.kind, self.handles = client, kind, []
        self.cuda_lock = cuda_lock if cuda_lock is not None else contextlib.nullcontext()
        self.timeout = {"client_timeout": timeout_s} if protocol == "grpc" and timeout_s else {}
        self.outputs = []
        for tensor in inputs:
            data = tensor._sartor_data  # kept by request_inputs
            name = f"{tag}_in_{tensor.name()}"
            self._region(name, data.nbytes, data)
            tensor.set_shared_memory(name, data.nbytes)
        for spec in metadata["outputs"]:
            name, size = f"{tag}_out_{spec['name']}", tensor_bytes(spec, batch)
            self._region(name, size, None)
            output = client_lib.InferRequestedOutput(spec["name"])
            output.set_shared_memory(name, size)
            self.outputs.append(output)

    def _region(self, name: str, size: int, data) -> None:
        if self.kind == "system":
            import tritonclient.utils.shared_memory as shm
            key = f"{SHM_KEY_PREFIX}{name}"
            handle = shm.create_shared_memory_region(name, key, size)
            self.handles.append((name, handle))
            if data is not None:
                shm.set_shared_memory_region(handle, [data])
            self.client.register_system_shared_memory(name, key, size, **self.timeout)
        else:
            import tritonclient.utils.cuda_shared_memory as cudashm
            # One thread at a time: tritonclient creates its copy stream on first use without a lock, and
            # two threads that race there can leave one using a stream the other's replacement destroyed.
            with self.cuda_lock:
                handle = cudashm.create_shared_memory_region(name, size, 0)
                self.handles.append((name, handle))
                if data is not None:
                    cudashm.set_shared_memory_region(handle, [data])
            self.client.register_cuda_shared_memory(name, cudashm.get_raw_handle(handle), 0, size, **self.timeout)

    def close(self) -> None:
        for name, handle in self.handles:
            if self.kind == "system":
                import tritonclient.utils.shared_memory as shm
                self.client.unregister_system_shared_memory(name, **self.timeout)
                shm.destroy_shared_memory_region(handle)
            else:
                import tritonclient.utils.cuda_shared_memory as cudashm
                self.client.unregister_cuda_shared_memory(name, **self.timeout)
                cudashm.destroy_shared_memory_region(handle)


# ---- progress ---------------------------------------------------------------------------------------------

class Progress:
    """Stage lines with the seconds since `t0`, flushed at once (a caller streams them), and the stage in
    progress in progress.json (what a caller that had to kill this process reads)."""

    def __init__(self, out: Path, t0: float | None = None) -> None:
        self.path = out / "progress.json"
        self.t0 = time.monotonic() if t0 is None else t0

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def __call__(self, message: str, stage: str | None = None, **where) -> None:
        print(f"[{self.elapsed():7.1f} s] {message}", flush=True)
        if stage is not None:
            _write_json(self.path, {"stage": stage, "elapsed_s": round(self.elapsed(), 1), **where})


def _write_json(path: Path, value) -> None:
    """Written to a temporary name, then renamed: a reader never sees half a file."""
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(value, indent=2))
    os.replace(partial, path)


def _stack_file(path: Path):
    """An open file for faulthandler's stack dumps (it writes to the descriptor from a signal handler)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    return open(path, "w")


def _exception_text(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}"
    if exc.__cause__ is not None:  # tritonclient's CUDA helpers wrap the CUDA error they met
        text += f" (from {type(exc.__cause__).__name__}: {exc.__cause__})"
    return " ".join(text.split())[:400]


# ---- the client processes -----------------------------------------------------------------------------------

def _client_process(url: str, protocol: str, model: str, metadata: dict, batch: int, threads: int,
                    shared_memory: str, request_timeout_s: float, duration: float, messages, go, start_at,
                    stacks_path: str) -> None:
    """`threads` client threads. Tells the parent on `messages` when it has started ("started"), when
    every thread has set up its client and regions ("ready"), and its results ("done"); measures from
    the shared `start_at` (set once every process was ready, then `go`) for `duration` seconds."""
    import threading
    stacks = _stack_file(Path(stacks_path))
    faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
    pid = os.getpid()
    messages.put(("started", pid))
    lock = threading.Condition()
    cuda_lock = threading.Lock()
    setup = {"count": 0, "seconds": [], "errors": []}
    result = {"latencies": [], "errors": 0, "timeouts": 0, "answered": 0, "samples": [], "teardown": []}
    window: dict = {}
    begin = threading.Event()

    def note_error(exc: BaseException) -> None:
        text = _exception_text(exc)
        with lock:
            result["errors"] += 1
            if "DEADLINE_EXCEEDED" in text or "timed out" in text.lower():
                result["timeouts"] += 1
            if len(result["samples"]) < 3 and text not in result["samples"]:
                result["samples"].append(text)

    def worker(k: int) -> None:
        t0 = time.monotonic()
        client = regions = None
        failure = None
        try:
            if protocol == "grpc":
                import tritonclient.grpc as client_lib
                client = client_lib.InferenceServerClient(url)
            else:
                import tritonclient.http as client_lib
                client = client_lib.InferenceServerClient(url, connection_timeout=request_timeout_s,
                                                          network_timeout=request_timeout_s)
            inputs = request_inputs(metadata, batch, protocol, seed=k)
            if shared_memory != "none":
                regions = Regions(client, protocol, shared_memory, metadata, batch, inputs, f"p{pid}_t{k}",
                                  request_timeout_s, cuda_lock)
        except Exception as exc:  # reported to the parent with the "ready" message
            failure = _exception_text(exc)
        with lock:
            setup["count"] += 1
            setup["seconds"].append(time.monotonic() - t0)
            if failure is not None:
                setup["errors"].append(failure)
            lock.notify_all()
        if failure is not None:
            if client is not None:
                client.close()
            return
        outputs = regions.outputs if regions is not None else None
        timeout = {"client_timeout": request_timeout_s} if protocol == "grpc" else {}
        begin.wait()
        mine, count = [], 0
        while True:
            t0 = time.monotonic()
            if t0 >= window["stop"]:
                break
            try:
                client.infer(model, inputs, outputs=outputs, **timeout)
            except Exception as exc:
                note_error(exc)
                continue
            t1 = time.monotonic()
            count += 1
            if t0 >= window["start"]:
                mine.append(t1 - t0)
        with lock:
            result["latencies"].extend(mine)
            result["answered"] += count
        try:
            if regions is not None:
                regions.close()
        except Exception as exc:
            with lock:
                result["teardown"].append(_exception_text(exc))
        client.close()

    pool = [threading.Thread(target=worker, args=(k,), daemon=True) for k in range(threads)]
    for t in pool:
        t.start()
    with lock:
        lock.wait_for(lambda: setup["count"] == threads)
    messages.put(("ready", pid, max(setup["seconds"]), setup["errors"]))
    go.wait()
    window["start"] = start_at.value
    window["stop"] = start_at.value + duration
    begin.set()
    for t in pool:
        t.join()
    messages.put(("done", pid, result))


class StageTimeout(Exception):
    pass


class ClientDied(Exception):
    pass


def _collect(messages, procs: list, kind: str, got: dict, deadline: float) -> None:
    """Wait until every process has sent its `kind` message (kept in got[kind] by pid); StageTimeout
    past `deadline`, ClientDied when a process exited without sending it."""
    empty_polls = 0
    while len(got.setdefault(kind, {})) < len(procs):
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise StageTimeout()
        try:
            message = messages.get(timeout=min(0.5, remaining))
        except queue_lib.Empty:
            empty_polls += 1
            # Its last messages may still be in the pipe just after it exited: look twice.
            dead = [p for p in procs if p.exitcode is not None and p.pid not in got[kind]]
            if dead and empty_polls >= 2:
                raise ClientDied(f"client process {dead[0].pid} exited with code {dead[0].exitcode}") from None
            continue
        empty_polls = 0
        got.setdefault(message[0], {})[message[1]] = message


def _server_counters(server, model: str) -> dict:
    labels = {"model": model, "version": "1"}
    return {name: server.metrics.get(name, labels) for name in SERVER_COUNTERS}


def measure(url: str, protocol: str, model: str, metadata: dict, batch: int, concurrency: int,
            duration: float, warmup: float, processes: int, server_in_process: bool = False,
            shared_memory: str = "none", frontend_pids: list | None = None, *, budget_s: float = 600.0,
            request_timeout_s: float = 30.0, progress: Progress | None = None, stacks_dir: Path | None = None,
            server=None) -> dict:
    """One level. With the server in this process, also its CPU time per request (the client
    processes are children, not counted), which says what the server costs when the load generator
    shares the cores. With frontend processes (serve --frontends N), "server CPU" is this main
    process only (batching and running), and theirs is reported apart. Past `budget_s` (wall clock,
    from the first client process's start) the row is {"error": "timed out after S s at stage X"}."""
    progress = progress or Progress(Path(tempfile.gettempdir()))
    stacks_dir = stacks_dir or Path(tempfile.gettempdir())
    label = f"{model} {shared_memory} c={concurrency}"
    where = {"model": model, "shared_memory": shared_memory, "concurrency": concurrency}
    processes = max(1, min(processes, concurrency))
    shares = [concurrency // processes + (1 if i < concurrency % processes else 0) for i in range(processes)]
    ctx = mp.get_context("spawn")
    messages, go, start_at = ctx.Queue(), ctx.Event(), ctx.Value("d", 0.0)
    tag = f"{model}_{shared_memory}_c{concurrency}"
    procs = [ctx.Process(target=_client_process, daemon=True,
                         args=(url, protocol, model, metadata, batch, n, shared_memory, request_timeout_s, duration,
                               messages, go, start_at, str(stacks_dir / f"{tag}_client_{i}.txt")))
             for i, n in enumerate(shares)]
    begun = time.monotonic()
    deadline = begun + budget_s
    stages: dict = {}
    got: dict = {}
    stage = "client processes starting"
    progress(f"{label}: starting {processes} client processes ({concurrency} threads)", stage, **where)
    try:
        for p in procs:
            p.start()
        _collect(messages, procs, "started", got, deadline)
        stages["clients_started_s"] = round(time.monotonic() - begun, 2)
        stage = "regions registered" if shared_memory != "none" else "clients connected"
        progress(f"{label}: clients started; waiting for every thread's client"
                 + (f" and {shared_memory} regions" if shared_memory != "none" else ""), stage, **where)
        _collect(messages, procs, "ready", got, deadline)
        ready = got["ready"].values()
        setup_errors = [e for m in ready for e in m[3]]
        stages["ready_s"] = round(time.monotonic() - begun, 2)
        stages["thread_setup_max_s"] = round(max(m[2] for m in ready), 2)
        progress(f"{label}: {stage} (slowest thread {stages['thread_setup_max_s']:.1f} s"
                 + (f", {len(setup_errors)} failed: {setup_errors[0]}" if setup_errors else "") + ")")
        if len(setup_errors) == concurrency:  # nothing to measure: let the processes report and exit
            go.set()
            _collect(messages, procs, "done", got, deadline)
            progress(f"{label}: ERROR every client thread failed to set up")
            return {"concurrency": concurrency, "error": f"every client thread failed to set up: {setup_errors[0]}",
                    "stage": stage, "elapsed_s": round(time.monotonic() - begun, 2), **stages}
        cpu_before = _main_cpu_s(server) if server is not None else time.process_time()
        frontends_before = _cpu_s(frontend_pids or [])
        counters_before = _server_counters(server, model) if server is not None else None
        start_at.value = time.monotonic() + warmup
        go.set()
        stage = "warm-up"
        progress(f"{label}: warm-up {warmup:g} s", stage, **where)
        _sleep_until(start_at.value, deadline)
        stage = "measuring"
        progress(f"{label}: warm-up done; measuring {duration:g} s", stage, **where)
        _sleep_until(start_at.value + duration, deadline)
        stage = "draining (the clients' last requests, unregistering regions)"
        progress(f"{label}: measured; draining", stage, **where)
        _collect(messages, procs, "done", got, deadline)
    except (StageTimeout, ClientDied) as exc:
        return _failed(exc, stage, budget_s, begun, procs, stacks_dir, tag, label, progress, concurrency, stages,
                       got)
    for p in procs:
        p.join(5)
    for path in stacks_dir.glob(f"{tag}_client_*.txt"):  # nothing was dumped: nothing to keep
        if not path.stat().st_size:
            path.unlink()
    cpu_s = (_main_cpu_s(server) if server is not None else time.process_time()) - cpu_before
    frontends_s = _cpu_s(frontend_pids or []) - frontends_before
    results = [m[2] for m in got["done"].values()]
    latencies = [v for r in results for v in r["latencies"]]
    answered = sum(r["answered"] for r in results)
    ms = sorted(v * 1e3 for v in latencies)
    pick = lambda q: ms[min(len(ms) - 1, int(q * len(ms)))] if ms else float("nan")  # noqa: E731
    row = {"concurrency": concurrency, "requests": len(ms), "errors": sum(r["errors"] for r in results),
           "timeouts": sum(r["timeouts"] for r in results),
           "infer_per_s": len(ms) * batch / duration, "p50_ms": pick(0.5), "p90_ms": pick(0.9),
           "p99_ms": pick(0.99), "mean_ms": statistics.fmean(ms) if ms else float("nan"),
           "server_cpu_ms_per_request": cpu_s * 1e3 / max(answered, 1) if server_in_process else float("nan"),
           "frontend_cpu_ms_per_request": frontends_s * 1e3 / max(answered, 1) if frontend_pids else float("nan"),
           "setup_errors": len(setup_errors), "elapsed_s": round(time.monotonic() - begun, 2), **stages}
    samples = sorted({s for r in results for s in r["samples"]} | set(setup_errors[:3]))
    teardown = [t for r in results for t in r["teardown"]]
    if samples:
        row["error_samples"] = samples[:5]
    if teardown:
        row["teardown_errors"] = teardown[:3]
    if counters_before is not None:
        row.update(_server_figures(server, model, counters_before))
    progress(f"{label}: done in {row['elapsed_s']:.1f} s")
    return row


def _server_figures(server, model: str, counters_before: dict) -> dict:
    """What the server batched and ran since `counters_before` (its counters then)."""
    after = _server_counters(server, model)
    delta = {name: after[name] - counters_before[name] for name in SERVER_COUNTERS}
    batches = delta["nv_inference_exec_count"]
    return {"server_batches": int(batches),
            "server_mean_batch": round(delta["nv_inference_count"] / batches, 2) if batches else 0.0,
            "server_compute_s": round(delta["nv_inference_compute_infer_duration_us"] / 1e6, 3),
            "server_queue_ms_per_request": round(delta["nv_inference_queue_duration_us"] / 1e3
                                                 / max(delta["nv_inference_request_success"], 1), 3)}


def perf_analyzer_with_server(server, binary: str, url: str, protocol: str, model: str, batch: int, level: int,
                              duration: float, out: Path, shared_memory: str, output_bytes: int) -> dict:
    """`perf_analyzer` for one level, plus, with the server in this process, its CPU per request: of
    this process (batching and running) and of its frontend processes, over the whole perf_analyzer
    run (warm-up and every trial; perf_analyzer's own CPU is not counted) divided by the requests the
    server answered meanwhile. Mean batch and compute time cover the same span."""
    if server is None:
        return perf_analyzer(binary, url, protocol, model, batch, level, duration, out, shared_memory, output_bytes)
    counters_before = _server_counters(server, model)
    frontend_pids = server.frontend_pids
    cpu_before, frontends_before = _main_cpu_s(server), _cpu_s(frontend_pids)
    row = perf_analyzer(binary, url, protocol, model, batch, level, duration, out, shared_memory, output_bytes)
    cpu_s, frontends_s = _main_cpu_s(server) - cpu_before, _cpu_s(frontend_pids) - frontends_before
    answered = server.metrics.get("nv_inference_request_success", {"model": model, "version": "1"}) \
        - counters_before["nv_inference_request_success"]
    row.update(_server_figures(server, model, counters_before))
    row["server_requests"] = int(answered)
    row["server_cpu_ms_per_request"] = cpu_s * 1e3 / max(answered, 1)
    if frontend_pids:
        row["frontend_cpu_ms_per_request"] = frontends_s * 1e3 / max(answered, 1)
    return row


def _main_cpu_s(server) -> float:
    """CPU seconds of what batches and runs: this process, and with --engine-processes K the K
    engine processes (their frontend processes are counted apart)."""
    return time.process_time() + _cpu_s(server.engine_pids)


def _sleep_until(when: float, deadline: float) -> None:
    time.sleep(max(0.0, min(when, deadline) - time.monotonic()))
    if time.monotonic() >= deadline and when > deadline:
        raise StageTimeout()


def _failed(exc: Exception, stage: str, budget_s: float, begun: float, procs: list, stacks_dir: Path, tag: str,
            label: str, progress: Progress, concurrency: int, stages: dict, got: dict) -> dict:
    """The row of a measurement that ran past its budget or lost a client process: the stacks of this
    process and of the clients still alive written under stacks_dir, the clients killed."""
    elapsed = time.monotonic() - begun
    error = (f"timed out after {budget_s:g} s at stage {stage}" if isinstance(exc, StageTimeout)
             else f"{exc} at stage {stage}")
    stacks = stacks_dir / f"{tag}_server.txt"
    with _stack_file(stacks) as out:
        faulthandler.dump_traceback(file=out, all_threads=True)
    alive = [p for p in procs if p.exitcode is None and p.pid is not None]
    for p in alive:
        os.kill(p.pid, signal.SIGUSR1)
    time.sleep(1.0)  # faulthandler writes from the signal handler; give every process its turn
    for p in alive:
        p.terminate()
    for p in alive:
        p.join(3)
        if p.exitcode is None:
            p.kill()
            p.join(2)
    for p in procs:  # what killed clients left in /dev/shm
        for path in glob.glob(f"/dev/shm/{SHM_KEY_PREFIX.strip('/')}p{p.pid}_*"):
            Path(path).unlink(missing_ok=True)
            # The clients share this process's resource tracker (spawn), which would otherwise warn at
            # exit about each object; multiprocessing's SharedMemory registered it with "/" prepended.
            resource_tracker.unregister("//" + os.path.basename(path), "shared_memory")
    progress(f"{label}: ERROR {error}; stacks in {stacks_dir}")
    not_ready = [p.pid for p in procs if p.pid not in got.get("ready", {})]
    return {"concurrency": concurrency, "error": error, "stage": stage, "elapsed_s": round(elapsed, 1),
            "clients_not_ready": len(not_ready), "stacks": str(stacks_dir), **stages}


def release_regions(url: str, protocol: str, kind: str, timeout_s: float = 10.0) -> str | None:
    """Unregister every region of `kind` (what killed clients left registered); the error, if any
    (a server that does not answer)."""
    try:
        if protocol == "grpc":
            import tritonclient.grpc as client_lib
            client = client_lib.InferenceServerClient(url)
            if kind != "none":
                (client.unregister_cuda_shared_memory if kind == "cuda" else client.unregister_system_shared_memory)(
                    client_timeout=timeout_s)
            client.is_server_live(client_timeout=timeout_s)
        else:
            import tritonclient.http as client_lib
            client = client_lib.InferenceServerClient(url, network_timeout=timeout_s)
            if kind != "none":
                (client.unregister_cuda_shared_memory if kind == "cuda" else client.unregister_system_shared_memory)()
            client.is_server_live()
        client.close()
    except Exception as exc:
        return _exception_text(exc)
    return None


def _cpu_s(pids: list) -> float:
    """User + system CPU seconds of these processes (Linux /proc)."""
    total = 0.0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


def find_perf_analyzer(explicit: str | None) -> str | None:
    """The perf_analyzer to run, or None; a candidate counts only once `--version` runs (its shared
    libraries resolve on this machine)."""
    local = Path(__file__).resolve().parents[1] / ".cache" / "perf_analyzer" / "perf_analyzer"
    candidates = [explicit] if explicit else [shutil.which("perf_analyzer"), str(local)]
    for candidate in candidates:
        if not candidate or not os.access(candidate, os.X_OK):
            continue
        try:
            probe = subprocess.run([candidate, "--version"], check=False, capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            continue
        if probe.returncode == 0:
            return candidate
    return None


def perf_analyzer(binary: str, url: str, protocol: str, model: str, batch: int, level: int, duration: float,
                  out: Path, shared_memory: str = "none", output_bytes: int = 0) -> dict:
    """One concurrency level. perf_analyzer's range step is additive (1:256:2 is 1, 3, 5, ...), so
    each level of the geometric series is its own run."""
    report = out / f"perf_analyzer_{model}_c{level}.csv"
    base = [binary, "-m", model, "-u", url, "-i", protocol, "-b", str(batch), "--concurrency-range", f"{level}:{level}",
            "--measurement-interval", str(max(int(duration * 1000), 500)), "--shared-memory", shared_memory,
            "--max-trials", "10", "-f", str(report)]
    if shared_memory != "none" and output_bytes:
        base += ["--output-shared-memory-size", str(output_bytes)]
    # Its default 10% stability bound can fail on a noisy level (exit 2, no report): then measure once
    # more without the bound and say so in the row.
    for stable, extra in ((True, []), (False, ["--stability-percentage", "100"])):
        report.unlink(missing_ok=True)
        done = subprocess.run(base + extra, check=False, capture_output=True, text=True,
                              timeout=max(600.0, 20 * duration + 120))
        (out / f"perf_analyzer_{model}_c{level}.log").write_text(done.stdout + done.stderr)
        if done.returncode == 0 and report.is_file():
            break
    else:
        last = (done.stdout + done.stderr).strip().splitlines()[-1:] or ["no output"]
        print(f"{model:>28} c={level:<4} perf_analyzer exit {done.returncode}: {last[0]}", flush=True)
        return {"concurrency": level, "infer_per_s": float("nan"), "p50_ms": float("nan"), "p90_ms": float("nan"),
                "p99_ms": float("nan"), "errors": 1, "perf_analyzer_exit": done.returncode}
    (values,) = [r for r in csv.DictReader(report.read_text().splitlines())
                 if int(r["Concurrency"]) == level]
    usec = lambda key: float(values.get(key) or "nan") / 1e3  # noqa: E731
    return {"concurrency": level, "infer_per_s": float(values["Inferences/Second"]), "p50_ms": usec("p50 latency"),
            "p90_ms": usec("p90 latency"), "p99_ms": usec("p99 latency"), "errors": 0, "stable": stable}


def _modes(text: str) -> list[str]:
    modes = [m.strip() for m in text.split(",") if m.strip()]
    if not modes or set(modes) - set(MODES):
        raise argparse.ArgumentTypeError(f"{text!r}: a comma-separated list of {', '.join(MODES)}")
    return modes


def _variants(text: str) -> tuple:
    variants = tuple(v.strip() for v in text.split(",") if v.strip())
    if not variants or set(variants) - set(VARIANTS):
        raise argparse.ArgumentTypeError(f"{text!r}: a comma-separated list of {', '.join(VARIANTS)}")
    return variants


def write_results(out: Path, results: dict) -> None:
    _write_json(out / "results.json", results)
    lines = [f"# sartor serve throughput ({results['protocol']}, request batch {results['batch']}, "
             f"{results['load_generator']}, frontends {results['frontends']})", "",
             "| shared memory | model | concurrency | infer/s | p50 ms | p90 ms | p99 ms | server CPU ms/request | "
             "mean batch | errors |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for mode, models in results["runs"].items():
        for model, rows in models.items():
            for r in rows:
                if "error" in r or "skipped" in r:
                    lines.append(f"| {mode} | {model} | {r['concurrency']} | {r.get('error') or r['skipped']} "
                                 f"| | | | | | |")
                    continue
                lines.append(f"| {mode} | {model} | {r['concurrency']} | {r['infer_per_s']:.1f} | {r['p50_ms']:.2f} | "
                             f"{r['p90_ms']:.2f} | {r['p99_ms']:.2f} | "
                             f"{r.get('server_cpu_ms_per_request', float('nan')):.3f} | "
                             f"{r.get('server_mean_batch', float('nan'))} | {r['errors']} |")
    (out / "results.md").write_text("\n".join(lines) + "\n")


def _print_row(model: str, mode: str, row: dict) -> None:
    if "error" in row or "skipped" in row:
        print(f"{model:>28} {mode:>6} c={row['concurrency']:<4} {row.get('error') or row['skipped']}", flush=True)
        return
    print(f"{model:>28} {mode:>6} c={row['concurrency']:<4} {row['infer_per_s']:10.1f} inf/s  "
          f"p50 {row['p50_ms']:8.2f} ms  p99 {row['p99_ms']:8.2f} ms  "
          f"server CPU {row.get('server_cpu_ms_per_request', float('nan')):6.3f} ms/req  "
          f"frontends CPU {row.get('frontend_cpu_ms_per_request', float('nan')):6.3f} ms/req  "
          f"mean batch {row.get('server_mean_batch', float('nan'))}  errors {row['errors']}", flush=True)


def _metadata(url: str, protocol: str, model: str, timeout_s: float) -> dict:
    if protocol == "grpc":
        import tritonclient.grpc as client_lib
        client = client_lib.InferenceServerClient(url)
        metadata = client.get_model_metadata(model, as_json=True, client_timeout=timeout_s)
        for spec in metadata["inputs"] + metadata["outputs"]:
            spec["shape"] = [int(d) for d in spec["shape"]]
    else:
        import tritonclient.http as client_lib
        client = client_lib.InferenceServerClient(url, network_timeout=timeout_s)
        metadata = client.get_model_metadata(model)
    client.close()
    return metadata


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--plan", type=Path, help="the engine to serve (builds a temporary repository)")
    parser.add_argument("--url", help="measure a running server instead (HOST:PORT of its HTTP or gRPC endpoint)")
    parser.add_argument("--models", help="with --url: comma-separated model names")
    parser.add_argument("--out", type=Path, default=Path("out/serve_throughput"))
    parser.add_argument("--protocol", choices=("grpc", "http"), default="grpc")
    parser.add_argument("--concurrency", default=",".join(map(str, LEVELS)), help="comma-separated levels")
    parser.add_argument("--batch", type=int, default=1, help="batch size of each request (default 1)")
    parser.add_argument("--duration", type=float, default=10.0, help="measured seconds per level")
    parser.add_argument("--warmup", type=float, default=2.0, help="unmeasured seconds before each level")
    parser.add_argument("--processes", type=int, default=os.cpu_count() or 4, help="client processes")
    parser.add_argument("--device", help="cpu, cuda:N, or GPUs as cuda:0,cuda:1 for the served instances "
                                         "(--instances on each)")
    parser.add_argument("--instances", type=int, default=1, help="instance_group count")
    parser.add_argument("--max-batch", type=int, default=0, help="max_batch_size (default: the engine's profile max)")
    parser.add_argument("--max-queue-delay-us", type=int, default=500)
    parser.add_argument("--switch-interval-us", type=float, default=0.0,
                        help="with --plan: the server process's GIL switch interval (sys.setswitchinterval; "
                             "0: Python's 5,000). A batcher worker woken by its GPU waits up to this long for the "
                             "event loop to yield the interpreter")
    parser.add_argument("--variants", type=_variants, default=VARIANTS,
                        help="with --plan: the repository entries, of batched (dynamic batching) and single")
    parser.add_argument("--load-generator", choices=("python", "perf_analyzer"), default="python",
                        help="tritonclient processes (default) or Triton's perf_analyzer")
    parser.add_argument("--perf-analyzer", metavar="PATH", help="the perf_analyzer binary (default: PATH, then "
                                                                ".cache/perf_analyzer/perf_analyzer)")
    parser.add_argument("--shared-memory", type=_modes, default=["none"],
                        help="comma-separated, each measured in turn: tensors in the request body (none, the "
                             "default), in system or in CUDA shared memory")
    parser.add_argument("--engine-processes", type=int, default=1,
                        help="engine processes of the server (serve --engine-processes; default 1)")
    parser.add_argument("--frontends", type=int, default=1,
                        help="frontend processes of the server (serve --frontends; default 1: in this process)")
    parser.add_argument("--measure-budget-s", type=float, default=0.0,
                        help="wall-clock seconds one measurement may take, set-up and drain included "
                             "(default: warm-up + duration + 60)")
    parser.add_argument("--request-timeout-s", type=float, default=30.0,
                        help="client-side timeout of every request and region (un)registration")
    parser.add_argument("--budget-s", type=float, default=0.0,
                        help="wall-clock seconds for the whole run, server start included; measurements that "
                             "no longer fit are recorded as skipped (default: no limit)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    progress = Progress(args.out)
    run_deadline = progress.t0 + args.budget_s if args.budget_s > 0 else float("inf")
    measure_budget = args.measure_budget_s or args.warmup + args.duration + 60.0
    stacks_dir = args.out / "stacks"
    main_stacks = _stack_file(stacks_dir / f"main_{os.getpid()}.txt")
    faulthandler.register(signal.SIGUSR1, file=main_stacks, all_threads=True)
    levels = [int(v) for v in args.concurrency.split(",")]
    binary = None
    if args.load_generator == "perf_analyzer":
        binary = find_perf_analyzer(args.perf_analyzer)
        if binary is None:
            parser.error("--load-generator perf_analyzer: no working perf_analyzer (give --perf-analyzer PATH, or run "
                         "bash scripts/install_perf_analyzer.sh and copy .cache/perf_analyzer along)")

    results = {"protocol": args.protocol, "batch": args.batch, "duration_s": args.duration, "warmup_s": args.warmup,
               "frontends": args.frontends, "engine_processes": args.engine_processes,
               "load_generator": args.load_generator,
               "shared_memory": args.shared_memory, "measure_budget_s": measure_budget,
               "request_timeout_s": args.request_timeout_s, "runs": {}}
    server = None
    workdir = None
    if args.url:
        url, models = args.url, [m for m in (args.models or "").split(",") if m]
        if not models:
            parser.error("--url needs --models")
    elif args.plan:
        import logging

        import sartor
        from sartor.serve import ServeOptions, Server
        from sartor.serve.config import engine_max_batch
        # The server's lines (each model's load and warm-up times, engine and frontend processes up) in
        # the run's output; engine processes take this level from here.
        logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s")
        logging.getLogger("sartor").setLevel(logging.INFO)
        progress(f"loading {args.plan.name} for its batch range", "server start")
        engine = sartor.load(args.plan, device=args.device.split(",")[0] if args.device else None)
        max_batch = args.max_batch or engine_max_batch(engine)
        if not max_batch:
            parser.error(f"{args.plan} has no dynamic batch dimension: nothing to batch")
        del engine
        workdir = Path(tempfile.mkdtemp(prefix="sartor-serve-bench-"))
        models = make_repository(args.plan, workdir, max_batch, args.max_queue_delay_us, args.instances, args.device,
                                 args.variants)
        if args.switch_interval_us > 0:
            sys.setswitchinterval(args.switch_interval_us / 1e6)
        results["switch_interval_us"] = sys.getswitchinterval() * 1e6
        progress(f"starting the server ({', '.join(models)}; {args.frontends} frontend process(es)); loading and "
                 f"warming up its models", "server start")
        started = time.monotonic()
        server = Server(ServeOptions(str(workdir), http_port=0, grpc_port=0, metrics_port=None, poll_interval=None,
                                     devices=args.device.split(",") if args.device else None,
                                     max_queue_size=max(4096, 4 * max(levels)), frontends=args.frontends,
                                     engine_processes=args.engine_processes)).start()
        results["server_start_s"] = round(time.monotonic() - started, 1)
        progress(f"server up in {results['server_start_s']:.1f} s")
        url = server.grpc_url if args.protocol == "grpc" else server.http_url
    else:
        parser.error("give --plan or --url")

    try:
        metadata = {model: _metadata(url, args.protocol, model, args.request_timeout_s) for model in models}
        unresponsive = None
        for mode in args.shared_memory:
            runs = results["runs"].setdefault(mode, {})
            for model in models:
                rows = runs.setdefault(model, [])
                for level in levels:
                    left = run_deadline - time.monotonic()
                    if unresponsive is not None:
                        row = {"concurrency": level, "skipped": unresponsive}
                    elif left < args.warmup + args.duration + 10.0:
                        row = {"concurrency": level, "skipped": f"did not fit: {max(left, 0):.0f} s of --budget-s left"}
                    elif binary is not None:
                        output_bytes = max(tensor_bytes(spec, args.batch) for spec in metadata[model]["outputs"])
                        row = perf_analyzer_with_server(server, binary, url, args.protocol, model, args.batch, level,
                                                        args.duration, args.out, mode, output_bytes)
                    else:
                        row = measure(url, args.protocol, model, metadata[model], args.batch, level, args.duration,
                                      args.warmup, args.processes, server_in_process=server is not None,
                                      shared_memory=mode,
                                      frontend_pids=server.frontend_pids if server is not None else None,
                                      budget_s=min(measure_budget, left), request_timeout_s=args.request_timeout_s,
                                      progress=progress, stacks_dir=stacks_dir, server=server)
                        if "error" in row:
                            problem = release_regions(url, args.protocol, mode)
                            if problem is not None:
                                unresponsive = f"skipped: the server stopped answering ({problem})"
                                progress(f"the server does not answer: {problem}")
                    _print_row(model, mode, row)
                    rows.append(row)
                    write_results(args.out, results)
        if server is not None:
            text = server.metrics.render()
            results["batch_size_histograms"] = [line for line in text.splitlines()
                                                if line.startswith("nv_inference_batch_size_")]
    finally:
        write_results(args.out, results)
        progress("stopping the server", "server stop")
        if server is not None:
            server.stop()
        if workdir is not None:
            shutil.rmtree(workdir, ignore_errors=True)
        progress("finished", "finished")
    print((args.out / "results.md").read_text(), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
