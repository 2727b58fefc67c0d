"""Which INT8 (FP8) layers store their float output in their readers' narrower float.

An INT8 layer whose output is not quantized (its readers are float layers: decision 0045 keeps a
detector head's private branch float after its INT8 entry) computes float32 values. Each FP16
reader converted them on reading: on CUDA one conversion kernel per reader and the float32 tensor
written and read once more. Where every reader computes in the same narrower float (FP16, BF16),
the layer stores its values rounded to it (`ops.quantized.FLOAT_OUTPUT`), which is the conversion
the readers made, so no number changes. The plan is the executor's, made from the layer
precisions the engine records, as the Concat plan is; a graph output keeps the dtype it declares.
"""
from __future__ import annotations

from collections import defaultdict

import torch

from ..ir.dtypes import QUANTIZED_LAYERS, TORCH_TO_NUMPY
from ..ops.quantized import FLOAT_OUTPUT

# Float dtypes a layer's readers may compute in for it to store its output in theirs.
NARROW_FLOATS = (torch.float16, torch.bfloat16)


def plan_float_outputs(steps: list, graph_outputs: set[str]) -> dict[str, str]:
    """Mark each INT8 (FP8) step (`runtime.executor.Step`) whose output is not quantized, is not a
    graph output, and is read only by device steps that all compute in one of NARROW_FLOATS: its
    attributes (every profile's) get FLOAT_OUTPUT, that dtype's name. Returns {layer name: dtype
    name} of the steps marked."""
    readers: dict[str, list] = defaultdict(list)
    for step in steps:
        for name in step.node.present_inputs():
            readers[name].append(step)
    planned = {}
    for step in steps:
        if step.on_host or step.node.op_type not in QUANTIZED_LAYERS or step.attrs.get("output_inv_scale") is not None:
            continue
        output = step.node.outputs[0]
        reading = readers.get(output, [])
        if output in graph_outputs or not reading or any(_reads_on_host(reader, output) for reader in reading):
            continue
        dtypes = {reader.compute_dtype for reader in reading}
        if len(dtypes) != 1 or next(iter(dtypes)) not in NARROW_FLOATS:
            continue
        name = TORCH_TO_NUMPY[dtypes.pop()]
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
