"""The main process's CPU per request behind `sartor serve --frontends N`, on any machine.

Serves a one-Relu engine (CPU, FP32, [batch, 16], batch 1..128), or the engine `--plan` on `--device`,
with dynamic batching and N frontend processes in this process, drives it with
bench/serve_throughput.py's python load generator (batch-1 requests, system shared memory by default,
so tensor bytes do not dominate; `cuda` on a GPU) and prints the main process's CPU ms per request
for each run. `--profile` also runs every thread of the main process under cProfile for the measured
window (this inflates the CPU it reports) and prints the functions by own time, summed over threads.

    PYTHONPATH=. python bench/serve_main_cpu.py --runs 3 --concurrency 32 [--profile] [--protocol http]
    PYTHONPATH=. python bench/serve_main_cpu.py --plan resnet50.plan --device cuda:0 --shared-memory cuda \
        --frontends 8 --processes 8 --concurrency 256 --profile
"""
from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import serve_throughput as bench  # noqa: E402

WIDTH = 16
MAX_BATCH = 128


def relu_plan(directory: Path) -> Path:
    import onnx
    from onnx import TensorProto, helper

    import sartor
    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "relu",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", WIDTH])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", WIDTH])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(directory / "relu.onnx"))
    plan = directory / "relu.plan"
    sartor.build(directory / "relu.onnx", plan, device="cpu", min_shapes={"x": (1, WIDTH)},
                 opt_shapes={"x": (32, WIDTH)}, max_shapes={"x": (MAX_BATCH, WIDTH)})
    return plan


def plan_to_serve(plan: Path | None, device: str, workdir: Path) -> tuple[Path, int, object]:
    """(the engine file, the max_batch_size to serve it with, the engine loaded on `device` or None):
    `plan`, or the one-Relu engine built in `workdir`."""
    if plan is None:
        return relu_plan(workdir), MAX_BATCH, None
    import sartor
    from sartor.serve.config import engine_max_batch
    engine = sartor.load(plan, device=device)
    max_batch = engine_max_batch(engine)
    if not max_batch:
        raise SystemExit(f"{plan} has no dynamic batch dimension: nothing to batch")
    return plan, max_batch, engine


class ThreadProfiles:
    """Before Python 3.12: one cProfile.Profile per thread of this process, switched on from inside
    each thread (a profiler records only the thread that enabled it): new threads through
    threading.setprofile, running ones (the event loop) through a call scheduled on them.

    From 3.12 cProfile runs on sys.monitoring, which takes one profiler per process and sees every
    thread: a second one fails ("Another profiling tool is already active"). There one profiler,
    on the wall clock, records all threads; a thread's waits then count as its own time, so the
    report says so."""

    PROCESS_WIDE = sys.version_info >= (3, 12)

    def __init__(self) -> None:
        self.profiles: list[cProfile.Profile] = []

    def hook(self, *_) -> None:
        profile = cProfile.Profile(time.thread_time)  # CPU, not wall: waits cost nothing
        self.profiles.append(profile)
        profile.enable()  # replaces this hook as the thread's profile function

    def before_server_start(self) -> None:
        if not self.PROCESS_WIDE:
            threading.setprofile(self.hook)

    def after_server_start(self, loop) -> None:
        if self.PROCESS_WIDE:
            profile = cProfile.Profile()
            self.profiles.append(profile)
            profile.enable()
        else:
            threading.setprofile(None)
            loop.call_soon_threadsafe(self.hook)

    def report(self, top: int) -> None:
        recorded = []
        for profile in self.profiles:
            profile.disable()
            profile.create_stats()
            if profile.stats:  # threads that ended before making a call record nothing
                recorded.append(profile)
        if self.PROCESS_WIDE:
            print("profile: one profiler for all threads (Python 3.12+), wall-clock time: waits count")
        stats = pstats.Stats(*recorded)
        stats.sort_stats("tottime").print_stats(top)
        stats.sort_stats("cumulative").print_stats(top)


def thread_cpu_s() -> dict:
    """CPU seconds of each live thread of this process, by name (threads of one name summed)."""
    ticks = os.sysconf("SC_CLK_TCK")
    seconds: dict = {}
    for thread in threading.enumerate():
        try:
            fields = Path(f"/proc/self/task/{thread.native_id}/stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        name = "batcher workers" if thread.name.startswith("sartor-serve-") and thread.name.count("-") > 3 \
            else thread.name
        seconds[name] = seconds.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / ticks
    return seconds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--frontends", type=int, default=2)
    parser.add_argument("--protocol", choices=("grpc", "http"), default="grpc")
    parser.add_argument("--shared-memory", choices=("none", "system", "cuda"), default="system")
    parser.add_argument("--plan", type=Path, help="serve this engine instead of the one-Relu engine")
    parser.add_argument("--device", default="cpu", help="where the served instance runs (default cpu)")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--request-batch", type=int, default=1, help="images (rows) per request")
    parser.add_argument("--processes", type=int, default=2, help="client processes")
    parser.add_argument("--duration", type=float, default=8.0)
    parser.add_argument("--warmup", type=float, default=2.0)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--max-queue-delay-us", type=int, default=500)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--top", type=int, default=45)
    args = parser.parse_args()

    from sartor.serve import ServeOptions, Server
    workdir = Path(tempfile.mkdtemp(prefix="sartor-serve-main-cpu-"))
    profiles = ThreadProfiles() if args.profile else None
    try:
        plan, max_batch = plan_to_serve(args.plan, args.device, workdir)[:2]  # the loaded engine is not kept
        models = bench.make_repository(plan, workdir / "repo", max_batch, args.max_queue_delay_us, 1, args.device,
                                       ("batched",))
        if profiles is not None:
            profiles.before_server_start()
        server = Server(ServeOptions(str(workdir / "repo"), http_port=0, grpc_port=0, metrics_port=None,
                                     poll_interval=None, devices=[args.device], max_queue_size=4096,
                                     frontends=args.frontends)).start()
        if profiles is not None:
            profiles.after_server_start(server._loop)
        try:
            url = server.grpc_url if args.protocol == "grpc" else server.http_url
            metadata = bench._metadata(url, args.protocol, models[0], 30.0)
            for run in range(args.runs):
                threads_before, cpu_before = thread_cpu_s(), time.process_time()
                row = bench.measure(url, args.protocol, models[0], metadata, args.request_batch, args.concurrency,
                                    args.duration, args.warmup, args.processes, server_in_process=True,
                                    shared_memory=args.shared_memory, frontend_pids=server.frontend_pids,
                                    progress=bench.Progress(workdir), stacks_dir=workdir, server=server)
                print(f"run {run}: {row.get('infer_per_s', 0):8.0f} req/s  main CPU "
                      f"{row.get('server_cpu_ms_per_request', float('nan')):.3f} ms/req  frontends CPU "
                      f"{row.get('frontend_cpu_ms_per_request', float('nan')):.3f} ms/req  mean batch "
                      f"{row.get('server_mean_batch', 0)}  errors {row.get('errors')}", flush=True)
                answered = (time.process_time() - cpu_before) * 1e3 / row["server_cpu_ms_per_request"]
                threads_after = thread_cpu_s()
                split = {name: (threads_after[name] - threads_before.get(name, 0.0)) * 1e3 / answered
                         for name in threads_after}
                print("    by thread (ms/req): " + ", ".join(f"{name} {ms:.3f}" for name, ms in split.items()
                                                          if ms > 0.001), flush=True)
        finally:
            if profiles is not None:
                profiles.report(args.top)
            server.stop()
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
