"""Which part of `Pipeline`'s JPEG path costs it against a bare decode thread (issue 30), in one call.

The trained YOLOv8n at 640 built FP16 with the NMS and the preprocessing inside (bench/pipeline_e2e.py's
`frames` variant), batch 32, on 1280×720 JPEG frames held as bytes. Each variant is a decode thread
up to two batches ahead of the calling thread (a queue between them), adding one of the Pipeline's
own steps at a time, then the Pipeline itself:

- bare: torchvision's `decode_jpeg(list, device="cuda")` on the thread's stream; the caller stacks
  the frames into the engine's input, runs it and reads the kept-box counts (bench/jpeg_decoders.py's
  pipeline);
- sources: the thread also reads the items as the Pipeline does (`read_sources`) and decodes them
  through `decode_frames`;
- layout: the thread also lays the frames out into a staging buffer (`lay_out_frames`; three
  buffers in turn);
- detections: the caller also copies the NMS outputs to the host and makes each frame's
  detections (`EngineNms`), as `Pipeline` returns them;
- pipeline: `Pipeline(engine)` itself (its worker one batch ahead), also with Python's thread switch
  interval at 0.2 ms instead of 5 (how long a thread waiting for the GIL lets the holder run), and
  on the same frames decoded beforehand, as uint8 frames on the GPU (raw).

    PYTHONPATH=. python bench/jpeg_pipeline_variants.py --frames .carry/frames --onnx .carry/yolov8n.onnx --out $OUT
"""
from __future__ import annotations

import argparse
import json
import queue
import sys
import threading
import time
import warnings
from pathlib import Path

import torch

warnings.filterwarnings("ignore")
ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

import sartor  # noqa: E402
from sartor.pipeline import Pipeline, decode_frames, read_sources  # noqa: E402
from sartor.pipeline.detections import EngineNms  # noqa: E402
from sartor.pipeline.raw_frames import frames_tensor, lay_out_frames  # noqa: E402

VARIANTS = ("bare", "sources", "layout", "detections", "pipeline", "pipeline_switch_0.2ms", "pipeline_raw",
            "pipeline_raw_switch_0.2ms")


def threaded(engine, items: list, batch: int, variant: str) -> float:
    """Frames/s of a decode thread two batches ahead of the caller, with the variant's steps."""
    from torchvision.io import ImageReadMode, decode_jpeg
    ctx = engine.context()
    name = engine.inputs[0].name
    device = torch.device("cuda")
    side = torch.cuda.Stream()
    chunks = [items[i:i + batch] for i in range(0, len(items), batch)]
    staging = [frames_tensor(engine.input_format, batch, device) for _ in range(3)]
    detections = EngineNms(engine.nms) if variant == "detections" else None
    ready: queue.Queue = queue.Queue(maxsize=2)

    def producer():
        for k, chunk in enumerate(chunks):
            with torch.cuda.stream(side):
                if variant == "bare":
                    encoded = [torch.frombuffer(bytearray(b), dtype=torch.uint8) for b in chunk]
                    frames = decode_jpeg(encoded, mode=ImageReadMode.RGB, device=device)
                    batch_in = None
                else:
                    decoded = decode_frames(read_sources(chunk), device)
                    frames = [d.pixels for d in decoded]
                    batch_in = None
                    if variant in ("layout", "detections"):
                        batch_in, _ = lay_out_frames(frames, [d.name for d in decoded], engine.preprocess,
                                                     engine.input_format, staging[k % 3])
                event = torch.cuda.Event()
                event.record(side)
            ready.put((frames, batch_in, event))
        ready.put(None)

    thread = threading.Thread(target=producer)
    start = time.perf_counter()
    thread.start()
    metas = None
    while (item := ready.get()) is not None:
        frames, batch_in, event = item
        torch.cuda.current_stream().wait_event(event)
        if batch_in is None:
            batch_in = torch.stack([f.permute(1, 2, 0) for f in frames])
        outputs = ctx.run({name: batch_in})
        if detections is None:
            int(outputs[engine.nms["outputs"][0]].sum())
        else:
            host = {k: v.to("cpu", non_blocking=True) for k, v in outputs.items()}
            torch.cuda.current_stream().synchronize()
            if metas is None:
                from sartor.data.preprocess import placement
                place = placement(*engine.input_format.size, engine.preprocess)
                metas = [place.meta(f"f{i}", engine.input_format.size) for i in range(batch)]
            detections(host, metas)
    thread.join()
    return len(items) / (time.perf_counter() - start)


def main() -> None:
    from pipeline_e2e import build, cycled, device_frames, frames_engine_arguments, read_frames
    parser = frames_engine_arguments(argparse.ArgumentParser())
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    work = Path("/tmp/jpeg_pipeline_variants")
    work.mkdir(exist_ok=True)
    frames = read_frames(args.frames)
    items = cycled(frames, args.count)
    engine = sartor.load(build(args.onnx, 640, args.batch, work, "frames"), device="cuda")
    results = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "frames_per_s": {}}
    pipeline = Pipeline(engine, batch_size=args.batch)
    raw_items = cycled(device_frames(frames, torch.device("cuda")), args.count)
    default_switch = sys.getswitchinterval()
    for variant in VARIANTS:
        sys.setswitchinterval(0.0002 if "switch" in variant else default_switch)
        if variant.startswith("pipeline"):
            chosen = raw_items if "raw" in variant else items
            run = lambda: len(chosen) / timed(lambda: pipeline.run(chosen))  # noqa: E731
        else:
            run = lambda: threaded(engine, items, args.batch, variant)  # noqa: E731
        run()  # warm-up: graphs, buffers, decoder state
        rates = [run() for _ in range(args.repeats)]
        results["frames_per_s"][variant] = [round(r, 1) for r in rates]
        print(variant, results["frames_per_s"][variant], flush=True)
        (args.out / "jpeg_pipeline_variants.json").write_text(json.dumps(results, indent=1))
    sys.setswitchinterval(default_switch)


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


if __name__ == "__main__":
    main()
