"""Which of an engine's kernels move global memory in pieces narrower than 16 bytes (issues 33 and 30).

An engine file carries the cubins of the Triton kernels it runs (runtime/kernel_store.py). This
disassembles each with the cuobjdump of Triton's wheel and counts its global loads, stores and
asynchronous copies by width: a channel count or stride Triton could not prove a multiple of 16
splits vector accesses into words or bytes (the SPPF pool's 24 words, a Split half 8 bytes off a
16-byte boundary: decisions 0061 and kernel-told-alignment). Counts are of instructions in the
binary, not of executions; a kernel with a loop counts its body once. Needs no GPU, so an engine
built on the device can be audited here too.

    python bench/engine_sass_audit.py ENGINE.plan [--rows 40] [--all]
"""
from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sartor.runtime.engine_file import read_engine_file  # noqa: E402
from sartor.runtime.kernel_store import KernelEntry, split_kernel_tensors, unpack_kernels  # noqa: E402

# Global memory instructions: loads, stores, asynchronous copies into shared memory (cp.async), TMA.
MEMORY_OPS = ("LDG", "STG", "LDGSTS", "UTMALDG", "UTMASTG")
SASS_OPCODE = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)")
WIDTH_SUFFIX = {"U8": 8, "S8": 8, "U16": 16, "S16": 16, "64": 64, "128": 128}
NARROW_BITS = 32  # a word or less: what a 16-byte vector access was split into


def cuobjdump() -> Path:
    import triton
    return Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"


def sass_of(cubin: bytes) -> str:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "kernel.cubin"
        path.write_bytes(cubin)
        return subprocess.run([str(cuobjdump()), "-sass", str(path)], capture_output=True, text=True,
                              check=True).stdout


def memory_widths(sass: str) -> Counter:
    """(instruction, bits) → count for the global memory instructions of a disassembly; TMA ones
    as bits 0 (their width is the descriptor's box)."""
    counts: Counter = Counter()
    for opcode in SASS_OPCODE.findall(sass):
        base, *suffixes = opcode.split(".")
        if base not in MEMORY_OPS:
            continue
        bits = 0 if base.startswith("UTMA") else next(
            (WIDTH_SUFFIX[s] for s in reversed(suffixes) if s in WIDTH_SUFFIX), 32)
        counts[(base, bits)] += 1
    return counts


def audit_entry(entry: KernelEntry) -> dict:
    cubin = next((data for name, data in entry.files.items() if name.endswith(".cubin")), None)
    widths = memory_widths(sass_of(cubin)) if cubin is not None else Counter()
    narrow = sum(n for (op, bits), n in widths.items() if 0 < bits <= NARROW_BITS)
    return {"name": entry.name, "key": entry.key, "widths": widths, "narrow": narrow,
            "vector": sum(n for (op, bits), n in widths.items() if bits > NARROW_BITS)}


def describe(widths: Counter) -> str:
    return ", ".join(f"{n} {op}{'.' + str(bits) if bits else ''}" for (op, bits), n in sorted(widths.items()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("engine")
    parser.add_argument("--rows", type=int, default=40)
    parser.add_argument("--all", action="store_true", help="list kernels without narrow accesses too")
    args = parser.parse_args()
    header, tensors = read_engine_file(args.engine)
    _, kernel_tensors = split_kernel_tensors(tensors)
    entries, problems = unpack_kernels(header.get("kernels"), kernel_tensors)
    for problem in problems:
        print(f"note: {problem}")
    if not entries:
        raise SystemExit(f"{args.engine}: carries no kernels (a CPU engine, or built without them)")
    rows = sorted((audit_entry(e) for e in entries), key=lambda r: (-r["narrow"], r["name"]))
    print(f"{len(rows)} kernels; {sum(r['narrow'] > 0 for r in rows)} with global accesses of {NARROW_BITS} bits "
          f"or less (instructions in the binary, by instruction and bits)")
    for row in rows[:args.rows]:
        if row["narrow"] or args.all:
            print(f"  {row['narrow']:5d} narrow {row['vector']:5d} wider  {row['name'][:48]:48s} {row['key'][:10]}  "
                  f"{describe(row['widths'])}")


if __name__ == "__main__":
    main()
