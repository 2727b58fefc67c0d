"""Triton's host modules built at load (sartor/runtime/launchers.py): which launchers an engine's
kernels need, the signatures the engine records for them, and the parallel build that falls back to
Triton's lazy one.

Most tests stand a fake driver in for Triton's; the last one compiles real kernels for sm_90 (no GPU
needed) and builds their host modules with the C compiler against a stub libcuda, then checks that
Triton's own first-launch path finds every module in its cache and compiles nothing.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import threading
import time
import types
from pathlib import Path

import pytest
import triton
from test_kernel_store import ARCH, DIGEST, built_cache  # noqa: F401 - built_cache: a fixture

from sartor.runtime import kernel_cache
from sartor.runtime import kernel_store as ks
from sartor.runtime import launchers

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _clean(monkeypatch):
    monkeypatch.delenv(launchers.NO_BUILD_ENV, raising=False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    yield
    kernel_cache.forget_served()
    del triton.knobs.cache.manager_class


def _metadata(**fields) -> bytes:
    base = {"hash": "ab" * 32, "name": "k", "target": {"backend": "cuda", "arch": 90, "warp_size": 32},
            "tensordesc_meta": None, "global_scratch_size": 0, "global_scratch_align": 1, "profile_scratch_size": 0,
            "profile_scratch_align": 1, "launch_cooperative_grid": False, "launch_pdl": False, "num_ctas": 1}
    return json.dumps(dict(base, **fields)).encode()


def _entry(name: str, signature, **metadata) -> ks.KernelEntry:
    return ks.KernelEntry(f"KEY{name.upper()}", name, triton.__version__, ARCH,
                          {f"{name}.json": _metadata(name=name, **metadata), f"{name}.cubin": b"\0"},
                          None if signature is None else launchers.parse_signature(signature))


# ---- signatures -------------------------------------------------------------------------------

@pytest.mark.parametrize("signature", [
    ["*fp32", "i32", "constexpr"], ["*i8", "*fp16", "fp32", "i64", "u1", "constexpr"], [],
    ["tensordesc<i8[1, 8, 16, 64]>", "*fp32"], [["*fp32", "i32"], "constexpr"]])
def test_signatures_of_triton_types_round_trip(signature):
    parsed = launchers.parse_signature(signature)
    assert parsed is not None and launchers.record_signature(parsed) == signature


@pytest.mark.parametrize("signature", [
    None, "*fp32", {"x": "*fp32"}, ["*fp32", 3], ["i32); system(\"x\"); int y(", "*fp32"], ["FP32"],
    ["tensordesc<i8[1, 8]>; x"], ["i32"] * (launchers.MAX_ARGUMENTS + 1), [[[[["i32"]]]]]])
def test_other_signatures_are_refused(signature):
    """The types reach the C compiler through Triton's generated source: only names Triton gives."""
    assert launchers.parse_signature(signature) is None


def test_the_recorder_keeps_each_kernels_argument_types(built_cache):
    _, entries = built_cache
    assert entries[0].signature == ("*fp32", "i32", "constexpr")


def test_signatures_travel_in_the_engine_file(built_cache):
    record, tensors = ks.pack_kernels(built_cache[1], triton.__version__)
    assert record["entries"][0]["signature"] == ["*fp32", "i32", "constexpr"]
    back, problems = ks.unpack_kernels(record, tensors)
    assert problems == [] and back == built_cache[1]


@pytest.mark.parametrize("signature", [None, "*fp32", ["no such type!"]])
def test_an_entry_without_a_readable_signature_still_installs(built_cache, tmp_path, signature):
    """Engines built before signatures were recorded (or with one that is not Triton's) install as
    before: only their launchers are left to the first launch."""
    record, tensors = ks.pack_kernels(built_cache[1], triton.__version__)
    if signature is None:
        del record["entries"][0]["signature"]
    else:
        record["entries"][0]["signature"] = signature
    report = ks.install_engine_kernels({"kernels": record}, tensors, ARCH, kernel_names={"_add_one"}, digest=DIGEST,
                                       root=tmp_path)
    assert len(report.installed) == 1 and [e.signature for e in report.entries] == [None]


def test_the_install_report_lists_the_entries_triton_reads(built_cache, tmp_path):
    record, tensors = ks.pack_kernels(built_cache[1], triton.__version__)
    first = ks.install_engine_kernels({"kernels": record}, tensors, ARCH, kernel_names={"_add_one"}, digest=DIGEST,
                                      root=tmp_path)
    again = ks.install_engine_kernels({"kernels": record}, tensors, ARCH, kernel_names={"_add_one"}, digest=DIGEST,
                                      root=tmp_path)
    assert first.entries == again.entries == built_cache[1] and again.present and not again.installed
    refused = ks.install_engine_kernels({"kernels": record}, tensors, ARCH, kernel_names=set(), digest=DIGEST,
                                        root=tmp_path / "other")
    assert refused.entries == [], "no host module for a kernel that was not installed"


# ---- which launchers --------------------------------------------------------------------------

def test_kernels_with_the_same_argument_types_share_a_launcher():
    entries = [_entry("a", ["*fp32", "i32", "constexpr"]), _entry("b", ["*fp32", "i32", "constexpr"]),
               _entry("c", ["*fp16", "i32", "constexpr"]),
               _entry("d", ["*fp32", "i32", "constexpr"], tensordesc_meta=[{"swizzle": 3}]),
               _entry("e", None)]
    jobs, skipped = launchers.launcher_jobs(entries)
    assert sorted(job.kernels for job in jobs) == [["a", "b"], ["c"], ["d"]]
    assert len(skipped) == 1 and skipped[0].startswith("e:")


def test_unreadable_metadata_leaves_that_kernel_to_the_lazy_build():
    entry = _entry("a", ["i32"])
    broken = ks.KernelEntry(entry.key, "a", entry.triton, ARCH, {"a.json": b"{not json", "a.cubin": b"\0"}, ("i32",))
    jobs, skipped = launchers.launcher_jobs([broken, _entry("b", ["i32"])])
    assert [job.kernels for job in jobs] == [["b"]] and skipped[0].startswith("a: its metadata cannot be read")


def test_the_launchers_source_stand_in_has_what_cudalauncher_reads():
    job = launchers.launcher_jobs([_entry("a", ["*fp32", ["i32", "i64"], "constexpr"])])[0][0]
    assert job.source.signature == {"arg0": "*fp32", "arg1": ("i32", "i64"), "arg2": "constexpr"}
    assert job.source.constants == {} and job.metadata.global_scratch_size == 0
    assert job.metadata.target.arch == 90, "the target is a GPUTarget, as CompiledKernel gives it"


# ---- the parallel build, with a fake driver ---------------------------------------------------

class FakeDriver:
    """Triton's NVIDIA driver module as launchers.py calls it: CudaUtils, make_launcher, CudaLauncher.
    Its launcher sources are Triton 3.6's in one respect: a pointer is a pointer, whatever it points to."""

    def __init__(self, build_s: float = 0.0, fail: str = "") -> None:
        self.lock = threading.Lock()
        self.calls: list = []
        self.active = self.most_active = 0
        self.build_s, self.fail = build_s, fail
        driver = self

        class CudaUtils:
            def __init__(self):
                driver._build("cuda_utils")

        class CudaLauncher:
            def __init__(self, src, metadata):
                driver._build(tuple(src.signature.values()))

        self.CudaUtils, self.CudaLauncher = CudaUtils, CudaLauncher

    def make_launcher(self, constants, signature, tensordesc_meta=None):
        assert constants == {}
        return "launch(" + ", ".join("void*" if t.startswith("*") else t for t in signature.values()) + f") {tensordesc_meta}"

    def _build(self, what) -> None:
        with self.lock:
            self.active += 1
            self.most_active = max(self.most_active, self.active)
        time.sleep(self.build_s)
        with self.lock:
            self.active -= 1
            self.calls.append(what)
        if what == self.fail or (self.fail and what != "cuda_utils" and self.fail in what):
            raise RuntimeError(f"cc failed on {what}")


def _use(monkeypatch, driver, workers: int | None = None):
    monkeypatch.setattr(launchers, "nvidia_driver", lambda: driver)
    if workers is not None:
        monkeypatch.setattr(launchers, "_workers", lambda jobs: workers)
    if driver is not None:
        monkeypatch.setattr(launchers, "compile_without_loading", lambda d, job: d._build(("compiled",) + job.signature))


FOUR = [_entry("a", ["*fp32", "i32"]), _entry("b", ["fp16", "i32"]), _entry("c", ["i8", "i32"]),
        _entry("d", ["u8", "i32"]), _entry("e", ["u8", "i32"])]


def test_each_module_is_built_once_and_in_parallel(monkeypatch):
    driver = FakeDriver(build_s=0.1)
    _use(monkeypatch, driver, workers=5)
    report = launchers.start_host_builds(FOUR).wait()
    assert sorted(map(str, driver.calls)) == sorted(map(str, ["cuda_utils", ("*fp32", "i32"), ("fp16", "i32"),
                                                              ("i8", "i32"), ("u8", "i32")]))
    assert driver.most_active == 5, "the five builds ran at once"
    assert (report.launchers, report.kernels, report.ready, report.failed) == (4, 5, 5, [])
    assert "5 of 5 Triton host module(s) ready" in report.describe()


def test_kernels_whose_launchers_have_one_source_share_one_module(monkeypatch):
    """Triton generates the same C for pointers to any element type: one module, one build."""
    driver = FakeDriver()
    _use(monkeypatch, driver)
    entries = [_entry("a", ["*fp32", "i32"]), _entry("b", ["*i8", "i32"]), _entry("c", ["*fp16", "*u8", "i32"]),
               _entry("d", ["*i8", "i32"], tensordesc_meta=[{"swizzle": 3}])]
    report = launchers.start_host_builds(entries).wait()
    assert (report.launchers, report.kernels, report.ready) == (3, 4, 4)
    assert sorted(map(str, driver.calls)) == sorted(map(str, ["cuda_utils", ("*fp32", "i32"), ("*fp16", "*u8", "i32"),
                                                              ("*i8", "i32")]))


def test_a_job_without_a_source_is_built_on_its_own(monkeypatch):
    """A make_launcher that takes other arguments (another Triton) merges nothing and is not guessed at."""
    driver = FakeDriver()
    driver.make_launcher = lambda constants, signature, something_else: "never called"
    _use(monkeypatch, driver)
    report = launchers.start_host_builds([_entry("a", ["*fp32"]), _entry("b", ["*i8"])]).wait()
    assert (report.launchers, report.ready) == (2, 3)


def test_a_launcher_with_tensor_descriptors_compiles_beside_cuda_utils_and_loads_after_it(monkeypatch):
    """Its module keeps the PyCUtensorMap type that cuda_utils defines, as it was when first loaded."""
    driver = FakeDriver(build_s=0.1)
    _use(monkeypatch, driver, workers=3)
    entries = [_entry("a", ["tensordesc<i8[1, 8, 16, 64]>", "i32"]), _entry("b", ["*fp32", "i32"])]
    launchers.start_host_builds(entries).wait()
    desc = ("tensordesc<i8[1, 8, 16, 64]>", "i32")
    assert driver.calls.index("cuda_utils") < driver.calls.index(desc)
    assert driver.most_active == 3, "cuda_utils, the plain launcher and the compile of the other at once"


def test_a_failed_compile_ahead_leaves_the_build_to_cudalauncher(monkeypatch):
    driver = FakeDriver()
    _use(monkeypatch, driver)
    monkeypatch.setattr(launchers, "compile_without_loading", lambda d, job: 1 / 0)
    report = launchers.start_host_builds([_entry("a", ["tensordesc<i8[8]>"])]).wait()
    assert report.ready == 2 and driver.calls[-1] == ("tensordesc<i8[8]>",)


def test_a_failed_build_is_reported_and_the_rest_still_build(monkeypatch, caplog):
    driver = FakeDriver(fail="fp16")
    _use(monkeypatch, driver, workers=2)
    with caplog.at_level(logging.DEBUG, logger="sartor.runtime"):
        report = launchers.start_host_builds(FOUR).wait()
    assert report.ready == 4 and len(report.failed) == 1 and "launcher of b" in report.failed[0]
    assert "cc failed" in caplog.text and "left to the first launch" in report.describe()


def test_without_cuda_utils_the_tensor_descriptor_launchers_are_left_too(monkeypatch):
    driver = FakeDriver(fail="cuda_utils")
    _use(monkeypatch, driver, workers=2)
    report = launchers.start_host_builds([_entry("a", ["tensordesc<i8[8]>"]), _entry("b", ["i32"])]).wait()
    assert report.ready == 1 and len(report.failed) == 2
    assert driver.calls.count(("tensordesc<i8[8]>",)) == 0, "not loaded without the type cuda_utils defines"


def test_a_triton_without_per_signature_launchers_builds_cuda_utils_only(monkeypatch):
    """Triton 3.8 launches every kernel through cuda_utils (no make_launcher)."""
    driver = FakeDriver()
    driver.make_launcher = None
    _use(monkeypatch, driver)
    report = launchers.start_host_builds(FOUR).wait()
    assert driver.calls == ["cuda_utils"] and (report.launchers, report.ready) == (0, 1)


def test_load_stops_waiting_after_its_bound(monkeypatch):
    driver = FakeDriver(build_s=0.5)
    _use(monkeypatch, driver, workers=1)
    builds = launchers.start_host_builds(FOUR)
    report = builds.wait(timeout=0.05)
    assert report.pending >= 1 and "still building" in report.describe()
    builds.wait()


@pytest.mark.parametrize("setting", ["env", "interpret", "no_driver", "nothing", "raises"])
def test_nothing_is_built_when_it_must_not_or_cannot_be(monkeypatch, setting):
    driver = FakeDriver()
    _use(monkeypatch, driver)
    entries = FOUR
    if setting == "env":
        monkeypatch.setenv(launchers.NO_BUILD_ENV, "1")
    elif setting == "interpret":
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    elif setting == "no_driver":
        _use(monkeypatch, None)
    elif setting == "nothing":
        entries = []
    else:
        monkeypatch.setattr(launchers, "launcher_jobs", lambda e: 1 / 0)
    assert launchers.start_host_builds(entries) is None and driver.calls == []


def test_a_driver_without_cudautils_is_not_used(monkeypatch):
    module = types.ModuleType("triton.backends.nvidia.driver")
    monkeypatch.setitem(sys.modules, "triton.backends.nvidia.driver", module)
    assert launchers.nvidia_driver() is None


# ---- the real thing: Triton's own classes, the C compiler, a stub libcuda ----------------------

KERNELS_SOURCE = '''
import triton
import triton.language as tl


@triton.jit
def _add_one(x_ptr, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(x_ptr + i, tl.load(x_ptr + i, mask=i < n) + 1, mask=i < n)


@triton.jit
def _scale(x_ptr, y_ptr, n, s, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(y_ptr + i, (tl.load(x_ptr + i, mask=i < n) * s).to(tl.float16), mask=i < n)


@triton.jit
def _tile_copy(in_desc, out_ptr, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(out_ptr + offs[:, None] * BLOCK + offs[None, :], in_desc.load([0, 0]))
'''

COLD_MACHINE = '''
import json, logging, os, sys
# The stub libcuda defines no symbol: the modules load with their CUDA calls unresolved (never made).
sys.setdlopenflags(os.RTLD_LAZY)
sys.path.insert(0, sys.argv[1])
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kernels import _add_one, _scale, _tile_copy
from sartor.runtime import kernel_store as ks, launchers

target = GPUTarget("cuda", 90, 32)
recorder = ks.KernelRecorder()
triton.knobs.compilation.listener = recorder
compiled = [triton.compile(ASTSource(_add_one, {"x_ptr": "*fp32", "n": "i32", "BLOCK": "constexpr"}, {"BLOCK": b}),
                           target=target) for b in (64, 128)]
compiled.append(triton.compile(ASTSource(_scale, {"x_ptr": "*fp32", "y_ptr": "*fp16", "n": "i32", "s": "fp32",
                                                  "BLOCK": "constexpr"}, {"BLOCK": 128}), target=target))
try:
    compiled.append(triton.compile(ASTSource(_tile_copy, {"in_desc": "tensordesc<fp32[32, 32]>", "out_ptr": "*fp32",
                                                          "BLOCK": "constexpr"}, {"BLOCK": 32}), target=target))
except Exception as exc:
    print("no tensor-descriptor kernel here:", exc, file=sys.stderr)
triton.knobs.compilation.listener = None
entries = recorder.entries()
lines = []
handler = logging.Handler(logging.DEBUG)
handler.emit = lambda record: lines.append(record.getMessage())
logging.getLogger("sartor.runtime").addHandler(handler)
logging.getLogger("sartor.runtime").setLevel(logging.DEBUG)
report = launchers.start_host_builds(entries).wait()

# What a kernel's first launch does (CompiledKernel._init_handles), with compiling forbidden.
def no_compile(name, *args):
    raise AssertionError(f"{name} compiled at first launch")
triton.knobs.build.impl = no_compile
driver = launchers.nvidia_driver()
driver.CudaUtils()
per_signature = launchers.per_signature_launchers(driver)
if per_signature:
    for kernel in compiled:
        driver.CudaLauncher(kernel.src, kernel.metadata)
print(json.dumps({"kernels": len(entries), "launchers": report.launchers, "ready": report.ready,
                  "failed": report.failed, "per_signature": per_signature, "triton": triton.__version__,
                  "signatures": [list(e.signature) for e in entries], "log": lines}))
'''


def _stub_libcuda(directory: Path) -> Path:
    """An empty libcuda.so.1: enough for the C compiler to link Triton's host modules on a machine
    without a GPU driver."""
    directory.mkdir()
    (directory / "stub.c").write_text("void sartor_stub(void) {}\n")
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(directory / "libcuda.so.1"), str(directory / "stub.c")],
                   check=True, capture_output=True)
    return directory


@pytest.mark.skipif(shutil.which("gcc") is None, reason="needs the C compiler Triton builds its host modules with")
def test_modules_built_at_load_are_the_ones_the_first_launch_loads(tmp_path):
    (tmp_path / "kernels").mkdir()
    (tmp_path / "kernels" / "kernels.py").write_text(KERNELS_SOURCE)
    cache = tmp_path / "triton_cache"
    env = dict(os.environ, TRITON_CACHE_DIR=str(cache), TRITON_LIBCUDA_PATH=str(_stub_libcuda(tmp_path / "stub")),
               PYTHONPATH=os.pathsep.join(filter(None, [os.environ.get("PYTHONPATH"), str(ROOT)])))
    env.pop("TRITON_INTERPRET", None)
    env.pop(launchers.NO_BUILD_ENV, None)
    run = subprocess.run([sys.executable, "-c", COLD_MACHINE, str(tmp_path / "kernels")], env=env,
                         capture_output=True, text=True, timeout=300, check=False)
    if run.returncode != 0 and "ptxas" in run.stderr and "AssertionError" not in run.stderr:
        pytest.skip(f"Triton cannot compile for sm_90 here: {run.stderr[-500:]}")
    assert run.returncode == 0, run.stderr[-4000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result["failed"] == [] and not any("not compiled ahead" in line for line in result["log"]), result
    modules = sorted(p.name.split(".")[0] for p in cache.glob("*/*.so"))
    if result["per_signature"]:  # Triton 3.6: _add_one's two kernels share one launcher
        assert result["launchers"] == result["kernels"] - 1 and result["ready"] == result["launchers"] + 1, result
        assert modules == ["__triton_launcher"] * result["launchers"] + ["cuda_utils"], modules
    else:  # Triton 3.8: every kernel launches through cuda_utils
        assert result["launchers"] == 0 and result["ready"] == 1 and modules == ["cuda_utils"], (result, modules)


def test_usable_cpus_is_no_more_than_a_cgroup_quota_allows(tmp_path):
    usable_cpus = launchers.usable_cpus
    affinity = usable_cpus(str(tmp_path / "absent"))
    quota = tmp_path / "cpu.max"
    quota.write_text("max 100000\n")  # no quota: the affinity is the limit
    assert usable_cpus(str(quota)) == affinity
    quota.write_text("150000 100000\n")  # 1.5 CPUs of time: two threads may run
    assert usable_cpus(str(quota)) == min(affinity, 2)
    quota.write_text("50000 100000\n")  # half a CPU: still one thread
    assert usable_cpus(str(quota)) == 1
    quota.write_text("garbage\n")
    assert usable_cpus(str(quota)) == affinity
