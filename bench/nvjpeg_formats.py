"""Does nvJPEG's hardware decode keep its rate beside the engine when nothing of it runs on the SMs
(issue 30)? One device call.

Beside the engine replayed back to back, the Pipeline's decoders fall to about a quarter of their
rate alone (bench/joint_ceiling.py), though the hardware JPEG engines are not the SMs the engine
runs on. nvJPEG's output format decides what runs after the hardware: interleaved RGB (the
Pipeline's) needs a colour conversion on the SMs; planar YUV is what the hardware writes. Per format
(`--formats`): the decode alone on two threads with a decoder each, and beside the engine.

    PYTHONPATH=. python bench/nvjpeg_formats.py ENGINE.plan --images DIR [--formats rgbi,rgb,yuv,y]
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

import sartor  # noqa: E402
from sartor.pipeline.benchmark import bench_pipeline, image_files  # noqa: E402
from sartor.pipeline.nvjpeg_batched import NVJPEG_MAX_COMPONENT, NvjpegBatched, NvjpegImage, _buffer  # noqa: E402
from sartor.pipeline.prepare import input_tensor  # noqa: E402

FORMATS = {"y": 2, "yuv": 1, "rgb": 3, "rgbi": 5}


class FormatDecoder:
    """A batched nvJPEG decoder (the Pipeline's binding's handle and states) writing `fmt`."""

    def __init__(self, device: torch.device, fmt: str, encoded: list) -> None:
        self.binding = NvjpegBatched(device, states=2)
        self.stream = torch.cuda.Stream(device)
        self.fmt, self.device, self.encoded = fmt, device, encoded
        lib, handle = self.binding.lib, self.binding.handle
        self.planes = []  # per image: [(h, w, bytes per row)] of each plane written
        for item in encoded:
            address, length = _buffer(item)
            components, subsampling = ctypes.c_int(), ctypes.c_int()
            widths, heights = (ctypes.c_int * NVJPEG_MAX_COMPONENT)(), (ctypes.c_int * NVJPEG_MAX_COMPONENT)()
            lib.nvjpegGetImageInfo(handle, ctypes.c_void_p(address), ctypes.c_size_t(length), ctypes.byref(components),
                                   ctypes.byref(subsampling), widths, heights)
            h, w = heights[0], widths[0]
            if fmt == "rgbi":
                self.planes.append([(h, w * 3)])
            elif fmt == "rgb":
                self.planes.append([(h, w)] * 3)
            elif fmt == "y":
                self.planes.append([(h, w)])
            else:
                self.planes.append([(heights[c], widths[c]) for c in range(components.value)])
        self.subsampling = subsampling.value
        self.initialized = [False, False]
        self.turn = 0
        self.last: list = [None, None]

    def decode(self) -> torch.cuda.Event:
        lib, handle = self.binding.lib, self.binding.handle
        state = self.binding._states[self.turn]
        turn, self.turn = self.turn, 1 - self.turn
        if self.last[turn] is not None:
            self.last[turn][0].synchronize()
        with torch.cuda.stream(self.stream):
            if not self.initialized[turn]:
                code = lib.nvjpegDecodeBatchedInitialize(handle, state.handle, len(self.encoded), 1,
                                                         FORMATS[self.fmt])
                assert code == 0, f"initialize {self.fmt}: {code}"
                self.initialized[turn] = True
            images = (NvjpegImage * len(self.encoded))()
            kept = []
            for image, planes in zip(images, self.planes):
                for c, (h, w) in enumerate(planes):
                    plane = torch.empty((h, w), dtype=torch.uint8, device=self.device)
                    kept.append(plane)
                    image.channel[c], image.pitch[c] = plane.data_ptr(), w
            addresses, lengths = zip(*(_buffer(item) for item in self.encoded))
            data = (ctypes.c_void_p * len(self.encoded))(*addresses)
            sizes = (ctypes.c_size_t * len(self.encoded))(*lengths)
            code = lib.nvjpegDecodeBatched(handle, state.handle, data, sizes, images,
                                           ctypes.c_void_p(self.stream.cuda_stream))
            assert code == 0, f"decode {self.fmt}: {code}"
            done = torch.cuda.Event()
            done.record(self.stream)
        self.last[turn] = (done, [images, data, sizes, kept])
        return done


def decode_rate(decoders: list[FormatDecoder], batches: int, stop: threading.Event | None = None) -> float:
    counts = [0] * len(decoders)

    def loop(k: int) -> None:
        for _ in range(batches):
            if stop is not None and stop.is_set():
                break
            decoders[k].decode()
            counts[k] += 1
        decoders[k].stream.synchronize()
    threads = [threading.Thread(target=loop, args=(k,)) for k in range(len(decoders))]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(counts) * len(decoders[0].encoded) / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("engine")
    parser.add_argument("--images", required=True)
    parser.add_argument("--formats", default="rgbi,rgb,yuv,y")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    engine = sartor.load(args.engine)
    pipeline = bench_pipeline(engine, None, "auto")[0]
    device, batch = pipeline.device, pipeline.batch_size
    encoded = [f.read_bytes() for f in image_files(args.images)[:batch]]
    context = engine.context(pipeline.bucket_profile(0)[1])
    feed = input_tensor(pipeline.spec, batch, device).fill_(0.5)
    context.run({pipeline.input_name: feed})
    torch.cuda.synchronize()
    decoders = {}
    for fmt in args.formats.split(","):
        try:
            decoders[fmt] = [FormatDecoder(device, fmt, encoded) for _ in range(args.threads)]
            decode_rate(decoders[fmt], 3)
        except AssertionError as exc:
            print(f"{fmt}: {exc}", flush=True)
            decoders.pop(fmt, None)
    print(f"{torch.cuda.get_device_name()}, batch {batch}, subsampling {decoders[next(iter(decoders))][0].subsampling}"
          if decoders else "no format decoded", flush=True)
    stream = torch.cuda.current_stream()
    for r in range(1, args.rounds + 1):
        for fmt, group in decoders.items():
            alone = decode_rate(group, 60)
            stop, beside = threading.Event(), {}
            thread = threading.Thread(target=lambda: beside.setdefault("fps", decode_rate(group, 10 ** 6, stop)))
            thread.start()
            start, runs = time.perf_counter(), 0
            while time.perf_counter() - start < 2.0:
                context.run({pipeline.input_name: feed})
                runs += 1
                if runs % 8 == 0:
                    stream.synchronize()
            stream.synchronize()
            engine_fps = runs * batch / (time.perf_counter() - start)
            stop.set()
            thread.join()
            print(f"round {r} {fmt}: decode alone {alone:,.0f}, beside the engine {beside['fps']:,.0f} "
                  f"({beside['fps'] / alone:.2f}); engine beside {engine_fps:,.0f}", flush=True)


if __name__ == "__main__":
    main()
