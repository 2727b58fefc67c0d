"""KServe v2 tensors: datatype names, and numpy arrays from JSON data or raw bytes (checked)."""
from __future__ import annotations

import math

import numpy as np

from .errors import InvalidRequest

# KServe v2 datatype -> numpy dtype name (BYTES and BF16 have no engine counterpart here).
TO_NUMPY = {
    "BOOL": "bool", "UINT8": "uint8", "UINT16": "uint16", "UINT32": "uint32", "UINT64": "uint64",
    "INT8": "int8", "INT16": "int16", "INT32": "int32", "INT64": "int64",
    "FP16": "float16", "FP32": "float32", "FP64": "float64",
}
FROM_NUMPY = {v: k for k, v in TO_NUMPY.items()}
KNOWN = set(TO_NUMPY) | {"BYTES", "BF16"}
MAX_RANK = 16


def kserve_datatype(numpy_dtype: str) -> str:
    return FROM_NUMPY.get(str(numpy_dtype), str(numpy_dtype).upper())


def numpy_dtype(datatype, where: str) -> np.dtype:
    if not isinstance(datatype, str) or datatype not in KNOWN:
        raise InvalidRequest(f"{where}: datatype {datatype!r} is not a KServe v2 datatype "
                             f"({', '.join(sorted(KNOWN))})")
    if datatype not in TO_NUMPY:
        raise InvalidRequest(f"{where}: datatype {datatype} is not supported by sartor engines")
    return np.dtype(TO_NUMPY[datatype])


def check_shape(shape, where: str) -> tuple[int, ...]:
    if not isinstance(shape, (list, tuple)) or len(shape) > MAX_RANK:
        raise InvalidRequest(f"{where}: shape must be a list of at most {MAX_RANK} non-negative integers")
    dims = []
    for d in shape:
        if isinstance(d, bool) or not isinstance(d, int) or d < 0 or d > 2**40:
            raise InvalidRequest(f"{where}: shape {list(shape)!r} must hold non-negative integers")
        dims.append(int(d))
    return tuple(dims)


def element_count(shape: tuple[int, ...]) -> int:
    return math.prod(shape) if shape else 1


def array_from_bytes(raw, shape: tuple[int, ...], dtype: np.dtype, where: str) -> np.ndarray:
    """Raw little-endian row-major bytes -> array, read-only on little-endian hosts; the byte size
    must match the shape exactly."""
    expected = element_count(shape) * dtype.itemsize
    if len(raw) != expected:
        raise InvalidRequest(f"{where}: {len(raw)} bytes of data for shape {list(shape)} "
                             f"{kserve_datatype(dtype.name)}; expected {expected} bytes")
    wire = dtype.newbyteorder("<")
    if wire == dtype:
        # A read-only view of the request's bytes, no copy: the batcher copies each request once,
        # into the batch it runs in.
        return np.frombuffer(raw, dtype=dtype).reshape(shape)
    return np.frombuffer(raw, dtype=wire).astype(dtype).reshape(shape)


def array_from_list(data, shape: tuple[int, ...], dtype: np.dtype, where: str) -> np.ndarray:
    """JSON `data` (flat or nested, row-major) -> array of `dtype` and `shape`."""
    if not isinstance(data, list):
        data = [data]
    try:
        array = np.asarray(data)
    except (ValueError, TypeError, OverflowError):
        raise InvalidRequest(f"{where}: data is not a regular (rectangular) list of numbers") from None
    kind = array.dtype.kind
    if array.size and kind not in "biuf":
        raise InvalidRequest(f"{where}: data must hold numbers (got {_kind_name(kind)})")
    if array.size and dtype.kind in "iu" and kind == "f":
        raise InvalidRequest(f"{where}: data holds non-integer numbers for datatype {kserve_datatype(dtype.name)}")
    if array.size and dtype.kind == "b" and kind != "b":
        raise InvalidRequest(f"{where}: datatype BOOL needs true/false data")
    if array.size != element_count(shape):
        raise InvalidRequest(f"{where}: {array.size} data elements for shape {list(shape)} "
                             f"(expected {element_count(shape)})")
    if dtype.kind in "iu" and array.size:
        info = np.iinfo(dtype)
        if array.min() < info.min or array.max() > info.max:
            raise InvalidRequest(f"{where}: data is out of range for datatype {kserve_datatype(dtype.name)}")
    try:
        return array.astype(dtype).reshape(shape)
    except (ValueError, OverflowError, TypeError):
        raise InvalidRequest(f"{where}: data cannot be read as {kserve_datatype(dtype.name)}") from None


def _kind_name(kind: str) -> str:
    return {"U": "strings", "S": "bytes", "O": "mixed or nested values", "c": "complex numbers"}.get(kind, kind)
