"""Triton compile requests: recorded in the builder's process without compiling or launching, and
compiled from their record in another process into the same on-disk cache.

Recording uses Triton's public `knobs.runtime.jit_cache_hook`: the JIT calls it where it would
compile a kernel it has not compiled in this process, and a hook that returns True makes it skip
both the compile and the launch (Triton 3.6 and 3.8 alike). The hook receives the JIT function,
the argument signature with its specialisation attributes, the constexprs and the options, which
is all `triton.compile` needs. A request names its function by module and qualified name, so that
a process importing sartor's kernel modules finds the same function, hashed the same way
(docs/decisions/0027-settled-triton-cache-keys.md), and compiles it under the key the builder's
JIT then looks up.
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib
import json
import pickle
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator


class RecordingUnavailable(Exception):
    """This Triton (or this process's use of it) does not allow recording (the reason is the message)."""


@dataclass(frozen=True)
class JitReference:
    """A Triton function passed as a constexpr, by name: the function itself does not cross processes."""
    module: str
    qualname: str


@dataclass(frozen=True)
class CompileRequest:
    """One kernel compile the JIT asked for: everything `triton.compile` takes, in plain values."""
    module: str
    qualname: str
    signature: dict
    constexprs: dict
    attrs: dict
    options: dict
    target: tuple  # GPUTarget's (backend, arch, warp_size)
    jit_key: str  # the JIT's own key of this specialisation (arguments' types, values, options)

    @property
    def ident(self) -> str:
        return f"{self.module}:{self.qualname}:{self.jit_key}"


@dataclass
class Recorder:
    """Runs candidates with Triton's compiles recorded instead of performed; `requests` (by ident,
    first recording first) and, for each, the tactic that asked for it first."""
    requests: dict[str, CompileRequest] = field(default_factory=dict)
    tactic_of: dict[str, str] = field(default_factory=dict)
    unrecorded: int = 0  # compiles whose request could not be written down (they compile when timed)
    failed_runs: int = 0  # candidate runs that raised (the timing run says why)

    def run(self, tactic: str, fn: Callable[[], object]) -> None:
        """Run `fn` (one candidate) once with every compile it needs recorded under `tactic`. Its
        Triton kernels do not launch: what they would write stays unwritten, which arithmetic after
        them tolerates (the caller runs only such candidates). The candidate's exceptions are
        counted, not raised; RecordingUnavailable is raised."""
        def hook(*, fn: object, compile: dict, **_: object) -> bool:
            self._add(tactic, fn, compile)
            return True
        with _jit_cache_hook(hook):
            try:
                fn()
            except Exception:  # noqa: BLE001 - a candidate that cannot run here is the timing run's to report
                self.failed_runs += 1

    def _add(self, tactic: str, info: object, compile: dict) -> None:
        try:
            request = request_from_hook(info, compile)
            pickle.dumps(request)  # it must reach a worker (compile_worker.py's frames)
        except Exception:  # noqa: BLE001 - left to compile in the builder's process when timed
            self.unrecorded += 1
            return
        if request.ident not in self.requests:
            self.requests[request.ident] = request
            self.tactic_of[request.ident] = tactic


@contextlib.contextmanager
def _jit_cache_hook(hook) -> Iterator[None]:
    from triton import knobs
    runtime = getattr(knobs, "runtime", None)
    if runtime is None or not hasattr(runtime, "jit_cache_hook"):
        raise RecordingUnavailable("this Triton has no jit_cache_hook")
    previous = runtime.jit_cache_hook
    if previous is not None:
        raise RecordingUnavailable("another jit_cache_hook is installed")
    runtime.jit_cache_hook = hook
    try:
        yield
    finally:
        runtime.jit_cache_hook = previous


def check_recording_available() -> None:
    """Raise RecordingUnavailable unless this process can record compiles."""
    with _jit_cache_hook(lambda **_: True):
        pass


def _as_tuples(value):
    """JSON's lists back into the tuples they were (Triton's options hold tuples, never lists)."""
    return tuple(_as_tuples(v) for v in value) if isinstance(value, list) else value


def _encode_constant(value):
    from triton.runtime.jit import JITFunction
    if isinstance(value, JITFunction):
        return JitReference(value.fn.__module__, value.fn.__qualname__)
    if isinstance(value, tuple):
        return tuple(_encode_constant(v) for v in value)
    return value


def request_from_hook(info, compile: dict) -> CompileRequest:
    """The request for what the JIT hook was called with (`fn` a JitFunctionInfo, `compile` its
    dict). The options come from the specialisation data's JSON, the one place the hook gets them
    all; the target from the JIT function's table for this device."""
    jit_function = info.jit_function
    options = {k: _as_tuples(v) for k, v in json.loads(compile["specialization_data"])["options"].items()}
    target = jit_function.device_caches[compile["device"]][2]
    return CompileRequest(
        module=jit_function.fn.__module__, qualname=jit_function.fn.__qualname__,
        signature=dict(compile["signature"]),
        constexprs={path: _encode_constant(v) for path, v in compile["constants"].items()},
        attrs=dict(compile["configs"][0]), options=options,
        target=(target.backend, target.arch, target.warp_size), jit_key=str(compile["key"]))


# ---- compiling a request (in any process) -----------------------------------------------------

def resolve_function(module: str, qualname: str):
    """The Triton JIT function `module`.`qualname` (unwrapping Autotuner and Heuristics)."""
    from triton.runtime.jit import JITFunction
    value = importlib.import_module(module)
    for part in qualname.split("."):
        value = getattr(value, part)
    for _ in range(4):
        if isinstance(value, JITFunction):
            return value
        value = getattr(value, "fn", None)
    raise TypeError(f"{module}.{qualname} is not a Triton JIT function")


def _decode_constant(value):
    if isinstance(value, JitReference):
        return resolve_function(value.module, value.qualname)
    if isinstance(value, tuple):
        return tuple(_decode_constant(v) for v in value)
    return value


def _source_and_target(request: CompileRequest):
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    fn = resolve_function(request.module, request.qualname)
    constexprs = {path: _decode_constant(v) for path, v in request.constexprs.items()}
    return ASTSource(fn, dict(request.signature), constexprs, dict(request.attrs)), GPUTarget(*request.target)


@functools.lru_cache(maxsize=None)
def _backend(target: tuple):
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    return make_backend(GPUTarget(*target))


def expected_hash(request: CompileRequest) -> str:
    """The hash `triton.compile` gives this request here (its cache entry's name, before base32):
    Triton's own key of source, backend, options and environment."""
    from triton._C.libtriton import get_cache_invalidating_env_vars
    from triton.compiler import get_cache_key
    src, _ = _source_and_target(request)
    backend = _backend(request.target)
    options = backend.parse_options(dict(request.options))
    key = get_cache_key(src, backend, options, get_cache_invalidating_env_vars())
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


def cache_state(request: CompileRequest) -> tuple[str, bool]:
    """(the hash this process's JIT looks the request up by, whether Triton's cache holds it)."""
    from triton.runtime.cache import get_cache_manager
    kernel_hash = expected_hash(request)
    name = request.qualname.rsplit(".", 1)[-1][:150]  # triton.compile's file stem: the function's name, cut
    return kernel_hash, get_cache_manager(kernel_hash).get_group(f"{name}.json") is not None


def compile_request(request: CompileRequest) -> tuple[str, float]:
    """Compile the request into this process's Triton cache; (its hash, seconds)."""
    import triton
    started = time.perf_counter()
    src, target = _source_and_target(request)
    kernel = triton.compile(src, target=target, options=dict(request.options))
    _build_launcher(kernel)
    return kernel.hash, time.perf_counter() - started


def _build_launcher(kernel) -> None:
    """Triton 3.6 compiles a host launcher module per kernel signature with the C compiler on the
    kernel's first launch, cached beside the kernels: built here, it is a cache hit there too.
    Later Triton launches natively (no `make_launcher`); nothing to do then."""
    from ..runtime.launchers import nvidia_driver, per_signature_launchers
    try:
        driver = nvidia_driver()
        if driver is not None and per_signature_launchers(driver) and kernel.metadata.target.backend == "cuda":
            driver.CudaLauncher(kernel.src, kernel.metadata)
    except Exception:  # noqa: BLE001 - only a head start: the first launch builds it otherwise
        pass
