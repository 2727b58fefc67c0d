"""The fused preprocessing kernel against today's torch path and the CPU reference, on one batch.

32 camera-like 1280×720 uint8 frames (made here: gradients, edges and noise; the pixels do not
change the work) letterboxed into 640×640 FP16 NCHW (`letterbox=640,mean=0,std=255,rgb,nchw,
dtype=float16`), into one preallocated input buffer, steady state after warm-up, synchronised:

- kernel: `prepare_batch(..., kernel=True)` from a list of 3×H×W frames (as decoders give them:
  includes stacking them), and the kernel alone on an N×3×H×W and an N×H×W×3 (camera) batch, each
  tile of PREPROCESS_TILES: the one-row tiles and beside them those of several output rows per
  program (".rows4": the rows share their filtered input rows), each checked bit for bit against
  the first tile's output (`tiles_equal_default`);
- torch: `prepare_batch(..., kernel=False)`, today's path (interpolate with antialias in float32,
  normalise, pad, layout: several launches);
- cpu_reference: `sartor.data.preprocess.preprocess_batch` (Pillow + numpy, one core) on the same
  frames from host memory;
- agreement: the kernel's and the torch path's pixels against the CPU reference, in levels.

    PYTHONPATH=. python bench/preprocess_kernel.py --out $OUT/prep.json

On a machine without a GPU it runs through Triton's interpreter (TRITON_INTERPRET=1) on small
frames: `--frames 2 --size 12x20 --spec letterbox=8,... --tiles 1` (tests/bench does that).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sartor.data.preprocess import parse_preprocess, placement, preprocess_batch
from sartor.kernels.preprocess.letterbox import PREPROCESS_TILES, letterbox_frames
from sartor.pipeline import prepare_batch
from sartor.pipeline.prepare import input_tensor

SPEC = "letterbox=640,mean=0,std=255,rgb,nchw,dtype=float16"


def camera_frames(count: int, h: int, w: int, seed: int = 0) -> np.ndarray:
    """N×H×W×3 uint8: a gradient per channel, a few hard edges, sensor noise."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:h, 0:w].astype(np.float32)
    frames = np.empty((count, h, w, 3), np.uint8)
    for k in range(count):
        base = np.stack([yy / h * 255, xx / w * 255, ((xx + yy * (k + 1)) % 97) * 2.6], -1)
        base[(xx // 64 + yy // 64 + k) % 5 == 0] = 250.0
        frames[k] = np.clip(base + rng.normal(0, 8, base.shape), 0, 255).astype(np.uint8)
    return frames


def timed_ms(fn, device: torch.device, repeats: int, warmup: int) -> dict:
    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    for _ in range(warmup):
        fn()
    sync()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync()
        samples.append((time.perf_counter() - start) * 1e3)
    ordered = sorted(samples)
    return {"median_ms": round(statistics.median(samples), 4), "min_ms": round(ordered[0], 4),
            "p90_ms": round(ordered[int(0.9 * (len(ordered) - 1))], 4), "repeats": repeats, "warmup": warmup}


def levels_apart(ours: torch.Tensor, reference: np.ndarray, spec) -> dict:
    """|ours - reference| in pixel levels (undoing std): max, and the share of values that differ."""
    std = np.asarray(spec.std).reshape((1, 3, 1, 1) if spec.layout == "nchw" else (1, 1, 1, 3))
    scale = 1.0 if spec.dtype == "uint8" else std
    apart = np.abs(ours.float().cpu().numpy().astype(np.float64) - reference.astype(np.float64)) * scale
    half_step = 0.5 * float(np.max(std)) / 1024 if spec.dtype == "float16" else 1e-6  # float16's own rounding
    return {"max_levels": round(float(apart.max()), 4), "share_differing": round(float((apart > half_step).mean()), 6)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="the JSON file to write")
    parser.add_argument("--frames", type=int, default=32)
    parser.add_argument("--size", default="720x1280", help="frame H x W")
    parser.add_argument("--spec", default=SPEC)
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--cpu-repeats", type=int, default=3)
    parser.add_argument("--tiles", type=int, default=len(PREPROCESS_TILES), help="how many tiles to time alone")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    h, w = (int(d) for d in args.size.lower().split("x"))
    spec = parse_preprocess(args.spec)
    host = camera_frames(args.frames, h, w)
    hwc = torch.from_numpy(host).to(device)
    chw = hwc.permute(0, 3, 1, 2).contiguous()
    frames = list(chw)
    names = [f"frame {i}" for i in range(args.frames)]
    out = input_tensor(spec, args.frames, device)
    place = placement(h, w, spec)
    report: dict = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (interpreter)",
                    "torch": torch.__version__, "frames": args.frames, "frame_size": [h, w], "spec": spec.describe(),
                    "triton_interpret": os.environ.get("TRITON_INTERPRET") == "1"}
    try:
        import triton
        report["triton"] = triton.__version__
    except ImportError:
        report["triton"] = None

    timings: dict = {}
    timings["kernel_prepare_batch"] = timed_ms(lambda: prepare_batch(frames, names, spec, out, kernel=True), device,
                                               args.repeats, args.warmup)
    for tile in PREPROCESS_TILES[:args.tiles]:
        for layout, batch in (("chw", chw), ("hwc", hwc)):
            timings[f"kernel_alone.{layout}.{tile.name}"] = timed_ms(
                lambda batch=batch, layout=layout, tile=tile: letterbox_frames(
                    batch, layout, "rgb", spec, place.resized, place.pad, out, tile), device, args.repeats, args.warmup)
    timings["torch_prepare_batch"] = timed_ms(lambda: prepare_batch(frames, names, spec, out, kernel=False), device,
                                              args.repeats, args.warmup)
    timings["cpu_reference_preprocess_batch"] = timed_ms(lambda: preprocess_batch(list(host), spec), torch.device("cpu"),
                                                         args.cpu_repeats, 1)
    report["timings"] = timings
    for layout in ("chw", "hwc"):
        alone = [k for k in timings if k.startswith(f"kernel_alone.{layout}.")]
        best = min(alone, key=lambda k: timings[k]["median_ms"])
        report[f"best_tile_{layout}"] = best.split(".", 2)[2]
    equal = {}
    for layout, batch in (("chw", chw), ("hwc", hwc)):
        first = letterbox_frames(batch, layout, "rgb", spec, place.resized, place.pad, torch.empty_like(out),
                                 PREPROCESS_TILES[0])
        for tile in PREPROCESS_TILES[1:args.tiles]:
            again = letterbox_frames(batch, layout, "rgb", spec, place.resized, place.pad, torch.empty_like(out), tile)
            equal[f"{layout}.{tile.name}"] = bool(torch.equal(again, first))
    report["tiles_equal_default"] = equal
    report["speedup_prepare_batch_kernel_over_torch"] = round(
        timings["torch_prepare_batch"]["median_ms"] / timings["kernel_prepare_batch"]["median_ms"], 3)

    reference, _ = preprocess_batch(list(host), spec)
    fused, _ = prepare_batch(frames, names, spec, kernel=True)
    ops, _ = prepare_batch(frames, names, spec, kernel=False)
    report["agreement"] = {"kernel_vs_cpu_reference": levels_apart(fused, reference, spec),
                           "torch_vs_cpu_reference": levels_apart(ops, reference, spec)}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps({k: report[k] for k in ("device", "best_tile_chw", "best_tile_hwc",
                                             "speedup_prepare_batch_kernel_over_torch", "agreement",
                                             "tiles_equal_default")}, indent=2))
    print(f"kernel {timings['kernel_prepare_batch']['median_ms']} ms, torch {timings['torch_prepare_batch']['median_ms']}"
          f" ms, cpu reference {timings['cpu_reference_preprocess_batch']['median_ms']} ms per {args.frames} frames")
    return 0


if __name__ == "__main__":
    sys.exit(main())
