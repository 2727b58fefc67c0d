"""The host decode pool alone (decisions 0057, 0059): JPEG files decoded the fast host way by the
pipeline's own pool step, on 1..N threads, by Pillow and by libjpeg-turbo (simplejpeg), on CUDA
also into page-locked memory allocated for each frame and into the pool's own reused buffers. It
tells whether the pool scales with the cores, or stops at the GIL or the page-locked memory.

Each cell is the median of --repeats timed runs (the spread beside it): at 16 threads on 16 cores
one short run moved by half between two calls.

    python bench/host_decode_pool.py --images DIR [--threads 1,4,8,16] [--frames 512] [--repeats 3]"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from sartor.data.preprocess import parse_preprocess  # noqa: E402
from sartor.pipeline import decode, turbo_jpeg  # noqa: E402
from sartor.pipeline.pinned_slots import PinnedSlots  # noqa: E402
from sartor.pipeline.sources import FrameSource  # noqa: E402
from sartor.runtime.launchers import usable_cpus  # noqa: E402


def release(frame):
    """The frame's buffer back at once, as if uploaded and copied: the pool alone is timed."""
    if frame.pinned is not None:
        frame.pinned.release()
    return frame


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", required=True)
    parser.add_argument("--threads", default="1,2,4,8,16")
    parser.add_argument("--frames", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--preprocess", default="letterbox=640,mean=0,std=255,rgb,nchw")
    args = parser.parse_args()
    spec = parse_preprocess(args.preprocess)
    files = sorted(p for p in Path(args.images).iterdir() if p.suffix.lower() in (".jpg", ".jpeg"))
    sources = [FrameSource(f.name, encoded=torch.frombuffer(bytearray(f.read_bytes()), dtype=torch.uint8))
               for f in files]
    sources = [sources[i % len(sources)] for i in range(args.frames)]
    turbo = turbo_jpeg.simplejpeg  # None: not installed, and the libjpeg-turbo rows are left out
    steps = {}  # name: (the pool's step, whether libjpeg-turbo may decode)
    for library in ("Pillow", "libjpeg-turbo") if turbo is not None else ("Pillow",):
        steps[f"{library}"] = (decode._host_frame, library != "Pillow")
        if torch.cuda.is_available():
            steps[f"{library}, page-locked memory a frame"] = (decode._pinned_host_frame, library != "Pillow")
            slots = PinnedSlots()
            steps[f"{library}, the pool's page-locked buffers"] = (
                lambda source, spec, fast, slots=slots: release(decode._pinned_host_frame(source, spec, fast, slots)),
                library != "Pillow")
    print(f"os.cpu_count {os.cpu_count()}, usable_cpus {usable_cpus()}, {len(files)} files cycled to "
          f"{len(sources)}, torch threads {torch.get_num_threads()}")
    print(f"| step | threads | frames/s, median of {args.repeats} (lowest–highest) | ms a frame a thread |")
    print("|---|---|---|---|")
    for name, (step, turbo_decodes) in steps.items():
        turbo_jpeg.simplejpeg = turbo if turbo_decodes else None
        for threads in (int(t) for t in args.threads.split(",")):
            with ThreadPoolExecutor(threads) as pool:
                list(pool.map(lambda s: step(s, spec, True), sources[:threads * 4]))  # warm-up
                rates = []
                for _ in range(args.repeats):
                    started = time.perf_counter()
                    # Each frame is dropped once decoded, as the pipeline drops it once uploaded: holding
                    # them all would time the page faults of fresh memory, not the decode.
                    errors = [f.error for f in pool.map(lambda s: step(s, spec, True), sources) if f.error]
                    rates.append(len(sources) / (time.perf_counter() - started))
                    assert not errors, errors[:1]
            rate = statistics.median(rates)
            print(f"| {name} | {threads} | {rate:,.0f} ({min(rates):,.0f}–{max(rates):,.0f}) | "
                  f"{threads / rate * 1e3:.3f} |")


if __name__ == "__main__":
    main()
