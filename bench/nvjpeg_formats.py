"""Does nvJPEG's hardware decode keep its rate beside the engine when nothing of it runs on the SMs
(issue 30)? One device call.

Beside the engine replayed back to back, the Pipeline's decoders fall to about a quarter of their
rate alone (bench/joint_ceiling.py), though the hardware JPEG engines are not the SMs the engine
runs on. nvJPEG's output format decides what runs after the hardware: interleaved RGB (the
Pipeline's) needs a colour conversion on the SMs; planar YUV is what the hardware writes. Per format
(`--formats`): the decode alone on two threads with a decoder each, and beside the engine.

    PYTHONPATH=. python bench/nvjpeg_formats.py ENGINE.plan --images DIR [--formats rgbi,rgb,yuv,y]
"""
from __future__ import annotations

import argparse
import ctypes
import sys
import threading
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import sartor  # noqa: E402
from sartor.pipeline.benchmark import bench_pipeline, image_files  # noqa: E402
from sartor.pipeline.nvjpeg_batched import NVJPEG_MAX_COMPONENT, NvjpegBatched, NvjpegImage, _buffer  # noqa: E402
from sartor.pipeline.prepare import input_tensor  # noqa: E402

FORMATS = {"y": 2, "yuv": 1, "rgb": 3, "rgbi": 5}
DEV_MALLOC = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t)
DEV_FREE = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p)
PIN_MALLOC = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t, ctypes.c_uint)
PIN_FREE = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p)


class DevAllocator(ctypes.Structure):
    _fields_ = [("dev_malloc", DEV_MALLOC), ("dev_free", DEV_FREE)]


class PinnedAllocator(ctypes.Structure):
    _fields_ = [("pinned_malloc", PIN_MALLOC), ("pinned_free", PIN_FREE)]


def cudart() -> ctypes.CDLL:
    torch.zeros(1, device="cuda")
    mapped = [line.split()[-1] for line in Path("/proc/self/maps").read_text().splitlines() if "libcudart" in line]
    site = Path(torch.__file__).resolve().parents[1]
    return ctypes.CDLL(mapped[0] if mapped else sorted(site.glob("nvidia/**/libcudart.so*"))[-1])


class Allocators:
    """nvJPEG's device and pinned allocators as Python callbacks over cudart: "counting" counts the
    calls (cudaFree and cudaFreeHost wait for the whole device); "pool" keeps what nvJPEG frees and
    hands it out again for the same size once the decoder's stream has passed the free."""

    def __init__(self, how: str, stream: torch.cuda.Stream) -> None:
        self.rt, self.how, self.stream = cudart(), how, stream
        self.counts = {"dev_malloc": 0, "dev_free": 0, "pinned_malloc": 0, "pinned_free": 0}
        self.sizes: dict[int, int] = {}
        self.pools: dict[tuple[str, int], list] = {}
        self.dev = DevAllocator(DEV_MALLOC(self._dev_malloc), DEV_FREE(self._dev_free))
        self.pinned = PinnedAllocator(PIN_MALLOC(self._pinned_malloc), PIN_FREE(self._pinned_free))

    def _reuse(self, kind: str, size: int):
        pool = self.pools.get((kind, size))
        if pool and pool[0][1].query():
            return pool.pop(0)[0]
        return None

    def _keep(self, kind: str, address: int) -> bool:
        if self.how != "pool":
            return False
        event = torch.cuda.Event()
        event.record(self.stream)
        self.pools.setdefault((kind, self.sizes[address]), []).append((address, event))
        return True

    def _malloc(self, kind: str, ptr, size: int, allocate) -> int:
        """A pooled buffer of `size` once its last free has passed, else `allocate(out pointer)`'s."""
        self.counts[f"{kind}_malloc"] += 1
        address = self._reuse(kind, size) if self.how == "pool" else None
        if address is None:
            out = ctypes.c_void_p()
            code = allocate(ctypes.byref(out))
            if code:
                return code
            address = out.value
        self.sizes[address] = size
        ptr[0] = address
        return 0

    def _free(self, kind: str, address: int, release) -> int:
        self.counts[f"{kind}_free"] += 1
        return 0 if self._keep(kind, address) else release(ctypes.c_void_p(address))

    def _dev_malloc(self, ptr, size):
        return self._malloc("dev", ptr, size, lambda out: self.rt.cudaMalloc(out, ctypes.c_size_t(size)))

    def _dev_free(self, address):
        return self._free("dev", address, self.rt.cudaFree)

    def _pinned_malloc(self, ptr, size, flags):
        return self._malloc("pinned", ptr, size,
                            lambda out: self.rt.cudaHostAlloc(out, ctypes.c_size_t(size), ctypes.c_uint(flags)))

    def _pinned_free(self, address):
        return self._free("pinned", address, self.rt.cudaFreeHost)


class FormatDecoder:
    """A batched nvJPEG decoder (the Pipeline's binding's handle and states) writing `fmt`."""

    def __init__(self, device: torch.device, fmt: str, encoded: list, allocators: str = "default") -> None:
        self.binding = NvjpegBatched(device, states=2)
        self.stream = torch.cuda.Stream(device)
        self.allocators = None
        if allocators != "default":  # the binding's handle and states again, made with these allocators
            self.allocators = Allocators(allocators, self.stream)
            lib = self.binding.lib
            handle = ctypes.c_void_p()
            code = lib.nvjpegCreateEx(3, ctypes.byref(self.allocators.dev), ctypes.byref(self.allocators.pinned), 0,
                                      ctypes.byref(handle))
            assert code == 0, f"nvjpegCreateEx with allocators: {code}"
            self.binding.handle = handle
            for state in self.binding._states:
                state.handle = ctypes.c_void_p()
                assert lib.nvjpegJpegStateCreate(handle, ctypes.byref(state.handle)) == 0
        self.fmt, self.device, self.encoded = fmt, device, encoded
        lib, handle = self.binding.lib, self.binding.handle
        self.planes = []  # per image: [(h, w, bytes per row)] of each plane written
        for item in encoded:
            address, length = _buffer(item)
            components, subsampling = ctypes.c_int(), ctypes.c_int()
            widths, heights = (ctypes.c_int * NVJPEG_MAX_COMPONENT)(), (ctypes.c_int * NVJPEG_MAX_COMPONENT)()
            lib.nvjpegGetImageInfo(handle, ctypes.c_void_p(address), ctypes.c_size_t(length), ctypes.byref(components),
                                   ctypes.byref(subsampling), widths, heights)
            h, w = heights[0], widths[0]
            if fmt == "rgbi":
                self.planes.append([(h, w * 3)])
            elif fmt == "rgb":
                self.planes.append([(h, w)] * 3)
            elif fmt == "y":
                self.planes.append([(h, w)])
            else:
                self.planes.append([(heights[c], widths[c]) for c in range(components.value)])
        self.subsampling = subsampling.value
        self.initialized = [False, False]
        self.turn = 0
        self.last: list = [None, None]

    def decode(self) -> torch.cuda.Event:
        lib, handle = self.binding.lib, self.binding.handle
        state = self.binding._states[self.turn]
        turn, self.turn = self.turn, 1 - self.turn
        if self.last[turn] is not None:
            self.last[turn][0].synchronize()
        with torch.cuda.stream(self.stream):
            if not self.initialized[turn]:
                code = lib.nvjpegDecodeBatchedInitialize(handle, state.handle, len(self.encoded), 1,
                                                         FORMATS[self.fmt])
                assert code == 0, f"initialize {self.fmt}: {code}"
                self.initialized[turn] = True
            images = (NvjpegImage * len(self.encoded))()
            kept = []
            for image, planes in zip(images, self.planes):
                for c, (h, w) in enumerate(planes):
                    plane = torch.empty((h, w), dtype=torch.uint8, device=self.device)
                    kept.append(plane)
                    image.channel[c], image.pitch[c] = plane.data_ptr(), w
            addresses, lengths = zip(*(_buffer(item) for item in self.encoded))
            data = (ctypes.c_void_p * len(self.encoded))(*addresses)
            sizes = (ctypes.c_size_t * len(self.encoded))(*lengths)
            code = lib.nvjpegDecodeBatched(handle, state.handle, data, sizes, images,
                                           ctypes.c_void_p(self.stream.cuda_stream))
            assert code == 0, f"decode {self.fmt}: {code}"
            done = torch.cuda.Event()
            done.record(self.stream)
        self.last[turn] = (done, [images, data, sizes, kept])
        return done


def decode_rate(decoders: list[FormatDecoder], batches: int, stop: threading.Event | None = None) -> float:
    counts = [0] * len(decoders)

    def loop(k: int) -> None:
        for _ in range(batches):
            if stop is not None and stop.is_set():
                break
            decoders[k].decode()
            counts[k] += 1
        decoders[k].stream.synchronize()
    threads = [threading.Thread(target=loop, args=(k,)) for k in range(len(decoders))]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(counts) * len(decoders[0].encoded) / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("engine")
    parser.add_argument("--images", required=True)
    parser.add_argument("--formats", default="rgbi,rgb,yuv,y")
    parser.add_argument("--allocators", default="default", help="default, counting, pool (comma-separated)")
    parser.add_argument("--depths", default="8", help="engine runs queued before the host waits (comma-separated)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    engine = sartor.load(args.engine)
    pipeline = bench_pipeline(engine, None, "auto")[0]
    device, batch = pipeline.device, pipeline.batch_size
    encoded = [f.read_bytes() for f in image_files(args.images)[:batch]]
    context = engine.context(pipeline.bucket_profile(0)[1])
    feed = input_tensor(pipeline.spec, batch, device).fill_(0.5)
    context.run({pipeline.input_name: feed})
    torch.cuda.synchronize()
    decoders = {}
    for fmt in args.formats.split(","):
        for how in args.allocators.split(","):
            label = f"{fmt}/{how}"
            try:
                decoders[label] = [FormatDecoder(device, fmt, encoded, how) for _ in range(args.threads)]
                decode_rate(decoders[label], 3)
            except AssertionError as exc:
                print(f"{label}: {exc}", flush=True)
                decoders.pop(label, None)
    print(f"{torch.cuda.get_device_name()}, batch {batch}, subsampling {decoders[next(iter(decoders))][0].subsampling}"
          if decoders else "no format decoded", flush=True)
    stream = torch.cuda.current_stream()
    for r in range(1, args.rounds + 1):
        for label, group in decoders.items():
            counted = [d.allocators for d in group if d.allocators is not None]
            before = [dict(a.counts) for a in counted]
            alone = decode_rate(group, 60)
            calls = {k: sum(a.counts[k] - b[k] for a, b in zip(counted, before)) / (60 * len(group))
                     for k in (counted[0].counts if counted else {})}
            for depth in (int(d) for d in args.depths.split(",")):
                stop, beside = threading.Event(), {}
                thread = threading.Thread(target=lambda: beside.setdefault("fps", decode_rate(group, 10 ** 6, stop)))
                thread.start()
                start, runs = time.perf_counter(), 0
                while time.perf_counter() - start < 2.0:
                    context.run({pipeline.input_name: feed})
                    runs += 1
                    if runs % depth == 0:
                        stream.synchronize()
                stream.synchronize()
                engine_fps = runs * batch / (time.perf_counter() - start)
                stop.set()
                thread.join()
                print(f"round {r} {label}, engine queue {depth}: decode alone {alone:,.0f}, beside the engine "
                      f"{beside['fps']:,.0f} ({beside['fps'] / alone:.2f}); engine beside {engine_fps:,.0f}"
                      + (f"; allocator calls per batch {calls}" if calls else ""), flush=True)


if __name__ == "__main__":
    main()
