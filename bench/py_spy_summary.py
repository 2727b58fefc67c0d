"""Where the samples of a `py-spy record --format raw --threads` file went: by thread, by the function
a sample was in (self), and by each sartor function on the stack (inclusive). With `--gil`, py-spy keeps
only the samples of the thread holding the interpreter lock, so the shares are who held it; with
`--idle`, every thread's every sample, so a thread's innermost frames say where it waits.
`--skip` drops the samples of start-up (imports, decoders being made) by a frame's name. Threads
are told apart by their job, their outermost sartor function: py-spy may name a thread after an
earlier one of the same id, so its names are not used.

    python bench/py_spy_summary.py RAW.txt [--top 30] [--role Pipeline._prepare] [--skip NAME,...]
"""
from __future__ import annotations

import argparse
import re
from collections import Counter
from pathlib import Path

FRAME = re.compile(r"^(?P<function>.*?) \((?P<file>[^()]*?)(?::\d+)?\)$")


def frames_of(stack: str) -> list[tuple[str, str]]:
    """(function, file) of each frame, outermost first; the thread's marker frame dropped."""
    out = []
    for frame in stack.split(";"):
        match = FRAME.match(frame)
        if match and not frame.startswith("thread ("):
            out.append((match["function"], match["file"]))
    return out


def short(function: str, file: str) -> str:
    marker = file.rfind("sartor/")
    where = file[marker:] if marker >= 0 else Path(file).name
    return f"{function} ({where})"


def role(frames: list[tuple[str, str]]) -> str:
    """The thread's job: its outermost sartor function, or its outermost function."""
    for function, file in frames:
        if "sartor/" in file:
            return short(function, file)
    return short(*frames[0]) if frames else "?"


def innermost(frames: list[tuple[str, str]]) -> str:
    """The innermost frame, and the innermost sartor frame around it where that is another."""
    leaf = short(*frames[-1])
    inside = next((short(f, p) for f, p in reversed(frames) if "sartor/" in p), None)
    return leaf if inside in (None, leaf) else f"{leaf} in {inside}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("raw")
    parser.add_argument("--top", type=int, default=30)
    parser.add_argument("--role", default="", help="only samples whose outermost sartor function's name holds this")
    parser.add_argument("--skip", default="_call_with_frames_removed,NvjpegBatched.__init__",
                        help="drop samples with a frame of one of these names")
    args = parser.parse_args()
    skipped = [name for name in args.skip.split(",") if name]
    threads, leaves, inclusive, roles = Counter(), Counter(), Counter(), Counter()
    total = 0
    for line in Path(args.raw).read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        frames = frames_of(stack)
        job = role(frames)
        if args.role not in job or any(f"{name} (" in stack for name in skipped):
            continue
        total += n
        threads[stack.split(";", 1)[0]] += n
        roles[job] += n
        if frames:
            leaves[innermost(frames)] += n
        for name in {short(f, p) for f, p in frames if "sartor/" in p}:
            inclusive[name] += n
    print(f"{total} samples")
    for title, counter in (("by thread (py-spy's names)", threads), ("by job (the outermost sartor function)", roles),
                           ("self (the innermost frame)", leaves), ("inclusive, sartor functions", inclusive)):
        print(f"\n{title}:")
        for name, n in counter.most_common(args.top):
            print(f"  {n / total:6.1%}  {n:7d}  {name}")


if __name__ == "__main__":
    main()
