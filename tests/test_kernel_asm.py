"""What the INT8 kernels compile to for Hopper, checked on any machine (Triton compiles for sm_90
with the ptxas its wheel ships; bench/kernel_asm.py): the quantization's rounding by adding and
subtracting 1.5·2^23 must survive compilation as two IEEE additions; a compiler that folded them
(fast-math reassociation) would truncate instead of rounding to nearest even. The resident-window
kernel of the stem compiles in both its forms (one product over padded K; the weight held as a
tuple of filter rows) to Hopper's tensor-core instructions without spills.

The compile runs in a child process: this test session may run Triton's interpreter, under which
the kernels are not compilable objects."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")
ROOT = Path(__file__).resolve().parents[1]

CHILD = r"""
import re, sys
sys.path.insert(0, "bench")
import kernel_asm
from triton.backends.compiler import GPUTarget
label, fn, values, constexprs, warps, stages = kernel_asm.layer_cases("layer1.conv2")[1]
ptx = kernel_asm.compile_for(fn, values, constexprs, warps, stages, GPUTarget("cuda", 90, 32)).asm["ptx"]
added = re.findall(r"add\.rn\.f32\s+(%r\d+), %r\d+, 0f4B400000;", ptx)  # + 1.5*2^23
subtracted = re.findall(r"add\.rn\.f32\s+%r\d+, (%r\d+), 0fCB400000;", ptx)  # - 1.5*2^23
print(len(added), sorted(added) == sorted(subtracted), "wgmma.mma_async" in ptx)
"""

STEM_CHILD = r"""
import sys
sys.path.insert(0, "bench")
import kernel_asm
from triton.backends.compiler import GPUTarget
from sartor.kernels.window_resident import window_resident_tiles
names = ["window_" + tile.name for tile in window_resident_tiles(1)]
for label, fn, values, constexprs, warps, stages in kernel_asm.layer_cases("stem"):
    if label in names:
        ptx = kernel_asm.compile_for(fn, values, constexprs, warps, stages, GPUTarget("cuda", 90, 32)).asm["ptx"]
        print(label, kernel_asm.ptxas_report(ptx, 90)["spill_bytes"], "wgmma.mma_async" in ptx)
"""


def _compile_in_child(code: str) -> str:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def test_int8_rounding_survives_compilation_for_sm90():
    count, paired, hopper = _compile_in_child(CHILD).split()
    assert int(count) > 0 and paired == "True"  # every rounding's add has its subtract
    assert hopper == "True"  # Hopper's tensor-core instructions, not a fallback


def test_resident_window_kernel_compiles_for_sm90_in_both_forms():
    lines = [line.split() for line in _compile_in_child(STEM_CHILD).splitlines()]
    assert [label.endswith("_kh") for label, _, _ in lines] == [False, True]
    assert all(spills == "0" and hopper == "True" for _, spills, hopper in lines)
