"""Graph ↔ (JSON header part, named tensors): how layers travel inside an engine file."""
from __future__ import annotations

import numpy as np
import torch

from ..ir import Graph, Node, ValueInfo
from ..ops.util import tensor_from_numpy, tensor_to_numpy

_TENSOR_KEY = "__tensor__"


def _to_torch(array: np.ndarray) -> torch.Tensor:
    return tensor_from_numpy(array)


def _encode_attr(value, key: str, tensors: dict):
    if isinstance(value, np.ndarray):
        tensors[key] = _to_torch(value)
        return {_TENSOR_KEY: key}
    if isinstance(value, (np.integer,)):
        return int(value)
    if isinstance(value, (np.floating,)):
        return float(value)
    if isinstance(value, (list, tuple)):
        return [_encode_attr(v, f"{key}.{i}", tensors) for i, v in enumerate(value)]
    if isinstance(value, dict):  # a ConvChain's layers' own attributes
        return {k: _encode_attr(v, f"{key}/{k}", tensors) for k, v in value.items()}
    return value


def _decode_attr(value, tensors: dict):
    if isinstance(value, dict) and _TENSOR_KEY in value:
        return tensor_to_numpy(tensors[value[_TENSOR_KEY]])
    if isinstance(value, list):
        return [_decode_attr(v, tensors) for v in value]
    if isinstance(value, dict):
        return {k: _decode_attr(v, tensors) for k, v in value.items()}
    return value


def _info(v: ValueInfo) -> dict:
    return {"name": v.name, "dtype": v.dtype, "shape": None if v.shape is None else list(v.shape)}


def _uninfo(d: dict) -> ValueInfo:
    return ValueInfo(d["name"], d["dtype"], None if d["shape"] is None else tuple(d["shape"]))


def encode_graph(graph: Graph) -> tuple[dict, dict[str, torch.Tensor]]:
    tensors: dict[str, torch.Tensor] = {f"w/{name}": _to_torch(a) for name, a in graph.initializers.items()}
    nodes = []
    for node in graph.nodes:
        attrs = {k: _encode_attr(v, f"attr/{node.name}/{k}", tensors) for k, v in node.attrs.items()}
        nodes.append({"op": node.op_type, "name": node.name, "inputs": node.inputs, "outputs": node.outputs,
                      "attrs": attrs, "origin": node.origin})
    weight_dtypes = {name: str(a.dtype) for name, a in graph.initializers.items()}
    header = {"nodes": nodes, "inputs": [_info(v) for v in graph.inputs], "outputs": [_info(v) for v in graph.outputs],
              "opset": graph.opset, "name": graph.name, "weight_dtypes": weight_dtypes}
    return header, tensors


def decode_graph(header: dict, tensors: dict[str, torch.Tensor]) -> tuple[Graph, dict[str, torch.Tensor]]:
    """The graph (initializers left empty) and its weights as torch tensors, by value name."""
    weights = {key[2:]: t for key, t in tensors.items() if key.startswith("w/")}
    nodes = [Node(n["op"], n["name"], list(n["inputs"]), list(n["outputs"]),
                  {k: _decode_attr(v, tensors) for k, v in n["attrs"].items()}, list(n["origin"]))
             for n in header["nodes"]]
    graph = Graph(nodes, [_uninfo(v) for v in header["inputs"]], [_uninfo(v) for v in header["outputs"]], {},
                  opset=header.get("opset", 17), name=header.get("name", "graph"))
    return graph, weights
