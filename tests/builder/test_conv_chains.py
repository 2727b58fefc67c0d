"""builder/conv_chains.py's engine-level check: the engine with its chains against the engine without,
end to end; the chains kept only where the whole engine wins. On the CPU (where no chain is fused) the
check's mechanics run on a real engine standing for both; the GPU runs are bench/conv_chains_ab.py's."""
from __future__ import annotations

import re

import pytest
import torch
from conftest import MAX_SHAPES, MIN_SHAPES, OPT_SHAPES

from sartor.builder.conv_chains import MARGIN, chains_win, check_chains
from sartor.runtime.engine_file import read_engine_file


def test_chains_are_kept_only_when_the_whole_engine_wins_by_the_margin():
    assert chains_win([1.0, 2.0], [0.9, 1.8])
    assert not chains_win([1.0], [MARGIN * 1.0 + 1e-6])  # within run-to-run noise: without them
    assert not chains_win([1.0, 1.0], [0.5, 1.6])  # summed over the profiles


def _feeds(engine_header: dict):
    def opt_feeds(k: int) -> dict:
        return {name: torch.rand(*shapes["opt"]) for name, shapes in engine_header["profiles"][k].items()}
    return opt_feeds


def test_times_both_engines_at_every_profile_and_leaves_the_build_as_the_decision_says(tiny_plan):
    header, tensors = read_engine_file(tiny_plan)
    switched, log = [], []
    record = check_chains(lambda: (header, tensors), switched.append, torch.device("cpu"), _feeds(header), log)
    assert [p["profile"] for p in record["profiles"]] == list(range(len(header["profiles"])))
    assert all(p["apart_ms"] > 0 and p["chains_ms"] > 0 for p in record["profiles"])
    kept = chains_win([p["apart_ms"] for p in record["profiles"]], [p["chains_ms"] for p in record["profiles"]])
    assert record["kept"] is kept and switched == [False, kept]
    assert log[-1].startswith("chains: kept" if kept else "chains: not used, the engine was not 1% faster")


def test_an_engine_that_cannot_be_timed_leaves_the_build_without_chains(tiny_plan):
    header, tensors = read_engine_file(tiny_plan)
    calls, switched, log, warnings = [], [], [], []

    def make_header():
        calls.append(1)
        if len(calls) == 2:  # the engine without chains fails to load
            raise RuntimeError("no such kernel")
        return header, tensors
    record = check_chains(make_header, switched.append, torch.device("cpu"), _feeds(header), log, warnings.append)
    assert record["kept"] is False and record["error"] == "RuntimeError: no such kernel"
    assert switched == [False, False] and warnings == log == [
        "warning: chains: not used, the engine could not be timed with them: RuntimeError: no such kernel"]


def test_the_halves_split_the_chains_in_graph_order_the_first_taking_the_odd_one():
    from sartor.builder.conv_chains import chain_halves
    assert chain_halves([]) == chain_halves(["a"]) == []
    assert chain_halves(["a", "b"]) == [("a",), ("b",)]
    assert chain_halves(["a", "b", "c"]) == [("a", "b"), ("c",)]


def _scripted_times(monkeypatch, rounds: list[dict]):
    """check_chains' timings, one scripted {key: ms} per call of fastest_alternating ("apart", then the
    engines it is timed against, 0, 1, …; they are real, built from the tiny plan; which is faster is what
    the script says)."""
    from sartor.builder import conv_chains
    calls = iter(rounds)
    monkeypatch.setattr(conv_chains, "fastest_alternating", lambda contexts, feeds, device: {
        key: ms for key, ms in next(calls).items() if key in contexts})


HALVES = [("a", "b"), ("c",)]


@pytest.mark.parametrize("rounds, switched, kept_chains", [
    # every chain wins: no half is timed
    ([{"apart": 1.0, 0: 0.9}], [False, True], None),
    # every chain loses, the first half loses, the second wins
    ([{"apart": 1.0, 0: 1.0}, {"apart": 1.0, 0: 1.0, 1: 0.95}], [False, HALVES[0], HALVES[1], HALVES[1]],
     ["c"]),
    # both halves win: the faster is kept
    ([{"apart": 1.0, 0: 1.2}, {"apart": 1.0, 0: 0.9, 1: 0.95}], [False, HALVES[0], HALVES[1], HALVES[0]],
     ["a", "b"]),
    # neither wins: none
    ([{"apart": 1.0, 0: 1.2}, {"apart": 1.0, 0: 0.995, 1: 1.1}], [False, HALVES[0], HALVES[1], False], None),
])
def test_where_every_chain_loses_each_half_is_timed_and_the_faster_half_that_wins_is_kept(
        tiny_plan, monkeypatch, rounds, switched, kept_chains):
    header, tensors = read_engine_file(tiny_plan)
    _scripted_times(monkeypatch, [dict(r) for r in rounds for _ in header["profiles"]])
    calls, log = [], []
    record = check_chains(lambda: (header, tensors), calls.append, torch.device("cpu"), _feeds(header), log,
                          subsets=HALVES)
    assert calls == switched
    assert record["kept"] is (switched[-1] is not False) and record.get("kept_chains") == kept_chains
    if len(rounds) == 1:
        assert "subsets" not in record and log == [log[-1]] and log[-1].startswith("chains: kept, the engine")
        return
    assert [entry["chains"] for entry in record["subsets"]] == [list(half) for half in HALVES]
    assert [p["chains_ms"] for p in record["subsets"][1]["profiles"]] == [rounds[1][1]] * len(header["profiles"])
    assert log[0].startswith("chains: not all, the engine was not 1% faster with every chain")
    assert log[1].startswith(f"chains: kept {len(kept_chains)} of 3" if kept_chains else
                             "chains: not used, no half of them made the engine 1% faster")


def test_a_half_that_cannot_be_timed_leaves_the_build_without_chains(tiny_plan, monkeypatch):
    header, tensors = read_engine_file(tiny_plan)
    _scripted_times(monkeypatch, [{"apart": 1.0, 0: 1.1}] * len(header["profiles"]))
    calls, switched, log, warnings = [], [], [], []

    def make_header():
        calls.append(1)
        if len(calls) == 4:  # the second half's engine fails to load
            raise RuntimeError("no such kernel")
        return header, tensors
    record = check_chains(make_header, switched.append, torch.device("cpu"), _feeds(header), log, warnings.append,
                          subsets=HALVES)
    assert record["kept"] is False and record["error"] == "RuntimeError: no such kernel"
    assert switched == [False, HALVES[0], HALVES[1], False]
    assert warnings == [log[-1]] == [
        "warning: chains: not used, the engine could not be timed with half of them: RuntimeError: no such kernel"]


def test_inspect_says_how_many_chains_the_engine_runs_and_the_timing_behind_them(tiny_plan):
    from sartor.cli.inspect import _chains_summary, engine_summary
    assert engine_summary(str(tiny_plan), None)["chains"]["text"].startswith("none (not timed: a CPU engine")
    graph = {"nodes": [{"op": "ConvChain"}, {"op": "QConv"}, {"op": "ConvChain"}]}
    timed = {"margin": MARGIN, "kept": True, "profiles": [{"profile": 0, "apart_ms": 0.25, "chains_ms": 0.24}]}
    assert _chains_summary({"graph": graph, "chains_check": timed})["text"] == (
        "2 layer(s), the engine faster with them (profile 0 0.24 ms with, 0.25 ms without)")
    dropped = {"graph": {"nodes": []}, "chains_check": dict(timed, kept=False)}
    assert _chains_summary(dropped)["text"].startswith("none, the engine not faster")
    failed = {"graph": {"nodes": []}, "chains_check": dict(timed, kept=False, error="RuntimeError: x")}
    assert _chains_summary(failed)["text"] == "none, the build could not time them (RuntimeError: x)"
    halves = [{"chains": ["a", "b"], "profiles": [{"profile": 0, "apart_ms": 0.25, "chains_ms": 0.26}]},
              {"chains": ["c"], "profiles": [{"profile": 0, "apart_ms": 0.25, "chains_ms": 0.23}]}]
    half = {"graph": {"nodes": [{"op": "ConvChain"}]}, "chains_check": dict(timed, subsets=halves, kept_chains=["c"])}
    assert _chains_summary(half)["text"] == ("1 layer(s), the engine faster with them (profile 0 0.23 ms with, 0.25 ms "
                                             "without); with all 3 it was not (profile 0 0.24 ms with, 0.25 ms without)")
    neither = {"graph": {"nodes": []}, "chains_check": dict(timed, kept=False, subsets=halves)}
    assert _chains_summary(neither)["text"].endswith(
        "; nor with either half of them (profile 0 0.26 ms with, 0.25 ms without | profile 0 0.23 ms with, 0.25 ms "
        "without)")
    asked = {"graph": graph, "build_config": {"conv_chains": True}}
    assert _chains_summary(asked)["text"].startswith("2 layer(s), each faster than its two layers (--conv-chains")
    refused = {"graph": {"nodes": []}, "build_config": {"conv_chains": False}}
    assert _chains_summary(refused)["text"] == "none (--no-conv-chains)"


def test_the_cli_flag_reaches_the_config_and_the_rebuild_command():
    """--conv-chains: every chain that times faster; --no-conv-chains: none; neither: also checked
    against the whole engine (None)."""
    from sartor.cli.build import config_from_args
    from sartor.cli.main import make_parser
    from sartor.runtime.engine import rebuild_command

    def config(*flags):
        return config_from_args(make_parser().parse_args(["build", "m.onnx", "-o", "m.plan", *flags]))
    assert config("--conv-chains").conv_chains is True and config("--no-conv-chains").conv_chains is False
    assert config().conv_chains is None
    for asked, flags in ((True, ["--conv-chains"]), (False, ["--no-conv-chains"]), (None, [])):
        words = rebuild_command({"build_config": config().to_json() | {"conv_chains": asked}}).split()
        assert [w for w in words if w.endswith("conv-chains")] == flags


@pytest.mark.parametrize("kwargs, message", [
    ({"builder_effort": 0}, "--conv-chains fuses the chains that time faster than their two layers: it needs "
                            "--builder-effort 1 or more"),
    ({"device": "cpu"}, "--conv-chains fuses convolutions into sartor's CUDA kernels; cpu is not a CUDA device"),
])
def test_asking_for_chains_where_none_can_be_timed_is_refused(tiny_onnx, tmp_path, kwargs, message):
    import sartor
    from sartor.errors import ConfigError
    with pytest.raises(ConfigError, match=re.escape(message)):
        sartor.build(tiny_onnx, tmp_path / "m.plan", conv_chains=True, min_shapes=MIN_SHAPES, opt_shapes=OPT_SHAPES,
                     max_shapes=MAX_SHAPES, **dict({"device": "cpu", "builder_effort": 1}, **kwargs))
    assert not (tmp_path / "m.plan").exists()


def test_a_chain_on_its_kernel_is_marked_for_programmatic_launch_and_on_the_reference_not():
    from sartor.builder.pdl import mark_programmatic_launch
    from sartor.ir import Graph, Node
    from sartor.kernels.conv.chain import CHAIN_TILES
    nodes = [Node("ConvChain", "kernel", ["x"], ["y"], {"tactic": CHAIN_TILES[0].name}),
             Node("ConvChain", "reference", ["y"], ["z"], {"tactic": "torch"})]
    graph = Graph(nodes, [], [], {})
    assert mark_programmatic_launch(graph) == 1
    assert nodes[0].attrs.get("pdl") is True and "pdl" not in nodes[1].attrs


def _selection(entries: dict):
    from sartor.tactics import TacticSelection
    return TacticSelection(layers={name: {"tactic": tactic, "timings_ms": {tactic: ms}, "rejected": {},
                                          "source": "timed"} for name, (tactic, ms) in entries.items()})


def _backbone_pairs():
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "passes"))
    from test_fuse_conv_chain import _quantized, backbone

    from sartor.passes.fuse_conv_chain import chain_pairs
    graph, layers = _quantized(backbone())
    return graph, layers, chain_pairs(graph, layers)


def test_a_chain_faster_at_every_profile_replaces_its_layers_in_the_graph_the_selections_and_the_precisions():
    from sartor.builder.conv_chains import fuse_faster_chains
    from sartor.kernels.conv.chain import CHAIN_TILES
    graph, layers, pairs = _backbone_pairs()
    tile = CHAIN_TILES[0].name
    selections = [_selection({"down": ("igemm.64x64x64.w4.s4", 0.010), "cv1": ("resident.64x64.t8.w4.s2", 0.008)}),
                  _selection({"down": ("igemm.64x64x64.w4.s4", 0.030), "cv1": ("resident.64x64.t8.w4.s2", 0.020)})]
    trial = [_selection({"down+cv1": (tile, 0.012)}), _selection({"down+cv1": (tile, 0.040)})]
    reasons = {"down": "kept INT8", "cv1": "the 1×1's own", "stem": "the stem's"}
    timings = fuse_faster_chains(graph, pairs, selections, trial, layers, reasons)
    assert timings[0].chain_ms == 0.052 and timings[0].apart_ms == 0.068 and timings[0].fused
    assert reasons == {"down+cv1": "kept INT8", "stem": "the stem's"}
    assert [n.name for n in graph.nodes if n.op_type == "ConvChain"] == ["down+cv1"]
    for selection in selections:
        assert "down+cv1" in selection.layers and not {"down", "cv1"} & set(selection.layers)
    assert layers["down+cv1"] == "int8" and not {"down", "cv1"} & set(layers)


def test_a_choice_fuses_only_the_chains_named_into_a_graph_without_them():
    """What the engine check's halves are built from: the build without chains, a copy, and the
    chains of one half fused into it from the trial's selections."""
    import copy

    from sartor.builder.conv_chains import ChainChoice, ChainTiming
    from sartor.kernels.conv.chain import CHAIN_TILES
    graph, layers, _ = _backbone_pairs()
    selections = [_selection({"down": ("igemm.64x64x64.w4.s4", 0.010), "cv1": ("resident.64x64.t8.w4.s2", 0.008)})]
    choice = ChainChoice([ChainTiming("down+cv1", 0.012, 0.018)], [_selection({"down+cv1": (CHAIN_TILES[0].name,
                                                                                             0.012)})])
    assert choice.fused == ["down+cv1"]
    none_named = graph.copy()
    choice.fuse_only(none_named, copy.deepcopy(selections), dict(layers), None, [])
    assert not any(n.op_type == "ConvChain" for n in none_named.nodes)
    choice.fuse_only(graph, selections, layers, None, ["down+cv1"])
    assert [n.name for n in graph.nodes if n.op_type == "ConvChain"] == ["down+cv1"]
    assert selections[0].layers["down+cv1"]["tactic"] == CHAIN_TILES[0].name and "down" not in selections[0].layers
    assert layers["down+cv1"] == "int8" and "cv1" not in layers


def test_a_chain_whose_winner_is_its_reference_at_some_profile_stays_two_layers():
    from sartor.builder.conv_chains import fuse_faster_chains
    from sartor.kernels.conv.chain import CHAIN_TILES
    graph, layers, pairs = _backbone_pairs()
    before = [n.name for n in graph.nodes]
    selections = [_selection({"down": ("igemm.64x64x64.w4.s4", 0.010), "cv1": ("resident.64x64.t8.w4.s2", 0.008)})] * 2
    trial = [_selection({"down+cv1": (CHAIN_TILES[0].name, 0.001)}), _selection({"down+cv1": ("torch", 0.001)})]
    timings = fuse_faster_chains(graph, pairs, selections, trial, layers)
    assert not timings[0].fused and timings[0].chain_ms is None
    assert [n.name for n in graph.nodes] == before and "down+cv1" not in layers


def test_a_chain_is_timed_under_a_signature_of_its_two_layers_not_of_its_scales():
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "kernels"))
    from test_kernels_conv_chain import CASES, _int8_chain

    from sartor.tactics.timing_cache import layer_signature
    inputs, attrs = _int8_chain(*CASES[0], torch.Generator().manual_seed(1))
    signature = layer_signature("ConvChain", inputs, attrs, "int8", False)
    assert signature.startswith("ConvChain QConv x=i8[2x16x9x11]:nhwc w=i8[32x16x3x3]") and "strides=2,2" in signature
    assert signature.endswith("then w=i8[32x32x1x1]:contiguous b=i32 act=SiLU out=i8")
    rescaled = dict(attrs, first=dict(attrs["first"], output_inv_scale=12.0))
    assert layer_signature("ConvChain", inputs, rescaled, "int8", False) == signature
    floats_out = dict(attrs, second=dict(attrs["second"], output_inv_scale=None))
    assert layer_signature("ConvChain", inputs, floats_out, "int8", False) != signature
