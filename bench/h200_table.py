"""Issue 5's table in one device call per group of models: sartor FP16 (and INT8/FP8 where asked,
calibrated on 64 street scenes at the model's input size) against PyTorch eager FP16
channels-last + CUDA graph and torch.compile reduce-overhead (and max-autotune where asked), per
batch, in the same process; with build time (cold and with a warm timing cache), load time, first
inference and device memory.

    PYTHONPATH=. python bench/h200_table.py --out $OUT --models resnet50,mobilenet_v3_large \\
        [--batches 1,8,64,256] [--int8] [--fp8] [--onnx-dir .carry] [--no-compile]

Models: resnet50, mobilenet_v3_large, efficientnet_b0 (torchvision, 224, random weights with settled
BatchNorm), detector (the sample detector, 320; its PyTorch peer is samples/detector/model.py),
yolov8n and yolo11n (640, ONNX from --onnx-dir; PyTorch peer from Ultralytics' yaml where it imports).
Detectors take --detector-batches (1, 8, 32 unless told). Writes table.json and table.md; a device
call has 10 minutes, so give a few models per call.

Each cell is timed after its own build, minutes from the row's other cells; on a shared machine batch-1
figures moved between such timings by more than FP16 and INT8 differ (the session-60 device history). So
once a row's cells are built, its sartor engines are timed again in turns (--paired-rounds, 5 unless told):
the `paired` figures and their FP16 ÷ INT8 table compare engines over one stretch of time.

A max-autotune compile longer than one call is resumed across calls: with --inductor-cache DIR the
compile's results land in DIR (bench/inductor_cache.py exports them after a killed call), and
--autotune-resume ARCHIVE puts an earlier call's exported results back into DIR before compiling.
The cell's compile_s is then this call's alone; compile_resumed and compile_s_earlier_calls say so.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback
import warnings
from pathlib import Path

import numpy as np
import torch

warnings.filterwarnings("ignore")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "samples" / "detector"))

import sartor  # noqa: E402
from h200_models import (compiled_runner, export_classifier, graph_runner, sample_figures,  # noqa: E402
                         settle_batchnorm, versions)
from inductor_cache import (CacheArchiveError, archive_has_cell, autotune_op_count, earlier_compile_s,  # noqa: E402
                            mark_compile, restore_results)
from sartor.errors import TacticFaultError  # noqa: E402
from sartor.tactics.select import gpu_fault, timing_samples_ms  # noqa: E402

CLASSIFIERS = ("resnet50", "mobilenet_v3_large", "efficientnet_b0")
DETECTOR_BATCHES = (1, 8, 32)
SPEC = {"detector": ("images", 320), "yolov8n": ("images", 640), "yolo11n": ("images", 640)}


def torch_model(name: str) -> torch.nn.Module | None:
    if name in CLASSIFIERS:
        import torchvision
        torch.manual_seed(0)
        model = getattr(torchvision.models, name)(weights=None)
        settle_batchnorm(model)
        return model.eval()
    if name in ("yolov8n", "yolo11n"):
        return yolo_model(name)
    if name == "detector":
        from model import Detector
        torch.manual_seed(0)
        model = Detector().eval()
        model.export = True
        return model
    return None


def yolo_model(name: str) -> torch.nn.Module | None:
    """Ultralytics' own PyTorch model built from its yaml (random weights, BatchNorm folded as its
    exporter does, head in export mode: one output tensor as in the ONNX). None where Ultralytics
    is not installed (on the device, carry its wheel: it imports without polars and thop)."""
    try:
        from ultralytics.nn.tasks import DetectionModel
    except ImportError:
        return None
    torch.manual_seed(0)
    model = DetectionModel(f"{name}.yaml", verbose=False).fuse(verbose=False).eval()
    model.model[-1].export = True
    return model


def onnx_path(name: str, work: Path, onnx_dir: Path | None) -> Path:
    if name in CLASSIFIERS:
        return export_classifier(name, work)
    if name == "detector":
        return ROOT / "samples" / "detector" / "sample_detector.onnx"
    if onnx_dir is None:
        raise FileNotFoundError(f"{name} needs --onnx-dir with {name}.onnx")
    return onnx_dir / f"{name}.onnx"


def timed(fn, batch: int, iterations: int, device: str = "cuda") -> dict:
    return sample_figures(timing_samples_ms(fn, torch.device(device), iterations, 20), batch)


def pinned_variants(specs: list[str]) -> dict[str, dict[str, str]]:
    """--int8-pinned's "NAME:NODE=PRECISION[,NODE=PRECISION]" entries as {NAME: {NODE: PRECISION}}."""
    variants = {}
    for spec in specs:
        name, _, pins = spec.partition(":")
        variants[name] = dict(pin.rsplit("=", 1) for pin in pins.split(","))
    return variants


def sartor_row(onnx: Path, input_name: str, shape: tuple, precision: str, work: Path, iterations: int,
               calib: Path | None, effort: int | None = None, warm_build: bool = True,
               imagenet: bool = True, pdl: bool = False, layer_precision: dict | None = None,
               pinned_name: str = "", aux_streams: int = 0, keep: dict | None = None) -> dict:
    """Cold build, warm-cache build (unless `warm_build` is off), load, first inference, steady
    state, device memory. `pdl`: built with --pdl (quantized precisions). `layer_precision`: built
    with these --layer-precision pins (`pinned_name`: the variant's name in file names).
    `aux_streams`: the same engine timed again in a second context running its independent
    branches on that many more streams (runtime/branch_streams.py), its outputs checked against
    the first context's. The first context runs what a user's gets: the count the build chose
    (`Engine.aux_streams`, recorded in the row's `aux_streams_chosen` with every count's time).
    `keep`: given, receives the two timed calls ("copied", "bound") for `paired_timings`."""
    shapes = {input_name: shape}
    variant = precision + ("_pdl" if pdl else "") + (f"_pinned_{pinned_name}" if layer_precision else "")
    cache = work / f"timing_{onnx.stem}_{variant}_b{shape[0]}.json"  # one per engine: kept for reading
    cache.unlink(missing_ok=True)
    kwargs = {"calib": str(calib), "calib_size": 64} if precision in ("int8", "fp8") else {}
    if pdl:
        kwargs["pdl"] = True
    if layer_precision:
        kwargs["layer_precision"] = layer_precision
    plan = work / f"{onnx.stem}_{variant}_b{shape[0]}.plan"
    if effort is not None:
        kwargs["builder_effort"] = effort
    builds = []
    for _ in range(2 if warm_build else 1):  # cold, then with the timing cache the first build wrote
        t0 = time.perf_counter()
        result = sartor.build(str(onnx), str(plan), device="cuda", precision=precision, min_shapes=shapes,
                              opt_shapes=shapes, max_shapes=shapes, timing_cache=str(cache), **kwargs)
        builds.append(round(time.perf_counter() - t0, 1))
    t0 = time.perf_counter()
    engine = sartor.load(str(plan))
    load_s = time.perf_counter() - t0
    ctx = engine.context(bound_graphs=0)  # copied runs are copies: a reused tensor bound (0069) is timed apart
    x = torch.rand(*shape, device="cuda")
    t0 = time.perf_counter()
    ctx.run({input_name: x})
    torch.cuda.synchronize()
    first_s = time.perf_counter() - t0
    row = timed(lambda: ctx.run({input_name: x}), shape[0], iterations)
    # The same run with the input already in the engine's own buffer (ExecutionContext.input_buffers,
    # as a TensorRT deployment binds its buffers and a preprocessing kernel writes into them): no
    # device copy of the input before the graph (at batch 256 a 154 MB FP32 copy). The eager + graph
    # peer reads its static input the same way; reduce-overhead copies its inputs in.
    bound = ctx.input_buffers({input_name: shape})
    bound[input_name].copy_(x)
    row["bound_input"] = timed(lambda: ctx.run(bound), shape[0], iterations)
    if keep is not None:
        # "plain": a plain copy into the engine's own buffer, then its graph: a copied run's work before the
        # copy wrote the input as its readers take it (docs/decisions/0068), timed beside it.
        # "reused": the caller's one tensor in a context that binds it (decision 0069).
        binding = engine.context()
        keep.update(copied=lambda x=x: ctx.run({input_name: x}), bound=lambda: ctx.run(bound),
                    plain=lambda x=x: (bound[input_name].copy_(x), ctx.run(bound)),
                    reused=lambda x=x: binding.run({input_name: x}))
    if aux_streams:
        branched = engine.context(aux_streams=aux_streams)
        expected = {k: v.clone() for k, v in ctx.run({input_name: x}).items()}
        got = branched.run({input_name: x})
        branched_bound = branched.input_buffers({input_name: shape})
        branched_bound[input_name].copy_(x)
        row["aux_streams"] = dict(
            timed(lambda: branched.run({input_name: x}), shape[0], iterations), streams=aux_streams,
            streams_used=engine.executor.branch_plan(aux_streams).streams_used,
            bound_input=timed(lambda: branched.run(branched_bound), shape[0], iterations),
            max_abs_diff_vs_one_stream=max(float((got[k].float() - v.float()).abs().max())
                                           for k, v in expected.items()))
    if shape[0] == 1:
        if calib is not None:
            # Quantized engines are judged on inputs like their calibration (issue 4): a held-out
            # street scene, not uniform noise outside the calibrated ranges.
            from h200_int8 import scene_images
            x = torch.from_numpy(scene_images(1, 90_000, shape[-1], imagenet)).cuda()
        row.update(agreement_with_onnxruntime(onnx, input_name, x, ctx.run({input_name: x})))
    row.update(build_cold_s=builds[0], build_warm_s=builds[1] if warm_build else None, load_s=round(load_s, 3),
               first_inference_s=round(first_s, 3), device_memory_mb=round(engine.device_memory_bytes / 2**20, 1),
               layers_of_note=layers_of_note(result.header["layers"]),
               pdl_check=result.header.get("pdl_check"),  # the build's PDL timing (default flags)
               aux_streams_chosen=result.header.get("aux_streams"))  # and its streams' (the contexts' default)
    return row


def paired_timings(runners: dict, batch: int, iterations: int, rounds: int, device: str = "cuda") -> dict:
    """The row's sartor engines timed again in turns, `rounds` times `iterations` calls each way (input
    copied in, input in place), after all of them are built: a slow spell of the shared machine then
    falls on every engine alike, where each cell's own timing came minutes apart, after its build.
    {key: timed()'s figures over all rounds' calls, with each round's median}."""
    samples = {key: {way: [] for way in fns} for key, fns in runners.items()}
    round_medians = {key: {way: [] for way in fns} for key, fns in runners.items()}
    for _ in range(rounds):
        for key, fns in runners.items():
            for way, fn in fns.items():
                taken = timing_samples_ms(fn, torch.device(device), iterations, 5)
                samples[key][way] += taken
                round_medians[key][way].append(round(statistics.median(taken), 4))
    paired = {}
    for key, ways in samples.items():
        figures = {way: dict(sample_figures(taken, batch), round_medians_ms=round_medians[key][way])
                   for way, taken in ways.items()}
        paired[key] = dict(figures["copied"], bound_input=figures["bound"], rounds=rounds)
        if "plain" in figures:
            paired[key]["plain_copy"] = figures["plain"]
        if "reused" in figures:
            paired[key]["reused_buffer"] = figures["reused"]
    return paired


def layers_of_note(layers: list[dict], slowest: int = 5) -> dict:
    """What a timed figure alone does not say: the layers whose winning tactic took longest at the
    build's timing, and every layer where candidates were rejected (an FP8 check that refuses every
    tile leaves the layer on its emulation, as session 11's first FP8 row showed)."""
    def best(layer: dict) -> float:
        return min((layer.get("tactic_timings_ms") or {}).values(), default=0.0)
    timed = sorted((layer for layer in layers if layer.get("tactic_timings_ms")), key=best, reverse=True)
    return {"slowest": [{"name": layer["name"], "tactic": layer.get("tactic"), "ms": round(best(layer), 4)}
                        for layer in timed[:slowest]],
            "rejected": {layer["name"]: sorted(layer["tactic_rejected"])[:4]
                         for layer in layers if layer.get("tactic_rejected")}}


def agreement_with_onnxruntime(onnx: Path, input_name: str, x: torch.Tensor, outputs: dict) -> dict:
    """The engine's first output against ONNX Runtime FP32 (CPU) on the same input: a check that
    the timed engine computes the model, not only a figure."""
    import onnxruntime
    session = onnxruntime.InferenceSession(str(onnx), providers=["CPUExecutionProvider"])
    expected = session.run(None, {input_name: x.cpu().numpy()})[0].astype(np.float64).ravel()
    got = next(iter(outputs.values())).float().cpu().numpy().astype(np.float64).ravel()
    cosine = float(expected @ got / (np.linalg.norm(expected) * np.linalg.norm(got) + 1e-30))
    return {"cosine_vs_onnxruntime": round(cosine, 6),
            "max_abs_diff_vs_onnxruntime": round(float(np.abs(expected - got).max()), 5)}


def autotune_resume(archive: Path, cache_dir: Path, results: dict) -> dict | None:
    """An earlier call's autotuning results put into `cache_dir` before any compile; its manifest,
    or None where there is no archive or it cannot be read (then the compile starts cold)."""
    try:
        restored = restore_results(archive, cache_dir)
    except CacheArchiveError as exc:
        results["errors"]["autotune_resume"] = str(exc)
        print(f"autotune resume: {exc}", file=sys.stderr, flush=True)
        return None
    if restored is None:
        results["autotune_resume"] = {"archive": str(archive), "found": False}
        return None
    results["autotune_resume"] = {"archive": str(archive), "found": True, "files": restored.files,
                                  "autotune_ops": autotune_op_count(cache_dir),
                                  "cells": restored.manifest.get("cells", []),
                                  "history": restored.manifest.get("history", [])}
    return restored.manifest


def autotune_cell(model: torch.nn.Module, x: torch.Tensor, name: str, batch: int, iterations: int,
                  cache_dir: Path | None, progress: Path, manifest: dict | None) -> dict:
    """The max-autotune peer, with where its compile time came from: `compile_s` is this call's
    alone; on a resumed compile the ops benchmarked in earlier calls were not benchmarked here."""
    ops_before = autotune_op_count(cache_dir) if cache_dir else None
    mark_compile(progress, name, batch)
    run, compile_s = compiled_runner(model, x, mode="max-autotune")
    mark_compile(progress, name, batch, compile_s)
    cell = dict(timed(run, batch, iterations), compile_s=round(compile_s, 1))
    earlier = earlier_compile_s(manifest, name, batch)
    cell["compile_resumed"] = earlier > 0 or archive_has_cell(manifest, name, batch)
    if cell["compile_resumed"]:
        cell.update(compile_s_earlier_calls=earlier, compile_s_all_calls=round(compile_s + earlier, 1))
    if cache_dir:
        cell.update(autotune_ops_cached_before=ops_before,
                    autotune_ops_benchmarked=autotune_op_count(cache_dir) - ops_before)
    return cell


def autotune_lines(rows: list[dict]) -> list[str]:
    """The max-autotune cells under the table, a resumed compile's time marked as this call's."""
    lines = []
    for r in rows:
        cell = r.get("torch_compile_max_autotune")
        if not cell:
            continue
        line = f"- max-autotune {r['model']} b{r['batch']}: {cell['median_ms']:.3f} ms, compile {cell['compile_s']} s"
        if cell.get("compile_resumed"):
            line += (f" in this call, resumed: {cell['compile_s_earlier_calls']} s in earlier calls "
                     f"({cell.get('autotune_ops_cached_before')} ops restored, {cell.get('autotune_ops_benchmarked')} "
                     "benchmarked here)")
        lines.append(line)
    return [""] + lines if lines else []


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.environ.get("OUT", "out"))
    parser.add_argument("--models", default="resnet50")
    parser.add_argument("--batches", default="1,8,64,256")
    parser.add_argument("--detector-batches", default=",".join(map(str, DETECTOR_BATCHES)))
    parser.add_argument("--int8", action="store_true", help="also sartor INT8 (calibrated on street scenes)")
    parser.add_argument("--fp8", action="store_true", help="also sartor FP8 E4M3 (same calibration as INT8)")
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile peer")
    parser.add_argument("--pdl", action="store_true",
                        help="also each quantized engine built with --pdl (programmatic dependent launch), "
                             "side by side")
    parser.add_argument("--int8-pinned", action="append", default=[], metavar="NAME:NODE=PRECISION[,NODE=PRECISION]",
                        help="with --int8, also an INT8 engine built with these --layer-precision pins, side by "
                             "side (repeatable, one engine each): column sartor_int8_pinned_NAME")
    parser.add_argument("--max-autotune", action="store_true",
                        help="also torch.compile mode max-autotune (minutes of compile per shape)")
    parser.add_argument("--inductor-cache", type=Path, default=None,
                        help="TORCHINDUCTOR_CACHE_DIR for every compile here, whose autotuning results "
                             "bench/inductor_cache.py exports")
    parser.add_argument("--autotune-resume", type=Path, default=None,
                        help="an earlier call's exported archive, restored into --inductor-cache first (absent: none)")
    parser.add_argument("--onnx-dir", type=Path, default=None)
    parser.add_argument("--iterations", type=int, default=100)
    parser.add_argument("--effort", type=int, default=None, help="sartor's --builder-effort (its default unless told)")
    parser.add_argument("--aux-streams", type=int, default=0,
                        help="also time each sartor engine running its branches on this many more streams")
    parser.add_argument("--paired-rounds", type=int, default=5,
                        help="after a row's cells, time its sartor engines again in turns, this many rounds of "
                             "--iterations calls each (0: not): the FP16 / INT8 ratio from one stretch of time")
    parser.add_argument("--no-warm-build", action="store_true",
                        help="skip the second (warm timing cache) build of each engine: saves device time")
    args = parser.parse_args()
    if args.autotune_resume and not args.inductor_cache:
        parser.error("--autotune-resume needs --inductor-cache")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.inductor_cache:
        # Inductor reads the variable at its first compile and keeps the path, so it is set before any.
        args.inductor_cache = args.inductor_cache.resolve()
        args.inductor_cache.mkdir(parents=True, exist_ok=True)
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(args.inductor_cache)
    work = Path("/tmp/sartor_table")
    work.mkdir(exist_ok=True)
    torch.backends.cudnn.benchmark = True
    results = {"versions": versions(), "rows": [], "errors": {}, "effort": args.effort}
    manifest = autotune_resume(args.autotune_resume, args.inductor_cache, results) if args.autotune_resume else None
    calibs: dict[tuple, Path] = {}

    def calibration(size: int, imagenet: bool) -> Path:
        """64 street scenes at the model's input size, as the model reads its input."""
        if (size, imagenet) not in calibs:
            from h200_int8 import scene_images
            calibs[size, imagenet] = work / f"calib_{size}_{'imagenet' if imagenet else 'unit'}.npy"
            np.save(calibs[size, imagenet], scene_images(64, 50_000, size, imagenet))
        return calibs[size, imagenet]

    build = {"effort": args.effort, "warm_build": not args.no_warm_build, "aux_streams": args.aux_streams}

    def save():
        (out / "table.json").write_text(json.dumps(results, indent=1))

    context_lost = None  # the cell whose GPU fault ended this process's CUDA context
    for name in args.models.split(","):
        if context_lost:
            break
        input_name, size = SPEC.get(name, ("input", 224))
        batches = tuple(int(b) for b in (args.detector_batches if name in SPEC else args.batches).split(","))
        model = torch_model(name)
        if model is not None:
            model = model.half().cuda().to(memory_format=torch.channels_last)
        for batch in batches:
            if context_lost:
                break
            shape = (batch, 3, size, size)
            row = {"model": name, "batch": batch, "input": "x".join(map(str, shape))}
            runners: dict[str, dict] = {}  # each sartor cell's timed calls, for paired_timings
            build_kept = lambda key: dict(build, keep=runners.setdefault(key, {}))  # noqa: E731
            jobs = [("sartor_fp16", lambda: sartor_row(onnx_path(name, work, args.onnx_dir), input_name, shape,
                                                       "fp16", work, args.iterations, None,
                                                       **build_kept("sartor_fp16")))]
            # Classifiers read ImageNet-normalised pixels, the detectors pixels in 0..1.
            imagenet = name in CLASSIFIERS
            for quantized in [p for p, wanted in (("int8", args.int8), ("fp8", args.fp8)) if wanted]:
                for pdl in (False, True) if args.pdl else (False,):
                    jobs.append((f"sartor_{quantized}" + ("_pdl" if pdl else ""),
                                 lambda quantized=quantized, pdl=pdl: sartor_row(
                                     onnx_path(name, work, args.onnx_dir), input_name, shape, quantized, work,
                                     args.iterations, calibration(size, imagenet), imagenet=imagenet, pdl=pdl,
                                     **build_kept(f"sartor_{quantized}" + ("_pdl" if pdl else "")))))
            for variant, pins in (pinned_variants(args.int8_pinned) if args.int8 else {}).items():
                jobs.append((f"sartor_int8_pinned_{variant}", lambda variant=variant, pins=pins: sartor_row(
                    onnx_path(name, work, args.onnx_dir), input_name, shape, "int8", work, args.iterations,
                    calibration(size, imagenet), imagenet=imagenet, layer_precision=pins, pinned_name=variant,
                    **build_kept(f"sartor_int8_pinned_{variant}"))))
            if model is not None:
                x = torch.rand(*shape, device="cuda").half().contiguous(memory_format=torch.channels_last)
                jobs.append(("eager_fp16_cuda_graph", lambda: timed(graph_runner(model, x), batch, args.iterations)))
                if not args.no_compile:
                    def compile_job():
                        run, compile_s = compiled_runner(model, x)
                        return dict(timed(run, batch, args.iterations), compile_s=round(compile_s, 1))
                    jobs.append(("torch_compile_reduce_overhead", compile_job))
                if args.max_autotune:
                    jobs.append(("torch_compile_max_autotune", lambda: autotune_cell(
                        model, x, name, batch, args.iterations, args.inductor_cache, out / "autotune_progress.json",
                        manifest)))
            for key, job in jobs:
                if context_lost:
                    results["errors"][f"{name} b{batch} {key}"] = f"not run: the GPU faulted in {context_lost}"
                    continue
                try:
                    row[key] = job()
                except Exception as exc:  # noqa: BLE001 - the other cells are still worth measuring
                    results["errors"][f"{name} b{batch} {key}"] = f"{type(exc).__name__}: {exc}"[:600]
                    traceback.print_exc()
                    if isinstance(exc, TacticFaultError) or gpu_fault(exc):
                        # Every later CUDA call of this process fails alike (session 25: five
                        # tracebacks after one misaligned address): say so once and measure nothing more.
                        context_lost = f"{name} b{batch} {key}"
                        print(f"the GPU faulted in {context_lost}: this process's CUDA context is lost, its "
                              f"remaining cells are not measured", flush=True)
                print(json.dumps({key: row.get(key)}), flush=True)
                results["partial"] = row  # a call cut off mid-row still brings its finished cells back
                save()
            timed_runners = {key: fns for key, fns in runners.items() if fns and key in row}
            if args.paired_rounds > 0 and len(timed_runners) >= 2 and not context_lost:
                try:
                    row["paired"] = paired_timings(timed_runners, batch, args.iterations, args.paired_rounds)
                    print(json.dumps({f"paired_{key}": value for key, value in row["paired"].items()}), flush=True)
                except Exception as exc:  # noqa: BLE001 - the row's own cells stand
                    results["errors"][f"{name} b{batch} paired"] = f"{type(exc).__name__}: {exc}"[:600]
                    traceback.print_exc()
            runners.clear()  # the engines go with their contexts before the next row's builds
            peers = [row[k]["median_ms"] for k in ("eager_fp16_cuda_graph", "torch_compile_reduce_overhead",
                                                    "torch_compile_max_autotune") if k in row]
            if "sartor_fp16" in row and peers:
                row["sartor_fp16_speedup_over_best_peer"] = round(min(peers) / row["sartor_fp16"]["median_ms"], 3)
            results["rows"].append(row)
            results.pop("partial", None)
            print(json.dumps(row), flush=True)
            save()
    lines = ["| model | batch | sartor FP16 ms | INT8 ms | FP8 ms | eager+graph ms | compile r-o ms "
             "| FP16 vs best peer |", "|---|---|---|---|---|---|---|---|"]
    cell = lambda r, k: f"{r[k]['median_ms']:.3f}" if k in r else "–"  # noqa: E731
    for r in results["rows"]:
        lines.append(f"| {r['model']} | {r['batch']} | {cell(r, 'sartor_fp16')} | {cell(r, 'sartor_int8')} | "
                     f"{cell(r, 'sartor_fp8')} | "
                     f"{cell(r, 'eager_fp16_cuda_graph')} | {cell(r, 'torch_compile_reduce_overhead')} | "
                     f"{r.get('sartor_fp16_speedup_over_best_peer', '–')} |")
    lines += autotune_lines(results["rows"])
    pdl_rows = [r for r in results["rows"] if any(k.endswith("_pdl") for k in r)]
    if pdl_rows:
        lines += ["", "| model | batch | INT8 ms | INT8 --pdl ms | FP8 ms | FP8 --pdl ms |",
                  "|---|---|---|---|---|---|"]
        lines += [f"| {r['model']} | {r['batch']} | {cell(r, 'sartor_int8')} | {cell(r, 'sartor_int8_pdl')} | "
                  f"{cell(r, 'sartor_fp8')} | {cell(r, 'sartor_fp8_pdl')} |" for r in pdl_rows]
    variants = list(pinned_variants(args.int8_pinned)) if args.int8 else []
    if variants:
        lines += ["", "INT8 engines with --layer-precision pins: "
                  + "; ".join(f"{v}: {pins}" for v, pins in pinned_variants(args.int8_pinned).items()), "",
                  "| model | batch | FP16 ms | INT8 ms | " + " | ".join(f"INT8 {v} ms" for v in variants) + " |",
                  "|---|---|---|---|" + "---|" * len(variants)]
        lines += [f"| {r['model']} | {r['batch']} | {cell(r, 'sartor_fp16')} | {cell(r, 'sartor_int8')} | "
                  + " | ".join(cell(r, f"sartor_int8_pinned_{v}") for v in variants) + " |" for r in results["rows"]]
    if args.aux_streams:
        def streams(r: dict, k: str) -> str:
            timing = r.get(k, {}).get("aux_streams")
            return f"{timing['median_ms']:.3f} / {timing['bound_input']['median_ms']:.3f}" if timing else "–"
        lines += ["", f"The same engines running their branches on {args.aux_streams} more streams (input copied / "
                  "in the engine's buffer):", "",
                  "| model | batch | FP16 ms | FP16 + streams ms | INT8 ms | INT8 + streams ms |",
                  "|---|---|---|---|---|---|"]
        lines += [f"| {r['model']} | {r['batch']} | {cell(r, 'sartor_fp16')} | {streams(r, 'sartor_fp16')} | "
                  f"{cell(r, 'sartor_int8')} | {streams(r, 'sartor_int8')} |" for r in results["rows"]]
    paired_rows = [r for r in results["rows"] if "sartor_fp16" in r.get("paired", {})]
    if paired_rows:
        def paired(r: dict, k: str) -> str:
            timing = r["paired"].get(k)
            return f"{timing['median_ms']:.3f} / {timing['bound_input']['median_ms']:.3f}" if timing else "–"

        def ratio(r: dict, k: str) -> str:
            first, second = r["paired"]["sartor_fp16"], r["paired"].get(k)
            if not second:
                return "–"
            return (f"{first['median_ms'] / second['median_ms']:.2f}× / "
                    f"{first['bound_input']['median_ms'] / second['bound_input']['median_ms']:.2f}×")
        lines += ["", f"The sartor engines timed again in turns after the row's builds ({args.paired_rounds} rounds of "
                  f"{args.iterations} calls each way; ms, input copied / in place):", "",
                  "| model | batch | FP16 | INT8 | FP16 ÷ INT8 | FP8 | FP16 ÷ FP8 |", "|---|---|---|---|---|---|---|"]
        lines += [f"| {r['model']} | {r['batch']} | {paired(r, 'sartor_fp16')} | {paired(r, 'sartor_int8')} | "
                  f"{ratio(r, 'sartor_int8')} | {paired(r, 'sartor_fp8')} | {ratio(r, 'sartor_fp8')} |"
                  for r in paired_rows]

        extra_ways = [("plain_copy", "a plain copy of the input into the engine's own buffer and then its graph (a "
                       "copied run's work before the copy wrote what the readers take, decision 0068)"),
                      ("reused_buffer", "a run from the caller's one reused tensor in a context that binds it (a graph "
                       "reading it where it is, decision 0069); the copied runs above come from a context that never "
                       "binds")]
        for way, said in extra_ways:
            def cell(r: dict, k: str, way=way) -> str:
                timing = r["paired"].get(k, {}).get(way)
                return f"{timing['median_ms']:.3f}" if timing else "–"
            lines += ["", f"In the same rounds, {said}; ms:", "",
                      "| model | batch | FP16 | INT8 | FP16 ÷ INT8 |", "|---|---|---|---|---|"]
            for r in paired_rows:
                first, second = (r["paired"].get(k, {}).get(way) for k in ("sartor_fp16", "sartor_int8"))
                share = f"{first['median_ms'] / second['median_ms']:.2f}×" if first and second else "–"
                lines.append(f"| {r['model']} | {r['batch']} | {cell(r, 'sartor_fp16')} | {cell(r, 'sartor_int8')} | "
                             f"{share} |")
    bound = lambda r, k: f"{r[k]['bound_input']['median_ms']:.3f}" if "bound_input" in r.get(k, {}) else "–"  # noqa: E731
    lines += ["", "The same engines with the input in their own buffer (no input copy before the graph):", "",
              "| model | batch | sartor FP16 ms | INT8 ms | FP8 ms |", "|---|---|---|---|---|"]
    lines += [f"| {r['model']} | {r['batch']} | {bound(r, 'sartor_fp16')} | {bound(r, 'sartor_int8')} | "
              f"{bound(r, 'sartor_fp8')} |" for r in results["rows"]]
    (out / "table.md").write_text("\n".join(lines) + "\n")
    save()
    print("\n".join(lines))


if __name__ == "__main__":
    main()
