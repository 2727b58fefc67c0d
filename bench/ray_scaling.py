"""Issue 35's figures in one run: Ray Data against the single-process pipeline, and Ray Serve against
`sartor serve`, on the same engine and the same JPEG frames.

- single: `Pipeline.run` over --count frames (paths, repeated from --frames; files in the page
  cache after the warm-up), batch --batch, the decoder SartorPredictor chooses (in-engine NMS, or
  --decoder yolo for a raw YOLO head): frames/s after a warm-up pass over 4 batches;
- ray_data: the same paths through the Dataset `sartor infer --ray` runs
  (`sartor.integrations.ray_infer.predictions`: SartorPredictor, one actor per GPU, num_gpus=1),
  Ray batches of --ray-batches engine batches (the Pipeline inside runs --batch at a time, decoding
  the next batch while one runs): frames/s over the whole run (actor start included) and from the
  batches that bring the 10th to the 90th percent of the rows (steady), and `ratio` = steady /
  single (issue 35 asks ≥ 0.8), `ratio_whole_run` with the actors' start;
- serve: --concurrency client threads posting the JPEG bytes to `/v2/models/model/infer_image` for
  --duration s, against Ray Serve (`sartor_app`, one replica per GPU, `@serve.batch` of --batch)
  and then against `sartor serve` (dynamic batching, max_batch_size --batch) over the same
  repository: requests/s, p50 and p99 latency.

    PYTHONPATH=. python bench/make_frames.py .carry/frames --count 48
    PYTHONPATH=. python bench/ray_scaling.py --engine yolov8n.plan --frames .carry/frames --count 10000 \
        --decoder yolo --out $OUT

On the H200 with Ray carried: bench/h200_ray.sh. Writes ray_scaling.json under --out (after each
part) and prints each figure as it lands."""
from __future__ import annotations

import argparse
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

STARTED = time.monotonic()
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # the device machine reaches no network


def log(message: str) -> None:
    print(f"[{time.monotonic() - STARTED:7.1f} s] {message}", flush=True)


def single_process(args, files: list[str]) -> dict:
    from sartor.integrations.ray_data import SartorPredictor
    predictor = SartorPredictor(args.engine, batch_size=args.batch, decoder=args.decoder)
    predictor.pipeline.run(files[:4 * args.batch])  # warm-up: CUDA graphs, kernels, page cache
    start = time.perf_counter()
    results = predictor.pipeline.run(files)
    seconds = time.perf_counter() - start
    assert len(results) == len(files) and not any(r.error for r in results)
    out = {"frames": len(files), "seconds": seconds, "frames_per_s": len(files) / seconds,
           "decoder": type(predictor.pipeline.decoder).__name__, "device": str(predictor.pipeline.engine.device),
           "detections_per_frame": sum(len(r.detections) for r in results if r.detections is not None) / len(files)}
    del predictor, results
    import torch
    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # the actors and replicas that follow take the GPU
    return out


def ray_data(args, files: list[str]) -> dict:
    import ray

    from sartor.integrations.ray_infer import predictions
    gpus = int(ray.cluster_resources().get("GPU", 0))
    actors = max(gpus, 1)
    options = {"column": "path", "batch_size": args.batch, "decoder": args.decoder}
    ds = predictions(ray, args.engine, files, rows_per_batch=args.batch * args.ray_batches, actors=actors,
                     gpus_per_actor=1 if gpus else 0, predictor_options=options)
    start = time.perf_counter()
    arrivals = []  # (time, rows so far) at each batch's arrival
    rows = 0
    for batch in ds.iter_batches(batch_size=None, batch_format="numpy"):
        rows += len(batch["path"])
        arrivals.append((time.perf_counter(), rows))
    end = time.perf_counter()
    assert rows == len(files), (rows, len(files))
    # Steady: between the batches that bring the 10th and the 90th percent of the rows, so that
    # neither the actors' start (engine load, first CUDA graphs) nor the last stragglers count.
    lo = next(a for a in arrivals if a[1] >= 0.1 * rows)
    hi = next(a for a in arrivals if a[1] >= 0.9 * rows)
    steady = (hi[1] - lo[1]) / (hi[0] - lo[0]) if hi[0] > lo[0] else float("nan")
    return {"frames": rows, "actors": actors, "gpus": gpus, "rows_per_ray_batch": args.batch * args.ray_batches,
            "seconds": end - start, "frames_per_s": rows / (end - start), "first_result_s": arrivals[0][0] - start,
            "batches_seen": len(arrivals), "steady_frames_per_s": steady, "steady_rows": hi[1] - lo[1]}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def load(url: str, bodies: list[bytes], concurrency: int, duration: float) -> dict:
    """`concurrency` threads posting bodies in turn for `duration` s (after 2 s of warm-up)."""
    latencies, failures, stop_at = [], [0], [time.monotonic() + 2 + duration]
    measuring = threading.Event()
    lock = threading.Lock()

    def client(k: int) -> None:
        i = k
        while time.monotonic() < stop_at[0]:
            body = bodies[i % len(bodies)]
            i += concurrency
            t0 = time.perf_counter()
            try:
                request = urllib.request.Request(url, data=body, headers={"Content-Type": "image/jpeg"})
                with urllib.request.urlopen(request, timeout=60) as response:
                    response.read()
                ok = response.status == 200
            except OSError:
                ok = False
            elapsed = time.perf_counter() - t0
            if measuring.is_set():
                with lock:
                    if ok:
                        latencies.append(elapsed)
                    else:
                        failures[0] += 1

    threads = [threading.Thread(target=client, args=(k,), daemon=True) for k in range(concurrency)]
    for t in threads:
        t.start()
    time.sleep(2)
    measuring.set()
    begin = time.monotonic()
    for t in threads:
        t.join()
    seconds = time.monotonic() - begin
    ms = sorted(1000 * x for x in latencies)
    return {"concurrency": concurrency, "requests_per_s": len(ms) / seconds, "failures": failures[0],
            "p50_ms": statistics.median(ms) if ms else None,
            "p99_ms": ms[min(len(ms) - 1, int(0.99 * len(ms)))] if ms else None}


def serve_both(args, bodies: list[bytes]) -> dict:
    import ray
    from ray import serve

    from sartor.integrations.ray_serve import sartor_app
    repository = Path(tempfile.mkdtemp(prefix="ray_scaling_repo_"))
    (repository / "model" / "1").mkdir(parents=True)
    os.symlink(os.path.abspath(args.engine), repository / "model" / "1" / "model.plan")
    (repository / "model" / "config.pbtxt").write_text(
        f"max_batch_size: {args.batch}\ndynamic_batching {{ max_queue_delay_microseconds: 2000 }}\n")
    gpus = int(ray.cluster_resources().get("GPU", 0))
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(sartor_app(str(repository), num_gpus=1 if gpus else 0, num_replicas=max(gpus, 1),
                         max_batch_size=args.batch, batch_wait_timeout_s=0.002), route_prefix="/")
    url = f"http://127.0.0.1:{port}/v2/models/model/infer_image"
    # A replica loads a model at its first request and warms it (every batch size it will form)
    # before answering; sartor serve below does the same before it says it serves.
    started = time.perf_counter()
    with urllib.request.urlopen(urllib.request.Request(url, data=bodies[0], headers={"Content-Type": "image/jpeg"}),
                                timeout=300) as response:
        response.read()
    log(f"ray serve: model loaded and warmed by the first request in {time.perf_counter() - started:.1f} s")
    out = {"ray_serve": load(url, bodies, args.concurrency, args.duration)}
    log(f"ray serve: {out['ray_serve']}")
    serve.shutdown()
    server = subprocess.Popen([sys.executable, "-m", "sartor", "serve", "--model-repository", str(repository),
                               "--http-port", "0", "--grpc-port", "-1", "--metrics-port", "-1", "--poll-interval", "0"],
                              stdout=subprocess.PIPE, text=True, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    try:
        for line in server.stdout:
            match = re.search(r"serving on HTTP [\d.]+:(\d+)", line)
            if match:
                break
        else:
            raise RuntimeError("sartor serve ended before it served")
        out["sartor_serve"] = load(f"http://127.0.0.1:{match.group(1)}/v2/models/model/infer_image", bodies,
                                   args.concurrency, args.duration)
        log(f"sartor serve: {out['sartor_serve']}")
    finally:
        server.terminate()
        server.wait(60)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine", required=True)
    parser.add_argument("--frames", required=True, help="a folder of JPEG frames (bench/make_frames.py)")
    parser.add_argument("--count", type=int, default=10000)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--ray-batches", type=int, default=8, help="engine batches per Ray batch (default 8)")
    parser.add_argument("--object-store-gb", type=float, default=8,
                        help="Ray's object store (default 8 GB; Ray's own default, 30%% of memory, can exceed "
                             "/dev/shm)")
    parser.add_argument("--decoder", choices=("auto", "none", "yolo"), default="auto")
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--duration", type=float, default=20)
    parser.add_argument("--num-cpus", type=int, default=None, help="CPUs of the local Ray (default: all)")
    parser.add_argument("--skip", default="", help="comma-separated: single, ray_data, serve")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    args.engine = os.path.abspath(args.engine)  # Ray's workers may start elsewhere
    import ray

    from sartor.pipeline.benchmark import image_files
    frames = [str(p) for p in image_files(args.frames)]
    files = [frames[i % len(frames)] for i in range(args.count)]
    skip = set(filter(None, args.skip.split(",")))
    out_path = Path(args.out) / "ray_scaling.json"
    out_path.parent.mkdir(parents=True, exist_ok=True)
    import torch
    report = {"engine": args.engine, "frames": len(frames), "count": args.count, "batch": args.batch,
              "ray_batches": args.ray_batches, "ray": ray.__version__, "torch": torch.__version__,
              "python": sys.version.split()[0],
              "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None}
    if "single" not in skip:
        report["single"] = single_process(args, files)
        log(f"single process: {report['single']}")
        out_path.write_text(json.dumps(report, indent=1))
    # One machine: the loopback address, not one found by routing towards a public address the
    # device machine has no route to
    ray.init(num_cpus=args.num_cpus, include_dashboard=False, log_to_driver=False,
             object_store_memory=int(args.object_store_gb * 1e9), _node_ip_address="127.0.0.1")
    ray.data.DataContext.get_current().enable_progress_bars = False
    if "ray_data" not in skip:
        report["ray_data"] = ray_data(args, files)
        if "single" in report:
            single = report["single"]["frames_per_s"]
            report["ray_data"]["ratio"] = report["ray_data"]["steady_frames_per_s"] / single
            report["ray_data"]["ratio_whole_run"] = report["ray_data"]["frames_per_s"] / single
        log(f"ray data: {report['ray_data']}")
        out_path.write_text(json.dumps(report, indent=1))
    if "serve" not in skip:
        report["serve"] = serve_both(args, [Path(f).read_bytes() for f in frames])
        out_path.write_text(json.dumps(report, indent=1))
    ray.shutdown()
    log(f"wrote {out_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
