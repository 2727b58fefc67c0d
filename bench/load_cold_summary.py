"""A few lines from bench/load_cold.py's load_cold.json: each engine's key misses and, per run, its
load, first inference and kernel counts (what a device call prints).

    python bench/load_cold_summary.py $OUT/load_cold.json
"""
from __future__ import annotations

import json
import sys

FIELDS = ("import_s", "load_s", "first_inference_s", "load_plus_first_s", "kernels_compiled", "kernel_cache_hits",
          "installed", "host_modules_at_load_s", "host_modules_in_cache", "error")


def main(path: str) -> int:
    try:
        with open(path) as f:
            report = json.load(f)
    except OSError as exc:
        print("no load_cold.json:", exc)
        return 1
    for spec, engine in report["engines"].items():
        print(spec, "misses:", [m["name"] for m in engine.get("key_misses", [])][:8])
        built = engine.get("built", {}).get("embedded", {})
        print("  kernels", built.get("kernel_entries"), "launcher signatures", built.get("launcher_signatures"))
        for name, row in engine["runs"].items():
            print(" ", name, {k: row.get(k) for k in FIELDS})
            if (row.get("host_modules") or {}).get("note"):
                print("   ", row["host_modules"]["note"])
        for name, values in (engine.get("load_plus_first_s") or {}).items():
            print("  load + first inference,", name, values)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
