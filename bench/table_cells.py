"""Reads bench/h200_table.py's output on stdin and prints each timed cell as one line the moment it
is done (model, batch, engine, median ms with the input copied / in the engine's buffer, build s, the
auxiliary streams and PDL the build chose), and its table lines: a call cut off mid-run still shows
every cell it finished."""
from __future__ import annotations

import json
import sys

for line in sys.stdin:
    line = line.rstrip("\n")
    if line.startswith("|") or line.startswith("INT8 engines"):
        print(line, flush=True)
        continue
    if not line.startswith("{"):
        if "Error" in line or "faulted" in line:  # a cell's failure: its last traceback line
            print(line[:300], flush=True)
        continue
    try:
        cell = json.loads(line)
    except json.JSONDecodeError:
        continue
    if "model" in cell:  # a finished row: the cells above were its
        print(f"row done: {cell['model']} batch {cell['batch']}", flush=True)
        continue
    for key, timing in cell.items():
        if not isinstance(timing, dict) or "median_ms" not in timing:
            print(f"cell {key}: {str(timing)[:200]}", flush=True)
            continue
        bound = timing.get("bound_input", {}).get("median_ms")
        extra = {k: timing[k] for k in ("build_cold_s", "max_abs_diff") if k in timing}
        # What the build chose that the engine runs with: its auxiliary streams (and each count's time)
        # and whether it kept programmatic dependent launch.
        streams = timing.get("aux_streams_chosen") or {}
        if streams:
            extra["aux_streams"] = f"{streams.get('streams')} of {streams.get('totals_ms')}"
        if timing.get("pdl_check"):
            extra["pdl_kept"] = timing["pdl_check"].get("kept")
        print(f"cell {key}: {timing['median_ms']:.3f} / {bound if bound is None else f'{bound:.3f}'} ms {extra}",
              flush=True)
