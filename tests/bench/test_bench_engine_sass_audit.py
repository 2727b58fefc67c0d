"""bench/engine_sass_audit.py: an engine's embedded cubins disassembled and their global accesses
counted by width, on a machine without a GPU."""
from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")
ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

from engine_sass_audit import memory_widths  # noqa: E402
from sartor.runtime.engine_file import pack  # noqa: E402
from sartor.runtime.kernel_store import KernelEntry, entry_key, pack_kernels  # noqa: E402

# The SPPF pool over 24 words of INT8 codes, compiled for sm_90 untold (CH_ALIGN 1) and told (8).
COMPILE_CHILD = r"""
import os, sys
sys.path.insert(0, "bench")
import kernel_asm
from triton.backends.compiler import GPUTarget
from sartor.kernels.pool.max_pool import _max_pool_nhwc_kernel
values = dict(x_ptr="*i32", y_ptr="*i32", P=3200, C=24, H=10, W=10, OH=10, OW=10, y_row=96, sxn=9600, sxh=960,
              sxw=96, pad_h=2, pad_w=2)
for align in (1, 8):
    constexprs = dict(KH=5, KW=5, SH=1, SW=1, DH=1, DW=1, BLOCK_P=16, BLOCK_C=16, CODE_WORDS=True, PACKED_MAX=True,
                      CH_ALIGN=align)
    kernel = kernel_asm.compile_for(_max_pool_nhwc_kernel, values, constexprs, 4, 1, GPUTarget("cuda", 90, 32))
    open(os.path.join(os.environ["OUT_DIR"], f"align{align}.cubin"), "wb").write(kernel.asm["cubin"])
"""


@pytest.fixture(scope="module")
def cubins(tmp_path_factory) -> dict[int, bytes]:
    out = tmp_path_factory.mktemp("cubins")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(OUT_DIR=str(out), PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")])))
    done = subprocess.run([sys.executable, "-c", COMPILE_CHILD], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return {align: (out / f"align{align}.cubin").read_bytes() for align in (1, 8)}


def test_widths_are_read_from_opcodes_and_tma_is_apart():
    sass = "\n".join(f"        /*{i:04x}*/                   {op} R0, desc[UR4][R2.64] ;" for i, op in enumerate((
        "LDG.E", "LDG.E.128", "@P0 LDG.E.U8", "STG.E.64", "LDGSTS.E.BYPASS.LTC128B.128", "UTMALDG.2D", "IMAD.WIDE")))
    assert memory_widths(sass) == {("LDG", 32): 1, ("LDG", 128): 1, ("LDG", 8): 1, ("STG", 64): 1,
                                   ("LDGSTS", 128): 1, ("UTMALDG", 0): 1}


def test_an_engines_kernels_are_ranked_by_their_narrow_accesses(cubins, tmp_path):
    entries = []
    for align, cubin in cubins.items():
        name = f"_max_pool_nhwc_kernel_align{align}"
        key = entry_key(hashlib.sha256(cubin).hexdigest())
        entries.append(KernelEntry(key, name, "3.9.0", "90", {f"{name}.json": b"{}", f"{name}.cubin": cubin}))
    record, tensors = pack_kernels(entries, "3.9.0")
    plan = tmp_path / "pools.plan"
    plan.write_bytes(pack({"kernels": record}, tensors))
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "engine_sass_audit.py"), str(plan), "--all"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.splitlines()
    assert lines[0].startswith("2 kernels; 1 with global accesses of 32 bits or less")
    untold, told = lines[1].split(), lines[2].split()
    assert untold[4] == "_max_pool_nhwc_kernel_align1" and int(untold[0]) >= 50  # the 25 taps' two words each
    assert told[4] == "_max_pool_nhwc_kernel_align8" and told[0] == "0" and int(told[2]) >= 25


def test_an_engine_without_kernels_says_so(tmp_path):
    plan = tmp_path / "cpu.plan"
    plan.write_bytes(pack({"kernels": {"embedded": False, "reason": "a CPU engine", "entries": [], "bytes": 0}}, {}))
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "engine_sass_audit.py"), str(plan)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 1 and "carries no kernels" in done.stderr
