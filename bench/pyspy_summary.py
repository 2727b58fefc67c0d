"""Summarise py-spy's raw stacks (`py-spy record --threads --format raw`) per role: samples a
thread was running (py-spy leaves idle threads out by default), and the functions with the most
samples, inclusive and at the top of the stack. Used on the device machine, where the raw file is
too large to bring back (issue 30: which thread's Python fills the period of JPEG files → boxes).
Stacks of the start (imports, graph capture, decoders made) are left out, and each stack is put to
the Pipeline's role it runs (a pool's threads come anew each pass, under names py-spy mixes up).

    python bench/pyspy_summary.py RAW.txt [--top 25]
"""
from __future__ import annotations

import argparse
import collections
import re


def thread_of(frame: str) -> str | None:
    """The thread's name of a stack's leading element (py-spy writes `thread (0x…)`, with the name
    after it when it knows it), "" for its `process …` element, None for a Python frame."""
    if frame.startswith("process"):
        return ""
    if not frame.startswith("thread"):
        return None
    quoted = re.search(r'"([^"]+)"', frame)
    named = quoted.group(1) if quoted else frame.split(")", 1)[-1].strip(" :") or frame
    return re.sub(r"_\d+$", "", named)  # sartor-pipeline_0 and _1 together


# A stack holding one of these is the process's start, not its steady state.
START = ("<frozen importlib", "ExecutionContext._capture (", "_batched_decoder.<locals>.make", "_prepare_constant",
         "load (sartor/runtime/engine.py")
# The role of a stack holding each frame, the first found.
ROLES = (("Pipeline._prepare (", "worker (prepare)"), ("_read (sartor/pipeline/read_ahead", "reader"),
         ("Pipeline._launch (", "calling thread: launch"), ("Pipeline._finish (", "calling thread: finish"),
         ("Pipeline.stream (", "calling thread: other"))


def role_of(frames: list[str], thread: str) -> str:
    for marker, role in ROLES:
        if any(frame.startswith(marker) for frame in frames):
            return role
    return thread


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("raw")
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args()
    totals: collections.Counter = collections.Counter()
    inclusive: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    leaves: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for line in open(args.raw, encoding="utf-8", errors="replace"):
        stack, _, count = line.rstrip("\n").rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames = stack.split(";")
        thread = None
        while frames and (name := thread_of(frames[0])) is not None:
            thread = name or thread
            frames = frames[1:]
        if any(marker in frame for frame in frames for marker in START):
            continue
        thread = role_of(frames, thread or "?")
        n = int(count)
        totals[thread] += n
        for frame in set(frames):
            inclusive[thread][frame] += n
        if frames:
            leaves[thread][frames[-1]] += n
    every = sum(totals.values())
    print(f"{every} samples")
    for thread, n in totals.most_common():
        print(f"== {thread}: {n} samples ({n / every:.1%})")
        print("   inclusive:")
        for frame, k in inclusive[thread].most_common(args.top):
            print(f"     {k / n:6.1%}  {frame}")
        print("   top of stack:")
        for frame, k in leaves[thread].most_common(args.top):
            print(f"     {k / n:6.1%}  {frame}")


if __name__ == "__main__":
    main()
