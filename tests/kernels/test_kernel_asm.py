"""What the INT8 kernels compile to for Hopper, checked on any machine (Triton compiles for sm_90
with the ptxas its wheel ships; bench/kernel_asm.py). The epilogue requantizes with one fused
multiply-add of its value, the output's inverse scale and 1.5·2^23, and reads the code from the
sum's low byte (`requantize_int8`): one rounding of the exact product, as the emulation defines it
(ops/quantized.py), never a multiply and a separate add, which round twice. The residual's codes are
added with their scale in one fused multiply-add as well. The epilogue must convert neither its
output codes from float nor its residual codes to float with the conversion instructions, which run
at an eighth of an add's rate. The resident-window
kernel of the stem compiles in both its forms (one product over padded K; the weight held as a
tuple of filter rows) to Hopper's tensor-core instructions without spills. FP8 epilogues round with
the hardware's conversion once compiled.

The compile runs in a child process: this test session may run Triton's interpreter, under which
the kernels are not compilable objects."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")
ROOT = Path(__file__).resolve().parents[2]

CHILD = r"""
import re, sys
sys.path.insert(0, "bench")
import kernel_asm
from triton.backends.compiler import GPUTarget
label, fn, values, constexprs, warps, stages = kernel_asm.layer_cases("layer1.conv3")[1]  # INT8 out, residual
ptx = kernel_asm.compile_for(fn, values, constexprs, warps, stages, GPUTarget("cuda", 90, 32)).asm["ptx"]
params = set(re.findall(r"ld\.param\.\w+\s+(%r\d+),", ptx))
# value * inverse scale + 1.5*2^23, rounded once
rounding = len(re.findall(r"fma\.rn\.f32\s+%r\d+, %r\d+, %r\d+, 0f4B400000;", ptx))
# + 1.5*2^23 added alone to a computed value: the two-rounding form (1.5*2^23 + qmin, the lower
# clamp bound, adds it to a parameter)
separate = sum(source not in params for source in re.findall(r"add\.rn\.f32\s+%r\d+, (%r\d+), 0f4B400000;", ptx))
clamped = len(re.findall(r"min\.f32\s+%r\d+, %r\d+, 0f4B40007F;", ptx))  # 1.5*2^23 + 127
residual = len(re.findall(r"fma\.rn\.f32\s+%r\d+, %r\d+, %r\d+, %r\d+;", ptx))  # code * scale + value
conversions = len(re.findall(r"cvt\.r[nz]i?\.s(?:8|16|32)\.f32|cvt\.rn\.f32\.s(?:8|16)\b", ptx))
decoded = len(re.findall(r"prmt\.b32\s+%r\d+, flipped, exponent, 0x765[0-3];", ptx))  # _packed_codes_to_float
print(rounding, separate, clamped, residual, decoded, conversions, "wgmma.mma_async" in ptx)
"""

FP8_CHILD = r"""
import re, sys
sys.path.insert(0, "bench")
import kernel_asm
from triton.backends.compiler import GPUTarget
label, fn, values, constexprs, warps, stages = kernel_asm.layer_cases("layer1.conv3")[1]  # residual, codes out
values = dict(values, x_ptr="*fp8e4nv", w_ptr="*fp8e4nv", res_ptr="*fp8e4nv", y_ptr="*fp8e4nv", bias_ptr="*fp32")
ptx = kernel_asm.compile_for(fn, values, dict(constexprs, INT8=False, FP8=True), warps, stages,
                             GPUTarget("cuda", 90, 32)).asm["ptx"]
print(len(re.findall(r"cvt\.rn\.satfinite\.e4m3x2\.f32", ptx)), len(re.findall(r"cvt\.rmi(?:\.ftz)?\.f32\.f32", ptx)),
      "wgmma.mma_async" in ptx)
"""

STEM_CHILD = r"""
import re, sys
sys.path.insert(0, "bench")
import kernel_asm
from triton.backends.compiler import GPUTarget
from sartor.kernels.window.resident import window_resident_tiles
from sartor.ops.quantized_window import window_tactic
names = [window_tactic(tile, form).name for tile in window_resident_tiles(1, max_pool=True) for form in (False, True)]
for label, fn, values, constexprs, warps, stages in kernel_asm.layer_cases("stem"):
    if label in names:
        ptx = kernel_asm.compile_for(fn, values, constexprs, warps, stages, GPUTarget("cuda", 90, 32)).asm["ptx"]
        copies = {int(size, 16) for size in re.findall(
            r"cp\.async\.c[ag]\.shared\.global\S* \[[^]]*\], \[[^]]*\], (0x[0-9a-f]+)", ptx)}
        print(label, kernel_asm.ptxas_report(ptx, 90)["spill_bytes"], "wgmma.mma_async" in ptx, max(copies))
"""


def _compile_in_child(code: str) -> str:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def recorded_launch_child(module: str, kernel: str, call: str, sm90: dict | None = None,
                          told: str = "CH_ALIGN") -> str:
    """A child that runs `call` (a wrapper of `module`) with `kernel` replaced by a recorder, then
    compiles the real kernel for sm_90 with the arguments the wrapper launched it with (tensors as
    16-byte aligned pointers of their dtype; `sm90`: constexprs as a Hopper launch would set them)
    and prints the alignment it was told (the constexpr `told`), then its scalar and vector global
    loads and stores."""
    return f"""
import re, sys
sys.path.insert(0, "bench")
import torch, kernel_asm
from triton.backends.compiler import GPUTarget
from {module} import *
import {module} as module
launched = {{}}
class Recorder:
    def __getitem__(self, grid):
        return lambda *args, **kwargs: launched.update(args=args, kwargs=kwargs)
kernel, module.{kernel} = module.{kernel}, Recorder()
{call}
pointer = {{torch.int32: "*i32", torch.int8: "*i8", torch.uint8: "*u8", torch.float16: "*fp16", torch.float32: "*fp32"}}
values = {{name: pointer[v.dtype] if isinstance(v, torch.Tensor) else v
          for name, v in zip(kernel.arg_names, launched["args"])}}
constexprs = {{k: v for k, v in launched["kwargs"].items() if k in kernel.arg_names}} | {sm90 or {}!r}
options = launched["kwargs"]  # num_warps, num_stages and the like
ptx = kernel_asm.compile_for(kernel, values, constexprs, options.get("num_warps", 4), options.get("num_stages", 1),
                             GPUTarget("cuda", 90, 32)).asm["ptx"]
print(constexprs.get("{told}"), *(len(re.findall(kernel_asm.PATTERNS[name], ptx))
                                    for name in ("ld.scalar", "ld.v2", "ld.v4", "st.scalar", "st.v2", "st.v4")))
"""


def test_int8_rounding_survives_compilation_for_sm90():
    rounding, separate, clamped, residual, decoded, conversions, hopper = _compile_in_child(CHILD).split()
    assert int(rounding) > 0 and separate == "0"  # one fused multiply-add rounds, no add on its own
    assert clamped == rounding  # each rounded sum is clamped to the codes' bounds before its low byte is read
    assert residual == rounding  # each output's residual code added with its scale in one rounding
    assert decoded == rounding  # each residual code decoded by one byte permute, four codes to a word
    assert conversions == "0"  # codes neither made from floats nor read as floats by conversion instructions
    assert hopper == "True"  # Hopper's tensor-core instructions, not a fallback


def test_fp8_epilogue_rounds_with_the_hardware_conversion_when_compiled():
    """FP8_HARDWARE_ROUNDING: a compiled FP8 epilogue converts with cvt.rn.satfinite (nearest even,
    ±448 beyond) and no longer floors its way to the e4m3 grid (round_to_fp8_grid, 64 floors here)."""
    conversions, floors, hopper = _compile_in_child(FP8_CHILD).split()
    assert int(conversions) > 0 and floors == "0" and hopper == "True"


def test_resident_window_kernel_compiles_for_sm90_in_both_forms():
    lines = [line.split() for line in _compile_in_child(STEM_CHILD).splitlines()]
    # both walks at effort 1, each also with its columns' bias and scale loaded once (cols-loaded), the
    # one by filter rows also over row pairs (row-pairs), and three tiles of those pooling the output
    # (max-pool, a stem carrying its max pool; one walking balanced), and the first by filter rows with
    # its columns loaded, with and without row pairs, walking balanced at 4 and 6 programs an SM; each
    # in the 4-byte and the space-to-depth form
    for s2d in (False, True):
        form = ".space-to-depth" if s2d else ""
        assert sorted((".kh-steps" in label, ".cols-loaded" in label, label.endswith(".row-pairs" + form),
                       ".max-pool" in label, ".balanced" in label)
                      for label, *_ in lines if label.endswith(".space-to-depth") == s2d) == [
            (False, False, False, False, False), (False, True, False, False, False), (True, False, False, False, False),
            (True, False, False, True, False), (True, False, False, True, False), (True, False, False, True, True),
            (True, False, True, False, False), (True, True, False, False, False), *[(True, True, False, False, True)] * 4,
            (True, True, True, False, False)]
    assert all(spills == "0" and hopper == "True" for _, spills, hopper, _ in lines)
    # The 4-byte form's windows start every 8 bytes at stride 2, the block pixels' every 16: wider
    # copies are a misaligned address on the GPU (Triton 3.6 made 16-byte ones of the row pairs'
    # 4-byte windows until the kernel was told their alignment; session 25).
    assert {label: int(copy) for label, *_, copy in lines if not label.endswith(".space-to-depth")} == {
        label: 8 for label, *_ in lines if not label.endswith(".space-to-depth")}
    assert all(int(copy) == 16 for label, *_, copy in lines if label.endswith(".space-to-depth"))


PROJECTED_CHILD = r"""
import sys
sys.path.insert(0, "bench")
import kernel_asm
from triton.backends.compiler import GPUTarget
from sartor.kernels.gemm.resident import resident_tactics
first = resident_tactics(1)[:2]  # the first tile, plain and grouped
for layer in ("layer1.conv3", "layer1.projected", "layer2.projected"):
    for label, fn, values, constexprs, warps, stages in kernel_asm.layer_cases(layer):
        if label in first:
            ptx = kernel_asm.compile_for(fn, values, constexprs, warps, stages, GPUTarget("cuda", 90, 32)).asm["ptx"]
            print(layer, label, kernel_asm.ptxas_report(ptx, 90)["spill_bytes"], ptx.count("wgmma.mma_async"))
"""


def test_projected_resident_kernel_compiles_for_sm90():
    """The resident kernel with a projection (passes/fuse_projected_residual.py), unstrided (layer1.0)
    and strided (layer2.0), beside the same tile without one (layer1's conv3): every product on
    Hopper's tensor cores, the projection's as well, and no spills."""
    lines = [line.split() for line in _compile_in_child(PROJECTED_CHILD).splitlines()]
    assert [(layer, label.endswith(".grouped")) for layer, label, _, _ in lines] == [
        (layer, adjacent) for layer in ("layer1.conv3", "layer1.projected", "layer2.projected")
        for adjacent in (False, True)]
    assert all(spills == "0" for _, _, spills, _ in lines)
    plain = {int(wgmma) for layer, _, _, wgmma in lines if layer == "layer1.conv3"}
    # layer1.0: a projection of the same K as the layer's own product, so twice its tensor-core ops
    assert {int(wgmma) for layer, _, _, wgmma in lines if layer == "layer1.projected"} == {2 * n for n in plain}
    assert all(int(wgmma) > max(plain) for layer, _, _, wgmma in lines if layer == "layer2.projected")


PERSISTENT_CHILD = r"""
import re, sys
from dataclasses import replace
sys.path.insert(0, "bench")
import kernel_asm
from triton.backends.compiler import GPUTarget
from sartor.kernels.gemm import tma as gemm_tma
first, specialized = gemm_tma.GEMM_TMA_TILES[0], gemm_tma.WS_TILES[0]
wanted = {first.name: "plain", replace(first, persistent=gemm_tma.PERSISTENT_FLAT).name: "flat",
          replace(specialized, persistent=gemm_tma.PERSISTENT_WS).name: "ws"}
for label, fn, values, constexprs, warps, stages in kernel_asm.layer_cases("layer3.conv3", []):
    if label in wanted:
        ptx = kernel_asm.compile_for(fn, values, constexprs, warps, stages, GPUTarget("cuda", 90, 32)).asm["ptx"]
        print(wanted[label], kernel_asm.ptxas_report(ptx, 90)["spill_bytes"], len(re.findall("setmaxnreg", ptx)),
              "wgmma.mma_async" in ptx)
"""


def test_persistent_gemm_tiles_compile_for_sm90_and_the_specialized_one_specializes():
    """The persistent `gemm_tma` variants on layer3's conv3 (K = 256): flattened and warp-specialized
    both compile to Hopper's tensor-core instructions without spills, and the warp-specialized one
    really is (a producer warp group giving up registers: setmaxnreg), where the one-tile kernel is
    not. Triton compiles `warp_specialize` to the plain loop where its pass does not take a tile,
    which is why WS_TILES names the tiles it takes."""
    lines = sorted(line.split() for line in _compile_in_child(PERSISTENT_CHILD).splitlines())
    assert [kind for kind, *_ in lines] == ["flat", "plain", "ws"]
    assert all(spills == "0" and hopper == "True" for _, spills, _, hopper in lines)
    registers = {kind: int(count) for kind, _, count, _ in lines}
    assert registers["ws"] > 0 and registers["plain"] == 0 and registers["flat"] == 0


SPACE_TO_DEPTH_CHILD = r"""
import re, sys
sys.path.insert(0, "bench")
import kernel_asm
from triton.backends.compiler import GPUTarget
from sartor.kernels.window.resident import window_resident_tiles
from sartor.ops.quantized_window import window_tactic
first = window_resident_tiles(1)[0]
for label, fn, values, constexprs, warps, stages in kernel_asm.layer_cases("stem"):
    if label in (window_tactic(first).name, window_tactic(first, True).name):
        ptx = kernel_asm.compile_for(fn, values, constexprs, warps, stages, GPUTarget("cuda", 90, 32)).asm["ptx"]
        sizes = sorted(set(re.findall(r"cp\.async\.c[ag]\.shared\.global \[[^]]*\], \[[^]]*\], (0x[0-9a-f]+)", ptx)))
        print(label.endswith(".space-to-depth"), kernel_asm.ptxas_report(ptx, 90)["spill_bytes"], ",".join(sizes),
              len(re.findall(r"cp\.async\.c[ag]", ptx)), "wgmma.mma_async" in ptx)
"""


def test_space_to_depth_stem_gathers_in_aligned_16_byte_copies():
    """The stem's resident-window tile over block pixels (`….space-to-depth`) copies its rows in 16-byte
    pieces, fewer than the 4-byte form's 8-byte ones (the builder's first tile, K by filter rows:
    4 rows of 64 bytes against 7 of 32), on Hopper's tensor cores without spills."""
    lines = sorted(line.split() for line in _compile_in_child(SPACE_TO_DEPTH_CHILD).splitlines())
    assert [s2d for s2d, *_ in lines] == ["False", "True"]
    (_, plain_spills, plain_sizes, plain_copies, plain_hopper), (_, spills, sizes, copies, hopper) = lines
    assert plain_sizes == "0x8" and sizes == "0x10" and int(copies) < int(plain_copies)
    assert spills == plain_spills == "0" and hopper == plain_hopper == "True"


PACK_CHILD = r"""
import re, sys
sys.path.insert(0, "bench")
import kernel_asm
from triton.backends.compiler import GPUTarget
from sartor.kernels.window import pixel_pack
# YOLOv8n's stem input at 640 (float32 NCHW, quantized as loaded), padded by 1 into 321 x 321 blocks
values = dict(x_ptr="*fp32", p_ptr="*i8", C=3, H=640, W=640, HB=321, WB=321, sxn=3 * 640 * 640, sxc=640 * 640,
              sxh=640, sxw=1, pad_h=1, pad_w=1, in_inv_scale=20.0, qmin=-127.0)
ptx = kernel_asm.compile_for(pixel_pack._pack_blocks_kernel, values, dict(QUANTIZE=True, FP8=False, BLOCK_W=128),
                             pixel_pack.PACK_WARPS, 1, GPUTarget("cuda", 90, 32)).asm["ptx"]
print(len(re.findall(kernel_asm.PATTERNS["st.v4"], ptx)), len(re.findall(kernel_asm.PATTERNS["st.v2"], ptx)),
      len(re.findall(kernel_asm.PATTERNS["st.scalar"], ptx)))
"""


def test_block_pixels_are_stored_whole_in_16_byte_stores():
    """The space-to-depth packing writes each 16-byte block pixel with one vector store: the form
    that wrote each row's half of a block from its own program stored 4 bytes at a time, half of
    every 32-byte sector per program (the L2 traffic Nsight Compute found at 90% on the H200)."""
    vector16, vector8, scalar = _compile_in_child(PACK_CHILD).split()
    assert int(vector16) >= 1 and vector8 == scalar == "0"


LOOP_CHILD = r"""
import sys
sys.path.insert(0, "bench")
import kernel_asm
from triton.backends.compiler import GPUTarget
for label, fn, values, constexprs, warps, stages in kernel_asm.layer_cases("layer3.conv3",
                                                                            ["resident.64x64.t8.w4.s2.cols-loaded.grouped"]):
    if label == "resident.64x64.t8.w4.s2.cols-loaded.grouped":
        ptx = kernel_asm.compile_for(fn, values, constexprs, warps, stages, GPUTarget("cuda", 90, 32)).asm["ptx"]
        length, mix = kernel_asm.ptxas_report(ptx, 90)["main_loop"]
        print(length, mix.get("IGMMA", 0), mix.get("BRA", 0), sum(mix.values()))
"""


def _sass(*lines: tuple[int, str]) -> str:
    """cuobjdump -sass lines: address, then the instruction and its encoding comment."""
    return "\n".join(f"        /*{address:04x}*/                   {text} ;   /* 0x000000000000794d */"
                     for address, text in lines)


def test_the_main_loop_is_the_innermost_one_with_a_tensor_core_product(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    import kernel_asm
    sass = _sass((0x10, "S2R R0, SR_TID.X"),
                 (0x20, "IMAD R1, R0, R0, RZ"),  # outer loop: the row tiles
                 (0x30, "LDGSTS.E.BYPASS.128 [R2], desc[UR4][R4.64]"),
                 (0x40, "IGMMA.64x64x32.S8.S8 R24, gdesc[UR8], R24, gsb0"),
                 (0x50, "FFMA R6, R24, R7, R8"),
                 (0x60, "@P0 BRA 0x40"),  # inner loop: the product and one add
                 (0x70, "STG.E.128 desc[UR4][R10.64], R12"),
                 (0x80, "@P1 BRA 0x20"),
                 (0x90, "FADD R1, R1, R1"),  # a loop without a product is not the main loop
                 (0xa0, "@P2 BRA 0x90"),
                 (0xb0, "EXIT"))
    assert kernel_asm.main_loop_mix(sass) == (3, {"IGMMA": 1, "FFMA": 1, "BRA": 1})
    assert kernel_asm.main_loop_mix(_sass((0x10, "FADD R1, R1, R1"), (0x20, "@P0 BRA 0x10"), (0x30, "EXIT"))) == (0, {})


def test_the_resident_tiles_main_loop_is_found_in_compiled_sass():
    """layer3's conv3 (K = 256) through the 64×64 resident tile: one row tile's pass issues K / 32 = 8
    tensor-core products of 64×64×32, and the loop ends in its branch."""
    length, products, branches, total = map(int, _compile_in_child(LOOP_CHILD).split())
    assert products == 8 and branches == 1 and length == total > 100


def test_a_candidate_that_fails_to_compile_is_reported_by_its_first_cause(monkeypatch):
    """Triton wraps a failure inside a called @jit function in one error per caller (session 25:
    an AssertionError under two CompilationErrors that named only the call sites)."""
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    import kernel_asm
    root = AssertionError("tuple index is not a constexpr")
    try:
        try:
            try:
                raise root
            except AssertionError as exc:
                raise RuntimeError("at 39:50") from exc
        except RuntimeError as exc:
            raise RuntimeError("at 37:8") from exc
    except RuntimeError as outer:
        assert kernel_asm.first_cause(outer) is root
    plain = ValueError("no cause")
    assert kernel_asm.first_cause(plain) is plain


SHORT_ATTENTION_CHILD = r"""
import re, sys
sys.path.insert(0, "bench")
import kernel_asm
from triton.backends.compiler import GPUTarget
from sartor.kernels.attention.short import _short_attention_kernel, padded, short_tiles_for
heads, dim, windows = 3, 32, 64  # Swin-T's first stage
qkv = (3 * heads * dim, dim)  # q, k and v: views of the qkv projection [BW, N, 3, heads, d], rows 3·C apart
for tokens in (49, 128):
    for tile in short_tiles_for(tokens):
        values = dict(q_ptr="*fp16", k_ptr="*fp16", v_ptr="*fp16", bias_ptr="*fp16", out_ptr="*fp16", heads=heads,
                      row_blocks=2, lq=tokens, lk=tokens, dim=dim, dim_v=dim, scale=0.17,
                      q_period=4096, q_so=tokens * qkv[0], q_sh=dim, q_sm=qkv[0], q_sd=1,
                      k_period=4096, k_so=tokens * qkv[0], k_sh=dim, k_sd=1, k_sn=qkv[0],
                      v_period=4096, v_so=tokens * qkv[0], v_sh=dim, v_sn=qkv[0], v_sd=1,
                      b_period=windows, b_so=heads * tokens * tokens, b_sh=tokens * tokens, b_sm=tokens, b_sn=1,
                      o_so=tokens * heads * dim, o_sh=dim, o_sm=heads * dim, o_sd=1)
        constexprs = dict(HAS_BIAS=True, PRECISION="tf32", ROWS=tile.rows, BLOCK_N=padded(tokens), BLOCK_D=dim,
                          BLOCK_DV=dim)
        ptx = kernel_asm.compile_for(_short_attention_kernel, values, constexprs, tile.warps, 1,
                                     GPUTarget("cuda", 90, 32)).asm["ptx"]
        print(tokens, tile.name, kernel_asm.ptxas_report(ptx, 90)["spill_bytes"],
              len(re.findall(r"mma\.sync|wgmma\.mma_async", ptx)))
"""


def test_short_attention_tiles_compile_for_sm90_on_tensor_cores_without_spills():
    """The one-kernel attention's FP16 tiles for Swin's 49 tokens and for 128, its operands strided
    as the qkv projection's views and its bias per window: both products on tensor cores, the
    scores held in registers without spilling."""
    lines = [line.split() for line in _compile_in_child(SHORT_ATTENTION_CHILD).splitlines()]
    assert [(tokens, name) for tokens, name, _, _ in lines] == [
        ("49", "attention.short.b16.w1"), ("49", "attention.short.b32.w2"), ("49", "attention.short.b64.w4"),
        ("128", "attention.short.b32.w2"), ("128", "attention.short.b64.w4"), ("128", "attention.short.b128.w8")]
    assert all(spills == "0" and int(products) > 0 for _, _, spills, products in lines)


SIGMOID_CHILD = r"""
import re, sys
sys.path.insert(0, "bench")
import kernel_asm
from triton.backends.compiler import GPUTarget
kernel_asm.ACTIVATION = kernel_asm.ACTIVATION_CODES["SiLU"]
label, fn, values, constexprs, warps, stages = next(case for case in kernel_asm.layer_cases("yolo.c16")
                                                    if case[0].endswith(".row-taps"))
ptx = kernel_asm.compile_for(fn, values, constexprs, warps, stages, GPUTarget("cuda", 90, 32)).asm["ptx"]
print(len(re.findall(r"ex2\.approx\.ftz\.f32", ptx)), len(re.findall(r"rcp\.approx\.ftz\.f32", ptx)),
      len(re.findall(r"ex2\.approx\.f32|div\.(?:full|rn|approx)\.f32", ptx)), "wgmma.mma_async" in ptx)
"""


def test_silu_epilogue_compiles_to_flushed_exponential_and_reciprocal():
    """A SiLU epilogue (YOLO's 16-channel 3×3 layer) compiles to one ex2.approx.ftz and one
    rcp.approx.ftz a value (pointwise/epilogue.py `_flushed_sigmoid`), not tl.exp's ex2.approx.f32
    and the division's div.full.f32, whose range checks cost about ten instructions a value."""
    exponentials, reciprocals, checked, hopper = _compile_in_child(SIGMOID_CHILD).split()
    assert int(exponentials) > 0 and reciprocals == exponentials
    assert checked == "0" and hopper == "True"


NARROW_OUTPUT_CHILD = r"""
import re, sys
sys.path.insert(0, "bench")
import kernel_asm
from triton.backends.compiler import GPUTarget
for label, fn, values, constexprs, warps, stages in kernel_asm.layer_cases("detector.c24"):
    if label.endswith((".row-taps", ".padded-taps")) and ".halves" not in label:
        ptx = kernel_asm.compile_for(fn, values, constexprs, warps, stages, GPUTarget("cuda", 90, 32)).asm["ptx"]
        print(label, len(re.findall(r"st\.global(?:\.\w+)*\.b8\s", ptx)), len(re.findall(r"st\.global(?:\.\w+)*\.v[24]", ptx)))
"""


def test_epilogue_of_24_outputs_stores_vectors():
    """The sample detector's 24-channel 3×3 layer, told its outputs and pixel stride are multiples of
    8 (`told_alignment`): every walk stores its codes 8 bytes at a time, not byte by byte."""
    lines = [line.split() for line in _compile_in_child(NARROW_OUTPUT_CHILD).splitlines()]
    assert {label.rsplit(".", 1)[-1] for label, _, _ in lines} == {"row-taps", "padded-taps"}
    assert all(bytes_ == "0" and int(vectors) > 0 for _, bytes_, vectors in lines)


SPLIT_HALF_CHILD = r"""
import re, sys
import torch
sys.path.insert(0, "bench")
import kernel_asm
from triton.backends.compiler import GPUTarget
from sartor.kernels.conv.igemm import ConvGeometry, aligned_start, residual_arguments, row_alignment
# The sample detector's stage1 C2f: its Concat buffer holds 72 channels (the Split's two halves of 24
# and the bottleneck's output); the 3x3 reads the second half, and the second 3x3 adds it back
C, HW = 24, 80
wide = torch.empty(32, 3 * C, HW, HW, dtype=torch.int8).contiguous(memory_format=torch.channels_last)
half = wide[:, C:2 * C]
_, shift = aligned_start(half)  # the wrapper's views from the boundary before it
align = row_alignment(half, ConvGeometry((3, 3), (1, 1), (1, 1), (1, 1), (HW, HW)), shift)
_, res_strides, res_shift, res_align = residual_arguments(half, half)
seen = set()
for label, fn, values, constexprs, warps, stages in kernel_asm.layer_cases("detector.c24"):
    walk = label.rsplit(".", 1)[-1]
    if walk in ("row-taps", "padded-taps") and ".halves" not in label and walk not in seen:
        seen.add(walk)
        values = dict(values, sxn=half.stride(0), sxh=half.stride(2), sxw=half.stride(3), x_shift=shift,
                      srn=res_strides[0], srh=res_strides[2], srw=res_strides[3])
        constexprs = dict(constexprs, ROW_ALIGN=align, HAS_RES=True, RES_QUANT=True, RES_SHIFT=res_shift,
                          RES_ALIGN=res_align)
        ptx = kernel_asm.compile_for(fn, values, constexprs, warps, stages, GPUTarget("cuda", 90, 32)).asm["ptx"]
        print(walk, align, res_shift, res_align, len(re.findall(r"ld\.global(?:\.\w+)*\.b8\s", ptx)))
"""


def test_a_split_half_off_a_16_byte_boundary_loads_vectors():
    """A Split's second half of 24 INT8 channels starts 8 bytes past a 16-byte boundary. Given the
    boundary as its pointer and the 8 as a shift its row alignment counts (decision 0061), each walk
    loads the input 8 bytes at a time, and the residual (the same half, RES_SHIFT) too, its strides
    of the 72-channel Concat buffer told as multiples of 8 (RES_ALIGN): no byte loads (with ROW_ALIGN
    1, or RES_ALIGN 1, there are 16 a tile)."""
    lines = [line.split() for line in _compile_in_child(SPLIT_HALF_CHILD).splitlines()]
    assert {walk for walk, *_ in lines} == {"row-taps", "padded-taps"}
    assert all(align == "8" and shift == "8" and res_align == "8" and byte_loads == "0"
               for _, align, shift, res_align, byte_loads in lines)


EIGHT_CHANNELS_CHILD = r"""
import re, sys
sys.path.insert(0, "bench")
import kernel_asm
from triton.backends.compiler import GPUTarget
label, fn, values, constexprs, warps, stages = next(case for case in kernel_asm.layer_cases("detector.1x1")
                                                    if case[0].startswith("resident."))
ptx = kernel_asm.compile_for(fn, values, constexprs, warps, stages, GPUTarget("cuda", 90, 32)).asm["ptx"]
print(len(re.findall(r"ld\.global(?:\.\w+)*\.b8\s", ptx)), len(re.findall(r"cp\.async\.c[ag]", ptx)))
"""


def test_resident_gemm_over_72_channels_copies_vectors():
    """The sample detector's 72 → 48 1×1 layer in the resident GEMM, told its K and input pixel
    stride are multiples of 8 (IN_ALIGN): its input and weight rows arrive by asynchronous vector
    copies, where they were 128 byte loads a row tile."""
    byte_loads, copies = _compile_in_child(EIGHT_CHANNELS_CHILD).split()
    assert byte_loads == "0" and int(copies) > 0


# MobileNetV2's projection with its shortcut, batch 32 at 28 x 28: 1x1, 144 -> 24 INT8 channels,
# the 24-channel block input added back (a whole tensor, 24 bytes a pixel)
RESIDENT_RESIDUAL_CHILD = recorded_launch_child("sartor.kernels.gemm.resident", "_resident_gemm_kernel", """
from sartor.kernels.conv.igemm import pack_weight
x = torch.zeros(32, 144, 28, 28, dtype=torch.int8).contiguous(memory_format=torch.channels_last)
shortcut = torch.zeros(32, 24, 28, 28, dtype=torch.int8).contiguous(memory_format=torch.channels_last)
weight = pack_weight(torch.zeros(24, 144, 1, 1, dtype=torch.int8))
resident_gemm(x, weight, torch.zeros(24, dtype=torch.int32), RESIDENT_TILES[0], dequant_scale=torch.ones(24),
              residual=shortcut, residual_scale=0.05, input_inv_scale=10.0, output_inv_scale=10.0)
""", told="RES_ALIGN")


def test_resident_gemm_adds_a_24_channel_shortcut_in_vectors():
    """The residual's strides of 24 codes a pixel, told as multiples of 8 (RES_ALIGN): the shortcut
    is read without a load narrower than a vector (untold, a byte at a time)."""
    align, scalar_loads, *_ = _compile_in_child(RESIDENT_RESIDUAL_CHILD).split()
    assert align == "8" and scalar_loads == "0"



DEPTHWISE_CHILD = r"""
import re, sys
sys.path.insert(0, "bench")
import kernel_asm
from triton.backends.compiler import GPUTarget
from sartor.kernels.conv.depthwise import _depthwise_nhwc_kernel
from sartor.kernels.pointwise.epilogue import told_alignment
C, HW = 24, 80  # MobileNet's 24-channel depthwise 3x3, as the wrapper launches it (blocks of 128 x 32)
for int8 in (True, False):
    codes = "*i8" if int8 else "*fp16"
    values = dict(x_ptr=codes, w_ptr=codes, bias_ptr="*i32" if int8 else "*fp16", scale_ptr="*fp32", res_ptr=codes,
                  y_ptr=codes, P=32 * HW * HW, C=C, H=HW, W=HW, OH=HW, OW=HW, y_row=C, sxn=HW * HW * C, sxh=HW * C,
                  sxw=C, swc=1, swh=3 * C, sww=C, srn=0, src=0, srh=0, srw=0, pad_h=1, pad_w=1, in_inv_scale=1.0,
                  res_scale=1.0, out_inv_scale=20.0, qmin=-127.0, alpha=0.0, beta=0.0)
    constexprs = dict(KH=3, KW=3, SH=1, SW=1, DH=1, DW=1, INT8=int8, QUANTIZE_INPUT=False, HAS_BIAS=True,
                      HAS_RES=False, RES_QUANT=False, RES_AFTER=False, ACT=3, OUT_QUANT=int8, BLOCK_P=128,
                      BLOCK_C=32, CH_ALIGN=told_alignment(C, HW * HW * C, HW * C, C, C, 3 * C, C, 0, 0, 0))
    ptx = kernel_asm.compile_for(_depthwise_nhwc_kernel, values, constexprs, 4, 1, GPUTarget("cuda", 90, 32)).asm["ptx"]
    print(int8, kernel_asm.ptxas_report(ptx, 90)["spill_bytes"],
          len(re.findall(kernel_asm.PATTERNS["ld.scalar"], ptx)))
"""


def test_depthwise_kernel_over_24_channels_loads_vectors_without_spills():
    """The depthwise kernel on 24 channels (MobileNet's), told the channels and strides are
    multiples of 8 (CH_ALIGN): vector loads and no spills, INT8 and FP16. Untold, each element
    was its own load and the unrolled taps spilled (255 registers, 364–1,140 bytes)."""
    lines = [line.split() for line in _compile_in_child(DEPTHWISE_CHILD).splitlines()]
    assert [int8 for int8, _, _ in lines] == ["True", "False"]
    assert all(spills == "0" and scalar_loads == "0" for _, spills, scalar_loads in lines)


def depthwise_blocks_child(kernel: str, dtype: str, first_tile: str, tiles: str, launch: str,
                           sm90: dict | None = None) -> str:
    """A child that launches YOLO11n's class-branch depthwise 3×3 (64 channels of `dtype` at 80 × 80, batch 32,
    SiLU) in `first_tile`'s blocks and each of `tiles`' by `launch` (an expression of x, w, geometry and tile),
    compiles `kernel` for sm_90 as each launched it, and prints a line a tile: its elements and warps, the
    elements and warps launched, registers and spilled bytes."""
    return recorded_launch_child("sartor.kernels.conv.depthwise", kernel, f"""
x = torch.zeros(32, 64, 80, 80, dtype=torch.{dtype}).contiguous(memory_format=torch.channels_last)
w = pack_depthwise_weight(torch.zeros(64, 1, 3, 3, dtype=torch.{dtype}))
geometry = ConvGeometry((3, 3), (1, 1), (1, 1), (1, 1), (80, 80))
pointers = {{torch.int8: "*i8", torch.int32: "*i32", torch.float16: "*fp16", torch.float32: "*fp32"}}
for tile in ({first_tile},) + {tiles}:
    {launch}
    kwargs = launched["kwargs"]
    values = {{name: pointers[v.dtype] if isinstance(v, torch.Tensor) else v
              for name, v in zip(kernel.arg_names, launched["args"])}}
    constexprs = {{k: v for k, v in kwargs.items() if k in kernel.arg_names}} | {sm90 or {}!r}
    report = kernel_asm.ptxas_report(kernel_asm.compile_for(kernel, values, constexprs, kwargs["num_warps"], 1,
                                                            GPUTarget("cuda", 90, 32)).asm["ptx"], 90)
    blocks = kwargs["BLOCK_P"] * (kwargs["BLOCK_C"] if "BLOCK_C" in kwargs else 4 * kwargs["BLOCK_W"])
    print("tile", tile.elements, tile.warps, blocks, kwargs["num_warps"], report["registers"], report["spill_bytes"])
""")


def _tiles_in_fewer_registers_than_the_first(child: str, count: int) -> list:
    """Every tile of the child launched its own blocks and warps, without spills, the later ones in fewer
    registers a thread than the first."""
    rows = [list(map(int, line.split()[1:])) for line in _compile_in_child(child).splitlines()
            if line.startswith("tile ")]
    assert len(rows) == count
    (_, _, _, _, first_registers, _), *tiles = rows
    for elements, warps, launched_elements, launched_warps, registers, spills in rows:
        assert launched_elements == elements and launched_warps == warps and spills == 0
    assert all(registers < first_registers for *_, registers, _ in tiles)
    return rows


def test_depthwise_block_tiles_launch_their_blocks_in_fewer_registers_than_the_original():
    """Each of DEPTHWISE_TILES (FP16, the class branch stays float in YOLO11n's INT8 engine too) in fewer
    registers a thread than the original blocks' 32 elements a thread: more warps an SM for a kernel that waits
    on loads."""
    print(_tiles_in_fewer_registers_than_the_first(depthwise_blocks_child(
        "_depthwise_nhwc_kernel", "float16", "ORIGINAL_DEPTHWISE_TILE", "DEPTHWISE_TILES",
        'depthwise_conv_nhwc(x, w, torch.zeros(64, dtype=torch.float16), geometry, activation="SiLU", tile=tile)'),
        1 + 3))


def test_depthwise_words_tiles_launch_their_blocks_in_fewer_registers_than_the_words_tactic():
    """Each of DEPTHWISE_WORDS_TILES (INT8 codes as words: the class branch's entry) in fewer registers a thread
    than the words tactic's blocks (64 channels: one block of 64 of its 128)."""
    print(_tiles_in_fewer_registers_than_the_first(depthwise_blocks_child(
        "_depthwise_int8_words_kernel", "int8", "NAMED_DEPTHWISE_TILES[TRITON_DEPTHWISE_INT8_WORDS]",
        "DEPTHWISE_WORDS_TILES",
        'depthwise_qconv_nhwc(x, w, torch.zeros(64, dtype=torch.int32), geometry, dequant_scale=torch.ones(64), '
        'input_inv_scale=1.0, output_inv_scale=20.0, activation="SiLU", tile=tile)', sm90={"DP4A": True}), 1 + 2))


# YOLO11n's head depthwise 3×3 over 64 INT8 channels at 80 × 80, batch 32, as the words tactic launches it
DEPTHWISE_WORDS_CHILD = recorded_launch_child("sartor.kernels.conv.depthwise", "_depthwise_int8_words_kernel", """
x = torch.zeros(32, 64, 80, 80, dtype=torch.int8).contiguous(memory_format=torch.channels_last)
wq = pack_depthwise_weight(torch.zeros(64, 1, 3, 3, dtype=torch.int8))
geometry = ConvGeometry((3, 3), (1, 1), (1, 1), (1, 1), (80, 80))
depthwise_qconv_nhwc(x, wq, torch.zeros(64, dtype=torch.int32), geometry, dequant_scale=torch.ones(64),
                     input_inv_scale=1.0, output_inv_scale=20.0, activation="SiLU",
                     tile=NAMED_DEPTHWISE_TILES[TRITON_DEPTHWISE_INT8_WORDS])
""", sm90={"DP4A": True}, told="DP4A") + """
print(len(re.findall(r"dp4a\\.s32\\.s32", ptx)), kernel_asm.ptxas_report(ptx, 90)["spill_bytes"])
"""


def test_int8_depthwise_words_compile_to_one_dp4a_a_lane_and_tap_in_vector_loads():
    """The words tactic for sm_90: each tap's input words in vector loads, one dp4a per lane, word
    and tap (4 lanes × 9 taps × the words a thread holds), no spills."""
    told, scalar_loads, v2_loads, v4_loads, _, _, _, dp4a, spills = _compile_in_child(DEPTHWISE_WORDS_CHILD).split()
    assert told == "True" and spills == "0"
    assert int(v2_loads) + int(v4_loads) > 0 and int(dp4a) > 0 and int(dp4a) % (4 * 9) == 0
    print(scalar_loads, v2_loads, v4_loads, dp4a)


# YOLO11n's C2PSA positional conv (`attn.pe`, depthwise 3×3 over 128 channels at 20 × 20, batch 32) as INT8: its
# input is the attention's value, float16, quantized on load; a float16 residual, codes out
def depthwise_float_input_child(float_sums: bool) -> str:
    return recorded_launch_child("sartor.kernels.conv.depthwise", "_depthwise_nhwc_kernel", """
x = torch.zeros(32, 128, 20, 20, dtype=torch.float16).contiguous(memory_format=torch.channels_last)
wq = pack_depthwise_weight(torch.zeros(128, 1, 3, 3, dtype=torch.int8))
geometry = ConvGeometry((3, 3), (1, 1), (1, 1), (1, 1), (20, 20))
depthwise_qconv_nhwc(x, wq, torch.zeros(128, dtype=torch.int32), geometry, dequant_scale=torch.ones(128),
                     input_inv_scale=1.0, output_inv_scale=20.0, residual=torch.zeros_like(x))
assert launched["kwargs"]["QUANTIZE_INPUT"] and launched["kwargs"]["FLOAT_SUMS"]
""", sm90={"FLOAT_SUMS": float_sums}) + """
print(len(re.findall(r"cvt\\.r[nz]i\\.s(?:8|16|32)\\.f32", ptx)), kernel_asm.ptxas_report(ptx, 90)["spill_bytes"])
"""


def test_int8_depthwise_sums_a_float_inputs_codes_without_a_conversion_a_tap():
    """A float input quantized on load: its codes stay float32 values, summed exactly in float32, and are
    converted to integers once an output, not once a value and tap (a ninth of the float-to-integer
    conversions of the int32 sums, each an eighth of Hopper's float32 rate), without spills."""
    float_sums, spills = _compile_in_child(depthwise_float_input_child(True)).split()[-2:]
    int_sums = _compile_in_child(depthwise_float_input_child(False)).split()[-2]
    assert spills == "0" and 0 < int(float_sums) and 3 * int(float_sums) < int(int_sums)
    print(float_sums, int_sums)


# YOLO11n's C3k2 3×3 of 16 INT8 channels into 8 at 160 × 160, batch 32, SiLU, as each dp4a tactic launches it
def direct_words_child(tactic: str) -> str:
    return recorded_launch_child("sartor.kernels.conv.direct_words", "_direct_int8_words_kernel", f"""
x = torch.zeros(32, 16, 160, 160, dtype=torch.int8).contiguous(memory_format=torch.channels_last)
wq = torch.zeros(8, 16, 3, 3, dtype=torch.int8).contiguous(memory_format=torch.channels_last)
geometry = ConvGeometry((3, 3), (1, 1), (1, 1), (1, 1), (160, 160))
direct_int8_words_conv(x, wq, torch.zeros(8, dtype=torch.int32), geometry, dequant_scale=torch.ones(8),
                       output_inv_scale=20.0, activation="SiLU", tactic={tactic!r})
""", sm90={"DP4A": True}, told="DP4A") + """
print(len(re.findall(r"dp4a\\.s32\\.s32", ptx)), kernel_asm.ptxas_report(ptx, 90)["spill_bytes"],
      launched["kwargs"]["BLOCK_P"], launched["kwargs"]["BLOCK_CO"])
"""


@pytest.mark.parametrize("tactic", ["triton_direct_int8_words", "triton_direct_int8_word_tiles",
                                    "triton_direct_int8_word_tiles_wide"])
def test_int8_direct_words_compile_to_one_dp4a_a_word_tap_and_output(tactic):
    """The dense dp4a tactics for sm_90: one dp4a a word (4 for 16 channels), tap (9) and output pair a
    thread holds (a [BLOCK_P, BLOCK_CO] accumulator over 128 threads), no spills; a pixel's eight
    output codes stored as one vector. The tile forms load each tap's words in vectors: fewer scalar
    loads in all than the word steps (36), where the word-a-load form issues several a step."""
    told, ld_scalar, _, ld_v4, st_scalar, *_, dp4a, spills, block_p, block_co = _compile_in_child(
        direct_words_child(tactic)).split()
    assert told == "True" and spills == "0"
    assert int(dp4a) == 4 * 9 * int(block_p) * int(block_co) // 128
    assert int(st_scalar) == 0
    if "tiles" in tactic:
        assert int(ld_scalar) < 36 and int(ld_v4) >= 2 * 9
    else:
        assert int(ld_scalar) > 4 * 36
    print(tactic, ld_scalar, ld_v4, dp4a)


# YOLO's stem at batch 32 (a float32 image 3 × 640 × 640 into 16 INT8 channels, 3×3 at stride 2), as each stem
# tactic launches it on a GPU: min_programs asks the device, so the grid is left as the wrapper makes it on CPU
def direct_stem_child(tactic: str) -> str:
    return recorded_launch_child("sartor.kernels.conv.direct_stem", "_direct_stem_kernel", f"""
x = torch.zeros(32, 3, 640, 640)
words = tap_words(torch.zeros(16, 3, 3, 3, dtype=torch.int8))
geometry = ConvGeometry((3, 3), (2, 2), (1, 1), (1, 1), (320, 320))
direct_stem_conv(x, words, torch.zeros(16, dtype=torch.int32), geometry, dequant_scale=torch.ones(16),
                 input_inv_scale=50.0, output_inv_scale=20.0, activation="SiLU", tactic={tactic!r})
""", sm90={"DP4A": True}, told="DP4A") + """
print(len(re.findall(r"dp4a\\.s32\\.s32", ptx)), kernel_asm.ptxas_report(ptx, 90)["spill_bytes"],
      launched["kwargs"]["BLOCK_P"], launched["kwargs"]["BLOCK_CO"])
"""


@pytest.mark.parametrize("tactic", ["triton_direct_stem_int8", "triton_direct_stem_int8_wide"])
def test_int8_stem_compiles_to_one_dp4a_a_word_of_taps_and_output(tactic):
    """The stem tactics for sm_90: 27 taps are 7 words, one dp4a a word and output pair a thread holds
    ([BLOCK_P, 16] accumulators over 128 threads), no spills; the weight's words loaded as vectors
    (each word's 16 output channels: four 16-byte loads), a pixel's 16 codes stored as one."""
    told, ld_scalar, _, ld_v4, st_scalar, *_, dp4a, spills, block_p, block_co = _compile_in_child(
        direct_stem_child(tactic)).split()
    assert told == "True" and spills == "0" and block_co == "16"
    pixels_a_thread = int(block_p) * int(block_co) // 128 // 16
    assert int(dp4a) == 7 * int(block_p) * int(block_co) // 128
    assert int(ld_v4) >= 7 * 4 and int(ld_scalar) == 27 * pixels_a_thread  # the image's taps: one a pixel
    assert int(st_scalar) == 0
    print(tactic, ld_scalar, ld_v4, dp4a)


# YOLO's stem at batch 32 again, by the quads form (2 × 2 output pixels a thread, the weight a word a filter row)
STEM_QUADS_CHILD = recorded_launch_child("sartor.kernels.conv.direct_stem", "_direct_stem_quads_kernel", """
x = torch.zeros(32, 3, 640, 640)
rows = row_words(torch.zeros(16, 3, 3, 3, dtype=torch.int8))
geometry = ConvGeometry((3, 3), (2, 2), (1, 1), (1, 1), (320, 320))
direct_stem_conv(x, rows, torch.zeros(16, dtype=torch.int32), geometry, dequant_scale=torch.ones(16),
                 input_inv_scale=50.0, output_inv_scale=20.0, activation="SiLU", tactic=TRITON_DIRECT_STEM_INT8_QUADS)
""", sm90={"DP4A": True}) + """
report = kernel_asm.ptxas_report(ptx, 90)
print(len(re.findall(r"dp4a\\.s32\\.s32", ptx)), report["spill_bytes"], report["instructions"],
      launched["kwargs"]["BLOCK_Q"], launched["kwargs"]["BLOCK_CO"])
"""


def test_int8_stem_quads_quantize_each_input_value_of_a_quad_once():
    """The quads form for sm_90: a thread's quad reads 3 channels × 5 × 5 inputs (each one load and one
    quantization, against 4 × 27 for its four pixels one by one), a dp4a a filter row, pixel and
    output channel (4 × 9 × 16), no spills; fewer instructions a pixel than the wide form's."""
    *_, ld_scalar, _, _, _, _, _, dp4a, spills, instructions, block_q, block_co = _compile_in_child(
        STEM_QUADS_CHILD).split()
    assert spills == "0" and block_co == "16" and int(block_q) * 4 * 16 // 128 == 64  # a quad a thread
    assert int(ld_scalar) == 3 * 5 * 5 and int(dp4a) == 4 * 9 * 16
    wide = _compile_in_child(direct_stem_child("triton_direct_stem_int8_wide") + """
print(kernel_asm.ptxas_report(ptx, 90)["instructions"])
""").split()
    pixels_a_thread = int(wide[-3]) * int(wide[-2]) // 128 // 16
    assert int(instructions) / 4 < int(wide[-1]) / pixels_a_thread
    print(ld_scalar, dp4a, instructions, wide[-1])


def int8_chain_call(channels: int, stride: int, size: int, tile: str) -> str:
    """A child's call of an INT8 chain at batch 32: a 3×3 of `channels` → 32 at `stride` over `size` × `size`
    codes, then a 1×1 32 → 32, both with SiLU, on the tile the expression `tile` gives."""
    return f"""
from sartor.kernels.conv.igemm import pack_weight
x = torch.zeros(32, {channels}, {size}, {size}, dtype=torch.int8).contiguous(memory_format=torch.channels_last)
w1 = pack_weight(torch.zeros(32, {channels}, 3, 3, dtype=torch.int8))
first = ChainLayer(torch.zeros(32, dtype=torch.int32), torch.ones(32), "SiLU", input_inv_scale=1.0,
                   output_inv_scale=20.0)
second = ChainLayer(torch.zeros(32, dtype=torch.int32), torch.ones(32), "SiLU", output_inv_scale=20.0)
out = {size} // {stride}
conv_chain(x, w1, torch.zeros(32, 32, 1, 1, dtype=torch.int8),
           ConvGeometry((3, 3), ({stride}, {stride}), (1, 1), (1, 1), (out, out)), first, second, {tile})
"""


# A chain's first layer over 24 INT8 channels (3×3, 24 → 32 → 32, batch 32 at 80 × 80) on a tile whose 64-column K
# block does not divide them: the K walk a filter row a step (row_block)
CHAIN_ROWS_CHILD = recorded_launch_child("sartor.kernels.conv.chain", "_conv_chain_kernel", int8_chain_call(
    24, 1, 80, "CHAIN_TILES[0]") + """
assert launched["kwargs"]["ROW_TAPS"] == 24 and not launched["kwargs"]["GATHER"]
""", told="ROW_ALIGN") + """
print(*(len(re.findall(r"cp\\.async\\.c[ag]\\.shared\\.global[^;]*, 0x%d[,;]" % size, ptx)) for size in (4, 8, 16)),
      kernel_asm.ptxas_report(ptx, 90)["spill_bytes"])
"""


def test_chain_rows_of_24_channels_load_8_byte_runs():
    """A chain whose first layer has 24 INT8 channels walks K a filter row a step, told that each
    pixel's run of channels is 8-byte aligned (ROW_ALIGN 8): its activation and weight loads go as
    8-byte asynchronous copies, none a byte or a word at a time, without spills (the flat gather it
    replaced loaded bytes, in 165 registers)."""
    told, ld_scalar, *_, copies_4, copies_8, copies_16, spills = _compile_in_child(CHAIN_ROWS_CHILD).split()
    assert told == "8" and spills == "0"
    assert int(ld_scalar) == 0 and int(copies_4) == 0 and int(copies_8) > 0
    print(ld_scalar, copies_4, copies_8, copies_16)


# YOLO's first INT8 chain (16 → 32 channels 3×3 at stride 2, then a 1×1 32 → 32, batch 32 at 160 × 160) on the
# first tile as listed and as chain_tiles narrows it to the second layer's 32 outputs
def first_chain_child(tile: str) -> str:
    return recorded_launch_child("sartor.kernels.conv.chain", "_conv_chain_kernel",
                                 int8_chain_call(16, 2, 320, tile)) + """
report = kernel_asm.ptxas_report(ptx, 90)
print(launched["kwargs"]["BLOCK_N"], report["registers"], report["spill_bytes"], report["instructions"])
"""


def test_a_chain_tile_narrowed_to_32_outputs_spends_fewer_registers_and_instructions():
    """The second product and its SiLU epilogue over the 32 outputs alone (chain_tiles' narrowing):
    fewer registers and instructions than the listed 64-column tile, which masks off half of them."""
    wide = _compile_in_child(first_chain_child("CHAIN_TILES[0]")).split()[-4:]
    narrow = _compile_in_child(first_chain_child("chain_tiles(2, 32)[0]")).split()[-4:]
    assert wide[0] == "64" and narrow[0] == "32" and wide[2] == narrow[2] == "0"
    assert int(narrow[1]) < int(wide[1]) and int(narrow[3]) < int(wide[3])
    print(wide, narrow)


def test_yolo_s_first_chain_gathered_loads_its_taps_as_8_byte_copies():
    """The gathered tile at YOLO's first chain (16 channels a tap, two taps a 32-column K step, told as a
    power of two) loads its activations as 8-byte asynchronous copies, none narrower, without spills."""
    report = _compile_in_child(first_chain_child("chain_tiles(2, 32, 16, (3, 3))[-1]") + """
assert launched["kwargs"]["GATHER"] and launched["kwargs"]["C_TAPS"] == 16
print(*(len(re.findall(r"cp\\.async\\.c[ag]\\.shared\\.global[^;]*, 0x%d[,;]" % size, ptx)) for size in (4, 8, 16)))
""").split()
    block_n, registers, spills, instructions, copies_4, copies_8, copies_16 = report[-7:]
    assert block_n == "32" and spills == "0" and copies_4 == "0" and int(copies_8) > 0
    print(registers, instructions, copies_16)


# A mixed chain: a YOLO box branch's INT8 3×3 (64 → 64 channels, batch 32 at 80 × 80) writing float16 for its
# output head's 1×1 (64 → 64), which stays float
MIXED_CHAIN_CHILD = recorded_launch_child("sartor.kernels.conv.chain", "_conv_chain_kernel", """
from sartor.kernels.conv.igemm import pack_weight
x = torch.zeros(32, 64, 80, 80, dtype=torch.int8).contiguous(memory_format=torch.channels_last)
w1 = pack_weight(torch.zeros(64, 64, 3, 3, dtype=torch.int8))
first = ChainLayer(torch.zeros(64, dtype=torch.int32), torch.ones(64), "SiLU", input_inv_scale=1.0)
second = ChainLayer(torch.zeros(64, dtype=torch.float16), None)
conv_chain(x, w1, torch.zeros(64, 64, 1, 1, dtype=torch.float16),
           ConvGeometry((3, 3), (1, 1), (1, 1), (1, 1), (80, 80)), first, second, CHAIN_TILES[0])
assert launched["kwargs"]["SECOND_FLOAT"] and launched["kwargs"]["INT8"]
""") + """
print(len(re.findall(r"mma[^;]*\\.s8\\.s8", ptx)), len(re.findall(r"mma[^;]*\\.f16\\.f16", ptx)),
      kernel_asm.ptxas_report(ptx, 90)["spill_bytes"])
"""


def test_mixed_chain_multiplies_int8_codes_then_float16_on_the_tensor_cores():
    """A mixed chain's first product runs on INT8 codes and its second on float16, both on the tensor
    cores, without spills: the INT8 layer's speed for the 3×3 that holds most of a branch's work,
    the float head's numbers for its 1×1."""
    *_, int8_products, float16_products, spills = _compile_in_child(MIXED_CHAIN_CHILD).split()
    assert int(int8_products) > 0 and int(float16_products) > 0 and spills == "0"
    print(int8_products, float16_products)


# The sample detector's SPPF, batch 32: 96 INT8 channels of a 384-channel Concat buffer at 10 x 10,
# each pool reading one slice and writing the next
SPPF_POOL_CHILD = recorded_launch_child("sartor.kernels.pool.max_pool", "_max_pool_nhwc_kernel", """
buffer = torch.zeros(32, 384, 10, 10, dtype=torch.int8).contiguous(memory_format=torch.channels_last)
max_pool_nhwc(buffer[:, 96:192], (5, 5), (1, 1), (2, 2), (1, 1), (10, 10), out=buffer[:, 192:288], tile=SMALL_POOL_TILE)
assert launched["kwargs"]["CODE_WORDS"]
""", sm90={"PACKED_MAX": True})


def test_int8_sppf_pool_over_24_words_loads_vectors():
    """The sample detector's SPPF pools 96 INT8 channels as 24 words of four codes. Triton sees no
    factor in 24, so the channel mask split every load into single words (50 a thread, against 25
    16-byte loads for FP16's 96 halves); told 8 (CH_ALIGN, from the wrapper's own launch), each tap
    is one vector load."""
    align, scalar_loads, v2_loads, v4_loads, *_ = _compile_in_child(SPPF_POOL_CHILD).split()
    assert align == "8" and scalar_loads == "0"
    assert int(v2_loads) + int(v4_loads) == 25  # one per tap of the 5 × 5 window



# ResNet's stem pool (3×3, stride 2, padding 1) over 70 INT8 channels: codes pooled one by one (70 is no
# multiple of four), two to a 16-bit load as the channel alignment allows
POOL_CODES_CHILD = recorded_launch_child("sartor.kernels.pool.max_pool", "_max_pool_nhwc_kernel", """
x = torch.zeros(2, 70, 11, 9, dtype=torch.int8).contiguous(memory_format=torch.channels_last)
max_pool_nhwc(x, (3, 3), (2, 2), (1, 1), (1, 1), (6, 5))
assert not launched["kwargs"]["CODE_WORDS"]
""") + """
presets = re.findall(r"mov\\.u(16|32) %\\w+, (\\S+);\\s*@!?%p\\d+ ld\\.global\\.b(?:16|32)", ptx)
print(len(presets), *sorted({value for _, value in presets}))
"""


def test_int8_pool_masked_lanes_read_the_lowest_code_in_every_lane():
    """A masked tap must read -128 in every code of a vector load. Triton spreads a constant `other` over
    a load's lanes sign-extended, so other=-128 preset 16-bit loads with 0xFF80: the second code read -1
    and beat every negative code at a padded border (the GPU tests failed; the interpreter loads each code
    alone). The kernel's lowest code is computed, so each preset is a register holding 0x8080."""
    loads, *presets = _compile_in_child(POOL_CODES_CHILD).splitlines()[-1].split()
    assert int(loads) > 0
    assert all(value.startswith("%") for value in presets), presets

# YOLO's SPPF at batch 1: 128 INT8 channels (32 words) of a 512-channel Concat buffer at 20 × 20, the
# first pool reading one slice and writing the next, by the small-pool tile as Hopper launches it
# (the packed maximum) and by its loads-first form.
SPPF_LOAD_ORDER_CHILD = """
import sys
sys.path.insert(0, "bench")
import torch, kernel_asm
from triton.backends.compiler import GPUTarget
import sartor.kernels.pool.max_pool as module
from sartor.kernels.pool.max_pool import SMALL_POOL_LOADS_FIRST, SMALL_POOL_TILE, max_pool_nhwc
launches = []
class Recorder:
    def __getitem__(self, grid):
        return lambda *args, **kwargs: launches.append((args, kwargs))
kernel, module._max_pool_nhwc_kernel = module._max_pool_nhwc_kernel, Recorder()
module._has_packed_max = lambda device: True  # as on sm_90: the wrapper decides each tile's PACKED_MAX
buffer = torch.zeros(1, 512, 20, 20, dtype=torch.int8).contiguous(memory_format=torch.channels_last)
for tile in (SMALL_POOL_TILE, SMALL_POOL_LOADS_FIRST):
    max_pool_nhwc(buffer[:, :128], (5, 5), (1, 1), (2, 2), (1, 1), (20, 20), out=buffer[:, 128:256], tile=tile)
for args, kwargs in launches:
    values = {name: "*i32" if isinstance(v, torch.Tensor) else v for name, v in zip(kernel.arg_names, args)}
    constexprs = {k: v for k, v in kwargs.items() if k in kernel.arg_names}
    assert constexprs["CODE_WORDS"]
    target = GPUTarget("cuda", 90, 32)
    ptx = kernel_asm.compile_for(kernel, values, constexprs, kwargs["num_warps"], 1, target).asm["ptx"]
    report, sass = kernel_asm.assemble(ptx, 90)
    loads = sum(op == "LDG" for _, op, _ in kernel_asm.sass_instructions(sass))
    print(kernel_asm.loads_before(sass, ("VIMNMX", "VIMNMX3")), loads,
          "spill" if " 0 bytes spill stores" not in report else "no-spill")
"""


def test_the_loads_first_pool_tile_issues_every_tap_before_its_first_maximum():
    """YOLO's SPPF pool at batch 1 runs 50 programs for 132 SMs: each thread's 25 taps are all the
    latency hiding it has. With PTX's packed 16-bit maximum (inline assembly) the compiler keeps each
    load beside its maximum, a few loads in flight; the loads-first tile compares the lanes in plain
    integer steps, and the compiler issues nearly every load before the first maximum, still without
    spills. (On Triton 3.6 and 3.9: 3 against 24 of 25.)"""
    (packed_first, packed_loads, packed_spill), (plain_first, plain_loads, plain_spill) = (
        line.split() for line in _compile_in_child(SPPF_LOAD_ORDER_CHILD).split("\n") if line)
    assert packed_loads == plain_loads == "25" and packed_spill == plain_spill == "no-spill"
    assert int(packed_first) <= 5 and int(plain_first) >= 20

# A neck's ×2 upsample of 40 FP16 channels at 20 × 20, batch 32, into the first 40 channels of a
# 120-channel Concat buffer (MobileNet- and EfficientNet-width necks have 24, 40 and 112)
RESIZE_CHILD = recorded_launch_child("sartor.kernels.pointwise.resize", "_upsample_nearest_nhwc_kernel", """
x = torch.zeros(32, 40, 20, 20, dtype=torch.float16).contiguous(memory_format=torch.channels_last)
buffer = torch.zeros(32, 120, 40, 40, dtype=torch.float16).contiguous(memory_format=torch.channels_last)
upsample_nearest_nhwc(x, (2, 2), out=buffer[:, :40])
""")


def test_upsample_of_40_channels_into_a_concat_slice_moves_vectors():
    """Told that 40 channels and the 120-channel buffer's pixel stride are multiples of 8
    (CH_ALIGN), the upsample loads and stores 16-byte vectors; untold, each half went alone."""
    align, scalar_loads, _, v4_loads, scalar_stores, _, v4_stores = _compile_in_child(RESIZE_CHILD).split()
    assert align == "8" and scalar_loads == "0" and scalar_stores == "0"
    assert int(v4_loads) > 0 and int(v4_stores) > 0



# The kernels between a detector's convolutions and its few-channel convolutions, each as its wrapper
# launches it with pdl=True: YOLO's SPPF pool (INT8 words; FP16), its neck's ×2 upsample, the INT8 stem on
# the CUDA cores, the dp4a convolution of 16 channels, the INT8 depthwise code by code and in words, and the
# float depthwise.
PDL_SMALL_KERNELS_CHILD = r"""
import re, sys
sys.path.insert(0, "bench")
import torch, kernel_asm
from triton.backends.compiler import GPUTarget
import sartor.kernels.pool.max_pool as pool, sartor.kernels.pointwise.resize as resize
import sartor.kernels.conv.direct_stem as stem, sartor.kernels.conv.direct_words as words
import sartor.kernels.conv.depthwise as depthwise
from sartor.kernels.conv.igemm import ConvGeometry
launches = []
def record(module, name):
    kernel = getattr(module, name)
    class Recorder:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: launches.append((name, kernel, args, kwargs))
    setattr(module, name, Recorder())
for module, name in ((pool, "_max_pool_nhwc_kernel"), (resize, "_upsample_nearest_nhwc_kernel"),
                     (stem, "_direct_stem_kernel"), (stem, "_direct_stem_quads_kernel"),
                     (words, "_direct_int8_words_kernel"),
                     (depthwise, "_depthwise_nhwc_kernel"), (depthwise, "_depthwise_int8_words_kernel")):
    record(module, name)
def nhwc(*shape, dtype=torch.int8):
    return torch.zeros(*shape, dtype=dtype).contiguous(memory_format=torch.channels_last)
codes, halves = nhwc(1, 128, 20, 20), nhwc(1, 128, 20, 20, dtype=torch.float16)
pool.max_pool_nhwc(codes, (5, 5), (1, 1), (2, 2), (1, 1), (20, 20), pdl=True)
pool.max_pool_nhwc(halves, (5, 5), (1, 1), (2, 2), (1, 1), (20, 20), pdl=True)
resize.upsample_nearest_nhwc(codes, (2, 2), pdl=True)
same = ConvGeometry((3, 3), (1, 1), (1, 1), (1, 1), (20, 20))
epilogue = dict(dequant_scale=torch.ones(16), output_inv_scale=20.0, activation="SiLU", pdl=True)
stem.direct_stem_conv(torch.zeros(1, 3, 40, 40), stem.tap_words(torch.zeros(16, 3, 3, 3, dtype=torch.int8)),
                      torch.zeros(16, dtype=torch.int32), ConvGeometry((3, 3), (2, 2), (1, 1), (1, 1), (20, 20)),
                      input_inv_scale=50.0, **epilogue)
stem.direct_stem_conv(torch.zeros(1, 3, 40, 40), stem.row_words(torch.zeros(16, 3, 3, 3, dtype=torch.int8)),
                      torch.zeros(16, dtype=torch.int32), ConvGeometry((3, 3), (2, 2), (1, 1), (1, 1), (20, 20)),
                      input_inv_scale=50.0, tactic=stem.TRITON_DIRECT_STEM_INT8_QUADS, **epilogue)
words.direct_int8_words_conv(nhwc(1, 16, 20, 20), nhwc(16, 16, 3, 3), torch.zeros(16, dtype=torch.int32), same,
                             tactic="triton_direct_int8_word_tiles", **epilogue)
wq = depthwise.pack_depthwise_weight(torch.zeros(16, 1, 3, 3, dtype=torch.int8))
for in_words in (False, True):
    depthwise.depthwise_qconv_nhwc(nhwc(1, 16, 20, 20), wq, torch.zeros(16, dtype=torch.int32), same,
                                   input_inv_scale=1.0, **epilogue,
                                   tile=depthwise.depthwise_tile_for("triton_depthwise_int8_words" if in_words else None))
depthwise.depthwise_conv_nhwc(nhwc(1, 16, 20, 20, dtype=torch.float16),
                              depthwise.pack_depthwise_weight(torch.zeros(16, 1, 3, 3, dtype=torch.float16)),
                              torch.zeros(16, dtype=torch.float16), same, activation="SiLU", pdl=True)
pointer = {torch.int32: "*i32", torch.int8: "*i8", torch.uint8: "*u8", torch.float16: "*fp16", torch.float32: "*fp32"}
GLOBAL = re.compile(r"\b(ld\.global|st\.global|cp\.async|atom\.global|red\.global)")
for name, kernel, args, kwargs in launches:
    values = {n: pointer[v.dtype] if isinstance(v, torch.Tensor) else v for n, v in zip(kernel.arg_names, args)}
    constexprs = {k: v for k, v in kwargs.items() if k in kernel.arg_names}
    ptx = kernel_asm.compile_for(kernel, values, constexprs, kwargs.get("num_warps", 4), 1, GPUTarget("cuda", 90, 32),
                                 pdl=kwargs.get("launch_pdl", False)).asm["ptx"]
    waits = [m.start() for m in re.finditer(r"griddepcontrol\.wait", ptx)]
    triggers = len(re.findall(r"griddepcontrol\.launch_dependents", ptx))
    print(name, constexprs.get("PDL"), len(waits), triggers, len(GLOBAL.findall(ptx[:waits[0]] if waits else ptx)))
"""


def test_pool_upsample_stem_dp4a_and_depthwise_kernels_wait_before_touching_memory_under_pdl():
    """Asked for programmatic dependent launch, each of these wrappers launches its kernel with it (PDL
    and the launch option), and the compiled sm_90 kernel waits once for the kernel before it, then lets
    the next one launch, before any global load or store: an overlap never reads an activation early."""
    lines = [line.split() for line in _compile_in_child(PDL_SMALL_KERNELS_CHILD).splitlines()]
    assert [name for name, *_ in lines] == [
        "_max_pool_nhwc_kernel", "_max_pool_nhwc_kernel", "_upsample_nearest_nhwc_kernel", "_direct_stem_kernel",
        "_direct_stem_quads_kernel", "_direct_int8_words_kernel", "_depthwise_nhwc_kernel", "_depthwise_int8_words_kernel",
        "_depthwise_nhwc_kernel"]
    assert all(rest == ["True", "1", "1", "0"] for _, *rest in lines), lines


ELEMENTWISE_EPILOGUE_CHILD = r"""
import re, sys
sys.path.insert(0, "bench")
import kernel_asm
from triton.backends.compiler import GPUTarget
from sartor.kernels.pointwise.epilogue import _epilogue_kernel, told_alignment
for channels in (64, 24):
    block_c = 64 if channels == 64 else 32
    values = dict(y_ptr="*fp16", bias_ptr="*fp16", res_ptr="*fp16", out_ptr="*fp16", pixels=32 * 80 * 80,
                  channels=channels, res_row=channels, out_row=channels, alpha=0.0, beta=0.0)
    constexprs = dict(HAS_BIAS=True, HAS_RES=True, RES_AFTER=False, ACT=3, BLOCK_P=1024 // block_c,
                      BLOCK_C=block_c, CH_ALIGN=told_alignment(channels, channels, channels))
    ptx = kernel_asm.compile_for(_epilogue_kernel, values, constexprs, 4, 1, GPUTarget("cuda", 90, 32)).asm["ptx"]
    print(channels, len(re.findall(r"\b(?:div|rem)\.[su](?:32|64)", ptx)), len(re.findall(kernel_asm.PATTERNS["ld.scalar"], ptx)))
"""


def test_elementwise_epilogue_divides_nothing_per_element():
    """The epilogue after a library convolution (FP16 engines' cuDNN layers), tiled by pixels and
    channels: no integer division or remainder (a flat index divided by the channel count took two
    64-bit divisions a value), and at 24 channels, told their alignment, no scalar loads."""
    lines = [line.split() for line in _compile_in_child(ELEMENTWISE_EPILOGUE_CHILD).splitlines()]
    assert lines == [["64", "0", "0"], ["24", "0", "0"]]


YOLO_DECODE_CHILD = r"""
import sys
sys.path.insert(0, "bench")
import kernel_asm
from triton.backends.compiler import GPUTarget
from sartor.kernels.pointwise.yolo_head import _yolo_decode_kernel
values = dict(out_ptr="*fp32", NC=80, anchors=8400, first1=100, first2=125, start0=0, start1=6400, start2=8000)
for i, (pixels, width, stride) in enumerate([(6400, 80, 8.0), (1600, 40, 16.0), (400, 20, 32.0)]):
    values.update({f"box{i}": "*fp16", f"cls{i}": "*fp16", f"hw{i}": pixels, f"w{i}": width, f"stride{i}": stride,
                   f"sb{i}n": 144 * pixels, f"sb{i}c": 1, f"sb{i}h": 144 * width, f"sb{i}w": 144,
                   f"sc{i}n": 144 * pixels, f"sc{i}c": 1, f"sc{i}h": 144 * width, f"sc{i}w": 144})
for scales in (1, 3):
    ptx = kernel_asm.compile_for(_yolo_decode_kernel, values, dict(SCALES=scales, R=16, BLOCK_A=64, BLOCK_C=32), 4, 3,
                                 GPUTarget("cuda", 90, 32)).asm["ptx"]
    report = kernel_asm.ptxas_report(ptx, 90)
    print(scales, report["spill_bytes"], report["instructions"])
"""


def test_yolo_decode_of_three_scales_compiles_for_sm90_as_three_one_scale_bodies():
    """YOLOv8n's head (80 classes, FP16 logits in one channels-last buffer, float32 out) in one
    launch: no spills, and the three scales' code about three times one scale's, the branch on the
    block costing nothing beside it."""
    (one, one_spills, one_count), (three, three_spills, three_count) = (
        line.split() for line in _compile_in_child(YOLO_DECODE_CHILD).splitlines())
    assert (one, three, one_spills, three_spills) == ("1", "3", "0", "0")
    assert 2.5 * int(one_count) < int(three_count) < 3.2 * int(one_count)


PDL_CHILD = r"""
import re, sys
sys.path.insert(0, "bench")
import kernel_asm
from triton.backends.compiler import GPUTarget
from sartor.kernels.gemm.resident import resident_tactics
GLOBAL = re.compile(r"\b(ld\.global|st\.global|cp\.async|atom\.global|red\.global|cp\.reduce)")
wanted = {"yolo.b1.c128": ("igemm.64x64x64.w4.s4", "igemm.64x64x64.w4.s4.split4.last-reduces",
                           "igemm.128x128x64.w8.s3.halves.residual-early"),
          "layer1.conv3": tuple(resident_tactics(1)[:1]),
          "yolo-stem": ("window_resident.64x64.t8.w4.s2.kh-steps", "window_resident.64x64.t8.w4.s2")}
for layer, labels in wanted.items():
    for label, fn, values, constexprs, warps, stages in kernel_asm.layer_cases(layer, split_k=4):
        if label not in labels:
            continue
        if label.endswith("residual-early"):
            constexprs = dict(constexprs, HAS_RES=True, RES_QUANT=True, RES_EARLY=True)
        target = GPUTarget("cuda", 90, 32)
        ptx = kernel_asm.compile_for(fn, values, constexprs, warps, stages, target, pdl=True).asm["ptx"]
        waits = [m.start() for m in re.finditer(r"griddepcontrol\.wait", ptx)]
        before = [m.group(1) for m in GLOBAL.finditer(ptx[:waits[0]])] if waits else []
        print(layer, label, len(waits), len([b for b in before if b == "ld.global"]), len(before))
"""


def test_pdl_kernels_touch_only_constants_before_they_wait():
    """Launched with programmatic dependent launch, a kernel may start while the one before it ends:
    the implicit GEMM (plain, split-K ended by the last share, residual loaded early) touches no
    global memory before its one `griddepcontrol.wait`; the resident GEMM and the stem's window tiles
    (both walks) load only their weight tile before it, and store nothing."""
    lines = [line.split() for line in _compile_in_child(PDL_CHILD).splitlines()]
    by_label = {(layer, label): (int(waits), int(loads), int(accesses))
                for layer, label, waits, loads, accesses in lines}
    assert len(by_label) == 6, lines
    for (layer, label), (waits, loads, accesses) in by_label.items():
        assert waits == 1, label
        if layer == "yolo.b1.c128":
            assert accesses == 0, label
        else:  # the constants load early, nothing else is touched
            assert loads > 0 and accesses == loads, label
