"""Which layers store their float output in the dtype its readers, or the graph's output, want.

A layer that can store any float dtype (`OpDef.stores_any_float`: the INT8 layers, YoloDecode)
is given, in its FLOAT_OUTPUT attribute, the one float dtype everything that consumes its output
needs, where that differs from what it would store:
- an INT8 (FP8) layer whose output is not quantized computes float32; when its readers are float
  layers that all compute in FP16 (decision 0045 keeps a detector head's private branch float after
  its INT8 entry), each reader converted on reading, on CUDA a conversion kernel and the float32
  tensor written and read once more. Stored in FP16 it is the same numbers;
- a layer computing in FP16 whose output is a float32 graph output was converted when the run
  finished; YoloDecode computes its boxes in FP32, so stored as float32 they skip that conversion
  and the half-pixel rounding of FP16 at 640 pixels.
The plan is the executor's, made from the layer precisions the engine records, as the Concat plan
is (decision 0052).
"""
from __future__ import annotations

from collections import defaultdict

import torch

from ..ir.dtypes import NUMPY_TO_TORCH, TORCH_TO_NUMPY
from ..ops.registry import FLOAT_OUTPUT

FLOATS = (torch.float16, torch.bfloat16, torch.float32)


def plan_float_outputs(steps: list, graph_outputs: dict[str, str | None]) -> dict[str, str]:
    """Mark each device step (`runtime.executor.Step`) that stores any float, has one output (not
    quantized), and whose consumers all want one float dtype other than the one it stores: every
    reader a device step computing in it, and where the output is a graph output (`graph_outputs`:
    name → declared dtype name) that dtype declared. Its attributes (every profile's) get
    FLOAT_OUTPUT, that dtype's name. Returns {layer name: dtype name} of the steps marked."""
    readers: dict[str, list] = defaultdict(list)
    for step in steps:
        for name in step.node.present_inputs():
            readers[name].append(step)
    planned = {}
    for step in steps:
        outputs = [name for name in step.node.outputs if name]
        if step.on_host or not step.stores_any_float or len(outputs) != 1 \
                or step.attrs.get("output_inv_scale") is not None:
            continue
        output = outputs[0]
        reading = readers.get(output, [])
        if any(_reads_on_host(reader, output) for reader in reading):
            continue
        wanted = {reader.compute_dtype for reader in reading}
        if output in graph_outputs:
            wanted.add(NUMPY_TO_TORCH.get(graph_outputs[output]))
        if len(wanted) != 1:
            continue
        dtype = wanted.pop()
        if dtype not in FLOATS or dtype == (step.compute_dtype or torch.float32):
            continue
        name = TORCH_TO_NUMPY[dtype]
        step.attrs[FLOAT_OUTPUT] = name
        for variant in step.profile_variants.values():
            variant.attrs[FLOAT_OUTPUT] = name
        planned[step.node.name] = name
    return planned


def _reads_on_host(reader, name: str) -> bool:
    """Whether `reader` takes the value `name` as a host value (it runs on the host, or reads it at a
    host position): the dtype conversion of device readers does not apply there."""
    return reader.on_host or any(value == name and position in reader.host_positions
                                 for position, value in enumerate(reader.node.inputs))
