"""Runs of a graph at a few batch sizes without data, for passes that must know how a subgraph behaves
at any batch (gather_rows): every value's shape, and the host values (the Shape → Gather → Concat
arithmetic exporters write) exactly.

The executor runs on torch's meta device: device tensors carry shapes and no data, host values are
computed as at run time. A graph whose inputs have a symbolic dim other than one batch symbol in
axis 0 is not run (its shapes depend on more than the batch); one that cannot run on meta tensors
(a data-dependent shape) neither.

A pass that removes a value some Shape node reads rewrites that read as a function of the batch:
a constant where the shape does not change with it, else `base + batch · slope` from the first
input's batch (`rewrite_shape_reads`); where the runs show no such function, the pass must not
remove the value (`shape_reads_follow_batch`).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..ir import Graph, Node
from ..ir.dtypes import NUMPY_TO_TORCH
from ..ops.util import tensor_from_numpy
from ..runtime.executor import HOST_CONSTANT_LIMIT, Executor

BATCHES = (1, 2, 3)  # two points fit base + batch · slope; the third checks the fit
META = torch.device("meta")


@dataclass
class BatchRuns:
    """`values[k]`: every value of the run at `batches[k]` by name (meta tensors for device data,
    host tensors for shape arithmetic). `batches` is (None,) for a graph of static inputs."""
    batches: tuple
    values: list
    batch_input: str | None  # a graph input whose axis 0 is the batch

    @property
    def dynamic(self) -> bool:
        return self.batches[0] is not None

    def on_device(self, name: str) -> bool:
        value = self.values[0].get(name)
        return value is not None and value.device.type == "meta"

    def shapes(self, name: str) -> list[tuple] | None:
        if any(name not in run for run in self.values):
            return None
        return [tuple(run[name].shape) for run in self.values]


def _batch_input(graph: Graph) -> tuple[bool, str | None]:
    """(runnable, the input whose axis 0 is the batch): every symbolic dim is axis 0 of an input,
    one symbol for all."""
    symbols, batch_input = set(), None
    for value in graph.inputs:
        if value.shape is None or NUMPY_TO_TORCH.get(value.dtype) is None:
            return False, None
        for axis, dim in enumerate(value.shape):
            if isinstance(dim, int):
                continue
            if axis != 0:
                return False, None
            symbols.add(dim)
            batch_input = batch_input or value.name
    return len(symbols) <= 1, batch_input


def _meta_weights(graph: Graph) -> dict[str, torch.Tensor]:
    """Small constants as they are (shape arithmetic reads them on the host), the rest as meta."""
    weights = {}
    for name, array in graph.initializers.items():
        dtype = NUMPY_TO_TORCH.get(str(array.dtype))
        if array.size <= HOST_CONSTANT_LIMIT or dtype is None:
            weights[name] = tensor_from_numpy(array)
        else:
            weights[name] = torch.empty(array.shape, dtype=dtype, device=META)
    return weights


def _one_run(executor: Executor, graph: Graph, batch: int | None) -> dict[str, torch.Tensor]:
    feeds = {}
    for value in graph.inputs:
        shape = [batch if isinstance(dim, str) else dim for dim in value.shape]
        feeds[value.name] = torch.empty(shape, dtype=NUMPY_TO_TORCH[value.dtype], device=META)
    values = dict(feeds)

    def observe(index, step, outputs):
        values.update((name, out) for name, out in zip(step.node.outputs, outputs) if name)

    with torch.inference_mode():
        executor.run(feeds, observe=observe)
    return values


def run_batches(graph: Graph) -> BatchRuns | None:
    """The graph run without data at BATCHES (or once, at its static shapes); None where it cannot be."""
    runnable, batch_input = _batch_input(graph)
    if not runnable:
        return None
    batches = BATCHES if batch_input is not None else (None,)
    try:
        executor = Executor(graph, _meta_weights(graph), META)
        values = [_one_run(executor, graph, batch) for batch in batches]
    except Exception:  # noqa: BLE001 - a graph the meta device cannot run: the passes leave it as it is
        return None
    return BatchRuns(batches, values, batch_input)


def follows_batch(runs: BatchRuns, values: list) -> tuple[np.ndarray, np.ndarray] | None:
    """(base, slope) with values[k] == base + batches[k] · slope, integer arrays; None where they do not."""
    arrays = [np.asarray(v, dtype=np.int64) for v in values]
    if any(a.shape != arrays[0].shape for a in arrays):
        return None
    if not runs.dynamic:
        return arrays[0], np.zeros_like(arrays[0])
    b0, b1 = runs.batches[:2]
    if np.any((arrays[1] - arrays[0]) % (b1 - b0)):
        return None
    slope = (arrays[1] - arrays[0]) // (b1 - b0)
    base = arrays[0] - b0 * slope
    if any(not np.array_equal(a, base + b * slope) for a, b in zip(arrays, runs.batches)):
        return None
    return base, slope


def _shape_readers(graph: Graph, removed: set[str]) -> list[Node]:
    return [node for node in graph.nodes if node.op_type == "Shape" and node.inputs[0] in removed]


def shape_reads_follow_batch(graph: Graph, runs: BatchRuns, removed: set[str]) -> bool:
    """Whether every Shape node reading a value of `removed` can be computed from the batch."""
    for node in _shape_readers(graph, removed):
        outputs = [run.get(node.outputs[0]) for run in runs.values]
        if any(out is None for out in outputs) or follows_batch(runs, outputs) is None:
            return False
    return True


def _batch_node(graph: Graph, batch_input: str) -> str:
    """The graph's batch as a host value of one element, computed first: an existing
    Shape(input)[0:1] moved to the front (it reads a graph input only), or a new one."""
    for node in graph.nodes:
        if node.op_type == "Shape" and node.inputs == [batch_input] and node.attrs.get("start", 0) == 0 \
                and node.attrs.get("end") == 1:
            graph.nodes.remove(node)
            graph.nodes.insert(0, node)
            return node.outputs[0]
    name = graph.fresh_name(batch_input + "_batch")
    graph.nodes.insert(0, Node("Shape", name, [batch_input], [name], attrs={"start": 0, "end": 1}))
    return name


def rewrite_shape_reads(graph: Graph, runs: BatchRuns, removed: set[str]) -> None:
    """Each Shape node reading a value of `removed` becomes a constant, or `base + batch · slope`
    (checked by shape_reads_follow_batch first)."""
    for node in _shape_readers(graph, removed):
        out = node.outputs[0]
        base, slope = follows_batch(runs, [run[out] for run in runs.values])
        if not slope.any():
            graph.nodes.remove(node)
            graph.initializers[out] = base
            continue
        batch = _batch_node(graph, runs.batch_input)
        at = graph.nodes.index(node)
        slope_name, base_name = graph.fresh_name(out + "_slope"), graph.fresh_name(out + "_base")
        graph.initializers[slope_name], graph.initializers[base_name] = slope, base
        scaled = graph.fresh_name(out + "_scaled")
        graph.nodes[at:at + 1] = [
            Node("Mul", graph.fresh_name(node.name + "_scaled"), [batch, slope_name], [scaled], origin=list(node.origin)),
            Node("Add", graph.fresh_name(node.name + "_of_batch"), [scaled, base_name], [out], origin=list(node.origin))]
