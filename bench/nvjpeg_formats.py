"""Does nvJPEG's hardware decode slow beside the engine because of its colour conversion (issue 30)?

In the pipeline the batched decode of 32 720p JPEGs takes longer on the GPU beside the engine than
alone, and the thread that calls it waits that long (BENCHMARKS.md, "Frames to boxes"). The
hardware JPEG engines decode to YCbCr; interleaved RGB (what the pipeline asks for) takes a CUDA
pass more, which competes with the engine's kernels for the SMs. Here one thread decodes batch after
batch into interleaved RGB, planar RGB and planar YUV (4:2:0 frames: Y at full size, U and V at
half), alone and beside an engine replaying its CUDA graph back to back on another thread and
stream; frames/s of the decode, and of the engine beside it.

    PYTHONPATH=. python bench/nvjpeg_formats.py --images DIR --engine ENGINE.plan [--formats rgbi,rgb,yuv]
"""
from __future__ import annotations

import argparse
import ctypes
import sys
import threading
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import sartor  # noqa: E402
from sartor.pipeline.nvjpeg_batched import NvjpegBatched, NvjpegImage, _buffer  # noqa: E402

OUTPUT_FORMATS = {"yuv": 1, "rgb": 3, "rgbi": 5}  # nvjpegOutputFormat_t


def planes(fmt: str, h: int, w: int) -> list[tuple[int, int]]:
    """(rows, bytes a row) of each output plane of an h×w 4:2:0 JPEG in `fmt`."""
    if fmt == "rgbi":
        return [(h, w * 3)]
    if fmt == "rgb":
        return [(h, w)] * 3
    return [(h, w), ((h + 1) // 2, (w + 1) // 2), ((h + 1) // 2, (w + 1) // 2)]


class FormatDecoder:
    """The binding's handle and one decode state, initialised for `fmt` and the batch size."""
    def __init__(self, fmt: str, batch: int):
        self.binding = NvjpegBatched("cuda", states=1)
        self.fmt, self.state = fmt, self.binding._states[0]
        self.binding._check(self.binding.lib.nvjpegDecodeBatchedInitialize(
            self.binding.handle, self.state.handle, batch, 1, OUTPUT_FORMATS[fmt]), "nvjpegDecodeBatchedInitialize")

    def decode(self, encoded: list, stream: torch.cuda.Stream) -> list[torch.Tensor]:
        lib, binding = self.binding.lib, self.binding
        addresses, lengths = zip(*(_buffer(e) for e in encoded))
        sizes = [binding.image_size(a, n) for a, n in zip(addresses, lengths)]
        images = (NvjpegImage * len(encoded))()
        outputs = []
        with torch.cuda.stream(stream):
            for image, (h, w) in zip(images, sizes):
                for c, (rows, pitch) in enumerate(planes(self.fmt, h, w)):
                    plane = torch.empty((rows, pitch), dtype=torch.uint8, device="cuda")
                    outputs.append(plane)
                    image.channel[c], image.pitch[c] = plane.data_ptr(), pitch
            data = (ctypes.c_void_p * len(encoded))(*addresses)
            counts = (ctypes.c_size_t * len(encoded))(*lengths)
            binding._check(lib.nvjpegDecodeBatched(binding.handle, self.state.handle, data, counts, images,
                                                   ctypes.c_void_p(stream.cuda_stream)), "nvjpegDecodeBatched")
        return outputs


def engine_loop(context, feeds: dict, stop: threading.Event, count: list) -> None:
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        while not stop.is_set():
            context.run(feeds)
            stream.synchronize()
            count[0] += 1


def decode_rate(decoder: FormatDecoder, encoded: list, seconds: float, context=None, feeds=None):
    """(decoded frames/s, engine runs/s beside it or None)."""
    stream = torch.cuda.Stream()
    stop, runs = threading.Event(), [0]
    beside = threading.Thread(target=engine_loop, args=(context, feeds, stop, runs)) if context else None
    if beside:
        beside.start()
        time.sleep(0.2)  # the engine's loop under way
        runs[0] = 0
    decoded, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        decoder.decode(encoded, stream)
        stream.synchronize()
        decoded += len(encoded)
    elapsed = time.perf_counter() - start
    engine_runs = runs[0] / elapsed if beside else None
    stop.set()
    if beside:
        beside.join()
    return decoded / elapsed, engine_runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", required=True)
    parser.add_argument("--engine", required=True)
    parser.add_argument("--formats", default="rgbi,rgb,yuv")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--size", type=int, default=640, help="the engine's input height and width")
    parser.add_argument("--seconds", type=float, default=2.0)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    from pipeline_e2e import read_frames
    frames = read_frames(Path(args.images))
    encoded = (frames * (args.batch // len(frames) + 1))[:args.batch]
    engine = sartor.load(args.engine)
    context = engine.context()
    size = args.size
    feeds = context.input_buffers({"images": (args.batch, 3, size, size)})  # the engine's own input buffer
    print(torch.cuda.get_device_name(), f"torch {torch.__version__}", f"batch {args.batch}", flush=True)
    stop, runs = threading.Event(), [0]
    loop = threading.Thread(target=engine_loop, args=(context, feeds, stop, runs))
    loop.start()
    time.sleep(args.seconds)
    stop.set()
    loop.join()
    print(f"engine alone: {runs[0] / args.seconds * args.batch:.0f} frames/s", flush=True)
    decoders = {fmt: FormatDecoder(fmt, args.batch) for fmt in args.formats.split(",")}
    for decoder in decoders.values():
        decoder.decode(encoded, torch.cuda.current_stream())  # warm-up
    torch.cuda.synchronize()
    for round_ in range(1, args.rounds + 1):
        for fmt, decoder in decoders.items():
            alone, _ = decode_rate(decoder, encoded, args.seconds)
            beside, engine_runs = decode_rate(decoder, encoded, args.seconds, context, feeds)
            print(f"round {round_}: {fmt:5s} decode alone {alone:6.0f} frames/s; beside the engine {beside:6.0f} "
                  f"frames/s, engine {engine_runs * args.batch:6.0f} frames/s", flush=True)


if __name__ == "__main__":
    main()
