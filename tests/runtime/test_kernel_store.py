"""Compiled Triton kernels inside the engine file (sartor/runtime/kernel_store.py, builder/kernels.py).

The CPU tests compile a real kernel for an sm_90 target with Triton's own compiler (it needs no GPU),
so the cache entries they collect, store and install have Triton's real layout, and a second
compile after installation shows whether Triton finds them. The last test runs on CUDA only.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import subprocess
import sys
import threading
import types
from pathlib import Path

import numpy as np
import pytest
import torch
import triton
import triton.language as tl
from conftest import MAX_SHAPES, MIN_SHAPES, OPT_SHAPES
from triton.runtime.jit import JITFunction

import sartor
from sartor.builder import BuildConfig
from sartor.builder import kernels as capture
from sartor.builder.pipeline import _embed_kernels
from sartor.cli.build import add_parser, config_from_args
from sartor.cli.inspect import engine_summary
from sartor.errors import EngineFileError
from sartor.runtime import kernel_cache
from sartor.runtime import kernel_store as ks
from sartor.runtime.engine import rebuild_command
from sartor.runtime.engine_file import pack, read_engine_file, unpack

ARCH = "90"
DIGEST = "ab" * 32  # an engine checksum: the private directory its kernels go to


@pytest.fixture(autouse=True)
def _no_served_entries():
    """Loads here make this process's Triton read engines' private entries: undone after each test."""
    yield
    kernel_cache.forget_served()
    del triton.knobs.cache.manager_class


def _add_one(x_ptr, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(x_ptr + i, tl.load(x_ptr + i, mask=i < n) + 1, mask=i < n)


# Built directly: under TRITON_INTERPRET=1 (conftest) @triton.jit gives the interpreter's function.
ADD_ONE = JITFunction(_add_one)
# The kernels installation accepts here: the test kernel stands in for sartor's (sartor_kernel_names()).
KERNELS = frozenset({"_add_one"})


@contextlib.contextmanager
def triton_cache_at(directory: Path):
    """Triton's file cache in `directory` for the duration (it reads TRITON_CACHE_DIR on each use)."""
    saved = os.environ.get("TRITON_CACHE_DIR")
    os.environ["TRITON_CACHE_DIR"] = str(directory)
    try:
        yield
    finally:
        if saved is None:
            del os.environ["TRITON_CACHE_DIR"]
        else:
            os.environ["TRITON_CACHE_DIR"] = saved


@contextlib.contextmanager
def listening(listener):
    previous = triton.knobs.compilation.listener
    triton.knobs.compilation.listener = listener
    try:
        yield
    finally:
        triton.knobs.compilation.listener = previous


# Triton 3.8's interpreter patches triton.language on every call of a @triton.jit helper from an
# interpreted kernel and never restores it (InterpretedFunction.__call__), so once such a kernel has
# run in this process (the kernel tests before this file), a real compile fails. Collection imports
# this module before any test runs, so what is seen here is Triton's own language; compiles below run
# with it and then put back whatever the interpreter left.
_LANGUAGE_OBJECTS = (tl, tl.core, tl.math, tl.core.tensor, tl.core.tensor_descriptor_base, tl.core.dtype)
_TRITON_LANGUAGE = [(obj, dict(vars(obj))) for obj in _LANGUAGE_OBJECTS]


def _set_attributes(snapshot) -> None:
    for obj, attrs in snapshot:
        present = dict(vars(obj))
        for name in present.keys() - attrs.keys():
            delattr(obj, name)
        for name, value in attrs.items():
            if present.get(name) is not value:
                setattr(obj, name, value)


@contextlib.contextmanager
def real_triton_language():
    left = [(obj, dict(vars(obj))) for obj in _LANGUAGE_OBJECTS]
    _set_attributes(_TRITON_LANGUAGE)
    try:
        yield
    finally:
        _set_attributes(left)


def compile_add_one(block: int = 128):
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    source = ASTSource(ADD_ONE, {"x_ptr": "*fp32", "n": "i32", "BLOCK": "constexpr"}, {"BLOCK": block})
    with real_triton_language():
        return triton.compile(source, target=GPUTarget("cuda", int(ARCH), 32))


class Events:
    def __init__(self) -> None:
        self.hits, self.misses = 0, 0

    def __call__(self, **event) -> None:
        if event["cache_hit"]:
            self.hits += 1
        else:
            self.misses += 1


@pytest.fixture(scope="session")
def built_cache(tmp_path_factory):
    """A Triton cache holding one compiled kernel, and the entries a KernelRecorder collected from it."""
    cache = tmp_path_factory.mktemp("triton_cache")
    recorder = ks.KernelRecorder()
    with triton_cache_at(cache), listening(recorder):
        try:
            compile_add_one()
        except triton.compiler.errors.CompilationError:
            raise  # the kernel or the language is broken: a failure, not a missing toolchain
        except Exception as exc:  # noqa: BLE001 - no CUDA backend or ptxas on this machine
            pytest.skip(f"Triton cannot compile for sm_{ARCH} here ({type(exc).__name__}: {exc})")
    return cache, recorder.entries()


def _engine_file_bytes(entries, header=None) -> bytes:
    record, tensors = ks.pack_kernels(entries, triton.__version__)
    return pack(dict(header or {"format": "test"}, kernels=record), {"w/x": torch.zeros(3), **tensors})


def _roundtrip(entries):
    header, tensors = unpack(_engine_file_bytes(entries))
    own, kernel_tensors = ks.split_kernel_tensors(tensors)
    assert set(own) == {"w/x"}
    return header, kernel_tensors


# ---- collection -------------------------------------------------------------------------------

def test_collects_binary_and_metadata_of_a_real_entry(built_cache):
    cache, entries = built_cache
    assert len(entries) == 1
    entry = entries[0]
    directory = cache / entry.key
    assert directory.is_dir(), "the key is the directory Triton's file cache made"
    assert sorted(entry.files) == ["_add_one.cubin", "_add_one.json"]
    assert entry.files["_add_one.cubin"] == (directory / "_add_one.cubin").read_bytes()
    assert (entry.name, entry.triton, entry.arch) == ("_add_one", triton.__version__, ARCH)
    everything = sum(f.stat().st_size for f in directory.iterdir())
    assert entry.nbytes < everything, "IR stages and the group file are not stored"


def test_recorder_ignores_compiles_without_a_binary(tmp_path):
    (tmp_path / "k.json").write_text(json.dumps({"hash": "ab" * 32, "name": "k"}))
    recorder = ks.KernelRecorder()
    recorder(metadata_group={"k.json": str(tmp_path / "k.json"), "k.ttir": str(tmp_path / "k.ttir")}, cache_hit=True)
    assert ks.collect_entries(recorder.groups.values()) == []


# ---- engine file ------------------------------------------------------------------------------

def test_pack_and_unpack_through_the_engine_file(built_cache):
    _, entries = built_cache
    header, kernel_tensors = _roundtrip(entries)
    record = header["kernels"]
    assert record["embedded"] and record["scheme"] == ks.SCHEME and record["triton"] == triton.__version__
    assert record["bytes"] == entries[0].nbytes
    assert all(k.startswith(f"{ks.TENSOR_PREFIX}{entries[0].key}/") for k in kernel_tensors)
    back, problems = ks.unpack_kernels(record, kernel_tensors)
    assert problems == [] and back == entries


def test_tampered_kernel_bytes_fail_the_checksum(built_cache):
    data = bytearray(_engine_file_bytes(built_cache[1]))
    cubin = built_cache[1][0].files["_add_one.cubin"]
    at = bytes(data).index(cubin[64:96])
    data[at] ^= 0xFF
    with pytest.raises(EngineFileError, match="integrity"):
        unpack(bytes(data))


@pytest.mark.parametrize("key,extra", [("../../ETC", None), (None, "../evil.cubin"), (None, "launcher.so"),
                                       (None, "__grp__x.json"), (None, "__grp___add_one.json"),
                                       (None, "_add_one.ptx"), (None, "other.cubin")])
def test_malformed_entries_are_skipped(built_cache, key, extra):
    """Names come from the file's header: a path, host code or a group file never reaches the cache.
    Each case is otherwise a valid entry (its real cubin and metadata), so only the rule on names
    rejects it."""
    entry = built_cache[1][0]
    files = dict(entry.files, **({extra: b"\x7fELF" + b"\x00" * 8} if extra else {}))
    bad = ks.KernelEntry(key or entry.key, entry.name, entry.triton, entry.arch, files)
    record, tensors = ks.pack_kernels([bad], triton.__version__)
    entries, problems = ks.unpack_kernels(record, tensors)
    assert entries == [] and len(problems) == 1 and "malformed" in problems[0]


def test_files_must_be_named_after_the_kernel(built_cache):
    entry = built_cache[1][0]
    renamed = ks.KernelEntry(entry.key, "_other", entry.triton, entry.arch, entry.files)
    record, tensors = ks.pack_kernels([renamed, entry], triton.__version__)
    entries, problems = ks.unpack_kernels(record, tensors)
    assert entries == [entry] and len(problems) == 1 and "malformed" in problems[0]


# Shapes a crafted or damaged header can give the record (the review's cases and a few more).
_MALFORMED_RECORDS = [
    ["embedded"],
    "embedded",
    {"embedded": True, "scheme": ks.SCHEME, "entries": {"key": "A" * 16}},
    {"embedded": True, "scheme": ks.SCHEME, "entries": "A" * 16},
    {"embedded": True, "scheme": ks.SCHEME, "entries": ["x", 3, None, []]},
    {"embedded": True, "scheme": ks.SCHEME, "entries": [{"key": "A" * 16, "files": ["a.json"]}]},
    {"embedded": True, "scheme": ks.SCHEME, "entries": [{"key": "A" * 16, "name": "n",
                                                        "files": {"n.json": 1, "n.cubin": 1}}]},
    {"embedded": True, "scheme": ks.SCHEME, "entries": [{"key": 7, "name": ["n"], "files": {"n.json": "1"}}]},
    {"embedded": True, "scheme": ks.SCHEME, "entries": [{"key": "A" * 16, "name": "n",
                                                        "files": {"n.json": None, "n.cubin": 1.5}}]},
    {"embedded": True, "scheme": ["x"], "entries": [1]},
    {"embedded": True, "scheme": ks.SCHEME, "entries": [], "bytes": "many", "triton": {"v": 1}},
]


@pytest.mark.parametrize("record", _MALFORMED_RECORDS, ids=range(len(_MALFORMED_RECORDS)))
def test_malformed_records_give_lines_not_errors(record, tmp_path):
    entries, problems = ks.unpack_kernels(record, {})
    assert entries == [] and all(isinstance(p, str) and "\n" not in p for p in problems)
    assert problems or record_has_no_entries(record)
    assert isinstance(ks.describe_record(record), str)
    report = ks.install_engine_kernels({"kernels": record}, {}, ARCH, kernel_names=KERNELS, digest=DIGEST,
                                       root=tmp_path)
    assert report is None or not report.installed
    assert list(tmp_path.iterdir()) == []


def record_has_no_entries(record) -> bool:
    return isinstance(record, dict) and record.get("entries") == []


def _random_json(rng: np.random.Generator, depth: int = 0):
    kind = int(rng.integers(0, 9 if depth < 3 else 6))
    if kind == 0:
        return None
    if kind == 1:
        return bool(rng.integers(0, 2))
    if kind == 2:
        return int(rng.integers(-5, 1 << 20))
    if kind == 3:
        return float(rng.normal())
    if kind == 4:
        return str(rng.choice(["", "A" * 16, "_add_one", "_add_one.json", "../x", ks.SCHEME, "90"]))
    if kind == 5:
        return "".join(rng.choice(list("AZ27az_.-/é"), size=int(rng.integers(0, 20))))
    if kind == 6:
        return [_random_json(rng, depth + 1) for _ in range(int(rng.integers(0, 4)))]
    keys = ["embedded", "scheme", "entries", "key", "name", "files", "arch", "triton", "bytes", "_add_one.json"]
    return {str(rng.choice(keys)): _random_json(rng, depth + 1) for _ in range(int(rng.integers(0, 5)))}


def _with_random_leaf(value, rng: np.random.Generator):
    """`value` (a JSON tree) with one node, picked at random, replaced by random JSON."""
    if rng.random() < 0.25 or not isinstance(value, (dict, list)) or not value:
        return _random_json(rng)
    if isinstance(value, dict):
        key = list(value)[int(rng.integers(0, len(value)))]
        return dict(value, **{key: _with_random_leaf(value[key], rng)})
    at = int(rng.integers(0, len(value)))
    return [*value[:at], _with_random_leaf(value[at], rng), *value[at + 1:]]


def test_fuzzed_records_never_raise(built_cache, tmp_path):
    """Random records and random damage to a real one: lines or entries, never an exception, and
    whatever is installed is a valid entry."""
    record, tensors = ks.pack_kernels(built_cache[1], triton.__version__)
    real = built_cache[1][0]
    rng = np.random.default_rng(0)
    kept = skipped = 0
    for i in range(400):
        fuzzed = _with_random_leaf(record, rng) if i % 2 else _random_json(rng)
        entries, problems = ks.unpack_kernels(fuzzed, tensors)
        kept, skipped = kept + len(entries), skipped + len(problems)
        assert all(isinstance(p, str) for p in problems), fuzzed
        assert all((e.key, e.name, e.files) == (real.key, real.name, real.files) for e in entries), fuzzed
        assert isinstance(ks.describe_record(fuzzed), str), fuzzed
        ks.install_engine_kernels({"kernels": fuzzed}, tensors, ARCH, kernel_names=KERNELS, digest=DIGEST,
                                  root=tmp_path / str(i))
    assert kept > 0 and skipped > 0, "the fuzz reaches both outcomes"


def test_inspect_reports_a_malformed_record_in_one_line(plan_copy, cli):
    header, tensors = read_engine_file(plan_copy)
    header["fingerprint"] = dict(header["fingerprint"], kind="cuda")
    plan_copy.write_bytes(pack(dict(header, kernels=["embedded"]), tensors))
    result = cli("inspect", plan_copy)
    assert result.code == 0, result
    assert "malformed (the engine's kernels record is a list" in result.out, result.out
    assert json.loads(cli("inspect", plan_copy, "--json").out)["kernels"]["entries"] == 0


def test_another_scheme_is_ignored_with_a_line(built_cache):
    record, tensors = ks.pack_kernels(built_cache[1], triton.__version__)
    entries, problems = ks.unpack_kernels(dict(record, scheme="other/9"), tensors)
    assert entries == [] and "other/9" in problems[0]


# ---- installation -----------------------------------------------------------------------------

def test_installed_entries_make_triton_compile_nothing(built_cache, tmp_path):
    """Installed into an engine's private directory and served from it, an entry is what Triton
    loads; Triton's user-wide cache gets no entry of the kernel."""
    header, kernel_tensors = _roundtrip(built_cache[1])
    entries, _ = ks.unpack_kernels(header["kernels"], kernel_tensors)
    private, user_wide = tmp_path / "private" / DIGEST, tmp_path / "user_wide"
    report = ks.install_kernels(entries, private, triton.__version__, ARCH, KERNELS)
    assert report.installed == [entries[0].key] and not report.present and not report.ignored
    assert kernel_cache.serve_entries(private, report.installed) == []
    before = sorted(p.relative_to(private) for p in private.rglob("*"))
    events = Events()
    with triton_cache_at(user_wide), listening(events):
        kernel = compile_add_one()
    assert (events.hits, events.misses) == (1, 0), "Triton found the installed entry"
    assert kernel.asm["cubin"] == entries[0].files["_add_one.cubin"]
    assert sorted(p.relative_to(private) for p in private.rglob("*")) == before, "nothing compiled or written"
    assert not (user_wide / entries[0].key).exists(), "the user-wide cache is not touched for a served key"


def test_installed_but_not_served_entries_are_not_read(built_cache, tmp_path):
    """The check above can fail: an entry in a private directory that this process does not serve
    (another engine's, or one no load verified) is not what Triton runs."""
    entry = built_cache[1][0]
    private, user_wide = tmp_path / "private" / DIGEST, tmp_path / "user_wide"
    ks.install_kernels([entry], private, triton.__version__, ARCH, KERNELS)
    events = Events()
    with triton_cache_at(user_wide), listening(events):
        compile_add_one()
    assert (events.hits, events.misses) == (0, 1)


def test_without_installation_triton_compiles(tmp_path):
    """The check above can fail: an empty cache makes Triton compile."""
    events = Events()
    with triton_cache_at(tmp_path / "empty"), listening(events):
        compile_add_one()
    assert (events.hits, events.misses) == (0, 1)


_LATER_PROCESS = r"""
import json, sys
sys.path[:0] = sys.argv[1:3]
import test_kernel_store as t
events = t.Events()
with t.listening(events):
    t.compile_add_one()
print(json.dumps({"hits": events.hits, "misses": events.misses}))
"""


def test_a_later_process_never_runs_an_engines_kernels(built_cache, tmp_path):
    """What a load installs serves the loading process only: a later process compiling the same
    kernel with the same Triton cache (here a real one, without loading the engine) compiles it
    itself, so an engine cannot plant GPU code for other programs."""
    entry = built_cache[1][0]
    record, tensors = ks.pack_kernels([entry], triton.__version__)
    user_wide = tmp_path / "user_wide"
    events = Events()
    with triton_cache_at(user_wide):
        report = ks.install_engine_kernels({"kernels": record}, tensors, ARCH, kernel_names=KERNELS, digest=DIGEST,
                                           root=tmp_path / "private")
        with listening(events):
            compile_add_one()
    assert report.installed == [entry.key] and report.cache_dir == str(tmp_path / "private" / DIGEST)
    assert (events.hits, events.misses) == (1, 0), "this process reads the engine's entry"
    tests = Path(__file__).resolve().parent.parent
    run = subprocess.run([sys.executable, "-c", _LATER_PROCESS, str(tests), str(tests / "runtime")],
                         env=dict(os.environ, TRITON_CACHE_DIR=str(user_wide)), capture_output=True, text=True,
                         timeout=600, check=False)
    assert run.returncode == 0, run.stderr[-3000:]
    assert json.loads(run.stdout.strip().splitlines()[-1]) == {"hits": 0, "misses": 1}


def test_two_engines_in_one_process_keep_their_own_entries(built_cache, tmp_path, caplog):
    """Engine B carries engine A's key with another cubin: both install into their own directories,
    Triton runs A's (loaded first) and B's conflict is one warning; neither reaches Triton's cache."""
    entry = built_cache[1][0]
    cubin = bytearray(entry.files["_add_one.cubin"])
    cubin[len(cubin) // 2] ^= 0xFF
    forged = dict(entry.files, **{"_add_one.cubin": bytes(cubin)})
    other = ks.KernelEntry(entry.key, entry.name, entry.triton, entry.arch, forged)
    user_wide, root = tmp_path / "user_wide", tmp_path / "private"
    reports = []
    with caplog.at_level(logging.WARNING, logger="sartor.runtime"):
        for digest, carried in (("aa" * 32, entry), ("bb" * 32, other)):
            record, tensors = ks.pack_kernels([carried], triton.__version__)
            reports.append(ks.install_engine_kernels({"kernels": record}, tensors, ARCH, kernel_names=KERNELS,
                                                     digest=digest, root=root))
    assert [r.installed for r in reports] == [[entry.key], [entry.key]]
    assert (root / ("bb" * 32) / entry.key / "_add_one.cubin").read_bytes() == forged["_add_one.cubin"]
    assert len(reports[1].ignored) == 1 and "differs from the one an engine loaded earlier" in reports[1].ignored[0]
    assert any("differs" in r.getMessage() for r in caplog.records)
    with triton_cache_at(user_wide):
        kernel = compile_add_one()
    assert kernel.asm["cubin"] == entry.files["_add_one.cubin"], "the first engine's binary runs"
    assert not (user_wide / entry.key).exists()


def test_group_file_points_at_the_installed_files(built_cache, tmp_path):
    entry = built_cache[1][0]
    ks.install_kernels([entry], tmp_path, triton.__version__, ARCH, KERNELS)
    group = json.loads((tmp_path / entry.key / "__grp___add_one.json").read_text())
    assert group["child_paths"] == {name: str(tmp_path / entry.key / name) for name in entry.files}
    assert not list(tmp_path.glob("tmp.*")), "no staging directory left"


def test_an_entry_with_the_engines_files_is_left_as_it_is(built_cache, tmp_path):
    entry = built_cache[1][0]
    ks.install_kernels([entry], tmp_path, triton.__version__, ARCH, KERNELS)
    before = {p: p.stat().st_mtime_ns for p in (tmp_path / entry.key).iterdir()}
    report = ks.install_kernels([entry], tmp_path, triton.__version__, ARCH, KERNELS)
    assert report.present == [entry.key] and not report.installed
    assert {p: p.stat().st_mtime_ns for p in (tmp_path / entry.key).iterdir()} == before


def test_an_entry_edited_on_disk_is_replaced_by_the_engines(built_cache, tmp_path):
    """The private directory holds what the engine carries: a cubin changed there after the
    install (by anyone who can write the directory) is not run, it is written again."""
    entry = built_cache[1][0]
    ks.install_kernels([entry], tmp_path, triton.__version__, ARCH, KERNELS)
    (tmp_path / entry.key / "_add_one.cubin").write_bytes(b"planted")
    report = ks.install_kernels([entry], tmp_path, triton.__version__, ARCH, KERNELS)
    assert report.installed == [entry.key] and not report.present
    assert (tmp_path / entry.key / "_add_one.cubin").read_bytes() == entry.files["_add_one.cubin"]
    assert [p.name for p in tmp_path.iterdir()] == [entry.key], "no staging or stale directory left"


def test_an_empty_directory_from_a_triton_lookup_is_filled(built_cache, tmp_path):
    entry = built_cache[1][0]
    (tmp_path / entry.key).mkdir()
    report = ks.install_kernels([entry], tmp_path, triton.__version__, ARCH, KERNELS)
    assert report.installed == [entry.key]
    assert (tmp_path / entry.key / "_add_one.cubin").read_bytes() == entry.files["_add_one.cubin"]


def test_an_entry_triton_is_writing_is_left_alone(built_cache, tmp_path):
    entry = built_cache[1][0]
    (tmp_path / entry.key).mkdir()
    (tmp_path / entry.key / "_add_one.ttir").write_text("half")
    report = ks.install_kernels([entry], tmp_path, triton.__version__, ARCH, KERNELS)
    assert report.busy == [entry.key] and not report.installed
    assert sorted(p.name for p in (tmp_path / entry.key).iterdir()) == ["_add_one.ttir"]
    assert not list(tmp_path.glob("tmp.*"))


def test_a_failed_write_leaves_no_half_entry(built_cache, tmp_path, monkeypatch):
    entry = built_cache[1][0]
    real = Path.write_bytes
    calls = []

    def failing(self, data):
        calls.append(self.name)
        if len(calls) == 2:
            raise OSError(28, "No space left on device")
        return real(self, data)
    monkeypatch.setattr(Path, "write_bytes", failing)
    with pytest.raises(OSError):
        ks.install_kernels([entry], tmp_path, triton.__version__, ARCH, KERNELS)
    assert list(tmp_path.iterdir()) == [], "neither the entry nor its staging directory exists"


def test_concurrent_installs_each_entry_once(built_cache, tmp_path):
    entry = built_cache[1][0]
    reports, barrier = [], threading.Barrier(8)

    def install():
        barrier.wait()
        reports.append(ks.install_kernels([entry], tmp_path, triton.__version__, ARCH, KERNELS))
    threads = [threading.Thread(target=install) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sum(len(r.installed) for r in reports) == 1
    assert sum(len(r.present) for r in reports) == 7
    assert sorted(p.name for p in (tmp_path / entry.key).iterdir()) == sorted(
        ["__grp___add_one.json", *entry.files])
    assert [p.name for p in tmp_path.iterdir()] == [entry.key]


@pytest.mark.parametrize("version,arch", [("0.0.1", ARCH), (None, "80")])
def test_entries_for_another_triton_or_arch_are_ignored(built_cache, tmp_path, version, arch):
    entry = built_cache[1][0]
    other = ks.KernelEntry(entry.key, entry.name, version or entry.triton, arch, entry.files)
    report = ks.install_kernels([other], tmp_path, triton.__version__, ARCH, KERNELS)
    assert not report.installed and len(report.ignored) == 1
    assert (version or f"arch {arch}") in report.ignored[0]
    assert not (tmp_path / entry.key).exists()


def _with_metadata(entry: ks.KernelEntry, key: str | None = None, **changes) -> ks.KernelEntry:
    """`entry` with its metadata's fields changed (a field set to None is removed) and maybe its key."""
    metadata = json.loads(entry.files[entry.metadata_file])
    metadata.update(changes)
    metadata = {k: v for k, v in metadata.items() if v is not None}
    files = dict(entry.files, **{entry.metadata_file: json.dumps(metadata).encode()})
    return ks.KernelEntry(key or entry.key, entry.name, entry.triton, entry.arch, files)


_OTHER_HASH = hashlib.sha256(b"another program's kernel").hexdigest()


@pytest.mark.parametrize("case,why", [
    ("key_of_another_hash", "key is not the one Triton derives"),
    ("hash_of_another_key", "key is not the one Triton derives"),
    ("no_hash", "key is not the one Triton derives"),
    ("metadata_names_another_kernel", "metadata names kernel 'other'"),
    ("not_a_sartor_kernel", "not a Triton kernel sartor ships"),
    ("metadata_for_another_arch", "targets arch 80"),
    ("metadata_without_target", "targets arch None"),
    ("metadata_not_json", "not a JSON object"),
    ("metadata_not_utf8", "not a JSON object"),
    ("metadata_a_list", "not a JSON object"),
])
def test_entries_that_disagree_with_their_metadata_are_not_installed(built_cache, tmp_path, case, why):
    """The header says where an entry goes; Triton loads what its metadata says. A file whose two
    disagree could plant a binary or corrupt metadata under another kernel's key."""
    entry = built_cache[1][0]
    names = KERNELS
    bad = {
        "key_of_another_hash": lambda: ks.KernelEntry(ks.entry_key(_OTHER_HASH), entry.name, entry.triton,
                                                      entry.arch, entry.files),
        "hash_of_another_key": lambda: _with_metadata(entry, hash=_OTHER_HASH),
        "no_hash": lambda: _with_metadata(entry, hash=None),
        "metadata_names_another_kernel": lambda: _with_metadata(entry, name="other"),
        "not_a_sartor_kernel": lambda: entry,
        "metadata_for_another_arch": lambda: _with_metadata(entry, target={"backend": "cuda", "arch": 80,
                                                                           "warp_size": 32}),
        "metadata_without_target": lambda: _with_metadata(entry, target=None),
        "metadata_not_json": lambda: ks.KernelEntry(entry.key, entry.name, entry.triton, entry.arch,
                                                    dict(entry.files, **{entry.metadata_file: b"{not json"})),
        "metadata_not_utf8": lambda: ks.KernelEntry(entry.key, entry.name, entry.triton, entry.arch,
                                                    dict(entry.files, **{entry.metadata_file: b"\xff\xfe{}"})),
        "metadata_a_list": lambda: ks.KernelEntry(entry.key, entry.name, entry.triton, entry.arch,
                                                  dict(entry.files, **{entry.metadata_file: b"[]"})),
    }[case]()
    if case == "not_a_sartor_kernel":
        names = None  # sartor's own kernels: the test kernel is not one of them
    report = ks.install_kernels([bad], tmp_path, triton.__version__, ARCH, names)
    assert not report.installed and not report.present and len(report.ignored) == 1
    assert why in report.ignored[0], report.ignored
    assert list(tmp_path.iterdir()) == [], "nothing written to the cache"


def test_the_unaltered_entry_passes_the_same_checks(built_cache, tmp_path):
    """The cases above can fail: the real entry, re-serialized the same way, is installed."""
    entry = _with_metadata(built_cache[1][0])
    report = ks.install_kernels([entry], tmp_path, triton.__version__, ARCH, KERNELS)
    assert report.installed == [entry.key] and not report.ignored


def test_sartor_kernel_names_are_its_triton_functions():
    names = ks.sartor_kernel_names()
    assert {"_conv_igemm_kernel", "_epilogue_kernel", "_depthwise_nhwc_kernel", "_max_pool_nhwc_kernel",
            "_upsample_nearest_nhwc_kernel", "_yolo_decode_kernel"} <= names
    assert "_add_one" not in names and "conv_igemm" not in names, "plain Python functions are not kernels"


@pytest.mark.parametrize("install,env,refused", [
    (True, None, ""), (True, "0", ""), (False, None, "install_kernels=False"),
    (True, "1", "SARTOR_NO_KERNEL_INSTALL=1"), (False, "1", "install_kernels=False")])
def test_install_refusal(monkeypatch, install, env, refused):
    if env is None:
        monkeypatch.delenv(ks.NO_INSTALL_ENV, raising=False)
    else:
        monkeypatch.setenv(ks.NO_INSTALL_ENV, env)
    got = ks.install_refusal(install)
    assert refused in got if refused else got == ""


def test_a_refused_load_writes_nothing(built_cache, tmp_path, caplog):
    record, tensors = ks.pack_kernels(built_cache[1], triton.__version__)
    with caplog.at_level(logging.INFO, logger="sartor.runtime"):
        report = ks.install_engine_kernels({"kernels": record}, tensors, ARCH, "sartor.load(install_kernels=False)",
                                           kernel_names=KERNELS, digest=DIGEST, root=tmp_path)
        assert list(tmp_path.iterdir()) == []
        allowed = ks.install_engine_kernels({"kernels": record}, tensors, ARCH, "", kernel_names=KERNELS,
                                            digest=DIGEST, root=tmp_path)
    assert not report.installed and "install_kernels=False" in report.ignored[0]
    assert not any(r.levelno >= logging.WARNING for r in caplog.records), "an opt-out is not a warning"
    assert allowed.installed == [built_cache[1][0].key], "the same record is installed without the refusal"


def test_load_takes_install_kernels(plan_copy, tiny_engine, images):
    engine = sartor.load(plan_copy, device="cpu", install_kernels=False)
    np.testing.assert_array_equal(engine.context().run({"images": images})["logits"],
                                  tiny_engine.context().run({"images": images})["logits"])


def test_load_step_logs_ignored_kernels_and_installs_the_rest(built_cache, tmp_path, caplog):
    entry = built_cache[1][0]
    other = ks.KernelEntry("A" * 52, entry.name, "0.0.1", ARCH, entry.files)
    record, tensors = ks.pack_kernels([entry, other], triton.__version__)
    with caplog.at_level(logging.INFO, logger="sartor.runtime"):
        report = ks.install_engine_kernels({"kernels": record}, tensors, ARCH, kernel_names=KERNELS, digest=DIGEST,
                                           root=tmp_path)
    assert report.installed == [entry.key] and report.cache_dir == str(tmp_path / DIGEST)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "Triton 0.0.1" in warnings[0] and "AAAAAAAAAAAA" in warnings[0]
    assert any("1 Triton kernel(s) installed" in r.getMessage() for r in caplog.records)


def test_engines_without_kernels_install_nothing(tmp_path):
    assert ks.install_engine_kernels({"format": "sartor-engine"}, {}, ARCH, digest=DIGEST, root=tmp_path) is None
    assert ks.install_engine_kernels({"kernels": ks.not_embedded("off")}, {}, ARCH, digest=DIGEST,
                                     root=tmp_path) is None
    assert list(tmp_path.iterdir()) == []


def test_a_custom_cache_manager_is_not_written_to(built_cache, tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_CACHE_MANAGER", "triton.runtime.cache:FileCacheManager")
    record, tensors = ks.pack_kernels(built_cache[1], triton.__version__)
    report = ks.install_engine_kernels({"kernels": record}, tensors, ARCH, digest=DIGEST, root=tmp_path)
    assert not report.installed and "cache manager" in report.ignored[0]
    assert list(tmp_path.iterdir()) == []


# ---- capture: fresh JIT tables + the compilation listener -------------------------------------

def test_capture_sees_kernels_already_compiled_in_this_process(built_cache, monkeypatch):
    """A kernel in a JIT function's in-memory table is launched without a compile; the capture
    empties the tables of sartor's functions (and restores them), so that it is compiled from
    Triton's disk cache and the listener names its entry."""
    cache, entries = built_cache
    module = types.ModuleType("sartor._kernel_store_test")
    module.ADD_ONE = ADD_ONE
    monkeypatch.setitem(sys.modules, module.__name__, module)
    original = ADD_ONE.device_caches
    original[0] = ("compiled", "earlier")
    outer = Events()
    recorder = ks.KernelRecorder()
    with triton_cache_at(cache), listening(outer):
        with capture._fresh_jit_tables(), capture._listening(recorder):
            assert ADD_ONE.device_caches is not original and not ADD_ONE.device_caches
            compile_add_one()
        assert ADD_ONE.device_caches is original and triton.knobs.compilation.listener is outer
    del original[0]
    assert recorder.entries() == entries
    assert outer.hits == 1, "a listener set before the capture still hears the compiles"


def test_capture_refuses_a_triton_without_jit_tables(monkeypatch):
    module = types.ModuleType("sartor._kernel_store_test")
    module.ADD_ONE = JITFunction(_add_one)
    module.ADD_ONE.device_caches = {}
    monkeypatch.setitem(sys.modules, module.__name__, module)
    with pytest.raises(capture.CaptureUnavailable, match="device_caches"):
        with capture._fresh_jit_tables():
            pass


def test_profile_shapes_are_min_opt_max_once():
    from sartor.runtime.profiles import Profile, ShapeRange
    one = Profile({"x": ShapeRange((1, 3), (8, 3), (8, 3))})
    assert capture_shapes(one) == [{"x": (1, 3)}, {"x": (8, 3)}]


def capture_shapes(profile):
    from sartor.builder.pipeline import _profile_shapes
    return _profile_shapes(profile)


# ---- builds, inspect, options -----------------------------------------------------------------

def test_cpu_engines_are_unchanged(tiny_plan, tiny_engine):
    header, tensors = read_engine_file(tiny_plan)
    assert "kernels" not in header and not any(k.startswith(ks.TENSOR_PREFIX) for k in tensors)
    assert not any(line.startswith("kernels:") for line in header["build_log"])
    assert tiny_engine.kernels_installed is None
    summary = engine_summary(str(tiny_plan))["kernels"]
    assert summary["embedded"] is False and summary["entries"] == 0 and summary["text"] == "none (CPU engine)"


def test_an_engine_carrying_kernels_stays_valid_loads_and_runs(built_cache, plan_copy, tiny_engine, images):
    header, tensors = read_engine_file(plan_copy)
    record, kernel_tensors = ks.pack_kernels(built_cache[1], triton.__version__)
    plan_copy.write_bytes(pack(dict(header, kernels=record), {**tensors, **kernel_tensors}))
    engine = sartor.load(plan_copy, device="cpu")  # digest checked; the CPU installs nothing
    assert engine.kernels_installed is None
    assert engine.weight_bytes == tiny_engine.weight_bytes, "the kernel files are not weights"
    np.testing.assert_array_equal(engine.context().run({"images": images})["logits"],
                                  tiny_engine.context().run({"images": images})["logits"])
    summary = engine_summary(str(plan_copy))["kernels"]
    assert summary["embedded"] and summary["entries"] == 1 and summary["bytes"] == built_cache[1][0].nbytes
    assert summary["text"].startswith(f"1 Triton kernel(s) embedded, {summary['bytes'] / 1024:.1f} KiB (Triton "
                                      f"{triton.__version__}, sm_{ARCH}): _add_one")


def test_inspect_shows_the_kernels(built_cache, plan_copy, cli):
    header, tensors = read_engine_file(plan_copy)
    record, kernel_tensors = ks.pack_kernels(built_cache[1], triton.__version__)
    plan_copy.write_bytes(pack(dict(header, kernels=record), {**tensors, **kernel_tensors}))
    result = cli("inspect", plan_copy)
    assert result.code == 0, result
    assert "1 Triton kernel(s) embedded" in result.out
    as_json = cli("inspect", plan_copy, "--json")
    assert json.loads(as_json.out)["kernels"]["entries"] == 1


def test_inspect_says_when_kernels_were_left_out(plan_copy, cli):
    header, tensors = read_engine_file(plan_copy)
    header["fingerprint"] = dict(header["fingerprint"], kind="cuda")  # inspect reads; it does not bind
    plan_copy.write_bytes(pack(dict(header, kernels=ks.not_embedded("built with --no-embed-kernels")), tensors))
    result = cli("inspect", plan_copy)
    assert "not embedded (built with --no-embed-kernels)" in result.out, result


def test_no_embed_kernels_option(tiny_onnx, tmp_path):
    import argparse
    assert BuildConfig("m.onnx", "o.plan").embed_kernels is True
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers(), [])
    for argv, expected in ((["build", "m.onnx", "-o", "o.plan"], True),
                           (["build", "m.onnx", "-o", "o.plan", "--no-embed-kernels"], False)):
        assert config_from_args(parser.parse_args(argv)).embed_kernels is expected
    result = sartor.build(tiny_onnx, tmp_path / "t.plan", device="cpu", min_shapes=MIN_SHAPES,
                          opt_shapes=OPT_SHAPES, max_shapes=MAX_SHAPES, embed_kernels=False)
    assert result.header["build_config"]["embed_kernels"] is False
    assert "--no-embed-kernels" in rebuild_command(result.header)
    assert "--no-embed-kernels" not in rebuild_command({"build_config": {"embed_kernels": True}})


def test_the_kernels_stage_records_a_disabled_embedding():
    config = BuildConfig("m.onnx", "o.plan", embed_kernels=False)
    log = []
    record, tensors = _embed_kernels(config, {}, {}, torch.device("cpu"), [], None, None, log)
    assert record == ks.not_embedded("built with --no-embed-kernels") and tensors == {}
    assert log == ["kernels: not embedded (built with --no-embed-kernels): the first run on a fresh machine "
                   "JIT-compiles them"]


# ---- the real thing (CUDA) --------------------------------------------------------------------

_COLD_LOAD = r"""
import json, sys
import numpy as np
import triton
events = {"hits": 0, "misses": 0}
triton.knobs.compilation.listener = lambda **e: events.__setitem__("hits" if e["cache_hit"] else "misses",
                                                                   events["hits" if e["cache_hit"] else "misses"] + 1)
import glob, os
import sartor
engine = sartor.load(sys.argv[1])
# Triton's host modules (.so) in its cache: those load built, then any the first run built.
modules = lambda: len(glob.glob(os.path.join(os.environ["TRITON_CACHE_DIR"], "*", "*.so")))
at_load = modules()
out = engine.context().run({"images": np.load(sys.argv[2])})
np.save(sys.argv[3], out["logits"])
report, host = engine.kernels_installed, engine.host_modules
print(json.dumps(dict(events, installed=report.installed, present=report.present, host_modules_at_load=at_load,
                      host_modules_after_run=modules(), host_failed=None if host is None else host.failed)))
"""


def _force_triton_tactics(timing_cache: Path) -> int:
    """Make the Triton epilogue win every fused conv it was timed for (a cached winner is taken as is)."""
    data = json.loads(timing_cache.read_text())
    forced = 0
    for device in data.get("devices", {}).values():
        for entry in device.get("entries", {}).values():
            if "triton_epilogue" in entry.get("timings_ms", {}):
                entry["winner"] = "triton_epilogue"
                forced += 1
    timing_cache.write_text(json.dumps(data))
    return forced


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: on the CPU Triton's interpreter "
                    "compiles nothing, so there are no kernels to embed")
def test_cuda_engine_loads_in_a_fresh_process_without_compiling(tiny_onnx, tmp_path, images):
    timing = tmp_path / "timing.json"
    shapes = dict(device="cuda", precision="fp16", min_shapes=MIN_SHAPES, opt_shapes=OPT_SHAPES,
                  max_shapes=MAX_SHAPES, timing_cache=timing)
    sartor.build(tiny_onnx, tmp_path / "timed.plan", **shapes)
    assert _force_triton_tactics(timing) > 0, timing.read_text()[:2000]
    plan = tmp_path / "tiny_cuda.plan"
    result = sartor.build(tiny_onnx, plan, **shapes)
    assert any("triton" in layer["tactic"] for layer in result.header["layers"]), result.header["layers"]
    record = result.header["kernels"]
    assert record["embedded"] and record["entries"], record
    expected = sartor.load(plan).context().run({"images": images})["logits"]

    cache, private = tmp_path / "empty_triton_cache", tmp_path / "sartor_cache"
    cache.mkdir()
    np.save(tmp_path / "images.npy", images)
    env = dict(os.environ, TRITON_CACHE_DIR=str(cache), SARTOR_CACHE_DIR=str(private))
    env.pop("TRITON_INTERPRET", None)
    run = subprocess.run([sys.executable, "-c", _COLD_LOAD, str(plan), str(tmp_path / "images.npy"),
                          str(tmp_path / "out.npy")], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    events = json.loads(run.stdout.strip().splitlines()[-1])
    assert events["misses"] == 0 and events["hits"] >= 1, events
    assert sorted(events["installed"]) == sorted(e["key"] for e in record["entries"])
    assert events["host_failed"] == [] and events["host_modules_after_run"] == events["host_modules_at_load"] >= 1, \
        "load built every host module the first run needed (runtime/launchers.py)"
    assert list(cache.glob("*/__grp__*.json")) == [], "no kernel entry in Triton's user-wide cache"
    kernel_dirs = {p.parent.name for p in private.glob("kernels/*/*/__grp__*.json")}
    assert kernel_dirs == set(events["installed"]), "the engine's entries are in its private directory"
    np.testing.assert_allclose(np.load(tmp_path / "out.npy"), expected, rtol=0, atol=0)

    # Under a trust store: the unsigned engine is refused; signed by a trusted key, it loads cold as above.
    from sartor.deploy.signing import generate_key, sign_engine
    generate_key(tmp_path / "signer")
    (tmp_path / "trust").mkdir()
    (tmp_path / "trust" / "signer.pub").write_bytes((tmp_path / "signer.pub").read_bytes())
    signed = tmp_path / "signed.plan"
    sign_engine(plan, tmp_path / "signer", signed)
    for engine_file, fresh in ((plan, "unsigned"), (signed, "signed")):
        (tmp_path / f"{fresh}_triton_cache").mkdir()
        trusted_env = dict(env, TRITON_CACHE_DIR=str(tmp_path / f"{fresh}_triton_cache"),
                           SARTOR_CACHE_DIR=str(tmp_path / f"{fresh}_sartor_cache"), SARTOR_TRUST=str(tmp_path / "trust"))
        run = subprocess.run([sys.executable, "-c", _COLD_LOAD, str(engine_file), str(tmp_path / "images.npy"),
                              str(tmp_path / f"out_{fresh}.npy")], env=trusted_env, capture_output=True, text=True,
                             timeout=600, check=False)
        if engine_file == plan:
            assert run.returncode != 0 and "is not signed" in run.stderr, run.stderr[-3000:]
            assert not (tmp_path / "unsigned_sartor_cache").exists(), "nothing installed from a refused engine"
            continue
        assert run.returncode == 0, run.stderr[-3000:]
        events = json.loads(run.stdout.strip().splitlines()[-1])
        assert events["misses"] == 0 and sorted(events["installed"]) == sorted(e["key"] for e in record["entries"])

    opted_out = tmp_path / "opted_out_triton_cache"
    opted_out.mkdir()
    env = dict(env, TRITON_CACHE_DIR=str(opted_out), SARTOR_NO_KERNEL_INSTALL="1")
    run = subprocess.run([sys.executable, "-c", _COLD_LOAD, str(plan), str(tmp_path / "images.npy"),
                          str(tmp_path / "out_opted_out.npy")], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    events = json.loads(run.stdout.strip().splitlines()[-1])
    assert events["misses"] >= 1 and events["installed"] == [], events
    np.testing.assert_allclose(np.load(tmp_path / "out_opted_out.npy"), expected, rtol=0, atol=0)
