"""bench/launch_floor.py: the chain its graphs hold, and its refusals."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))

pytest.importorskip("triton")
import launch_floor  # noqa: E402


def test_each_kernel_of_the_chain_adds_one_to_every_word_of_every_program():
    """What a replay is checked by (and what makes each kernel wait for the last): n kernels add n."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    buffer = torch.zeros(3 * 8, dtype=torch.int32, device=device)
    launch_floor.chain(buffer, 5, programs=3)
    assert buffer.tolist() == [5] * 24
    weights = torch.zeros(3 * 64, dtype=torch.int8, device=device)  # read before or after the wait, adding nothing
    for early in (False, True):
        launch_floor.chain(buffer, 2, programs=3, constant=weights, early=early)
    assert buffer.tolist() == [9] * 24


@pytest.mark.parametrize("argv,message", [
    (["--kernels", "0"], "whole numbers from 1"),
    (["--bytes", "12"], "power of two"),
    (["--constant-bytes", "100"], "--constant-bytes 100: a power of two"),
])
def test_bad_arguments_are_refused_with_the_reason(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        launch_floor.main(argv)
    assert exit_.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal of a machine without a GPU")
def test_without_a_gpu_it_says_the_floor_is_the_gpus(capsys):
    with pytest.raises(SystemExit):
        launch_floor.main(["--kernels", "2"])
    assert "needs a CUDA GPU" in capsys.readouterr().err
