"""The precision plan: which precision each layer runs at, and why."""
from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field

import torch

from ..ir import Graph, Node
from ..ir.dtypes import QUANTIZED_PRECISIONS
from ..ops.attention import attention_scores
from ..runtime.executor import Executor
from .config import BuildConfig

# A fused layer answers to the op types it was made of, so --op-precision Conv=fp32 reaches FusedConv.
BASE_OP = {"FusedConv": "Conv", "FusedGemm": "Gemm", "Linear": "MatMul"}


@dataclass
class PrecisionPlan:
    layers: dict = field(default_factory=dict)  # node name -> precision
    reasons: dict = field(default_factory=dict)  # node name -> why it differs from the build precision

    def mix(self) -> dict:
        counts: dict[str, int] = {}
        for p in self.layers.values():
            counts[p] = counts.get(p, 0) + 1
        return counts


def exact_layer_pattern(name: str) -> str:
    """A --layer-precision pattern that matches exactly `name` (glob characters escaped)."""
    return "".join(f"[{c}]" if c in "*?[" else c for c in name)


def _override(node: Node, config: BuildConfig) -> tuple[str, str] | None:
    for pattern, precision in config.layer_precision.items():
        if any(fnmatch.fnmatchcase(origin, pattern) for origin in node.origin + [node.name]):
            return precision, f"--layer-precision {pattern}={precision}"
    for op_type, precision in config.op_precision.items():
        if op_type in (node.op_type, BASE_OP.get(node.op_type)):
            return precision, f"--op-precision {op_type}={precision}"
    return None


def unmatched_overrides(graph: Graph, config: BuildConfig) -> list[str]:
    """Overrides that name no layer: almost always a typo the user wants to hear about."""
    names = [o for node in graph.nodes for o in node.origin + [node.name]]
    ops = {node.op_type for node in graph.nodes} | {BASE_OP.get(n.op_type, n.op_type) for n in graph.nodes}
    missing = [f"--layer-precision {p}" for p in config.layer_precision if not fnmatch.filter(names, p)]
    missing += [f"--op-precision {op}" for op in config.op_precision if op not in ops]
    return missing


def overflowing_layers(graph: Graph, weights: dict, feeds_list: list[dict], threshold: float,
                       device: torch.device) -> dict[str, float]:
    """Layers whose FP32 outputs exceed `threshold` in magnitude on the sample inputs. An Attention
    layer's scaled scores count as an output: its FP16 tactics may hold them in FP16, as the unfused
    graph's MatMul and Softmax did."""
    executor = Executor(graph, weights, device)
    peaks: dict[str, float] = {}

    def record(name, tensors):
        for t in tensors:
            if isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel():
                peak = float(t.detach().abs().amax())
                if peak > peaks.get(name, 0.0):
                    peaks[name] = peak

    def observe(index, step, outputs):
        record(step.node.name, outputs)

    def before(index, step, args):
        if step.node.op_type == "Attention":
            record(step.node.name, [attention_scores(args, step.attrs)])

    with torch.inference_mode():
        for feeds in feeds_list:
            executor.run(feeds, observe=observe, before=before)
    return {name: peak for name, peak in peaks.items() if peak > threshold or peak != peak}


def base_precision(config: BuildConfig, device: torch.device | None) -> str:
    """The precision of the layers nothing else decides. INT8 (FP8) builds run the layers that do
    not run INT8 (FP8) at `config.int8_fallback_precision`, by default FP16 on CUDA and FP32 on the
    CPU."""
    if config.precision in QUANTIZED_PRECISIONS:
        if config.int8_fallback_precision is not None:
            return config.int8_fallback_precision
        return "fp16" if device is not None and device.type == "cuda" else "fp32"
    return config.precision


def plan_precision(graph: Graph, config: BuildConfig, overflow: dict[str, float],
                   device: torch.device | None = None) -> PrecisionPlan:
    """Overrides first; in INT8 (FP8) builds, conv/gemm layers run INT8 (FP8) except output heads
    (see `sartor.quant.plan`); then, in FP16 builds, layers whose outputs overflow FP16 stay FP32
    and so do the layers reading those outputs (they would otherwise cast the large values back
    down). An override to a quantized precision a layer cannot run says why in the plan."""
    from ..quant.plan import int8_decisions, quantized_unsupported
    from ..quant.qdq import fixed_precision
    plan = PrecisionPlan()
    producers = graph.producers()
    base = base_precision(config, device)
    quantized = config.precision if config.precision in QUANTIZED_PRECISIONS else None
    int8 = int8_decisions(graph, base, quantized) if quantized else {}
    for node in graph.nodes:
        fixed = fixed_precision(node, base)  # Q/DQ models: the layers the model quantized run INT8
        if fixed is not None:
            plan.layers[node.name], plan.reasons[node.name] = fixed
            continue
        chosen = _override(node, config)
        overflowing_inputs = [producers[i].name for i in node.present_inputs() if i in producers
                              and producers[i].name in overflow]
        if chosen is not None and chosen[0] in QUANTIZED_PRECISIONS:
            why = quantized_unsupported(graph, node, chosen[0])
            if why is not None:
                chosen = base, f"{chosen[1]} not applied: {why}"
        if chosen is not None:
            plan.layers[node.name], plan.reasons[node.name] = chosen
        elif node.name in int8 and int8[node.name][0] == quantized:
            plan.layers[node.name] = quantized
        elif base == "fp16" and node.name in overflow:
            plan.layers[node.name] = "fp32"
            plan.reasons[node.name] = f"FP16 overflow guard: FP32 output reached {overflow[node.name]:.3g}"
        elif base == "fp16" and overflowing_inputs:
            plan.layers[node.name] = "fp32"
            plan.reasons[node.name] = f"FP16 overflow guard: reads the FP32 output of {overflowing_inputs[0]}"
        else:
            plan.layers[node.name] = base
            if node.name in int8:
                plan.reasons[node.name] = int8[node.name][1]
    return plan
