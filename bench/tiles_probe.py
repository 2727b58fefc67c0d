"""Named INT8 tiles (resident `resident_…`, TMA-fed `gemm_tma_…` or `tma_…` tactics) timed on
ResNet-50's expanding 1×1 layers and layer1's 3×3 at batch 256, beside a copy: a quick answer, in
a minute or two of device time, to whether a tile not yet among the builder's candidates is worth
adding (the full probe, bench/int8_kernel_probe.py, takes longer and times fixed lists). A tile
whose kernel does not apply to a layer is recorded with its error.

Each layer runs as the engine runs it: INT8 codes in, bias, the residual of INT8 codes where the
layer has one, ReLU, INT8 codes out. Rows go to $OUT/tiles_probe.json as they are timed, so a run
cut short keeps them.

    PYTHONPATH=. python bench/tiles_probe.py --out $OUT --layers layer3.conv3 \
        --tiles resident.64x64.t8.w4.s3.cols-loaded.grouped,gemm_tma.128x128x128.w8.s3.halves.persistent-flat
"""
from __future__ import annotations

import argparse
import os
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from int8_kernel_probe import conv_case, median_ms, row_recorder  # noqa: E402
from sartor.kernels.conv.tma import TmaTile, conv_tma  # noqa: E402
from sartor.kernels.gemm.tma import GemmTmaTile, fit_to_k, gemm_tma  # noqa: E402
from sartor.kernels.registry import TacticNameError, tactic_for  # noqa: E402
from sartor.kernels.gemm.resident import ResidentTile, resident_gemm  # noqa: E402

# (input channels, output channels, size, kernel, residual): the expanding 1×1 layers, and layer1's 3×3.
LAYERS = {"layer1.conv3": (64, 256, 56, 1, True), "layer2.conv3": (128, 512, 28, 1, True),
          "layer3.conv3": (256, 1024, 14, 1, True), "layer1.conv2": (64, 64, 56, 3, False)}
Tile = ResidentTile | GemmTmaTile | TmaTile


def parse_tiles(text: str) -> list[Tile]:
    try:
        tiles = [tactic_for(name) for name in text.split(",")]
    except TacticNameError as error:
        raise SystemExit(f"--tiles: {error}") from None
    if not all(isinstance(tile, (ResidentTile, GemmTmaTile, TmaTile)) for tile in tiles):
        raise SystemExit(f"--tiles: not resident, gemm_tma or tma tactics: {text}")
    return tiles


def run_tile(tile: Tile, case: dict, residual: bool):
    """The layer through this tile's kernel, as the builder would run it (a gemm_tma tile fitted to
    the layer's K)."""
    epilogue = dict(dequant_scale=case["scale"], residual=case["residual"] if residual else None, activation="Relu",
                    residual_scale=0.01, output_inv_scale=20.0)
    if isinstance(tile, ResidentTile):
        if case["geometry"].kernel != (1, 1):  # resident_gemm takes the layer as a 1×1 one without asking
            raise ValueError(f"{tile.name}: resident tiles run 1×1 layers only")
        return lambda: resident_gemm(case["x"], case["w"], case["bias"], tile, **epilogue)
    if isinstance(tile, TmaTile):
        return lambda: conv_tma(case["x"], case["w"], case["bias"], case["geometry"], tile, **epilogue)
    fitted = fit_to_k(tile, case["x"].shape[1])
    return lambda: gemm_tma(case["x"], case["w"], case["bias"], case["geometry"], fitted, **epilogue)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.environ.get("OUT", "out"))
    parser.add_argument("--layers", default="layer3.conv3,layer1.conv3")
    parser.add_argument("--tiles", type=parse_tiles, required=True,
                        help="comma-separated resident_… or gemm_tma_… tactics")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--reps", type=int, default=20)
    args = parser.parse_args()
    layers = args.layers.split(",")
    unknown = [name for name in layers if name not in LAYERS]
    if unknown:
        raise SystemExit(f"--layers: unknown {unknown}; known: {sorted(LAYERS)}")
    record = row_recorder(Path(args.out) / "tiles_probe.json")

    source = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    target = torch.empty_like(source)
    ms = median_ms(lambda: target.copy_(source), args.reps)
    record(name="copy 256 MiB", ms=round(ms, 4), tb_s=round(2 * source.numel() / ms / 1e9, 2))
    for layer in layers:
        cin, cout, hw, kernel, residual = LAYERS[layer]
        case = conv_case(args.batch, cin, cout, hw, kernel, 1)
        traffic = case["x"].numel() + (2 if residual else 1) * case["residual"].numel()
        for tile in args.tiles:
            start = time.perf_counter()
            try:
                ms = median_ms(run_tile(tile, case, residual), args.reps)
            except Exception as exc:  # noqa: BLE001 - one failing tile must not hide the others
                if not isinstance(exc, ValueError):  # a ValueError: the kernel does not apply to the layer
                    traceback.print_exc()
                record(layer=layer, tile=tile.name, error=f"{type(exc).__name__}: {exc}"[:300])
                continue
            record(layer=layer, tile=tile.name, ms=round(ms, 4), tb_s=round(traffic / ms / 1e9, 2),
                   tops=round(2 * case["macs"] / ms / 1e9, 1), seconds=round(time.perf_counter() - start, 1))


if __name__ == "__main__":
    main()
