"""bench/gpu_zoo.py end to end on the CPU: one small architecture exported, built, checked against
ONNX Runtime and timed; a second call adding a peer without rebuilding, with the table and the
per-layer file; a third call skipping what is done and stopped by its budget mid-model."""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("timm")
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import gpu_zoo  # noqa: E402

MODEL = "deit_tiny_patch16_224"  # a ViT: its position embedding is made for the 64-pixel input
CPU_RUN = ["--device", "cpu", "--size", "64", "--batches", "1,2", "--iterations", "3", "--warmup", "1"]


def records(out: Path, kind: str) -> list[dict]:
    return [r for r in gpu_zoo.read_records(out / gpu_zoo.RESULTS) if r.get("record") == kind]


def test_profiles_cover_every_batch_each_timed_at_its_own_shape():
    profiles = gpu_zoo.profiles_for([64, 1], 224)
    assert [(p["min"]["input"][0], p["opt"]["input"][0], p["max"]["input"][0]) for p in profiles] == [(1, 1, 1),
                                                                                                     (2, 64, 64)]
    assert profiles[1]["opt"]["input"] == (64, 3, 224, 224)


def test_zero_initialised_parameters_get_small_random_values_and_others_stay():
    import torch
    layer = torch.nn.Linear(4, 3)
    norm = torch.nn.LayerNorm(3)
    torch.nn.init.zeros_(layer.bias)
    weight = layer.weight.detach().clone()
    assert gpu_zoo.randomise_zero_parameters(torch.nn.Sequential(layer, norm)) == 2  # the Linear's and LN's biases
    assert layer.bias.abs().min() > 0 and norm.bias.abs().min() > 0 and layer.bias.abs().max() < 0.2
    assert torch.equal(layer.weight, weight) and torch.equal(norm.weight, torch.ones(3))


def test_cpu_run_writes_lines_table_and_per_layer_then_resumes(tmp_path: Path, capsys, monkeypatch):
    out, work = tmp_path / "out", tmp_path / "work"
    common = CPU_RUN + ["--out", str(out), "--work", str(work), "--per-layer", "1"]
    assert gpu_zoo.main(common + ["--models", MODEL, "--peers", "none"]) == 0
    [call] = records(out, "call")
    assert call["versions"]["resolution"] == "64x64" and call["versions"]["device"] == "cpu"
    [model] = records(out, "model")
    assert model["errors"] == {} and model["params_m"] > 5 and model["build_s"] > 0
    assert model["cosine_min"] > 0.999 and set(model["cosine"]) == {"logits"}
    assert model["per_layer"]["layers"] and model["per_layer"]["batch"] == 2  # no eager: the largest batch
    first = records(out, "batch")
    assert [(r["batch"], r["sartor"]["median_ms"] > 0, r["sartor_bound"]["median_ms"] > 0) for r in first] == [
        (1, True, True), (2, True, True)]
    assert all("eager" not in r for r in first)

    # The eager peer asked for later: measured alone (no second build, no new model line) and
    # merged into the rows the first call wrote.
    capsys.readouterr()
    assert gpu_zoo.main(common + ["--models", MODEL, "--peers", "eager"]) == 0
    assert "only the peers missing" in capsys.readouterr().out
    assert len(records(out, "model")) == 1
    added = records(out, "batch")[2:]
    assert [r["batch"] for r in added] == [1, 2] and all("sartor" not in r and r["eager"]["median_ms"] > 0
                                                        for r in added)
    _, rows = gpu_zoo.collect(gpu_zoo.read_records(out / gpu_zoo.RESULTS))
    for batch in (1, 2):
        row = rows[MODEL][batch]
        assert row["speedup_vs_eager"] == pytest.approx(row["eager"]["median_ms"] / row["sartor"]["median_ms"],
                                                        abs=5e-4)  # rounded to 3 decimals
    table = (out / gpu_zoo.TABLE).read_text()
    assert "| batches / resolution / precision | 1, 2 / 64x64 / fp16 |" in table
    assert "| model | params M | build s | cosine (bar 0.9999) | sartor b1 ms | eager b1 ms | sartor b2 ms |" in table
    line = next(row for row in table.splitlines() if row.startswith(f"| {MODEL} |"))
    assert f"{rows[MODEL][1]['sartor']['median_ms']:.3f}" in line
    assert f"{rows[MODEL][2]['eager']['median_ms']:.3f}" in line
    assert line.endswith(f"| {gpu_zoo.slower_where(rows[MODEL], ['eager'])} |")
    per_layer = json.loads((out / gpu_zoo.PER_LAYER).read_text())
    assert list(per_layer) == [MODEL] and per_layer[MODEL]["layers"][0]["median_ms"] > 0

    # Nothing left of the first model: skipped; the budget runs out in the second one, which then
    # has no model line (the next call measures it) while the table keeps the first. The second
    # model's run outlasts the budget whatever the machine's speed: it sleeps where it would measure
    # (a quick machine built and timed MobileNetV3 at 64x64 within 3 s).
    real_run = gpu_zoo.ModelRun.run

    def outlasting_run(model_run):
        if model_run.arch.name == "mobilenetv3_large_100":
            time.sleep(60)  # the budget's alarm interrupts it
        return real_run(model_run)
    monkeypatch.setattr(gpu_zoo.ModelRun, "run", outlasting_run)
    assert gpu_zoo.main(common + ["--models", f"{MODEL},mobilenetv3_large_100", "--peers", "eager",
                                  "--budget-s", "3"]) == 0
    printed = capsys.readouterr().out
    assert f"{MODEL}: already in" in printed and "models left for another call: mobilenetv3_large_100" in printed
    assert len(records(out, "call")) == 3 and len(records(out, "batch")) == 4
    assert [m["model"] for m in records(out, "model")] == [MODEL]
    [stopped] = records(out, "stopped")
    assert "--budget-s 3 reached during mobilenetv3_large_100" in stopped["reason"]
    assert f"| {MODEL} |" in (out / gpu_zoo.TABLE).read_text()


def test_min_cosine_builds_with_the_planner_on_seeded_held_out_inputs_in_rows_of_their_own(tmp_path: Path):
    out, work = tmp_path / "out", tmp_path / "work"
    common = CPU_RUN + ["--out", str(out), "--work", str(work), "--peers", "none", "--models", MODEL]
    assert gpu_zoo.main(common + ["--min-cosine", "0.9999"]) == 0
    row = gpu_zoo.row_name(MODEL, 0.9999)
    assert row == f"{MODEL} (min-cosine 0.9999)" and gpu_zoo.row_name(MODEL, None) == MODEL
    [model] = records(out, "model")
    assert model["model"] == row and model["errors"] == {}, model
    planner = model["planner"]
    # FP16 already meets 0.9999 on this ViT at 64 pixels: measured once, nothing kept FP32.
    assert planner["min_cosine"] == 0.9999 and planner["held_out_samples"] == gpu_zoo.HELD_OUT_SAMPLES
    assert planner["kept_fp32"] == 0 and planner["measurements"] == 1 and planner["mean_cosine_after"] >= 0.9999
    held_out = np.load(work / f"held_out_64_seed{gpu_zoo.HELD_OUT_SEED}.npy")
    assert held_out.shape == (gpu_zoo.HELD_OUT_SAMPLES, 3, 64, 64) and 0 <= held_out.min() and held_out.max() < 1
    assert (work / f"{MODEL}_64_fp16_timings.json").is_file()  # the trials' and the final build's timings
    table = (out / gpu_zoo.TABLE).read_text()
    assert f"| {row} |" in table and f"- {row}: planner kept 0 of " in table
    # The plain row is another model: not skipped because the planned one is done.
    assert gpu_zoo.pending_work(out / gpu_zoo.RESULTS, gpu_zoo.parse_args(common), "cpu") == {MODEL: None}
    assert gpu_zoo.pending_work(out / gpu_zoo.RESULTS, gpu_zoo.parse_args(common + ["--min-cosine", "0.9999"]),
                                "cpu") == {}
