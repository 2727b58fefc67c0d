"""bench/compare_layers.py: two engines' builder timings matched layer by layer."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))

from compare_layers import compare, load_layers  # noqa: E402


def _layers(path: Path, layers: list[tuple]) -> Path:
    path.write_text(json.dumps([{"name": name, "op": op, "tactic": "description", "fastest": tactic, "ms": ms,
                                 "timed_ms": {}} for name, op, tactic, ms in layers]))
    return path


@pytest.fixture()
def engines(tmp_path):
    fp16 = _layers(tmp_path / "fp16.json", [("stem", "FusedConv", "torch", 0.30), ("c3", "FusedConv", "igemm.a", 0.12),
                                            ("c1", "FusedConv", "igemm.b", 0.06), ("pool", "MaxPool", "triton", 0.01),
                                            ("gone", "FusedConv", "torch", 0.02)])
    int8 = _layers(tmp_path / "int8.json", [("stem", "QConv", "window_resident.x", 0.10),
                                            ("c3", "QConv", "igemm.c.row-taps", 0.10), ("c1", "QConv", "resident.d", 0.03),
                                            ("pool", "MaxPool", "triton", 0.01), ("new", "QConv", "tma.e", 0.01)])
    return fp16, int8


def test_layers_are_matched_by_name_and_ranked_by_what_holds_the_ratio_back(engines):
    result = compare(load_layers(engines[0]), load_layers(engines[1]), target=1.5)
    assert result["first_ms"] == pytest.approx(0.49) and result["second_ms"] == pytest.approx(0.24)
    assert result["only_first"] == ["gone"] and result["only_second"] == ["new"]
    # c3: 0.10 - 0.12 / 1.5 = +0.02 (holds back); stem: 0.10 - 0.20 = -0.10 (carries the rest)
    assert [row["name"] for row in result["rows"]] == ["c3", "pool", "c1", "stem"]
    assert result["rows"][0]["excess_ms"] == pytest.approx(0.02)
    assert result["families"]["igemm"] == {"layers": 1, "first_ms": pytest.approx(0.12), "second_ms": pytest.approx(0.10)}


def test_the_command_prints_totals_families_and_layers(engines):
    done = subprocess.run([sys.executable, str(BENCH / "compare_layers.py"), *map(str, engines), "--rows", "2"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "ratio 2.04 (target 1.5: 0.327 ms)" in done.stdout
    assert "only_first: gone 0.0200 ms" in done.stdout and "only_second: new 0.0100 ms" in done.stdout
    layer_lines = done.stdout.split("== layers by excess")[1].strip().splitlines()[1:]
    assert len(layer_lines) == 2 and "c3" in layer_lines[0]


def test_a_plan_is_read_from_its_header_as_the_layers_json_would_have_it(tiny_plan, tmp_path):
    """An engine file gives each timed layer its fastest tactic and time (the table's builds keep plans,
    not layers JSON); layers the builder did not time are left out, as from the JSON."""
    from compare_layers import header_layers
    from sartor.runtime.engine_file import read_engine_file

    header = read_engine_file(tiny_plan)[0]
    timed = {layer["name"]: layer["tactic_timings_ms"] for layer in header["layers"] if layer.get("tactic_timings_ms")}
    assert timed  # the CPU build times its convolutions' tactics
    layers = load_layers(tiny_plan)
    assert set(layers) == set(timed)
    for name, timings in timed.items():
        assert layers[name]["ms"] == min(timings.values())
        assert layers[name]["tactic"] == min(timings, key=timings.get)
    as_json = tmp_path / "layers.json"
    as_json.write_text(json.dumps(header_layers(header)))
    assert load_layers(as_json) == layers
    done = subprocess.run([sys.executable, str(BENCH / "compare_layers.py"), str(tiny_plan), str(as_json)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert f"shared layers: {len(timed)};" in done.stdout and "ratio 1.00" in done.stdout
    plans = subprocess.run([sys.executable, str(BENCH / "compare_layers.py"), str(tiny_plan), str(tiny_plan)],
                           capture_output=True, text=True, timeout=60)
    assert plans.returncode == 0, plans.stderr
    counts = f"{tiny_plan.name} {len(header['layers'])} / {len(timed)}"
    assert f"with a builder time (the untimed run one tactic): {counts} {counts}" in plans.stdout
