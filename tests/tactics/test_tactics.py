"""Tactic selection on the CPU: the channels_last candidate, rejection of wrong candidates, the
builder effort, and the timing cache (round trip, warm builds, other fingerprints, corrupt files)."""
from __future__ import annotations

import json

import pytest
import torch
from conftest import MAX_SHAPES, MIN_SHAPES, OPT_SHAPES, assert_cli_error, shape_flag

import sartor
from sartor.errors import ConfigError
from sartor.ops import conv as conv_ops
from sartor.runtime.engine_file import read_engine_file
from sartor.runtime.fingerprint import device_fingerprint
from sartor.tactics import TimingCache, TimingCacheError, select
from sartor.tactics.timing_cache import FORMAT, conv_signature, fingerprint_digest

SHAPES = {"min_shapes": MIN_SHAPES, "opt_shapes": OPT_SHAPES, "max_shapes": MAX_SHAPES}
SHAPE_ARGS = ["--min-shapes", shape_flag(MIN_SHAPES), "--opt-shapes", shape_flag(OPT_SHAPES),
              "--max-shapes", shape_flag(MAX_SHAPES)]
CPU = device_fingerprint(torch.device("cpu"))


@pytest.fixture
def timing_calls(monkeypatch) -> list:
    """Every call of the timing function during the test, as (device type, iterations, warm-up)."""
    calls = []
    real = select.time_ms

    def counted(fn, device, iterations, warmup=3, graph=False):
        calls.append((device.type, iterations, warmup))
        return real(fn, device, iterations, warmup, graph)
    monkeypatch.setattr(select, "time_ms", counted)
    return calls


def build(model, out, **kwargs) -> tuple[dict, list]:
    result = sartor.build(model, out, device="cpu", **SHAPES, **kwargs)
    header, _ = read_engine_file(out)
    return header, result.log


def conv_layers(header: dict) -> dict:
    return {layer["name"]: layer for layer in header["layers"] if layer["op"] == "FusedConv"}


def chosen(header: dict) -> dict:
    """{layer: tactic attribute} as the engine's graph stores it."""
    return {n["name"]: n["attrs"].get("tactic") for n in header["graph"]["nodes"] if n["op"] == "FusedConv"}


# ---- the CPU candidate ----------------------------------------------------------------------------

CONV_CASES = [
    {},
    {"strides": [2, 2], "pads": [1, 1, 1, 1], "activation": "Relu"},
    {"pads": [0, 1, 2, 1], "dilations": [2, 1], "activation": "LeakyRelu", "activation_alpha": 0.1},
    {"group": 4, "pads": [1, 1, 1, 1], "activation": "Sigmoid", "residual": True},
    {"pads": [1, 1, 1, 1], "activation": "HardSwish", "residual": True, "residual_after_activation": True},
    {"auto_pad": "SAME_UPPER", "strides": [2, 2], "activation": "Clip", "activation_alpha": 0.0,
     "activation_beta": 6.0},
]


@pytest.mark.parametrize("case", CONV_CASES, ids=lambda c: ",".join(c) or "plain")
@pytest.mark.parametrize("nhwc", [False, True], ids=["nchw", "nhwc"])
def test_channels_last_candidate_matches_the_reference(case, nhwc):
    g = torch.Generator().manual_seed(0)
    attrs = dict(case)
    residual = attrs.pop("residual", False)
    group = attrs.get("group", 1)
    x = torch.randn(2, 8, 13, 11, generator=g)
    w = torch.randn(16, 8 // group, 3, 3, generator=g)
    b = torch.randn(16, generator=g)
    if nhwc:
        x = x.contiguous(memory_format=torch.channels_last)
    inputs = [x, w, b]
    reference = conv_ops.fused_conv(inputs, dict(attrs, tactic="torch"))
    if residual:
        inputs.append(torch.randn(reference.shape, generator=g))
        reference = conv_ops.fused_conv(inputs, dict(attrs, tactic="torch"))
    assert conv_ops.applicable_conv_tactics(inputs, attrs) == ["torch", "channels_last"]
    out = conv_ops.fused_conv(inputs, dict(attrs, tactic="channels_last"))
    torch.testing.assert_close(out, reference, rtol=1e-4, atol=1e-5)
    assert select._mismatch(out, reference) is None
    # the output keeps the input's memory format
    assert out.is_contiguous(memory_format=torch.channels_last if nhwc else torch.contiguous_format)
    # the weight as the executor stores it for this tactic gives the same result
    stored = conv_ops.conv_weight_for_tactic(w, "channels_last")
    assert stored.is_contiguous(memory_format=torch.channels_last)
    torch.testing.assert_close(conv_ops.fused_conv([x, stored, *inputs[2:]], dict(attrs, tactic="channels_last")), out)


# ---- selection on CPU builds -----------------------------------------------------------------------

def test_cpu_build_times_both_candidates_and_runs_the_winner(tiny_onnx, tmp_path, timing_calls):
    header, log = build(tiny_onnx, tmp_path / "m.plan")
    layers = conv_layers(header)
    assert set(layers) == {"conv1", "conv2"}
    for name, layer in layers.items():
        assert set(layer["tactic_timings_ms"]) == {"torch", "channels_last"}, layer
        assert layer["tactic_rejected"] == {} and layer["tactic_source"] == "timed"
        winner = min(layer["tactic_timings_ms"], key=layer["tactic_timings_ms"].get)
        assert chosen(header)[name] == winner
        assert ("channels-last" in layer["tactic"]) == (winner == "channels_last")
    assert len(timing_calls) == 4 and {c[1:] for c in timing_calls} == {(10, 3)}  # effort 2: 3 warm-up, 10 runs
    assert "tactics: 2 timed, 0 from timing cache" in log
    assert header["tactics"] == {"builder_effort": 2, "timed": 2, "from_timing_cache": 0, "timing_cache": None}
    assert header["build_config"]["builder_effort"] == 2
    # whichever tactic won, the engine computes what the reference tactic computes
    images = torch.randn(OPT_SHAPES["images"]).numpy()
    out = sartor.load(tmp_path / "m.plan").context().run({"images": images})["logits"]
    build(tiny_onnx, tmp_path / "ref.plan", builder_effort=0)
    ref = sartor.load(tmp_path / "ref.plan").context().run({"images": images})["logits"]
    torch.testing.assert_close(torch.from_numpy(out), torch.from_numpy(ref), rtol=1e-4, atol=1e-5)


def test_the_tactics_stage_says_where_its_seconds_went_by_family(tiny_onnx, tmp_path, cli):
    """Two convolutions, each timing "torch" and "channels_last": two candidates of each family, the
    reference runs apart; the families' seconds add up to at most the stage's."""
    result = sartor.build(tiny_onnx, tmp_path / "m.plan", device="cpu", **SHAPES)
    families = result.tactic_seconds
    assert set(families) == {"torch", "channels_last", select.REFERENCE_COST}
    assert families["torch"]["candidates"] == families["channels_last"]["candidates"] == 2
    assert families[select.REFERENCE_COST]["candidates"] == 0
    for entry in families.values():
        assert entry["seconds"] == pytest.approx(entry["compile_s"] + entry["time_s"], abs=2e-3)
        assert entry["compile_s"] == 0  # nothing is precompiled on the CPU
    assert sum(e["seconds"] for e in families.values()) <= result.stage_seconds["tactics"] + 1e-3
    assert list(families) == sorted(families, key=lambda f: -families[f]["seconds"])  # costliest first
    assert sartor.load(tmp_path / "m.plan").header["provenance"]["tactic_seconds"] == families
    shown = cli("build", tiny_onnx, "-o", tmp_path / "c.plan", "--device", "cpu", *SHAPE_ARGS)
    assert shown.code == 0 and "Tactics stage by family" in shown.out and "channels_last" in shown.out
    as_json = cli("build", tiny_onnx, "-o", tmp_path / "j.plan", "--device", "cpu", *SHAPE_ARGS, "--json")
    assert set(json.loads(as_json.out)["tactic_seconds"]) == set(families)


def test_a_parallel_step_is_charged_to_families_by_their_share():
    selection = select.TacticSelection()
    select._charge_apportioned(selection, "compile_s", 2.0, {"igemm.64x64x32.w4.s3": 3.0, "igemm.128x64x32.w4.s3": 3.0,
                                                             "triton_epilogue": 2.0})
    assert selection.family_seconds["igemm"]["compile_s"] == pytest.approx(1.5)
    assert selection.family_seconds["triton_epilogue"]["compile_s"] == pytest.approx(0.5)
    select._charge_apportioned(selection, "compile_s", 1.0, {})  # nothing ran: nothing charged
    assert select.family_seconds([selection])["igemm"] == {"seconds": 1.5, "compile_s": 1.5, "time_s": 0.0,
                                                           "candidates": 0}


def test_effort_zero_times_nothing(tiny_onnx, tmp_path, timing_calls, cli):
    header, log = build(tiny_onnx, tmp_path / "m.plan", builder_effort=0)
    assert timing_calls == []
    assert set(chosen(header).values()) == {None}  # the reference kernel
    for layer in conv_layers(header).values():
        assert layer["tactic_timings_ms"] == {} and layer["tactic_source"] is None
        assert layer["tactic"] == "torch.conv (onednn/mkl) + torch epilogue"
    assert header["tactics"]["builder_effort"] == 0 and header["build_config"]["builder_effort"] == 0
    assert any("builder effort 0, nothing timed" in line for line in log)
    # effort 1 times briefly
    build(tiny_onnx, tmp_path / "m1.plan", builder_effort=1)
    assert {c[1:] for c in timing_calls} == {(3, 1)} and select.EFFORT_TIMING[1] == (1, 3)  # (warm-up, runs)
    with pytest.raises(ConfigError, match="--builder-effort 7 must be 0..5"):
        sartor.build(tiny_onnx, tmp_path / "x.plan", device="cpu", builder_effort=7)
    result = cli("build", tiny_onnx, "-o", tmp_path / "x.plan", "--device", "cpu", "--builder-effort", "9")
    assert result.code == 2 and "--builder-effort" in result.err


def test_wrong_candidate_is_rejected_with_its_reason(tiny_onnx, tmp_path, monkeypatch, timing_calls):
    real = conv_ops._conv_channels_last
    monkeypatch.setattr(conv_ops, "_conv_channels_last", lambda *args: real(*args) * 1.5 + 0.25)
    header, _ = build(tiny_onnx, tmp_path / "m.plan")
    for name, layer in conv_layers(header).items():
        assert list(layer["tactic_timings_ms"]) == ["torch"]
        assert layer["tactic_rejected"]["channels_last"].startswith("output differs from reference (max error")
        assert chosen(header)[name] == "torch"
    assert len(timing_calls) == 2  # the wrong candidate is not even timed

    # a candidate that raises is rejected too, with the exception
    def broken(*args):
        raise RuntimeError("no kernel for this shape")
    monkeypatch.setattr(conv_ops, "_conv_channels_last", broken)
    header, _ = build(tiny_onnx, tmp_path / "m2.plan")
    assert {layer["tactic_rejected"]["channels_last"] for layer in conv_layers(header).values()} == {
        "RuntimeError: no kernel for this shape"}


def test_excluded_tactics_are_never_run_and_the_engine_records_them(tiny_onnx, tmp_path, monkeypatch, cli):
    header, _ = build(tiny_onnx, tmp_path / "m.plan", exclude_tactics=["channels_*"])
    assert {name: set(layer["tactic_timings_ms"]) for name, layer in conv_layers(header).items()} == {
        "conv1": {"torch"}, "conv2": {"torch"}}
    assert header["tactics"]["excluded"] == ["channels_*"]
    assert header["build_config"]["exclude_tactics"] == ["channels_*"]  # the engine can be rebuilt as it was
    # a glob that matches no candidate (an old-scheme name, a typo) is said in the build log, not ignored
    header, log = build(tiny_onnx, tmp_path / "w.plan", exclude_tactics=["igemm_*", "channels_*"])
    assert [line for line in log if "matched no candidate" in line] == [
        "warning: --exclude-tactic 'igemm_*' matched no candidate of any layer (tactic names read like "
        "igemm.128x128x64.w8.s3; `sartor inspect` shows each layer's)"]
    # the reference may be left out too: the other candidate is still checked against it
    header, _ = build(tiny_onnx, tmp_path / "r.plan", exclude_tactics=["torch"])
    assert set(chosen(header).values()) == {"channels_last"}
    with pytest.raises(ConfigError, match=r"--exclude-tactic \* leaves layer 'conv1' no tactic \(it had torch, "):
        build(tiny_onnx, tmp_path / "x.plan", exclude_tactics=["*"])
    real = conv_ops._conv_channels_last
    monkeypatch.setattr(conv_ops, "_conv_channels_last", lambda *args: real(*args) + 1.0)
    with pytest.raises(ConfigError, match="no tactic left after --exclude-tactic matches the reference "
                                          r"\(channels_last: output differs"):
        build(tiny_onnx, tmp_path / "y.plan", exclude_tactics=["torch"])
    assert_cli_error(cli("build", tiny_onnx, "-o", tmp_path / "z.plan", "--device", "cpu", *SHAPE_ARGS,
                         "--exclude-tactic", " "), "--exclude-tactic ' ': give a glob over tactic names")
    assert not (tmp_path / "z.plan").exists()


def test_a_candidate_that_faults_the_gpu_stops_the_build_in_one_line(tiny_onnx, tmp_path, monkeypatch, cli):
    """A fault ends the process's CUDA context (session 25: a misaligned address from a Triton 3.6
    miscompile), so every later candidate would fail too: the build stops, naming the layer and the
    candidates that ran, where before it went on rejecting them all."""
    def faulting(*args):
        raise RuntimeError("CUDA error: misaligned address\nCUDA kernel errors might be asynchronously reported")
    monkeypatch.setattr(conv_ops, "_conv_channels_last", faulting)
    line = assert_cli_error(cli("build", tiny_onnx, "-o", tmp_path / "m.plan", "--device", "cpu", *SHAPE_ARGS),
                            "layer 'conv1' (FusedConv): the GPU faulted (CUDA error: misaligned address) while its "
                            "candidate kernels ran (torch, channels_last)", "--exclude-tactic PATTERN")
    assert "asynchronously" not in line and not (tmp_path / "m.plan").exists()
    assert cli("build", tiny_onnx, "-o", tmp_path / "m.plan", "--device", "cpu", *SHAPE_ARGS,
               "--exclude-tactic", "channels_last").code == 0
    # a candidate short of memory is only rejected, as any candidate that cannot run here
    monkeypatch.setattr(conv_ops, "_conv_channels_last", lambda *args: (_ for _ in ()).throw(
        RuntimeError("CUDA error: out of memory")))
    header, _ = build(tiny_onnx, tmp_path / "o.plan")
    assert {layer["tactic_rejected"]["channels_last"] for layer in conv_layers(header).values()} == {
        "RuntimeError: CUDA error: out of memory"}
    assert not select.gpu_fault(ValueError("CUDA error: misaligned address"))  # CUDA raises RuntimeErrors
    assert select.gpu_fault(RuntimeError("Triton Error [CUDA]: an illegal memory access was encountered"))


# ---- the timing cache ------------------------------------------------------------------------------

def test_timing_cache_round_trip(tmp_path):
    path = tmp_path / "timing.json"
    cache = TimingCache(path)  # a missing file is an empty cache
    assert len(cache) == 0 and not path.exists()
    other = dict(CPU, cpu="Some Other CPU")
    sig = "FusedConv x=f32[2x3x16x16]:contiguous"
    cache.record(CPU, sig, "channels_last", {"torch": 0.5, "channels_last": 0.25}, {"x": "why"}, effort=2)
    cache.record(other, sig, "torch", {"torch": 0.1}, {}, effort=1)
    cache.save()
    data = json.loads(path.read_text())
    assert data["format"] == FORMAT == "sartor-timing-cache-2"
    assert data["devices"][fingerprint_digest(CPU)]["fingerprint"] == CPU  # recorded in full
    entry = data["devices"][fingerprint_digest(CPU)]["entries"][sig]
    assert entry["winner"] == "channels_last" and entry["timings_ms"] == {"torch": 0.5, "channels_last": 0.25}
    assert entry["rejected"] == {"x": "why"} and entry["effort"] == 2 and entry["measured_at"].endswith("Z")
    again = TimingCache(path)
    assert len(again) == 2
    assert again.lookup(CPU, sig) == entry and again.lookup(CPU, sig, effort=2) == entry
    assert again.lookup(CPU, sig, effort=3) is None  # measured with less effort than asked: re-time
    assert again.lookup(other, sig)["winner"] == "torch"
    assert again.lookup(dict(CPU, torch="0.0"), sig) is None
    assert again.lookup(CPU, sig + " ") is None
    assert sorted(p.name for p in tmp_path.iterdir()) == ["timing.json"]  # atomic: no temporary left

    # save merges: entries written by another build in between are kept
    late = TimingCache(path)
    cache2 = TimingCache(path)
    cache2.record(CPU, "sig-b", "torch", {"torch": 1.0}, {}, effort=2)
    cache2.save()
    late.record(CPU, "sig-c", "torch", {"torch": 2.0}, {}, effort=2)
    late.save()
    assert {"sig-b", "sig-c", sig} <= set(TimingCache(path).devices[fingerprint_digest(CPU)]["entries"])


def test_conv_signature_is_what_determines_speed():
    x, w, b = torch.zeros(2, 8, 16, 16), torch.zeros(16, 8, 3, 3), torch.zeros(16)
    attrs = {"pads": [1, 1, 1, 1], "activation": "Relu", "group": 1}
    sig = conv_signature("FusedConv", [x, w, b], attrs, "fp32", False)
    assert sig == ("FusedConv x=f32[2x8x16x16]:contiguous w=f32[16x8x3x3]:contiguous b=f32 strides=1,1 "
                   "pads=1,1/1,1 dilations=1,1 group=1 act=Relu residual=none precision=fp32 tf32=0")
    assert conv_signature("FusedConv", [x, w, b], dict(attrs, activation_alpha=0.3), "fp32", False) == sig
    variants = [
        conv_signature("FusedConv", [torch.zeros(4, 8, 16, 16), w, b], attrs, "fp32", False),
        conv_signature("FusedConv", [x.contiguous(memory_format=torch.channels_last), w, b], attrs, "fp32", False),
        conv_signature("FusedConv", [x, w, None], attrs, "fp32", False),
        conv_signature("FusedConv", [x, w, b], dict(attrs, strides=[2, 2]), "fp32", False),
        conv_signature("FusedConv", [x, w, b], dict(attrs, pads=[0, 0, 1, 1]), "fp32", False),
        conv_signature("FusedConv", [x, w, b], dict(attrs, activation="SiLU"), "fp32", False),
        conv_signature("FusedConv", [x, w, b, torch.zeros(2, 16, 16, 16)], attrs, "fp32", False),
        conv_signature("FusedConv", [x, w, b, torch.zeros(2, 16, 16, 16)], dict(attrs, residual_after_activation=True),
                       "fp32", False),
        conv_signature("FusedConv", [x.half(), w.half(), b.half()], attrs, "fp16", False),
        conv_signature("FusedConv", [x, w, b], attrs, "fp32", True),
    ]
    assert len({sig, *variants}) == len(variants) + 1


def test_warm_build_times_nothing_and_picks_the_same_tactics(tiny_onnx, tmp_path, timing_calls, cli):
    cache = tmp_path / "timing.json"
    cold, log = build(tiny_onnx, tmp_path / "cold.plan", timing_cache=cache)
    assert len(timing_calls) == 4 and "tactics: 2 timed, 0 from timing cache" in log
    assert len(TimingCache(cache)) == 2
    stored = cache.read_text()

    timing_calls.clear()
    result = cli("build", tiny_onnx, "-o", tmp_path / "warm.plan", "--device", "cpu", *SHAPE_ARGS,
                 "--timing-cache", cache)
    assert result.code == 0, result
    assert timing_calls == []
    assert "tactics: 0 timed, 2 from timing cache" in result.out
    warm, _ = read_engine_file(tmp_path / "warm.plan")
    assert chosen(warm) == chosen(cold)
    assert warm["tactics"] == {"builder_effort": 2, "timed": 0, "from_timing_cache": 2, "timing_cache": str(cache)}
    for name, layer in conv_layers(warm).items():
        assert layer["tactic_source"] == "timing cache"
        assert layer["tactic_timings_ms"] == conv_layers(cold)[name]["tactic_timings_ms"]
        assert layer["tactic"] == conv_layers(cold)[name]["tactic"]
    assert cache.read_text() == stored  # nothing new: the file is not rewritten

    # inspect shows the runners-up with their times, fastest first, and marks cached layers
    shown = cli("inspect", tmp_path / "warm.plan")
    assert shown.code == 0, shown
    for layer in conv_layers(warm).values():
        ranked = sorted(layer["tactic_timings_ms"].items(), key=lambda kv: kv[1])
        assert f"{ranked[0][0]} {ranked[0][1]:.3g}" in shown.out
    assert "(timing cache)" in shown.out and "2 from timing cache" in shown.out
    info = json.loads(cli("inspect", tmp_path / "warm.plan", "--json").out)
    assert {layer["tactic_source"] for layer in info["layers"] if layer["op"] == "FusedConv"} == {"timing cache"}
    assert info["tactics"]["from_timing_cache"] == 2

    # a higher effort re-times what was measured with less
    build(tiny_onnx, tmp_path / "e3.plan", timing_cache=cache, builder_effort=3)
    assert len(timing_calls) == 4


def test_cache_for_another_fingerprint_is_kept_but_not_used(tiny_onnx, tmp_path, timing_calls):
    cache = tmp_path / "timing.json"
    build(tiny_onnx, tmp_path / "a.plan", timing_cache=cache)
    data = json.loads(cache.read_text())
    (device,) = data["devices"].values()
    device["fingerprint"]["cpu"] = "Another CPU, another machine"
    foreign_entries = device["entries"]
    copy = tmp_path / "foreign.json"
    copy.write_text(json.dumps(data))

    timing_calls.clear()
    _, log = build(tiny_onnx, tmp_path / "b.plan", timing_cache=copy)
    assert len(timing_calls) == 4 and "tactics: 2 timed, 0 from timing cache" in log
    merged = json.loads(copy.read_text())
    assert len(merged["devices"]) == 2
    by_cpu = {d["fingerprint"]["cpu"]: d for d in merged["devices"].values()}
    assert by_cpu["Another CPU, another machine"]["entries"] == foreign_entries  # preserved as it was
    assert set(by_cpu[CPU["cpu"]]["entries"]) == set(foreign_entries)  # same layers, timed here
    assert merged["devices"][fingerprint_digest(CPU)]["fingerprint"] == CPU


@pytest.mark.parametrize("content, fragment", [
    ("{not json", "is not valid JSON (line 1"),
    ('{"format": "sartor-calib-1", "amax": {}}', "is not a sartor timing cache (format 'sartor-calib-1'"),
    ('{"format": "sartor-timing-cache-2", "devices": {"x": {"fingerprint": {}, "entries": {"s": {"winner": 3}}}}}',
     "entry 's' is malformed"),
    ("\xff\xfe", "is not readable (UnicodeDecodeError)"),
    ('{"format": "sartor-timing-cache-1", "devices": {"x": {"fingerprint": {}, "entries": {"s": {"winner": '
     '"igemm_64x64x32_w4_s4", "timings_ms": {}}}}}}', "named in sartor's scheme before the tactic registry"),
], ids=["json", "format", "entry", "binary", "old-names"])
def test_corrupt_cache_is_refused_in_one_line(tiny_onnx, tmp_path, cli, content, fragment):
    cache = tmp_path / "timing.json"
    cache.write_bytes(content.encode("latin-1"))
    result = cli("build", tiny_onnx, "-o", tmp_path / "m.plan", "--device", "cpu", *SHAPE_ARGS,
                 "--timing-cache", cache)
    assert_cli_error(result, f"timing cache {cache}", fragment, "delete it")
    assert not (tmp_path / "m.plan").exists() and cache.read_bytes() == content.encode("latin-1")
    with pytest.raises(TimingCacheError):
        TimingCache(cache)


def test_cached_winner_that_no_longer_matches_is_timed_again(tiny_onnx, tmp_path, monkeypatch, timing_calls):
    """A cache says channels_last wins everywhere, but channels_last now computes wrong numbers:
    the cached winner is checked against the reference, so the layer is timed again."""
    cache = tmp_path / "timing.json"
    build(tiny_onnx, tmp_path / "a.plan", timing_cache=cache)
    data = json.loads(cache.read_text())
    for entry in data["devices"][fingerprint_digest(CPU)]["entries"].values():
        entry["winner"] = "channels_last"
    cache.write_text(json.dumps(data))
    real = conv_ops._conv_channels_last
    monkeypatch.setattr(conv_ops, "_conv_channels_last", lambda *args: -real(*args))
    timing_calls.clear()
    header, log = build(tiny_onnx, tmp_path / "b.plan", timing_cache=cache)
    assert "tactics: 2 timed, 0 from timing cache" in log and len(timing_calls) == 2
    assert set(chosen(header).values()) == {"torch"}
    entries = TimingCache(cache).devices[fingerprint_digest(CPU)]["entries"].values()
    assert {e["winner"] for e in entries} == {"torch"}
    assert all("output differs" in e["rejected"]["channels_last"] for e in entries)


def test_other_layers_are_signed_by_inputs_and_attributes():
    from sartor.tactics.timing_cache import layer_signature
    x = torch.zeros(2, 8, 16, 16)
    attrs = {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1], "tactic": "torch"}
    sig = layer_signature("MaxPool", [x], attrs, "fp16", False)
    assert sig.startswith("MaxPool in=f32[2x8x16x16]:contiguous") and "strides=2,2" in sig and "tactic" not in sig
    assert layer_signature("MaxPool", [x], dict(attrs, tactic="triton_nhwc"), "fp16", False) == sig
    assert layer_signature("MaxPool", [x], dict(attrs, strides=[1, 1]), "fp16", False) != sig
    assert layer_signature("FusedConv", [x, torch.zeros(4, 8, 3, 3)], {}, "fp32", False).startswith("FusedConv x=")


def test_feeds_take_their_readers_dtype_in_the_layout_change(tiny_onnx):
    """An FP16 engine's image input is cast in the same copy that makes it channels-last."""
    import numpy as np

    from sartor.frontend.onnx import import_onnx
    from sartor.runtime.executor import Executor
    graph = import_onnx(str(tiny_onnx)).graph
    weights = {k: torch.from_numpy(np.array(v)) for k, v in graph.initializers.items()}
    name = graph.inputs[0].name
    half = Executor(graph, weights, torch.device("cpu"), {node.name: "fp16" for node in graph.nodes})
    assert half.feed_dtypes == {name: torch.float16}
    mixed = {node.name: "fp16" for node in graph.nodes}
    readers = [node.name for node in graph.nodes if name in node.inputs]
    mixed[readers[0]] = "fp32"
    assert Executor(graph, weights, torch.device("cpu"), mixed).feed_dtypes.get(name) in (None, torch.float32)


# ---- layers whose output the engine places in a Concat's buffer -----------------------------------

def _conv_concat_graph(tmp_path):
    """x -> conv+relu a, conv+relu b -> Concat(axis 1) -> Relu: both convs are Concat targets."""
    import numpy as np
    import onnx
    from onnx import TensorProto, helper

    from sartor.frontend.onnx import import_onnx
    from sartor.passes.pipelines import optimize
    rng = np.random.default_rng(0)
    inits = [helper.make_tensor(n, TensorProto.FLOAT, [8, 4, 3, 3], rng.standard_normal(288).astype(np.float32))
             for n in ("wa", "wb")]
    nodes = [helper.make_node("Conv", ["x", "wa"], ["a0"], name="conv_a", pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["a0"], ["a"], name="relu_a"),
             helper.make_node("Conv", ["x", "wb"], ["b0"], name="conv_b", pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["b0"], ["b"], name="relu_b"),
             helper.make_node("Concat", ["a", "b"], ["c"], name="cat", axis=1),
             helper.make_node("Relu", ["c"], ["y"], name="relu")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4, 9, 9])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 16, 9, 9])], inits)
    path = tmp_path / "cat.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    g = import_onnx(str(path)).graph
    optimize(g)
    weights = {k: torch.from_numpy(np.array(v)) for k, v in g.initializers.items()}
    return g, weights, {"x": torch.randn(2, 4, 9, 9).contiguous(memory_format=torch.channels_last)}


def test_concat_targets_are_timed_storing_into_their_slice(tmp_path, monkeypatch, timing_calls):
    """A layer placed in a Concat is timed as the engine runs it: through write_into where the
    tactic can store into the slice, else computed and copied there; its signature says so."""
    graph, weights, feeds = _conv_concat_graph(tmp_path)
    stored = []

    def write_into(inputs, attrs, out):
        if attrs["tactic"] != "channels_last":
            return None
        stored.append(out.data_ptr())
        return out.copy_(conv_ops.fused_conv(inputs, attrs))
    monkeypatch.setattr(select.Executor, "__init__", _with_write_into(select.Executor.__init__, write_into))
    cpu = torch.device("cpu")
    selection = select.select_tactics(graph, weights, feeds, cpu, {}, channels_last=True, tf32=False)
    assert set(selection.layers) == {"conv_a", "conv_b"}
    # both timed (2 candidates each), the write_into path ran for channels_last into the Concat's buffer
    assert len(timing_calls) == 4 and stored
    cache = TimingCache()
    select.select_tactics(graph, weights, feeds, cpu, {}, channels_last=True, tf32=False, cache=cache)
    signatures = [s for device in cache.to_json()["devices"].values() for s in device["entries"]]
    # the two convs are the same layer (same shapes, same slice geometry): one entry
    assert len(signatures) == 1 and signatures[0].endswith(" into=f32[2x8x9x9]:nhwc/16"), signatures


def _with_write_into(init, write_into):
    """Executor.__init__ that gives its FusedConv steps `write_into` (on the CPU the real one never
    stores: only the Triton tactics can)."""
    def patched(self, *args, **kwargs):
        init(self, *args, **kwargs)
        for step in self.steps:
            if step.node.op_type == "FusedConv":
                step.write_into = write_into
    return patched


def test_layers_outside_concats_are_signed_without_a_slice(tmp_path):
    from sartor.tactics.timing_cache import layer_signature
    x = torch.zeros(1, 8, 4, 4)
    plain = layer_signature("Resize", [x, torch.tensor([1.0, 1.0, 2.0, 2.0])], {"mode": "nearest"}, "fp16", False)
    other = layer_signature("Resize", [x, torch.tensor([1.0, 1.0, 3.0, 3.0])], {"mode": "nearest"}, "fp16", False)
    assert plain != other and "=1.0,1.0,2.0,2.0" in plain  # small host inputs are signed by value
    assert "into=" not in plain


def test_float16_outputs_below_the_normal_range_are_compared_by_absolute_steps():
    """Values under float16's smallest normal number keep absolute steps of 2^-24: a kernel that
    rounds such a value one step away is not wrong, a tensor that differs by its whole size is."""
    step = 2.0 ** -24
    reference = (torch.arange(1, 9, dtype=torch.float32) * step).to(torch.float16)  # all subnormal
    one_step_off = (reference.float() + step).to(torch.float16)
    assert select._mismatch(one_step_off, reference) is None
    assert "max error" in select._mismatch(one_step_off * 0 + 1e-4, reference)  # far outside the floor
    # in the normal range the relative tolerance (1% of the largest value) still decides
    normal = torch.full((8,), 1.0, dtype=torch.float16)
    assert select._mismatch(normal + 0.02, normal) is not None and select._mismatch(normal + 0.005, normal) is None


def test_short_candidates_are_timed_several_calls_per_replay():
    """A replay's events also time the graph's launch (about 10 µs on the H200), so a candidate
    whose replay is short is captured several times in one graph and its time divided by them."""
    assert select.calls_per_replay(select.SHORT_REPLAY_MS) == 1
    assert select.calls_per_replay(1.5) == 1  # a batch-256 layer: one call
    assert select.calls_per_replay(0.02) == 10  # a batch-1 layer: 0.2 ms of calls
    assert select.calls_per_replay(0.0) == select.MAX_CALLS_PER_REPLAY
    assert all(1 < select.calls_per_replay(ms) <= select.MAX_CALLS_PER_REPLAY for ms in (0.001, 0.01, 0.049))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="graph replays need a GPU")
def test_a_short_kernel_is_captured_with_several_calls():
    x = torch.zeros(16, device="cuda")
    calls = []

    def candidate():
        calls.append(1)
        x.add_(1)

    times = select.timing_samples_ms(candidate, torch.device("cuda"), iterations=2, warmup=1, graph=True)
    assert len(times) == 2 and all(t > 0 for t in times)
    # two runs for the one-call graph (warm-up, capture), then the longer graph's warm-up and captures
    assert len(calls) > 2 + 1 + 1
