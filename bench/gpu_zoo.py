"""Issue 34 part 5: a zoo of current vision architectures, each exported to ONNX, built by sartor
FP16, checked against ONNX Runtime FP32 and timed against PyTorch FP16 peers, in one device call.

    PYTHONPATH=. python bench/gpu_zoo.py --out $OUT [--models resnet50,vit_tiny_patch16_224]
        [--peers eager,compile[,autotune]] [--batches 1,64] [--budget-s 540] [--per-layer 3]
    PYTHONPATH=. python bench/gpu_zoo.py --device cpu --size 64 --batches 1,2 --peers eager \\
        --models deit_tiny_patch16_224 --out out/zoo      # the CPU smoke run a test makes
    ... [--min-cosine 0.9999]                             # FP16 builds planned to that cosine

Models (random seeded weights, nothing downloaded: `pretrained=False`, HF_HUB_OFFLINE=1): timm's
CNNs, ViT/DeiT, Swin, LeViT, MobileViT, FastViT and EfficientViT, torchvision's DeepLabV3 head on
MobileNetV3 (`out` only), and a small DETR-style detector written here (`DetrStyle`). Each is
exported at opset 17 with a dynamic batch (`dynamo=False`). Parameters initialised to zeros (biases,
LayerNorm shifts) get small random values, as a trained net has them. BatchNorm's affine parameters are
randomised and its running statistics re-estimated on random images (a trained net's activation
scale, so FP16 says something and folding is not a no-op); reparameterisable blocks (FastViT) are
fused as for deployment, and the PyTorch peers run that same module.

Per model: the sartor FP16 build (default flags, build seconds recorded), the cosine of every
output against ONNX Runtime FP32 on one seeded batch of at most 8 (the bar: 0.9999, worst output),
then per batch the median of `--iterations` timed runs after warm-up (CUDA events around each call,
as bench/h200_table.py times) of:
- sartor: `ExecutionContext.run` on an FP32 NCHW tensor already on the device, outputs left there,
  the context's CUDA graph replayed (the input copied into the graph's buffer is included);
  `sartor_bound` is the same with the input already in that buffer (`input_buffers`);
- eager: the torch module FP16, channels-last, `cudnn.benchmark`, captured once as a CUDA graph and
  replayed (on the CPU: FP32 eager, no graph), input already FP16 channels-last on the device;
- compile: `torch.compile(mode="reduce-overhead", dynamic=False)` of the same FP16 module, one
  compile per batch (its seconds recorded apart); `autotune` adds `max-autotune-no-cudagraphs`.

With --min-cosine C, each build asks sartor's accuracy planner for that target (decision 0050:
the layers FP16 hurts most kept FP32 until the worst output's mean per-sample cosine against FP32
reaches C): its held-out samples are HELD_OUT_SAMPLES seeded inputs of the zoo's own distribution
(uniform 0..1, another seed than the ONNX Runtime check's batch, so that check stays independent),
saved as a .npy under --work and given as the build's calib; its trials and final build share a
timing cache there. The rows are the model's name suffixed, e.g. `resnet50 (min-cosine 0.9999)`,
done and resumed apart from the plain ones; the model line records the planner's outcome.

Profiles: one per timed batch, each covering the batches above the previous one (for 1,64:
1..1 opt 1 and 2..64 opt 64), so that every batch is timed on kernels chosen at its own shape, as a
TensorRT deployment keeps a latency and a throughput profile, and every batch 1..64 still runs.
One profile with opt 64 would run batch 1 on kernels tuned for 64 and understate sartor there; the
second profile's timing is cheap beside the build's kernel compiles, which both profiles share.

Output, under --out, as it goes: zoo.jsonl (a `call` line with the versions per call, a `batch`
line per model and batch, then a `model` line that marks the model done), zoo.md (the table and
the versions) and, with --per-layer N, per_layer.json (sartor's per-layer profile of the N models
where it is slowest against eager, keyed by model). Models whose `model` line is already in
zoo.jsonl are skipped, so a second call carrying the first one's zoo.jsonl (bench/gpu_zoo.sh's
ZOO_RESUME) goes on where it stopped; a peer asked for that a finished model lacks (an earlier
call ran `--peers eager`) is measured alone, without a rebuild, and joins its rows. No model is
started that this call's models so far say will not fit before --budget-s; an alarm at --budget-s
ends one that runs over, which the next call measures again. A peer that fails records its error
and the others go on; a GPU fault (the CUDA context lost) ends the call.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import io
import json
import math
import os
import platform
import signal
import subprocess
import sys
import time
import traceback
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before timm imports huggingface_hub: never go online

import numpy as np  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# graph_runner: the eager forward replayed as one CUDA graph, as h200_models times it
from h200_models import graph_runner, sample_figures  # noqa: E402
import sartor  # noqa: E402
from sartor.errors import TacticFaultError  # noqa: E402
from sartor.tactics.select import gpu_fault, timing_samples_ms  # noqa: E402

INPUT = "input"
COSINE_BAR = 0.9999
COSINE_BATCH = 8  # the largest batch the ONNX Runtime check runs (FP32 on the host's CPU)
PEERS = ("eager", "compile", "autotune")
RESULTS, TABLE, PER_LAYER = "zoo.jsonl", "zoo.md", "per_layer.json"
INCLUDED = {
    "cuda": "device tensors in and out, no host copies: sartor from an FP32 NCHW tensor on the device (its copy "
            "into the engine's buffer included) to outputs left on the device, its CUDA graph replayed; the peers "
            "from an FP16 channels-last tensor on the device: eager replayed as one CUDA graph, torch.compile "
            "reduce-overhead with its own CUDA graphs",
    "cpu": "host tensors in and out: sartor from an FP32 NCHW tensor; the peers FP32 eager (no CUDA graphs)"}
TIMING = {"cuda": "median of timed runs after warm-up, CUDA events around each call; one model at a time",
          "cpu": "median of timed runs after warm-up, host clock around each call; one model at a time"}
PER_LAYER_KEPT = 40  # slowest layers kept per model: what a reader needs, in a small file
HELD_OUT_SAMPLES = 32  # --min-cosine: the planner's held-out inputs (and the first 32 rank its layers)
HELD_OUT_SEED = 1  # not the ONNX Runtime check's seed (0): the planner tunes on these, the check must not


# ---- the architectures ---------------------------------------------------------------------
@dataclass(frozen=True)
class Architecture:
    name: str
    family: str
    make: Callable[[int], nn.Module]  # input size -> module in eval mode, random seeded weights
    outputs: tuple = ("logits",)


def timm_model(name: str, sized: bool = False) -> Callable[[int], nn.Module]:
    """A timm classifier; `sized` ones fix their token grid at creation (position embeddings,
    windows, attention biases), so they are told the input size."""
    def make(size: int) -> nn.Module:
        import timm
        kwargs = {"img_size": size} if sized and size != 224 else {}
        return timm.create_model(name, pretrained=False, **kwargs)
    return make


class SegmentationOut(nn.Module):
    """torchvision's segmentation models return a dict; the engine's output is its 'out' map."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)["out"]


def deeplabv3_mobilenet(size: int) -> nn.Module:
    import torchvision
    return SegmentationOut(torchvision.models.segmentation.deeplabv3_mobilenet_v3_large(
        weights=None, weights_backbone=None, aux_loss=False))


def sine_positions(height: int, width: int, channels: int, temperature: float = 10000.0) -> torch.Tensor:
    """DETR's 2-D sine embedding of an height × width grid: [height·width, channels], half the
    channels for y, half for x, each interleaving sin and cos."""
    quarter = channels // 4
    omega = 1.0 / temperature ** (torch.arange(quarter, dtype=torch.float32) / quarter)
    y, x = torch.meshgrid(torch.arange(height, dtype=torch.float32), torch.arange(width, dtype=torch.float32),
                          indexing="ij")
    y = y.flatten()[:, None] * omega[None] * (2 * math.pi / height)
    x = x.flatten()[:, None] * omega[None] * (2 * math.pi / width)
    return torch.cat([y.sin(), y.cos(), x.sin(), x.cos()], dim=1)


class DetrStyle(nn.Module):
    """A DETR-style detector: ResNet-50 features (stride 32), a 1×1 projection to d_model, a sine
    position embedding (fixed by the input size: a constant in the graph), nn.Transformer's encoder
    and decoder over learned queries, a class head (+ no-object) and a 3-layer box head (sigmoid
    cx, cy, w, h)."""

    def __init__(self, size: int, classes: int = 91, d_model: int = 256, heads: int = 8, layers: int = 2,
                 queries: int = 100) -> None:
        super().__init__()
        import torchvision
        resnet = torchvision.models.resnet50(weights=None)
        self.backbone = nn.Sequential(*list(resnet.children())[:-2])
        self.project = nn.Conv2d(2048, d_model, 1)
        grid = math.ceil(size / 32)
        self.register_buffer("positions", sine_positions(grid, grid, d_model)[None], persistent=False)
        self.transformer = nn.Transformer(d_model, heads, layers, layers, dim_feedforward=4 * d_model,
                                          dropout=0.0, batch_first=True)
        self.queries = nn.Parameter(torch.randn(1, queries, d_model) * 0.1)
        self.classes = nn.Linear(d_model, classes + 1)
        self.boxes = nn.Sequential(nn.Linear(d_model, d_model), nn.ReLU(), nn.Linear(d_model, d_model), nn.ReLU(),
                                   nn.Linear(d_model, 4))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        features = self.project(self.backbone(x)).flatten(2).transpose(1, 2)
        # Zero queries plus the learned ones: the batch comes from the input, no Expand of a shape.
        targets = torch.zeros_like(features[:, :1, :1]) + self.queries
        decoded = self.transformer(features + self.positions, targets)
        return self.classes(decoded), self.boxes(decoded).sigmoid()


# In the order a call measures them: when the budget runs out, what is left is the architectures
# already measured by other means (ResNet-50, EfficientNet-B0, MobileNetV3 in BENCHMARKS.md) and
# the twins (DeiT-Ti has ViT-Ti's graph; ViT-S is ViT-Ti wider).
ARCHITECTURES = [
    Architecture("vit_tiny_patch16_224", "vit", timm_model("vit_tiny_patch16_224", sized=True)),
    Architecture("swin_tiny_patch4_window7_224", "swin", timm_model("swin_tiny_patch4_window7_224", sized=True)),
    Architecture("levit_128s", "levit", timm_model("levit_128s", sized=True)),
    Architecture("mobilevit_xxs", "mobilevit", timm_model("mobilevit_xxs")),
    Architecture("fastvit_t8", "fastvit", timm_model("fastvit_t8")),
    Architecture("efficientvit_b0", "efficientvit", timm_model("efficientvit_b0")),
    Architecture("convnextv2_atto", "cnn", timm_model("convnextv2_atto")),
    Architecture("detr_resnet50", "detr", DetrStyle, ("logits", "boxes")),
    Architecture("deeplabv3_mobilenet_v3_large", "segmentation", deeplabv3_mobilenet, ("out",)),
    Architecture("ghostnet_100", "cnn", timm_model("ghostnet_100")),
    Architecture("regnety_008", "cnn", timm_model("regnety_008")),
    Architecture("vit_small_patch16_224", "vit", timm_model("vit_small_patch16_224", sized=True)),
    Architecture("deit_tiny_patch16_224", "vit", timm_model("deit_tiny_patch16_224", sized=True)),
    Architecture("resnet50", "cnn", timm_model("resnet50")),
    Architecture("efficientnet_b0", "cnn", timm_model("efficientnet_b0")),
    Architecture("mobilenetv3_large_100", "cnn", timm_model("mobilenetv3_large_100")),
]
BY_NAME = {arch.name: arch for arch in ARCHITECTURES}


def row_name(name: str, min_cosine: float | None) -> str:
    """The model column of a row: the architecture, suffixed with the planner target when built with one."""
    return name if min_cosine is None else f"{name} (min-cosine {min_cosine:g})"


def held_out_inputs(work: Path, size: int) -> Path:
    """HELD_OUT_SAMPLES seeded inputs of the zoo's distribution as a .npy (--min-cosine's samples)."""
    path = work / f"held_out_{size}_seed{HELD_OUT_SEED}.npy"
    if not path.is_file():
        x = np.random.default_rng(HELD_OUT_SEED).random((HELD_OUT_SAMPLES, 3, size, size), dtype=np.float32)
        np.save(path, x)
    return path


def randomise_and_settle_batchnorm(model: nn.Module, size: int, seed: int = 0, batches: int = 2) -> None:
    """BatchNorm's affine parameters randomised (folding them is then not a no-op) and its running
    statistics re-estimated on random images: with the initial variance of 1 against far smaller
    real ones, a random net's activations shrink layer by layer until FP16 flushes them to zero."""
    norms = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.track_running_stats]
    if not norms:
        return
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for module in norms:
            if module.affine:
                module.weight.copy_(0.5 + torch.rand(module.num_features, generator=generator))
                module.bias.copy_(torch.randn(module.num_features, generator=generator) * 0.1)
            module.reset_running_stats()
            module.momentum = None  # a cumulative average over the batches below
        model.train()
        for _ in range(batches):
            model(torch.rand(8, 3, size, size, generator=generator))
    model.eval()


def randomise_zero_parameters(model: nn.Module, seed: int = 0) -> int:
    """Every parameter initialised to all zeros (linear and LayerNorm biases, layer-scale-free
    residual gates), given small random values as training leaves them: a zero bias is an identity
    the importer removes, so a zoo of untrained models would time graphs without the bias adds and
    affine shifts that trained ones carry. Returns how many were set."""
    generator = torch.Generator().manual_seed(seed + 1)
    count = 0
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.is_floating_point() and parameter.numel() and not parameter.any():
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.02)
                count += 1
    return count


def make_model(arch: Architecture, size: int, seed: int = 0) -> nn.Module:
    """The architecture with seeded random weights (zero-initialised parameters made small and
    random, as training leaves them), BatchNorm settled, reparameterised blocks fused (timm's
    deployment form), in eval mode on the CPU."""
    torch.manual_seed(seed)
    model = arch.make(size).eval()
    randomise_zero_parameters(model, seed)
    randomise_and_settle_batchnorm(model, size, seed)
    if arch.name.startswith("fastvit"):
        from timm.utils.model import reparameterize_model
        model = reparameterize_model(model)
    return model.eval()


def export_onnx(arch: Architecture, model: nn.Module, size: int, directory: Path) -> Path:
    """Opset 17, dynamic batch, the TorchScript exporter; written under a temporary name first.
    PRESERVE (the model is in eval mode) keeps the exporter from folding BatchNorm into the Conv
    itself, so sartor's fold_batchnorm meets it; nn.MultiheadAttention's fused fast path has no
    ONNX form and is turned off while the exporter traces."""
    path = directory / f"{arch.name}_{size}.onnx"
    if path.is_file():
        return path
    example = torch.rand(1, 3, size, size, generator=torch.Generator().manual_seed(0))
    partial = path.with_name(path.name + ".partial")
    quiet = io.StringIO()
    fast_path = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(False)
    try:
        with torch.no_grad(), warnings.catch_warnings(), contextlib.redirect_stdout(quiet):
            warnings.simplefilter("ignore")
            torch.onnx.export(model, (example,), str(partial), dynamo=False, opset_version=17,
                              training=torch.onnx.TrainingMode.PRESERVE, input_names=[INPUT],
                              output_names=list(arch.outputs),
                              dynamic_axes={name: {0: "batch"} for name in (INPUT,) + tuple(arch.outputs)})
    finally:
        torch.backends.mha.set_fastpath_enabled(fast_path)
    os.replace(partial, path)
    return path


# ---- measurements --------------------------------------------------------------------------
def cosine(a: np.ndarray, b: np.ndarray) -> float:
    a, b = a.astype(np.float64).ravel(), b.astype(np.float64).ravel()
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b) + 1e-30))


def onnxruntime_outputs(path: Path, x: np.ndarray) -> list[np.ndarray]:
    import onnxruntime
    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return session.run(None, {INPUT: x})


def profiles_for(batches: list[int], size: int) -> list[dict]:
    """One profile per timed batch, covering the batches above the one before (see the docstring)."""
    profiles, low = [], 1
    for batch in sorted(set(batches)):
        shape = lambda b: {INPUT: (b, 3, size, size)}  # noqa: E731
        profiles.append({"min": shape(low), "opt": shape(batch), "max": shape(batch)})
        low = batch + 1
    return profiles


def timed(fn, batch: int, device: torch.device, iterations: int, warmup: int) -> dict:
    return sample_figures(timing_samples_ms(fn, device, iterations, warmup), batch)




def eager_runner(model: nn.Module, x: torch.Tensor):
    if x.device.type == "cuda":
        return graph_runner(model, x)

    def run():
        with torch.inference_mode():
            model(x)
    return run


def compiled_runner(model: nn.Module, x: torch.Tensor, mode: str):
    """(a call of torch.compile(model, mode, static shapes) on x, seconds its first three calls
    took: the compile and cudagraph recording)."""
    compiled = torch.compile(model, mode=mode, dynamic=False)
    started = time.perf_counter()
    with torch.inference_mode():
        for _ in range(3):
            compiled(x)
    if x.device.type == "cuda":
        torch.cuda.synchronize()
    compile_s = time.perf_counter() - started

    def run():
        with torch.inference_mode():
            compiled(x)
    return run, compile_s


def output_arrays(outputs) -> list[np.ndarray]:
    if isinstance(outputs, torch.Tensor):
        outputs = (outputs,)
    return [o.float().cpu().numpy() for o in outputs]


class OutOfBudget(BaseException):
    """The call's --budget-s ran out mid-model. A BaseException, as KeyboardInterrupt is, so that no
    `except Exception` on the way (a build's candidate that fails, a peer that fails) takes it."""


def gpu_context_lost(exc: BaseException) -> bool:
    return isinstance(exc, TacticFaultError) or gpu_fault(exc)


def planner_outcome(planner: dict) -> dict:
    """What the model line keeps of the engine's planner record: the layers kept FP32 of those it
    could move (and how many it ranked: none where FP16 met the target), the measurements, and the
    worst output's held-out mean cosine before and after."""
    first = planner["iterations"][0]["outputs"]
    return {"min_cosine": planner.get("min_cosine"), "kept_fp32": len(planner["kept_out"]),
            "candidates": planner.get("candidates", len(planner["ranking"])), "ranked": len(planner["ranking"]),
            "measurements": len(planner["iterations"]),
            "held_out_samples": planner["held_out"]["samples"],
            "mean_cosine_before": min((o["mean"] for o in first.values() if o["mean"] is not None), default=None),
            "mean_cosine_after": min((o["mean"] for o in planner["outputs"].values() if o["mean"] is not None),
                                     default=None),
            "kept_out": planner["kept_out"][:PER_LAYER_KEPT]}


# ---- one model -----------------------------------------------------------------------------
class ModelRun:
    """Everything measured for one architecture; each finished batch is written at once."""

    def __init__(self, arch: Architecture, args, work: Path, emit: Callable[[dict], None],
                 missing_peers: dict[int, list[str]] | None = None) -> None:
        """`missing_peers` ({batch: peers}): the model is done and only these peers are measured
        (a later call asking for more peers than the one that built it: no rebuild)."""
        self.arch, self.args, self.work, self.emit = arch, args, work, emit
        self.missing_peers = missing_peers
        self.device = torch.device(args.device)
        self.key = {"model": row_name(arch.name, args.min_cosine), "size": args.size, "device": self.device.type,
                    "precision": args.precision}
        self.summary = dict(self.key, record="model", family=arch.family, errors={})
        self.rows: list[dict] = []  # the batch lines written so far

    def fail(self, step: str, exc: BaseException) -> None:
        self.summary["errors"][step] = f"{type(exc).__name__}: {exc}"[:600]
        traceback.print_exc()
        if gpu_context_lost(exc):
            raise exc  # every later CUDA call of this process fails alike: end the call

    def run(self) -> dict:
        """The model's summary; `context_lost` set in it when the GPU faulted (the call then ends,
        and the model counts as done: the fault would recur in the next call)."""
        started = time.perf_counter()
        try:
            if self.missing_peers is None:
                self.measure()
            else:
                self.measure_missing_peers()
        except Exception as exc:  # noqa: BLE001
            if not gpu_context_lost(exc):
                raise
            self.summary["errors"].setdefault("gpu_fault", f"{type(exc).__name__}: {exc}"[:600])
            self.summary["context_lost"] = True
        self.summary["seconds"] = round(time.perf_counter() - started, 1)
        self.summary["batches"] = sorted(set(self.args.batches))
        return self.summary

    def measure(self) -> None:
        args, arch, size = self.args, self.arch, self.args.size
        try:
            model = make_model(arch, size)
            self.summary["params_m"] = round(sum(p.numel() for p in model.parameters()) / 1e6, 2)
            t0 = time.perf_counter()
            onnx = export_onnx(arch, model, size, self.work)
            self.summary["export_s"] = round(time.perf_counter() - t0, 1)
        except Exception as exc:  # noqa: BLE001 - an architecture that cannot export is a result
            self.fail("export", exc)
            return
        batches = sorted(set(args.batches))
        check_batch = max(b for b in [1] + batches if b <= COSINE_BATCH)
        x_check = np.random.default_rng(0).random((check_batch, 3, size, size), dtype=np.float32)
        try:
            reference = onnxruntime_outputs(onnx, x_check)
        except Exception as exc:  # noqa: BLE001
            self.fail("onnxruntime", exc)
            reference = None
        engine = ctx = None
        try:
            plan = self.work / f"{arch.name}_{size}_{args.precision}.plan"
            t0 = time.perf_counter()
            result = sartor.build(str(onnx), str(plan), device=self.device.type, precision=args.precision,
                                  profiles=profiles_for(batches, size), **self.planner_options())
            self.summary.update(build_s=round(time.perf_counter() - t0, 1), onnx_nodes=result.onnx_nodes,
                                layers=result.layers, stage_s=dict(result.stage_seconds),
                                eager_check=result.header.get("eager_check"),
                                tactic_s={family: entry["seconds"] for family, entry in result.tactic_seconds.items()},
                                fp32_layers=sum(layer.get("precision") == "fp32" for layer in result.header["layers"]))
            if result.header.get("planner"):
                self.summary["planner"] = planner_outcome(result.header["planner"])
            engine = sartor.load(str(plan), device=str(self.device))
            ctx = engine.context()
            if reference is not None:
                got = ctx.run({INPUT: x_check})
                self.summary["cosine"] = {name: round(cosine(ref, out), 7)
                                          for name, ref, out in zip(arch.outputs, reference, got.values())}
                self.summary["cosine_min"] = min(self.summary["cosine"].values())
                self.summary["cosine_ok"] = self.summary["cosine_min"] >= COSINE_BAR
        except Exception as exc:  # noqa: BLE001
            self.fail("sartor_build", exc)
        peer_model = self.peer_model(model, reference, x_check)
        for batch in batches:
            self.rows.append(self.measure_batch(batch, ctx, peer_model, args.peers))
            self.emit(self.rows[-1])
        if args.per_layer and engine is not None:
            self.per_layer(engine)
        del engine, ctx, peer_model, model

    def planner_options(self) -> dict:
        """sartor.build's planner settings for --min-cosine (none without it)."""
        args, name = self.args, self.arch.name
        if args.min_cosine is None:
            return {}
        return {"min_cosine": args.min_cosine, "calib": str(held_out_inputs(self.work, args.size)),
                "cosine_samples": HELD_OUT_SAMPLES,
                "timing_cache": str(self.work / f"{name}_{args.size}_{args.precision}_timings.json")}

    def measure_missing_peers(self) -> None:
        try:
            peer_model = self.peer_model(make_model(self.arch, self.args.size), None, None)
        except Exception as exc:  # noqa: BLE001 - recorded in each cell below
            self.fail("torch_model", exc)
            peer_model = None
        for batch, peers in sorted(self.missing_peers.items()):
            self.rows.append(self.measure_batch(batch, None, peer_model, peers, with_sartor=False))
            self.emit(self.rows[-1])

    def peer_model(self, model: nn.Module, reference, x_check: np.ndarray | None) -> nn.Module | None:
        """The torch module the peers run: FP16 channels-last on CUDA, FP32 on the CPU; its own
        cosine against ONNX Runtime says what FP16 alone costs this architecture."""
        if not set(self.args.peers) & set(PEERS):
            return None
        try:
            if self.device.type == "cuda":
                model = model.half().to(self.device).to(memory_format=torch.channels_last)
            if reference is not None:
                x = self.peer_input(torch.from_numpy(x_check))
                with torch.inference_mode():
                    got = output_arrays(model(x))
                self.summary["torch_cosine_min"] = round(min(cosine(r, g) for r, g in zip(reference, got)), 7)
            return model
        except Exception as exc:  # noqa: BLE001
            self.fail("torch_model", exc)
            return None

    def peer_input(self, x: torch.Tensor) -> torch.Tensor:
        if self.device.type != "cuda":
            return x
        return x.to(self.device).half().contiguous(memory_format=torch.channels_last)

    def measure_batch(self, batch: int, ctx, peer_model: nn.Module | None, peers: list[str],
                      with_sartor: bool = True) -> dict:
        args, size, device = self.args, self.args.size, self.device
        row = dict(self.key, record="batch", batch=batch)
        generator = torch.Generator().manual_seed(batch)
        x = torch.rand(batch, 3, size, size, generator=generator).to(device)
        timing = (batch, device, args.iterations, args.warmup)

        def sartor_cells() -> None:
            row["sartor"] = timed(lambda: ctx.run({INPUT: x}), *timing)
            bound = ctx.input_buffers({INPUT: tuple(x.shape)})
            bound[INPUT].copy_(x)
            row["sartor_bound"] = timed(lambda: ctx.run(bound), *timing)

        jobs = [("sartor", sartor_cells if ctx is not None else None)] if with_sartor else []
        x_peer = self.peer_input(x) if peer_model is not None else None
        if "eager" in peers:
            jobs.append(("eager", None if peer_model is None else lambda: row.__setitem__(
                "eager", timed(eager_runner(peer_model, x_peer), *timing))))
        for peer, mode in (("compile", "reduce-overhead"), ("autotune", "max-autotune-no-cudagraphs")):
            if peer in peers:
                def compile_cell(peer=peer, mode=mode):
                    run, compile_s = compiled_runner(peer_model, x_peer, mode)
                    row[peer] = dict(timed(run, *timing), compile_s=round(compile_s, 1))
                jobs.append((peer, None if peer_model is None else compile_cell))
        for name, job in jobs:
            if job is None:  # a cell all the same, so that a resumed call does not try it again
                row[name] = {"error": f"not run: no {'engine' if name == 'sartor' else 'torch model'} "
                                      "(see the model line's errors)"}
                continue
            try:
                job()
            except Exception as exc:  # noqa: BLE001 - the other cells are still worth measuring
                row[name] = {"error": f"{type(exc).__name__}: {exc}"[:600]}
                traceback.print_exc()
                if gpu_context_lost(exc):
                    self.rows.append(row)
                    self.emit(row)
                    raise
        print(json.dumps(with_speedups(row)), flush=True)
        return row

    def per_layer(self, engine) -> None:
        """sartor's per-layer profile at the batch where it does worst against eager (else the
        largest), its slowest layers kept; the model line carries it, so it survives a resume."""
        from sartor.runtime.layer_profile import profile_layers
        worst = min(self.rows, key=lambda r: r.get("speedup_vs_eager", math.inf), default=None)
        batch = worst["batch"] if worst and "speedup_vs_eager" in worst else max(self.args.batches)
        try:
            profile = profile_layers(engine, {INPUT: (batch, 3, self.args.size, self.args.size)}).to_json()
            profile["layers"] = profile["layers"][:PER_LAYER_KEPT]
            profile["batch"] = batch
            self.summary["per_layer"] = profile
        except Exception as exc:  # noqa: BLE001
            self.fail("per_layer", exc)


# ---- the results file and the table --------------------------------------------------------
def read_records(path: Path) -> list[dict]:
    """The records of zoo.jsonl; a line torn by a kill is skipped."""
    if not path.is_file():
        return []
    records = []
    for line in path.read_text().splitlines():
        with contextlib.suppress(ValueError):
            record = json.loads(line)
            if isinstance(record, dict):
                records.append(record)
    return records


def done_key(record: dict) -> tuple:
    return record.get("model"), record.get("size"), record.get("device"), record.get("precision")


def with_speedups(row: dict) -> dict:
    """`row` with speedup_vs_<peer> (the peer's median ÷ sartor's) for every peer measured in it."""
    for peer in PEERS:
        row.pop(f"speedup_vs_{peer}", None)
        if "median_ms" in row.get(peer, {}) and "median_ms" in row.get("sartor", {}):
            row[f"speedup_vs_{peer}"] = round(row[peer]["median_ms"] / row["sartor"]["median_ms"], 3)
    return row


def collect(records: list[dict]) -> tuple[dict, dict]:
    """({model: its latest model line}, {model: {batch: its batch lines merged}}): a later line's
    cells replace an earlier one's, so peers measured by a later call join the row they complete,
    and a model redone whole replaces what an interrupted call left of it."""
    models = {r["model"]: r for r in records if r.get("record") == "model"}
    rows: dict[str, dict] = {}
    for r in records:
        if r.get("record") == "batch" and r.get("model") in models and done_key(r) == done_key(models[r["model"]]):
            rows.setdefault(r["model"], {}).setdefault(r["batch"], {}).update(r)
    for by_batch in rows.values():
        for row in by_batch.values():
            with_speedups(row)
    return models, rows


def missing_peers(model: dict, rows: dict, peers: list[str], batches: list[int]) -> dict[int, list[str]]:
    """{batch: peers asked for but without a cell} of a finished model, at the batches it was built for."""
    if "export" in model.get("errors", {}):
        return {}
    missing = {b: [p for p in peers if p not in rows.get(b, {})] for b in model.get("batches", []) if b in batches}
    return {b: p for b, p in missing.items() if p}


def versions(device: torch.device, size: int, batches: list[int], precision: str) -> dict:
    import onnxruntime
    found = {"torch": torch.__version__, "onnxruntime": onnxruntime.__version__, "python": platform.python_version(),
             "sartor": sartor.__version__, "sartor_commit": git_commit(), "batches": batches,
             "resolution": f"{size}x{size}", "precision": precision, "device": device.type}
    with contextlib.suppress(ImportError):
        import timm
        found["timm"] = timm.__version__
    if device.type == "cuda":
        import triton
        props = torch.cuda.get_device_properties(device)
        found.update(gpu=props.name, sm=f"{props.major}.{props.minor}", driver=nvidia_driver(), cuda=torch.version.cuda,
                     triton=triton.__version__, cudnn=torch.backends.cudnn.version())
    else:
        found.update(gpu="none (CPU)", cpu=platform.processor() or platform.machine(), threads=torch.get_num_threads())
    return found


def nvidia_driver() -> str:
    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=30).stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def git_commit() -> str:
    """The code's commit: $SARTOR_COMMIT where the tree came without its .git (a device copy)."""
    if os.environ.get("SARTOR_COMMIT"):
        return os.environ["SARTOR_COMMIT"]
    try:
        done = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, timeout=10)
        return done.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def ms(cell: dict | None) -> str:
    if not cell:
        return "–"
    return f"{cell['median_ms']:.3f}" if "median_ms" in cell else "error"


def ratio(value) -> str:
    return "–" if value is None else f"{value:.2f}×"


def slower_where(rows: dict, peers: list[str]) -> str:
    """Every batch and peer where the peer's median beat sartor's, with sartor's speed-up (< 1)."""
    found = [f"b{batch} vs {peer} ({row[f'speedup_vs_{peer}']:.2f}×)" for batch, row in sorted(rows.items())
             for peer in peers if row.get(f"speedup_vs_{peer}", math.inf) < 1]
    return ", ".join(found) or "nowhere"


def write_table(out: Path) -> str:
    """zoo.md from every record in zoo.jsonl (see `collect`)."""
    records = read_records(out / RESULTS)
    calls = [r for r in records if r.get("record") == "call"]
    models, batch_rows = collect(records)
    batches = sorted({b for rows in batch_rows.values() for b in rows})
    peers = [p for p in PEERS if any(p in row for rows in batch_rows.values() for row in rows.values())]
    info = calls[-1]["versions"] if calls else {}
    lines = ["# sartor against PyTorch on a model zoo (bench/gpu_zoo.py)", ""]
    if info:
        lines += ["| | |", "|---|---|"]
        lines += [f"| {key} | {value} |" for key, value in (
            ("GPU", f"{info.get('gpu')} (sm {info.get('sm', '–')})" if info.get("sm") else info.get("gpu")),
            ("driver / CUDA / cuDNN",
             f"{info.get('driver', '–')} / {info.get('cuda', '–')} / {info.get('cudnn', '–')}"),
            ("torch / Triton / timm / ONNX Runtime", f"{info['torch']} / {info.get('triton', '–')} / "
                                                     f"{info.get('timm', '–')} / {info['onnxruntime']}"),
            ("sartor", f"{info['sartor']} ({info['sartor_commit']})"),
            ("batches / resolution / precision", f"{', '.join(map(str, info['batches']))} / {info['resolution']} / "
                                                 f"{info['precision']}"),
            ("what is included", INCLUDED[info.get("device", "cuda")]),
            ("timing", TIMING[info.get("device", "cuda")]),
            ("calls", f"{len(calls)} (results of each call appended; a model's latest line counts)"))]
        lines.append("")
    head = ["model", "params M", "build s", "cosine (bar 0.9999)"]
    for batch in batches:
        head += [f"sartor b{batch} ms"] + [f"{peer} b{batch} ms" for peer in peers]
    head += [f"× {peer} (b{', b'.join(map(str, batches))})" for peer in peers] + ["sartor slower"]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    # Each architecture's planned rows ("resnet50 (min-cosine 0.9999)") right after its plain one.
    order = [n for a in ARCHITECTURES for n in [a.name] + sorted(m for m in models if m.startswith(f"{a.name} ("))]
    order += sorted(set(models) - set(order))
    for name in [n for n in order if n in models]:
        summary, rows = models[name], batch_rows.get(name, {})
        cos = summary.get("cosine_min")
        cells = [name, str(summary.get("params_m", "–")), str(summary.get("build_s", "–")),
                 "–" if cos is None else f"{cos:.6f}" + ("" if cos >= COSINE_BAR else " (under)")]
        for batch in batches:
            row = rows.get(batch, {})
            cells += [ms(row.get("sartor"))] + [ms(row.get(peer)) for peer in peers]
        cells += [" / ".join(ratio(rows.get(b, {}).get(f"speedup_vs_{peer}")) for b in batches) for peer in peers]
        cells.append(slower_where(rows, peers))
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "× is the peer's median ÷ sartor's (above 1: sartor faster)."]
    notes = []
    for name in [n for n in order if n in models]:
        summary, rows = models[name], batch_rows.get(name, {})
        errors = dict(summary.get("errors", {}))
        for batch, row in sorted(rows.items()):
            errors.update({f"b{batch} {k}": v["error"] for k, v in row.items() if isinstance(v, dict) and "error" in v})
        compile_s = [f"b{b} {row[p]['compile_s']} s" for b, row in sorted(rows.items()) for p in ("compile", "autotune")
                     if "compile_s" in row.get(p, {})]
        if compile_s:
            notes.append(f"- {name}: torch.compile {', '.join(compile_s)}; "
                         f"sartor build {summary.get('build_s', '–')} s")
        notes += [f"- {name} {step}: {text.splitlines()[0] if text else ''}" for step, text in errors.items()]
    build_lines = [f"- {name}: {build_breakdown(models[name])}" for name in [n for n in order if n in models]
                   if models[name].get("stage_s")]
    for name in [n for n in order if n in models]:
        for p in (models[name].get("eager_check") or {}).get("profiles", []):
            notes.append(f"- {name}: the build's eager check, profile {p['profile']}: {p['tuned_ms']:.4g} ms tuned, "
                         f"{p['eager_ms']:.4g} ms on eager kernels" + (", kept the eager kernels" if p["kept"] == "eager"
                                                                       else ""))
    if build_lines:
        lines += ["", "Where each build's seconds went (stages over 1 s; the tactics stage by tactic family, "
                  "compiling and timing its candidates):", ""] + build_lines
    planned = [f"- {name}: {planner_note(models[name]['planner'], models[name].get('stage_s', {}))}"
               for name in order if name in models and models[name].get("planner")]
    if planned:
        lines += ["", "Builds with an accuracy target (--min-cosine; the cosine column is the independent check "
                  "on the seed-0 batch, the planner measured its own held-out inputs):", ""] + planned
    if notes:
        lines += ["", "Compile times and errors:", ""] + notes
    text = "\n".join(lines) + "\n"
    (out / TABLE).write_text(text)
    return text


def planner_note(outcome: dict, stage_s: dict) -> str:
    """One line on a --min-cosine build: what the planner kept FP32 and what it measured."""
    def cos(value):
        return "–" if value is None else f"{value:.6f}"
    return (f"planner kept {outcome['kept_fp32']} of {outcome['candidates']} FP16 layers FP32 after "
            f"{outcome['measurements']} measurement(s), held-out mean cosine {cos(outcome['mean_cosine_before'])} → "
            f"{cos(outcome['mean_cosine_after'])} on {outcome['held_out_samples']} samples; planner stage "
            f"{stage_s.get('planner', 0):.1f} s of the build")


def build_breakdown(summary: dict) -> str:
    """"tactics 41.2 (igemm 30.1, cudnn_fused 4.0, …), kernels 6.3, capture 1.2": the stages of a build
    that took over a second, the tactics stage split by family."""
    families = ", ".join(f"{family} {seconds:.1f}" for family, seconds in summary.get("tactic_s", {}).items()
                         if seconds >= 0.5)
    parts = []
    for stage, seconds in sorted(summary["stage_s"].items(), key=lambda item: -item[1]):
        if seconds >= 1.0:
            parts.append(f"{stage} {seconds:.1f}" + (f" ({families})" if stage == "tactics" and families else ""))
    return ", ".join(parts) or "no stage over 1 s"


def write_per_layer(out: Path, count: int) -> list[str]:
    """per_layer.json: the per-layer profiles of the `count` models where sartor does worst against
    eager (its lowest speed-up at any batch), keyed by model."""
    models, rows = collect(read_records(out / RESULTS))
    worst = {name: min(row["speedup_vs_eager"] for row in rows[name].values() if "speedup_vs_eager" in row)
             for name, model in models.items() if "per_layer" in model
             and any("speedup_vs_eager" in row for row in rows.get(name, {}).values())}
    chosen = sorted(worst, key=worst.get)[:count]
    (out / PER_LAYER).write_text(json.dumps({name: dict(models[name]["per_layer"], speedup_vs_eager_worst=worst[name])
                                             for name in chosen}, indent=1))
    return chosen


# ---- the call ------------------------------------------------------------------------------
def pending_work(results: Path, args, device_type: str) -> dict[str, dict | None]:
    """The asked-for models this call still has to measure: None for a whole model, else the
    {batch: peers} a finished model lacks (measured without a rebuild)."""
    models, rows = collect(read_records(results))
    work: dict[str, dict | None] = {}
    for name in args.models:
        row = row_name(name, args.min_cosine)
        model = models.get(row)
        if model is None or done_key(model) != (row, args.size, device_type, args.precision):
            work[name] = None
        elif missing := missing_peers(model, rows.get(row, {}), args.peers, args.batches):
            work[name] = missing
    return work


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "out")))
    parser.add_argument("--work", type=Path, default=Path("/tmp/sartor_gpu_zoo"),
                        help="ONNX exports (reused when present) and engines; never results")
    parser.add_argument("--models", default=",".join(a.name for a in ARCHITECTURES))
    parser.add_argument("--peers", default="eager,compile", help=f"any of {', '.join(PEERS)} (or none)")
    parser.add_argument("--batches", default="1,64")
    parser.add_argument("--size", type=int, default=224)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--precision", default="fp16")
    parser.add_argument("--min-cosine", type=float, metavar="C",
                        help="build with sartor's accuracy planner target --min-cosine C on seeded held-out inputs "
                             "(rows named 'model (min-cosine C)')")
    parser.add_argument("--iterations", type=int, default=100)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--budget-s", type=float, default=540.0,
                        help="no model is started that would not finish before this, and one running over is stopped")
    parser.add_argument("--per-layer", type=int, default=0, metavar="N",
                        help="profile sartor's layers and keep those of the N models slowest against eager")
    parser.add_argument("--table-only", action="store_true", help="rewrite zoo.md from zoo.jsonl and stop")
    args = parser.parse_args(argv)
    args.models = [m for m in args.models.split(",") if m]
    unknown = sorted(set(args.models) - set(BY_NAME))
    if unknown:
        parser.error(f"unknown models {', '.join(unknown)}; known: {', '.join(BY_NAME)}")
    args.peers = [p for p in args.peers.split(",") if p and p != "none"]
    if set(args.peers) - set(PEERS):
        parser.error(f"--peers takes {', '.join(PEERS)}")
    args.batches = sorted({int(b) for b in args.batches.split(",")})
    if args.iterations < 1 or min(args.batches) < 1:
        parser.error("--iterations and --batches must be positive")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.monotonic()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.table_only:
        print(write_table(args.out))
        return 0
    args.work.mkdir(parents=True, exist_ok=True)
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = True
    results = args.out / RESULTS

    def emit(record: dict) -> None:
        with results.open("a") as handle:
            handle.write(json.dumps(record) + "\n")

    def out_of_budget(signum, frame):
        raise OutOfBudget(f"--budget-s {args.budget_s:g} reached")

    emit({"record": "call", "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
          "versions": versions(device, args.size, args.batches, args.precision),
          "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}})
    work = pending_work(results, args, device.type)
    previous_handler = signal.signal(signal.SIGALRM, out_of_budget)
    longest = 0.0  # the longest model of this call: what the next one is expected to need at most
    stopped, name = None, None
    try:
        signal.setitimer(signal.ITIMER_REAL, max(args.budget_s - (time.monotonic() - started), 1e-3))
        for name in args.models:
            if name not in work:
                print(f"{name}: already in {results}, skipped", flush=True)
                continue
            left = args.budget_s - (time.monotonic() - started)
            if left < longest:
                stopped = f"{name} not started: {left:.0f} s left, the longest model so far took {longest:.0f} s"
                break
            only = f" (done: only the peers missing, {work[name]})" if work[name] else ""
            print(f"== {name} ({left:.0f} s left){only}", flush=True)
            t0 = time.monotonic()
            summary = ModelRun(BY_NAME[name], args, args.work, emit, work[name]).run()
            longest = max(longest, time.monotonic() - t0)
            if work[name] is None:
                emit(summary)
            print(json.dumps({k: v for k, v in summary.items() if k != "per_layer"}), flush=True)
            if summary.get("context_lost"):
                stopped = f"the GPU faulted during {name}: this process's CUDA context is lost, it measures no more"
                break
            gc.collect()
            torch._dynamo.reset()  # frees the compiled graphs and their CUDA graph pools
            if device.type == "cuda":
                torch.cuda.empty_cache()
    except OutOfBudget as exc:
        stopped = f"{exc} during {name}: the next call measures it again"
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous_handler)
    if stopped:
        print(f"stopped: {stopped}", flush=True)
        emit({"record": "stopped", "reason": stopped})
    if args.per_layer:
        print("per-layer profiles kept:", write_per_layer(args.out, args.per_layer), flush=True)
    print(write_table(args.out), flush=True)
    print(f"models left for another call: {','.join(pending_work(results, args, device.type)) or 'none'}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
