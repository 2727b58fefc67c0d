"""What a Python gRPC server costs per request before sartor does anything: bare KServe v2 servers that
answer ModelInfer with a fixed response, driven by Triton's perf_analyzer (C++, its CPU not counted).

Variants:
- `aio`: grpc.aio, as sartor's frontends are;
- `sync`: grpc's thread-pool server (`--workers` threads).
With `--deferred`, each answer waits for a batch-completion step, as a frontend's does for the main
process: the aio handler awaits a future that a timer completes (one timer per batch of waiting
requests), the sync handler blocks on a concurrent future that one completer thread sets (one wake-up
per batch). Without it, handlers answer at once.

Prints per variant: inferences/s at the concurrency, and the server's CPU per request (its CPU over
the whole perf_analyzer run, warm-up included, divided by wall time times the final throughput: an
estimate).

    PYTHONPATH=. python bench/grpc_server_cost.py --variants aio,sync --concurrency 32 [--deferred]
"""
from __future__ import annotations

import argparse
import asyncio
import concurrent.futures as cf
import json
import re
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import serve_throughput as bench  # noqa: E402

DEFER_S = 0.0002  # how long a deferred answer waits for its batch to complete
WIDTH = 16


def _service_handlers(wrap):
    import grpc
    import numpy as np
    from tritonclient.grpc import model_config_pb2 as mc
    from tritonclient.grpc import service_pb2 as pb
    output = np.zeros((1, WIDTH), np.float32).tobytes()
    tensor = pb.ModelMetadataResponse.TensorMetadata

    def metadata(request):
        return pb.ModelMetadataResponse(name="relu", versions=["1"], platform="bare",
                                        inputs=[tensor(name="x", datatype="FP32", shape=[-1, WIDTH])],
                                        outputs=[tensor(name="y", datatype="FP32", shape=[-1, WIDTH])])

    def config(request):
        return pb.ModelConfigResponse(config=mc.ModelConfig(
            name="relu", max_batch_size=128, input=[mc.ModelInput(name="x", data_type=mc.TYPE_FP32, dims=[WIDTH])],
            output=[mc.ModelOutput(name="y", data_type=mc.TYPE_FP32, dims=[WIDTH])]))

    def infer(request):
        return pb.ModelInferResponse(model_name="relu", model_version="1", id=request.id, raw_output_contents=[output],
                                     outputs=[pb.ModelInferResponse.InferOutputTensor(name="y", datatype="FP32",
                                                                                      shape=[1, WIDTH])])
    table = {}
    for method in pb.DESCRIPTOR.services_by_name["GRPCInferenceService"].methods:
        if method.name == "ModelStreamInfer":
            continue
        request_cls, response_cls = getattr(pb, method.input_type.name), getattr(pb, method.output_type.name)
        answer = {"ModelMetadata": metadata, "ModelConfig": config}.get(method.name, lambda r, cls=response_cls: cls())
        table[method.name] = grpc.unary_unary_rpc_method_handler(
            wrap(infer if method.name == "ModelInfer" else answer, method.name == "ModelInfer"),
            request_deserializer=request_cls.FromString, response_serializer=response_cls.SerializeToString)
    return grpc.method_handlers_generic_handler("inference.GRPCInferenceService", table)


class _Completer:
    """Sets submitted concurrent futures from one thread, a batch per wake-up (a channel reader's role)."""

    def __init__(self) -> None:
        self._lock, self._wake, self._items = threading.Lock(), threading.Event(), []
        threading.Thread(target=self._run, daemon=True).start()

    def submit(self, value) -> cf.Future:
        future = cf.Future()
        with self._lock:
            self._items.append((future, value))
            first = len(self._items) == 1
        if first:
            self._wake.set()
        return future

    def _run(self) -> None:
        while True:
            self._wake.wait()
            self._wake.clear()
            time.sleep(DEFER_S)
            with self._lock:
                items, self._items = self._items, []
            for future, value in items:
                future.set_result(value)


def serve_sync(port: int, workers: int, deferred: bool) -> None:
    import grpc
    server = grpc.server(cf.ThreadPoolExecutor(workers))
    completer = _Completer() if deferred else None

    def wrap(answer, is_infer):
        if is_infer and completer is not None:
            return lambda request, context: completer.submit(answer(request)).result()
        return lambda request, context: answer(request)
    server.add_generic_rpc_handlers((_service_handlers(wrap),))
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    server.wait_for_termination()


async def serve_aio(port: int, deferred: bool) -> None:
    import grpc
    server = grpc.aio.server()
    loop = asyncio.get_running_loop()
    waiting: list = []

    def complete() -> None:
        items = list(waiting)
        waiting.clear()
        for future, value in items:
            future.set_result(value)

    def wrap(answer, is_infer):
        async def handler(request, context):
            if not (is_infer and deferred):
                return answer(request)
            future = loop.create_future()
            waiting.append((future, answer(request)))
            if len(waiting) == 1:
                loop.call_later(DEFER_S, complete)
            return await future
        return handler
    server.add_generic_rpc_handlers((_service_handlers(wrap),))
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    await server.wait_for_termination()


def measure(variant: str, binary: str, concurrency: int, duration: float, workers: int, deferred: bool) -> dict:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = subprocess.Popen([sys.executable, __file__, "--serve", variant, "--port", str(port), "--workers",
                               str(workers)] + (["--deferred"] if deferred else []))
    try:
        time.sleep(3.0)  # imports and bind
        cpu_before, wall_before = bench._cpu_s([server.pid]), time.monotonic()
        done = subprocess.run([binary, "-m", "relu", "-u", f"127.0.0.1:{port}", "-i", "grpc", "--shape", f"x:{WIDTH}",
                               "--concurrency-range", f"{concurrency}:{concurrency}", "--measurement-interval",
                               str(int(duration * 1000)), "--max-trials", "4", "--stability-percentage", "100"],
                              check=False, capture_output=True, text=True, timeout=20 * duration + 120)
        cpu, wall = bench._cpu_s([server.pid]) - cpu_before, time.monotonic() - wall_before
    finally:
        server.kill()
        server.wait()
    found = re.findall(r"Throughput: ([\d.]+) infer/sec", done.stdout)
    if done.returncode != 0 or not found:
        return {"variant": variant, "error": (done.stdout + done.stderr).strip().splitlines()[-1:]}
    rate = float(found[-1])
    return {"variant": variant, "workers": workers if variant == "sync" else None, "deferred": deferred,
            "concurrency": concurrency, "infer_per_s": round(rate), "server_cores": round(cpu / wall, 2),
            "server_cpu_ms_per_request": round(cpu / wall / rate * 1e3, 3)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variants", default="aio,sync")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--duration", type=float, default=4.0, help="perf_analyzer's measurement interval, s")
    parser.add_argument("--workers", type=int, default=64, help="threads of the sync server")
    parser.add_argument("--deferred", action="store_true")
    parser.add_argument("--repeat", type=int, default=2, help="rounds over the variants, interleaved")
    parser.add_argument("--perf-analyzer", metavar="PATH")
    parser.add_argument("--serve", choices=("aio", "sync"), help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve == "sync":
        serve_sync(args.port, args.workers, args.deferred)
        return 0
    if args.serve == "aio":
        asyncio.run(serve_aio(args.port, args.deferred))
        return 0
    binary = bench.find_perf_analyzer(args.perf_analyzer)
    if binary is None:
        print("perf_analyzer not found: bash scripts/install_perf_analyzer.sh", file=sys.stderr)
        return 1
    for _ in range(args.repeat):
        for variant in args.variants.split(","):
            print(json.dumps(measure(variant, binary, args.concurrency, args.duration, args.workers, args.deferred)),
                  flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
