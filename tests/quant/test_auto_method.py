"""--calib-method auto: the held-out split, the per-tensor choice, never worse than the best single
method on the held-out samples (in the simulation it chooses by, and in the engine), the cache
round trip, the fallback, and what inspect shows."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from conftest import (
    IMAGE,
    assert_cli_error,
    classifier_model,
    gaussian_images,
    make_model,
    save,
)
from onnx import TensorProto, helper, numpy_helper
from test_quant import SHAPE_ARGS, SHAPES

import sartor
from sartor.cli.inspect import calibration_line
from sartor.frontend import import_onnx
from sartor.ops.quantized import quantize
from sartor.ops.util import tensor_from_numpy
from sartor.passes import optimize
from sartor.quant.auto_method import (
    FALLBACK_METHOD,
    HELD_OUT_EVERY,
    MAX_HELD_OUT,
    PER_TENSOR,
    HeldOutSplit,
    Simulation,
    choose_methods,
    fake_quantize,
    output_error,
    reader_errors,
)
from sartor.quant.cache import CalibrationCache, CalibrationCacheError, read_cache
from sartor.quant.calibrate import amax_from_histograms, collect_histograms
from sartor.quant.calibrators import METHODS
from sartor.quant.plan import calibration_targets, int8_decisions
from sartor.quant.quantize import activation_scale
from sartor.runtime.executor import Executor
from sartor.runtime.engine_file import read_engine_file

CLIP = 0.1  # the saturating branch's ceiling


def two_branch_model() -> onnx.ModelProto:
    """Two branches on the image: a1 → Relu → a2 (linear: the long tail of its input matters) and
    b1 → Relu → b2 → Clip(0, CLIP) (saturating: only the bulk of its input matters). Each branch
    wants another threshold method for its middle tensor; a2 and b2 are INT8 by override."""
    rng = np.random.default_rng(0)

    def tensor(name, a):
        return numpy_helper.from_array(np.asarray(a, np.float32), name)

    def pick(channel):  # 8 output channels, each mostly one input channel
        return np.eye(3)[[channel] * 8].reshape(8, 3, 1, 1) + rng.normal(0, 0.05, (8, 3, 1, 1))
    inits = [tensor("a1.w", pick(0)), tensor("a2.w", rng.normal(0, 0.3, (8, 8, 1, 1))), tensor("b1.w", pick(1)),
             tensor("b2.w", np.abs(rng.normal(0, 0.3, (8, 8, 1, 1)))), tensor("lo", 0.0), tensor("hi", CLIP)]
    nodes = [helper.make_node("Conv", ["images", "a1.w"], ["a"], name="a1"),
             helper.make_node("Relu", ["a"], ["ra"], name="relu_a"),
             helper.make_node("Conv", ["ra", "a2.w"], ["out_a"], name="a2"),
             helper.make_node("Conv", ["images", "b1.w"], ["b"], name="b1"),
             helper.make_node("Relu", ["b"], ["rb"], name="relu_b"),
             helper.make_node("Conv", ["rb", "b2.w"], ["c"], name="b2"),
             helper.make_node("Clip", ["c", "lo", "hi"], ["out_b"], name="clip")]
    shape = ["batch", 8, IMAGE, IMAGE]
    return make_model(nodes, [helper.make_tensor_value_info("images", TensorProto.FLOAT, ["batch", 3, IMAGE, IMAGE])],
                      [helper.make_tensor_value_info("out_a", TensorProto.FLOAT, shape),
                       helper.make_tensor_value_info("out_b", TensorProto.FLOAT, shape)], inits, name="two_branch")


def two_branch_samples() -> np.ndarray:
    """Student-t pixels: a very long tail on channel 0 (branch a), a long one on the others."""
    rng = np.random.default_rng(2)
    return np.concatenate([rng.standard_t(1.5, (48, 1, IMAGE, IMAGE)), rng.standard_t(3, (48, 2, IMAGE, IMAGE))],
                          axis=1).astype(np.float32)


OVERRIDES = {"a2": "int8", "b2": "int8"}


def _batches(samples: np.ndarray, size: int = 5) -> list[dict]:
    return [{"images": samples[k:k + size]} for k in range(0, len(samples), size)]


def test_every_fifth_sample_is_held_out_up_to_the_cap():
    samples = np.arange(12, dtype=np.float32).reshape(12, 1)
    split = HeldOutSplit(_batches(samples), batch_size=4)
    fitted = np.concatenate([b["images"] for b in split])
    assert fitted.ravel().tolist() == [0, 1, 2, 3, 5, 6, 7, 8, 10, 11] and split.fit == 10
    assert split.drawn == 12  # the progress a build shows counts the held-out samples too
    held = split.held_out_batches()
    assert [b["images"].ravel().tolist() for b in held] == [[4, 9]]
    many = HeldOutSplit(_batches(np.arange(400, dtype=np.float32).reshape(400, 1), 7), batch_size=8)
    assert sum(len(b["images"]) for b in many) == 400 - MAX_HELD_OUT
    assert many.drawn == 400
    held = np.concatenate([b["images"] for b in many.held_out_batches()]).ravel()
    assert held.tolist() == [HELD_OUT_EVERY * k + HELD_OUT_EVERY - 1 for k in range(MAX_HELD_OUT)]


def _prepared(folder: Path):
    model = save(two_branch_model(), folder / "two_branch.onnx")
    graph = import_onnx(model).graph
    optimize(graph)
    weights = {k: tensor_from_numpy(a) for k, a in graph.initializers.items()}
    layers = {n: p for n, (p, _) in int8_decisions(graph, "fp32").items() if p == "int8"}
    layers.update(OVERRIDES)
    return model, graph, weights, layers, two_branch_samples()


def test_auto_chooses_per_tensor_and_is_never_worse_than_one_method(tmp_path):
    _, graph, weights, layers, samples = _prepared(tmp_path)
    targets = calibration_targets(graph)
    split = HeldOutSplit(_batches(samples), 4)
    observers = collect_histograms(graph, weights, split, targets, "cpu")
    held_out = split.held_out_batches()
    choice = choose_methods(graph, weights, observers, held_out, layers, targets, "cpu", 99.99, split.fit)
    assert choice.chosen == PER_TENSOR and len(set(choice.methods.values())) >= 2, choice.to_json()
    candidates = {m: amax_from_histograms(observers, m, 99.99) for m in METHODS}
    assert all(choice.amax[t] == candidates[choice.methods[t]][t] for t in choice.amax)
    # Measured apart from the choice: on the held-out samples, the mix beats each method alone.
    simulation = Simulation(graph, weights, layers, targets, torch.device("cpu"))
    reference = Simulation(graph, weights, {}, targets, torch.device("cpu")).run(held_out, {})  # FP32
    weights_only = simulation.run(held_out, {})  # no activation threshold: only the weights quantized
    assert 0 < output_error(reference, weights_only) < output_error(reference, simulation.run(held_out, choice.amax))
    errors = {m: output_error(reference, simulation.run(held_out, candidates[m])) for m in METHODS}
    mixed = output_error(reference, simulation.run(held_out, choice.amax))
    assert mixed < min(errors.values()), (mixed, errors)
    assert choice.errors[PER_TENSOR] == pytest.approx(mixed) and choice.held_out == len(samples) // HELD_OUT_EVERY


def test_fake_quantize_is_the_engines_codes_times_the_scale_and_leaves_its_input():
    x = torch.from_numpy(np.random.default_rng(4).standard_t(2, 10_000).astype(np.float32))
    before = x.clone()
    for amax in (0.5, 3.0, float(x.abs().max())):
        scale, inverse = activation_scale(amax)
        expected = quantize(x, inverse).float() * scale
        assert torch.equal(fake_quantize(x, amax), expected)
        assert torch.equal(x, before)  # quantized in a copy, never in the caller's tensor
    assert (fake_quantize(x, 0.5).abs() <= 0.5 + 1e-6).all() and not torch.equal(fake_quantize(x, 0.5), x)


def _reader_errors_by_rerun(graph, weights, batches, candidates, targets, formats) -> dict:
    """reader_errors as it was: each reader run again on its float arguments for the reference."""
    sums = {}

    def before(index, step, args):
        for position in targets.get(step.node.name, ()):
            tensor = step.node.inputs[position]
            reference = step.impl(args, step.attrs).double()
            entry = sums.setdefault((tensor, step.node.name), [0.0, {}])
            entry[0] += float((reference ** 2).sum())
            for amax in {table[tensor] for table in candidates.values() if tensor in table}:
                trial = list(args)
                trial[position] = fake_quantize(args[position], amax, formats.get(step.node.name, "int8"))
                noise = float(((step.impl(trial, step.attrs).double() - reference) ** 2).sum())
                entry[1][amax] = entry[1].get(amax, 0.0) + noise
    executor = Executor(graph, weights, torch.device("cpu"))
    with torch.inference_mode():
        for batch in batches:
            executor.run({k: torch.from_numpy(v) for k, v in batch.items()}, before=before)
    errors = {}
    for (tensor, _), (signal, noise) in sums.items():
        for method, table in candidates.items():
            errors.setdefault(tensor, {})
            errors[tensor][method] = errors[tensor].get(method, 0.0) + noise[table[tensor]] / signal
    return errors


def test_reader_errors_keep_the_numbers_of_rerunning_each_reader(tmp_path):
    """The readers' reference is the executor's own float output: the same numbers, bit for bit,
    as running each reader again on its float arguments."""
    _, graph, weights, layers, samples = _prepared(tmp_path)
    targets = {name: positions for name, positions in calibration_targets(graph).items() if name in layers}
    observers = collect_histograms(graph, weights, _batches(samples[:40]), targets, "cpu")
    candidates = {m: amax_from_histograms(observers, m, 99.99) for m in METHODS}
    held_out = _batches(samples[40:])
    errors, reference = reader_errors(graph, weights, held_out, candidates, targets, layers, torch.device("cpu"))
    assert errors == _reader_errors_by_rerun(graph, weights, held_out, candidates, targets, layers)
    assert len(errors) >= 2 and all(len(set(e.values())) >= 2 and min(e.values()) > 0 for e in errors.values())
    assert len(reference) == len(held_out) and set(reference[0]) == {"out_a", "out_b"}


def _engine_error(plan: Path, batches: list[dict], reference: list[dict]) -> float:
    context = sartor.load(plan, device="cpu").context()
    outputs = [{k: np.asarray(v, np.float64) for k, v in context.run(b).items()} for b in batches]
    return output_error(reference, outputs)


def test_the_auto_engine_beats_each_method_on_the_held_out_samples(tmp_path):
    """The exact INT8 engines, not the simulation: auto's is the closest to FP32 on the samples it
    held out, against each method alone calibrated on the samples auto fitted its thresholds on."""
    model, _, _, _, samples = _prepared(tmp_path)
    build = {"device": "cpu", "profiles": [SHAPES], "layer_precision": OVERRIDES}
    sartor.build(model, tmp_path / "fp32.plan", device="cpu", profiles=[SHAPES])
    held_index = np.arange(HELD_OUT_EVERY - 1, len(samples), HELD_OUT_EVERY)
    held, fitted = samples[held_index], np.delete(samples, held_index, axis=0)
    batches = [{"images": held[k:k + 4]} for k in range(0, len(held), 4)]
    reference_context = sartor.load(tmp_path / "fp32.plan", device="cpu").context()
    reference = [{k: np.asarray(v, np.float64) for k, v in reference_context.run(b).items()} for b in batches]
    errors = {}
    for method in METHODS:
        sartor.build(model, tmp_path / f"{method}.plan", precision="int8", calib_method=method, calib=fitted, **build)
        errors[method] = _engine_error(tmp_path / f"{method}.plan", batches, reference)
    result = sartor.build(model, tmp_path / "auto.plan", precision="int8", calib_method="auto", calib=samples, **build)
    assert result.header["provenance"]["calibration"]["auto"]["chosen"] == PER_TENSOR
    errors["auto"] = _engine_error(tmp_path / "auto.plan", batches, reference)
    assert errors["auto"] < min(errors[m] for m in METHODS), errors


def test_auto_cache_round_trip_and_inspect(tmp_path, cli):
    model, _, _, _, samples = _prepared(tmp_path)
    np.save(tmp_path / "calib.npy", samples)
    cache = tmp_path / "calib.json"
    args = ("--device", "cpu", *SHAPE_ARGS, "--precision", "int8", "--layer-precision", "a2=int8",
            "--layer-precision", "b2=int8")
    first = cli("build", model, "-o", tmp_path / "a.plan", *args, "--calib", tmp_path / "calib.npy",
                "--calib-method", "auto", "--calib-cache", cache)
    assert first.code == 0, first
    stored = read_cache(cache)
    data = json.loads(cache.read_text())
    assert stored.method == "auto" and stored.auto["chosen"] == PER_TENSOR and set(stored.methods) == set(stored.amax)
    assert data["methods"] == stored.methods and len(set(stored.methods.values())) >= 2
    second = cli("build", model, "-o", tmp_path / "b.plan", *args, "--calib-cache", cache)
    assert second.code == 0 and "calibration skipped" in second.out, second
    header_a, tensors_a = read_engine_file(tmp_path / "a.plan")
    header_b, tensors_b = read_engine_file(tmp_path / "b.plan")
    assert all(torch.equal(tensors_a[k], tensors_b[k]) for k in tensors_a)
    cal_a, cal_b = header_a["provenance"]["calibration"], header_b["provenance"]["calibration"]
    assert cal_a["methods"] == cal_b["methods"] == stored.methods and cal_b["auto"]["chosen"] == PER_TENSOR
    shown = cli("inspect", tmp_path / "b.plan")
    assert shown.code == 0 and "Threshold methods" in shown.out, shown
    for method in set(stored.methods.values()):
        assert method in shown.out
    assert calibration_line(cal_b).endswith(f"(from cache {cache}); auto chose per-tensor by output error on 9 "
                                            f"held-out samples ({', '.join(f'{k} {v:.3g}' for k, v in cal_b['auto']['errors'].items())})")
    # Asking for a single method against an auto cache is refused; an explicit auto reads it.
    assert_cli_error(cli("build", model, "-o", tmp_path / "c.plan", *args, "--calib-cache", cache, "--calib-method",
                         "mse"), "holds auto thresholds but --calib-method mse was asked")
    assert cli("build", model, "-o", tmp_path / "d.plan", *args, "--calib-cache", cache, "--calib-method",
               "auto").code == 0


def test_cache_methods_are_checked(tmp_path):
    cache = CalibrationCache("ab" * 32, "auto", "cd" * 32, 7, {"x": 1.0, "y": 2.0}, methods={"x": "mse", "y": "minmax"},
                             auto={"chosen": PER_TENSOR})
    assert CalibrationCache.from_json(cache.to_json()).methods == {"x": "mse", "y": "minmax"}
    older = CalibrationCache("ab" * 32, "entropy", "cd" * 32, 7, {"x": 1.0})
    assert CalibrationCache.from_json(older.to_json()).tensor_methods() == {"x": "entropy"}
    for methods, message in (({"x": "bogus"}, "must map tensor → one of"), ({"z": "mse"}, "names 'z', which has no amax")):
        data = dict(cache.to_json(), methods=methods)
        with pytest.raises(CalibrationCacheError, match=message):
            CalibrationCache.from_json(data)


def test_too_few_samples_fall_back_to_one_method(tmp_path):
    model = save(classifier_model(), tmp_path / "m.onnx")
    samples = gaussian_images(5, HELD_OUT_EVERY * 2 - 1)
    auto = sartor.build(model, tmp_path / "a.plan", device="cpu", profiles=[SHAPES], precision="int8", calib=samples,
                        calib_method="auto", calib_cache=tmp_path / "a.json")
    single = sartor.build(model, tmp_path / "b.plan", device="cpu", profiles=[SHAPES], precision="int8", calib=samples,
                          calib_method=FALLBACK_METHOD, calib_cache=tmp_path / "b.json")
    record = auto.header["provenance"]["calibration"]
    assert record["auto"]["chosen"] == FALLBACK_METHOD and "needs 2 held out" in record["auto"]["reason"]
    assert set(record["methods"].values()) == {FALLBACK_METHOD}
    assert read_cache(tmp_path / "a.json").amax == read_cache(tmp_path / "b.json").amax
    assert single.header["provenance"]["calibration"]["methods"] == record["methods"]
    assert any("auto: mse for every tensor" in line for line in auto.log)


def test_calib_method_flag_choices(tmp_path, cli):
    model = save(classifier_model(), tmp_path / "m.onnx")
    np.save(tmp_path / "calib.npy", gaussian_images(1, 4))
    result = cli("sensitivity", model, "--calib", tmp_path / "calib.npy", "--calib-method", "auto")
    assert result.code == 2 and "invalid choice: 'auto'" in result.err
    result = cli("build", model, "-o", tmp_path / "a.plan", "--device", "cpu", *SHAPE_ARGS, "--precision", "int8",
                 "--calib", tmp_path / "calib.npy", "--calib-method", "median")
    assert result.code == 2 and "invalid choice: 'median'" in result.err and "'auto'" in result.err


def test_auto_is_the_default_and_says_so(tmp_path, cli):
    """A build that names no method chooses per tensor on held-out samples (0029, 0048); the help
    names the default."""
    model = save(classifier_model(), tmp_path / "m.onnx")
    result = sartor.build(model, tmp_path / "a.plan", device="cpu", profiles=[SHAPES], precision="int8",
                          calib=gaussian_images(5, 2 * HELD_OUT_EVERY))
    record = result.header["provenance"]["calibration"]
    assert record["method"] == "auto" and record["auto"]["held_out_samples"] == 2, record
    assert set(record["auto"]["errors"]) >= set(METHODS)
    shown = cli("build", "--help")
    assert "(default auto;" in " ".join(shown.out.split()), shown


def test_the_rebuild_command_names_the_method_an_engine_used():
    """An engine calibrated under the old default (mse) is rebuilt with mse, not today's auto."""
    from sartor.runtime.engine import rebuild_command
    header = {"build_config": {"precision": "int8", "calib": "calib.npy"},
              "provenance": {"calibration": {"method": "mse"}}}
    assert "--calib calib.npy --calib-method mse" in rebuild_command(header)
    header["build_config"]["calib_method"] = "entropy"  # asked for: named once, as asked
    assert rebuild_command(header).count("--calib-method") == 1 and "--calib-method entropy" in rebuild_command(header)
    cached = {"build_config": {"precision": "int8", "calib_cache": "c.json"},
              "provenance": {"calibration": {"method": "mse"}}}
    assert "--calib-method" not in rebuild_command(cached)  # the cache holds its method
