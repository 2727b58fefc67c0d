"""`sartor serve` throughput against concurrency (1..256), with and without dynamic batching.

Builds a model repository around one engine (two entries: `<name>_batched` with dynamic batching,
`<name>_single` without), starts the server in this process on loopback, and drives it with Triton
clients. The load generator (`--load-generator`):

- `python` (the default): tritonclient in several client processes (threads within each, one client
  per thread, synchronous requests), needing nothing beyond the serve extras;
- `perf_analyzer`: Triton's own load generator, one run per concurrency level.
  It is looked for at `--perf-analyzer`, then on PATH, then at `.cache/perf_analyzer/perf_analyzer`
  in this tree, where `bash scripts/install_perf_analyzer.sh` puts it (a machine without internet
  needs that folder copied along: nothing is downloaded here).

`--shared-memory none|system|cuda` passes the tensors in the request body (the default), in POSIX
shared memory, or in CUDA shared memory (cudaIpc handles; the client process allocates on GPU 0).
With the python load generator every client thread creates and registers its own input and output
regions (names and keys carry the process id and thread number) and unregisters them at the end of
its level; perf_analyzer does the same per run.

Reports inferences/s and p50/p90/p99 latency per concurrency level, writes results.json and
results.md under --out.

For the GPU (not run in CI):

    PYTHONPATH=. python bench/serve_throughput.py --plan resnet50_fp16.plan --out $OUT \
        --device cuda:0 --instances 2 --max-queue-delay-us 500 --protocol grpc [--load-generator perf_analyzer]

`--url HOST:PORT` measures a server that is already running (then --models names its models).
"""
from __future__ import annotations

import argparse
import csv
import json
import multiprocessing as mp
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

LEVELS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def make_repository(plan: Path, root: Path, max_batch: int, delay_us: int, instances: int, device: str | None) -> list[str]:
    name = plan.stem.replace(".", "_")
    gpus = f" gpus: [{device.partition(':')[2] or 0}]" if device and device.startswith("cuda") else ""
    group = f"instance_group [{{ count: {instances}{gpus} }}]\n"
    models = {f"{name}_batched": f"max_batch_size: {max_batch}\ndynamic_batching {{ max_queue_delay_microseconds: "
                                 f"{delay_us} }}\n{group}",
              f"{name}_single": f"max_batch_size: {max_batch}\n{group}"}
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
    server under names of its own; `close()` unregisters and frees them."""

    def __init__(self, client, protocol: str, kind: str, metadata: dict, batch: int, inputs, tag: str) -> None:
        if protocol == "grpc":
            import tritonclient.grpc as client_lib
        else:
            import tritonclient.http as client_lib
        self.client, self.kind, self.handles = client, kind, []
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
            key = f"/sartor_bench_{name}"
            handle = shm.create_shared_memory_region(name, key, size)
            if data is not None:
                shm.set_shared_memory_region(handle, [data])
            self.client.register_system_shared_memory(name, key, size)
        else:
            import tritonclient.utils.cuda_shared_memory as cudashm
            handle = cudashm.create_shared_memory_region(name, size, 0)
            if data is not None:
                cudashm.set_shared_memory_region(handle, [data])
            self.client.register_cuda_shared_memory(name, cudashm.get_raw_handle(handle), 0, size)
        self.handles.append((name, handle))

    def close(self) -> None:
        for name, handle in self.handles:
            if self.kind == "system":
                import tritonclient.utils.shared_memory as shm
                self.client.unregister_system_shared_memory(name)
                shm.destroy_shared_memory_region(handle)
            else:
                import tritonclient.utils.cuda_shared_memory as cudashm
                self.client.unregister_cuda_shared_memory(name)
                cudashm.destroy_shared_memory_region(handle)


def _client_process(url: str, protocol: str, model: str, metadata: dict, batch: int, threads: int,
                    duration: float, warmup: float, queue, shared_memory: str = "none") -> None:
    import threading
    latencies: list[float] = []
    errors = [0]
    answered = [0]  # warm-up included: what the server's CPU time is spent on
    lock = threading.Lock()
    start_at = time.monotonic() + warmup
    stop_at = start_at + duration

    def worker(k: int) -> None:
        if protocol == "grpc":
            import tritonclient.grpc as client_lib
            client = client_lib.InferenceServerClient(url)
        else:
            import tritonclient.http as client_lib
            client = client_lib.InferenceServerClient(url, network_timeout=120.0)
        inputs = request_inputs(metadata, batch, protocol, seed=k)
        regions = None
        if shared_memory != "none":
            regions = Regions(client, protocol, shared_memory, metadata, batch, inputs, f"p{os.getpid()}_t{k}")
        outputs = regions.outputs if regions is not None else None
        mine = []
        count = 0
        while True:
            t0 = time.monotonic()
            if t0 >= stop_at:
                break
            try:
                client.infer(model, inputs, outputs=outputs)
            except Exception:
                with lock:
                    errors[0] += 1
                continue
            t1 = time.monotonic()
            count += 1
            if t0 >= start_at:
                mine.append(t1 - t0)
        with lock:
            latencies.extend(mine)
            answered[0] += count
        if regions is not None:
            regions.close()
        client.close()

    pool = [threading.Thread(target=worker, args=(k,)) for k in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    queue.put((latencies, errors[0], answered[0]))


def measure(url: str, protocol: str, model: str, metadata: dict, batch: int, concurrency: int,
            duration: float, warmup: float, processes: int, server_in_process: bool = False,
            shared_memory: str = "none", frontend_pids: list | None = None) -> dict:
    """One level. With the server in this process, also its CPU time per request (the client
    processes are children, not counted), which says what the server costs when the load generator
    shares the cores. With frontend processes (serve --frontends N), "server CPU" is this main
    process only (batching and running), and theirs is reported apart."""
    processes = max(1, min(processes, concurrency))
    shares = [concurrency // processes + (1 if i < concurrency % processes else 0) for i in range(processes)]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_client_process,
                         args=(url, protocol, model, metadata, batch, n, duration, warmup, queue, shared_memory))
             for n in shares]
    for p in procs:
        p.start()
    cpu_before = time.process_time()
    frontends_before = _cpu_s(frontend_pids or [])
    latencies, errors, answered = [], 0, 0
    for _ in procs:
        lat, err, count = queue.get(timeout=duration + warmup + 600)
        latencies += lat
        errors += err
        answered += count
    for p in procs:
        p.join(60)
    cpu_s = time.process_time() - cpu_before
    frontends_s = _cpu_s(frontend_pids or []) - frontends_before
    ms = sorted(v * 1e3 for v in latencies)
    pick = lambda q: ms[min(len(ms) - 1, int(q * len(ms)))] if ms else float("nan")  # noqa: E731
    return {"concurrency": concurrency, "requests": len(ms), "errors": errors,
            "infer_per_s": len(ms) * batch / duration, "p50_ms": pick(0.5), "p90_ms": pick(0.9),
            "p99_ms": pick(0.99), "mean_ms": statistics.fmean(ms) if ms else float("nan"),
            "server_cpu_ms_per_request": cpu_s * 1e3 / max(answered, 1) if server_in_process else float("nan"),
            "frontend_cpu_ms_per_request": frontends_s * 1e3 / max(answered, 1) if frontend_pids else float("nan")}


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
    parser.add_argument("--device", help="cpu or cuda:N for the served instances")
    parser.add_argument("--instances", type=int, default=1, help="instance_group count")
    parser.add_argument("--max-batch", type=int, default=0, help="max_batch_size (default: the engine's profile max)")
    parser.add_argument("--max-queue-delay-us", type=int, default=500)
    parser.add_argument("--load-generator", choices=("python", "perf_analyzer"), default="python",
                        help="tritonclient processes (default) or Triton's perf_analyzer")
    parser.add_argument("--perf-analyzer", metavar="PATH", help="the perf_analyzer binary (default: PATH, then "
                                                                ".cache/perf_analyzer/perf_analyzer)")
    parser.add_argument("--shared-memory", choices=("none", "system", "cuda"), default="none",
                        help="tensors in the request body (default), in system or in CUDA shared memory")
    parser.add_argument("--frontends", type=int, default=1,
                        help="frontend processes of the server (serve --frontends; default 1: in this process)")
    args = parser.parse_args()
    levels = [int(v) for v in args.concurrency.split(",")]
    args.out.mkdir(parents=True, exist_ok=True)
    binary = None
    if args.load_generator == "perf_analyzer":
        binary = find_perf_analyzer(args.perf_analyzer)
        if binary is None:
            parser.error("--load-generator perf_analyzer: no working perf_analyzer (give --perf-analyzer PATH, or run "
                         "bash scripts/install_perf_analyzer.sh and copy .cache/perf_analyzer along)")

    server = None
    workdir = None
    if args.url:
        url, models = args.url, [m for m in (args.models or "").split(",") if m]
        if not models:
            parser.error("--url needs --models")
    elif args.plan:
        import sartor
        from sartor.serve import ServeOptions, Server
        from sartor.serve.config import engine_max_batch
        engine = sartor.load(args.plan, device=args.device)
        max_batch = args.max_batch or engine_max_batch(engine)
        if not max_batch:
            parser.error(f"{args.plan} has no dynamic batch dimension: nothing to batch")
        del engine
        workdir = Path(tempfile.mkdtemp(prefix="sartor-serve-bench-"))
        models = make_repository(args.plan, workdir, max_batch, args.max_queue_delay_us, args.instances, args.device)
        server = Server(ServeOptions(str(workdir), http_port=0, grpc_port=0, metrics_port=None, poll_interval=None,
                                     devices=[args.device] if args.device else None,
                                     max_queue_size=max(4096, 4 * max(levels)), frontends=args.frontends)).start()
        url = server.grpc_url if args.protocol == "grpc" else server.http_url
    else:
        parser.error("give --plan or --url")

    results = {"protocol": args.protocol, "batch": args.batch, "duration_s": args.duration, "frontends": args.frontends,
               "load_generator": args.load_generator, "shared_memory": args.shared_memory, "models": {}}
    try:
        for model in models:
            if args.protocol == "grpc":
                import tritonclient.grpc as client_lib
                metadata = client_lib.InferenceServerClient(url).get_model_metadata(model, as_json=True)
                for spec in metadata["inputs"] + metadata["outputs"]:
                    spec["shape"] = [int(d) for d in spec["shape"]]
            else:
                import tritonclient.http as client_lib
                metadata = client_lib.InferenceServerClient(url).get_model_metadata(model)
            rows = []
            for level in levels:
                if binary is not None:
                    output_bytes = max(tensor_bytes(spec, args.batch) for spec in metadata["outputs"])
                    row = perf_analyzer(binary, url, args.protocol, model, args.batch, level, args.duration, args.out,
                                        args.shared_memory, output_bytes)
                else:
                    row = measure(url, args.protocol, model, metadata, args.batch, level, args.duration, args.warmup,
                                  args.processes, server_in_process=server is not None,
                                  shared_memory=args.shared_memory,
                                  frontend_pids=server.frontend_pids if server is not None else None)
                print(f"{model:>28} c={level:<4} {row['infer_per_s']:10.1f} inf/s  p50 {row['p50_ms']:8.2f} ms  "
                      f"p99 {row['p99_ms']:8.2f} ms  server CPU {row.get('server_cpu_ms_per_request', float('nan')):6.3f} ms/req  "
                      f"frontends CPU {row.get('frontend_cpu_ms_per_request', float('nan')):6.3f} ms/req  "
                      f"errors {row['errors']}", flush=True)
                rows.append(row)
            results["models"][model] = rows
        if server is not None:
            text = server.metrics.render()
            results["batch_size_histograms"] = [line for line in text.splitlines()
                                                if line.startswith("nv_inference_batch_size_")]
    finally:
        if server is not None:
            server.stop()
        if workdir is not None:
            shutil.rmtree(workdir, ignore_errors=True)

    (args.out / "results.json").write_text(json.dumps(results, indent=2))
    lines = [f"# sartor serve throughput ({args.protocol}, request batch {args.batch}, {args.load_generator}, "
             f"shared memory {args.shared_memory}, frontends {args.frontends})", "",
             "| model | concurrency | infer/s | p50 ms | p90 ms | p99 ms | server CPU ms/request | errors |",
             "|---|---|---|---|---|---|---|---|"]
    for model, rows in results["models"].items():
        for r in rows:
            lines.append(f"| {model} | {r['concurrency']} | {r['infer_per_s']:.1f} | {r['p50_ms']:.2f} | "
                         f"{r['p90_ms']:.2f} | {r['p99_ms']:.2f} | {r.get('server_cpu_ms_per_request', float('nan')):.3f} | "
                         f"{r['errors']} |")
    (args.out / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
