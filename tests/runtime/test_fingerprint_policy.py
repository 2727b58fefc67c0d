"""The fingerprint's compatibility levels: per field, which difference refuses a load and which only
warns, at strict, default and loose; the override by argument, $SARTOR_FINGERPRINT and the CLI flag;
the warning logged once per load; refusals naming both sides and the rebuild."""
from __future__ import annotations

import json
import logging

import numpy as np
import pytest

import sartor
from sartor.errors import ConfigError, FingerprintMismatchError
from sartor.runtime.engine_file import pack, unpack
from sartor.runtime.fingerprint import compare_fingerprints, compatibility_level

GPU = {"kind": "cuda", "gpu": "NVIDIA H200", "compute_capability": "9.0", "driver": "570.86.15", "cuda": "12.8",
       "triton": "3.3.1", "torch": "2.7.1+cu128", "sartor": "0.1.0"}
CPU = {"kind": "cpu", "cpu": "AMD EPYC 9654", "arch": "x86_64", "torch": "2.7.1+cpu", "sartor": "0.1.0"}

# (field, value elsewhere, what strict / default / loose do with the difference)
CASES = [
    (GPU, "kind", "cpu", "refuse", "refuse", "refuse"),
    (GPU, "compute_capability", "8.0", "refuse", "refuse", "refuse"),
    (GPU, "gpu", "NVIDIA H100 80GB HBM3", "refuse", "refuse", "warn"),  # same sm_90, other model
    (GPU, "driver", "570.124.06", "refuse", "warn", "warn"),
    (GPU, "driver", "580.65.06", "refuse", "warn", "warn"),
    (GPU, "cuda", "12.9", "refuse", "refuse", "warn"),
    (GPU, "triton", "3.4.0", "refuse", "refuse", "warn"),
    (GPU, "torch", "2.7.1+cu126", "refuse", "warn", "warn"),  # local build suffix
    (GPU, "torch", "2.7.0+cu128", "refuse", "warn", "warn"),  # patch
    (GPU, "torch", "2.8.0+cu128", "refuse", "refuse", "warn"),  # minor
    (GPU, "sartor", "0.1.3", "refuse", "warn", "warn"),
    (GPU, "sartor", "0.2.0", "refuse", "refuse", "warn"),
    (CPU, "arch", "aarch64", "refuse", "refuse", "refuse"),
    (CPU, "cpu", "Intel(R) Xeon(R) Platinum 8480+", "refuse", "warn", "warn"),
    # A CPU engine's torch compared without the local build suffix (+cpu, +cu128): see below.
    (CPU, "torch", "2.7.0+cpu", "refuse", "warn", "warn"),  # patch
    (CPU, "torch", "2.7.0+cu128", "refuse", "warn", "warn"),  # patch, in the other build
    (CPU, "torch", "2.8.1+cpu", "refuse", "refuse", "warn"),  # minor
    (CPU, "torch", "2.8.1+cu128", "refuse", "refuse", "warn"),  # minor, in the other build
]


@pytest.mark.parametrize("base, field, other, strict, default, loose", CASES,
                         ids=[f"{c[1]}={c[2]}" for c in CASES])
def test_each_field_at_each_level(base, field, other, strict, default, loose):
    built_for = dict(base, **{field: other})
    for level, expected in (("strict", strict), ("default", default), ("loose", loose)):
        result = compare_fingerprints(built_for, base, level)
        assert (result.refused, result.warned) == (((field,), ()) if expected == "refuse" else ((), (field,))), level
        assert result.loads == (expected == "warn")


def test_an_equal_fingerprint_neither_refuses_nor_warns():
    for level in ("strict", "default", "loose"):
        result = compare_fingerprints(dict(GPU), GPU, level)
        assert result.loads and not result.warned


@pytest.mark.parametrize("built, here", [("2.7.1+cu128", "2.7.1+cpu"), ("2.7.1+cpu", "2.7.1+cu128"),
                                         ("2.7.1", "2.7.1+cpu"), ("2.7.1+cu130", "2.7.1")])
def test_a_cpu_engine_is_the_same_across_cpu_and_cuda_builds_of_one_torch(built, here):
    # One torch source, one set of CPU kernels: no difference at any level, not even a warning.
    for level in ("strict", "default", "loose"):
        result = compare_fingerprints(dict(CPU, torch=built), dict(CPU, torch=here), level)
        assert result.loads and not result.warned and not result.refused, level
    # A CUDA engine's build suffix names the toolkit its kernels were chosen with: still a difference.
    result = compare_fingerprints(dict(GPU, torch=built), dict(GPU, torch=here), "strict")
    assert result.refused == ("torch",)


def test_the_level_comes_from_the_argument_then_the_environment(monkeypatch):
    monkeypatch.delenv("SARTOR_FINGERPRINT", raising=False)
    assert compatibility_level() == "default"
    monkeypatch.setenv("SARTOR_FINGERPRINT", "loose")
    assert compatibility_level() == "loose" and compatibility_level("strict") == "strict"
    monkeypatch.setenv("SARTOR_FINGERPRINT", "lenient")
    with pytest.raises(ConfigError, match=r"^\$SARTOR_FINGERPRINT='lenient' is not a compatibility level: use one "
                                          r"of strict, default, loose$"):
        compatibility_level()
    with pytest.raises(ConfigError, match="^compatibility='any' is not"):
        compatibility_level("any")


def _elsewhere(plan, dest, **fields):
    header, tensors = unpack(plan.read_bytes())
    header["fingerprint"].update(fields)
    dest.write_bytes(pack(header, tensors))
    return dest


def test_a_warned_difference_loads_with_one_log_line(tiny_plan, tmp_path, caplog, monkeypatch):
    monkeypatch.delenv("SARTOR_FINGERPRINT", raising=False)
    plan = _elsewhere(tiny_plan, tmp_path / "other_cpu.plan", cpu="Imaginary CPU 9000")
    with caplog.at_level(logging.WARNING, logger="sartor.runtime"):
        engine = sartor.load(plan, device="cpu")
    lines = [r.getMessage() for r in caplog.records if r.name == "sartor.runtime"]
    assert len(lines) == 1, lines
    assert "other_cpu.plan: loaded at compatibility 'default'" in lines[0]
    assert "cpu Imaginary CPU 9000 (here " in lines[0]
    assert engine.fingerprint_check.warned == ("cpu",)
    with pytest.raises(FingerprintMismatchError) as info:
        sartor.load(plan, device="cpu", compatibility="strict")
    message = str(info.value)
    assert "\n" not in message
    assert "Imaginary CPU 9000" in message and "differs in cpu, which must match at compatibility 'strict'" in message
    assert "rebuild it here: sartor build" in message and "--compatibility loose" in message


def test_a_refused_difference_names_both_sides_and_the_way_out(tiny_plan, tmp_path, monkeypatch):
    monkeypatch.delenv("SARTOR_FINGERPRINT", raising=False)
    plan = _elsewhere(tiny_plan, tmp_path / "new_torch.plan", torch="99.1.0", cpu="Imaginary CPU 9000")
    with pytest.raises(FingerprintMismatchError) as info:
        sartor.load(plan, device="cpu")
    message = str(info.value)
    assert "torch 99.1.0" in message and "differs in torch, which must match at compatibility 'default'; also in cpu" \
        in message and "--compatibility loose (SARTOR_FINGERPRINT=loose)" in message
    monkeypatch.setenv("SARTOR_FINGERPRINT", "loose")
    assert sartor.load(plan, device="cpu").fingerprint_check.warned == ("cpu", "torch")
    # What no level admits gives no override to try.
    arch = _elsewhere(tiny_plan, tmp_path / "arch.plan", arch="imaginary64")
    with pytest.raises(FingerprintMismatchError) as info:
        sartor.load(arch, device="cpu")
    assert "differs in arch, which must match at compatibility 'loose'" in str(info.value)
    assert "--compatibility" not in str(info.value)


def test_the_cli_flag_sets_the_level_for_one_command(tiny_plan, tmp_path, cli, monkeypatch):
    monkeypatch.delenv("SARTOR_FINGERPRINT", raising=False)
    plan = _elsewhere(tiny_plan, tmp_path / "new_torch.plan", torch="99.1.0")
    result = cli("run", plan)
    assert result.code == 2 and "differs in torch" in result.err
    result = cli("run", plan, "--compatibility", "loose")
    assert result.code == 0, result
    result = cli("--compatibility", "loose", "inspect", plan, "--json")
    here = json.loads(result.out)["fingerprint_here"]
    assert result.code == 0 and here["loads"] and here["warned_for"] == ["torch"] and here["compatibility"] == "loose"
    result = cli("inspect", plan, "--compatibility", "loose")
    assert "no (differs in torch); loads at compatibility 'loose', with a warning" in " ".join(result.out.split())
    result = cli("run", tiny_plan, "--compatibility", "lenient")
    assert result.code == 2 and "invalid choice: 'lenient'" in result.err
    import os
    assert "SARTOR_FINGERPRINT" not in os.environ  # the flag held for that command only


def _this_torch_as(monkeypatch, version: str) -> None:
    """This process's torch reported as `version` (what device_fingerprint reads at each load)."""
    import torch
    monkeypatch.setattr(torch, "__version__", version)


def test_a_cpu_engine_loads_across_cpu_and_cuda_builds_and_not_across_versions(tiny_plan, tmp_path, caplog,
                                                                               monkeypatch):
    monkeypatch.delenv("SARTOR_FINGERPRINT", raising=False)
    cuda_build = _elsewhere(tiny_plan, tmp_path / "from_cu130.plan", torch="2.14.1+cu130")
    cpu_build = _elsewhere(tiny_plan, tmp_path / "from_cpu.plan", torch="2.14.1+cpu")
    reference = sartor.load(tiny_plan, device="cpu").context().run({"images": np.ones((2, 3, 16, 16), np.float32)})
    for plan, here in ((cuda_build, "2.14.1+cpu"), (cpu_build, "2.14.1+cu130"), (cuda_build, "2.14.1")):
        _this_torch_as(monkeypatch, here)
        with caplog.at_level(logging.WARNING, logger="sartor.runtime"):
            caplog.clear()
            engine = sartor.load(plan, device="cpu", compatibility="strict")
        assert not engine.fingerprint_check.warned and not engine.fingerprint_check.refused
        assert not [r for r in caplog.records if r.name == "sartor.runtime"], here
        outputs = engine.context().run({"images": np.ones((2, 3, 16, 16), np.float32)})
        assert np.array_equal(outputs["logits"], reference["logits"])
    # Another torch release is still another torch, in either build, at the default level.
    for here in ("2.13.0+cpu", "2.15.0+cu130"):
        _this_torch_as(monkeypatch, here)
        with pytest.raises(FingerprintMismatchError, match="differs in torch, which must match at compatibility "
                                                           "'default'"):
            sartor.load(cuda_build, device="cpu")
    _this_torch_as(monkeypatch, "2.14.2+cpu")  # a patch release: loads, with the warning
    assert sartor.load(cuda_build, device="cpu").fingerprint_check.warned == ("torch",)


def test_a_cuda_engine_on_a_cpu_build_of_torch_says_so(monkeypatch):
    import torch

    from sartor.errors import DeviceError
    from sartor.runtime.fingerprint import parse_device
    monkeypatch.setattr(torch.version, "cuda", None)
    with pytest.raises(DeviceError, match=r"^device 'cuda' requested but this torch \(.*\) is a CPU-only build: "
                                          r"CUDA engines need a CUDA build of torch"):
        parse_device("cuda")
