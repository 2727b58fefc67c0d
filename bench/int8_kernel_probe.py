"""Where does an INT8 convolution's time go? One device call that times sartor's implicit-GEMM
kernel on ResNet-50's batch-256 shapes, tile by tile and with parts of its epilogue switched off,
beside the machine's copy bandwidth and torch's `_int_mm` on the same GEMM.

Issue 5's profile (docs/benchmarks-history, session 13) found INT8 layers far from both the tensor cores'
and the memory's limits: layer1's 1×1 conv3 (C 64 → 256, residual, ReLU, INT8 out) at 0.44 ms is
about 60 TOPS and 1 TB/s, and the stem's im2col at 2.6 ms. This probe separates the kernels' parts
(tiles, epilogue, stem tactics) so the next change is chosen by measurement.

    PYTHONPATH=. python bench/int8_kernel_probe.py --out $OUT [--batch 256] [--reps 20]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import traceback
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sartor.kernels.conv.igemm import _INT8_TILES, ConvGeometry, TileConfig, conv_igemm, pack_weight  # noqa: E402
from sartor.kernels.pool.max_pool import POOL_TILES, max_pool_nhwc  # noqa: E402
from sartor.kernels.conv.im2col import im2col_codes  # noqa: E402
from sartor.kernels.window.pixel_pack import pack_pixels  # noqa: E402
from sartor.kernels.conv.tma import TMA_TILES, conv_tma  # noqa: E402
from sartor.kernels.gemm.resident import (MAX_RESIDENT_K, Projection, ResidentTile, program_tiles,  # noqa: E402
                                          resident_gemm, resident_tactics)
from sartor.ops.quantized import FEW_ROWS_TILE  # noqa: E402
from sartor.kernels.window.resident import window_resident_conv, window_resident_tiles  # noqa: E402
from sartor.ops.quantized_window import window_tactic  # noqa: E402
from sartor.ops.quantized_library import INT_MM, library_qlayer  # noqa: E402
from sartor.tactics.select import time_ms  # noqa: E402
from sartor.ops.quantized_window import (WINDOW_TILES, window_conv, window_pack, window_weight,  # noqa: E402
                                         windows_conv)


import triton  # noqa: E402
import triton.language as tl  # noqa: E402


@triton.jit
def _stream_like_resident(x_ptr, r_ptr, y_ptr, M, N, K: tl.constexpr, TILES: tl.constexpr, ADJACENT: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The resident kernel's memory traffic without its product: each program reads its rows of x
    (K codes each) and, per column tile, the residual tile, and writes the output tile, in the same
    tiles, order and grid. Its time is what the traffic pattern alone costs."""
    row_group, column_tile = program_tiles(N, BLOCK_N, ADJACENT)
    offs_n = column_tile * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, K)
    for t in range(TILES):
        offs_m = (row_group * TILES + t) * BLOCK_M + tl.arange(0, BLOCK_M)
        m_ok = offs_m < M
        a = tl.load(x_ptr + offs_m.to(tl.int64)[:, None] * K + offs_k[None, :], mask=m_ok[:, None], other=0)
        row = tl.sum(a.to(tl.int32), axis=1)  # uses every byte read, so none is dropped
        at = offs_m.to(tl.int64)[:, None] * N + offs_n[None, :]
        r = tl.load(r_ptr + at, mask=m_ok[:, None], other=0)
        tl.store(y_ptr + at, (r.to(tl.int32) + row[:, None]).to(tl.int8), mask=m_ok[:, None])


def stream_like_resident(x: torch.Tensor, residual: torch.Tensor, tile: ResidentTile) -> torch.Tensor:
    """`_stream_like_resident` over a channels-last [B, K, H, W] x and [B, N, H, W] residual."""
    m, k, n = x.numel() // x.shape[1], x.shape[1], residual.shape[1]
    y = torch.empty_like(residual)
    _stream_like_resident[tile.grid(m, n)](x, residual, y, m, n, K=k, TILES=tile.tiles, ADJACENT=tile.n_adjacent,
                                BLOCK_M=tile.block_m, BLOCK_N=tile.block_n, num_warps=tile.warps)
    return y


def median_ms(fn, reps: int) -> float:
    """Median milliseconds of `fn` replayed as a CUDA graph (the builder's own timing,
    `sartor.tactics.select.time_ms`): the host's launch overhead stays out, as in an engine."""
    return time_ms(fn, torch.device("cuda"), reps, warmup=3, graph=True)


def int8_codes(*shape: int, channels_last: bool = False) -> torch.Tensor:
    t = torch.randint(-127, 128, shape, dtype=torch.int8, device="cuda")
    return t.contiguous(memory_format=torch.channels_last) if channels_last else t


def conv_case(batch: int, cin: int, cout: int, hw: int, k: int, stride: int) -> dict:
    out_hw = (hw + 2 * (k // 2) - k) // stride + 1
    return dict(x=int8_codes(batch, cin, hw, hw, channels_last=True),
                w=pack_weight(int8_codes(cout, cin, k, k)),
                bias=torch.randint(-1000, 1000, (cout,), dtype=torch.int32, device="cuda"),
                scale=torch.full((cout,), 1e-3, device="cuda"),
                residual=int8_codes(batch, cout, out_hw, out_hw, channels_last=True),
                geometry=ConvGeometry((k, k), (stride, stride), (k // 2, k // 2), (1, 1), (out_hw, out_hw)),
                macs=batch * out_hw * out_hw * cout * cin * k * k)


def row_recorder(path: Path) -> Callable[..., None]:
    """record(**row): prints the row as JSON and rewrites `path` with every row so far, so that a run
    cut short keeps what it measured."""
    path.parent.mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []

    def record(**row) -> None:
        rows.append(row)
        print(json.dumps(row), flush=True)
        path.write_text(json.dumps(rows, indent=1))
    return record


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.environ.get("OUT", "out"))
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--reps", type=int, default=20)
    args = parser.parse_args()
    out = Path(args.out)
    record = row_recorder(out / "int8_kernel_probe.json")

    def timed(name: str, fn, macs: int = 0, bytes_moved: int = 0, **extra) -> None:
        try:
            ms = median_ms(fn, args.reps)
        except Exception as exc:  # noqa: BLE001 - one failing variant must not hide the others
            traceback.print_exc()
            record(name=name, error=f"{type(exc).__name__}: {exc}"[:300], **extra)
            return
        record(name=name, ms=round(ms, 4), tops=round(2 * macs / ms / 1e9, 1) if macs else None,
               tb_s=round(bytes_moved / ms / 1e9, 2) if bytes_moved else None, **extra)

    big = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    copy = torch.empty_like(big)
    timed("copy 256 MiB", lambda: copy.copy_(big), bytes_moved=2 * big.numel())

    b = args.batch
    cases = {"layer1.conv3 1x1 64->256 @56": conv_case(b, 64, 256, 56, 1, 1),
             "layer1.conv2 3x3 64->64 @56": conv_case(b, 64, 64, 56, 3, 1),
             "layer2.conv2 3x3 128->128 @28": conv_case(b, 128, 128, 28, 3, 1),
             "layer3.conv3 1x1 256->1024 @14": conv_case(b, 256, 1024, 14, 1, 1)}
    for label, case in cases.items():
        x, w, geometry = case["x"], case["w"], case["geometry"]
        out_elems = case["residual"].numel()
        full_bytes = x.numel() + 2 * out_elems  # input, residual and output codes, once each
        for tile in _INT8_TILES:
            timed(f"{label} {tile.name} full epilogue",
                  lambda: conv_igemm(x, w, case["bias"], geometry, tile, dequant_scale=case["scale"],
                                     residual=case["residual"], activation="Relu", residual_scale=0.01,
                                     output_inv_scale=20.0),
                  case["macs"], full_bytes, layer=label, tile=tile.name, epilogue="bias+res+relu+requant")
        tile = _INT8_TILES[1]
        timed(f"{label} {tile.name} no residual",
              lambda: conv_igemm(x, w, case["bias"], geometry, tile, dequant_scale=case["scale"],
                                 activation="Relu", output_inv_scale=20.0),
              case["macs"], x.numel() + out_elems, layer=label, tile=tile.name, epilogue="bias+relu+requant")
        timed(f"{label} {tile.name} float32 out",
              lambda: conv_igemm(x, w, case["bias"], geometry, tile, dequant_scale=case["scale"]),
              case["macs"], x.numel() + 4 * out_elems, layer=label, tile=tile.name, epilogue="bias, fp32 out")
        if geometry.kernel == (1, 1):
            a = x.permute(0, 2, 3, 1).reshape(-1, x.shape[1])
            w2 = w.reshape(w.shape[0], -1)
            timed(f"{label} GEMM view {tile.name}",
                  lambda: conv_igemm(a, w2, case["bias"], ConvGeometry.gemm(), tile, dequant_scale=case["scale"],
                                     activation="Relu", output_inv_scale=20.0),
                  case["macs"], x.numel() + out_elems, layer=label, tile=tile.name, epilogue="gemm view, no residual")
            wt = w2.t()  # [K, N] view of the K-major weight: what _int_mm reads
            timed(f"{label} torch._int_mm", lambda: torch._int_mm(a, wt), case["macs"],
                  x.numel() + 4 * out_elems, layer=label, tile="cublas", epilogue="none, int32 out")
            timed(f"{label} cublas_int_mm tactic (+ Triton epilogue)",
                  lambda: library_qlayer(x, w, INT_MM, case["bias"], case["residual"], case["scale"],
                                         dict(activation="Relu", residual_scale=0.01, output_inv_scale=20.0)),
                  case["macs"], full_bytes + 8 * out_elems, layer=label, tile=INT_MM, epilogue="bias+res+relu+requant")
        fp16_x = x.to(torch.float16)
        fp16_w = w.to(torch.float16)
        timed(f"{label} cudnn fp16 conv", lambda: torch.nn.functional.conv2d(
            fp16_x, fp16_w, stride=geometry.strides, padding=geometry.pads), case["macs"],
            2 * (x.numel() + out_elems), layer=label, tile="cudnn", epilogue="none, fp16")

    # One pipeline stage where K is one block (the 1×1 layers over 64 channels): more programs per SM.
    case = cases["layer1.conv3 1x1 64->256 @56"]
    # And the epilogue in two halves of the columns (fewer registers live: bench/kernel_asm.py).
    for tile in (TileConfig(64, 64, 64, 4, 1), TileConfig(64, 64, 64, 4, 2), TileConfig(128, 128, 64, 8, 1),
                 TileConfig(128, 64, 64, 4, 1), TileConfig(64, 128, 64, 4, 1), TileConfig(64, 256, 64, 8, 1),
                 TileConfig(64, 64, 64, 4, 4, epilogue_halves=True), TileConfig(64, 64, 64, 4, 1, epilogue_halves=True),
                 TileConfig(128, 128, 64, 8, 3, epilogue_halves=True), TileConfig(64, 128, 64, 4, 1, epilogue_halves=True)):
        timed(f"layer1.conv3 {tile.name} full epilogue",
              lambda: conv_igemm(case["x"], case["w"], case["bias"], case["geometry"], tile,
                                 dequant_scale=case["scale"], residual=case["residual"], activation="Relu",
                                 residual_scale=0.01, output_inv_scale=20.0),
              case["macs"], case["x"].numel() + 2 * case["residual"].numel(), layer="layer1.conv3", tile=tile.name,
              epilogue="bias+res+relu+requant")

    # The halved epilogue with the residual loaded before the K loop (`_re`) against without, on
    # the residual layers the implicit GEMM runs (layer3's conv3; layer1's for reference).
    for label in ("layer3.conv3 1x1 256->1024 @14", "layer1.conv3 1x1 64->256 @56"):
        case = cases[label]
        for base in (TileConfig(128, 128, 64, 8, 3), TileConfig(64, 64, 64, 4, 4), TileConfig(128, 64, 128, 4, 3)):
            for tile in (replace(base, epilogue_halves=True), replace(base, epilogue_halves=True, residual_early=True)):
                timed(f"{label} {tile.name} full epilogue",
                      lambda: conv_igemm(case["x"], case["w"], case["bias"], case["geometry"], tile,
                                         dequant_scale=case["scale"], residual=case["residual"], activation="Relu",
                                         residual_scale=0.01, output_inv_scale=20.0),
                      case["macs"], case["x"].numel() + 2 * case["residual"].numel(), layer=label, tile=tile.name,
                      epilogue="bias+res+relu+requant")

    # The resident-weight kernel on the same K = 64 layers: each program keeps its weight tile and
    # walks several row tiles.
    for label in ("layer1.conv3 1x1 64->256 @56", "layer3.conv3 1x1 256->1024 @14"):
        case = cases[label]
        if case["x"].shape[1] > MAX_RESIDENT_K:
            continue
        for tile in map(ResidentTile.parse, resident_tactics(5, residual=True)):
            timed(f"{label} {tile.name} full epilogue",
                  lambda: resident_gemm(case["x"], case["w"], case["bias"], tile, dequant_scale=case["scale"],
                                        residual=case["residual"], activation="Relu", residual_scale=0.01,
                                        output_inv_scale=20.0),
                  case["macs"], case["x"].numel() + 2 * case["residual"].numel(), layer=label, tile=tile.name,
                  epilogue="bias+res+relu+requant")
        # What bounds the best tile (session 15: 1.75 of 4 TB/s): without the residual, and the same
        # traffic with no product at all, in both grid orders.
        for tile in map(ResidentTile.parse, resident_tactics(1)):
            timed(f"{label} {tile.name} no residual",
                  lambda: resident_gemm(case["x"], case["w"], case["bias"], tile, dequant_scale=case["scale"],
                                        activation="Relu", output_inv_scale=20.0),
                  case["macs"], case["x"].numel() + case["residual"].numel(), layer=label, tile=tile.name,
                  epilogue="bias+relu+requant")
            timed(f"{label} {tile.name} traffic only (no product)",
                  lambda: stream_like_resident(case["x"], case["residual"], tile),
                  0, case["x"].numel() + 2 * case["residual"].numel(), layer=label, tile=tile.name,
                  epilogue="none: read x and residual, write y")

    # ResNet's stride-2 downsample (layer2.0's: 0.159–0.172 ms through the implicit GEMM, session 17)
    # through the implicit-GEMM tiles and the strided resident tiles; no residual, INT8 codes out.
    label = "layer2.0.downsample 1x1 256->512 s2 @56"
    case = conv_case(b, 256, 512, 56, 1, 2)
    traffic = case["x"].numel() // 4 + case["residual"].numel()  # every other pixel of every other row, then y
    for tile in _INT8_TILES[:3]:
        timed(f"{label} {tile.name}",
              lambda: conv_igemm(case["x"], case["w"], case["bias"], case["geometry"], tile, dequant_scale=case["scale"],
                                 activation=None, output_inv_scale=20.0),
              case["macs"], traffic, layer=label, tile=tile.name, epilogue="bias+requant")
    for tile in map(ResidentTile.parse, resident_tactics(3, residual=False, k_total=256)):
        timed(f"{label} {tile.name}",
              lambda: resident_gemm(case["x"], case["w"], case["bias"], tile, dequant_scale=case["scale"],
                                    output_inv_scale=20.0, strides=(2, 2)),
              case["macs"], traffic, layer=label, tile=tile.name, epilogue="bias+requant")

    # Block 0's downsample folded into its conv3 (passes/fuse_projected_residual.py): every resident
    # tile with the projection (session 18's engine: 0.203 ms for layer1.0 in the first tile, 0.190
    # for layer2.0 in the 64×128 one), INT8 codes in and out, ReLU.
    for label, (cin, cout, hw, pcin, stride) in {"layer1.0 conv3 + downsample 64->256 @56": (64, 256, 56, 64, 1),
                                                 "layer2.0 conv3 + downsample 128->512 @28": (128, 512, 28, 256, 2)
                                                 }.items():
        case = conv_case(b, cin, cout, hw, 1, 1)
        source = conv_case(b, pcin, cout, hw * stride, 1, stride)
        projection = Projection(source["x"], source["w"], source["bias"], source["scale"], (stride, stride))
        traffic = case["x"].numel() + source["x"].numel() // (stride * stride) + case["residual"].numel()
        for tile in [*map(ResidentTile.parse, resident_tactics(5, k_total=max(cin, pcin))), FEW_ROWS_TILE]:
            timed(f"{label} {tile.name} projected",
                  lambda: resident_gemm(case["x"], case["w"], case["bias"], tile, dequant_scale=case["scale"],
                                        projection=projection, activation="Relu", output_inv_scale=20.0),
                  case["macs"] + source["macs"], traffic, layer=label, tile=tile.name,
                  epilogue="bias+projection+relu+requant")

    # The TMA-fed kernel on the stride-1 3×3 layers (session 14's candidate against the implicit
    # GEMM's 330–550 TOPS there): the input boxes and weight tiles as bulk copies.
    for label in ("layer1.conv2 3x3 64->64 @56", "layer2.conv2 3x3 128->128 @28"):
        case = cases[label]
        for tile in TMA_TILES:
            timed(f"{label} {tile.name} (TMA) full epilogue",
                  lambda: conv_tma(case["x"], case["w"], case["bias"], case["geometry"], tile,
                                   dequant_scale=case["scale"], residual=case["residual"], activation="Relu",
                                   residual_scale=0.01, output_inv_scale=20.0),
                  case["macs"], case["x"].numel() + 2 * case["residual"].numel(), layer=label, tile=tile.name,
                  epilogue="bias+res+relu+requant")

    # The stem: 7×7 stride 2 over 3 FP32 channels (NCHW, as the network input arrives): im2col,
    # then the GEMM over K padded to 192, and the two together as the engine runs them.
    x = torch.rand(b, 3, 224, 224, device="cuda")
    geometry = ConvGeometry((7, 7), (2, 2), (3, 3), (1, 1), (112, 112))
    rows_stem = b * 112 * 112
    macs = rows_stem * 64 * 147
    for k_padded in (160, 192):
        timed(f"stem im2col K{k_padded}", lambda: im2col_codes(x, (7, 7), (2, 2), (3, 3), (1, 1), (112, 112),
                                                               k_padded, torch.int8, 50.0),
              bytes_moved=4 * x.numel() + rows_stem * k_padded, layer="stem", k_padded=k_padded)
    # The window tactic: 4-byte pixels, then the GEMM kernel over overlapping 32-byte windows.
    timed("stem pack_pixels", lambda: pack_pixels(x, (3, 3), (229, 232), torch.int8, 50.0),
          bytes_moved=4 * x.numel() + b * 229 * 232 * 4, layer="stem")
    w_window = window_weight(int8_codes(64, 3, 7, 7))
    epilogue = dict(activation="Relu", input_inv_scale=50.0, output_inv_scale=20.0, qmin=-127, fp8=False)
    for tile in WINDOW_TILES:
        timed(f"stem window {tile.name} (pack + GEMM)",
              lambda: window_conv(x, w_window, torch.zeros(64, dtype=torch.int32, device="cuda"), None,
                                  torch.full((64,), 1e-3, device="cuda"), geometry, tile, torch.int8, epilogue),
              macs, 4 * x.numel() + rows_stem * 64, layer="stem", tile=window_tactic(tile).name)
    # The GEMM over the windows alone (session 16: pack 0.080 ms of the best tile's 0.468).
    packed = window_pack(x, w_window, geometry, torch.int8, 50.0, -127)
    for tile in WINDOW_TILES[:3]:
        timed(f"stem window {tile.name} (GEMM over pre-packed pixels)",
              lambda: windows_conv(packed, w_window, torch.zeros(64, dtype=torch.int32, device="cuda"), None,
                                   torch.full((64,), 1e-3, device="cuda"), geometry, tile, epilogue),
              macs, packed.numel() + rows_stem * 64, layer="stem", tile=window_tactic(tile).name)
    # The resident-window kernel over the same packed pixels: each program keeps its weight block
    # and walks several row tiles.
    for tile in window_resident_tiles(5):
        timed(f"stem window {tile.name} (GEMM over pre-packed pixels)",
              lambda: window_resident_conv(packed, w_window, torch.zeros(64, dtype=torch.int32, device="cuda"), tile,
                                           geometry=geometry, dequant_scale=torch.full((64,), 1e-3, device="cuda"),
                                           activation="Relu", output_inv_scale=20.0),
              macs, packed.numel() + rows_stem * 64, layer="stem", tile=window_tactic(tile).name)
    cols = im2col_codes(x, (7, 7), (2, 2), (3, 3), (1, 1), (112, 112), 192, torch.int8, 50.0)
    w_stem = int8_codes(64, 192)
    bias = torch.zeros(64, dtype=torch.int32, device="cuda")
    scale = torch.full((64,), 1e-3, device="cuda")
    for tile in _INT8_TILES + (TileConfig(128, 64, 64, 4, 3), TileConfig(256, 64, 64, 8, 3),
                               TileConfig(128, 64, 64, 4, 4)):
        timed(f"stem GEMM K192 {tile.name}",
              lambda: conv_igemm(cols, w_stem, bias, ConvGeometry.gemm(), tile, dequant_scale=scale,
                                 activation="Relu", output_inv_scale=20.0),
              macs, cols.numel() + rows_stem * 64, layer="stem", tile=tile.name)
    # The stem's max pool over INT8 codes (3×3 stride 2, 112² → 56², 64 channels), each tile: session
    # 17's engines took 0.139 ms when every tap went through float32.
    stem_out = int8_codes(b, 64, 112, 112, channels_last=True)
    for tile in POOL_TILES:
        timed(f"stem max pool {tile.name}",
              lambda: max_pool_nhwc(stem_out, (3, 3), (2, 2), (1, 1), (1, 1), (56, 56), tile=tile),
              bytes_moved=stem_out.numel() + stem_out.numel() // 4, layer="stem pool", tile=tile.name)
    print(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__}), flush=True)


if __name__ == "__main__":
    main()
