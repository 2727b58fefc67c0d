"""Two engines of one model layer by layer: the builder's time for each layer's chosen tactic in
each (`bench/profile_engine.py --layers-out`), side by side, where one engine gains on the other and
where it does not.

    python bench/compare_layers.py yolov8n_layers_fp16.json yolov8n_layers_int8.json [--rows 30]
    python bench/compare_layers.py /tmp/sartor_table/yolov8n_fp16_b1.plan /tmp/sartor_table/yolov8n_int8_b1.plan

Layers are matched by name (an INT8 engine's QConv is the FP16 engine's FusedConv of the same
node). Printed: the totals, the time by the second engine's tactic family, and the layers by how
much time the second engine spends beyond the first's divided by the target ratio (`--target`,
issue 33's 1.5 by default): the layers that keep the whole from the target, largest first. Builder
timings are of each layer alone, without launch gaps: a guide to where the time goes, not the
engine's figure (bench/h200_table.py's replay is).
"""
from __future__ import annotations

import argparse
import collections
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # sartor, for a .plan's header


def header_layers(header: dict) -> list[dict]:
    """An engine header's layers as `--layers-out` writes them: op, the chosen tactic's description, the
    fastest tactic the builder timed and its time (the builder picks the fastest it timed), every timing."""
    return [{"name": layer["name"], "op": layer.get("op"), "tactic": layer.get("tactic"),
             "fastest": min(timings, key=timings.get) if timings else None,
             "ms": min(timings.values()) if timings else None, "timed_ms": timings}
            for layer in header["layers"] for timings in [layer.get("tactic_timings_ms") or {}]]


def load_layers(path: Path) -> dict[str, dict]:
    """name → {"op", "tactic", "ms"} of the layers with a builder time, from a layers JSON or from an
    engine file's header (a `.plan`, as the table's builds keep them)."""
    if Path(path).suffix == ".plan":
        from sartor.runtime.engine_file import read_engine_file
        layers = header_layers(read_engine_file(path)[0])
    else:
        layers = json.loads(Path(path).read_text())
    return {layer["name"]: {"op": layer.get("op"), "tactic": layer.get("fastest") or "", "ms": layer["ms"]}
            for layer in layers if layer.get("ms") is not None}


def plan_layer_counts(path: Path) -> tuple[int, int]:
    """An engine file's layers: all of them, and those with a builder time."""
    from sartor.runtime.engine_file import read_engine_file
    layers = read_engine_file(path)[0]["layers"]
    return len(layers), sum(1 for layer in layers if layer.get("tactic_timings_ms"))


def family(tactic: str) -> str:
    """A tactic's family: its name's first word ("igemm" of "igemm.128x16x64.w8.s3.row-taps")."""
    return tactic.split(".", 1)[0] or "?"


def compare(first: dict[str, dict], second: dict[str, dict], target: float) -> dict:
    """Totals, the second engine's time by tactic family, and each shared layer's excess: the second
    engine's time less the first's divided by `target` (positive: the layer holds the whole back)."""
    shared = [name for name in first if name in second]
    rows = [{"name": name, "first_ms": first[name]["ms"], "second_ms": second[name]["ms"],
             "first_tactic": first[name]["tactic"], "second_tactic": second[name]["tactic"],
             "op": second[name]["op"], "excess_ms": second[name]["ms"] - first[name]["ms"] / target}
            for name in shared]
    families: dict[str, list] = collections.defaultdict(lambda: [0, 0.0, 0.0])
    for row in rows:
        entry = families[family(row["second_tactic"])]
        entry[0] += 1
        entry[1] += row["first_ms"]
        entry[2] += row["second_ms"]
    first_total = sum(row["first_ms"] for row in rows)
    second_total = sum(row["second_ms"] for row in rows)
    return {"first_ms": first_total, "second_ms": second_total,
            "ratio": first_total / second_total if second_total else float("nan"),
            "only_first": sorted(set(first) - set(second)), "only_second": sorted(set(second) - set(first)),
            "families": {name: {"layers": n, "first_ms": a, "second_ms": b} for name, (n, a, b) in families.items()},
            "rows": sorted(rows, key=lambda row: -row["excess_ms"])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("first", type=Path, help="layers JSON or .plan of the engine compared against (e.g. FP16)")
    parser.add_argument("second", type=Path, help="layers JSON or .plan of the engine compared (e.g. INT8)")
    parser.add_argument("--target", type=float, default=1.5, help="the speed ratio aimed at (first ÷ second)")
    parser.add_argument("--rows", type=int, default=30)
    args = parser.parse_args()
    first, second = load_layers(args.first), load_layers(args.second)
    result = compare(first, second, args.target)
    print(f"shared layers: {len(result['rows'])}; {args.first.name} {result['first_ms']:.3f} ms, "
          f"{args.second.name} {result['second_ms']:.3f} ms, ratio {result['ratio']:.2f} "
          f"(target {args.target}: {result['first_ms'] / args.target:.3f} ms)")
    for side, layers in (("only_first", first), ("only_second", second)):
        if result[side]:  # layers one engine runs that the other does not (a chain, or its two layers)
            print(f"{side}: " + ", ".join(f"{name} {layers[name]['ms']:.4f} ms" for name in result[side]))
    if args.first.suffix == ".plan" and args.second.suffix == ".plan":
        print("layers in each engine, all and with a builder time (the untimed run one tactic):",
              *(f"{path.name} {counts[0]} / {counts[1]}" for path in (args.first, args.second)
                for counts in [plan_layer_counts(path)]))
    print("== by the second engine's tactic family (layers, first ms, second ms, ratio)")
    for name, entry in sorted(result["families"].items(), key=lambda kv: -kv[1]["second_ms"]):
        ratio = entry["first_ms"] / entry["second_ms"] if entry["second_ms"] else float("nan")
        print(f"  {name:16s} {entry['layers']:4d} {entry['first_ms']:8.4f} {entry['second_ms']:8.4f} {ratio:6.2f}")
    print(f"== layers by excess over first / {args.target} (ms: first, second, excess; tactics)")
    for row in result["rows"][:args.rows]:
        print(f"  {row['first_ms']:7.4f} {row['second_ms']:7.4f} {row['excess_ms']:+8.4f}  {row['name'][:44]:44s} "
              f"{row['first_tactic'][:36]} | {row['second_tactic'][:48]}")


if __name__ == "__main__":
    main()
