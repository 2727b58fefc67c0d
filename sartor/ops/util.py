"""Small helpers shared by the op families."""
from __future__ import annotations

import contextlib
from collections import OrderedDict

import numpy as np
import torch



def tensor_from_numpy(array) -> torch.Tensor:
    """A weight (numpy, maybe ml_dtypes bfloat16, maybe 0-d) as a torch tensor of the same dtype."""
    array = np.array(array)  # a copy, keeping 0-d arrays 0-d
    if array.dtype.name == "bfloat16":
        return torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
    if array.dtype.name == "float8_e4m3fn":  # FP8 layer weights (sartor/ops/fp8.py)
        return torch.from_numpy(array.view(np.uint8)).view(torch.float8_e4m3fn)
    return torch.from_numpy(array)


def tensor_to_numpy(tensor: torch.Tensor) -> np.ndarray:
    """The inverse of `tensor_from_numpy`: bfloat16 and float8_e4m3fn come back as ml_dtypes types."""
    tensor = tensor.detach().cpu().contiguous()
    if tensor.dtype == torch.bfloat16:
        return tensor.view(torch.int16).numpy().copy().view(ml_dtypes_module().bfloat16)
    if tensor.dtype == torch.float8_e4m3fn:
        return tensor.view(torch.uint8).numpy().copy().view(ml_dtypes_module().float8_e4m3fn)
    return tensor.numpy().copy()


def ml_dtypes_module():
    """ml_dtypes (onnx brings it: the build extra). Engines keep their weights as torch tensors and
    their attributes in float32, so loading and running one never needs it; a graph constant in
    bfloat16 or FP8 read back into numpy does."""
    try:
        import ml_dtypes
    except ImportError:
        from ..errors import MissingExtraError
        raise MissingExtraError("bfloat16 and FP8 arrays in numpy", "build", "ml_dtypes") from None
    return ml_dtypes


def ints(t) -> list[int]:
    """A host tensor, list or scalar read as a list of Python ints."""
    if t is None:
        return []
    if isinstance(t, torch.Tensor):
        return [int(v) for v in t.reshape(-1).tolist()]
    if isinstance(t, np.ndarray):
        return [int(v) for v in t.reshape(-1).tolist()]
    if isinstance(t, (list, tuple)):
        return [int(v) for v in t]
    return [int(t)]


def floats(t) -> list[float]:
    if t is None:
        return []
    if isinstance(t, torch.Tensor):
        return [float(v) for v in t.reshape(-1).tolist()]
    return [float(v) for v in np.asarray(t).reshape(-1).tolist()]


def norm_axis(axis: int, rank: int) -> int:
    return axis + rank if axis < 0 else axis


def same_device(value, like: torch.Tensor) -> torch.Tensor:
    """Bring a (possibly host-side) tensor beside `like`, keeping 0-d host tensors as scalars
    (elementwise kernels read a 0-d host tensor's value at launch, with no copy)."""
    if not isinstance(value, torch.Tensor):
        return torch.full((), value, device=like.device)
    if value.device != like.device and value.dim() > 0:
        return value.to(like.device)
    return value


_DEVICE_TABLES: "OrderedDict[tuple, torch.Tensor]" = OrderedDict()
DEVICE_TABLES_KEPT = 64


def device_table(key: tuple, make, device: torch.device) -> torch.Tensor:
    """An index table that depends on shapes and attributes only, built on the host by `make()` and
    copied to `device` once: the runs before a CUDA graph's capture make it, the capture finds it
    (a copy from pageable host memory cannot be captured). The most recent few are kept."""
    full_key = (key, str(device))
    table = _DEVICE_TABLES.get(full_key)
    if table is None:
        table = _DEVICE_TABLES[full_key] = make().to(device)
        while len(_DEVICE_TABLES) > DEVICE_TABLES_KEPT:
            _DEVICE_TABLES.popitem(last=False)
    else:
        _DEVICE_TABLES.move_to_end(full_key)
    return table


def device_scalar(value: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A 0-d tensor on `device` holding a 0-d host tensor's value, written by a fill kernel: a
    copy from pageable host memory would break CUDA-graph capture, a fill is captured as any
    other kernel (the value depends on input shapes only, fixed per captured shape)."""
    if value.device == device:
        return value
    return torch.full((), value.item(), dtype=value.dtype, device=device)


def programmatic_launch(x: torch.Tensor, attrs: dict) -> bool:
    """Whether the layer's kernel is launched with programmatic dependent launch: the builder marks the
    layers (`builder/pdl.py`), and only CUDA tensors take it (the interpreter has no grid dependency
    control)."""
    return bool(attrs.get("pdl")) and x.is_cuda


def is_float(t: torch.Tensor) -> bool:
    return t.is_floating_point()


def only_dtypes(allowed: set[str], positions: tuple = (0,)):
    """A registry check that refuses inputs of other dtypes (unknown dtypes pass)."""
    def check(attrs: dict, dtypes: list):
        for i in positions:
            if i < len(dtypes) and dtypes[i] is not None and dtypes[i] not in allowed:
                return f"input {i} dtype {dtypes[i]} not supported"
        return None
    return check


def exact_integer_math(device: torch.device):
    """A context in which float64 convolutions of integer codes are exact: cuDNN off on CUDA,
    whose algorithms may reorder or round the sums."""
    if device.type == "cuda":
        return torch.backends.cudnn.flags(enabled=False)
    return contextlib.nullcontext()
