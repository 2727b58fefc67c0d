"""One device call: every issue-2 architecture built for CUDA (FP32 and FP16) and checked against
ONNX Runtime FP32, then ResNet-50 FP16 speed against PyTorch eager FP16 channels-last + CUDA graph,
in the same process, plus engine load time.

    PYTHONPATH=. python bench/h200_models.py --out $OUT [--onnx-dir DIR_WITH_YOLO_AND_PPOCR]

Writes results.json and results.md under --out and prints the tables last.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import torch

warnings.filterwarnings("ignore")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import sartor  # noqa: E402
from sartor.tactics.select import timing_samples_ms  # noqa: E402

CLASSIFIERS = ["resnet50", "mobilenet_v2", "mobilenet_v3_large", "efficientnet_b0", "regnet_y_400mf",
               "convnext_tiny", "densenet121", "shufflenet_v2_x0_5", "squeezenet1_0", "vgg11", "googlenet"]


def versions() -> dict:
    import triton
    props = torch.cuda.get_device_properties(0)
    try:
        driver = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                capture_output=True, text=True, timeout=30).stdout.strip()
    except Exception:
        driver = "unknown"
    import onnxruntime
    return {"gpu": props.name, "sm": f"{props.major}.{props.minor}", "sms": props.multi_processor_count,
            "driver": driver, "cuda": torch.version.cuda, "torch": torch.__version__, "triton": triton.__version__,
            "onnxruntime": onnxruntime.__version__, "python": platform.python_version(),
            "cudnn": torch.backends.cudnn.version()}


def sample_figures(samples: list[float], batch: int) -> dict:
    """Median, 99th percentile (ms) and images/s of timed calls' milliseconds."""
    median = statistics.median(samples)
    return {"median_ms": round(median, 4), "p99_ms": round(float(np.percentile(samples, 99)), 4),
            "img_s": round(batch / median * 1e3, 1)}


def settle_batchnorm(model: torch.nn.Module, batches: int = 4) -> None:
    """Give a randomly initialised model the activation scale of a trained one: re-estimate its
    BatchNorm statistics on random images. Untouched, activations shrink layer by layer (running
    variance 1 against real variances far below) until FP16 flushes the logits to zero, which
    says nothing about a trained model's FP16 accuracy."""
    for module in model.modules():
        if isinstance(module, torch.nn.modules.batchnorm._BatchNorm):
            module.reset_running_stats()
            module.momentum = None  # cumulative average over the batches below
    model.train()
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for _ in range(batches):
            model(torch.rand(8, 3, 224, 224, generator=generator))
    model.eval()


def export_classifier(name: str, directory: Path) -> Path:
    import torchvision
    path = directory / f"{name}.onnx"
    if path.exists():
        return path
    kwargs = {"aux_logits": False, "init_weights": False} if name == "googlenet" else {}
    torch.manual_seed(0)
    model = getattr(torchvision.models, name)(weights=None, **kwargs)
    settle_batchnorm(model)
    torch.onnx.export(model, (torch.randn(1, 3, 224, 224),), str(path), input_names=["input"],
                      output_names=["logits"], dynamic_axes={"input": {0: "batch"}}, opset_version=17, dynamo=False)
    return path


def ort_reference(path: Path, feeds: dict) -> list:
    import onnxruntime as ort
    options = ort.SessionOptions()
    options.intra_op_num_threads = 16
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    return session.run(None, feeds)


def accuracy_row(name: str, path: Path, input_name: str, shape: tuple, directory: Path) -> dict:
    rng = np.random.default_rng(0)
    if name == "ppocrv4_det":
        # On noise the detector's map sits near 1e-5 everywhere; a page of strokes gives it text
        # to find. Normalised as PP-OCR expects.
        from tests.model_zoo import text_page
        x = (text_page(rng, shape) - 0.5) / 0.5
    else:
        x = rng.random(shape, dtype=np.float32)
    refs = ort_reference(path, {input_name: x})
    row = {"model": name, "input": "x".join(map(str, shape))}
    batch_range = {"min": {input_name: (1,) + shape[1:]}, "opt": {input_name: shape}, "max": {input_name: shape}}
    for precision in ("fp32", "fp16"):
        plan = directory / f"{name}.{precision}.plan"
        result = sartor.build(str(path), str(plan), device="cuda", precision=precision, profiles=[batch_range])
        engine = sartor.load(str(plan))
        outs = engine.context().run({input_name: x})
        worst_rel, worst_cos = 0.0, 1.0
        for ref, out in zip(refs, outs.values()):
            ref = ref.astype(np.float64)
            out = out.astype(np.float64)
            rel = float(np.abs(out - ref).max() / max(np.abs(ref).max(), 1e-12))
            cos = float((out.ravel() @ ref.ravel()) / (np.linalg.norm(out) * np.linalg.norm(ref) + 1e-30))
            worst_rel, worst_cos = max(worst_rel, rel), min(worst_cos, cos)
        row[precision] = {"max_rel_err": worst_rel, "cosine": worst_cos, "layers": result.layers,
                          "onnx_nodes": result.onnx_nodes, "build_s": result.seconds,
                          "fp32_layers": sum(1 for layer in engine.layers if layer["precision"] == "fp32")}
    return row


def cuda_time(fn, iterations: int, warmup: int = 10) -> list[float]:
    return timing_samples_ms(fn, torch.device("cuda"), iterations, warmup)


def graph_runner(model: torch.nn.Module, x: torch.Tensor):
    """`model(x)` captured as one CUDA graph (after warm-up on a side stream): its replay."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.inference_mode(), torch.cuda.stream(stream):
        for _ in range(3):
            model(x)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.inference_mode(), torch.cuda.graph(graph):
        model(x)
    return graph.replay


def compiled_runner(model: torch.nn.Module, x: torch.Tensor, mode: str = "reduce-overhead"):
    """(a call of torch.compile(model, mode) on x, seconds the first three calls took to compile)."""
    compiled = torch.compile(model, mode=mode)
    t0 = time.perf_counter()
    with torch.inference_mode():
        for _ in range(3):
            compiled(x)
    torch.cuda.synchronize()
    compile_s = time.perf_counter() - t0

    def run():
        with torch.inference_mode():
            compiled(x)
    return run, compile_s


def eager_graph_runner(batch: int):
    """PyTorch's own best non-compiled path: eager FP16, channels-last, captured in a CUDA graph."""
    import torchvision
    torch.manual_seed(0)
    model = torchvision.models.resnet50(weights=None).eval().half().cuda().to(memory_format=torch.channels_last)
    static = torch.rand(batch, 3, 224, 224, device="cuda").half().contiguous(memory_format=torch.channels_last)
    return graph_runner(model, static)


FRESH_LOAD = '''
import json, sys, time
t0 = time.perf_counter()
import torch, sartor
t1 = time.perf_counter()
engine = sartor.load(sys.argv[1])
torch.cuda.synchronize()
t2 = time.perf_counter()
ctx = engine.context()
ctx.run({"input": torch.rand(1, 3, 224, 224, device="cuda")})
torch.cuda.synchronize()
t3 = time.perf_counter()
print(json.dumps({"import_s": t1 - t0, "load_s": t2 - t1, "first_inference_s": t3 - t2}))
'''


def fresh_process_load(plan: Path) -> dict:
    """Load and first inference in a new process: nothing warm but the disk cache."""
    done = subprocess.run([sys.executable, "-c", FRESH_LOAD, str(plan)], capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1])))
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    return json.loads(lines[-1]) if lines else {"error": done.stderr[-500:]}


def speed_rows(directory: Path, iterations: int) -> tuple[list, dict]:
    torch.backends.cudnn.benchmark = True
    path = export_classifier("resnet50", directory)
    plan = directory / "resnet50.fp16.speed.plan"
    profiles = [{"min": {"input": (1, 3, 224, 224)}, "opt": {"input": (1, 3, 224, 224)}, "max": {"input": (1, 3, 224, 224)}},
                {"min": {"input": (256, 3, 224, 224)}, "opt": {"input": (256, 3, 224, 224)},
                 "max": {"input": (256, 3, 224, 224)}}]
    build = sartor.build(str(path), str(plan), device="cuda", precision="fp16", profiles=profiles)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    engine = sartor.load(str(plan))
    torch.cuda.synchronize()
    load_s = time.perf_counter() - t0
    ctx = engine.context()
    x1 = torch.rand(1, 3, 224, 224, device="cuda")
    t0 = time.perf_counter()
    ctx.run({"input": x1})
    torch.cuda.synchronize()
    first_s = time.perf_counter() - t0
    load = {"load_s": load_s, "first_inference_s": first_s, "build_s": build.seconds,
            "plan_bytes": plan.stat().st_size, "device_memory_bytes": engine.device_memory_bytes,
            "fresh_process": fresh_process_load(plan)}
    rows = []
    for batch in (1, 256):
        x = torch.rand(batch, 3, 224, 224, device="cuda")
        ctx.run({"input": x})
        sartor_ms = cuda_time(lambda: ctx.run({"input": x}), iterations)
        eager_ms = cuda_time(eager_graph_runner(batch), iterations)
        s, e = statistics.median(sartor_ms), statistics.median(eager_ms)
        rows.append({"batch": batch, "sartor_fp16_ms": s, "eager_fp16_cl_graph_ms": e,
                     "sartor_img_s": batch / s * 1e3, "eager_img_s": batch / e * 1e3, "ratio_sartor_over_eager": e / s,
                     "sartor_p99_ms": float(np.percentile(sartor_ms, 99)), "eager_p99_ms": float(np.percentile(eager_ms, 99))})
    return rows, load


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.environ.get("OUT", "out"))
    parser.add_argument("--onnx-dir", default=None, help="folder with yolov8n.onnx, yolo11n.onnx, ppocr_det.onnx")
    parser.add_argument("--iterations", type=int, default=100)
    parser.add_argument("--skip-accuracy", action="store_true")
    parser.add_argument("--skip-speed", action="store_true")
    parser.add_argument("--only", default="", help="comma-separated model names for the accuracy table")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path("/tmp/sartor_bench")
    work.mkdir(exist_ok=True)
    results = {"versions": versions(), "accuracy": [], "errors": {}}
    print(json.dumps(results["versions"]), flush=True)
    speed, load = ([], {}) if args.skip_speed else speed_rows(work, args.iterations)
    results["speed"], results["load"] = speed, load
    print(json.dumps({"speed": speed, "load": load}, indent=1), flush=True)
    if not args.skip_accuracy:
        jobs = [(name, lambda n=name: export_classifier(n, work), "input", (2, 3, 224, 224)) for name in CLASSIFIERS]
        if args.onnx_dir:
            extra = Path(args.onnx_dir)
            jobs += [("yolov8n", lambda: extra / "yolov8n.onnx", "images", (2, 3, 320, 320)),
                     ("yolo11n", lambda: extra / "yolo11n.onnx", "images", (2, 3, 320, 320)),
                     ("ppocrv4_det", lambda: extra / "ppocr_det.onnx", "x", (2, 3, 320, 320))]
        only = set(filter(None, args.only.split(",")))
        for name, make, input_name, shape in jobs:
            if only and name not in only:
                continue
            try:
                row = accuracy_row(name, make(), input_name, shape, work)
                results["accuracy"].append(row)
                print(json.dumps(row), flush=True)
            except Exception as exc:  # keep measuring the others; the failure is reported
                results["errors"][name] = f"{type(exc).__name__}: {exc}"[:500]
                print(name, "FAILED", results["errors"][name], flush=True)
            (out / "results.json").write_text(json.dumps(results, indent=1))
    (out / "results.json").write_text(json.dumps(results, indent=1))
    lines = ["| model | input | FP32 max rel err | FP16 cosine | ONNX nodes → layers | FP16 layers kept FP32 |",
             "|---|---|---|---|---|---|"]
    for row in results["accuracy"]:
        lines.append(f"| {row['model']} | {row['input']} | {row['fp32']['max_rel_err']:.2e} | {row['fp16']['cosine']:.6f} | "
                     f"{row['fp32']['onnx_nodes']} → {row['fp32']['layers']} | {row['fp16']['fp32_layers']} |")
    lines += ["", "| batch | sartor FP16 ms (img/s) | eager FP16 CL + graph ms (img/s) | sartor/eager speed |", "|---|---|---|---|"]
    for r in speed:
        lines.append(f"| {r['batch']} | {r['sartor_fp16_ms']:.3f} ({r['sartor_img_s']:.0f}) | {r['eager_fp16_cl_graph_ms']:.3f} "
                     f"({r['eager_img_s']:.0f}) | {r['ratio_sartor_over_eager']:.2f}x |")
    if load:
        lines.append(f"\nfresh process: {json.dumps(load['fresh_process'])}")
        lines.append(f"\nload {load['load_s']:.3f} s, first inference {load['first_inference_s']:.3f} s, "
                 f"plan {load['plan_bytes'] / 1e6:.1f} MB, device memory {load['device_memory_bytes'] / 1e6:.1f} MB")
    (out / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    if results["errors"]:
        print("errors:", json.dumps(results["errors"], indent=1))


if __name__ == "__main__":
    main()
