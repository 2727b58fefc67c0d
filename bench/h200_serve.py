"""One device call for issue 6: `sartor serve` throughput against concurrency, with and without
dynamic batching, for ResNet-50 FP16 (224) and the sample detector FP16 (320), next to each
engine's offline throughput at its best batch, measured in the same run.

    PYTHONPATH=. python bench/h200_serve.py --out $OUT [--levels 1,8,32,128,256] [--duration 4] \
        [--shared-memory none,system,cuda] [--frontends 1,8] [--variants batched] [--budget-s 420] \
        [--load-generator perf_analyzer] [--request-batch 8]

The load generator is bench/serve_throughput.py's (tritonclient gRPC in client processes on the
same machine). `--shared-memory` lists how the tensors travel, each measured in turn: in the request
body (`none`), in system shared memory, in CUDA shared memory (each client thread its own regions).
`--frontends` lists the servers: frontend-process counts (serve --frontends N), or KxN for K engine
processes of N frontend processes each (serve --engine-processes K --frontends N): one server per entry
and model, on which every shared-memory mode is measured. Writes serve.json under --out: per model
`serve` (the body) and `serve_system` / `serve_cuda`, with `_f<N>` appended for N > 1 frontends and
`_e<K>f<N>` for K > 1 engine processes.

Nothing waits silently: every stage prints a line with the elapsed time as it ends, the load
generator's own lines stream through as they come, and serve.json is rewritten whenever a
measurement lands (the load generator writes its results.json, under --out/runs/, after each one).
Each measurement has its own budget (`--measure-budget-s`; past it: `{"error": "timed out after S s
at stage X"}` and the next one starts), `--budget-s` bounds the whole run (a server that no longer
fits is recorded as skipped), and a load generator that outlives its share is asked for its stacks
(SIGUSR1, written under --out/runs/<key>/stacks/) and killed with everything it started.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import sartor  # noqa: E402
from h200_models import export_classifier  # noqa: E402
from sartor.tactics.select import timing_samples_ms  # noqa: E402

MODELS = {
    "resnet50": {"input": "input", "hw": 224, "max_batch": 128, "opt_batch": 64, "batches": (1, 8, 32, 64, 128)},
    "detector": {"input": "images", "hw": 320, "max_batch": 32, "opt_batch": 32, "batches": (1, 8, 32)},
    # The trained YOLOv8n of samples/yolo at 640 (issue 36 serves it on two GPUs).
    "yolov8n": {"input": "images", "hw": 640, "max_batch": 64, "opt_batch": 32, "batches": (1, 8, 32, 64)},
}
MODE_KEYS = {"none": "serve", "system": "serve_system", "cuda": "serve_cuda"}
KILL_GRACE_S = 20.0  # past the load generator's own budget, before it is killed from here
STOP_S = 15.0  # what stopping a server takes (drain, frontend processes' exit), reserved in each budget


class Clock:
    def __init__(self, budget_s: float) -> None:
        self.t0 = time.monotonic()
        self.deadline = self.t0 + budget_s if budget_s > 0 else float("inf")

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def say(self, message: str) -> None:
        print(f"[{time.monotonic() - self.t0:7.1f} s] {message}", flush=True)


def with_profile(spec: dict, opt: int, top: int) -> dict:
    """`spec` served from an engine built for batches 1..top, kernels chosen at `opt`; offline measured at
    its batches up to `top` and at opt and top."""
    return dict(spec, opt_batch=opt, max_batch=top,
                batches=tuple(sorted({b for b in spec["batches"] if b <= top} | {opt, top})))


def parse_profiles(text: str) -> dict[str, tuple[int, int]]:
    """--profile "detector=64/128,resnet50=64/128" -> {name: (opt, max)}; ValueError with the reason."""
    profiles = {}
    for item in filter(None, (v.strip() for v in text.split(","))):
        name, _, batches = item.partition("=")
        opt, _, top = batches.partition("/")
        if name not in MODELS or not opt.isdigit() or not top.isdigit() or not 1 <= int(opt) <= int(top):
            raise ValueError(f"{item!r}: NAME=OPT/MAX with NAME one of {', '.join(MODELS)} and 1 <= OPT <= MAX")
        profiles[name] = (int(opt), int(top))
    return profiles


def build(spec: dict, onnx: Path, plan: Path, effort: int) -> float:
    shape = lambda b: (b, 3, spec["hw"], spec["hw"])  # noqa: E731
    t0 = time.perf_counter()
    sartor.build(str(onnx), str(plan), device="cuda", precision="fp16",
                 min_shapes={spec["input"]: shape(1)}, opt_shapes={spec["input"]: shape(spec["opt_batch"])},
                 max_shapes={spec["input"]: shape(spec["max_batch"])}, builder_effort=effort)
    return time.perf_counter() - t0


def offline(spec: dict, plan: Path) -> list[dict]:
    """img/s of the engine called directly (inputs already on the GPU) at each batch."""
    ctx = sartor.load(str(plan)).context()
    rows = []
    for batch in spec["batches"]:
        x = torch.rand(batch, 3, spec["hw"], spec["hw"], device="cuda")
        ctx.run({spec["input"]: x})
        ms = statistics.median(timing_samples_ms(lambda: ctx.run({spec["input"]: x}), torch.device("cuda"), 50, 10))
        rows.append({"batch": batch, "ms": round(ms, 4), "img_s": round(batch / ms * 1e3, 1)})
    return rows


def server_shape(spec: str) -> tuple[int, int]:
    """(engine processes, frontend processes each) of a --frontends entry: "N" or "KxN"."""
    engines, _, frontends = spec.rpartition("x")
    return int(engines or 1), int(frontends)


def server_label(spec: str) -> str:
    engines, frontends = server_shape(spec)
    if engines > 1:
        return f"_e{engines}f{frontends}"
    return f"_f{frontends}" if frontends > 1 else ""


def key_of(mode: str, frontends: str, request_batch: int = 1) -> str:
    return MODE_KEYS[mode] + server_label(frontends) + (f"_b{request_batch}" if request_batch > 1 else "")


def served_rows(run: dict, modes: list[str], frontends: str, request_batch: int = 1) -> dict:
    """serve.json's entries (one per mode) from the load generator's results.json so far."""
    common = {k: run[k] for k in ("frontends", "engine_processes", "duration_s", "warmup_s", "server_start_s",
                                  "batch_size_histograms") if k in run}
    return {key_of(mode, frontends, request_batch): dict(common, shared_memory=mode, request_batch=request_batch,
                                                         models=run["runs"][mode])
            for mode in modes if mode in run.get("runs", {})}


def served(plan: Path, out: Path, args, modes: list[str], frontends: str, budget_s: float, clock: Clock,
           on_results) -> dict:
    """One server (`frontends`: a --frontends entry) measured in every mode by bench/serve_throughput.py,
    its output streamed. `on_results(entries)` is called whenever its results.json changes. Returns
    the entries, with an error entry for each mode it did not reach."""
    engines, frontends_each = server_shape(frontends)
    cmd = [sys.executable, str(ROOT / "bench" / "serve_throughput.py"), "--plan", str(plan), "--out", str(out),
           "--device", args.device, "--protocol", "grpc", "--concurrency", args.levels, "--duration", str(args.duration),
           "--warmup", str(args.warmup), "--processes", str(args.processes), "--max-queue-delay-us", "500",
           "--shared-memory", ",".join(modes), "--frontends", str(frontends_each), "--variants", args.variants,
           "--measure-budget-s", str(args.measure_budget_s), "--request-timeout-s", str(args.request_timeout_s),
           "--budget-s", str(round(budget_s, 1)), "--load-generator", args.load_generator,
           "--batch", str(args.request_batch), "--instances", str(args.instances),
           "--switch-interval-us", str(args.switch_interval_us), "--engine-processes", str(engines)]
    if args.perf_analyzer:
        cmd += ["--perf-analyzer", args.perf_analyzer]
    code = [str(Path(args.code).resolve())] if args.code else []
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [*code, str(ROOT), os.environ.get("PYTHONPATH")])))
    results = out / "results.json"
    results.unlink(missing_ok=True)
    # Its own session: the clients and frontend processes it starts are killed with it if need be.
    process = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, start_new_session=True)
    kill_at = time.monotonic() + budget_s + KILL_GRACE_S
    seen = None
    entries: dict = {}
    while process.poll() is None and time.monotonic() < kill_at:
        time.sleep(1.0)
        seen, entries = _reread(results, seen, entries, modes, frontends, args.request_batch, on_results)
    if process.poll() is None:
        clock.say(f"serve_throughput (frontends {frontends}) ran past {budget_s + KILL_GRACE_S:.0f} s: "
                  f"asking for its stacks, then killing it")
        _kill(process)
    seen, entries = _reread(results, seen, entries, modes, frontends, args.request_batch, on_results)
    if process.returncode == 0:
        return entries
    progress = _progress(out)
    stage = _stage(progress)
    why = (f"timed out after {budget_s + KILL_GRACE_S:.0f} s at stage {stage}" if process.returncode < 0
           else f"serve_throughput exited with code {process.returncode} at stage {stage}")
    # The measurement it was in gets the error row it could not write; modes it never reached, one entry.
    current = (entries.get(key_of(progress["shared_memory"], frontends, args.request_batch))
               if "shared_memory" in progress else None)
    if current is not None:
        rows = current["models"].setdefault(progress["model"], [])
        if all(r.get("concurrency") != progress["concurrency"] for r in rows):
            rows.append({"concurrency": progress["concurrency"], "error": why})
    for mode in modes:
        if key_of(mode, frontends, args.request_batch) not in entries:
            entries[key_of(mode, frontends, args.request_batch)] = {"error": why, "shared_memory": mode}
    on_results(entries)
    return entries


def _reread(path: Path, seen, entries: dict, modes: list[str], frontends: str, request_batch: int,
            on_results) -> tuple:
    try:
        stamp = path.stat().st_mtime_ns
    except FileNotFoundError:
        return seen, entries
    if stamp == seen:
        return seen, entries
    try:
        entries = served_rows(json.loads(path.read_text()), modes, frontends, request_batch)
    except (OSError, ValueError):
        return seen, entries  # replaced while read: the next poll reads it
    on_results(entries)
    return stamp, entries


def _progress(out: Path) -> dict:
    """The load generator's last stage (its progress.json), {} where it wrote none."""
    try:
        return json.loads((out / "progress.json").read_text())
    except (OSError, ValueError):
        return {}


def _stage(progress: dict) -> str:
    if not progress:
        return "unknown (no progress.json)"
    where = " ".join(f"{k}={progress[k]}" for k in ("model", "shared_memory", "concurrency") if k in progress)
    return f"{progress.get('stage')}" + (f" ({where})" if where else "")


def _kill(process: subprocess.Popen) -> None:
    """SIGUSR1 to the load generator (it writes its stacks), then its whole process group."""
    try:
        os.kill(process.pid, signal.SIGUSR1)
        time.sleep(2.0)
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(10)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(10)
    except ProcessLookupError:
        pass


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.environ.get("OUT", "out"))
    parser.add_argument("--levels", default="1,8,32,128,256")
    parser.add_argument("--duration", type=float, default=4.0)
    parser.add_argument("--warmup", type=float, default=1.0)
    parser.add_argument("--effort", type=int, default=2, help="builder effort of the served engines")
    parser.add_argument("--models", default=",".join(MODELS), help="comma-separated, of " + ", ".join(MODELS))
    parser.add_argument("--shared-memory", default="none",
                        help="comma-separated: none (tensors in the body), system, cuda; each is measured")
    parser.add_argument("--frontends", default="1",
                        help="comma-separated servers, each measured: frontend-process counts (serve --frontends N) "
                             "or KxN (serve --engine-processes K --frontends N)")
    parser.add_argument("--variants", default="batched,single",
                        help="the served entries: batched (dynamic batching), single (none), or both")
    parser.add_argument("--device", default="cuda:0",
                        help="where the server runs the engine: cuda:N, or GPUs as cuda:0,cuda:1 (--instances on "
                             "each); the build and the offline figures are on cuda:0")
    parser.add_argument("--processes", type=int, default=min(16, os.cpu_count() or 4), help="client processes")
    parser.add_argument("--measure-budget-s", type=float, default=45.0,
                        help="wall-clock seconds for one measurement (mode, model, level), set-up and drain included")
    parser.add_argument("--request-timeout-s", type=float, default=20.0, help="client-side timeout of every request")
    parser.add_argument("--server-start-s", type=float, default=60.0,
                        help="what a server start (engine load, warm-up, frontend processes) is expected to take: "
                             "a server is skipped when this plus one measurement no longer fits")
    parser.add_argument("--budget-s", type=float, default=0.0, help="wall-clock seconds for the whole run (0: none)")
    parser.add_argument("--load-generator", choices=("python", "perf_analyzer"), default="python",
                        help="bench/serve_throughput.py's: its Python gRPC clients, or Triton's C++ perf_analyzer "
                             "(scripts/install_perf_analyzer.sh's .cache/perf_analyzer, carried to the machine), "
                             "which leaves the machine's cores to the server")
    parser.add_argument("--perf-analyzer", default=None, help="the perf_analyzer binary, where not found by itself")
    parser.add_argument("--request-batch", type=int, default=1,
                        help="images per request (perf_analyzer -b): above 1, the server's cost per request is "
                             "shared by that many images; dynamic batching still joins requests into engine batches")
    parser.add_argument("--instances", type=int, default=1,
                        help="execution contexts of the served model (instance_group count), each with its own "
                             "worker thread")
    parser.add_argument("--switch-interval-us", type=float, default=0.0,
                        help="the server process's GIL switch interval (bench/serve_throughput.py; 0: Python's)")
    parser.add_argument("--code", default=None,
                        help="a folder holding another `sartor` package to serve with (an older commit's, for a "
                             "side-by-side run on one machine); the engine is built with this checkout's")
    parser.add_argument("--reuse-plan", action="store_true",
                        help="serve the engine already in /tmp/sartor_serve from an earlier call, if there is one")
    parser.add_argument("--profile", default="",
                        help="NAME=OPT/MAX[,...]: serve NAME from an engine of batches 1..MAX with kernels chosen at "
                             "OPT (default: " + ", ".join(f"{n}={m['opt_batch']}/{m['max_batch']}"
                                                        for n, m in MODELS.items()) + ")")
    args = parser.parse_args()
    try:
        profiles = parse_profiles(args.profile)
    except ValueError as exc:
        parser.error(f"--profile {exc}")
    specs = {name: with_profile(spec, *profiles[name]) if name in profiles else spec for name, spec in MODELS.items()}
    frontend_counts = [v.strip() for v in args.frontends.split(",") if v.strip()]
    try:
        shapes = [server_shape(v) for v in frontend_counts]
    except ValueError:
        shapes = []
    if not shapes or not all(1 <= k <= 16 and 1 <= n <= 64 and (k == 1 or n > 1) for k, n in shapes):
        parser.error(f"--frontends {args.frontends!r}: a comma-separated list of counts in 1..64, or KxN with K in "
                     f"1..16 and N in 2..64")
    modes = [m.strip() for m in args.shared_memory.split(",") if m.strip()]
    if not modes or set(modes) - set(MODE_KEYS):
        parser.error(f"--shared-memory {args.shared_memory!r}: a comma-separated list of none, system, cuda")
    if args.request_batch < 1:
        parser.error(f"--request-batch {args.request_batch}: at least 1")
    if args.instances < 1:
        parser.error(f"--instances {args.instances}: at least 1")
    clock = Clock(args.budget_s)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path("/tmp/sartor_serve")
    work.mkdir(exist_ok=True)
    onnx = {"resnet50": lambda: export_classifier("resnet50", work),
            "detector": lambda: ROOT / "samples/detector/sample_detector.onnx",
            "yolov8n": lambda: ROOT / "samples/yolo/yolov8n_scenes.onnx"}
    results: dict = {}

    def save() -> None:
        partial = out / "serve.json.partial"
        partial.write_text(json.dumps(results, indent=1))
        os.replace(partial, out / "serve.json")

    for name in args.models.split(","):
        row = results[name] = {}
        # Another profile is another engine: never reused for the default one, nor it for this.
        plan = work / (f"{name}_fp16_{profiles[name][0]}_{profiles[name][1]}.plan" if name in profiles
                       else f"{name}_fp16.plan")
        row["profile"] = {"opt_batch": specs[name]["opt_batch"], "max_batch": specs[name]["max_batch"]}
        if args.reuse_plan and plan.exists():
            clock.say(f"{name}: reusing {plan}")
        else:
            clock.say(f"{name}: exporting and building (effort {args.effort})")
            row["build_s"] = round(build(specs[name], onnx[name](), plan, args.effort), 1)
            clock.say(f"{name}: built in {row['build_s']} s")
        row["offline"] = offline(specs[name], plan)
        torch.cuda.empty_cache()  # the served engine's server is another process
        best = max(row["offline"], key=lambda r: r["img_s"])
        clock.say(f"{name}: offline {json.dumps(row['offline'])}; best {best['img_s']} img/s at batch {best['batch']}")
        save()
        for frontends in frontend_counts:
            left = clock.left() - STOP_S
            if left < args.server_start_s + args.measure_budget_s:
                for mode in modes:
                    row[key_of(mode, frontends, args.request_batch)] = {
                        "skipped": f"did not fit: {max(left, 0):.0f} s of --budget-s left", "shared_memory": mode}
                clock.say(f"{name}: frontends {frontends} skipped ({max(left, 0):.0f} s left)")
                save()
                continue
            clock.say(f"{name}: serving with {frontends} (engine processes x frontend processes), "
                      f"modes {','.join(modes)}")

            def on_results(entries: dict, row=row) -> None:
                row.update(entries)
                save()

            # Its share: a generous start, every measurement's budget, the stop; never past the run's end.
            measurements = len(modes) * len(args.variants.split(",")) * len(args.levels.split(","))
            need = 2 * args.server_start_s + measurements * args.measure_budget_s + STOP_S
            batch_suffix = f"_b{args.request_batch}" if args.request_batch > 1 else ""
            runs = out / "runs" / f"{name}{server_label(frontends) or '_f1'}{batch_suffix}"
            served(plan, runs, args, modes, frontends, min(left, need), clock, on_results)
            clock.say(f"{name}: frontends {frontends} done")
    clock.say("finished")


if __name__ == "__main__":
    main()
