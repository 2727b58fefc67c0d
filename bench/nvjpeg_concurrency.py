"""Does the GPU decode JPEGs faster with several batched decodes in flight at once (issue 30)?

In the pipeline one thread decodes batch after batch, each decode waiting for the last one's, and
JPEG files → boxes stayed near the decode's time plus the engine's (BENCHMARKS.md, "Frames to
boxes"). Here 1, 2 and 3 threads each decode with a `NvjpegBatched` of their own on a stream of
their own, for the same wall time; frames/s in all.

    PYTHONPATH=. python bench/nvjpeg_concurrency.py --images DIR [--threads 1,2,3] [--batch 32]
"""
from __future__ import annotations

import argparse
import sys
import threading
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from sartor.pipeline.nvjpeg_batched import NvjpegBatched  # noqa: E402


def rate(decoders: list, encoded: list, seconds: float) -> float:
    counts = [0] * len(decoders)
    streams = [torch.cuda.Stream() for _ in decoders]

    def loop(index: int) -> None:
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            decoders[index].decode(encoded, streams[index])
            streams[index].synchronize()
            counts[index] += len(encoded)
    threads = [threading.Thread(target=loop, args=(i,)) for i in range(len(decoders))]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(counts) / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", required=True)
    parser.add_argument("--threads", default="1,2,3")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    from pipeline_e2e import read_frames
    frames = read_frames(Path(args.images))
    encoded = (frames * (args.batch // len(frames) + 1))[:args.batch]
    counts = [int(t) for t in args.threads.split(",")]
    decoders = [NvjpegBatched("cuda") for _ in range(max(counts))]
    for d in decoders:
        d.decode(encoded, torch.cuda.current_stream())
    torch.cuda.synchronize()
    print(torch.cuda.get_device_name(), "nvJPEG hardware backend:", decoders[0].hardware, flush=True)
    for round_index in range(args.rounds):
        for n in counts:
            print(f"round {round_index + 1}: {n} thread(s), batch {args.batch}: "
                  f"{rate(decoders[:n], encoded, args.seconds):.0f} frames/s", flush=True)


if __name__ == "__main__":
    main()
