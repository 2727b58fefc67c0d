"""Per-layer profiles (runtime/layer_profile.py) of a CPU engine: every layer, slowest first, with
its tactic, precision and ONNX nodes from the engine header; the refusals."""
from __future__ import annotations

import pytest
import torch

from sartor.errors import ConfigError
from sartor.runtime.layer_profile import profile_layers


def test_every_layer_is_timed_and_described(tiny_engine):
    result = profile_layers(tiny_engine, iterations=3, warmup=1)
    recorded = {layer["name"]: layer for layer in tiny_engine.layers}
    assert sorted(layer.name for layer in result.layers) == sorted(recorded)
    times = [layer.median_ms for layer in result.layers]
    assert times == sorted(times, reverse=True) and all(t > 0 for t in times)
    assert sum(layer.share for layer in result.layers) == pytest.approx(1.0)
    assert result.total_ms == pytest.approx(sum(times))
    for layer in result.layers:
        assert layer.tactic == recorded[layer.name]["tactic"]
        assert layer.precision == recorded[layer.name]["precision"]
        assert layer.origin == recorded[layer.name]["origin"]
    assert next(layer for layer in result.layers if layer.name == "conv2").origin == ["conv2", "add"]
    assert result.shapes == {"images": (2, 3, 16, 16)} and result.profile == 0 and result.iterations == 3
    data = result.to_json()
    assert data["shapes"] == {"images": [2, 3, 16, 16]} and data["layers"][0]["median_ms"] == times[0]


def test_shapes_choose_the_run(tiny_engine):
    result = profile_layers(tiny_engine, {"images": (4, 3, 16, 16)}, iterations=1, warmup=0)
    assert result.shapes == {"images": (4, 3, 16, 16)}


@pytest.mark.parametrize("kwargs, message", [
    ({"iterations": 0}, "--iterations must be at least 1"),
    ({"warmup": -1}, "--warmup must be 0 or more"),
    ({"shapes": {"pixels": (1, 3, 16, 16)}}, "--shapes names unknown input(s) pixels"),
])
def test_refusals(tiny_engine, kwargs, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        profile_layers(tiny_engine, **kwargs)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without CUDA")
def test_nvtx_needs_cuda(tiny_engine):
    with pytest.raises(ConfigError, match="--nvtx needs a CUDA device"):
        profile_layers(tiny_engine, iterations=1, nvtx=True)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_events_and_nvtx_ranges(tiny_onnx, tmp_path):
    import sartor
    from conftest import OPT_SHAPES
    plan = tmp_path / "tiny_cuda.plan"
    sartor.build(tiny_onnx, plan, device="cuda", opt_shapes=OPT_SHAPES)
    engine = sartor.load(plan)
    result = profile_layers(engine, iterations=5, warmup=2, nvtx=True)
    assert result.nvtx and result.device.startswith("cuda")
    assert sorted(layer.name for layer in result.layers) == sorted(layer["name"] for layer in engine.layers)
    assert all(layer.median_ms > 0 for layer in result.layers if not layer.on_host)
    assert sum(layer.share for layer in result.layers) == pytest.approx(1.0)
