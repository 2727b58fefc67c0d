"""The main process's CPU per request of `sartor serve --frontends N` against how many requests reach
it per wake-up, without gRPC, HTTP or a load generator in the way.

Under load the main process reads many frontend frames per wake-up; what it spends per request then
decides how far one process goes. Here a fake frontend (a child process speaking the channel
protocol of sartor/serve/ipc.py) sends one grouped frame of G batch-1 requests to a one-Relu engine
(CPU, FP32, [batch, 16], batch 1..128, dynamic batching), or to the engine `--plan` on `--device`
(batch-1 inputs of its first profile's opt shape, tensors in the frame's body), waits for every
answer, and repeats, so that each wake-up holds exactly G requests. Reported per G: requests/s and the main process's CPU
per request (this process: the server runs in it; the fake frontend's CPU is not counted). The server
starts 2 real frontend processes (1 serves in-process, with no channel); they stay idle.

    PYTHONPATH=. python bench/serve_group_cost.py --groups 1,4,16,64 --duration 5
    PYTHONPATH=. python bench/serve_group_cost.py --plan resnet50.plan --device cuda:0 --groups 1,16,64,128
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import shutil
import socket
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import serve_main_cpu  # noqa: E402
import serve_throughput as bench  # noqa: E402


def _answered_ids(header: dict, payload, ipc) -> list:
    if header.get("k") == "G":
        return [entry["id"] for entry, _ in ipc.group_members(header, payload)]
    return [header["id"]]


def request_tensors(engine) -> dict:
    """One batch-1 request's inputs: name -> (shape, numpy dtype name); the one-Relu engine's without one."""
    if engine is None:
        return {"x": ((1, serve_main_cpu.WIDTH), "float32")}
    profile = engine.profiles[0]
    return {v.name: ((1, *profile.shapes[v.name].opt[1:]), v.dtype) for v in engine.inputs}


def fake_frontend(path: str, model: str, tensors: dict, group: int, duration: float, warmup: float, result) -> None:
    """Send groups of `group` requests until `warmup + duration` s have passed; put (requests in the
    measured window, errors, measured seconds) on `result`."""
    from sartor.serve import ipc
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(path)
    rng = np.random.default_rng(0)
    described, buffers = ipc.encode_tensors({name: rng.standard_normal(shape).astype(dtype)
                                             for name, (shape, dtype) in tensors.items()})
    received, next_id, errors, counted = b"", 1, 0, 0
    start = time.monotonic()
    measuring_from = start + warmup
    end = measuring_from + duration
    while True:
        now = time.monotonic()
        if now >= end:
            break
        ids = list(range(next_id, next_id + group))
        next_id += group
        headers = [{"k": "i", "id": i, "model": model, "version": None, "inputs": described, "outputs": None,
                    "regions": {}, "timeout": None, "deadline": None} for i in ids]
        pieces = ipc.frame({"k": "g", "rs": headers}, tuple(buffers) * group)
        sock.sendall(b"".join(bytes(memoryview(p)) for p in pieces))
        waiting = set(ids)
        while waiting:
            while len(received) >= ipc.PREFIX.size:
                head, size = ipc.PREFIX.unpack_from(received)
                total = ipc.PREFIX.size + head + size
                if len(received) < total:
                    break
                header, payload = ipc.parse(received[:total])
                received = received[total:]
                for entry_id in _answered_ids(header, payload, ipc):
                    waiting.discard(entry_id)
                errors += header.get("k") == "e" or any(e.get("k") == "e" for e in header.get("rs", ()))
            if waiting:
                chunk = sock.recv(1 << 20)
                if not chunk:
                    raise ConnectionError("the main process closed the channel")
                received += chunk
        if now >= measuring_from:
            counted += group
    result.put((counted, errors, duration))
    sock.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--groups", default="1,4,16,64", help="comma-separated requests per frame")
    parser.add_argument("--duration", type=float, default=5.0)
    parser.add_argument("--warmup", type=float, default=1.0)
    parser.add_argument("--json", type=Path, help="also write the rows here")
    parser.add_argument("--plan", type=Path, help="serve this engine instead of the one-Relu engine")
    parser.add_argument("--device", default="cpu", help="where the served instance runs (default cpu)")
    args = parser.parse_args()

    from sartor.serve import ServeOptions, Server
    workdir = Path(tempfile.mkdtemp(prefix="sartor-serve-group-cost-"))
    rows = []
    try:
        plan, max_batch, engine = serve_main_cpu.plan_to_serve(args.plan, args.device, workdir)
        tensors = request_tensors(engine)
        del engine
        repo = workdir / "repo"
        (model,) = bench.make_repository(plan, repo, max_batch, 500, 1, args.device, ("batched",))
        server = Server(ServeOptions(str(repo), http_port=0, grpc_port=None, metrics_port=None, poll_interval=None,
                                     devices=[args.device], max_queue_size=4096, frontends=2)).start()
        spawn = multiprocessing.get_context("spawn")
        try:
            for group in map(int, args.groups.split(",")):
                result = spawn.Queue()
                child = spawn.Process(target=fake_frontend, args=(server._pool._path("ipc"), model, tensors, group,
                                                                  args.duration, args.warmup, result))
                child.start()
                time.sleep(args.warmup)
                cpu_before = time.process_time()
                counted, errors, seconds = result.get(timeout=args.warmup + args.duration + 60)
                cpu = time.process_time() - cpu_before
                child.join(10)
                row = {"group": group, "requests_per_s": round(counted / seconds), "errors": errors,
                       "main_cpu_us_per_request": round(cpu * 1e6 / max(counted, 1), 1)}
                rows.append(row)
                print(json.dumps(row), flush=True)
        finally:
            server.stop()
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
