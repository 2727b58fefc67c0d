"""Per-layer FP16 (or BF16) sensitivity for the accuracy planner of float builds: each layer alone
at the build's reduced precision, every other layer FP32, the model outputs' SNR against FP32 on
the given batches. The INT8 ranking (`quant.sensitivity.layer_sensitivity`) is the same pass with a
layer quantized instead: one pass over the batches per layer, least robust (lowest SNR) first."""
from __future__ import annotations

from collections.abc import Collection

import torch

from ..ir import Graph
from ..quant.sensitivity import LayerSensitivity, all_outputs_as_one, compare_outputs, grouped_outputs
from ..runtime.executor import Executor
from .config import PLANNED_FLOAT_PRECISIONS


def float_layer_sensitivity(graph: Graph, weights: dict, batches: list[dict], device: torch.device,
                            layers: Collection[str], precision: str) -> list[LayerSensitivity]:
    """The layers named in `layers`, each run alone at `precision` ("fp16" or "bf16"), lowest output
    SNR against FP32 first. The executor casts a reduced layer's inputs and weights down and its
    output back, which is what an engine's FP16 layer between FP32 ones does to the values."""
    if precision not in PLANNED_FLOAT_PRECISIONS:
        raise ValueError(f"float sensitivity ranks {' or '.join(PLANNED_FLOAT_PRECISIONS)} layers, not {precision}")
    reference = grouped_outputs(Executor(graph, weights, device), batches, device, all_outputs_as_one)
    rows = []
    for node in graph.nodes:
        if node.name not in layers:
            continue
        reduced = grouped_outputs(Executor(graph, weights, device, {node.name: precision}), batches, device,
                           all_outputs_as_one)
        snr, cos, _ = compare_outputs(reference, reduced)
        rows.append(LayerSensitivity(node.name, node.op_type, list(node.origin), snr, cos, precision, 0.0))
    rows.sort(key=lambda r: (r.snr_db, r.name))
    return rows
