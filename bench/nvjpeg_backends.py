"""One JPEG's latency through each nvJPEG backend (issue 30: one JPEG file → boxes at batch 1 took 0.92
ms over the engine against a bar of 0.5, and nvJPEG's hardware engines alone took about 0.6 ms of
it). One device call. Per backend (`--backends`; `sartor.pipeline.nvjpeg_batched.BACKENDS`):
- decode: one 720p JPEG decoded and waited for, back to back (median and p99 of `--repeats`), and a
  batch of `--batch` at a time (frames/s);
- pipeline: one JPEG file → boxes through `Pipeline(batch_size=1, overlap=False)` with the device's
  decoders made on that backend, against the engine alone at batch 1 on a letterboxed frame.
Rounds alternate the backends.

    PYTHONPATH=. python bench/nvjpeg_backends.py ENGINE.plan --images DIR [--backends hardware,gpu_hybrid,default]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import sartor  # noqa: E402
from batch1_latency import engine_alone_ms, one_file_at_a_time_ms  # noqa: E402
from pipeline_e2e import per_call_ms, summary  # noqa: E402
from sartor.pipeline import Pipeline  # noqa: E402
from sartor.pipeline import decode as decode_module  # noqa: E402
from sartor.pipeline.benchmark import image_files  # noqa: E402
from sartor.pipeline.nvjpeg_batched import NvjpegBatched  # noqa: E402


def use_backend(device: torch.device, backend: str) -> None:
    """The device's shared decoders (what every Pipeline takes) made on `backend` from now on."""
    decode_module.set_gpu_jpeg_decoders(device, lambda: decode_module.GpuJpegDecoder(
        NvjpegBatched(device, backend=backend), torch.cuda.Stream(device)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("engine")
    parser.add_argument("--images", required=True)
    parser.add_argument("--backends", default="hardware,gpu_hybrid,default")
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    engine = sartor.load(args.engine)
    files = image_files(args.images)
    encoded = [f.read_bytes() for f in files[:args.batch]]
    device = torch.device(engine.device)
    stream = torch.cuda.Stream(device)
    decoders = {b: NvjpegBatched(device, backend=b) for b in args.backends.split(",")}
    single = Pipeline(engine, batch_size=1, overlap=False)
    single.run([files[0]])  # the engine alone runs this frame, letterboxed into its input
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, {len(files)} files", flush=True)
    for r in range(1, args.rounds + 1):
        engine_ms = engine_alone_ms(single, args.repeats)
        print(f"round {r}: engine alone at batch 1 {engine_ms['median_ms']:.3f} ms (p99 {engine_ms['p99_ms']:.3f})",
              flush=True)
        for backend, decoder in decoders.items():
            def one() -> None:
                decoder.decode(encoded[:1], stream)
                stream.synchronize()

            def batch() -> None:
                decoder.decode(encoded, stream)
                stream.synchronize()
            alone = summary(per_call_ms(one, args.repeats, warmup=10), 1)
            many = summary(per_call_ms(batch, max(10, args.repeats // 10), warmup=3), len(encoded))
            use_backend(device, backend)
            through = one_file_at_a_time_ms(Pipeline(engine, batch_size=1, overlap=False), files, args.repeats)
            print(f"round {r} {backend}: one JPEG decoded {alone['median_ms']:.3f} ms (p99 {alone['p99_ms']:.3f}); "
                  f"batch {len(encoded)} {many['per_s']:,.0f} frames/s; JPEG file → boxes at batch 1 "
                  f"{through['median_ms']:.3f} ms (p99 {through['p99_ms']:.3f}), "
                  f"{through['median_ms'] - engine_ms['median_ms']:.3f} over the engine", flush=True)


if __name__ == "__main__":
    main()
