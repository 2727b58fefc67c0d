"""The host decode pool alone (decision 0057): JPEG files decoded the fast host way by the pipeline's
own pool step, on 1..N threads, with and without the copy to page-locked memory that CUDA pipelines
make. It tells whether the pool scales with the cores, or stops at the GIL or the pinned copy.

    python bench/host_decode_pool.py --images DIR [--threads 1,4,8,16] [--frames 512]"""
from __future__ import annotations

import argparse
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from sartor.data.preprocess import parse_preprocess  # noqa: E402
from sartor.pipeline import decode  # noqa: E402
from sartor.pipeline.sources import FrameSource  # noqa: E402
from sartor.runtime.launchers import usable_cpus  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", required=True)
    parser.add_argument("--threads", default="1,2,4,8,16")
    parser.add_argument("--frames", type=int, default=512)
    parser.add_argument("--preprocess", default="letterbox=640,mean=0,std=255,rgb,nchw")
    args = parser.parse_args()
    spec = parse_preprocess(args.preprocess)
    files = sorted(p for p in Path(args.images).iterdir() if p.suffix.lower() in (".jpg", ".jpeg"))
    sources = [FrameSource(f.name, encoded=torch.frombuffer(bytearray(f.read_bytes()), dtype=torch.uint8))
               for f in files]
    sources = [sources[i % len(sources)] for i in range(args.frames)]
    steps = {"decode": decode._host_frame}
    if torch.cuda.is_available():
        steps["decode+pinned copy"] = decode._pinned_host_frame
    try:  # libjpeg-turbo through simplejpeg: the GIL released for the whole decode, into any buffer
        import simplejpeg
    except ImportError:
        simplejpeg = None
    if simplejpeg is not None:
        def scaled(data: bytes) -> tuple[int, int]:
            height, width = simplejpeg.decode_jpeg_header(data)[:2]
            scale = 1
            while scale < 8 and width / (scale * 2) >= 640 and height / (scale * 2) >= 360:
                scale *= 2
            return -(-height // scale), -(-width // scale)

        def simple(source, spec, fast):
            data = source.encoded.numpy().tobytes()
            h, w = scaled(data)
            return decode.DecodedFrame(source.name, torch.from_numpy(simplejpeg.decode_jpeg(
                data, "RGB", min_height=h, min_width=w)))

        def simple_pinned(source, spec, fast):
            data = source.encoded.numpy().tobytes()
            h, w = scaled(data)
            pinned = torch.empty((h, w, 3), dtype=torch.uint8, pin_memory=torch.cuda.is_available())
            simplejpeg.decode_jpeg(data, "RGB", min_height=h, min_width=w, buffer=pinned.numpy())
            return decode.DecodedFrame(source.name, pinned)
        steps["simplejpeg"] = simple
        steps["simplejpeg into pinned"] = simple_pinned
    print(f"os.cpu_count {os.cpu_count()}, usable_cpus {usable_cpus()}, {len(files)} files cycled to "
          f"{len(sources)}, torch threads {torch.get_num_threads()}")
    print("| step | threads | frames/s | ms a frame a thread |")
    print("|---|---|---|---|")
    for name, step in steps.items():
        for threads in (int(t) for t in args.threads.split(",")):
            with ThreadPoolExecutor(threads) as pool:
                list(pool.map(lambda s: step(s, spec, True), sources[:threads * 4]))  # warm-up
                started = time.perf_counter()
                # Each frame is dropped once decoded, as the pipeline drops it once uploaded: holding
                # them all would time the page faults of fresh memory, not the decode.
                errors = [f.error for f in pool.map(lambda s: step(s, spec, True), sources) if f.error]
                seconds = time.perf_counter() - started
            assert not errors, errors[:1]
            per_frame = seconds / len(sources)
            print(f"| {name} | {threads} | {1 / per_frame:,.0f} | {per_frame * threads * 1e3:.3f} |")


if __name__ == "__main__":
    main()
