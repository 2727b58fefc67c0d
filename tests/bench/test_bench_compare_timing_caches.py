"""bench/compare_timing_caches.py: two caches' winners side by side, matched by layer signature."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import compare_timing_caches  # noqa: E402

from sartor.tactics.timing_cache import TimingCache  # noqa: E402

DEVICE = {"kind": "cuda", "gpu": "NVIDIA H200", "triton": "3.6.0"}
EXPANDING = ("QConv x=i8[256x64x56x56]:nhwc w=i8[256x64x1x1]:contiguous b=i32 strides=1,1 act=Relu "
             "residual=i8[256x256x56x56]:nhwc@before precision=int8 out=i8")
PROJECTED = ("QConv x=i8[256x64x56x56]:nhwc w=i8[256x64x1x1]:contiguous b=i32 strides=1,1 act=Relu "
             "residual=none precision=int8 out=i8 projection=i8[256x64x56x56]:nhwc*i8[256x64x1x1]:contiguous@1,1")
STEM = "QConv x=f32[256x3x224x224]:contiguous w=i8[64x3x7x7]:contiguous b=i32 strides=2,2 residual=none"


def _cache(path: Path, layers: dict, device: dict = DEVICE) -> Path:
    cache = TimingCache()
    for signature, (winner, ms) in layers.items():
        cache.record(device, signature, winner, {winner: ms, "torch": 9.0}, {}, effort=1)
    cache.save(path)
    return path


def test_layers_in_both_caches_are_compared_slowest_first(tmp_path, capsys):
    base = _cache(tmp_path / "base.json", {EXPANDING: ("resident_a", 0.2), PROJECTED: ("resident_a", 0.18),
                                           STEM: ("window", 0.3)})
    new = _cache(tmp_path / "new.json", {EXPANDING: ("resident_b", 0.15), PROJECTED: ("resident_a", 0.18)})
    compare_timing_caches.main([str(base), str(new)])
    lines = capsys.readouterr().out.splitlines()
    assert lines[2] == ("| QConv x 256x64x56x56 w 256x64x1x1 strides=1,1 + residual | resident_a | 0.2000 | "
                        "resident_b | 0.1500 | 0.750 |")
    assert lines[3].startswith("| QConv x 256x64x56x56 w 256x64x1x1 strides=1,1 + projection | resident_a | 0.1800")
    assert "2 layers in both: 0.3800 → 0.3300 ms" in lines[5]
    assert lines[6] == "1 only in base: QConv x 256x3x224x224 w 64x3x7x7 strides=2,2"


def test_a_layer_whose_sums_are_decoded_is_the_same_layer(tmp_path, capsys):
    """passes/bound_accumulators.py: the new build's signature names the other epilogue."""
    base = _cache(tmp_path / "base.json", {EXPANDING: ("resident_a", 0.2)})
    new = _cache(tmp_path / "new.json", {EXPANDING + " sums=decoded": ("resident_a", 0.18)})
    compare_timing_caches.main([str(base), str(new)])
    lines = capsys.readouterr().out.splitlines()
    assert lines[2] == ("| QConv x 256x64x56x56 w 256x64x1x1 strides=1,1 + residual | resident_a | 0.2000 | "
                        "resident_a (sums decoded) | 0.1800 | 0.900 |")
    assert "only in" not in "\n".join(lines)


def test_a_cache_of_several_devices_is_refused(tmp_path):
    path = _cache(tmp_path / "two.json", {STEM: ("window", 0.3)})
    cache = TimingCache(path)
    cache.record(dict(DEVICE, gpu="NVIDIA H100"), STEM, "window", {"window": 0.4}, {}, effort=1)
    cache.save()
    with pytest.raises(SystemExit, match="2 devices in the cache, expected one"):
        compare_timing_caches.main([str(path), str(path)])
