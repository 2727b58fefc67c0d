"""Named resident tiles timed on ResNet-50's expanding 1×1 layers at batch 256, beside a copy: a
quick answer, in well under a minute of device time, to whether a tile not yet among the builder's
candidates is worth adding (the full probe, bench/int8_kernel_probe.py, takes about two minutes).

Each layer runs as the engine runs it: INT8 codes in, bias, residual of INT8 codes, ReLU, INT8 codes
out. Rows go to $OUT/resident_tiles_probe.json as they are timed, so a run cut short keeps them.

    PYTHONPATH=. python bench/resident_tiles_probe.py --out $OUT --layers layer3.conv3 \
        --tiles resident_64x64_t8_w4_s3_c_g,resident_64x64_t8_w4_s2_c_g
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from int8_kernel_probe import conv_case, median_ms  # noqa: E402
from sartor.kernels.resident_gemm import ResidentTile, resident_gemm  # noqa: E402

# (input channels, output channels, size): the expanding 1×1 layers with a residual.
LAYERS = {"layer1.conv3": (64, 256, 56), "layer2.conv3": (128, 512, 28), "layer3.conv3": (256, 1024, 14)}


def parse_tiles(text: str) -> list[ResidentTile]:
    tiles = [ResidentTile.parse(name) for name in text.split(",")]
    if None in tiles:
        raise SystemExit(f"--tiles: not resident tactics: {text}")
    return tiles


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.environ.get("OUT", "out"))
    parser.add_argument("--layers", default="layer3.conv3,layer1.conv3")
    parser.add_argument("--tiles", type=parse_tiles, required=True, help="comma-separated resident tactics")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--reps", type=int, default=20)
    args = parser.parse_args()
    layers = args.layers.split(",")
    unknown = [name for name in layers if name not in LAYERS]
    if unknown:
        raise SystemExit(f"--layers: unknown {unknown}; known: {sorted(LAYERS)}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []

    def record(**row) -> None:
        rows.append(row)
        print(json.dumps(row), flush=True)
        (out / "resident_tiles_probe.json").write_text(json.dumps(rows, indent=1))

    source = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    target = torch.empty_like(source)
    ms = median_ms(lambda: target.copy_(source), args.reps)
    record(name="copy 256 MiB", ms=round(ms, 4), tb_s=round(2 * source.numel() / ms / 1e9, 2))
    for layer in layers:
        cin, cout, hw = LAYERS[layer]
        case = conv_case(args.batch, cin, cout, hw, 1, 1)
        traffic = case["x"].numel() + 2 * case["residual"].numel()
        for tile in args.tiles:
            start = time.perf_counter()
            try:
                ms = median_ms(lambda: resident_gemm(case["x"], case["w"], case["bias"], tile,
                                                     dequant_scale=case["scale"], residual=case["residual"],
                                                     activation="Relu", residual_scale=0.01, output_inv_scale=20.0),
                               args.reps)
            except Exception as exc:  # noqa: BLE001 - one failing tile must not hide the others
                traceback.print_exc()
                record(layer=layer, tile=tile.name, error=f"{type(exc).__name__}: {exc}"[:300])
                continue
            record(layer=layer, tile=tile.name, ms=round(ms, 4), tb_s=round(traffic / ms / 1e9, 2),
                   tops=round(2 * case["macs"] / ms / 1e9, 1), seconds=round(time.perf_counter() - start, 1))


if __name__ == "__main__":
    main()
