"""Frames to boxes, end to end, against the engine alone and the decoder alone, in one process.

For each model (YOLOv8n at 640 from --onnx, the trained sample detector at 320) an FP16 engine is
built with the letterbox stored in it (batch 1..B, kernels chosen at B), then, on the same 1280×720
JPEG frames (bench/make_frames.py; held in memory as bytes, so disk reads are not timed):

- engine: the engine alone on its bound input buffer (no copy), batch B and batch 1;
- decode: nvJPEG through torchvision.io.decode_jpeg(list, device="cuda") alone, batches B and 128:
  the JPEG ceiling on this GPU (nvImageCodec is not installed on the device machine);
- stages: decode, preprocess (prepare_batch into the engine's buffer), engine, YoloNms, each alone
  at batch B, synchronised;
- jpeg_e2e: `Pipeline(engine, decoder=YoloNms(), host_outputs=False)` over N frames at batch B
  (decode of batch n+1 overlapping batch n), after one warm-up pass: frames/s, and the share of
  min(engine, decode ceiling) it reaches;
- raw_e2e: the same with decoded H×W×3 uint8 frames already on the GPU (a camera SDK's case);
- latency: batch 1 end to end, frame after frame, median and p99, against the engine's batch 1;
- with --variants nms,frames: engines with the YOLO decode and NMS inside (`--nms`), and also
  taking raw 720p uint8 frames (`--input-format uint8:720x1280`, preprocessing inside the CUDA
  graph): the engine alone, JPEG bytes and raw GPU frames → boxes, batch-1 latency;
- cpu: one core, per 720p frame: today's `sartor.data.preprocess.preprocess_image` (PIL + numpy)
  against the pipeline's CPU path, exact (Pillow decode, uint8 resize, normalisation into the input)
  and fast (JPEGs decoded at the DCT scale the letterbox needs, the CPU Pipeline's default; per
  stage: bench/cpu_preprocess.py);
  and frames/s of the PIL path on every core (a thread per core, as `iterate_batches` runs it).

    PYTHONPATH=. python bench/pipeline_e2e.py --frames .carry/frames --onnx .carry/yolov8n.onnx --out $OUT
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

warnings.filterwarnings("ignore")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import sartor  # noqa: E402
from sartor.data.preprocess import parse_preprocess, preprocess_image  # noqa: E402
from sartor.pipeline import Pipeline, YoloNms, decode_frames, prepare_batch, read_sources  # noqa: E402


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def per_call_ms(fn, repeats: int, warmup: int = 3) -> list[float]:
    for _ in range(warmup):
        fn()
    sync()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync()
        times.append((time.perf_counter() - start) * 1e3)
    return times


def summary(times_ms: list[float], items_per_call: int) -> dict:
    median = statistics.median(times_ms)
    return {"median_ms": round(median, 4), "p99_ms": round(float(np.percentile(times_ms, 99)), 4),
            "per_s": round(items_per_call * 1e3 / median, 1), "calls": len(times_ms)}


def frames_engine_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The options of the benches that run the `frames` engine over a folder of frames: --frames,
    --onnx, --batch (32), --count (1,024 frames a pass) and --out ($OUT)."""
    parser.add_argument("--frames", type=Path, required=True)
    parser.add_argument("--onnx", type=Path, required=True)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--count", type=int, default=1024)
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "out")))
    return parser


def read_frames(folder: Path) -> list[bytes]:
    """The JPEG frames of `folder` (bench/make_frames.py), as bytes, in name order."""
    return [p.read_bytes() for p in sorted(folder.glob("*.jpg"))]


def cycled(items: list, count: int) -> list:
    """`items` repeated in order until there are `count`."""
    return (items * (count // len(items) + 1))[:count]


def device_frames(frames: list[bytes], device: torch.device) -> list[torch.Tensor]:
    """The frames decoded on `device` as H×W×3 uint8 tensors: a camera SDK's raw frames."""
    return [d.pixels.permute(1, 2, 0).contiguous() for d in decode_frames(read_sources(frames), device)]


DEVICE = os.environ.get("E2E_DEVICE", "cuda")  # cpu: a quick check of the script itself
NMS = "conf=0.25,iou=0.45,max_det=300"
# What each variant builds beside the FP16 engine with its letterbox stored: `nms` appends the
# YOLO decode and NMS (only the kept boxes leave the engine); `frames` also takes raw 720p uint8
# frames, so preprocessing, inference and NMS all run inside the engine's CUDA graph.
VARIANTS = {"plain": {}, "nms": {"nms": NMS}, "frames": {"nms": NMS, "input_format": "uint8:720x1280"}}


def build(onnx: Path, size: int, batch: int, work: Path, variant: str = "plain") -> Path:
    from sartor.builder.config import BuildConfig
    from sartor.builder.pipeline import build as run_build
    plan = work / f"{onnx.stem}_fp16_b{batch}_{variant}.plan"
    if os.environ.get("E2E_REUSE_PLANS") and plan.exists():  # A/B runs of the runtime over one build
        print(f"reusing {plan.name}", flush=True)
        return plan
    shape = lambda b: {"images": (b, 3, size, size)}  # noqa: E731
    start = time.perf_counter()
    run_build(BuildConfig(str(onnx), str(plan), device=DEVICE, precision="fp16",
                          profiles=[{"min": shape(1), "opt": shape(batch), "max": shape(batch)}],
                          preprocess=f"letterbox={size},mean=0,std=255,rgb,nchw", builder_effort=1,
                          **VARIANTS[variant]))
    print(f"built {plan.name} in {time.perf_counter() - start:.0f} s", flush=True)
    return plan


def measure_variant(onnx: Path, size: int, batch: int, frames: list[bytes], count: int, work: Path,
                    variant: str, engine_only_per_s: float | None) -> dict:
    """An engine with the NMS (and the preprocessing) inside: the engine alone on its bound input,
    JPEG bytes → boxes and raw GPU frames → boxes through the Pipeline, and batch-1 latency."""
    engine = sartor.load(build(onnx, size, batch, work, variant), device=DEVICE)
    result = {"model": onnx.stem, "variant": variant, "input": engine.inputs[0].name}
    ctx = engine.context()
    device = torch.device(DEVICE)
    raw = device_frames(frames, device)
    for b in (batch, 1):
        if engine.input_format is not None:
            feed = {engine.inputs[0].name: torch.stack(cycled(raw, b))}
        else:
            feed = ctx.input_buffers({"images": (b, 3, size, size)})
            feed["images"].uniform_(0, 1)
        result[f"engine_b{b}"] = summary(per_call_ms(lambda: ctx.run(feed), 200), b)
    items = cycled(frames, count)
    pipeline = Pipeline(engine, batch_size=batch, host_outputs=False)
    pipeline.run(items[:2 * batch])
    result["jpeg_e2e"] = summary(per_call_ms(lambda: pipeline.run(items), 3, warmup=0), count)
    raw_items = cycled(raw, count)
    pipeline.run(raw_items[:2 * batch])
    result["raw_e2e"] = summary(per_call_ms(lambda: pipeline.run(raw_items), 3, warmup=0), count)
    result["boxes_per_frame"] = round(float(np.mean([len(r.detections) for r in pipeline.run(raw_items[:batch])])), 1)
    if engine_only_per_s:
        result["jpeg_e2e"]["share_of_plain_engine"] = round(result["jpeg_e2e"]["per_s"] / engine_only_per_s, 3)
        result["raw_e2e"]["share_of_plain_engine"] = round(result["raw_e2e"]["per_s"] / engine_only_per_s, 3)
    single = Pipeline(engine, batch_size=1, host_outputs=False, overlap=False)
    result["latency_b1"] = summary(per_call_ms(lambda: single.run(items[:1]), 200, warmup=10), 1)
    result["latency_b1_raw"] = summary(per_call_ms(lambda: single.run(raw_items[:1]), 200, warmup=10), 1)
    return result


def measure_model(onnx: Path, size: int, batch: int, frames: list[bytes], count: int, work: Path) -> dict:
    engine = sartor.load(build(onnx, size, batch, work), device="cuda")
    spec = engine.preprocess
    result = {"model": onnx.stem, "variant": "plain", "input": f"{batch}x3x{size}x{size}",
              "frames": f"{count} 1280x720 JPEG"}
    ctx = engine.context()
    for b in (batch, 1):
        buffers = ctx.input_buffers({"images": (b, 3, size, size)})
        buffers["images"].uniform_(0, 1)
        result[f"engine_b{b}"] = summary(per_call_ms(lambda: ctx.run(buffers), 200), b)
    device = torch.device("cuda")
    chunk = cycled(frames, batch)
    sources = read_sources(chunk)
    from torchvision.io import ImageReadMode, decode_jpeg
    encoded = [s.encoded for s in sources]
    big = cycled(frames, 128)
    big_encoded = [s.encoded for s in read_sources(big)]
    result["decode_b%d" % batch] = summary(per_call_ms(lambda: decode_jpeg(encoded, mode=ImageReadMode.RGB, device=device), 30), batch)
    result["decode_b128"] = summary(per_call_ms(lambda: decode_jpeg(big_encoded, mode=ImageReadMode.RGB, device=device), 20), 128)
    ceiling = max(result["decode_b%d" % batch]["per_s"], result["decode_b128"]["per_s"])
    on_gpu = decode_frames(read_sources(frames), device)
    on_cpu = decode_frames(read_sources(frames), torch.device("cpu"))
    apart = torch.cat([(g.pixels.cpu().int() - c.pixels.int()).abs().flatten() for g, c in zip(on_gpu, on_cpu)]).float()
    result["nvjpeg_vs_libjpeg_levels"] = {"mean": round(float(apart.mean()), 4), "max": int(apart.max()),
                                          "p99": float(torch.quantile(apart[::97], 0.99)),
                                          "p999": float(torch.quantile(apart[::97], 0.999))}
    # each stage alone, synchronised
    decoded = decode_frames(sources, device)
    pixels = [d.pixels for d in decoded]
    names = [d.name for d in decoded]
    buffer = ctx.input_buffers({"images": (batch, 3, size, size)})["images"]
    nms = YoloNms()
    metas = prepare_batch(pixels, names, spec, buffer)[1]
    outputs = ctx.run({"images": buffer})  # the real frames' head outputs
    stages = {"read": per_call_ms(lambda: read_sources(chunk), 20),
              "decode": per_call_ms(lambda: decode_frames(sources, device), 20),
              "preprocess": per_call_ms(lambda: prepare_batch(pixels, names, spec, buffer), 20),
              "engine": per_call_ms(lambda: ctx.run({"images": buffer}), 50),
              "nms_to_host": per_call_ms(lambda: nms(outputs, metas), 20)}
    result["stages_b%d_ms" % batch] = {k: round(statistics.median(v), 4) for k, v in stages.items()}
    result["engine_nms_parts_b%d_ms" % batch] = engine_nms_parts(outputs)
    detections = nms(outputs, metas)
    result["boxes_per_frame"] = round(float(np.mean([len(d) for d in detections])), 1)
    items = cycled(frames, count)
    pipeline = Pipeline(engine, batch_size=batch, decoder=YoloNms(), host_outputs=False)
    pipeline.run(items[:2 * batch])  # warm-up: graphs captured, kernels loaded, buffers allocated
    e2e = per_call_ms(lambda: pipeline.run(items), 3, warmup=0)
    result["jpeg_e2e"] = summary(e2e, count)
    floor = min(result[f"engine_b{batch}"]["per_s"], ceiling)
    result["jpeg_e2e"]["share_of_min_engine_decode"] = round(result["jpeg_e2e"]["per_s"] / floor, 3)
    raw = device_frames(frames, device)
    raw_items = cycled(raw, count)
    pipeline.run(raw_items[:2 * batch])
    result["raw_e2e"] = summary(per_call_ms(lambda: pipeline.run(raw_items), 3, warmup=0), count)
    result["raw_e2e"]["share_of_engine"] = round(result["raw_e2e"]["per_s"] / result[f"engine_b{batch}"]["per_s"], 3)
    single = Pipeline(engine, batch_size=1, decoder=YoloNms(), host_outputs=False, overlap=False)
    latencies = per_call_ms(lambda: single.run(items[:1]), 200, warmup=10)
    result["latency_b1"] = summary(latencies, 1)
    result["latency_b1"]["over_engine_ms"] = round(result["latency_b1"]["median_ms"] - result["engine_b1"]["median_ms"], 4)
    return result


def engine_nms_parts(outputs: dict) -> dict:
    """The in-engine NMS (`--nms`, ops/nms.py) on this batch's real head outputs, each part alone,
    synchronised: candidates (threshold, top-k, sort), the greedy kernel, and the whole op per tactic."""
    from sartor.ops.nms import NmsSettings, batched_nms_op, fused_candidates, nms_candidates
    from sartor.pipeline.detections import yolo_output
    from sartor.kernels.detection.greedy_nms import greedy_nms
    head = outputs[yolo_output(outputs)]
    settings = NmsSettings(conf=0.25, iou=0.45, max_det=300)
    attrs = settings.to_json()
    boxes, scores, classes, valid = nms_candidates(head, settings)
    count = valid.sum(1)
    parts = {"candidates": per_call_ms(lambda: nms_candidates(head, settings), 50),
             "candidates_two_level": per_call_ms(lambda: nms_candidates(head, settings, two_level=True), 50),
             "candidates_fused": per_call_ms(lambda: fused_candidates(head, settings), 50),
             "greedy_kernel": per_call_ms(lambda: greedy_nms(boxes, scores, classes, classes, count, 0.45, 300), 50)}
    for tactic in ("torch", "triton_greedy_nms", "two_level_torch", "two_level_triton_greedy_nms",
                   "fused_triton_greedy_nms"):
        parts[f"op_{tactic}"] = per_call_ms(lambda: batched_nms_op([head], dict(attrs, tactic=tactic)), 30)
    summary_ms = {k: round(statistics.median(v), 4) for k, v in parts.items()}
    summary_ms["valid_candidates_per_image"] = round(float(count.float().mean()), 1)
    summary_ms["head_dtype"] = str(head.dtype)
    return summary_ms


def measure_cpu(frames: list[bytes], work: Path) -> dict:
    spec = parse_preprocess("letterbox=640,mean=0,std=255,rgb,nchw")
    paths = []
    for i, data in enumerate(frames[:16]):
        paths.append(work / f"frame{i}.jpg")
        paths[-1].write_bytes(data)
    torch.set_num_threads(1)
    reference = per_call_ms(lambda: [preprocess_image(p, spec) for p in paths], 5, warmup=1)

    def pipeline_cpu(fast: bool):
        decoded = decode_frames(read_sources(paths), torch.device("cpu"), spec, fast)
        for d in decoded:
            prepare_batch([d.pixels], [d.name], spec, orig_sizes=[d.size])
    ours = per_call_ms(lambda: pipeline_cpu(False), 5, warmup=1)
    ours_fast = per_call_ms(lambda: pipeline_cpu(True), 5, warmup=1)
    cores = os.cpu_count() or 1
    with ThreadPoolExecutor(cores) as pool:
        many = paths * 8
        threaded = per_call_ms(lambda: list(pool.map(lambda p: preprocess_image(p, spec), many)), 3, warmup=1)
    torch.set_num_threads(cores)
    return {"pil_one_core_ms_per_frame": round(statistics.median(reference) / len(paths), 3),
            "pipeline_cpu_one_core_ms_per_frame": round(statistics.median(ours) / len(paths), 3),
            "speedup": round(statistics.median(reference) / statistics.median(ours), 2),
            "pipeline_cpu_fast_one_core_ms_per_frame": round(statistics.median(ours_fast) / len(paths), 3),
            "speedup_fast": round(statistics.median(reference) / statistics.median(ours_fast), 2),
            f"pil_{cores}_threads_frames_per_s": round(len(many) * 1e3 / statistics.median(threaded), 1)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--frames", type=Path, required=True)
    parser.add_argument("--onnx", type=Path, default=None, help="YOLOv8n ONNX (640)")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--count", type=int, default=512)
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "out")))
    parser.add_argument("--skip-cpu", action="store_true")
    parser.add_argument("--skip-sample", action="store_true", help="only the --onnx model")
    parser.add_argument("--variants", default="plain", help=f"comma-separated, of {', '.join(VARIANTS)}")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    work = Path("/tmp/pipeline_e2e")
    work.mkdir(exist_ok=True)
    frames = read_frames(args.frames)
    import torchvision
    results = {"versions": {"torch": torch.__version__, "torchvision": torchvision.__version__,
                            "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
                            "cuda": torch.version.cuda}, "models": []}
    save = lambda: (args.out / "pipeline_e2e.json").write_text(json.dumps(results, indent=1))  # noqa: E731
    if not args.skip_cpu:
        results["cpu"] = measure_cpu(frames, work)
        print(json.dumps(results["cpu"]), flush=True)
        save()
    models = [] if args.skip_sample else [(ROOT / "samples/detector/sample_detector.onnx", 320)]
    if args.onnx is not None:
        models.insert(0, (args.onnx, 640))
    variants = args.variants.split(",")
    for onnx, size in models:
        plain = None
        for variant in variants:
            if variant != "plain" and "yolo" not in onnx.stem:
                continue  # --nms decodes YOLOv8/YOLO11 heads only
            try:
                if variant == "plain":
                    plain = measure_model(onnx, size, args.batch, frames, args.count, work)
                    results["models"].append(plain)
                else:
                    engine_only = plain[f"engine_b{args.batch}"]["per_s"] if plain else None
                    results["models"].append(measure_variant(onnx, size, args.batch, frames, args.count, work,
                                                             variant, engine_only))
            except Exception as exc:  # noqa: BLE001 - the other models and variants are still worth measuring
                import traceback
                traceback.print_exc()
                results["models"].append({"model": onnx.stem, "variant": variant,
                                          "error": f"{type(exc).__name__}: {exc}"[:500]})
            print(json.dumps(results["models"][-1]), flush=True)
            save()


if __name__ == "__main__":
    main()
