"""What holds ResNet-50's slowest INT8 kernels, read off the hardware counters: each kernel the
batch-256 engine picked for its slowest layers (session 18's timing cache), launched once inside an
NVTX range that `bench/ncu_layers.sh` hands to Nsight Compute, beside two references on the same
bytes (a device copy, and the resident kernel's traffic with no product).

Timings alone left open why layer1's conv3 takes 0.21 ms where its traffic would take 0.11 at the
copy's bandwidth (docs/benchmarks-history, sessions 16–18); the counters say whether it is DRAM, L2, stalls
on loads, occupancy or the stores' access pattern.

    PYTHONPATH=. python bench/ncu_layers.py [--batch 256] [--only NAME,...] [--list] [--time]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from int8_kernel_probe import conv_case, int8_codes, stream_like_resident  # noqa: E402
from sartor.kernels.conv.chain import ChainLayer, conv_chain  # noqa: E402
from sartor.kernels.conv.depthwise import (DEPTHWISE_TILES, DEPTHWISE_WORDS_TILES, TRITON_DEPTHWISE,  # noqa: E402
                                           TRITON_DEPTHWISE_INT8_WORDS,
                                           depthwise_conv_nhwc, depthwise_qconv_nhwc, depthwise_tile_for,
                                           pack_depthwise_weight)
from sartor.kernels.conv.igemm import ConvGeometry, TileConfig, conv_igemm, pack_weight  # noqa: E402
from sartor.kernels.conv.tma import TmaTile, conv_tma  # noqa: E402
from sartor.kernels.pool.max_pool import PoolTile, max_pool_nhwc  # noqa: E402
from sartor.kernels.gemm.resident import Projection, ResidentTile, resident_gemm  # noqa: E402
from sartor.kernels.registry import tactic_for  # noqa: E402
from sartor.ops.quantized_window import window_conv, window_weight  # noqa: E402
from sartor.tactics.select import time_ms  # noqa: E402

# The INT8 epilogue every case runs: residual (where the layer has one), ReLU, INT8 codes out.
EPILOGUE = dict(activation="Relu", output_inv_scale=20.0)


# YOLO's layers end in SiLU: its exponential is part of what their epilogues cost.
SILU_EPILOGUE = dict(activation="SiLU", output_inv_scale=20.0)


def resident_case(batch: int, cin: int, cout: int, hw: int, tactic: str, residual: bool = True,
                  epilogue: dict = EPILOGUE):
    case = conv_case(batch, cin, cout, hw, 1, 1)
    tile = ResidentTile.parse(tactic)
    extra = dict(residual=case["residual"], residual_scale=0.01) if residual else {}
    return lambda: resident_gemm(case["x"], case["w"], case["bias"], tile, dequant_scale=case["scale"], **extra,
                                 **epilogue)


def projected_case(batch: int, cin: int, cout: int, hw: int, pcin: int, stride: int, tactic: str):
    case = conv_case(batch, cin, cout, hw, 1, 1)
    source = conv_case(batch, pcin, cout, hw * stride, 1, stride)
    projection = Projection(source["x"], source["w"], source["bias"], source["scale"], (stride, stride))
    tile = ResidentTile.parse(tactic)
    return lambda: resident_gemm(case["x"], case["w"], case["bias"], tile, dequant_scale=case["scale"],
                                 projection=projection, **EPILOGUE)


def igemm_case(batch: int, cin: int, cout: int, hw: int, k: int, stride: int, tactic: str, residual: bool = False,
               epilogue: dict = EPILOGUE):
    case = conv_case(batch, cin, cout, hw, k, stride)
    tile = TileConfig.parse(tactic)
    extra = dict(residual=case["residual"], residual_scale=0.01) if residual else {}
    return lambda: conv_igemm(case["x"], case["w"], case["bias"], case["geometry"], tile,
                              dequant_scale=case["scale"], **extra, **epilogue)


def tma_case(batch: int, cin: int, cout: int, hw: int, tactic: str, epilogue: dict = EPILOGUE):
    case = conv_case(batch, cin, cout, hw, 3, 1)
    tile = TmaTile.parse(tactic)
    return lambda: conv_tma(case["x"], case["w"], case["bias"], case["geometry"], tile, dequant_scale=case["scale"],
                            **epilogue)


def stem_case(batch: int, tactic: str, cout: int = 64, kernel: int = 7, size: int = 224, activation: str = "Relu"):
    """ResNet's stem (7×7 / 2, 3 → 64 at 224) or, with cout 16, kernel 3, size 640, YOLO's."""
    x = torch.rand(batch, 3, size, size, device="cuda")
    out = (size + 2 * (kernel // 2) - kernel) // 2 + 1
    geometry = ConvGeometry((kernel, kernel), (2, 2), (kernel // 2, kernel // 2), (1, 1), (out, out))
    window = tactic_for(tactic)
    space_to_depth = window.space_to_depth
    w_window = window_weight(int8_codes(cout, 3, kernel, kernel), space_to_depth)
    bias = torch.zeros(cout, dtype=torch.int32, device="cuda")
    scale = torch.full((cout,), 1e-3, device="cuda")
    epilogue = dict(activation=activation, input_inv_scale=50.0, output_inv_scale=20.0, qmin=-127, fp8=False)
    return lambda: window_conv(x, w_window, bias, None, scale, geometry, window.tile, torch.int8, epilogue,
                               space_to_depth=space_to_depth)


def pool_case(batch: int, tactic: str, dtype: torch.dtype = torch.int8):
    stem_out = int8_codes(batch, 64, 112, 112, channels_last=True).to(dtype)
    tile = PoolTile.parse(tactic)
    return lambda: max_pool_nhwc(stem_out, (3, 3), (2, 2), (1, 1), (1, 1), (56, 56), tile=tile)


def traffic_case(batch: int, tactic: str):
    case = conv_case(batch, 64, 256, 56, 1, 1)
    return lambda: stream_like_resident(case["x"], case["residual"], ResidentTile.parse(tactic))


def chain_case(batch: int, cin: int, cmid: int, cout: int, hw: int, stride: int, tactic: str, int8: bool = True,
               activation: str | None = "SiLU"):
    """A 3×3 convolution and the 1×1 reading it in one kernel (kernels/conv/chain.py), `activation`
    after each; INT8 codes in and out, or float16."""
    out_hw = (hw + 2 - 3) // stride + 1
    geometry = ConvGeometry((3, 3), (stride, stride), (1, 1), (1, 1), (out_hw, out_hw))
    if int8:
        x, w1, w2 = int8_codes(batch, cin, hw, hw, channels_last=True), int8_codes(cmid, cin, 3, 3), int8_codes(
            cout, cmid, 1, 1)
        layers = [ChainLayer(torch.randint(-1000, 1000, (c,), dtype=torch.int32, device="cuda"),
                             torch.full((c,), 1e-3, device="cuda"), activation=activation, output_inv_scale=20.0)
                  for c in (cmid, cout)]
    else:
        x = torch.randn(batch, cin, hw, hw, device="cuda").half().contiguous(memory_format=torch.channels_last)
        w1, w2 = (torch.randn(cmid, cin, 3, 3, device="cuda") / 12).half(), (torch.randn(
            cout, cmid, 1, 1, device="cuda") / 6).half()
        layers = [ChainLayer(torch.zeros(c, device="cuda").half(), None, activation=activation) for c in (cmid, cout)]
    tile = tactic_for(tactic)
    w1 = pack_weight(w1)
    return lambda: conv_chain(x, w1, w2, geometry, layers[0], layers[1], tile)


def depthwise_case(batch: int, channels: int, hw: int, form: str):
    """A 3×3 depthwise convolution (stride 1, SiLU) over channels-last activations, as YOLO11n's DWConv:
    `triton` (FP16, kernels/conv/depthwise.py, triton_depthwise's blocks), `cudnn` (FP16, torch's convolution
    alone: the triton_epilogue tactic's first kernel), `int8_words` (INT8 codes a word of four channels), or a
    DepthwiseTile's name (in its blocks: FP16, or INT8 words for a words tile)."""
    geometry = ConvGeometry((3, 3), (1, 1), (1, 1), (1, 1), (hw, hw))
    named = {"triton": TRITON_DEPTHWISE, "int8_words": TRITON_DEPTHWISE_INT8_WORDS}
    tile = None if form == "cudnn" else depthwise_tile_for(named.get(form, form))
    if tile is not None and tile.words:
        x = int8_codes(batch, channels, hw, hw, channels_last=True)
        w = pack_depthwise_weight(int8_codes(channels, 1, 3, 3))
        bias = torch.randint(-1000, 1000, (channels,), dtype=torch.int32, device="cuda")
        scale = torch.full((channels,), 1e-3, device="cuda")
        return lambda: depthwise_qconv_nhwc(x, w, bias, geometry, dequant_scale=scale, input_inv_scale=1.0,
                                            tile=tile, **SILU_EPILOGUE)
    x = torch.randn(batch, channels, hw, hw, device="cuda").half().contiguous(memory_format=torch.channels_last)
    w = (torch.randn(channels, 1, 3, 3, device="cuda") / 3).half()
    bias = torch.zeros(channels, device="cuda").half()
    if form == "cudnn":
        return lambda: torch.nn.functional.conv2d(x, w, bias, padding=1, groups=channels)
    w = pack_depthwise_weight(w)
    return lambda: depthwise_conv_nhwc(x, w, bias, geometry, activation="SiLU", tile=tile)


def copy_case(batch: int, channels: int = 256, hw: int = 56):
    source = int8_codes(batch, channels, hw, hw)
    target = torch.empty_like(source)
    return lambda: target.copy_(source)


def cases(batch: int) -> dict:
    """Name → a function that builds the case's tensors and returns its launch (session 18's winners)."""
    return {
        "layer1.conv3": lambda: resident_case(batch, 64, 256, 56, "resident.64x64.t8.w4.s3.grouped"),
        "layer1.conv3_c": lambda: resident_case(batch, 64, 256, 56, "resident.64x64.t8.w4.s3.cols-loaded.grouped"),
        "layer1.0.conv3+downsample_c": lambda: projected_case(batch, 64, 256, 56, 64, 1,
                                                              "resident.64x64.t8.w4.s3.cols-loaded.grouped"),
        "layer1.0.conv3+downsample": lambda: projected_case(batch, 64, 256, 56, 64, 1, "resident.64x64.t8.w4.s3.grouped"),
        "layer1.conv2": lambda: tma_case(batch, 64, 64, 56, "tma.8x16x64x64.w4.s4"),
        "layer1.conv1": lambda: resident_case(batch, 256, 64, 56, "resident.64x64.t8.w4.s3", residual=False),
        "layer2.conv3": lambda: resident_case(batch, 128, 512, 28, "resident.64x64.t8.w4.s3.grouped"),
        "layer2.conv3_c": lambda: resident_case(batch, 128, 512, 28, "resident.64x64.t8.w4.s3.cols-loaded.grouped"),
        "layer3.conv3": lambda: resident_case(batch, 256, 1024, 14, "resident.64x128.t8.w4.s2.grouped"),
        "layer3.conv3_c": lambda: resident_case(batch, 256, 1024, 14, "resident.64x128.t8.w4.s2.cols-loaded.grouped"),
        # Session 23's fastest (0.0709 ms) and a tile of half the rows, 6 programs an SM where it holds 4:
        # whether layer3's conv3 waits on latency (more programs help) or on shared memory (neither does).
        "layer3.conv3_64": lambda: resident_case(batch, 256, 1024, 14, "resident.64x64.t8.w4.s2.cols-loaded.grouped"),
        "layer3.conv3_32": lambda: resident_case(batch, 256, 1024, 14, "resident.32x64.t8.w4.s3.cols-loaded.grouped"),
        "layer3.conv2": lambda: igemm_case(batch, 256, 256, 14, 3, 1, "igemm.128x128x64.w8.s3.halves"),
        "layer4.conv3": lambda: igemm_case(batch, 512, 2048, 7, 1, 1, "igemm.128x128x64.w8.s3.halves.residual-early", residual=True),
        # Batch 1's slowest layer (0.021 ms, 8 programs walking K = 4,608) and its split-K tile, which
        # did not beat it (0.023: session 19's timing cache).
        "layer4.conv2": lambda: igemm_case(batch, 512, 512, 7, 3, 1, "igemm.64x64x64.w4.s4"),
        "layer4.conv2_k16": lambda: igemm_case(batch, 512, 512, 7, 3, 1, "igemm.64x64x64.w4.s4.split16"),
        "stem": lambda: stem_case(batch, "window_resident.64x64.t8.w4.s2.kh-steps"),
        "stem.s2d": lambda: stem_case(batch, "window_resident.64x64.t8.w4.s2.cols-loaded.space-to-depth"),
        "stem.s2d_o2": lambda: stem_case(batch, "window_resident.64x64.t8.w4.s2.cols-loaded.kh-steps.row-pairs.space-to-depth"),
        "stem.pool": lambda: pool_case(batch, "max_pool.elements8192.channels64.w4"),
        "stem.pool.first_tile": lambda: pool_case(batch, "max_pool.elements4096.channels64.w4"),
        "stem.pool.fp16": lambda: pool_case(batch, "max_pool.elements4096.channels64.w4", torch.float16),
        "stem.pool.fp16_e8192": lambda: pool_case(batch, "max_pool.elements8192.channels64.w4", torch.float16),
        "traffic.layer1.conv3": lambda: traffic_case(batch, "resident.64x64.t8.w4.s3.grouped"),
        "copy.205MB": lambda: copy_case(batch),
        # YOLOv8n at 640, batch 32 (fixed, whatever --batch says), with the tactics session 37's
        # builder chose: the 16- to 64-channel layers at 80-320 pixels a side where INT8 gained least.
        "yolo.stem": lambda: stem_case(32, "window_resident.64x64.t8.w4.s2.cols-loaded.kh-steps.row-pairs.space-to-depth",
                                       cout=16, kernel=3, size=640, activation="SiLU"),
        "yolo.model2.cv2_1x1": lambda: resident_case(32, 48, 32, 160, "resident.64x64.t8.w4.s3.cols-loaded.grouped",
                                                     residual=False, epilogue=SILU_EPILOGUE),
        "yolo.model2.m0_3x3": lambda: igemm_case(32, 16, 16, 160, 3, 1, "igemm.128x32x64.w8.s3.row-taps",
                                                 epilogue=SILU_EPILOGUE),
        "yolo.head_3x3_64": lambda: tma_case(32, 64, 64, 80, "tma.8x16x64x64.w4.s4", epilogue=SILU_EPILOGUE),
        "copy.yolo.26MB": lambda: copy_case(32, 32, 160),
        # The first backbone chain (model.1's stride-2 3×3, 16 → 32 at 320 pixels a side, and model.2's
        # cv1, 32 → 32): its INT8 kernel is barely faster than its FP16 one, both far above their bytes.
        "yolo.chain1.int8": lambda: chain_case(32, 16, 32, 32, 320, 2, "chain.128x64x32.w8.s3"),
        "yolo.chain1.int8_m64": lambda: chain_case(32, 16, 32, 32, 320, 2, "chain.64x64x32.w4.s3"),
        "yolo.chain1.fp16": lambda: chain_case(32, 16, 32, 32, 320, 2, "chain.128x64x32.w8.s3", int8=False),
        "yolo.chain2.int8": lambda: chain_case(32, 32, 64, 64, 160, 2, "chain.128x64x64.w8.s3"),
        "copy.yolo.52MB": lambda: copy_case(32, 16, 320),
        # Other tiles for it: the 64-pixel tile took 1.8× the 128-pixel one's time.
        **{f"yolo.chain1.int8.{tile}": (lambda tile=tile: chain_case(32, 16, 32, 32, 320, 2, f"chain.{tile}"))
           for tile in ("256x64x32.w8.s3", "256x64x32.w16.s3", "128x64x32.w4.s3", "128x64x32.w8.s2",
                        "128x64x32.w8.s4", "256x64x32.w8.s2", "512x64x32.w16.s2", "128x32x32.w8.s3",
                        "128x32x32.w4.s3", "64x32x32.w4.s3", "128x32x32.w4.s4")},
        **{f"yolo.chain2.int8.{tile}": (lambda tile=tile: chain_case(32, 32, 64, 64, 160, 2, f"chain.{tile}"))
           for tile in ("128x64x64.w8.s3", "128x32x64.w8.s3", "128x32x64.w4.s4", "64x32x64.w4.s3", "64x64x64.w4.s3",
                        "256x32x64.w8.s3")},
        # The gathered walk (chain_tiles' GATHERED_CHAIN_TILES, narrowed as the builds narrow it), INT8 and FP16.
        "yolo.chain1.int8.gathered": lambda: chain_case(32, 16, 32, 32, 320, 2, "chain.128x32x32.w4.s4.gathered"),
        "yolo.chain1.fp16.gathered": lambda: chain_case(32, 16, 32, 32, 320, 2, "chain.128x32x32.w4.s4.gathered",
                                                        int8=False),
        # Its first layer alone in igemm's tiles (the 1×1 after it is a resident GEMM of 26 MB each way).
        **{f"yolo.model1.int8.{tile}": (lambda tile=tile: igemm_case(32, 16, 32, 320, 3, 2, f"igemm.{tile}",
                                                                    epilogue=SILU_EPILOGUE))
           for tile in ("128x32x64.w8.s3.row-taps", "128x32x32.w4.s3.padded-taps", "128x32x32.w4.s3")},
        # YOLO11n's class branch at P3 (64 channels at 80 pixels a side): its depthwise layers stay FP16 in the
        # INT8 engine (decision 0045), where cuDNN and an epilogue (0.0386 ms) beat the Triton kernel: 2.2 times
        # a copy of its 26 MB (copy.yolo.26MB).
        **{f"yolo11n.cv3_dw.{form}": (lambda form=form: depthwise_case(32, 64, 80, form))
           for form in ("triton", "cudnn", "int8_words")
           + tuple(tile.name for tile in DEPTHWISE_TILES + DEPTHWISE_WORDS_TILES)},
        # Without the activations: what the SiLUs' special-function operations cost it.
        "yolo.chain1.int8.no_activation": lambda: chain_case(32, 16, 32, 32, 320, 2, "chain.128x64x32.w8.s3",
                                                             activation=None),
        "yolo.chain1.fp16.no_activation": lambda: chain_case(32, 16, 32, 32, 320, 2, "chain.128x64x32.w8.s3",
                                                             int8=False, activation=None),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--only", default="", help="comma-separated case names (default: all)")
    parser.add_argument("--list", action="store_true")
    parser.add_argument("--time", action="store_true",
                        help="time each case as the builder does (CUDA graph, median ms) instead of one launch each")
    args = parser.parse_args()
    table = cases(args.batch)
    if args.list:
        print("\n".join(table))
        return
    names = [name for name in args.only.split(",") if name] or list(table)
    unknown = sorted(set(names) - set(table))
    if unknown:
        raise SystemExit(f"ncu_layers: unknown case(s) {', '.join(unknown)}; --list shows them")
    for name in names:
        launch = table[name]()
        if args.time:
            print(f"{name:32s} {time_ms(launch, torch.device('cuda'), 20, warmup=3, graph=True):.4f} ms", flush=True)
            continue
        launch()  # compiles; the profiled launch below is the second
        torch.cuda.synchronize()
        torch.cuda.nvtx.range_push(f"case {name}")
        launch()
        torch.cuda.synchronize()
        torch.cuda.nvtx.range_pop()
        print(f"ran {name}", flush=True)


if __name__ == "__main__":
    main()
