"""Which GPU JPEG decoder can feed an engine, and does it overlap with one (issue 30), in one device call.

On the same 1280×720 JPEG frames (bench/make_frames.py, held in memory as bytes):

- alone: frames/s of each decoder at batch 32 and 128, synchronised per batch: torchvision's
  nvJPEG (`decode_jpeg(list, device="cuda")`) and nvImageCodec (when importable) with its default
  backends, the hardware JPEG engines alone (HW_GPU_ONLY), CUDA alone (GPU_ONLY) and hybrid;
- beside the engine: the engine's CUDA graph replayed in a loop on one thread and stream while
  another thread decodes on its own stream, both for the same wall time; each one's rate against
  its rate alone says whether the two share the GPU or take turns;
- pipeline: a decode thread two batches ahead of an engine thread (a queue between them, the
  decoded frames copied into the engine's bound input): frames/s of JPEG bytes → kept boxes,
  against min(engine alone, best decoder alone).

The engine is the trained YOLOv8n at 640 built FP16 with the NMS and the preprocessing inside
(`--nms --input-format uint8:720x1280`, bench/pipeline_e2e.py's `frames` variant), batch 1..32.

    PYTHONPATH=.:$NVIMG python bench/jpeg_decoders.py --frames .carry/frames --onnx .carry/yolov8n.onnx --out $OUT
"""
from __future__ import annotations

import argparse
import json
import os
import queue
import statistics
import sys
import threading
import time
import warnings
from pathlib import Path

import torch

warnings.filterwarnings("ignore")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import sartor  # noqa: E402


def torchvision_decoder(device):
    from torchvision.io import ImageReadMode, decode_jpeg

    def decode(encoded: list, stream: torch.cuda.Stream) -> list[torch.Tensor]:
        with torch.cuda.stream(stream):  # CHW frames
            return decode_jpeg(encoded, mode=ImageReadMode.RGB, device=device)
    return decode


def nvimgcodec_decoder(kind: str | None, reuse: int = 0):
    """With `reuse`, a ring of that many sets of output images is decoded into again (no device
    allocation or free per batch); the caller must be done with a set `reuse` batches later."""
    from nvidia import nvimgcodec
    backends = None if kind is None else [nvimgcodec.Backend(getattr(nvimgcodec.BackendKind, kind))]
    decoder = nvimgcodec.Decoder(backends=backends)
    rings: dict[int, list] = {}  # batch size → its sets of images
    turn = [0]

    def decode(encoded: list, stream: torch.cuda.Stream) -> list[torch.Tensor]:
        ring = rings.setdefault(len(encoded), [])
        if reuse and len(ring) == reuse:
            images = decoder.decode(encoded, images=ring[turn[0] % reuse], cuda_stream=stream.cuda_stream)
        else:
            images = decoder.decode(encoded, cuda_stream=stream.cuda_stream)
            if reuse:
                ring.append(images)
        turn[0] += 1
        if any(i is None for i in images):
            raise RuntimeError(f"nvImageCodec ({kind or 'default'}) failed on {sum(i is None for i in images)} images")
        with torch.cuda.stream(stream):  # HWC frames, the decoder's own buffers
            return [torch.as_tensor(i, device="cuda") for i in images]
    return decode


def decoders(device) -> dict:
    found = {"torchvision_nvjpeg": (torchvision_decoder(device), "bytes")}
    try:
        from nvidia import nvimgcodec
    except ImportError as exc:
        print(f"nvImageCodec not importable: {exc}", flush=True)
        return found
    print(f"nvImageCodec {nvimgcodec.__version__}", flush=True)
    for label, kind in (("nvimgcodec_default", None), ("nvimgcodec_hw", "HW_GPU_ONLY"),
                        ("nvimgcodec_hw_reuse", "HW_GPU_ONLY")):
        try:
            found[label] = (nvimgcodec_decoder(kind, reuse=4 if "reuse" in label else 0), "codestreams")
        except Exception as exc:  # noqa: BLE001 - a backend this GPU lacks is a result, not a stop
            print(f"{label}: {type(exc).__name__}: {exc}", flush=True)
    return found


def inputs_for(form: str, frames: list[bytes], batch: int):
    chunk = (frames * (batch // len(frames) + 1))[:batch]
    if form == "bytes":
        return [torch.frombuffer(bytearray(f), dtype=torch.uint8) for f in chunk]
    from nvidia import nvimgcodec
    return [nvimgcodec.CodeStream(f) for f in chunk]


def rate_alone(decode, encoded, stream, seconds: float = 2.0) -> dict:
    for _ in range(3):
        decode(encoded, stream)
    stream.synchronize()
    times = []
    end = time.perf_counter() + seconds
    while time.perf_counter() < end or len(times) < 5:
        start = time.perf_counter()
        decode(encoded, stream)
        stream.synchronize()
        times.append(time.perf_counter() - start)
    median = statistics.median(times)
    return {"median_ms": round(median * 1e3, 3), "per_s": round(len(encoded) / median, 1), "batches": len(times)}


def waits_for_other_streams(decode, encoded, sleep_ms: float = 20.0) -> dict:
    """A decode's wall time alone, and right after a `sleep_ms` kernel (one thread block spinning)
    is queued on another stream: about `sleep_ms` more means the decoder waits for the whole
    device (a device-wide synchronisation, or a free or pinned allocation that implies one)."""
    stream, other = torch.cuda.Stream(), torch.cuda.Stream()
    torch.cuda.synchronize()
    start = time.perf_counter()
    decode(encoded, stream)
    stream.synchronize()
    alone = time.perf_counter() - start
    cycles = int(sleep_ms * 1e-3 * torch.cuda.get_device_properties(0).clock_rate * 1e3)
    with torch.cuda.stream(other):
        torch.cuda._sleep(cycles)
    start = time.perf_counter()
    decode(encoded, stream)
    stream.synchronize()
    beside = time.perf_counter() - start
    torch.cuda.synchronize()
    return {"alone_ms": round(alone * 1e3, 3), "beside_sleep_ms": round(beside * 1e3, 3), "sleep_ms": sleep_ms}


def engine_stepper(ctx, feed: dict):
    """(step, stream): one engine run on a stream of its own, waited for; warmed up here."""
    stream = torch.cuda.Stream()

    def step():
        with torch.cuda.stream(stream):
            ctx.run(feed)
        stream.synchronize()
    for _ in range(5):
        step()
    return step, stream


def loop_for(seconds: float, step, counter: list, stop: threading.Event) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end and not stop.is_set():
        step()
        counter[0] += 1


def side_by_side(engine_step, decode_step, seconds: float = 3.0) -> dict:
    """Both loops at once on two threads; each one's batches per second."""
    counts = {"engine": [0], "decode": [0]}
    stop = threading.Event()
    threads = [threading.Thread(target=loop_for, args=(seconds, engine_step, counts["engine"], stop)),
               threading.Thread(target=loop_for, args=(seconds, decode_step, counts["decode"], stop))]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    return {k: round(v[0] / wall, 2) for k, v in counts.items()}


def pipeline_rate(decode, encoded, ctx, feed_name: str, batch: int, batches: int = 60,
                  decode_priority: int = 0) -> dict:
    """A decode thread (its own stream, of `decode_priority`: negative is higher) two batches ahead
    of the engine thread; frames/s."""
    decode_stream, engine_stream = torch.cuda.Stream(priority=decode_priority), torch.cuda.Stream()
    ready: queue.Queue = queue.Queue(maxsize=2)

    def producer():
        for _ in range(batches):
            frames = decode(encoded, decode_stream)
            event = torch.cuda.Event()
            event.record(decode_stream)
            ready.put((frames, event))
        ready.put(None)

    thread = threading.Thread(target=producer)
    start = time.perf_counter()
    thread.start()
    kept = 0
    with torch.cuda.stream(engine_stream):
        while (item := ready.get()) is not None:
            frames, event = item
            engine_stream.wait_event(event)
            stacked = torch.stack([f.permute(1, 2, 0) if f.shape[0] == 3 else f for f in frames])
            outputs = ctx.run({feed_name: stacked})
            count = next(t for name, t in outputs.items() if "count" in name.lower() or t.dim() == 1)
            kept += int(count.sum())  # the host waits for this batch's boxes
    thread.join()
    wall = time.perf_counter() - start
    return {"per_s": round(batches * batch / wall, 1), "boxes_per_frame": round(kept / (batches * batch), 2)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--frames", type=Path, required=True)
    parser.add_argument("--onnx", type=Path, required=True)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "out")))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    from pipeline_e2e import build, read_frames
    frames = read_frames(args.frames)
    device = torch.device("cuda")
    results = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "alone": {}, "beside_engine": {},
               "sync": {}, "pipeline": {}}
    save = lambda: (args.out / "jpeg_decoders.json").write_text(json.dumps(results, indent=1))  # noqa: E731
    found = decoders(device)
    stream = torch.cuda.Stream()
    for label, (decode, form) in found.items():
        try:
            results["alone"][label] = {f"b{b}": rate_alone(decode, inputs_for(form, frames, b), stream)
                                       for b in (args.batch, 128)}
        except Exception as exc:  # noqa: BLE001
            results["alone"][label] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
        print(label, json.dumps(results["alone"][label]), flush=True)
        save()
    work = Path("/tmp/jpeg_decoders")
    work.mkdir(exist_ok=True)
    engine = sartor.load(build(args.onnx, 640, args.batch, work, "frames"), device="cuda")
    ctx = engine.context()
    name = engine.inputs[0].name
    first = [d for d in found["torchvision_nvjpeg"][0](inputs_for("bytes", frames, args.batch), stream)]
    feed = {name: torch.stack([f.permute(1, 2, 0) for f in first]).contiguous()}
    engine_step, engine_stream = engine_stepper(ctx, feed)
    results["engine_alone"] = rate_alone(lambda e, s: ctx.run(feed), list(range(args.batch)), torch.cuda.current_stream())
    print("engine", json.dumps(results["engine_alone"]), flush=True)
    for label, (decode, form) in found.items():
        if "error" in results["alone"].get(label, {}):
            continue
        encoded = inputs_for(form, frames, args.batch)
        decode_stream = torch.cuda.Stream()

        def decode_step():
            decode(encoded, decode_stream)
            decode_stream.synchronize()
        try:
            both = side_by_side(engine_step, decode_step)
            alone_engine = results["engine_alone"]["per_s"] / args.batch
            alone_decode = results["alone"][label][f"b{args.batch}"]["per_s"] / args.batch
            both["engine_share_of_alone"] = round(both["engine"] / alone_engine, 3)
            both["decode_share_of_alone"] = round(both["decode"] / alone_decode, 3)
            results["beside_engine"][label] = both
            print(label, "beside", json.dumps(both), flush=True)
            results["sync"][label] = waits_for_other_streams(decode, encoded)
            print(label, "sync", json.dumps(results["sync"][label]), flush=True)
            floor = min(results["engine_alone"]["per_s"], max(
                v[f"b{b}"]["per_s"] for v in results["alone"].values() if "error" not in v for b in (args.batch, 128)))
            high = torch.cuda.Stream.priority_range()[1] if hasattr(torch.cuda.Stream, "priority_range") else -1
            for priority in (0, high):
                rate = pipeline_rate(decode, encoded, ctx, name, args.batch, decode_priority=priority)
                rate["share_of_min_engine_best_decoder"] = round(rate["per_s"] / floor, 3)
                results["pipeline"][f"{label} priority {priority}"] = rate
                print(label, "pipeline priority", priority, json.dumps(rate), flush=True)
        except Exception as exc:  # noqa: BLE001
            import traceback
            traceback.print_exc()
            results["pipeline"][label] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
        save()


if __name__ == "__main__":
    main()
