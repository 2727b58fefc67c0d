"""The compiler's graph: named values, nodes in topological order, weights as numpy arrays.

Dims are ints for static sizes and strings for symbolic ones ("batch", "height").
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, Iterable, Union

import numpy as np

Dim = Union[int, str]
Shape = tuple  # tuple[Dim, ...]


@dataclass
class ValueInfo:
    name: str
    dtype: str  # numpy dtype name: "float32", "int64", "bool", ...
    shape: tuple | None  # None when the rank is unknown

    def is_static(self) -> bool:
        return self.shape is not None and all(isinstance(d, int) for d in self.shape)


@dataclass
class Node:
    op_type: str
    name: str
    inputs: list[str]  # "" marks an omitted optional input
    outputs: list[str]
    attrs: dict[str, Any] = field(default_factory=dict)
    # ONNX node names this node was made from: kept through every rewrite for `inspect`.
    origin: list[str] = field(default_factory=list)

    def present_inputs(self) -> list[str]:
        return [name for name in self.inputs if name]


@dataclass
class Graph:
    nodes: list[Node]
    inputs: list[ValueInfo]
    outputs: list[ValueInfo]
    initializers: dict[str, np.ndarray]
    value_info: dict[str, ValueInfo] = field(default_factory=dict)
    opset: int = 17
    name: str = "graph"

    # ---- queries -------------------------------------------------------------------
    def producers(self) -> dict[str, Node]:
        return {out: node for node in self.nodes for out in node.outputs if out}

    def consumers(self) -> dict[str, list[Node]]:
        users: dict[str, list[Node]] = {}
        for node in self.nodes:
            for name in node.present_inputs():
                users.setdefault(name, []).append(node)
        return users

    def output_names(self) -> set[str]:
        return {v.name for v in self.outputs}

    def input_names(self) -> list[str]:
        return [v.name for v in self.inputs]

    def is_constant(self, name: str) -> bool:
        return name in self.initializers

    def constant(self, name: str) -> np.ndarray | None:
        return self.initializers.get(name)

    def shape_of(self, name: str) -> tuple | None:
        if name in self.initializers:
            return tuple(self.initializers[name].shape)
        info = self.value_info.get(name)
        return info.shape if info else None

    def dtype_of(self, name: str) -> str | None:
        if name in self.initializers:
            return str(self.initializers[name].dtype)
        info = self.value_info.get(name)
        return info.dtype if info else None

    # ---- edits ---------------------------------------------------------------------
    def fresh_name(self, base: str) -> str:
        taken = {n for node in self.nodes for n in node.outputs} | set(self.initializers)
        taken |= {n.name for n in self.nodes} | set(self.input_names())
        candidate, k = base, 0
        while candidate in taken:
            k += 1
            candidate = f"{base}_{k}"
        return candidate

    def replace_uses(self, old: str, new: str) -> None:
        """Point every consumer (and graph output) of `old` at `new`."""
        for node in self.nodes:
            node.inputs = [new if name == old else name for name in node.inputs]
        for out in self.outputs:
            if out.name == old:
                # Graph outputs keep their public names: rename the producer's output instead.
                raise ValueError("replace_uses cannot rename a graph output")

    def remove_unused_initializers(self) -> None:
        used = {name for node in self.nodes for name in node.present_inputs()}
        used |= self.output_names()
        self.initializers = {k: v for k, v in self.initializers.items() if k in used}

    def copy(self) -> "Graph":
        return copy.deepcopy(self)

    def op_types(self) -> list[str]:
        return sorted({node.op_type for node in self.nodes})


def topological_order(nodes: Iterable[Node], available: Iterable[str]) -> list[Node]:
    """Kahn's algorithm; raises ValueError naming the nodes on a cycle or with undefined inputs."""
    nodes = list(nodes)
    ready_values = set(available)
    produced_by = {out: node for node in nodes for out in node.outputs if out}
    pending = {id(node): {i for i in node.present_inputs() if i not in ready_values} for node in nodes}
    waiting: dict[str, list[Node]] = {}
    for node in nodes:
        for name in pending[id(node)]:
            waiting.setdefault(name, []).append(node)
    queue = [node for node in nodes if not pending[id(node)]]
    ordered: list[Node] = []
    while queue:
        node = queue.pop(0)
        ordered.append(node)
        for out in node.outputs:
            for user in waiting.pop(out, []):
                deps = pending[id(user)]
                deps.discard(out)
                if not deps:
                    queue.append(user)
    if len(ordered) != len(nodes):
        stuck = [node for node in nodes if pending[id(node)]]
        undefined = sorted({i for node in stuck for i in pending[id(node)] if i not in produced_by})
        if undefined:
            raise ValueError(f"inputs never defined: {', '.join(undefined[:5])}")
        raise ValueError("graph has a cycle through " + ", ".join(n.name or n.op_type for n in stuck[:5]))
    return ordered
