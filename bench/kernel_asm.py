"""What sartor's INT8 convolution kernels compile to on Hopper, without a GPU: registers, spills,
shared memory, and the instruction mix (tensor-core ops, vector widths of global loads and stores,
asynchronous copies, layout conversions through shared memory), for the tile candidates of one
layer.

Triton compiles for a target named here (sm_90 by default) with the ptxas its wheel ships, so this
runs on a CPU machine: kernel structure can be compared between device sessions. Registers and
shared memory decide how many programs an SM holds, which is what latency-bound layers (ResNet-50's
1×1 layers of K = 64, docs/benchmarks-history session 13) live on. Times still need the GPU
(bench/int8_kernel_probe.py).

    PYTHONPATH=. python bench/kernel_asm.py [--layer layer1.conv3] [--arch 90] [--dump DIR]
    # with the GPU machine's Triton (3.6 on the H200) rather than this machine's:
    pip install --target /tmp/t36 --no-deps triton==3.6.0 && PYTHONPATH=/tmp/t36:. python bench/kernel_asm.py

Layers (ResNet-50 at batch 256, INT8 codes in and out, residual where the network has one):
layer1.conv3 (1×1, 64 → 256, 56×56), layer1.conv2 (3×3, 64 → 64, 56×56), layer3.conv2 (3×3,
256 → 256, 14×14), layer3.conv3 (1×1, 256 → 1024, 14×14), layer4.conv3 (1×1, 512 → 2048, 7×7; at
K = 512 the resident tiles would need 133–270 KB of shared memory, so MAX_RESIDENT_K stays 256), stem
(7×7 stride 2, 3 → 64, 224×224: the window tactic's GEMMs over packed pixels,
`ops/quantized_window.py`, in both forms); yolo-stem (YOLOv8n's at batch 32: 3×3 stride 2, 3 → 16,
640×640, the same GEMMs and the narrow resident-window tiles of few output channels).
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from collections import Counter
from dataclasses import replace
from pathlib import Path

if __name__ == "__main__":
    os.environ.pop("TRITON_INTERPRET", None)  # compile for real, whatever the shell set

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.backends.nvidia.compiler import CUDABackend  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
from sartor.kernels.conv import igemm as conv_igemm, tma as conv_tma  # noqa: E402
from sartor.kernels.gemm import resident as resident_gemm, tma as gemm_tma  # noqa: E402
from sartor.kernels.window import resident as window_resident  # noqa: E402
from sartor.kernels.registry import TacticNameError  # noqa: E402
from sartor.kernels.window.pixel_pack import PIXEL_BYTES  # noqa: E402
from sartor.kernels.common.tile_steps import (CODES_ABOVE_FLOOR, SUMS_DECODED, output_codes,  # noqa: E402
                                              residual_pixels)
from sartor.kernels.pointwise.epilogue import ACTIVATION_CODES, told_alignment  # noqa: E402
from sartor.ops import quantized, quantized_window  # noqa: E402

LAYERS = {  # name: (batch, cin, cout, hw, kernel, residual)
    "layer1.conv3": (256, 64, 256, 56, 1, True),
    "layer1.conv2": (256, 64, 64, 56, 3, False),
    "layer3.conv2": (256, 256, 256, 14, 3, False),  # the 3×3 layers of layers 2–4 run implicit-GEMM tiles
    "layer3.conv3": (256, 256, 1024, 14, 1, True),
    "layer4.conv3": (256, 512, 2048, 7, 1, True),
    "detector.c24": (32, 24, 24, 80, 3, False),  # the sample detector's stage1 3×3 layers (C = 24)
    "detector.c40": (32, 40, 40, 40, 3, False),  # its stage2 3×3 layers (C = 40)
    "detector.1x1": (32, 72, 48, 80, 1, False),  # its 72 → 48 1×1 layer (K a multiple of 8, not 16)
    "yolo.c16": (32, 16, 16, 160, 3, False),  # YOLOv8n at 640: model.2's bottleneck 3×3 layers (C = 16)
    "yolo.c32": (32, 32, 32, 80, 3, False),  # model.4's bottleneck 3×3 layers (C = 32)
    "yolo.1x1": (32, 48, 32, 160, 1, False),  # YOLOv8n at 640: model.2's cv2 (1×1, 48 → 32), resident GEMM
    "yolo.b1.c128": (1, 128, 128, 40, 3, False),  # batch 1: model.6's 3×3 layers, 50 tiles of 64×64 (split-K's case)
    "stem": (256, 3, 64, 224, 7, False),  # stride 2: the window tactic's GEMMs (window_cases)
    "yolo-stem": (32, 3, 16, 640, 3, False),  # YOLOv8n's: stride 2, 16 channels (the narrow window tiles)
}
# Block 0 of a stage, its downsample fused into the last 1×1 layer (passes/fuse_projected_residual.py):
# name: (batch, cin, cout, hw, projection's cin, projection's stride).
PROJECTED = {
    "layer1.projected": (256, 64, 256, 56, 64, 1),
    "layer2.projected": (256, 128, 512, 28, 256, 2),
}
STEM_STRIDE = 2
ACTIVATION_NAMES = {code: name for name, code in ACTIVATION_CODES.items()}
OUTPUT_INV_SCALE = 20.0  # the layers' output scale: codes of SiLU's least value (-5.6) need no lower clamp
ACTIVATION = 1  # the epilogue's activation code (pointwise/epilogue.py ACTIVATION_CODES); --activation sets it
# What each pattern counts in the PTX.
PATTERNS = {
    "tma": r"cp\.async\.bulk\.tensor",
    "wgmma": r"wgmma\.mma_async",
    "mma.sync": r"\bmma\.sync",
    "cp.async": r"cp\.async\.(?:cg|ca)",
    "ld.v4": r"ld\.global(?:\.\w+)*\.v4",
    "ld.v2": r"ld\.global(?:\.\w+)*\.v2",
    "ld.scalar": r"ld\.global(?:\.(?!v[24])\w+)+\s",
    "st.v4": r"st\.global(?:\.\w+)*\.v4",
    "st.v2": r"st\.global(?:\.\w+)*\.v2",
    "st.scalar": r"st\.global(?:\.(?!v[24])\w+)+\s",
    "pdl": r"griddepcontrol\.",
}
# Numeric conversions in the SASS: Hopper converts 16 values per clock per SM (CUDA C++ Programming
# Guide, arithmetic instruction throughput) against 128 float32 adds, so an epilogue's per-element
# int32 → float32 and float32 → int8 conversions cost as much issue time as eight adds each.
SASS_CONVERSIONS = {"I2F": r"\bI2F(?:\.\w+)*\b", "F2I": r"\bF2I(?:\.\w+)*\b", "I2I": r"\bI2I(?:\.\w+)*\b",
                    "F2F": r"\bF2F(?:\.\w+)*\b"}


def compile_for(fn, args: dict, constexprs: dict, warps: int, stages: int, target: GPUTarget, pdl: bool = False):
    """Compile `fn` as Triton's launcher would for these argument values: strings are pointer
    types (assumed 16-byte aligned), ints equal to 1 become constants and multiples of 16 carry
    the divisibility hint, floats are fp32. `pdl`: as launched with programmatic dependent launch
    (kernels/common/pdl.py), for the kernels that take part."""
    backend = CUDABackend(target)
    if "PDL" in fn.arg_names:
        constexprs = dict(constexprs, PDL=pdl)
    signature, attrs, constants = {}, {}, dict(constexprs)
    defaults = {param.name: param.default for param in fn.params if param.has_default}
    for index, name in enumerate(fn.arg_names):
        if name not in constexprs and name not in args and name in defaults:  # launched without it
            constexprs = dict(constexprs, **{name: defaults[name]})
            constants[name] = defaults[name]
        if name in constexprs:
            signature[name] = "constexpr"
            continue
        value = args[name]
        if value is None:  # an unused descriptor (conv_igemm's w_desc without weight TMA): a constant
            signature[name] = "constexpr"
            constants[name] = None
            continue
        if conv_tma.TensorDescriptor is not None and isinstance(value, conv_tma.TensorDescriptor):
            from triton.runtime.jit import mangle_type
            signature[name] = mangle_type(value)  # "tensordesc<i8[1, 8, 16, 64]>", as the launcher specializes it
        elif isinstance(value, str):
            signature[name] = value
            attrs[(index,)] = backend.parse_attr("D")
        elif isinstance(value, float):
            signature[name] = "fp32"
        elif value == 1:
            signature[name] = "constexpr"
            constants[name] = 1
        else:
            signature[name] = "i32" if abs(value) < 2**31 else "i64"
            if value % 16 == 0:
                attrs[(index,)] = backend.parse_attr("D")
    source = ASTSource(fn, signature, constants, attrs)
    options = {"num_warps": warps, "num_stages": stages, "enable_fp_fusion": False}
    return triton.compile(source, target=target, options=dict(options, launch_pdl=True) if constexprs.get("PDL")
                          else options)


SASS_LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)[^;]*;")
SASS_BRANCH_TARGET = re.compile(r"\bBRA\s+(?:\S+\s+)?`?\(?(?:\.L_x_\d+|0x([0-9a-f]+))")
TENSOR_CORE_OPS = ("HGMMA", "IGMMA", "QGMMA", "HMMA", "IMMA")


def sass_instructions(sass: str) -> list[tuple[int, str, str]]:
    """(address, opcode, line) of each SASS instruction cuobjdump printed, in order."""
    return [(int(m.group(1), 16), m.group(3), m.group(0)) for m in SASS_LINE.finditer(sass)]


def main_loop_mix(sass: str) -> tuple[int, dict[str, int]]:
    """The instructions of one pass of the innermost loop that holds a tensor-core product (a resident
    tile's row-tile loop, an implicit GEMM's K loop), by opcode: what one warp issues per iteration.
    (0, {}) where no backward branch encloses one."""
    instructions = sass_instructions(sass)
    loops = []
    for address, opcode, line in instructions:
        target = SASS_BRANCH_TARGET.search(line) if opcode == "BRA" else None
        if target and target.group(1) and int(target.group(1), 16) < address:
            body = [op for a, op, _ in instructions if int(target.group(1), 16) <= a <= address]
            if any(op in TENSOR_CORE_OPS for op in body):
                loops.append(body)
    if not loops:
        return 0, {}
    body = min(loops, key=len)
    return len(body), dict(Counter(body).most_common())


def assemble(ptx: str, arch: int) -> tuple[str, str]:
    """(ptxas's -v report, the SASS cuobjdump prints) of `ptx` for sm_`arch`, by the tools Triton's wheel ships."""
    ptxas = Path(triton.backends.nvidia.__file__).parent / "bin" / "ptxas"
    with tempfile.TemporaryDirectory() as tmp:
        source = Path(tmp) / "k.ptx"
        source.write_text(ptx)
        out = subprocess.run([str(ptxas), "--gpu-name", f"sm_{arch}a", "-v", str(source), "-o", str(Path(tmp) / "k.o")],
                             capture_output=True, text=True, check=True).stderr
        sass = subprocess.run([str(ptxas.parent / "cuobjdump"), "-sass", str(Path(tmp) / "k.o")],
                              capture_output=True, text=True, check=True).stdout
    return out, sass


def loads_before(sass: str, opcodes: tuple[str, ...]) -> int:
    """How many global loads the SASS issues before its first instruction of `opcodes` (e.g. a max
    pool's first maximum): how many loads are in flight before the first one's value is needed."""
    loads = 0
    for _, opcode, _ in sass_instructions(sass):
        if opcode in opcodes:
            return loads
        loads += opcode == "LDG"
    return loads


def ptxas_report(ptx: str, arch: int) -> dict:
    out, sass = assemble(ptx, arch)
    return {"registers": int(re.search(r"Used (\d+) registers", out).group(1)),
            "spill_bytes": int(re.search(r"(\d+) bytes spill stores", out).group(1)),
            "conversions": {name: len(re.findall(pattern, sass)) for name, pattern in SASS_CONVERSIONS.items()},
            "instructions": len(sass_instructions(sass)),
            "main_loop": main_loop_mix(sass)}


def window_cases(batch: int, cin: int, cout: int, hw: int, k: int, common: dict,
                 epilogue: dict) -> list[tuple[str, object, dict, dict, int, int]]:
    """The window tactic's GEMMs over packed pixels (`ops/quantized_window.py`) of a few-channel
    k × k stride-STEM_STRIDE convolution: the implicit-GEMM window tiles and the resident-window
    tiles, at effort 5, in the 4-byte form and (at stride 2) the space-to-depth one."""
    out_hw = (hw + 2 * (k // 2) - k) // STEM_STRIDE + 1
    common = dict(common, srn=out_hw * out_hw * cout, srh=out_hw * cout, srw=cout)
    resident_common = dict(common, p_ptr="*i8", M=batch * out_hw * out_hw, COUT=cout, OH=out_hw, OW=out_hw, y_row=cout)
    del resident_common["x_ptr"], resident_common["in_inv_scale"]
    resident_epilogue = {name: value for name, value in epilogue.items() if name != "QUANTIZE_INPUT"}

    def form(space_to_depth: bool, rows: int, window: int, stride_h: int, step: int, padded_h: int,
             padded_w: int) -> list:
        """One form's cases: `rows` filter rows of `window`-byte windows, `stride_h` rows and `step`
        4-byte pixels apart, over padded_h × padded_w 4-byte pixels (as the packing lays them out)."""
        image_bytes, row_bytes = padded_h * padded_w * PIXEL_BYTES, padded_w * PIXEL_BYTES
        igemm_args = dict(common, ws_ptr="*i8", arrivals_ptr="*i32", w_desc=None, M=batch * out_hw * out_hw,
                          COUT=cout, C=window, H=padded_h, W=padded_w - window // PIXEL_BYTES + 1, OH=out_hw,
                          OW=out_hw, y_row=cout,
                          sxn=image_bytes, sxc=1, sxh=row_bytes, sxw=PIXEL_BYTES, pad_h=0, pad_w=0, dil_h=1, dil_w=1)
        cases = []
        for tile in quantized_window.WINDOW_TILES:
            constexprs = dict(epilogue, KH=rows, KW=1, STRIDE_H=stride_h, STRIDE_W=step, K_GATHER=False, SPLIT_K=1,
                              ROW_ALIGN=step * PIXEL_BYTES, EPILOGUE_HALVES=False, RES_EARLY=False, CHANNEL_TAIL=0,
                              WEIGHT_TMA=False, BLOCK_M=tile.block_m, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k,
                              GROUP_M=8, ONE_COLUMN=cout <= tile.block_n)
            cases.append((quantized_window.window_tactic(tile, space_to_depth).name, conv_igemm._conv_igemm_kernel,
                          igemm_args, constexprs, tile.warps, tile.stages))
        resident_args = dict(resident_common, image_bytes=image_bytes, row_bytes=row_bytes)
        for tile in window_resident.window_resident_tiles(5, max_pool=True, out_channels=cout):
            constexprs = dict(resident_epilogue, KH=rows, WINDOW=window, STRIDE_H=stride_h,
                              PIXEL_STEP=step * PIXEL_BYTES, DIL_H=1, KH_STEPS=tile.kh_steps, TILES=tile.resident.tiles,
                              N_ADJACENT=tile.resident.n_adjacent, COLUMNS_LOADED=tile.resident.columns_loaded,
                              BLOCK_M=tile.resident.block_m, BLOCK_N=tile.resident.block_n,
                              K_PAD=triton.next_power_of_2(rows * window), OUTPUT_ROWS=tile.output_rows,
                              MAX_POOL=tile.max_pool, BALANCED=tile.balanced,
                              WINDOW_ALIGN=window_resident.window_alignment(step * PIXEL_BYTES, row_bytes, image_bytes))
            cases.append((quantized_window.window_tactic(tile, space_to_depth).name,
                          window_resident._window_resident_kernel, resident_args, constexprs, tile.resident.warps,
                          tile.resident.stages))
        return cases

    window = quantized_window.window_bytes(k)
    padded_w = -(-((out_hw - 1) * STEM_STRIDE + window // PIXEL_BYTES) // 4) * 4  # as window_pack pads
    cases = form(False, k, window, STEM_STRIDE, STEM_STRIDE,
                 (out_hw - 1) * STEM_STRIDE + k, padded_w)
    if STEM_STRIDE == 2:  # the space-to-depth form: ⌈k/2⌉ rows of 16-byte block pixels at stride 1
        rows, window = -(-k // 2), quantized_window.space_to_depth_window_bytes(k)
        block = quantized_window.BLOCK_PIXEL_BYTES // PIXEL_BYTES  # 4-byte pixels per block pixel
        blocks_h, blocks_w = out_hw + rows - 1, out_hw - 1 + window // quantized_window.BLOCK_PIXEL_BYTES
        cases += form(True, rows, window, 1, block,
                      blocks_h, blocks_w * block)  # as space_to_depth_pack packs
    return cases


NO_PROJECTION = dict(p_ptr="*i8", pw_ptr="*i8", pbias_ptr="*i32", pscale_ptr="*fp32", PK=0, p_row=0, spn=0, sph=0,
                     spw=0, p_inv_scale=1.0)
NO_PROJECTION_CONSTEXPRS = dict(HAS_PROJ=False, PROJ_STRIDED=False, PROJ_QUANTIZE_INPUT=False, PROJ_HAS_BIAS=False,
                                BLOCK_PK=resident_gemm.MIN_BLOCK_K, PROJ_COLUMNS_LOADED=False)


def projected_cases(layer: str) -> list[tuple[str, object, dict, dict, int, int]]:
    """The resident tiles of a layer with its downsample fused in, at effort 5."""
    batch, cin, cout, hw, pcin, stride = PROJECTED[layer]
    phw = hw * stride
    values = dict(NO_PROJECTION, x_ptr="*i8", w_ptr="*i8", bias_ptr="*i32", scale_ptr="*fp32", res_ptr="*i8",
                  y_ptr="*i8", M=batch * hw * hw, COUT=cout, K=cin, x_row=cin, y_row=cout, OH=hw, OW=hw,
                  sxn=hw * hw * cin, sxh=hw * cin, sxw=cin, srn=0, src=0, srh=0, srw=0, PK=pcin, p_row=pcin,
                  spn=phw * phw * pcin, sph=phw * pcin * stride, spw=pcin * stride, in_inv_scale=1.0, res_scale=1.0,
                  out_inv_scale=OUTPUT_INV_SCALE, qmin=-127.0, alpha=0.0, beta=0.0)
    if stride == 1:  # the wrapper addresses rows alone then (tile_steps.residual_pixels)
        values.update(OH=1, OW=1)
    epilogue = dict(INT8=True, FP8=False, QUANTIZE_INPUT=False, HAS_BIAS=True, HAS_RES=True, RES_QUANT=False,
                    RES_AFTER=False, ACT=1, OUT_QUANT=CODES_ABOVE_FLOOR, HAS_PROJ=True, PROJ_STRIDED=stride != 1,
                    PROJ_QUANTIZE_INPUT=False, PROJ_HAS_BIAS=True,
                    BLOCK_PK=resident_gemm.resident_block_k(pcin))
    cases = []
    tiles = [*map(resident_gemm.ResidentTile.parse, resident_gemm.resident_tactics(5)), quantized.FEW_ROWS_TILE]
    tiles += [replace(tile, projection_columns_loaded=True) for tile in tiles if tile.columns_loaded and tile.n_adjacent]
    for tile in tiles:
        constexprs = dict(epilogue, TILES=tile.tiles, BLOCK_M=tile.block_m, BLOCK_N=tile.block_n,
                          BLOCK_K=resident_gemm.resident_block_k(cin), RES_PREFETCH=0,
                          N_ADJACENT=tile.n_adjacent, COLUMNS_LOADED=tile.columns_loaded,
                          PROJ_COLUMNS_LOADED=tile.projection_columns_loaded, STRIDED=False)
        cases.append((tile.name, resident_gemm._resident_gemm_kernel, values, constexprs, tile.warps, tile.stages))
    return cases


def layer_cases(layer: str, resident_tiles: list[str] | None = None,
                split_k: int = 1) -> list[tuple[str, object, dict, dict, int, int]]:
    """(label, kernel, argument values, constexprs, warps, stages) for each candidate of the layer;
    `resident_tiles` (tactic names) in place of every resident tile the builder knows; with
    `split_k`, the implicit-GEMM tiles also split that many ways, ended by the epilogue kernel and
    by the last share (last-reduces)."""
    if layer in PROJECTED:
        return projected_cases(layer)
    batch, cin, cout, hw, k, residual = LAYERS[layer]
    rows = batch * hw * hw
    common = dict(res_ptr="*i8", y_ptr="*i8", bias_ptr="*i32", scale_ptr="*fp32", x_ptr="*i8", w_ptr="*i8",
                  srn=hw * hw * cout, src=1, srh=hw * cout, srw=cout, in_inv_scale=1.0, res_scale=0.01,
                  out_inv_scale=OUTPUT_INV_SCALE, qmin=-127.0, alpha=0.0, beta=0.0)
    epilogue = dict(INT8=True, FP8=False, QUANTIZE_INPUT=False, HAS_BIAS=True, HAS_RES=residual, RES_QUANT=residual,
                    RES_AFTER=False, ACT=ACTIVATION,
                    OUT_QUANT=output_codes(ACTIVATION_NAMES[ACTIVATION], 0.0, False, OUTPUT_INV_SCALE, -127.0))
    if cin <= PIXEL_BYTES:
        return window_cases(batch, cin, cout, hw, k, common, epilogue)
    igemm_args = dict(common, ws_ptr="*i32", arrivals_ptr="*i32", w_desc=None, M=rows, COUT=cout, C=cin, H=hw, W=hw,
                      OH=hw, OW=hw, y_row=cout,
                      sxn=hw * hw * cin, sxc=1, sxh=hw * cin, sxw=cin, x_shift=0, pad_h=k // 2, pad_w=k // 2, dil_h=1,
                      dil_w=1)
    cases = []
    tiles = conv_igemm.candidate_tiles(int8=True, effort=3)
    tiles = (tiles + conv_igemm.single_pass_tiles(tiles, cin * k * k)
             + conv_igemm.padded_tap_tiles(tiles, cin, cout, eight_bit=True)
             + conv_igemm.row_tap_tiles(tiles, cin, (k, k), cout, eight_bit=True))
    tiles = tiles + conv_igemm.halved_epilogue_tiles(tiles, residual=True)  # every variant, to compare
    tiles = tiles + conv_igemm.weight_tma_tiles(tiles, cin, (cout, cin, k, k), 1)
    if split_k > 1:
        split = [replace(tile, split_k=split_k, last_reduces=last) for tile in tiles for last in (False, True)]
        tiles = tiles + [tile for tile in split if tile.invalid() is None]
    for tile in tiles:
        tail = cin if tile.padded_taps and cin % tile.block_k else 0
        constexprs = dict(epilogue, KH=k, KW=k, STRIDE_H=1, STRIDE_W=1, ROW_TAPS=cin if tile.row_taps else 0,
                          K_GATHER=cin % tile.block_k != 0 and not tail and not tile.row_taps,
                          SPLIT_K=tile.split_k, LAST_REDUCES=tile.last_reduces,
                          ROW_ALIGN=(cin & -cin) if cin % 16 else 16,
                          EPILOGUE_HALVES=tile.epilogue_halves,
                          RES_EARLY=tile.residual_early and residual, CHANNEL_TAIL=tail, WEIGHT_TMA=tile.weight_tma,
                          BLOCK_M=tile.block_m, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k, GROUP_M=8,
                          OUT_ALIGN=told_alignment(cout, cout), ONE_COLUMN=cout <= tile.block_n)
        args = igemm_args
        if tile.weight_tma:
            import torch
            w = torch.empty(cout, k * k * cin, dtype=torch.int8, device="meta")
            args = dict(igemm_args, w_desc=conv_igemm.packed_weight_descriptor(w, tile.block_n, tile.block_k))
        cases.append((tile.name, conv_igemm._conv_igemm_kernel, args, constexprs, tile.warps, tile.stages))
    if conv_tma.TensorDescriptor is not None and cin % 64 == 0:
        import torch
        x = torch.empty(batch, hw, hw, cin, dtype=torch.int8, device="meta")
        w = torch.empty(cout, k * k * cin, dtype=torch.int8, device="meta")
        for tile in conv_tma.TMA_TILES:
            tma_args = dict(common, COUT=cout, C=cin, OH=hw, OW=hw, y_row=cout, pad_h=k // 2, pad_w=k // 2,
                            x_desc=conv_tma.TensorDescriptor(x, [batch, hw, hw, cin], [hw * hw * cin, hw * cin, cin, 1],
                                                             [1, tile.bh, tile.bw, tile.block_k]),
                            w_desc=conv_igemm.packed_weight_descriptor(w, tile.block_n, tile.block_k))
            constexprs = dict(epilogue, KH=k, KW=k, BH=tile.bh, BW=tile.bw, BLOCK_N=tile.block_n,
                              BLOCK_K=tile.block_k)
            constexprs.pop("QUANTIZE_INPUT")
            kernel = conv_tma._conv_tma_persistent_kernel if tile.persistent else conv_tma._conv_tma_kernel
            if tile.persistent:
                tma_args.update(N=batch, PROGRAMS=132)
            cases.append((tile.name, kernel, tma_args, constexprs, tile.warps, tile.stages))
    # The 1×1 kernels' wrappers address a whole NHWC residual by row (tile_steps.residual_pixels).
    (flat_oh, flat_ow), (srn, src, srh, srw) = residual_pixels(
        (common["srn"], common["src"], common["srh"], common["srw"]), batch, (hw, hw))
    flat = dict(common, OH=flat_oh, OW=flat_ow, srn=srn, src=src, srh=srh, srw=srw)
    if k == 1 and gemm_tma.TensorDescriptor is not None and cin % 16 == 0:
        import torch
        x = torch.empty(rows, cin, dtype=torch.int8, device="meta")
        w = torch.empty(cout, cin, dtype=torch.int8, device="meta")
        for tile in [gemm_tma.GemmTmaTile.parse(name) for name in
                     gemm_tma.gemm_tma_tactics(x, (cout, cin), conv_igemm.ConvGeometry.gemm(), 5, residual,
                                               residual_codes=residual)]:
            dense_args = dict(flat, M=rows, COUT=cout, K=cin, y_row=cout,
                              x_desc=gemm_tma.TensorDescriptor(x, [rows, cin], [cin, 1], [tile.block_m, tile.block_k]),
                              w_desc=conv_igemm.packed_weight_descriptor(w, tile.block_n, tile.block_k))
            constexprs = dict(epilogue, EPILOGUE_HALVES=tile.halves, BLOCK_M=tile.block_m, BLOCK_N=tile.block_n,
                              BLOCK_K=tile.block_k, GROUP_M=gemm_tma.GROUP_M, PERSISTENT=tile.persistent,
                              RES_MMA=tile.residual_mma and residual)
            constexprs.pop("QUANTIZE_INPUT")
            cases.append((tile.name, gemm_tma._gemm_tma_kernel, dense_args, constexprs, tile.warps, tile.stages))
    if k == 1 and cin <= resident_gemm.MAX_RESIDENT_K:
        resident_args = dict(flat, **NO_PROJECTION, M=rows, COUT=cout, K=cin, x_row=cin, y_row=cout,
                             sxn=hw * hw * cin, sxh=hw * cin, sxw=cin)
        # Effort 5 times every resident tile and its variants (residual prefetch where there is a residual).
        names = (resident_tiles if resident_tiles is not None
                 else resident_gemm.resident_tactics(5, residual, residual_codes=residual, out_channels=cout))
        for tile in map(resident_gemm.ResidentTile.parse, names):
            constexprs = dict(epilogue, **NO_PROJECTION_CONSTEXPRS, IN_ALIGN=told_alignment(cin, cin),
                              OUT_ALIGN=told_alignment(cout, cout), TILES=tile.tiles, BLOCK_M=tile.block_m,
                              BLOCK_N=tile.block_n, BLOCK_K=resident_gemm.resident_block_k(cin),
                              RES_PREFETCH=tile.residual_prefetch, N_ADJACENT=tile.n_adjacent,
                              COLUMNS_LOADED=tile.columns_loaded, STRIDED=False)
            cases.append((tile.name, resident_gemm._resident_gemm_kernel, resident_args, constexprs, tile.warps,
                          tile.stages))
    return cases


def first_cause(exc: BaseException) -> BaseException:
    """The exception a chain of them started from: Triton wraps a failure inside a called @jit
    function in one CompilationError per caller, each naming only its own call site."""
    while exc.__cause__ is not None:
        exc = exc.__cause__
    return exc


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layer", default="layer1.conv3", choices=sorted(LAYERS) + sorted(PROJECTED))
    parser.add_argument("--arch", type=int, default=90, help="compute capability as one number (90: Hopper)")
    parser.add_argument("--dump", type=Path, default=None, help="write each candidate's TTGIR and PTX here")
    parser.add_argument("--pdl", action="store_true", help="compile as launched with programmatic dependent launch")
    parser.add_argument("--loop-mix", action="store_true",
                        help="also print each candidate's main loop in SASS (the innermost loop with a tensor-core "
                             "product) by opcode: what one warp issues per iteration")
    parser.add_argument("--resident-tiles", type=lambda text: text.split(","), default=None,
                        help="comma-separated resident tactics (e.g. resident.64x64.t8.w4.s2.cols-loaded.grouped) "
                             "instead of every "
                             "one the builder knows: a tile not yet among them")
    parser.add_argument("--split-k", type=int, default=1,
                        help="also compile the implicit-GEMM tiles split this many ways, both endings")
    parser.add_argument("--activation", default="Relu", choices=[a for a in ACTIVATION_CODES if a],
                        help="the epilogue's activation (YOLO's layers: SiLU)")
    parser.add_argument("--sums-decoded", action="store_true",
                        help="compile the INT8 epilogues that decode their int32 sums from bits (tile_steps "
                             "SUMS_DECODED, a layer whose weights bound its sums below 2^22) instead of converting")
    args = parser.parse_args()
    global ACTIVATION
    ACTIVATION = ACTIVATION_CODES[args.activation]
    for name in args.resident_tiles or []:
        try:
            resident_gemm.ResidentTile.parse(name)
        except TacticNameError as error:
            parser.error(f"--resident-tiles: {error}")
    target = GPUTarget("cuda", args.arch, 32)
    print(f"{args.layer} on sm_{args.arch}: per program")
    print(f"{'candidate':32s} {'regs':>4} {'spill':>5} {'smem':>6} {'sass':>5} {'layout cvts':>11} "
          + " ".join(f"{name:>9}" for name in PATTERNS) + " " + " ".join(f"{name:>4}" for name in SASS_CONVERSIONS))
    for label, fn, values, constexprs, warps, stages in layer_cases(args.layer, args.resident_tiles, args.split_k):
        if args.sums_decoded and constexprs.get("INT8"):
            constexprs = dict(constexprs, INT8=SUMS_DECODED)
        try:
            kernel = compile_for(fn, values, constexprs, warps, stages, target, args.pdl)
            report = ptxas_report(kernel.asm["ptx"], args.arch)
        except Exception as exc:  # noqa: BLE001 - one candidate that fails to compile is a finding, not the end
            print(f"{label:32s} failed: {type(exc).__name__}: {str(exc).splitlines()[0][:120]}; "
                  f"first cause: {first_cause(exc)!r}")
            continue
        ptx, ttgir = kernel.asm["ptx"], kernel.asm["ttgir"]
        counts = " ".join(f"{len(re.findall(pattern, ptx)):>9}" for pattern in PATTERNS.values())
        print(f"{label:32s} {report['registers']:>4} {report['spill_bytes']:>5} {kernel.metadata.shared:>6} "
              f"{report['instructions']:>5} "
              f"{ttgir.count('ttg.convert_layout'):>11} {counts} "
              + " ".join(f"{count:>4}" for count in report["conversions"].values()), flush=True)
        if args.loop_mix:
            length, mix = report["main_loop"]
            print(f"{'':32s} main loop: {length} instructions: "
                  + (", ".join(f"{op} {n}" for op, n in mix.items()) if mix else "no loop with a product"), flush=True)
        if args.dump is not None:
            args.dump.mkdir(parents=True, exist_ok=True)
            (args.dump / f"{label}.ttgir").write_text(ttgir)
            (args.dump / f"{label}.ptx").write_text(ptx)


if __name__ == "__main__":
    main()
