"""One device call for issue 6: `sartor serve` throughput against concurrency, with and without
dynamic batching, for ResNet-50 FP16 (224) and the sample detector FP16 (320), next to each
engine's offline throughput at its best batch, measured in the same run.

    PYTHONPATH=. python bench/h200_serve.py --out $OUT [--levels 1,8,32,128,256] [--duration 4] \
        [--shared-memory none,system,cuda] [--frontends 1,8]

The load generator is bench/serve_throughput.py's (tritonclient gRPC in client processes on the
same machine). `--shared-memory` lists how the tensors travel, each measured in turn: in the request
body (`none`), in system shared memory, in CUDA shared memory (each client thread its own regions).
`--frontends` lists the server's frontend-process counts (serve --frontends N), each measured in
turn with every shared-memory mode. Writes serve.json under --out: per model `serve` (the body) and
`serve_system` / `serve_cuda`, with `_f<N>` appended for N > 1 frontends.
"""
from __future__ import annotations

import argparse
import json
import os
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
}


def build(name: str, onnx: Path, plan: Path, effort: int) -> float:
    spec = MODELS[name]
    shape = lambda b: (b, 3, spec["hw"], spec["hw"])  # noqa: E731
    t0 = time.perf_counter()
    sartor.build(str(onnx), str(plan), device="cuda", precision="fp16",
                 min_shapes={spec["input"]: shape(1)}, opt_shapes={spec["input"]: shape(spec["opt_batch"])},
                 max_shapes={spec["input"]: shape(spec["max_batch"])}, builder_effort=effort)
    return time.perf_counter() - t0


def offline(name: str, plan: Path) -> list[dict]:
    """img/s of the engine called directly (inputs already on the GPU) at each batch."""
    spec = MODELS[name]
    ctx = sartor.load(str(plan)).context()
    rows = []
    for batch in spec["batches"]:
        x = torch.rand(batch, 3, spec["hw"], spec["hw"], device="cuda")
        ctx.run({spec["input"]: x})
        ms = statistics.median(timing_samples_ms(lambda: ctx.run({spec["input"]: x}), torch.device("cuda"), 50, 10))
        rows.append({"batch": batch, "ms": round(ms, 4), "img_s": round(batch / ms * 1e3, 1)})
    return rows


def served(plan: Path, out: Path, levels: str, duration: float, shared_memory: str = "none",
           frontends: int = 1) -> dict:
    cmd = [sys.executable, str(ROOT / "bench" / "serve_throughput.py"), "--plan", str(plan), "--out", str(out),
           "--device", "cuda:0", "--protocol", "grpc", "--concurrency", levels, "--duration", str(duration),
           "--warmup", "1", "--processes", str(min(16, os.cpu_count() or 4)), "--max-queue-delay-us", "500",
           "--shared-memory", shared_memory, "--frontends", str(frontends)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=900,
                          env=dict(os.environ, PYTHONPATH=os.pathsep.join(
                              filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))))
    print(done.stdout[-4000:], done.stderr[-2000:], flush=True)
    path = out / "results.json"
    return json.loads(path.read_text()) if path.exists() else {"error": done.stderr[-800:]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.environ.get("OUT", "out"))
    parser.add_argument("--levels", default="1,8,32,128,256")
    parser.add_argument("--duration", type=float, default=4.0)
    parser.add_argument("--effort", type=int, default=2, help="builder effort of the served engines")
    parser.add_argument("--models", default=",".join(MODELS), help="comma-separated, of " + ", ".join(MODELS))
    parser.add_argument("--shared-memory", default="none",
                        help="comma-separated: none (tensors in the body), system, cuda; each is measured")
    parser.add_argument("--frontends", default="1",
                        help="comma-separated frontend-process counts of the server (serve --frontends); each is measured")
    args = parser.parse_args()
    try:
        frontend_counts = [int(v) for v in args.frontends.split(",") if v.strip()]
    except ValueError:
        frontend_counts = []
    if not frontend_counts or not all(1 <= n <= 64 for n in frontend_counts):
        parser.error(f"--frontends {args.frontends!r}: a comma-separated list of counts in 1..64")
    modes = [m.strip() for m in args.shared_memory.split(",") if m.strip()]
    if not modes or set(modes) - {"none", "system", "cuda"}:
        parser.error(f"--shared-memory {args.shared_memory!r}: a comma-separated list of none, system, cuda")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path("/tmp/sartor_serve")
    work.mkdir(exist_ok=True)
    onnx = {"resnet50": lambda: export_classifier("resnet50", work),
            "detector": lambda: ROOT / "samples/detector/sample_detector.onnx"}
    results = {}
    for name in args.models.split(","):
        plan = work / f"{name}_fp16.plan"
        row = {"build_s": round(build(name, onnx[name](), plan, args.effort), 1), "offline": offline(name, plan)}
        print(name, json.dumps(row), flush=True)
        results[name] = row
        for frontends in frontend_counts:
            for mode in modes:
                key = ("serve" if mode == "none" else f"serve_{mode}") + (f"_f{frontends}" if frontends > 1 else "")
                row[key] = served(plan, work / f"{key}_{name}", args.levels, args.duration, mode, frontends)
                (out / "serve.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
