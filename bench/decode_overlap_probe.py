"""Can nvJPEG (torchvision.io.decode_jpeg on CUDA) run beside other GPU work at all? Issue 30's JPEG
end to end looked like decode and inference in series; this separates the causes:

- decode alone (batch B), and a stand-in inference load alone (fp16 matmuls on a stream of their own);
- both at once, decode on a thread: each one's rate, so "in series" shows as rates that halve;
- the GIL during decode: how far a pure-Python counter thread gets while decode runs, against idle;
- the CUDA runtime calls one decode makes (torch.profiler), e.g. cudaFree, which waits for the
  whole device and would put any other stream's work in front of the decode;
- the host's capacity beside it: Pillow decoding the same frames at the DCT scale a 640 letterbox
  needs (the CPU pipeline's fast decode, decision 0025) on 1 and on every core, frames/s. Should
  decode prove to share the SMs with inference, a share of each batch decoded there is what could
  lift the JPEG figure above 1/(1/decode + 1/engine).

    PYTHONPATH=. python bench/decode_overlap_probe.py --frames .carry/frames --out $OUT
"""
from __future__ import annotations

import argparse
import json
import os
import threading
import time
from pathlib import Path

import torch
from torchvision.io import ImageReadMode, decode_jpeg


def rate(fn, seconds: float, stop: threading.Event | None = None) -> float:
    """Calls of fn per second over about `seconds` (synchronised each call)."""
    fn()
    torch.cuda.synchronize()
    count, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds and not (stop is not None and stop.is_set()):
        fn()
        count += 1
    torch.cuda.synchronize()
    return count / (time.perf_counter() - start)


def host_decode_rate(frames: list[bytes], threads: int) -> float:
    """Frames/s of Pillow decoding JPEG bytes at the DCT scale a 640 letterbox needs, on `threads`."""
    from concurrent.futures import ThreadPoolExecutor

    from sartor.data.preprocess import parse_preprocess
    from sartor.pipeline.decode import decode_on_host
    spec = parse_preprocess("letterbox=640,mean=0,std=255,rgb,nchw")
    many = frames * (threads * 8 // len(frames) + 1)
    with ThreadPoolExecutor(threads) as workers:
        start = time.perf_counter()
        list(workers.map(lambda data: decode_on_host(data, spec, fast=True), many))
        return round(len(many) / (time.perf_counter() - start), 1)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--frames", type=Path, required=True)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    files = sorted(args.frames.glob("*.jpg"))
    encoded = [torch.frombuffer(bytearray(p.read_bytes()), dtype=torch.uint8) for p in files]
    encoded = (encoded * (args.batch // len(encoded) + 1))[:args.batch]
    device = torch.device("cuda")
    result = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name()}

    decode_stream = torch.cuda.Stream(device)

    def decode() -> None:
        with torch.cuda.stream(decode_stream):
            decode_jpeg(encoded, mode=ImageReadMode.RGB, device=device)

    load_stream = torch.cuda.Stream(device, priority=-1)
    a = torch.randn(4096, 4096, device=device, dtype=torch.float16)

    def load() -> None:  # about a YOLOv8n batch's worth of work per call, with one sync as the pipeline has
        with torch.cuda.stream(load_stream):
            for _ in range(8):
                a @ a
        load_stream.synchronize()

    result["decode_alone_frames_per_s"] = round(rate(decode, args.seconds) * args.batch, 1)
    result["load_alone_calls_per_s"] = round(rate(load, args.seconds), 1)
    stop, decoded = threading.Event(), {}

    def decoding() -> None:
        decoded["rate"] = rate(decode, args.seconds, stop)
    thread = threading.Thread(target=decoding)
    thread.start()
    result["load_beside_decode_calls_per_s"] = round(rate(load, args.seconds), 1)
    thread.join()
    result["decode_beside_load_frames_per_s"] = round(decoded["rate"] * args.batch, 1)

    def counter(seconds: float) -> int:
        n, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds:
            n += 1
        return n
    result["python_counter_idle"] = counter(1.0)
    counted = {}
    thread = threading.Thread(target=lambda: counted.setdefault("n", counter(1.0)))
    thread.start()
    start = time.perf_counter()
    while time.perf_counter() - start < 1.0:
        decode()
    thread.join()
    result["python_counter_during_decode"] = counted["n"]

    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        decode()
        torch.cuda.synchronize()
    calls = {}
    for event in prof.events():
        if event.name.startswith("cuda") or event.name.startswith("cu"):
            calls[event.name] = calls.get(event.name, 0) + 1
    result["runtime_calls_one_decode"] = dict(sorted(calls.items()))
    frames = [p.read_bytes() for p in files]
    for threads in sorted({1, os.cpu_count() or 1}):
        result[f"host_fast_decode_{threads}_threads_frames_per_s"] = host_decode_rate(frames, threads)
    pool = [torch.cuda.Stream(device).cuda_stream for _ in range(40)]
    result["low_priority_pool_repeats_after"] = next((k for k in range(1, 40) if pool[k] == pool[0]), None)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "decode_overlap_probe.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
