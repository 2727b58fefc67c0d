"""NVDEC decoding alone, no engine (issue 30: video streams to boxes stop at a fraction of what the
engine alone runs, from 8 streams on; figures in BENCHMARKS.md). Each stream is a thread with its own
PyNvVideoCodec SimpleDecoder over the same clip, as `ConcurrentStreams` runs them; the decoders are
made before the clock starts, and the clock stops when every thread has its last frame and the
device is idle. Ways of taking the frames:

- `native`: the decoder's own NV12 surfaces, no colour conversion, nothing copied;
- `rgb`: interleaved RGB (what the pipeline asks for), not copied;
- `rgb+clone`: as the pipeline does (`video_nvdec._frames`): each frame cloned on the thread's
  current stream (torch's default), one event recorded per call;
- `rgb+own stream`: the decoder given a stream of the thread's own (PyNvVideoCodec's default is
  stream 0, the legacy default stream) and the clones made on it;
- `rgb+dlpack`: each frame taken by `torch.from_dlpack`, not copied (which of the pipeline's two
  per-frame calls hands the GIL over);
- `rgb+cai+clone`: each frame taken through its `__cuda_array_interface__` (`torch.as_tensor`),
  then cloned;
- `rgb+stack`: a call's frames taken by `torch.from_dlpack` and copied by one `torch.stack`, then
  unbound into frames: two torch calls a batch where the clones made one a frame (each torch call
  releases the GIL and must take it back).

CPU s per wall s says how many cores the threads kept busy; near 1 with many threads means they
take turns on the GIL. `--gil-probe` adds a thread that counts in a loop of pure Python beside the
decoders: its count per second against its count alone is the share of the interpreter the decoder
threads leave to Python (the pipeline's own threads need it to batch and launch); the decode rate
beside it says how much a busy Python thread slows the decoders.

    PYTHONPATH=SITE:. python bench/nvdec_decode_only.py clip.mp4 [--streams 1,8,32] [--per-call 8] [--gil-probe]"""
from __future__ import annotations

import argparse
import contextlib
import threading
import time

import torch

MODES = ("native", "rgb", "rgb+clone", "rgb+own stream", "rgb+dlpack", "rgb+cai+clone", "rgb+stack")


def python_rate(seconds: float, stop: threading.Event | None = None) -> float:
    """Iterations a second of a loop of pure Python, for `seconds` or until `stop`."""
    count, start = 0, time.perf_counter()
    while not (stop.is_set() if stop is not None else time.perf_counter() - start > seconds):
        count += 1
    return count / (time.perf_counter() - start)


def run(path: str, streams: int, mode: str, per_call: int, probe: bool = False) -> tuple[float, float, int, float]:
    import PyNvVideoCodec as nvc

    colour = nvc.OutputColorType.NATIVE if mode == "native" else nvc.OutputColorType.RGB
    own = [torch.cuda.Stream() if mode == "rgb+own stream" else None for _ in range(streams)]
    decoders = [nvc.SimpleDecoder(path, gpu_id=0, use_device_memory=True, output_color_type=colour,
                                  cuda_stream=stream.cuda_stream if stream is not None else 0)
                for stream in own]
    counts = [0] * streams
    start = threading.Barrier(streams + 1)
    failures: list[BaseException] = []

    def decode(k: int) -> None:
        decoder, stream = decoders[k], own[k]
        start.wait()
        try:
            with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                while True:
                    frames = decoder.get_batch_frames(per_call)
                    if not frames:
                        return
                    if mode in ("rgb+clone", "rgb+own stream"):
                        copies = [torch.from_dlpack(frame).clone() for frame in frames]
                        torch.cuda.Event().record(torch.cuda.current_stream(copies[0].device))
                    elif mode == "rgb+dlpack":
                        views = [torch.from_dlpack(frame) for frame in frames]
                        torch.cuda.Event().record(torch.cuda.current_stream(views[0].device))
                    elif mode == "rgb+stack":
                        copies = torch.stack([torch.from_dlpack(frame) for frame in frames]).unbind(0)
                        torch.cuda.Event().record(torch.cuda.current_stream(copies[0].device))
                    elif mode == "rgb+cai+clone":
                        copies = [torch.as_tensor(frame, device="cuda").clone() for frame in frames]
                        torch.cuda.Event().record(torch.cuda.current_stream(copies[0].device))
                    counts[k] += len(frames)
        except BaseException as exc:  # noqa: BLE001 - reported in the row
            failures.append(exc)

    threads = [threading.Thread(target=decode, args=(k,), daemon=True) for k in range(streams)]
    for thread in threads:
        thread.start()
    done, probed = threading.Event(), []
    if probe:
        prober = threading.Thread(target=lambda: probed.append(python_rate(0, done)), daemon=True)
    start.wait()
    wall0, cpu0 = time.perf_counter(), time.process_time()
    if probe:
        prober.start()
    for thread in threads:
        thread.join()
    done.set()
    if probe:
        prober.join()
    torch.cuda.synchronize()
    wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
    if failures:
        raise failures[0]
    return sum(counts) / wall, cpu / wall, sum(counts), probed[0] if probed else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("video")
    parser.add_argument("--streams", default="1,8,32")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--per-call", type=int, default=8)
    parser.add_argument("--gil-probe", action="store_true")
    args = parser.parse_args()
    torch.zeros(1, device="cuda")
    alone = python_rate(0.5) if args.gil_probe else float("nan")
    print("| streams | frames taken | frames/s | CPU s per wall s | frames | Python thread's rate ÷ alone |")
    print("|---|---|---|---|---|---|")
    for streams in (int(s) for s in args.streams.split(",")):
        for mode in args.modes.split(","):
            try:
                rate, cores, frames, python = run(args.video, streams, mode, args.per_call, args.gil_probe)
            except Exception as exc:  # noqa: BLE001 - the other rows are still worth timing
                print(f"| {streams} | {mode} | failed: {type(exc).__name__}: {str(exc)[:160]} ||||", flush=True)
                continue
            print(f"| {streams} | {mode} | {rate:,.0f} | {cores:.2f} | {frames} | {python / alone:.2f} |", flush=True)


if __name__ == "__main__":
    main()
