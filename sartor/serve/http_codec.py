"""KServe v2 HTTP/REST bodies: the JSON inference request with the binary tensor data extension
(`Inference-Header-Content-Length`, `binary_data_size`) and the shared-memory parameters
(`shared_memory_region`, `_byte_size`, `_offset`), and the response, JSON or binary.

Pure functions of bytes, so that they can run off the event loop for large bodies and be fuzzed."""
from __future__ import annotations

import gzip
import json
import zlib
from dataclasses import dataclass, field

import numpy as np

from .errors import InvalidRequest
from .shared_memory import ShmInput, shm_ref
from .tensors import array_from_bytes, array_from_list, check_shape, kserve_datatype, numpy_dtype

MAX_TENSORS = 1024


@dataclass
class HttpInferRequest:
    id: str | None
    inputs: dict  # name -> np.ndarray, or ShmInput (data in a shared-memory region)
    outputs: list = field(default_factory=list)  # [(name, binary or None)], empty: all outputs
    binary_output: bool = False  # the request-level binary_data_output parameter
    timeout_us: object = None
    output_regions: dict = field(default_factory=dict)  # name -> ShmRef, outputs to write to shared memory


def _object(value, where: str) -> dict:
    if not isinstance(value, dict):
        raise InvalidRequest(f"{where} must be a JSON object, not {_json_type(value)}")
    return value


def _json_type(value) -> str:
    return {dict: "an object", list: "an array", str: "a string", bool: "a boolean", int: "a number",
            float: "a number", type(None): "null"}.get(type(value), type(value).__name__)


def _bool(value, where: str) -> bool:
    if not isinstance(value, bool):
        raise InvalidRequest(f"{where} must be true or false, not {_json_type(value)}")
    return value


def compress(body: bytes, accept_encoding: str | None) -> tuple[bytes, str | None]:
    """Compress an inference response when the client asked for gzip or deflate (Accept-Encoding)."""
    accepted = [part.split(";")[0].strip().lower() for part in (accept_encoding or "").split(",")]
    if "gzip" in accepted:
        return gzip.compress(body, compresslevel=1), "gzip"
    if "deflate" in accepted:
        return zlib.compress(body, 1), "deflate"
    return body, None


def parse_infer_request(body: bytes, header_length: str | None) -> HttpInferRequest:
    if header_length is not None:
        try:
            n = int(header_length.strip())
        except (ValueError, AttributeError):
            raise InvalidRequest(f"Inference-Header-Content-Length {header_length!r} is not an integer") from None
        if not 0 < n <= len(body):
            raise InvalidRequest(f"Inference-Header-Content-Length {n} is outside 1..{len(body)} (the body size)")
        header, binary = body[:n], memoryview(body)[n:]
    else:
        header, binary = body, memoryview(b"")
    try:
        request = json.loads(header)
    except UnicodeDecodeError:
        raise InvalidRequest("the JSON request header is not UTF-8 (binary data needs "
                             "Inference-Header-Content-Length)") from None
    except json.JSONDecodeError as exc:
        raise InvalidRequest(f"malformed JSON request: {exc.msg} at line {exc.lineno} column {exc.colno}") from None
    except RecursionError:
        raise InvalidRequest("malformed JSON request: nested too deeply") from None
    request = _object(request, "the request")
    params = _object(request.get("parameters", {}), "request parameters")
    for key in ("sequence_id",):
        if params.get(key) not in (None, 0, ""):
            raise InvalidRequest(f"parameter {key} is not supported (no sequence batching)")
    binary_output = _bool(params.get("binary_data_output", False), "parameter binary_data_output")
    request_id = request.get("id")
    if request_id is not None and not isinstance(request_id, str):
        raise InvalidRequest(f"id must be a string, not {_json_type(request_id)}")

    raw_inputs = request.get("inputs")
    if not isinstance(raw_inputs, list) or not raw_inputs:
        raise InvalidRequest("the request needs \"inputs\": a non-empty array of tensors")
    if len(raw_inputs) > MAX_TENSORS:
        raise InvalidRequest(f"the request has {len(raw_inputs)} inputs (at most {MAX_TENSORS})")
    inputs: dict[str, np.ndarray] = {}
    offset = 0
    for i, raw in enumerate(raw_inputs):
        tensor = _object(raw, f"input {i}")
        name = tensor.get("name")
        if not isinstance(name, str) or not name:
            raise InvalidRequest(f"input {i} needs a \"name\" string")
        where = f"input {name!r}"
        if name in inputs:
            raise InvalidRequest(f"{where} is given twice")
        dtype = numpy_dtype(tensor.get("datatype"), where)
        shape = check_shape(tensor.get("shape"), where)
        tparams = _object(tensor.get("parameters", {}), f"{where} parameters")
        ref = shm_ref(tparams, where)
        if ref is not None:
            if "data" in tensor:
                raise InvalidRequest(f"{where} has both \"data\" and shared_memory_region")
            inputs[name] = ShmInput(ref, shape, dtype)
            continue
        size = tparams.get("binary_data_size")
        if size is not None:
            if isinstance(size, bool) or not isinstance(size, int) or size < 0:
                raise InvalidRequest(f"{where}: binary_data_size {size!r} must be a non-negative integer")
            if "data" in tensor:
                raise InvalidRequest(f"{where} has both \"data\" and binary_data_size")
            if offset + size > len(binary):
                raise InvalidRequest(f"{where}: binary_data_size {size} runs past the end of the binary data "
                                     f"({len(binary) - offset} bytes left)")
            inputs[name] = array_from_bytes(binary[offset:offset + size], shape, dtype, where)
            offset += size
        elif "data" in tensor:
            inputs[name] = array_from_list(tensor["data"], shape, dtype, where)
        else:
            raise InvalidRequest(f"{where} has neither \"data\" nor parameters.binary_data_size")
    if offset != len(binary):
        raise InvalidRequest(f"{len(binary) - offset} bytes of binary data after the inputs are not claimed by "
                             f"any binary_data_size")

    outputs, regions = [], {}
    raw_outputs = request.get("outputs")
    if raw_outputs is not None:
        if not isinstance(raw_outputs, list) or len(raw_outputs) > MAX_TENSORS:
            raise InvalidRequest("\"outputs\" must be an array of {\"name\": ...} objects")
        seen = set()
        for i, raw in enumerate(raw_outputs):
            tensor = _object(raw, f"output {i}")
            name = tensor.get("name")
            if not isinstance(name, str) or not name:
                raise InvalidRequest(f"output {i} needs a \"name\" string")
            if name in seen:
                raise InvalidRequest(f"output {name!r} is requested twice")
            seen.add(name)
            oparams = _object(tensor.get("parameters", {}), f"output {name!r} parameters")
            if oparams.get("classification"):
                raise InvalidRequest(f"output {name!r}: the classification extension is not supported")
            ref = shm_ref(oparams, f"output {name!r}")
            if ref is not None:
                regions[name] = ref
            binary = oparams.get("binary_data")
            outputs.append((name, None if binary is None else _bool(binary, f"output {name!r} binary_data")))
    return HttpInferRequest(request_id, inputs, outputs, binary_output, params.get("timeout"), regions)


def _json_values(array: np.ndarray) -> list:
    flat = array.reshape(-1)
    if flat.dtype.kind == "f":
        flat = flat.astype(np.float64)
    return flat.tolist()


def encode_infer_response(model_name: str, version: str, outputs: dict, request: HttpInferRequest,
                          shared_memory: dict | None = None) -> tuple[bytes, dict]:
    """(body, headers): JSON, or a JSON header followed by the binary outputs. `shared_memory`: the
    outputs already written to shared memory: name, datatype and shape only (no data, no parameters)."""
    binary_for = {name: b for name, b in request.outputs}
    entries, chunks = [], []
    for name, array in outputs.items():
        entry = {"name": name, "datatype": kserve_datatype(array.dtype.name), "shape": list(array.shape)}
        if shared_memory and name in shared_memory:
            entries.append(entry)
            continue
        array = np.ascontiguousarray(array)
        binary = binary_for.get(name)
        if binary is None:
            binary = request.binary_output
        if binary:
            data = array.astype(array.dtype.newbyteorder("<"), copy=False).tobytes()
            entry["parameters"] = {"binary_data_size": len(data)}
            chunks.append(data)
        else:
            entry["data"] = _json_values(array)
        entries.append(entry)
    response = {"model_name": model_name, "model_version": version, "outputs": entries}
    if request.id is not None:
        response["id"] = request.id
    header = json.dumps(response, separators=(",", ":")).encode()
    if not chunks:
        return header, {"Content-Type": "application/json"}
    return b"".join([header, *chunks]), {"Content-Type": "application/octet-stream",
                                         "Inference-Header-Content-Length": str(len(header))}
