"""What a thread that leaves the GIL for native work pays to get it back while another thread runs
Python (issue 30: the host decode pool's frames take longer beside the pipeline than alone).

A pool of N threads decodes JPEG files with libjpeg-turbo (simplejpeg, which releases the GIL for the
decode) through the pipeline's own host step, alone and beside one thread that runs pure Python
without pause, at Python's default switch interval (5 ms) and at a shorter one. A thread returning
from native code waits for the GIL until its holder blocks or the interval passes.

    PYTHONPATH=. python bench/gil_handoff.py --images DIR [--threads 2] [--frames 256] [--intervals-ms 5,0.5]"""
from __future__ import annotations

import argparse
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from sartor.data.preprocess import parse_preprocess  # noqa: E402
from sartor.pipeline import decode  # noqa: E402
from sartor.pipeline.sources import FrameSource  # noqa: E402


def pool_rate(step, sources, threads: int) -> float:
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(step, sources[:threads * 2]))  # warm-up
        started = time.perf_counter()
        list(pool.map(step, sources))
        return len(sources) / (time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", required=True)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--frames", type=int, default=256)
    parser.add_argument("--intervals-ms", default="5,0.5")
    args = parser.parse_args()
    spec = parse_preprocess("letterbox=640,mean=0,std=255,rgb,nchw")
    files = sorted(p for p in Path(args.images).iterdir() if p.suffix.lower() in (".jpg", ".jpeg"))
    sources = [FrameSource(f.name, encoded=torch.frombuffer(bytearray(f.read_bytes()), dtype=torch.uint8))
               for f in files]
    sources = [sources[i % len(sources)] for i in range(args.frames)]

    def step(source):
        return decode._host_frame(source, spec, True)

    print(f"| switch interval | pool of {args.threads} alone, frames/s | beside a thread running Python | ratio |")
    print("|---|---|---|---|")
    default = sys.getswitchinterval()
    for interval in (float(ms) / 1e3 for ms in args.intervals_ms.split(",")):
        sys.setswitchinterval(interval)
        alone = pool_rate(step, sources, args.threads)
        stop = threading.Event()

        def busy():
            while not stop.is_set():
                sum(range(1000))  # pure Python: holds the GIL until the interval forces a switch
        spinner = threading.Thread(target=busy)
        spinner.start()
        try:
            beside = pool_rate(step, sources, args.threads)
        finally:
            stop.set()
            spinner.join()
        print(f"| {interval * 1e3:g} ms | {alone:,.0f} | {beside:,.0f} | {beside / alone:.2f} |", flush=True)
    sys.setswitchinterval(default)


if __name__ == "__main__":
    main()
