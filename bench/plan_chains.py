"""Each engine file's convolution chains: whether the build's engine check kept them (with its timings per
profile), how many mixed (INT8 then float) chains the engine runs, the chain tiles it runs them on, and the
build log's `chains:` line.

    PYTHONPATH=. python bench/plan_chains.py /tmp/sartor_table/*.plan
"""
from __future__ import annotations

import sys
from collections import Counter

from sartor.runtime.engine_file import read_engine_file


def chains_line(path: str, width: int = 900) -> str:
    header = read_engine_file(path)[0]
    check = header.get("chains_check") or {}
    chains = [node.get("attrs") or {} for node in (header.get("graph") or {}).get("nodes", [])
              if node.get("op") == "ConvChain"]
    mixed = [attrs for attrs in chains if "second_layers" in attrs]
    tiles = ", ".join(f"{tile} ×{count}" for tile, count in Counter(attrs.get("tactic") for attrs in chains).items())
    log = next((line for line in header.get("build_log", []) if line.startswith("chains:")), "no chains line")
    halves = " | halves " + "; ".join(f"{entry['chains']} {entry['profiles']}" for entry in check["subsets"]) \
        + f" | kept {check.get('kept_chains')}" if check.get("subsets") else ""
    return (f"{path.rsplit('/', 1)[-1]} | chains kept {check.get('kept')} {check.get('profiles')}{halves} | mixed "
            f"chains in the engine: {len(mixed)} | tiles: {tiles or 'none'} | {log[:width]}")


if __name__ == "__main__":
    for path in sys.argv[1:]:
        print(chains_line(path))
