"""Triton's shared-memory extensions: input and output tensors in memory the client registered,
rather than in the request body (a request of a few hundred bytes instead of the tensors' copies).

- System shared memory: a POSIX shared-memory object (`shm_open(key)`: /dev/shm/<key> on Linux),
  mapped at registration. An input is a read-only numpy view of the mapping: the batcher copies it
  once into its staging buffer, as it does with a request body's bytes. An output is written into
  the mapping.
- CUDA shared memory: a cudaIpcMemHandle_t of device memory another process allocated, opened with
  cudaIpcOpenMemHandle on the CUDA runtime that torch loaded. An input is a torch CUDA tensor view of
  it, which the batcher copies device to device into the batch. An output is copied host to device:
  the batcher hands outputs back on the host.

One registry per server (InferenceCore owns it). Region names are one namespace across both kinds,
as in Triton. A request takes a `Lease` on the regions it names: unregistering removes the name at
once, but the mapping is closed only when the last request using it has finished, so a client that
unregisters early never makes the server touch unmapped memory.
"""
from __future__ import annotations

import ctypes
import glob
import logging
import mmap
import os
import stat
import threading
from dataclasses import dataclass

import numpy as np

from .device_copies import DeviceCopies, wait_asleep
from .errors import InvalidRequest, RegionExists, RegionNotFound, Unsupported
from .tensors import element_count, kserve_datatype

log = logging.getLogger("sartor.serve")
SHM_DIR = "/dev/shm"  # where glibc's shm_open keeps its objects
CUDA_IPC_HANDLE_SIZE = 64  # sizeof(cudaIpcMemHandle_t)
KINDS = {"system": "system shared memory", "cuda": "CUDA shared memory"}
MAX_NAME = 255
# Views kept per CUDA region and direction: a client uses a few offsets of its region (perf_analyzer
# one per tensor), so this bounds the memory of one that uses a fresh offset for every request.
MAX_REGION_VIEWS = 64


# ---- what a request names --------------------------------------------------------------------------

@dataclass(frozen=True)
class ShmRef:
    """`byte_size` bytes at `offset` in region `region`, for the tensor `where` describes."""
    region: str
    byte_size: int
    offset: int
    where: str


@dataclass(frozen=True)
class ShmInput:
    """An input whose data is in shared memory: resolved into an array by `Lease.read`."""
    ref: ShmRef
    shape: tuple
    dtype: np.dtype


def _uint(value, what: str, minimum: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise InvalidRequest(f"{what} {value!r} must be an integer >= {minimum}")
    return value


def shm_ref(params: dict, where: str) -> ShmRef | None:
    """The shared-memory parameters of one tensor (plain values: JSON, or gRPC's InferParameter
    unwrapped), or None when it names no region. Triton's rules: a region needs a byte size; offset
    and byte size without a region are errors."""
    region = params.get("shared_memory_region")
    if region is None:
        stray = [k for k in ("shared_memory_byte_size", "shared_memory_offset") if k in params]
        if stray:
            raise InvalidRequest(f"{where}: {stray[0]} is given without shared_memory_region")
        return None
    if not isinstance(region, str) or not region:
        raise InvalidRequest(f"{where}: shared_memory_region must be a non-empty string")
    if "shared_memory_byte_size" not in params:
        raise InvalidRequest(f"{where}: shared_memory_byte_size must be given with shared_memory_region")
    if "binary_data_size" in params:
        raise InvalidRequest(f"{where} has both shared_memory_region and binary_data_size")
    size = _uint(params["shared_memory_byte_size"], f"{where}: shared_memory_byte_size")
    offset = _uint(params.get("shared_memory_offset", 0), f"{where}: shared_memory_offset")
    return ShmRef(region, size, offset, where)


# ---- regions --------------------------------------------------------------------------------------

class Region:
    """One registered region. `_users` counts the requests holding it; a retired (unregistered)
    region is closed when the last of them lets go."""
    kind = ""

    def __init__(self, name: str, byte_size: int) -> None:
        self.name, self.byte_size = name, byte_size
        self._lock = threading.Lock()
        self._users = 0
        self._retired = False
        self.closed = False

    def acquire(self) -> bool:
        with self._lock:
            if self._retired:
                return False
            self._users += 1
            return True

    def release(self) -> None:
        with self._lock:
            self._users -= 1
            close = self._retired and self._users == 0
        if close:
            self._close()
            self.closed = True

    def retire(self) -> None:
        with self._lock:
            self._retired = True
            close = self._users == 0
        if close:
            self._close()
            self.closed = True

    def check_range(self, offset: int, byte_size: int, where: str) -> None:
        if offset + byte_size > self.byte_size:
            raise InvalidRequest(f"{where}: offset {offset} + byte size {byte_size} runs past the end of shared "
                                 f"memory region '{self.name}' ({self.byte_size} bytes)")

    def status(self) -> dict:
        raise NotImplementedError

    def read(self, offset: int, shape: tuple, dtype: np.dtype):
        raise NotImplementedError

    def write(self, offset: int, data: np.ndarray) -> None:
        raise NotImplementedError

    def _close(self) -> None:
        raise NotImplementedError


def _shm_path(key) -> str:
    if not isinstance(key, str) or not key.strip("/"):
        raise InvalidRequest(f"system shared memory key {key!r} must be a non-empty string")
    name = key.lstrip("/")
    # shm_open names are one path component: nothing may reach outside SHM_DIR.
    if "/" in name or name in (".", "..") or "\0" in name or len(name) > MAX_NAME:
        raise InvalidRequest(f"system shared memory key {key!r} is not a POSIX shared memory name "
                             f"(\"/name\", no other '/')")
    return os.path.join(SHM_DIR, name)


class SystemRegion(Region):
    kind = "system"

    def __init__(self, name: str, key: str, offset: int, byte_size: int) -> None:
        super().__init__(name, byte_size)
        self.key, self.offset = key, offset
        path = _shm_path(key)
        try:
            fd = os.open(path, os.O_RDWR | getattr(os, "O_NOFOLLOW", 0))
        except FileNotFoundError:
            raise InvalidRequest(f"system shared memory key {key!r} does not exist (no {path}): create the "
                                 f"object before registering region '{name}'") from None
        except OSError as exc:
            raise InvalidRequest(f"system shared memory key {key!r} cannot be opened: "
                                 f"{exc.strerror or exc}") from None
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                raise InvalidRequest(f"system shared memory key {key!r} is not a shared memory object")
            if offset + byte_size > info.st_size:
                raise InvalidRequest(f"region '{name}': offset {offset} + byte_size {byte_size} runs past the end "
                                     f"of shared memory object {key!r} ({info.st_size} bytes)")
            # mmap's offset must be a multiple of the allocation granularity: map from the page that
            # holds `offset`, and remember where the region starts in the mapping.
            start = offset - offset % mmap.ALLOCATIONGRANULARITY
            self._base = offset - start
            try:
                self._mmap = mmap.mmap(fd, self._base + byte_size, offset=start)
            except (OSError, ValueError) as exc:
                raise InvalidRequest(f"region '{name}': shared memory object {key!r} cannot be mapped: "
                                     f"{getattr(exc, 'strerror', None) or exc}") from None
        finally:
            os.close(fd)  # the mapping keeps the object alive (and its own descriptor: see _check_object)

    def status(self) -> dict:
        return {"name": self.name, "key": self.key, "offset": self.offset, "byte_size": self.byte_size}

    def _check_object(self, offset: int, byte_size: int, where: str) -> None:
        """A client that shrinks the object (ftruncate) after registering would turn the next access
        into a SIGBUS: its size is checked first (mmap.size() is an fstat on the mapping's own
        descriptor)."""
        end = self.offset + offset + byte_size
        size = self._mmap.size()
        if end > size:
            raise InvalidRequest(f"{where}: shared memory object {self.key!r} of region '{self.name}' shrank to "
                                 f"{size} bytes since it was registered")

    def check_range(self, offset: int, byte_size: int, where: str) -> None:
        super().check_range(offset, byte_size, where)
        self._check_object(offset, byte_size, where)

    def read(self, offset: int, shape: tuple, dtype: np.dtype) -> np.ndarray:
        count = element_count(shape)
        if count == 0:
            return np.empty(shape, dtype)
        wire = dtype.newbyteorder("<")
        array = np.frombuffer(self._mmap, dtype=wire, count=count, offset=self._base + offset)
        if wire != dtype:
            array = array.astype(dtype)
        array = array.reshape(shape)
        # Read-only: the engine never runs on (or writes into) the client's memory; the batcher
        # copies the view into its staging buffer.
        array.flags.writeable = False
        return array

    def write(self, offset: int, data: np.ndarray) -> None:
        if data.nbytes:
            target = np.frombuffer(self._mmap, dtype=np.uint8, count=data.nbytes, offset=self._base + offset)
            target[:] = data.reshape(-1).view(np.uint8)

    def _close(self) -> None:
        try:
            self._mmap.close()
        except BufferError:
            # A view is still alive (the finished request's input, until its objects are freed):
            # the mapping goes with the last view.
            pass
        self._mmap = None


class CudaRegion(Region):
    kind = "cuda"

    def __init__(self, name: str, raw_handle: bytes, device_id: int, byte_size: int, ipc: CudaIpc) -> None:
        super().__init__(name, byte_size)
        self.device_id = device_id
        self._ipc = ipc
        self._stream = None  # where outputs are copied in (write), made at the first
        # The views of the requests' (offset, shape, dtype) inputs and (offset, byte shape) outputs, made
        # once: a client reuses its offsets, and making a view (a slice and two reinterpretations,
        # a dtype look-up) per request costs the main process, which answers every request.
        self._input_views: dict = {}
        self._output_views: dict = {}
        self._ptr, size = ipc.open(raw_handle, device_id, name)
        try:
            if size is not None and byte_size > size:
                raise InvalidRequest(f"region '{name}': byte_size {byte_size} is larger than the CUDA allocation "
                                     f"behind the handle ({size} bytes)")
            self.tensor = ipc.as_tensor(self._ptr, byte_size, device_id)
        except BaseException:
            ipc.close(self._ptr, device_id)
            raise

    def status(self) -> dict:
        return {"name": self.name, "device_id": self.device_id, "byte_size": self.byte_size}

    def read(self, offset: int, shape: tuple, dtype: np.dtype):
        key = (offset, tuple(shape), dtype)
        view = self._input_views.get(key)
        if view is not None:
            return view
        import torch

        from ..ir.dtypes import NUMPY_TO_TORCH
        if dtype.name not in NUMPY_TO_TORCH:
            raise InvalidRequest(f"datatype {kserve_datatype(dtype.name)} cannot be read from CUDA shared memory")
        torch_dtype = NUMPY_TO_TORCH[dtype.name]
        nbytes = element_count(shape) * dtype.itemsize
        if not nbytes:
            return torch.empty(tuple(shape), dtype=torch_dtype, device=self.tensor.device)
        data = self.tensor[offset:offset + nbytes]
        if offset % dtype.itemsize:
            # view(dtype) needs an offset aligned to the element size: a copy, of this request's bytes only.
            return data.clone().view(torch_dtype).view(tuple(shape))
        view = data.view(torch_dtype).view(tuple(shape))
        if len(self._input_views) < MAX_REGION_VIEWS:
            self._input_views[key] = view
        return view

    def write(self, offset: int, data: np.ndarray) -> None:
        import torch
        if not data.nbytes:
            return
        host = data.reshape(-1).view(np.uint8)
        if not host.flags.writeable:
            host = host.copy()  # torch.from_numpy warns on read-only arrays
        self._copy_now(self.tensor[offset:offset + data.nbytes], torch.from_numpy(host))

    def _copy_now(self, target, source, after=None) -> None:
        """target.copy_(source), done when this returns: on the region's own stream, after the
        work queued on the stream `after` (that made `source`) if given."""
        import torch
        if target.device.type != "cuda":
            target.copy_(source)  # a host stand-in of the region (tests): synchronous
            return
        # The client reads the region once the response arrives, so the copy must be done before this
        # returns; but only this copy. A device-wide synchronize here would wait for whatever batch
        # the engine is running; the thread's default stream would too (the batcher's default stream
        # waits on the engine's). A high-priority stream comes from another pool than the engines'
        # (default-priority) streams.
        if self._stream is None:
            self._stream = torch.cuda.Stream(target.device, priority=-1)
        if after is not None:
            self._stream.wait_stream(after)
        with torch.cuda.stream(self._stream):
            target.copy_(source)
        wait_asleep(self._stream)

    def write_tensor(self, offset: int, data, copies: DeviceCopies) -> None:
        """Copy a torch tensor (the batch's output rows, on the engine's device) in without a round
        trip through the host. On the region's own device the copy is queued in `copies`, which the
        batcher's worker issues with the batch's others on its current stream, behind the batch
        that made `data`, and waits for once before the responses go out. Anywhere else it is done
        when this returns."""
        import torch
        nbytes = data.numel() * data.element_size()
        if not nbytes:
            return
        # The rows' bytes in their own shape (the last dim in bytes), and the region's bytes viewed in
        # that shape once: one torch call per request here, where flattening took three (each
        # main-process time).
        source = (data if data.is_contiguous() else data.contiguous()).view(torch.uint8)
        key = (offset, source.shape)
        target = self._output_views.get(key)
        if target is None:
            target = self.tensor[offset:offset + nbytes].view(source.shape)
            if len(self._output_views) < MAX_REGION_VIEWS:
                self._output_views[key] = target
        if target.device == source.device:
            copies.add(target, source)
        else:
            self._copy_now(target, source, torch.cuda.current_stream(source.device))

    def _close(self) -> None:
        self._input_views, self._output_views = {}, {}
        self.tensor = None
        self._ipc.close(self._ptr, self.device_id)


# ---- the CUDA runtime, through ctypes ----------------------------------------------------------------

class _IpcMemHandle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_char * CUDA_IPC_HANDLE_SIZE)]


class _DeviceMemory:
    """Device memory as `__cuda_array_interface__`, so that torch.as_tensor wraps it without a copy."""

    def __init__(self, ptr: int, size: int) -> None:
        self.__cuda_array_interface__ = {"shape": (size,), "typestr": "|u1", "data": (ptr, False),
                                         "version": 3, "strides": None}


def _libcudart_path() -> str | None:
    """The libcudart that torch itself loaded (it is mapped once torch initialised CUDA), else one
    next to torch's libraries (torch/lib, nvidia/*/lib of the same site-packages)."""
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.rsplit(" ", 1)[-1].strip()
                if os.path.basename(path).startswith("libcudart.so"):
                    return path
    except OSError:
        pass
    import torch
    torch_dir = os.path.dirname(torch.__file__)
    site = os.path.dirname(torch_dir)
    for pattern in (os.path.join(torch_dir, "lib", "libcudart.so*"), os.path.join(site, "nvidia", "*", "lib",
                                                                                  "libcudart.so*")):
        found = sorted(glob.glob(pattern))
        if found:
            return found[-1]
    return None


class CudaIpc:
    """cudaIpcOpenMemHandle / cudaIpcCloseMemHandle on the runtime torch uses. torch.cuda.cudart()
    does not expose IPC, hence ctypes. Raises Unsupported where CUDA is not available."""

    def __init__(self) -> None:
        import torch
        if not torch.cuda.is_available():
            raise Unsupported("CUDA shared memory needs a CUDA device and this server has none; use system "
                              "shared memory")
        torch.cuda.init()
        path = _libcudart_path()
        if path is None:
            raise Unsupported("CUDA shared memory: the CUDA runtime library (libcudart) torch uses was not found")
        try:
            rt = ctypes.CDLL(path)
        except OSError as exc:
            raise Unsupported(f"CUDA shared memory: {path} cannot be loaded: {exc}") from None
        rt.cudaIpcOpenMemHandle.argtypes = [ctypes.POINTER(ctypes.c_void_p), _IpcMemHandle, ctypes.c_uint]
        rt.cudaIpcOpenMemHandle.restype = ctypes.c_int
        rt.cudaIpcCloseMemHandle.argtypes = [ctypes.c_void_p]
        rt.cudaIpcCloseMemHandle.restype = ctypes.c_int
        rt.cudaGetErrorString.argtypes = [ctypes.c_int]
        rt.cudaGetErrorString.restype = ctypes.c_char_p
        self._rt = rt
        self._range = None
        try:  # the driver call Triton uses to check byte_size against the allocation; optional
            driver = ctypes.CDLL("libcuda.so.1")
            self._range = driver.cuMemGetAddressRange_v2
            self._range.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_size_t),
                                    ctypes.c_uint64]
            self._range.restype = ctypes.c_int
        except (OSError, AttributeError):
            self._range = None
        self.device_count = torch.cuda.device_count()

    def _error(self, code: int) -> str:
        text = self._rt.cudaGetErrorString(code)
        return text.decode(errors="replace") if text else f"CUDA error {code}"

    def open(self, raw_handle: bytes, device_id: int, name: str) -> tuple[int, int | None]:
        """(device pointer, size of the allocation behind it, None where it cannot be asked)."""
        import torch
        if not 0 <= device_id < self.device_count:
            raise InvalidRequest(f"region '{name}': device_id {device_id} does not exist (this server sees "
                                 f"{self.device_count} CUDA device(s))")
        ptr = ctypes.c_void_p()
        with torch.cuda.device(device_id):  # the IPC mapping and the driver query use the current context
            code = self._rt.cudaIpcOpenMemHandle(ctypes.byref(ptr), _IpcMemHandle.from_buffer_copy(raw_handle),
                                                 1)  # cudaIpcMemLazyEnablePeerAccess
            if code != 0 or not ptr.value:
                raise InvalidRequest(f"region '{name}': the CUDA IPC handle cannot be opened on device {device_id}: "
                                     f"{self._error(code)} (it must come from cudaIpcGetMemHandle in another "
                                     f"process on this machine)")
            return ptr.value, self._allocation_size(ptr.value)

    def _allocation_size(self, ptr: int) -> int | None:
        if self._range is None:
            return None
        base, size = ctypes.c_uint64(), ctypes.c_size_t()
        if self._range(ctypes.byref(base), ctypes.byref(size), ctypes.c_uint64(ptr)) != 0:
            return None
        return int(size.value) - (ptr - int(base.value))

    def as_tensor(self, ptr: int, size: int, device_id: int):
        import torch
        with torch.cuda.device(device_id):
            return torch.as_tensor(_DeviceMemory(ptr, size), device=torch.device("cuda", device_id))

    def close(self, ptr: int, device_id: int) -> None:
        import torch
        with torch.cuda.device(device_id):
            torch.cuda.synchronize()  # no copy from or to the region may still be running
            code = self._rt.cudaIpcCloseMemHandle(ctypes.c_void_p(ptr))
        if code != 0:
            log.warning("closing a CUDA IPC mapping failed: %s", self._error(code))


# ---- the registry and a request's lease ---------------------------------------------------------------

def _check_name(name) -> str:
    if not isinstance(name, str) or not name or len(name) > MAX_NAME:
        raise InvalidRequest(f"shared memory region name {name!r} must be a non-empty string of at most "
                             f"{MAX_NAME} characters")
    return name


class SharedMemoryRegistry:
    """The regions registered with one server, by name. Thread-safe: the frontends register and
    unregister on the event loop (or its executor), leases are released from batcher threads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._regions: dict[str, Region] = {}
        self._ipc: CudaIpc | None = None

    @staticmethod
    def cuda_available() -> bool:
        try:
            import torch
            return bool(torch.cuda.is_available())
        except Exception:  # a broken CUDA install: no CUDA shared memory, the rest still serves
            return False

    def _taken(self, name: str) -> None:
        region = self._regions.get(name)
        if region is not None:
            raise RegionExists(f"shared memory region '{name}' is already registered (as {KINDS[region.kind]}); "
                               f"unregister it first")

    def _add(self, region: Region) -> None:
        with self._lock:
            if region.name not in self._regions:
                self._regions[region.name] = region
                return
        region.retire()  # lost a race with another registration of the same name
        raise RegionExists(f"shared memory region '{region.name}' is already registered; unregister it first")

    def register_system(self, name: str, key: str, offset: int, byte_size: int) -> None:
        _check_name(name)
        offset = _uint(offset, f"region '{name}': offset")
        byte_size = _uint(byte_size, f"region '{name}': byte_size", minimum=1)
        with self._lock:
            self._taken(name)
        self._add(SystemRegion(name, key, offset, byte_size))

    def register_cuda(self, name: str, raw_handle: bytes, device_id: int, byte_size: int) -> None:
        _check_name(name)
        device_id = _uint(device_id, f"region '{name}': device_id")
        byte_size = _uint(byte_size, f"region '{name}': byte_size", minimum=1)
        if not isinstance(raw_handle, (bytes, bytearray)) or len(raw_handle) != CUDA_IPC_HANDLE_SIZE:
            size = len(raw_handle) if isinstance(raw_handle, (bytes, bytearray)) else type(raw_handle).__name__
            raise InvalidRequest(f"region '{name}': raw_handle must be a {CUDA_IPC_HANDLE_SIZE}-byte "
                                 f"cudaIpcMemHandle_t (got {size})")
        with self._lock:
            self._taken(name)
            if self._ipc is None:
                self._ipc = CudaIpc()
            ipc = self._ipc
        self._add(CudaRegion(name, bytes(raw_handle), device_id, byte_size, ipc))

    def status(self, kind: str, name: str | None = None) -> list[dict]:
        """Triton's status rows of every region of `kind`, or of the one named."""
        with self._lock:
            if name is None:
                return [r.status() for r in sorted(self._regions.values(), key=lambda r: r.name) if r.kind == kind]
            region = self._regions.get(name)
        if region is None:
            raise RegionNotFound(f"{KINDS[kind]} region '{name}' is not registered")
        if region.kind != kind:
            raise RegionNotFound(f"region '{name}' is registered as {KINDS[region.kind]}, not {KINDS[kind]}")
        return [region.status()]

    def unregister(self, kind: str, name: str | None = None) -> list[str]:
        """Unregister the region named (or every region of `kind`); returns the names removed.
        Triton answers success for a name that is not registered (clients unregister defensively
        before registering, and perf_analyzer unregisters everything at start): so does this."""
        with self._lock:
            names = [n for n, r in self._regions.items() if r.kind == kind and (name is None or n == name)]
            regions = [self._regions.pop(n) for n in names]
        for region in regions:
            region.retire()
        return names

    def close(self) -> None:
        for kind in KINDS:
            self.unregister(kind)

    def acquire(self, name: str, where: str) -> Region:
        with self._lock:
            region = self._regions.get(name)
            if region is not None and region.acquire():
                return region
        raise RegionNotFound(f"{where}: shared memory region '{name}' is not registered")

    def lease(self) -> Lease:
        return Lease(self)


def _check_fits(ref: ShmRef, nbytes: int, shape: tuple, dtype) -> None:
    """`dtype` (numpy) is named only for the error: numpy's dtype names are slow to make."""
    if nbytes > ref.byte_size:
        datatype = kserve_datatype(np.dtype(dtype).name)
        raise InvalidRequest(f"{ref.where}: {nbytes} bytes (shape {list(shape)} {datatype}) do not "
                             f"fit in shared_memory_byte_size {ref.byte_size} of region '{ref.region}'")


class Lease:
    """The regions one request uses, held until the request is done. Two holders release it: the
    request's own handler and, once the request is queued, its batcher future (which the batcher
    may still be working on after the handler gave up on a timeout)."""

    def __init__(self, registry: SharedMemoryRegistry) -> None:
        self._registry = registry
        self._regions: dict[str, Region] = {}
        self._lock = threading.Lock()
        self._holds = 1

    def _region(self, ref: ShmRef) -> Region:
        region = self._regions.get(ref.region)
        if region is None:
            region = self._registry.acquire(ref.region, ref.where)
            self._regions[ref.region] = region
        region.check_range(ref.offset, ref.byte_size, ref.where)
        return region

    def read(self, tensor: ShmInput):
        """The input's array: a numpy view (system) or a torch CUDA tensor view (CUDA)."""
        ref = tensor.ref
        expected = element_count(tensor.shape) * tensor.dtype.itemsize
        if ref.byte_size != expected:
            raise InvalidRequest(f"{ref.where}: shared_memory_byte_size {ref.byte_size} for shape "
                                 f"{list(tensor.shape)} {kserve_datatype(tensor.dtype.name)}; "
                                 f"expected {expected} bytes")
        return self._region(ref).read(ref.offset, tensor.shape, tensor.dtype)

    def check_output(self, ref: ShmRef) -> None:
        """Before the request runs: the region exists and the range is inside it."""
        self._region(ref)

    def write(self, ref: ShmRef, array: np.ndarray) -> int:
        """Write an output; returns the number of bytes written."""
        data = np.ascontiguousarray(array)
        data = data.astype(data.dtype.newbyteorder("<"), copy=False)
        _check_fits(ref, data.nbytes, data.shape, array.dtype)
        self._region(ref).write(ref.offset, data)
        return data.nbytes

    def write_output(self, ref: ShmRef, host: np.ndarray, device, copies: DeviceCopies) -> int:
        """Write an output from the batcher's worker, right after its batch: from `device` (the
        output's rows as a torch tensor, where the engine gave tensors) into a CUDA region, its copy
        queued in `copies` (see CudaRegion.write_tensor), else from `host`. Returns the bytes
        written (or queued)."""
        region = self._region(ref) if device is not None else None
        if region is None or region.kind != "cuda":
            return self.write(ref, host)  # which checks the range (and a system object's size) itself
        nbytes = device.numel() * device.element_size()
        _check_fits(ref, nbytes, device.shape, host.dtype)
        region.write_tensor(ref.offset, device, copies)
        return nbytes

    def hold(self) -> None:
        with self._lock:
            self._holds += 1

    def release(self) -> None:
        with self._lock:
            self._holds -= 1
            done = self._holds == 0
            regions, self._regions = (list(self._regions.values()), {}) if done else ([], self._regions)
        for region in regions:
            region.release()
