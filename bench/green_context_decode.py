"""Does fencing the engine into part of the GPU let the decoders run beside it (issue 30)? One device call.

JPEG files → boxes stay well below nvJPEG's rate alone: with the engine replayed in a loop, every
decoder fell to a fraction of its rate, the hardware JPEG engines' too, and a high-priority decode
stream changed nothing, since the decoders queue their kernels on streams of their own (figures in
BENCHMARKS.md, "Frames to boxes"). A CUDA green context runs the work of its streams on a fixed set
of SMs, so an engine launched on such a stream would leave the rest to everything else (the
decoders' kernels among them) without any change to the decoders. Session 47 found that sartor's
Triton kernels do not take the fence (`green_context_probe.py`; BENCHMARKS.md).

This script makes green-context streams through the driver API (ctypes on libcuda: the torch on
the device may predate `GreenContext.Stream()`), then, for each SM count asked ("all" is an
ordinary stream, the baseline), alternating over rounds:

- check: an FP16 matmul on the stream, against the same on an ordinary stream (the fence holds
  when the time grows as the SMs shrink);
- beside: the engine's CUDA graph replayed in a loop on the stream while another thread decodes
  with torchvision's nvJPEG on an ordinary stream (bench/jpeg_decoders.py's `side_by_side`), each
  one's rate against its own alone;
- end to end: `sartor bench --end-to-end`'s `end_to_end` (files → boxes, host share 0) called on
  the stream, so the engine runs fenced and the pipeline's worker decodes on its own stream;
- with `--video`: `video_end_to_end` over that many NVDEC streams on the same stream (the video
  pipeline reached about half the decoders' own rate, the same question).

    PYTHONPATH=. python bench/green_context_decode.py ENGINE.plan --images DIR [--sms all,120,112,96]
        [--video clip.mp4 --video-streams 8]
"""
from __future__ import annotations

import argparse
import ctypes
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import sartor  # noqa: E402
from sartor.pipeline.benchmark import end_to_end, image_files  # noqa: E402
from sartor.pipeline.video_benchmark import video_end_to_end  # noqa: E402

CU_DEV_RESOURCE_TYPE_SM = 1
CU_GREEN_CTX_DEFAULT_STREAM = 1
CU_STREAM_NON_BLOCKING = 1
# CUdevResource is {int type; 92 bytes internal; union {CUdevSmResource sm; 48 bytes}} in the 12.4
# ABI (144 bytes); later drivers append fields, so each is given a generous buffer.
RESOURCE_BYTES = 1024
SM_COUNT_OFFSET = 96


class GreenStreams:
    """Streams whose work runs on a partition of the device's SMs (CUDA green contexts)."""

    def __init__(self, device_index: int = 0):
        torch.zeros(1, device=f"cuda:{device_index}")  # the primary context first, as the driver advises
        self.cuda = ctypes.CDLL("libcuda.so.1")
        device = ctypes.c_int()
        self._check(self.cuda.cuDeviceGet(ctypes.byref(device), device_index), "cuDeviceGet")
        self.device = device
        self.whole = ctypes.create_string_buffer(RESOURCE_BYTES)
        self._check(self.cuda.cuDeviceGetDevResource(device, self.whole, CU_DEV_RESOURCE_TYPE_SM),
                    "cuDeviceGetDevResource")
        self.kept = []  # contexts and buffers live as long as their streams

    @staticmethod
    def sm_count(resource) -> int:
        return int.from_bytes(resource.raw[SM_COUNT_OFFSET:SM_COUNT_OFFSET + 4], "little")

    def _check(self, result: int, call: str) -> None:
        if result != 0:
            text = ctypes.c_char_p()
            self.cuda.cuGetErrorString(result, ctypes.byref(text))
            raise RuntimeError(f"{call}: CUDA error {result} ({(text.value or b'?').decode()})")

    def stream(self, num_sms: int) -> tuple[torch.cuda.ExternalStream, int]:
        """A stream on `num_sms` SMs (the driver rounds up to its granularity) and the count given."""
        group, rest = ctypes.create_string_buffer(RESOURCE_BYTES), ctypes.create_string_buffer(RESOURCE_BYTES)
        groups = ctypes.c_uint(1)
        self._check(self.cuda.cuDevSmResourceSplitByCount(group, ctypes.byref(groups), self.whole, rest, 0,
                                                          num_sms), "cuDevSmResourceSplitByCount")
        desc, green, stream = ctypes.c_void_p(), ctypes.c_void_p(), ctypes.c_void_p()
        self._check(self.cuda.cuDevResourceGenerateDesc(ctypes.byref(desc), group, 1), "cuDevResourceGenerateDesc")
        self._check(self.cuda.cuGreenCtxCreate(ctypes.byref(green), desc, self.device, CU_GREEN_CTX_DEFAULT_STREAM),
                    "cuGreenCtxCreate")
        self._check(self.cuda.cuGreenCtxStreamCreate(ctypes.byref(stream), green, CU_STREAM_NON_BLOCKING, 0),
                    "cuGreenCtxStreamCreate")
        self.kept.append((group, rest, green, stream))
        return torch.cuda.ExternalStream(stream.value), self.sm_count(group)


def matmul_ms(stream: torch.cuda.Stream, size: int = 8192, repeats: int = 10) -> float:
    a = torch.randn(size, size, device="cuda", dtype=torch.float16)
    with torch.cuda.stream(stream):
        stream.wait_stream(torch.cuda.default_stream())
        a @ a
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(stream)
        for _ in range(repeats):
            a @ a
        end.record(stream)
    end.synchronize()
    return start.elapsed_time(end) / repeats


def beside(ctx, feed: dict, stream, encoded: list, batch: int) -> dict:
    """The engine on `stream` and nvJPEG on an ordinary stream: each alone, then both at once."""
    from jpeg_decoders import rate_alone, side_by_side, torchvision_decoder
    decode = torchvision_decoder(torch.device("cuda"))
    decode_stream = torch.cuda.Stream()

    def engine_step():
        with torch.cuda.stream(stream):
            ctx.run(feed)
        stream.synchronize()

    def decode_step():
        decode(encoded, decode_stream)
        decode_stream.synchronize()
    for _ in range(5):
        engine_step()
    engine_alone = rate_alone(lambda e, s: engine_step(), list(range(batch)), stream)["per_s"] / batch
    decode_alone = rate_alone(decode, encoded, decode_stream)["per_s"] / batch
    both = side_by_side(engine_step, decode_step)
    return {"engine_alone_fps": round(engine_alone * batch), "decode_alone_fps": round(decode_alone * batch),
            "engine_beside_fps": round(both["engine"] * batch), "decode_beside_fps": round(both["decode"] * batch),
            "engine_share": round(both["engine"] / engine_alone, 3),
            "decode_share": round(both["decode"] / decode_alone, 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("engine")
    parser.add_argument("--images", required=True)
    parser.add_argument("--sms", default="all,120,112,96", help="SM counts for the engine; all: an ordinary stream")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--passes", type=int, default=4)
    parser.add_argument("--video", default=None, help="an H.264/H.265 file: NVDEC streams to boxes too")
    parser.add_argument("--video-streams", type=int, default=8)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("green_context_decode.py needs a CUDA device")
    props = torch.cuda.get_device_properties(0)
    print(f"{props.name}, {props.multi_processor_count} SMs, torch {torch.__version__}, CUDA {torch.version.cuda}",
          flush=True)
    greens = GreenStreams()
    streams = {}
    for token in args.sms.split(","):
        if token == "all":
            streams["all"] = (torch.cuda.Stream(), props.multi_processor_count)
            continue
        try:
            streams[token] = greens.stream(int(token))
        except RuntimeError as exc:
            print(f"{token} SMs: {exc}", flush=True)
    base_ms = matmul_ms(streams["all"][0]) if "all" in streams else matmul_ms(torch.cuda.Stream())
    for token, (stream, sms) in streams.items():
        ms = matmul_ms(stream)
        print(f"check {token}: {sms} SMs, fp16 matmul 8192³ {ms:.3f} ms ({ms / base_ms:.2f}× the whole device's)",
              flush=True)

    from jpeg_decoders import inputs_for
    from pipeline_e2e import read_frames
    engine = sartor.load(args.engine)
    ctx = engine.context()
    spec = engine.inputs[0]
    shape = (args.batch, *engine.profiles[0].shapes[spec.name].max[1:])
    feed = {spec.name: torch.rand(shape, device="cuda").to(getattr(torch, spec.dtype))}  # e.g. "float32"
    files = image_files(args.images)
    encoded = inputs_for("bytes", read_frames(Path(args.images)), args.batch)
    rows: dict[str, list[dict]] = {}
    for round_index in range(args.rounds):
        for token, (stream, sms) in streams.items():
            try:
                row = beside(ctx, feed, stream, encoded, args.batch)
                with torch.cuda.stream(stream):
                    result = end_to_end(engine, files, batch=args.batch, passes=args.passes, host_decode_share=0.0)
                row |= {"files_to_boxes_fps": round(result.frames_per_s), "e2e_engine_alone_fps":
                        round(result.engine_frames_per_s), "decode_stage_ms": result.stages_ms.get("decode")}
                if args.video:
                    with torch.cuda.stream(stream):
                        video = video_end_to_end(engine, [args.video], streams=args.video_streams,
                                                 batch=args.batch, passes=3, video_decoder="nvdec")
                    row |= {"video_to_boxes_fps": round(video.frames_per_s),
                            "video_p99_ms": round(video.latency_ms_p99, 1)}
            except Exception as exc:  # noqa: BLE001 - a stream the engine cannot run on is a result
                row = {"error": f"{type(exc).__name__}: {exc}"[:300]}
            rows.setdefault(token, []).append(row)
            print(f"round {round_index + 1}, engine on {token} ({sms} SMs): {row}", flush=True)
            time.sleep(0.5)
    keys = ("engine_alone_fps", "decode_alone_fps", "engine_share", "decode_share", "files_to_boxes_fps",
            "e2e_engine_alone_fps", "decode_stage_ms") + (("video_to_boxes_fps", "video_p99_ms") if args.video else ())
    print("| engine's SMs | " + " | ".join(keys) + " |\n|" + "---|" * (len(keys) + 1))
    for token, values in rows.items():
        good = [v for v in values if "error" not in v]
        cells = [f"{statistics.median(v[k] for v in good):g}" if good else "error" for k in keys]
        print(f"| {token} ({streams[token][1]}) | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
