"""The floor under a batch-1 engine on this GPU: CUDA graphs of N minimal Triton kernels in a chain,
replayed, in µs a kernel. Each program of a kernel reads and writes `bytes` of one buffer that every
kernel of the chain touches, so no kernel may start its work before the last has finished, as in
an engine. With `--pdl`, each kernel is also launched with programmatic dependent launch and waits
for its predecessor in the kernel (kernels/common/pdl.py), as sartor's INT8 layers do.

An engine of K kernels cannot replay in less than about K times this figure, however fast each
kernel's own work. Issue 33's batch-1 bar asks INT8 for 1.3× FP16 where both engines are chains of
short kernels (their counts and times: BENCHMARKS.md, "INT8 against FP16 on detectors"). So this
floor says how much of each kernel's time any kernel pays, and how much a kernel could still gain
by its own work.

    PYTHONPATH=. python bench/launch_floor.py [--kernels 1,84,97] [--programs 1,132] [--bytes 16,4096]
        [--pdl] [--constant-bytes 16384] [--replays 200] [--out DIR]

`--constant-bytes N` also times chains whose programs read N bytes that no kernel writes, as a
weight tile, after their wait and (with --pdl) before it: whether loading the constants while the
previous kernel ends, as sartor's resident kernels now do (decision 0055), shortens a chain.
"""
from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sartor.kernels.common.pdl import await_previous_kernel, launch_options, pdl_available  # noqa: E402
from sartor.kernels.pointwise.epilogue import triton  # noqa: E402
from sartor.tactics.select import timing_samples_ms  # noqa: E402

if triton is not None:
    import triton.language as tl

    @triton.jit
    def _chain_step_kernel(x_ptr, c_ptr, BLOCK: tl.constexpr, PDL: tl.constexpr, CONSTANT: tl.constexpr,
                           CONSTANT_EARLY: tl.constexpr):
        """Adds one to the program's BLOCK int32 words: a kernel that needs its predecessor's result.
        With CONSTANT, each program also reads CONSTANT int8 bytes of a buffer no kernel writes (a
        weight tile), before its wait for the predecessor (CONSTANT_EARLY) or after it."""
        if CONSTANT > 0 and CONSTANT_EARLY:
            weight = tl.load(c_ptr + tl.program_id(0) * CONSTANT + tl.arange(0, CONSTANT))
        await_previous_kernel(PDL)
        if CONSTANT > 0 and not CONSTANT_EARLY:
            weight = tl.load(c_ptr + tl.program_id(0) * CONSTANT + tl.arange(0, CONSTANT))
        offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        step = tl.load(x_ptr + offsets) + 1
        if CONSTANT > 0:  # the weight is zeros: used, so that it is loaded, and adds nothing
            step += (tl.sum(weight.to(tl.int32)) == 12345).to(tl.int32)
        tl.store(x_ptr + offsets, step)


def chain(buffer: torch.Tensor, kernels: int, programs: int, pdl: bool = False, constant: torch.Tensor | None = None,
          early: bool = False) -> None:
    """`kernels` launches in a row over `buffer` (programs × words, int32): each word gains `kernels`.
    `constant`: zeros, programs × bytes (int8), each program reading its row before (`early`) or
    after its wait."""
    words = buffer.numel() // programs
    size = constant.numel() // programs if constant is not None else 0
    for _ in range(kernels):
        _chain_step_kernel[(programs,)](buffer, constant if constant is not None else buffer, BLOCK=words, PDL=pdl,
                                        CONSTANT=size, CONSTANT_EARLY=early, **launch_options(pdl))


def replay_ms(kernels: int, programs: int, words: int, pdl: bool, replays: int, warmup: int = 20,
              constant_bytes: int = 0, early: bool = False) -> list[float]:
    """Milliseconds of each of `replays` replays of one CUDA graph holding the chain."""
    buffer = torch.zeros(programs * words, dtype=torch.int32, device="cuda")
    constant = torch.zeros(programs * constant_bytes, dtype=torch.int8, device="cuda") if constant_bytes else None
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        chain(buffer, 1, programs, pdl, constant, early)  # compiled outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        chain(buffer, kernels, programs, pdl, constant, early)
    times = timing_samples_ms(graph.replay, buffer.device, replays, warmup)  # CUDA events around each replay
    before = int(buffer[0].item())
    graph.replay()
    torch.cuda.synchronize()
    if int(buffer[0].item()) - before != kernels:
        raise RuntimeError(f"a replay of {kernels} kernels added {int(buffer[0].item()) - before}, not {kernels}")
    return times


def numbers(text: str) -> list[int]:
    values = [int(v) for v in text.split(",") if v.strip()]
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"{text!r}: comma-separated whole numbers from 1")
    return values


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kernels", type=numbers, default=[1, 84, 97], help="chain lengths (84 and 97: YOLOv8n's "
                        "INT8 and FP16 engines' kernels at batch 1, BENCHMARKS.md)")
    parser.add_argument("--programs", type=numbers, default=[1, 132], help="programs a kernel (132: an H200's SMs)")
    parser.add_argument("--bytes", type=numbers, default=[16, 4096],
                        help="bytes each program reads and writes (multiples of 4, powers of two)")
    parser.add_argument("--pdl", action="store_true", help="also time every chain with programmatic dependent launch")
    parser.add_argument("--constant-bytes", type=int, default=0, metavar="N",
                        help="also time each chain whose programs read N bytes of a buffer no kernel writes (a "
                             "weight tile: a power of two), after their wait and, with --pdl, before it")
    parser.add_argument("--replays", type=int, default=200)
    parser.add_argument("--out", type=Path, default=None, help="write launch_floor.json here")
    args = parser.parse_args(argv)
    if args.constant_bytes < 0 or args.constant_bytes & (args.constant_bytes - 1):
        parser.error(f"--constant-bytes {args.constant_bytes}: a power of two (0: none)")
    for size in args.bytes:
        if size % 4 or (size // 4) & (size // 4 - 1):
            parser.error(f"--bytes {size}: each program's words must be a power of two (a multiple of 4 bytes)")
    if triton is None or not torch.cuda.is_available():
        parser.error("needs a CUDA GPU and Triton: the floor is the GPU's")
    modes = [False, True] if args.pdl else [False]
    if args.pdl and not pdl_available("cuda"):
        parser.error("--pdl: this GPU or Triton has no programmatic dependent launch (compute capability 9.0+)")
    rows = []
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}, "
          f"{args.replays} replays, median")
    # (constant bytes, read before the wait): none; then, with --constant-bytes, after it, and with
    # PDL before it (without PDL there is no wait to read before).
    constants = [(0, False)] + ([(args.constant_bytes, False), (args.constant_bytes, True)]
                                if args.constant_bytes else [])
    print("| kernels | programs | bytes a program | constant bytes | PDL | ms a replay | µs a kernel |")
    print("|---|---|---|---|---|---|---|")
    for kernels, programs, size, pdl, (constant, early) in itertools.product(args.kernels, args.programs, args.bytes,
                                                                             modes, constants):
        if early and not pdl:
            continue
        median = statistics.median(replay_ms(kernels, programs, size // 4, pdl, args.replays,
                                             constant_bytes=constant, early=early))
        rows.append({"kernels": kernels, "programs": programs, "bytes": size, "constant_bytes": constant,
                     "constant_before_wait": early, "pdl": pdl, "replay_ms": median,
                     "us_per_kernel": median * 1e3 / kernels})
        where = f"{constant} ({'before' if early else 'after'} the wait)" if constant else "–"
        print(f"| {kernels} | {programs} | {size} | {where} | {'yes' if pdl else 'no'} | {median:.4f} | "
              f"{median * 1e3 / kernels:.2f} |", flush=True)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "launch_floor.json").write_text(json.dumps({
            "device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
            "replays": args.replays, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
