"""bench/engine_on_other_gpu.py (issue 36): its refusal without two GPUs, and the forged copies its
fingerprint checks load."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import engine_on_other_gpu  # noqa: E402
import sartor  # noqa: E402
from sartor.errors import FingerprintMismatchError  # noqa: E402
from sartor.runtime.engine_file import unpack  # noqa: E402


@pytest.mark.skipif(torch.cuda.device_count() >= 2, reason="the refusal of a machine without two GPUs")
def test_without_two_gpus_it_says_so(tmp_path, capsys):
    assert engine_on_other_gpu.main(["--out", str(tmp_path)]) == 2
    assert "needs two CUDA devices" in capsys.readouterr().err


def test_a_forged_copy_differs_in_its_fingerprint_alone_and_is_refused_naming_the_field(tiny_plan, tmp_path):
    forged = engine_on_other_gpu.forged_copy(tiny_plan, "kind", "cuda", tmp_path / "forged.plan")
    with pytest.raises(FingerprintMismatchError) as refusal:
        sartor.load(str(forged), device="cpu")
    assert engine_on_other_gpu.refuses_for(str(refusal.value), "kind")
    assert not engine_on_other_gpu.refuses_for(str(refusal.value), "gpu")
    original = sartor.load(str(tiny_plan), device="cpu").header
    copy, _ = unpack(forged.read_bytes())
    assert copy["fingerprint"] == dict(original["fingerprint"], kind="cuda")
    assert {k: v for k, v in copy.items() if k != "fingerprint"} == {
        k: v for k, v in original.items() if k != "fingerprint"}
