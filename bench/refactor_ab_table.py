"""bench/refactor_ab.sh's two sides set against each other: for every timing cache both sides wrote,
each layer's winner on each side and its time, and whether the winners are the same candidate; then
each engine's median time on both sides.

Tactic names may differ between the sides (a renaming refactor): candidates are matched by their
place in the layer's list of timed candidates, which a refactor that keeps behaviour keeps, and both
names are shown so that the match can be read.

    python bench/refactor_ab_table.py AB_DIR      # AB_DIR holds base/ and new/ (the unpacked tarball)
"""
from __future__ import annotations

import json
import sys
from pathlib import Path


def entries(path: Path) -> dict:
    data = json.loads(path.read_text())
    (device,) = data["devices"].values()
    return device["entries"]


def main() -> None:
    root = Path(sys.argv[1])
    lines, same, differ, unmatched = [], 0, 0, 0
    for base_file in sorted((root / "base").glob("timing_*.json")):
        new_file = root / "new" / base_file.name
        if not new_file.exists():
            lines.append(f"{base_file.name}: not written by the new side")
            continue
        base, new = entries(base_file), entries(new_file)
        lines += ["", f"## {base_file.stem}", "",
                  "| layer (signature, shortened) | base winner | new winner | same candidate | base ms | new ms | "
                  "candidates | the other's winner, each side (ms) |", "|---|---|---|---|---|---|---|---|"]
        for signature, b in base.items():
            n = new.get(signature)
            if n is None:
                unmatched += 1
                lines.append(f"| {signature[:60]} | {b['winner']} | (no such layer) | | | | |")
                continue
            b_order, n_order = list(b["timings_ms"]), list(n["timings_ms"])
            match = len(b_order) == len(n_order) and b_order.index(b["winner"]) == n_order.index(n["winner"])
            same += match
            differ += not match
            crossed = ""
            if not match and len(b_order) == len(n_order):
                # each side's time for the candidate the other side chose: a near tie is timing noise
                b_of_new = b["timings_ms"][b_order[n_order.index(n["winner"])]]
                n_of_base = n["timings_ms"][n_order[b_order.index(b["winner"])]]
                crossed = f"base {b_of_new:.4f} (+{b_of_new / b['timings_ms'][b['winner']] - 1:.1%}), " \
                          f"new {n_of_base:.4f} (+{n_of_base / n['timings_ms'][n['winner']] - 1:.1%})"
            lines.append(f"| {signature[:60]} | {b['winner']} | {n['winner']} | {'yes' if match else '**no**'} | "
                         f"{b['timings_ms'][b['winner']]:.4f} | {n['timings_ms'][n['winner']]:.4f} | "
                         f"{len(b_order)} / {len(n_order)} | {crossed} |")
    lines.insert(0, f"{same} layers chose the same candidate, {differ} another, {unmatched} unmatched")
    rows = []
    for side in ("base", "new"):
        table = json.loads((root / side / "table.json").read_text())
        for row in table["rows"]:
            for key in ("sartor_fp16", "sartor_int8", "eager_fp16_cuda_graph"):
                if key in row:
                    rows.append((row["model"], row["batch"], key, side, row[key]["median_ms"]))
    lines += ["", "| model | batch | engine | base ms | new ms | new ÷ base |", "|---|---|---|---|---|---|"]
    cells = {(m, b, k, s): v for m, b, k, s, v in rows}
    for m, b, k in sorted({(m, b, k) for m, b, k, _, _ in rows}):
        base_ms, new_ms = cells.get((m, b, k, "base")), cells.get((m, b, k, "new"))
        ratio = f"{new_ms / base_ms:.3f}" if base_ms and new_ms else "–"
        lines.append(f"| {m} | {b} | {k} | {base_ms} | {new_ms} | {ratio} |")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
