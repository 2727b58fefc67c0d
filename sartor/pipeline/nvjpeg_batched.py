"""nvJPEG's batched decode on a CUDA stream the caller chooses, through ctypes on the library torchvision
already loads.

`torchvision.io.decode_jpeg(device="cuda")` queues nvJPEG's work on a stream of its own, taken from
torch's pool of low-priority streams, and waits for it on the host, so the thread that prepares a
pipeline's batches stands still for every decode. Here the work goes to the stream given and nothing
waits on the host: the caller orders later work after it on that stream, or with an event, as for
any stream. (A high-priority stream was tried and changed nothing; decision 0062.)

Baseline JPEGs decode on the hardware JPEG engines (NVJPEG_BACKEND_HARDWARE, A100/H100/H200; on a
GPU without them, nvJPEG's default backend); output is interleaved RGB, H×W×3 uint8, one tensor a
frame. A batch nvJPEG cannot decode (a corrupt or progressive file on the hardware backend) raises
DataError for the whole batch: the caller decodes its items one at a time to find the bad one.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import glob
import importlib
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import ConfigError, DataError

NVJPEG_MAX_COMPONENT = 4
BACKEND_DEFAULT, BACKEND_HARDWARE = 0, 3
# nvjpegBackend_t by name: where a batch's Huffman decode and IDCT run (the host's CPU, the SMs, or
# the hardware JPEG engines of A100/H100/H200)
BACKENDS = {"default": BACKEND_DEFAULT, "hybrid": 1, "gpu_hybrid": 2, "hardware": BACKEND_HARDWARE}
OUTPUT_RGBI = 5  # interleaved RGB in channel[0]
STATUS_ARCH_MISMATCH = 7
STATUS_NAMES = {1: "not initialized", 2: "invalid parameter", 3: "bad JPEG", 4: "JPEG not supported",
                5: "allocator failure", 6: "execution failed", 7: "architecture mismatch", 8: "internal error",
                9: "implementation not supported", 10: "incomplete bitstream"}


class NvjpegImage(ctypes.Structure):
    """nvjpegImage_t: a pointer and a pitch per plane (pitch is size_t since CUDA 11)."""
    _fields_ = [("channel", ctypes.c_void_p * NVJPEG_MAX_COMPONENT),
                ("pitch", ctypes.c_size_t * NVJPEG_MAX_COMPONENT)]


def library_path() -> str:
    """The libnvjpeg torchvision's image ops link: the one in this process's memory once torchvision's
    extension is loaded, else one of the nvidia-* wheels' copies."""
    try:
        importlib.import_module("torchvision.io")  # loads its image extension and with it libnvjpeg
    except ImportError:
        pass
    try:
        for line in Path("/proc/self/maps").read_text().splitlines():
            if "libnvjpeg" in line:
                return line.split()[-1]
    except OSError:
        pass
    site = os.path.dirname(os.path.dirname(torch.__file__))
    patterns = (os.path.join(site, "nvidia", "**", "libnvjpeg.so*"),
                os.path.join(site, "torchvision.libs", "libnvjpeg*"))
    found = sorted(p for pattern in patterns for p in glob.glob(pattern, recursive=True))
    if found:
        return found[-1]
    system = ctypes.util.find_library("nvjpeg")
    if system is None:
        raise ConfigError("nvJPEG was not found: torchvision's CUDA build (or an nvidia-nvjpeg wheel) brings it")
    return system


def _buffer(item) -> tuple[int, int]:
    """(address, length) of an encoded image's bytes, without a copy."""
    if isinstance(item, torch.Tensor):
        if item.device.type != "cpu" or item.dtype != torch.uint8 or not item.is_contiguous():
            raise ConfigError("nvJPEG reads encoded images from contiguous uint8 CPU tensors or bytes")
        return item.data_ptr(), item.numel()
    return ctypes.cast(ctypes.c_char_p(item), ctypes.c_void_p).value, len(item)


def _status_text(code: int) -> str:
    return f"nvJPEG status {code} ({STATUS_NAMES.get(code, 'unknown')})"


@dataclass
class _State:
    """One nvJPEG decode state: its staging buffers hold a batch's bitstreams until its work has run."""
    handle: ctypes.c_void_p
    initialized_for: int = 0  # the batch size nvjpegDecodeBatchedInitialize was called with
    # nvJPEG stages a batch's bitstreams in the state's own host buffers: the next batch on this
    # state may not overwrite them before the last one's work has run (torchvision waits for its stream).
    last: tuple[torch.cuda.Event, list] | None = None


@dataclass
class DecodedJpegs:
    """A batch's frames, H×W×3 each; `batch`: the N×H×W×3 tensor they are views of, when they share a size."""
    frames: list[torch.Tensor]
    batch: torch.Tensor | None = None


class NvjpegBatched:
    """A batched nvJPEG decoder bound to one device. `decode(encoded, stream)` queues the decode of
    a batch of JPEGs on `stream` and returns their frames (H×W×3 uint8 on the device), valid once
    the stream's work up to that call is done; the host waits only for the decode `states` calls
    before, whose state (and staging buffers) this call takes over."""

    def __init__(self, device: torch.device | str = "cuda", library: str | None = None, states: int = 2,
                 backend: str | None = None):
        """`backend` (a name of BACKENDS): None takes the hardware JPEG engines where the GPU has
        them, else nvJPEG's default."""
        if backend is not None and backend not in BACKENDS:
            raise ConfigError(f"nvJPEG backend {backend!r} is not one of {', '.join(BACKENDS)}")
        self.device = torch.device(device)
        if self.device.type != "cuda":
            raise ConfigError(f"nvJPEG decodes on a CUDA device, not {self.device}")
        if states < 1:
            raise ConfigError(f"states {states} must be at least 1")
        path = library or library_path()
        self.lib = ctypes.CDLL(path)
        # The same library, its calls made holding Python's interpreter lock: reading a header takes
        # microseconds, less than handing the lock to another thread and waiting to get it back.
        self._lib_holding_lock = ctypes.PyDLL(path)
        # nvjpegGetImageInfo's outputs, made once: a decoder decodes one batch at a time, and a header
        # read is called for every JPEG of it
        self._info = (ctypes.byref(ctypes.c_int()), ctypes.byref(ctypes.c_int()),
                      (ctypes.c_int * NVJPEG_MAX_COMPONENT)(), (ctypes.c_int * NVJPEG_MAX_COMPONENT)())
        self.handle = ctypes.c_void_p()
        with torch.cuda.device(self.device):
            torch.zeros(1, device=self.device)  # the primary context current on this thread
            chosen = backend or "hardware"
            code = self.lib.nvjpegCreateEx(BACKENDS[chosen], None, None, 0, ctypes.byref(self.handle))
            if backend is None and code == STATUS_ARCH_MISMATCH:  # no JPEG engines on this GPU: the default
                chosen = "default"
                code = self.lib.nvjpegCreateEx(BACKEND_DEFAULT, None, None, 0, ctypes.byref(self.handle))
            self._check(code, f"nvjpegCreateEx ({chosen} backend)")
            self.hardware = chosen == "hardware"
            self._states = [_State(ctypes.c_void_p()) for _ in range(states)]
            for state in self._states:
                self._check(self.lib.nvjpegJpegStateCreate(self.handle, ctypes.byref(state.handle)),
                            "nvjpegJpegStateCreate")
        # Batches take the states in turn: a batch waits on the host only for the decode of the one
        # `states` batches before it, so with two the next batch is handed to nvJPEG while this one
        # decodes, rather than after it.
        self._turn = 0

    def _check(self, code: int, call: str) -> None:
        if code != 0:
            raise DataError(f"{call}: {_status_text(code)}")

    def image_size(self, address: int, length: int) -> tuple[int, int]:
        """(H, W) of the JPEG at `address` from its header; DataError when nvJPEG cannot read it."""
        components, subsampling, widths, heights = self._info
        self._check(self._lib_holding_lock.nvjpegGetImageInfo(
            self.handle, ctypes.c_void_p(address), ctypes.c_size_t(length), components, subsampling, widths,
            heights), "nvjpegGetImageInfo")
        return heights[0], widths[0]

    def decode(self, encoded: list, stream: torch.cuda.Stream) -> list[torch.Tensor]:
        """Frames H×W×3 uint8 RGB of `encoded` (bytes, or 1-D uint8 CPU tensors as torchvision's
        `read_file` gives), allocated on `stream` and written by work queued on it."""
        return self.decode_batch(encoded, stream).frames

    def decode_batch(self, encoded: list, stream: torch.cuda.Stream) -> DecodedJpegs:
        """`decode`'s frames, and when they all have one size, the N×H×W×3 tensor they are views
        of: a camera's batch is one allocation, and its readers take it whole rather than frame by
        frame."""
        if not encoded:
            return DecodedJpegs([])
        # bytes-like items become bytes here, kept alive with the batch (below) while nvJPEG reads them
        encoded = [item if isinstance(item, (bytes, torch.Tensor)) else bytes(item) for item in encoded]
        addresses, lengths = zip(*(_buffer(item) for item in encoded))
        sizes = [self.image_size(a, n) for a, n in zip(addresses, lengths)]
        state = self._states[self._turn]
        self._turn = (self._turn + 1) % len(self._states)
        if state.last is not None:
            state.last[0].synchronize()  # that state's last decode alone, not the stream's later work
        with torch.cuda.device(self.device), torch.cuda.stream(stream):
            batch = None
            if len(set(sizes)) == 1:
                batch = torch.empty((len(sizes), *sizes[0], 3), dtype=torch.uint8, device=self.device)
                frames = list(batch.unbind(0))
            else:
                frames = [torch.empty((h, w, 3), dtype=torch.uint8, device=self.device) for h, w in sizes]
            if state.initialized_for != len(encoded):
                self._check(self.lib.nvjpegDecodeBatchedInitialize(self.handle, state.handle, len(encoded), 1,
                                                                   OUTPUT_RGBI), "nvjpegDecodeBatchedInitialize")
                state.initialized_for = len(encoded)
            images = (NvjpegImage * len(encoded))()
            for image, frame, (_, w) in zip(images, frames, sizes):
                image.channel[0], image.pitch[0] = frame.data_ptr(), w * 3
            data = (ctypes.c_void_p * len(encoded))(*addresses)
            lengths = (ctypes.c_size_t * len(encoded))(*lengths)
            code = self.lib.nvjpegDecodeBatched(self.handle, state.handle, data, lengths, images,
                                                ctypes.c_void_p(stream.cuda_stream))
            if code != 0:
                state.initialized_for = 0  # a failed batch leaves the state to be initialised again
                self._check(code, "nvjpegDecodeBatched")
            done = torch.cuda.Event()
            done.record(stream)
        state.last = (done, [data, lengths, images, encoded])
        return DecodedJpegs(frames, batch)
