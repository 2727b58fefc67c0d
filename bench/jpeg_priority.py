"""Does nvJPEG keep its rate beside the engine when its work runs on a high-priority stream (issue 30)?

JPEG files → boxes stay near the sum of the decode's and the engine's times, as if the two took turns
on the GPU, and in session 36 the decoders slowed beside the engine replayed in a loop (figures in
BENCHMARKS.md, "Frames to boxes"). torchvision's nvJPEG queues its work on a stream of torch's
low-priority pool, so no priority given to the caller's stream ever reached it.
`sartor.pipeline.nvjpeg_batched` queues nvJPEG's batched decode on the caller's stream, so the decode
can run at high priority (the SM scheduler places its blocks first as others retire). In one
process, alternating over rounds:

- frames: the binding's frames against torchvision's (both nvJPEG; the largest difference);
- alone / beside: each decoder's rate alone, and beside the engine replayed in a loop on a stream of
  normal priority on another thread (each one's rate against its own alone): torchvision, the binding
  on a normal stream, the binding on a high-priority stream;
- end to end: `end_to_end` (files → boxes, host share 0) with the Pipeline's preparation stream of
  normal or high priority and torchvision's decode or the binding's on it (as in session 48: the
  Pipeline now decodes on the decoder's own stream, decision 0063);
- batch 1: one JPEG's latency through `Pipeline(batch_size=1, overlap=False)`, frame after frame, with
  either decoder, against the engine's own at batch 1 (issue 30's bar: within 0.5 ms).
What it found (priority changed nothing; the binding's missing host wait did) is in BENCHMARKS.md.

    PYTHONPATH=. python bench/jpeg_priority.py ENGINE.plan --images DIR [--rounds 2]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import sartor  # noqa: E402
from sartor.pipeline import decode as decode_module  # noqa: E402
from sartor.pipeline import pipeline as pipeline_module  # noqa: E402
from sartor.pipeline.benchmark import end_to_end, image_files  # noqa: E402
from sartor.pipeline.nvjpeg_batched import NvjpegBatched  # noqa: E402

HIGH = -100  # torch maps it to the device's greatest priority
ORIGINAL_BATCHED = decode_module._batched_decoder
ORIGINAL_INIT = pipeline_module.Pipeline.__init__


def binding_decoder(binding: NvjpegBatched):
    def decode(encoded: list, stream: torch.cuda.Stream) -> list[torch.Tensor]:
        return binding.decode(encoded, stream)
    return decode


ON_PREPARATION_STREAM: dict = {}


def on_preparation_stream(device: torch.device):
    """The binding as session 48 ran it: decoding on the caller's (preparation) stream, whose
    priority the variant sets; the Pipeline decodes on the decoder's own stream since (decision 0063),
    with two decoders since decision 0064."""
    if ORIGINAL_BATCHED(device) is None:
        return None
    if device not in ON_PREPARATION_STREAM:
        def make() -> decode_module.GpuJpegDecoder:
            return decode_module.GpuJpegDecoder(NvjpegBatched(device))
        ON_PREPARATION_STREAM[device] = decode_module.GpuJpegDecoders(make, make())
    return ON_PREPARATION_STREAM[device]


def use_variant(binding: bool, priority: int) -> None:
    """The Pipeline's GPU JPEG decode (sartor's binding or torchvision's) and its preparation
    stream's priority, for the next end_to_end."""
    def init(self, *args, **kwargs):
        ORIGINAL_INIT(self, *args, **kwargs)
        self.stream_priority = priority
    decode_module._batched_decoder = on_preparation_stream if binding else (lambda device: None)
    pipeline_module.Pipeline.__init__ = init


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("engine")
    parser.add_argument("--images", required=True)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--passes", type=int, default=4)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("jpeg_priority.py needs a CUDA device")
    from jpeg_decoders import engine_stepper, inputs_for, rate_alone, side_by_side, torchvision_decoder
    from pipeline_e2e import read_frames
    low, high = torch.cuda.Stream.priority_range() if hasattr(torch.cuda.Stream, "priority_range") else (0, HIGH)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, CUDA {torch.version.cuda}, "
          f"stream priorities {low} (lowest) to {high}", flush=True)
    binding = NvjpegBatched("cuda")
    print(f"nvJPEG binding: {'hardware' if binding.hardware else 'default'} backend", flush=True)
    engine = sartor.load(args.engine)
    ctx = engine.context()
    spec = engine.inputs[0]
    shape = (args.batch, *engine.profiles[0].shapes[spec.name].max[1:])
    feed = {spec.name: torch.rand(shape, device="cuda").to(getattr(torch, spec.dtype))}
    files = image_files(args.images)
    encoded = inputs_for("bytes", read_frames(Path(args.images)), args.batch)

    # the binding's frames against torchvision's (both nvJPEG)
    normal, fast = torch.cuda.Stream(), torch.cuda.Stream(priority=HIGH)
    reference = torchvision_decoder(torch.device("cuda"))(encoded, normal)
    ours = binding.decode(encoded, fast)
    torch.cuda.synchronize()
    diff = max(int((r.permute(1, 2, 0).int() - o.int()).abs().max()) for r, o in zip(reference, ours))
    print(f"frames: {len(ours)} of {tuple(ours[0].shape)}; largest difference from torchvision's {diff}", flush=True)

    engine_step, engine_stream = engine_stepper(ctx, feed)
    decoders = {"torchvision": (torchvision_decoder(torch.device("cuda")), normal),
                "binding, normal stream": (binding_decoder(binding), normal),
                "binding, high-priority stream": (binding_decoder(binding), fast)}
    variants = {"torchvision, normal": (False, 0), "torchvision, high": (False, HIGH),
                "binding, normal": (True, 0), "binding, high": (True, HIGH)}
    beside_rows: dict[str, list] = {}
    e2e_rows: dict[str, list] = {}
    for round_index in range(args.rounds):
        engine_alone = rate_alone(lambda e, s: engine_step(), list(range(args.batch)), engine_stream)["per_s"]
        for name, (decode, stream) in decoders.items():
            alone = rate_alone(decode, encoded, stream)["per_s"]

            def decode_step(decode=decode, stream=stream):
                decode(encoded, stream)
                stream.synchronize()
            both = side_by_side(engine_step, decode_step)
            row = {"decode alone": alone, "engine alone": engine_alone,
                   "decode beside": both["decode"] * args.batch, "engine beside": both["engine"] * args.batch}
            beside_rows.setdefault(name, []).append(row)
            print(f"round {round_index + 1}, {name}: " + ", ".join(f"{k} {v:.0f}" for k, v in row.items())
                  + f" frames/s; shares {row['decode beside'] / alone:.2f} / {row['engine beside'] / engine_alone:.2f}",
                  flush=True)
        for name, (chosen, priority) in variants.items():
            use_variant(chosen, priority)
            result = end_to_end(engine, files, batch=args.batch, passes=args.passes, host_decode_share=0.0)
            row = {"files to boxes": result.frames_per_s, "engine alone": result.engine_frames_per_s,
                   "decode stage ms": result.stages_ms.get("decode")}
            e2e_rows.setdefault(name, []).append(row)
            print(f"round {round_index + 1}, end to end, {name}: {row}", flush=True)
            time.sleep(0.3)
    from pipeline_e2e import per_call_ms, summary
    one = {spec.name: torch.rand((1, *shape[1:]), device="cuda").to(getattr(torch, spec.dtype))}
    engine_b1 = summary(per_call_ms(lambda: ctx.run(one), 200, warmup=10), 1)["median_ms"]
    for name, chosen in (("torchvision", False), ("binding", True)):
        use_variant(chosen, 0)
        single = pipeline_module.Pipeline(engine, batch_size=1, overlap=False)
        frame = [read_frames(Path(args.images))[0]]
        latency = summary(per_call_ms(lambda: single.run(frame), 200, warmup=10), 1)
        print(f"batch 1, {name}: JPEG → boxes median {latency['median_ms']:.3f} ms, p99 {latency['p99_ms']:.3f}; "
              f"engine alone {engine_b1:.3f} ms; over it {latency['median_ms'] - engine_b1:.3f} ms", flush=True)
    use_variant(True, 0)
    print("| decoder | decode alone | decode beside | decode share | engine share |\n|---|---|---|---|---|")
    for name, rows in beside_rows.items():
        med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
        print(f"| {name} | {med['decode alone']:.0f} | {med['decode beside']:.0f} | "
              f"{med['decode beside'] / med['decode alone']:.2f} | {med['engine beside'] / med['engine alone']:.2f} |")
    print("| JPEG decode, preparation stream | files → boxes (each round) | engine alone |\n|---|---|---|")
    for name, rows in e2e_rows.items():
        rates = " / ".join(f"{r['files to boxes']:.0f}" for r in rows)
        print(f"| {name} | {rates} | {statistics.median(r['engine alone'] for r in rows):.0f} |")


if __name__ == "__main__":
    main()
