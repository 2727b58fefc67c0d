"""Triton cache keys of sartor's kernels are complete and the same in every process, whatever it
imports or compiles first (kernels/common/cache_keys.py): the kernels an engine carries are then
the ones its first run looks up. Checked in fresh processes without the interpreter, where the
functions are compiled ones (hashing needs no GPU)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

_PROBE = r"""
import importlib, json, sys
from triton.runtime.jit import JITFunction
from sartor.kernels.registry import FAMILY_MODULES
from sartor.kernels.common.cache_keys import _callees
modules = list(FAMILY_MODULES)
if sys.argv[1] == "reversed":
    modules.reverse()
for name in modules:
    importlib.import_module(name)
rows = {}
for name, module in sorted(sys.modules.items()):
    if not name.startswith("sartor.kernels") or module is None:
        continue
    for attr, fn in vars(module).items():
        if isinstance(fn, JITFunction) and fn.__module__ == name:
            own = {g for g, _ in fn.used_global_vals} if fn.hash is not None else set()
            # Triton's own library functions (tl.sort, ...) are left out: their source is in the
            # Triton hash every compiled kernel's key carries, and Triton merges none of their globals.
            ours = [c for c in _callees(fn, JITFunction) if not c.__module__.startswith("triton.")]
            missing = sorted({g for c in ours for g, _ in c.used_global_vals} - own)
            rows[f"{name}.{attr}"] = {"hash": fn.hash, "missing_callee_globals": missing}
print(json.dumps(rows))
"""


def _keys(order: str) -> dict:
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT)
    run = subprocess.run([sys.executable, "-c", _PROBE, order], env=env, capture_output=True, text=True,
                         timeout=300, check=False)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def test_every_kernel_function_is_hashed_at_import_with_its_callees_globals():
    rows = _keys("registry")
    assert len(rows) > 20  # the families' Triton functions were found at all
    unhashed = [name for name, row in rows.items() if row["hash"] is None]
    assert not unhashed, f"not hashed at import (settle_cache_keys(globals()) missing at the module's end): {unhashed}"
    incomplete = {name: row["missing_callee_globals"] for name, row in rows.items() if row["missing_callee_globals"]}
    assert not incomplete, f"keys lacking globals their callees use: {incomplete}"


def test_cache_keys_do_not_depend_on_import_order():
    forward, backward = _keys("registry"), _keys("reversed")
    assert {n: r["hash"] for n, r in forward.items()} == {n: r["hash"] for n, r in backward.items()}
