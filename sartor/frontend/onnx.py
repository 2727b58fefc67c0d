"""ONNX → Graph: load and check, convert the opset into 11–21, infer shapes, turn `Constant`
nodes and initializers into weights, and refuse what cannot be compiled — every node at once."""
from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper, shape_inference, version_converter

from ..errors import GraphError, ModelLoadError, UnsupportedModelError
from ..ir import Graph, Node, ValueInfo, topological_order
from ..ir.dtypes import ONNX_TO_NUMPY, SUPPORTED_DTYPES
from ..ops import OpRegistry, default_registry

MIN_OPSET, MAX_OPSET = 11, 21
OLD_OPSET_TARGET = 13  # where models older than MIN_OPSET are converted to

@dataclass(frozen=True)
class ImportedModel:
    graph: Graph
    sha256: str  # of the model file's bytes (provenance)
    source_opset: int
    producer: str


def elem_type_name(elem_type: int) -> str:
    return ONNX_TO_NUMPY.get(elem_type) or onnx.TensorProto.DataType.Name(elem_type).lower()


def load_onnx(path: str | os.PathLike) -> tuple[onnx.ModelProto, str]:
    path = Path(path)
    if not path.is_file():
        raise ModelLoadError(f"model file not found: {path}")
    data = path.read_bytes()
    if not data:
        raise ModelLoadError(f"{path} is empty, not an ONNX model")
    try:
        model = onnx.load_model_from_string(data)
    except Exception as exc:  # protobuf raises DecodeError, RuntimeWarning and friends
        raise ModelLoadError(f"{path} is not a readable ONNX model ({type(exc).__name__})") from None
    if not model.graph.node and not model.graph.output:
        raise ModelLoadError(f"{path} is not an ONNX model (no graph found)")
    if any(t.data_location == onnx.TensorProto.EXTERNAL for t in model.graph.initializer):
        try:
            onnx.load_external_data_for_model(model, str(path.parent))
        except Exception as exc:
            raise ModelLoadError(f"{path}: external weights could not be read ({exc})") from None
    return model, hashlib.sha256(data).hexdigest()


QUANTIZATION_OPS = ("QuantizeLinear", "DequantizeLinear", "DynamicQuantizeLinear", "QLinearConv", "QLinearMatMul",
                    "ConvInteger", "MatMulInteger")


def has_quantization_nodes(path: str | os.PathLike) -> bool:
    """Whether the ONNX file holds quantization ops (a Q/DQ or QOperator model, which carries its
    own INT8 scales). False for anything unreadable: loading reports that properly."""
    try:
        model = onnx.load(str(path), load_external_data=False)
    except Exception:
        return False
    return any(n.op_type in QUANTIZATION_OPS and n.domain in ("", "ai.onnx") for n in model.graph.node)


def _cycle(model: onnx.ModelProto) -> str | None:
    """The nodes on a cycle of the top-level graph, described, or None when it has none."""
    g = model.graph
    nodes = [Node(p.op_type, p.name or f"{p.op_type}_{i}", list(p.input), list(p.output))
             for i, p in enumerate(g.node)]
    available = [vi.name for vi in g.input] + [t.name for t in g.initializer]
    produced = {out for node in nodes for out in node.outputs if out}
    # Values nobody produces are the checker's business, not a cycle: treat them as available.
    available += [name for node in nodes for name in node.present_inputs() if name not in produced]
    try:
        topological_order(nodes, available)
    except ValueError as exc:
        return str(exc)
    return None


def _check(model: onnx.ModelProto, where: str) -> None:
    try:
        onnx.checker.check_model(model)
    except onnx.checker.ValidationError as exc:
        # The checker reports a cycle as an unsorted node and prints the node's proto; name the cycle.
        cycle = _cycle(model)
        if cycle:
            raise GraphError(f"{where}: {cycle}") from None
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ModelLoadError(f"{where} fails the ONNX checker: {first}") from None


def default_opset(model: onnx.ModelProto) -> int:
    for entry in model.opset_import:
        if entry.domain in ("", "ai.onnx"):
            return entry.version
    raise ModelLoadError("model imports no default-domain opset")


def _convert_opset(model: onnx.ModelProto, opset: int) -> onnx.ModelProto:
    target = OLD_OPSET_TARGET if opset < MIN_OPSET else MAX_OPSET
    try:
        return version_converter.convert_version(model, target)
    except Exception as exc:
        if opset > MAX_OPSET:
            # The default-domain updates after opset 21 widen dtype lists (bfloat16, 4-bit and
            # 8-bit floats) without changing what an op computes on the dtypes sartor accepts,
            # which the dtype checks below enforce. So a model the converter cannot lower is
            # read as it is.
            return model
        raise UnsupportedModelError(
            f"opset {opset} is outside {MIN_OPSET}-{MAX_OPSET} and could not be converted to {target}: "
            f"{str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__}") from None


def _dims(type_proto: onnx.TypeProto, name: str) -> tuple | None:
    tensor = type_proto.tensor_type
    if not tensor.HasField("shape"):
        return None
    dims = []
    for i, d in enumerate(tensor.shape.dim):
        if d.HasField("dim_value"):
            dims.append(int(d.dim_value))
        elif d.dim_param:
            dims.append(d.dim_param)
        else:
            dims.append(f"{name}_dim{i}")
    return tuple(dims)


def _value_info(vi: onnx.ValueInfoProto) -> ValueInfo:
    kind = vi.type.WhichOneof("value")
    if kind not in (None, "tensor_type"):  # sequence, optional, map, sparse tensor: never computed
        return ValueInfo(vi.name, kind.replace("_type", "").replace("_", " "), None)
    return ValueInfo(vi.name, elem_type_name(vi.type.tensor_type.elem_type), _dims(vi.type, vi.name))


def _attribute(attr: onnx.AttributeProto):
    value = helper.get_attribute_value(attr)
    if attr.type == onnx.AttributeProto.TENSOR:
        return numpy_helper.to_array(value)
    if attr.type == onnx.AttributeProto.TENSORS:
        return [numpy_helper.to_array(v) for v in value]
    if attr.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS):
        return value  # ops with subgraphs are refused by the registry check
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    if isinstance(value, list) and value and isinstance(value[0], bytes):
        return [v.decode("utf-8", "replace") for v in value]
    return value


def _constant_node_value(node: onnx.NodeProto) -> np.ndarray | None:
    for attr in node.attribute:
        if attr.name == "value" and attr.type == onnx.AttributeProto.TENSOR:
            return numpy_helper.to_array(attr.t)
        if attr.name == "value_float":
            return np.asarray(attr.f, dtype=np.float32)
        if attr.name == "value_floats":
            return np.asarray(list(attr.floats), dtype=np.float32)
        if attr.name == "value_int":
            return np.asarray(attr.i, dtype=np.int64)
        if attr.name == "value_ints":
            return np.asarray(list(attr.ints), dtype=np.int64)
    return None


def _normalise_attrs(op_type: str, attrs: dict, node: onnx.NodeProto, opset: int) -> dict:
    """Fold opset-specific meanings into one form the op implementations understand."""
    if op_type in ("Softmax", "LogSoftmax", "Hardmax") and opset < 13:
        attrs.setdefault("axis", 1)
        attrs["_coerce_2d"] = 1
    if op_type == "RoiAlign" and opset < 16:  # RoiAlign-10 had no such attribute and worked this way
        attrs.setdefault("coordinate_transformation_mode", "output_half_pixel")
    if op_type == "MaxPool" and len(node.output) > 1 and node.output[1]:
        attrs["_with_indices"] = 1
    if op_type == "Split" and "split" not in attrs and len(node.input) < 2:
        attrs.setdefault("num_outputs", len(node.output))
    return attrs


def graph_from_onnx(model: onnx.ModelProto, registry: OpRegistry | None = None) -> Graph:
    registry = registry or default_registry()
    opset = default_opset(model)
    g = model.graph
    initializers = {t.name: numpy_helper.to_array(t) for t in g.initializer}
    inputs = [_value_info(vi) for vi in g.input if vi.name not in initializers]
    outputs = [_value_info(vi) for vi in g.output]
    value_info = {vi.name: _value_info(vi) for vi in list(g.value_info) + list(g.input) + list(g.output)}

    nodes: list[Node] = []
    problems: list[str] = []
    seen_names: set[str] = set()
    for index, proto in enumerate(g.node):
        name = proto.name or f"{proto.op_type}_{index}"
        while name in seen_names:
            name = f"{name}_{index}"
        seen_names.add(name)
        if proto.domain not in ("", "ai.onnx"):
            problems.append(f"{name} ({proto.domain}.{proto.op_type}: custom domain)")
            continue
        if proto.op_type == "Constant":
            value = _constant_node_value(proto)
            if value is None:
                problems.append(f"{name} (Constant: only numeric tensor values are supported)")
                continue
            initializers[proto.output[0]] = value
            continue
        opdef = registry.get(proto.op_type)
        if opdef is None:
            problems.append(f"{name} ({proto.op_type})")
            continue
        attrs = {a.name: _attribute(a) for a in proto.attribute}
        dtypes = [value_info[i].dtype if i in value_info else
                  (str(initializers[i].dtype) if i in initializers else None) for i in proto.input]
        reason = opdef.unsupported_reason(attrs, dtypes)
        if reason:
            problems.append(f"{name} ({proto.op_type}: {reason})")
            continue
        attrs = _normalise_attrs(proto.op_type, attrs, proto, opset)
        nodes.append(Node(proto.op_type, name, list(proto.input), list(proto.output), attrs, origin=[name]))

    for info in list(inputs) + list(outputs) + list(value_info.values()):
        if info.dtype not in SUPPORTED_DTYPES:
            problems.append(f"value {info.name} (dtype {info.dtype})")
    for key, array in initializers.items():
        if str(array.dtype) not in SUPPORTED_DTYPES:
            problems.append(f"weight {key} (dtype {array.dtype})")
    if problems:
        unique = list(dict.fromkeys(problems))
        raise UnsupportedModelError(f"{len(unique)} unsupported: " + "; ".join(unique))

    try:
        ordered = topological_order(nodes, [v.name for v in inputs] + list(initializers))
    except ValueError as exc:
        raise GraphError(str(exc)) from None
    graph = Graph(ordered, inputs, outputs, initializers, value_info, opset=opset, name=g.name or "graph")
    return graph


def import_onnx(path: str | os.PathLike, registry: OpRegistry | None = None) -> ImportedModel:
    """Read, check, convert and translate an ONNX file."""
    model, sha = load_onnx(path)
    _check(model, str(path))
    opset = default_opset(model)
    if not MIN_OPSET <= opset <= MAX_OPSET:
        model = _convert_opset(model, opset)
    try:
        model = shape_inference.infer_shapes(model, data_prop=True)
    except Exception:  # shape inference is advisory: execution computes every shape itself
        pass
    graph = graph_from_onnx(model, registry)
    return ImportedModel(graph=graph, sha256=sha, source_opset=opset, producer=model.producer_name or "")


def import_model_proto(model: onnx.ModelProto, registry: OpRegistry | None = None) -> Graph:
    """Translate an in-memory model (tests, node cases) with the same checks as files."""
    _check(model, model.graph.name or "model")
    opset = default_opset(model)
    if not MIN_OPSET <= opset <= MAX_OPSET:
        model = _convert_opset(model, opset)
    try:
        model = shape_inference.infer_shapes(model, data_prop=True)
    except Exception:
        pass
    return graph_from_onnx(model, registry)
