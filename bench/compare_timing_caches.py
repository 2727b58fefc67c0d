"""Two timing caches of the same model side by side, layer by layer: each layer's winner and its
time in each, and the difference (the `int8ab` routine stage writes one for an older commit's code and
one for this checkout's, built on one machine).

    python bench/compare_timing_caches.py base/timing_resnet50_int8_b256.json new/timing_resnet50_int8_b256.json

Layers are matched by signature. Each cache is expected to hold one device. Times are the winners'
own, one layer each: a signature that occurs several times in the network counts once.
"""
from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sartor.tactics.timing_cache import TimingCache  # noqa: E402

SHAPES = re.compile(r"(\w+)=\w+\[([0-9x]+)\]")
# A signature's parts that name how a layer's epilogue works, not which layer it is: the same layer
# on both sides, its winner marked.
EPILOGUE_PARTS = {" sums=decoded": " (sums decoded)"}


def winners(path: Path) -> dict[str, tuple[str, float]]:
    """{signature less EPILOGUE_PARTS: (winner, marked by them, its ms)} of the cache's one device."""
    devices = TimingCache(path).devices
    if len(devices) != 1:
        raise SystemExit(f"{path}: {len(devices)} devices in the cache, expected one")
    entries = next(iter(devices.values()))["entries"]
    found = {}
    for signature, entry in entries.items():
        winner = entry["winner"]
        for part, mark in EPILOGUE_PARTS.items():
            if part in signature:
                signature, winner = signature.replace(part, ""), winner + mark
        found[signature] = (winner, entry["timings_ms"][entry["winner"]])
    return found


def short_name(signature: str) -> str:
    """The op, its input and weight shapes, strides, and whether a residual or a projection is added:
    'QConv x 256x64x56x56 w 256x64x1x1 strides=1,1 + residual'."""
    shapes = " ".join(f"{name} {shape}" for name, shape in SHAPES.findall(signature)[:2])
    strides = re.search(r"strides=\S+", signature)
    added = ("+ projection" if " projection=" in signature
             else "+ residual" if re.search(r"residual=(?!none\b)", signature) else "")
    return " ".join(filter(None, [signature.split()[0], shapes, strides.group(0) if strides else "", added]))


def compare(base: dict, new: dict) -> tuple[list[tuple], float, float]:
    """Rows (layer, base winner, base ms, new winner, new ms) for the layers in both caches, slowest
    first in the base, and the two sums over those layers."""
    rows = [(short_name(signature), *base[signature], *new[signature]) for signature in base if signature in new]
    rows.sort(key=lambda row: -row[2])
    return rows, sum(row[2] for row in rows), sum(row[4] for row in rows)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("base", type=Path)
    parser.add_argument("new", type=Path)
    args = parser.parse_args(argv)
    base, new = winners(args.base), winners(args.new)
    rows, base_ms, new_ms = compare(base, new)
    print("| layer | base winner | ms | new winner | ms | new ÷ base |")
    print("|---|---|---|---|---|---|")
    for layer, base_winner, base_time, new_winner, new_time in rows:
        print(f"| {layer} | {base_winner} | {base_time:.4f} | {new_winner} | {new_time:.4f} | "
              f"{new_time / base_time:.3f} |")
    print(f"\n{len(rows)} layers in both: {base_ms:.4f} → {new_ms:.4f} ms (each signature once)")
    for label, only in (("base", base.keys() - new.keys()), ("new", new.keys() - base.keys())):
        if only:
            print(f"{len(only)} only in {label}: " + "; ".join(sorted(map(short_name, only))))


if __name__ == "__main__":
    main()
