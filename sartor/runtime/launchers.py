"""Triton's host modules for an engine's kernels, built at load on a thread pool rather than one
after another at the first inference.

Triton launches a compiled kernel through host code that it compiles with the C compiler and keeps
in its own cache: the `cuda_utils` module (once per machine and Triton) and, in Triton 3.6 and
earlier, one launcher module per kernel signature, whose C source `make_launcher` generates from
the kernel's argument types (and tensor-descriptor metadata) and whose cache key is a hash of that
source. An engine carries no host code (decisions 0008, 0021), so on a fresh machine the first
inference waited for every one of those builds in turn, even with every kernel found in the engine.

At load, for the kernels an engine installed from a trusted file, this module asks Triton's own
classes (`CudaUtils`, `CudaLauncher`) for the same modules its first launches would ask for: same
source, same key, same cache. The compiler runs as a subprocess, so threads build in parallel;
kernels whose launchers Triton generates as one source (pointers of any element type are one C
type) share one module, built once. Anything missing or failing (another Triton's API, no C
compiler, no libcuda) is logged at debug and left to Triton's lazy build, as before. See
docs/decisions/0041-host-modules-built-at-load.md.
"""
from __future__ import annotations

import concurrent.futures
import hashlib
import importlib
import inspect
import json
import logging
import math
import os
import re
import sysconfig
import tempfile
import time
from collections import namedtuple
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger("sartor.runtime")

# Set (to anything but "0") to leave Triton's host modules to its first launches, one at a time.
NO_BUILD_ENV = "SARTOR_NO_LAUNCHER_BUILD"
# Bounds on what an engine header may ask the C compiler to build from (its signatures).
MAX_ARGUMENTS = 512
MAX_TUPLE_DEPTH = 4
_TYPE = re.compile(r"\*?k?[a-z][a-z0-9]{0,15}")  # "constexpr", "i32", "fp32", "*fp16", "*ki8"
# A host tensor descriptor's block: "tensordesc<i8[1, 8, 16, 64]>".
_TENSORDESC = re.compile(r"tensordesc<[a-z][a-z0-9]{0,15}\[\d{1,6}(, \d{1,6}){0,7}\]>")
MAX_WORKERS = 32
# The module name Triton 3.6's CudaLauncher compiles every launcher under (its cache file's stem).
LAUNCHER_MODULE = "__triton_launcher"
# How long load waits for the builds; past it the first launches build (or wait for) what is left.
WAIT_SECONDS = 120.0


def record_signature(types) -> list | None:
    """A kernel's argument types (Triton's `ASTSource.signature` values, in order) as the engine
    header stores them: a list, tuples as lists (the header is JSON with sorted keys, so a dict by
    argument name would lose the order). None when `types` is not a signature."""
    def plain(value):
        return [plain(v) for v in value] if isinstance(value, (tuple, list)) else value
    try:
        return [plain(v) for v in types]
    except TypeError:
        return None


def parse_signature(value) -> tuple | None:
    """The argument types a header records for a kernel, as Triton's launcher takes them (tuples for
    tuple arguments); None unless every type is one Triton names (the header comes from the file)."""
    count = 0

    def parse(item, depth: int):
        nonlocal count
        if isinstance(item, list) and depth < MAX_TUPLE_DEPTH:
            return tuple(parse(v, depth + 1) for v in item)
        count += 1
        named = isinstance(item, str) and (_TYPE.fullmatch(item) or _TENSORDESC.fullmatch(item))
        if count > MAX_ARGUMENTS or not named:
            raise ValueError(item)
        return item
    if not isinstance(value, list):
        return None
    try:
        return parse(value, 0)
    except ValueError:
        return None


def _flat(signature) -> list[str]:
    return [t for item in signature for t in (_flat(item) if isinstance(item, tuple) else [item])]


def _kernel_metadata(raw: bytes):
    """A kernel's metadata as Triton's CompiledKernel gives it to the launcher: a namedtuple of the
    JSON's fields, its target a GPUTarget."""
    metadata = json.loads(raw)
    target = metadata.get("target")
    if isinstance(target, dict):
        from triton.backends.compiler import GPUTarget
        metadata["target"] = GPUTarget(target["backend"], target["arch"], target["warp_size"])
    return namedtuple("KernelMetadata", sorted(metadata))(**metadata)


@dataclass(frozen=True)
class LaunchSource:
    """What Triton's CudaLauncher reads of a kernel's ASTSource: the argument types by name, and the
    constants (they shape nothing in the launcher's source, so there are none)."""
    signature: dict
    constants: dict = field(default_factory=dict)


@dataclass
class LauncherJob:
    """One launcher module: the argument types and tensor-descriptor metadata it is generated from,
    and the kernels that share it."""
    signature: tuple
    metadata: object  # one of those kernels' metadata (namedtuple): the launcher reads its scratch sizes
    kernels: list = field(default_factory=list)
    tensordesc: bool = False  # whether one of those kernels takes a tensor descriptor
    c_source: str | None = None  # Triton's C source for it, where this Triton's make_launcher gives it

    def __post_init__(self) -> None:
        self.tensordesc = self.tensordesc or any(t.startswith("tensordesc") for t in _flat(self.signature))

    @property
    def source(self) -> LaunchSource:
        return LaunchSource({f"arg{i}": t for i, t in enumerate(self.signature)})


def launcher_jobs(entries) -> tuple[list[LauncherJob], list[str]]:
    """The distinct launchers the entries' kernels need (make_launcher's source depends on the
    argument types and the tensor-descriptor metadata only, so kernels equal in both share one),
    and a line per entry left to the lazy build (no signature recorded, or unreadable metadata)."""
    jobs: dict[tuple, LauncherJob] = {}
    skipped = []
    for entry in entries:
        if entry.signature is None:
            skipped.append(f"{entry.name}: the engine records no launcher signature for it")
            continue
        try:
            metadata = _kernel_metadata(entry.files[entry.metadata_file])
            same = (entry.signature, json.dumps(getattr(metadata, "tensordesc_meta", None), sort_keys=True))
        except (ValueError, TypeError, KeyError, AttributeError) as exc:
            skipped.append(f"{entry.name}: its metadata cannot be read ({type(exc).__name__}: {exc})")
            continue
        jobs.setdefault(same, LauncherJob(entry.signature, metadata)).kernels.append(entry.name)
    return list(jobs.values()), skipped


def launcher_source(driver, job: LauncherJob) -> str | None:
    """Triton's C source of the job's launcher, from make_launcher called as CudaLauncher calls it;
    None where this make_launcher takes other arguments or fails (then nothing is merged or
    compiled ahead for it)."""
    given = {"constants": {}, "signature": dict(job.source.signature),
             "tensordesc_meta": getattr(job.metadata, "tensordesc_meta", None)}
    try:
        accepted = inspect.signature(driver.make_launcher).parameters
        if not set(accepted) <= set(given):
            return None
        source = driver.make_launcher(**{name: value for name, value in given.items() if name in accepted})
    except Exception as exc:  # noqa: BLE001 - Triton's generator refusing a signature: its first launch will too
        log.debug("host modules: no launcher source for %s (%s: %s)", job.kernels, type(exc).__name__, exc)
        return None
    return source if isinstance(source, str) else None


def merge_same_source(driver, jobs: list[LauncherJob]) -> list[LauncherJob]:
    """One job per launcher module: jobs whose C source is the same (its hash is the module's cache
    key) are merged; a job without a source stays on its own."""
    merged: dict = {}
    for job in jobs:
        job.c_source = launcher_source(driver, job)
        first = merged.setdefault(job.c_source if job.c_source is not None else id(job), job)
        if first is not job:
            first.kernels += job.kernels
            first.tensordesc = first.tensordesc or job.tensordesc
    return list(merged.values())


def build_refusal() -> str:
    """Why host modules are left to Triton's first launches here ("" when they are built at load)."""
    if os.environ.get(NO_BUILD_ENV, "") not in ("", "0"):
        return f"{NO_BUILD_ENV}={os.environ[NO_BUILD_ENV]}"
    if os.environ.get("TRITON_INTERPRET", "") not in ("", "0"):
        return "TRITON_INTERPRET is set: the interpreter launches nothing"
    return ""


def nvidia_driver():
    """Triton's NVIDIA driver module when it has what this module calls (CudaUtils, and CudaLauncher
    where launchers are built per signature), else None."""
    try:
        module = importlib.import_module("triton.backends.nvidia.driver")
    except Exception as exc:  # noqa: BLE001 - any import failure means: leave it to Triton
        log.debug("host modules: Triton's NVIDIA driver cannot be imported (%s: %s)", type(exc).__name__, exc)
        return None
    if not callable(getattr(module, "CudaUtils", None)):
        log.debug("host modules: this Triton's NVIDIA driver has no CudaUtils: left to its first launch")
        return None
    return module


def per_signature_launchers(driver) -> bool:
    """Whether this Triton compiles a launcher module per kernel signature (3.6 and earlier:
    `make_launcher` generates its C source); later ones launch every kernel through cuda_utils."""
    return callable(getattr(driver, "make_launcher", None)) and callable(getattr(driver, "CudaLauncher", None))


@dataclass
class HostModuleReport:
    per_signature: bool = True  # whether this Triton builds a launcher module per kernel signature
    launchers: int = 0  # distinct launcher modules the engine's kernels need (0 where Triton has none)
    kernels: int = 0  # kernels they serve
    ready: int = 0  # modules built or found in Triton's cache (cuda_utils counted)
    failed: list = field(default_factory=list)  # one line per module left to the lazy build
    skipped: list = field(default_factory=list)  # one line per kernel without a launcher to build
    pending: int = 0  # modules still building when load stopped waiting
    seconds: float = 0.0

    def describe(self) -> str:
        modules = (f"cuda_utils and {self.launchers} launcher(s) for {self.kernels} kernel(s)" if self.per_signature
                   else "cuda_utils: this Triton has no per-signature launchers")
        return (f"{self.ready} of {self.launchers + 1} Triton host module(s) ready ({modules}) in {self.seconds:.2f} s"
                + (f", {len(self.failed)} left to the first launch" if self.failed else "")
                + (f", {self.pending} still building" if self.pending else "")
                + (f", {len(self.skipped)} kernel(s) without a recorded signature" if self.skipped else ""))


def _build_cuda_utils(driver) -> None:
    driver.CudaUtils()  # a singleton whose __init__ compiles (or loads from the cache) the module


def compile_without_loading(driver, job: LauncherJob) -> None:
    """Put the job's launcher module into Triton's cache as Triton 3.6's compile_module_from_src
    does (its key: SHA-256 of the source and platform_key; its file: the module name and Python's
    extension suffix), without loading it. Where that differs in another Triton, CudaLauncher,
    called next, finds no file and compiles the module itself."""
    from triton.runtime import build
    from triton.runtime.cache import get_cache_manager
    key = hashlib.sha256((job.c_source + build.platform_key()).encode("utf-8")).hexdigest()
    cache = get_cache_manager(key)
    file_name = LAUNCHER_MODULE + sysconfig.get_config_var("EXT_SUFFIX")
    if cache.get_file(file_name) is not None:
        return
    with tempfile.TemporaryDirectory() as directory:
        source = Path(directory) / f"{LAUNCHER_MODULE}.c"
        source.write_text(job.c_source)
        built = build._build(LAUNCHER_MODULE, str(source), directory, driver.library_dirs(), driver.include_dirs,
                             driver.libraries, [])
        cache.put(Path(built).read_bytes(), file_name, binary=True)


def _build_launcher(driver, job: LauncherJob, utils: concurrent.futures.Future | None) -> None:
    if utils is not None:
        # A launcher module keeps the PyCUtensorMap type that cuda_utils defines as it finds it when
        # first loaded (a later load of the same file reuses it), so one taking tensor descriptors
        # is loaded only after cuda_utils; it compiles meanwhile.
        if job.c_source is not None:
            try:
                compile_without_loading(driver, job)
            except Exception as exc:  # noqa: BLE001 - CudaLauncher below compiles it then
                log.debug("host modules: %s not compiled ahead (%s: %s)", job.kernels, type(exc).__name__, exc)
        utils.result()
    driver.CudaLauncher(job.source, job.metadata)


class HostBuilds:
    """The builds started at load: `wait` collects them into a HostModuleReport."""

    def __init__(self, futures: dict, report: HostModuleReport, started: float) -> None:
        self.futures = futures  # future -> what it builds
        self.report = report
        self.started = started

    def wait(self, timeout: float = WAIT_SECONDS) -> HostModuleReport:
        done, pending = concurrent.futures.wait(self.futures, timeout=timeout)
        report = self.report
        for future in done:
            exc = future.exception()
            if exc is None:
                report.ready += 1
            else:
                report.failed.append(f"{self.futures[future]}: {type(exc).__name__}: {exc}")
        report.pending = len(pending)
        report.seconds = time.perf_counter() - self.started
        for line in report.failed + report.skipped:
            log.debug("host modules: %s (Triton builds it at first launch)", line)
        log.info("host modules: %s", report.describe())
        return report


CGROUP_CPU_MAX = "/sys/fs/cgroup/cpu.max"


def usable_cpus(cgroup_cpu_max: str = CGROUP_CPU_MAX) -> int:
    """The CPUs this process may run on: its affinity (else the machine's count), and no more than a
    cgroup v2 CPU quota allows. In a container `os.cpu_count()` is the host's count, and a pool
    sized by it runs many more threads than the container has cores."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    try:
        with open(cgroup_cpu_max) as f:
            quota, period = f.read().split()[:2]
        if quota != "max":
            cpus = min(cpus, max(1, math.ceil(int(quota) / int(period))))
    except (OSError, ValueError):
        pass  # no cgroup v2 quota here: the affinity is the limit
    return cpus


def _workers(jobs: int) -> int:
    return max(1, min(jobs, usable_cpus(), MAX_WORKERS))


def start_host_builds(entries) -> HostBuilds | None:
    """Start building Triton's host modules for `entries` (the kernel entries an engine installed,
    kernel_store.KernelEntry) on a thread pool; None when there is nothing to build or this Triton
    or environment does not allow it (said at debug). Never raises: a failure leaves the modules to
    Triton's first launches."""
    if not entries:
        return None
    why_not = build_refusal()
    if why_not:
        log.debug("host modules: left to Triton's first launches (%s)", why_not)
        return None
    try:
        return _start(entries)
    except Exception as exc:  # noqa: BLE001 - never a reason for a load to fail
        log.debug("host modules: not built at load (%s: %s)", type(exc).__name__, exc)
        return None


def _start(entries) -> HostBuilds | None:
    driver = nvidia_driver()
    if driver is None:
        return None
    per_signature = per_signature_launchers(driver)
    jobs, skipped = launcher_jobs(entries) if per_signature else ([], [])
    jobs = merge_same_source(driver, jobs)
    report = HostModuleReport(per_signature, len(jobs), sum(len(j.kernels) for j in jobs), skipped=skipped)
    started = time.perf_counter()
    pool = concurrent.futures.ThreadPoolExecutor(_workers(len(jobs) + 1), thread_name_prefix="sartor-host-build")
    try:
        # Submitted first, so a worker runs it before any launcher job can wait for it.
        utils = pool.submit(_build_cuda_utils, driver)
        futures = {utils: "cuda_utils"}
        for job in jobs:
            after = utils if job.tensordesc else None
            label = f"launcher of {', '.join(sorted(set(job.kernels)))}"
            futures[pool.submit(_build_launcher, driver, job, after)] = label
    finally:
        pool.shutdown(wait=False)  # the workers finish the queued builds; nothing joins them here
    return HostBuilds(futures, report, started)
