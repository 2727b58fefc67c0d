"""Compiled Triton kernels inside the engine file, so that a fresh machine compiles nothing at the
shapes the build ran (each profile's min, opt and max; other sizes inside a profile may compile once).

Triton's JIT keeps each compiled kernel on disk as one *cache entry*: a directory named by the
compilation's key (base32 of the SHA-256 of the kernel source, its specialization, the compile
options and the Triton build) under `triton.knobs.cache.dir` (`$TRITON_CACHE_DIR`, by default
`~/.triton/cache`). The entry holds one file per compilation stage (`.source`, `.ttir`, `.ttgir`,
`.llir`, `.ptx`, `.cubin`), the kernel's metadata (`<name>.json`) and the group file
`__grp__<name>.json` that lists them by absolute path. A later compile of the same key reads the
group, checks that every listed file exists, and loads the binary and the metadata without compiling.

So an engine carries, per kernel its tactics run, only the binary and the metadata (what Triton
itself keeps under TRITON_STORE_BINARY_ONLY) as uint8 tensors `__kernels__/<key>/<file>`, and loading
writes them back as entries with a group file that points at their new place. Host code (Triton's
compiled launcher modules, `.so`) is never stored: loading an engine must not be able to run code on
the host.

Loading installs them only from an engine the caller trusts (one that verified against a trust
store, or any when no trust store is set and installation is not turned off) and only into the
engine's private directory (kernel_cache.py), never into Triton's user-wide cache. An entry is
written only when what Triton will load agrees with where it lands: the key is the one Triton
derives from the metadata's own hash, the kernel is one sartor ships, and the metadata's arch is
this GPU's. That keeps a file from serving another program's keys or corrupt metadata; it cannot
prove that a cubin is the compile of sartor's source: the signature says who made it.
"""
from __future__ import annotations

import base64
import importlib
import json
import logging
import os
import pkgutil
import re
import shutil
import uuid
from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path

import torch

from . import kernel_cache
from .launchers import parse_signature, record_signature

log = logging.getLogger("sartor.runtime")

# How entries are named and laid out; a reader that meets another scheme ignores the kernels.
SCHEME = "triton-file-cache/1"
TENSOR_PREFIX = "__kernels__/"
GROUP_PREFIX = "__grp__"
# The GPU binary Triton loads on a cache hit (cubin: NVIDIA) and the metadata beside it.
BINARY_SUFFIXES = (".cubin",)
METADATA_SUFFIX = ".json"
# Bounds on what an engine file may ask loading to write (the names come from its header).
_KEY = re.compile(r"[A-Z2-7]{16,128}")
_KERNEL_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,199}")
_HASH = re.compile(r"[0-9a-f]{64}")  # Triton's compilation hash: a SHA-256 hex digest
# Triton names an entry's files after the kernel, cut to this many characters (compiler.compile).
_FILE_STEM_CHARS = 150
MAX_ENTRIES = 4096
# Set (to anything but "0") to compile engines' kernels here rather than run the binaries they carry.
NO_INSTALL_ENV = "SARTOR_NO_KERNEL_INSTALL"


@dataclass(frozen=True)
class KernelEntry:
    """One compiled kernel: its cache key and the files Triton needs to load it."""
    key: str
    name: str
    triton: str
    arch: str
    files: dict  # file name -> bytes
    # The kernel's argument types, from which Triton generates its host launcher (launchers.py);
    # None where the engine does not record them (built before they were).
    signature: tuple | None = None

    @property
    def metadata_file(self) -> str:
        return next(f for f in self.files if f.endswith(METADATA_SUFFIX))

    @property
    def nbytes(self) -> int:
        return sum(len(b) for b in self.files.values())


def entry_key(kernel_hash: str) -> str:
    """The directory Triton's file cache gives a compilation hash (triton.runtime.cache._base32)."""
    return base64.b32encode(bytes.fromhex(kernel_hash)).decode("ascii").rstrip("=")


def _valid_files(kernel: str, files: Collection[str]) -> bool:
    """The name rule: an entry of kernel `kernel` carries exactly the files Triton's cache entry of it
    loads, `<kernel>.json` and `<kernel>.cubin`. Paths, host code (a launcher `.so`), group files and
    any other name are refused: they come from the file's header."""
    stem = kernel[:_FILE_STEM_CHARS]
    metadata, binaries = stem + METADATA_SUFFIX, {stem + suffix for suffix in BINARY_SUFFIXES}
    return (bool(_KERNEL_NAME.fullmatch(kernel)) and metadata in files and any(b in files for b in binaries)
            and all(name == metadata or name in binaries for name in files))


def sartor_kernel_names() -> frozenset[str]:
    """The names of the Triton functions sartor ships (every module under sartor/kernels/, its
    sub-packages walked): the only kernels an engine may install. Under TRITON_INTERPRET they are interpreter objects; both kinds keep the
    Python function in `.fn` (and Autotuner/Heuristics wrap them in `.fn` too)."""
    try:
        from triton.runtime.jit import JITFunction
    except ImportError:
        return frozenset()
    kinds: tuple[type, ...] = (JITFunction,)
    try:
        from triton.runtime.interpreter import InterpretedFunction
        kinds += (InterpretedFunction,)
    except ImportError:
        pass
    from .. import kernels as package
    names = set()
    for module_info in pkgutil.walk_packages(package.__path__, prefix=f"{package.__name__}."):
        module = importlib.import_module(module_info.name)
        for value in vars(module).values():
            for _ in range(4):
                if isinstance(value, kinds):
                    names.add(value.fn.__name__)
                    break
                value = getattr(value, "fn", None)
                if value is None:
                    break
    return frozenset(names)


# ---- build: which kernels ran, and their files ------------------------------------------------

class KernelRecorder:
    """A Triton compilation listener (`triton.knobs.compilation.listener`): Triton calls it after
    every compile, cache hits included, with the entry's files ({file name: path}) and its source,
    whose argument types (the launcher's signature) the metadata does not keep."""

    def __init__(self) -> None:
        self.groups: dict[str, dict[str, str]] = {}
        self.signatures: dict[str, list] = {}  # metadata path -> the kernel's argument types

    def __call__(self, **event) -> None:
        group = dict(event.get("metadata_group") or {})
        name = metadata_file(group)
        metadata = group[name] if name is not None else None
        if metadata is not None:
            self.groups[metadata] = group
            types = getattr(getattr(event.get("src"), "signature", None), "values", None)
            signature = record_signature(types()) if callable(types) else None
            if signature is not None:
                self.signatures[metadata] = signature

    def entries(self, triton_version: str = "") -> list[KernelEntry]:
        """The entries of the recorded compiles, one per key, in key order."""
        return collect_entries(self.groups.values(), triton_version, self.signatures)


def metadata_file(group: dict[str, str]) -> str | None:
    """The name of a compile's metadata file among its group's files (not the group file itself)."""
    return next((f for f in group if f.endswith(METADATA_SUFFIX) and not f.startswith(GROUP_PREFIX)), None)


def entry_from_group(group: dict[str, str], triton_version: str = "",
                     signature: list | None = None) -> KernelEntry | None:
    """The entry a compile produced, from its files; None when it has no GPU binary to load.
    `triton_version`: the compiling Triton's, where the metadata does not say; `signature`: the
    kernel's argument types, as the recorder took them from its source."""
    metadata_name = metadata_file(group)
    binaries = [f for f in group if f.endswith(BINARY_SUFFIXES)]
    if metadata_name is None or not binaries:
        return None
    raw = Path(group[metadata_name]).read_bytes()
    metadata = json.loads(raw)
    target = metadata.get("target") or {}
    files = {metadata_name: raw, **{f: Path(group[f]).read_bytes() for f in binaries}}
    return KernelEntry(entry_key(metadata["hash"]), str(metadata.get("name", metadata_name[:-5])),
                       str(metadata.get("triton_version") or triton_version), str(target.get("arch", "")), files,
                       parse_signature(signature))


def collect_entries(groups, triton_version: str = "", signatures: dict | None = None) -> list[KernelEntry]:
    """The entries of the recorded compiles, one per key, in key order. `signatures`: argument
    types by metadata path (KernelRecorder.signatures)."""
    entries = {}
    for group in groups:
        name = metadata_file(group)
        entry = entry_from_group(group, triton_version, (signatures or {}).get(group[name]) if name else None)
        if entry is not None:
            entries[entry.key] = entry
    return [entries[k] for k in sorted(entries)]


# ---- the engine file: header record + uint8 tensors ------------------------------------------

def pack_kernels(entries: list[KernelEntry], triton_version: str) -> tuple[dict, dict[str, torch.Tensor]]:
    """The header record (`header["kernels"]`) and the tensors that carry the files."""
    tensors = {f"{TENSOR_PREFIX}{e.key}/{name}": torch.frombuffer(bytearray(data), dtype=torch.uint8)
               for e in entries for name, data in e.files.items()}
    record = {"embedded": True, "scheme": SCHEME, "triton": triton_version,
              "entries": [_entry_item(e) for e in entries],
              "bytes": sum(e.nbytes for e in entries)}
    return record, tensors


def _entry_item(entry: KernelEntry) -> dict:
    item = {"key": entry.key, "name": entry.name, "triton": entry.triton, "arch": entry.arch,
            "files": {name: len(data) for name, data in entry.files.items()}}
    if entry.signature is not None:
        item["signature"] = record_signature(entry.signature)
    return item


def not_embedded(reason: str) -> dict:
    return {"embedded": False, "reason": reason, "entries": [], "bytes": 0}


def split_kernel_tensors(tensors: dict[str, torch.Tensor]) -> tuple[dict, dict]:
    """(the engine's own tensors, the kernel files' tensors)."""
    own = {k: t for k, t in tensors.items() if not k.startswith(TENSOR_PREFIX)}
    return own, {k: t for k, t in tensors.items() if k.startswith(TENSOR_PREFIX)}


def is_embedded(record) -> bool:
    """Whether a header's `kernels` record says the file carries kernels (any JSON value is accepted)."""
    return isinstance(record, dict) and bool(record.get("embedded"))


def record_entries(record) -> list:
    """The record's entry list as written (empty where the record or its list is malformed)."""
    entries = record.get("entries") if isinstance(record, dict) else None
    return entries if isinstance(entries, list) else []


def _malformed_record(record) -> str | None:
    """Why a whole `kernels` record cannot be read (None when its entries can be, one by one)."""
    if not isinstance(record, dict):
        return f"the engine's kernels record is a {type(record).__name__}, not an object: embedded kernels ignored"
    entries = record.get("entries") or []
    if not isinstance(entries, list):
        return f"the engine's kernel entries are a {type(entries).__name__}, not a list: embedded kernels ignored"
    return None


def _other_scheme(record: dict) -> str | None:
    if record.get("scheme") == SCHEME:
        return None
    return (f"kernel scheme {record.get('scheme')!r} is not {SCHEME!r}: all {len(record_entries(record))} "
            f"embedded kernel(s) ignored")


def _entry_label(item) -> str:
    key = item.get("key") if isinstance(item, dict) else None
    return repr(key[:16]) if isinstance(key, str) else f"<{type(item).__name__}>"


def _entry_from_item(item, tensors: dict[str, torch.Tensor]) -> KernelEntry | None:
    """The entry one header item describes, its files read from `tensors`; None if malformed."""
    if not isinstance(item, dict):
        return None
    key, name, files = item.get("key"), item.get("name"), item.get("files")
    if not (isinstance(key, str) and _KEY.fullmatch(key) and isinstance(name, str) and isinstance(files, dict)
            and _valid_files(name, files)):
        return None
    data = {file: tensors.get(f"{TENSOR_PREFIX}{key}/{file}") for file in files}
    for file, tensor in data.items():
        size = files[file]
        if not (isinstance(tensor, torch.Tensor) and tensor.dtype == torch.uint8 and tensor.dim() == 1
                and tensor.numel() == size):
            return None
    # A signature that is absent or not one Triton names only costs the launcher's build at load.
    return KernelEntry(key, name, str(item.get("triton", "")), str(item.get("arch", "")),
                       {file: t.contiguous().numpy().tobytes() for file, t in data.items()},
                       parse_signature(item.get("signature")))


def unpack_kernels(record, tensors: dict[str, torch.Tensor]) -> tuple[list[KernelEntry], list[str]]:
    """The entries an engine carries, and a line per entry it carries malformed (skipped), or one
    line when the whole record is. Total over any JSON value: the record comes from the file."""
    if not record or (isinstance(record, dict) and not record.get("embedded")):
        return [], []
    problem = _malformed_record(record) or _other_scheme(record)
    if problem is not None:
        return [], [problem]
    items = record_entries(record)
    entries, problems = [], []
    if len(items) > MAX_ENTRIES:
        problems.append(f"{len(items) - MAX_ENTRIES} kernel entries beyond the first {MAX_ENTRIES}: skipped")
    for item in items[:MAX_ENTRIES]:
        entry = _entry_from_item(item, tensors)
        if entry is None:
            problems.append(f"kernel entry {_entry_label(item)} is malformed: skipped")
        else:
            entries.append(entry)
    return entries, problems


# ---- load: entries into the cache directory Triton reads --------------------------------------

@dataclass
class InstallReport:
    cache_dir: str | None  # the engine's private directory
    installed: list = field(default_factory=list)  # keys written now
    present: list = field(default_factory=list)  # keys installed before with the same files (left as they are)
    busy: list = field(default_factory=list)  # keys whose directory holds files but no group (left alone)
    ignored: list = field(default_factory=list)  # one line per entry or reason not installed
    # The entries of `installed` and `present`: the kernels whose host modules load builds (launchers.py).
    entries: list = field(default_factory=list, repr=False)

    def describe(self) -> str:
        line = (f"{len(self.installed)} Triton kernel(s) installed, {len(self.present)} already cached"
                + (f", {len(self.busy)} being written by Triton" if self.busy else "")
                + (f", {len(self.ignored)} ignored" if self.ignored else ""))
        return line + (f" ({self.cache_dir})" if self.cache_dir else "")


def _content_problem(entry: KernelEntry, triton_version: str, arch: str, kernel_names: Collection[str]) -> str | None:
    """Why `entry` must not be written to Triton's cache, or None. The header names the key, kernel
    and arch; the metadata Triton will load must agree with each, so that an entry lands only under
    the key Triton gives that metadata, for a kernel sartor ships and this GPU."""
    label = f"kernel {entry.name} ({entry.key[:12]}…)"
    if entry.triton != triton_version or entry.arch != str(arch):
        return (f"{label} was compiled by Triton {entry.triton} for arch {entry.arch}; this process runs "
                f"Triton {triton_version} on arch {arch}")
    try:
        metadata = json.loads(entry.files[entry.metadata_file])
    except ValueError:  # JSONDecodeError and UnicodeDecodeError both are
        metadata = None
    if not isinstance(metadata, dict):
        return f"{label}: its metadata is not a JSON object: not installed"
    kernel_hash = metadata.get("hash")
    if not (isinstance(kernel_hash, str) and _HASH.fullmatch(kernel_hash) and entry_key(kernel_hash) == entry.key):
        return f"{label}: its key is not the one Triton derives from its metadata's hash: not installed"
    if metadata.get("name") != entry.name:
        return f"{label}: its metadata names kernel {metadata.get('name')!r}: not installed"
    if entry.name not in kernel_names:
        return f"{label}: not a Triton kernel sartor ships: not installed"
    target = metadata.get("target")
    built_for = target.get("arch") if isinstance(target, dict) else None
    if str(built_for) != entry.arch:
        return f"{label}: its metadata targets arch {built_for}, not {entry.arch}: not installed"
    return None


def _holds(final: Path, entry: KernelEntry) -> bool:
    """Whether the entry directory `final` holds exactly `entry`'s files and a group naming them there."""
    group = {"child_paths": {name: str(final / name) for name in entry.files}}
    try:
        if json.loads((final / (GROUP_PREFIX + entry.metadata_file)).read_text()) != group:
            return False
        return all((final / name).read_bytes() == data for name, data in entry.files.items())
    except (OSError, ValueError):
        return False


def install_kernels(entries: list[KernelEntry], cache_dir: str | os.PathLike, triton_version: str,
                    arch: str, kernel_names: Collection[str] | None = None) -> InstallReport:
    """Write each entry into `cache_dir` (an engine's private directory) atomically: built in a
    temporary directory, then renamed into place, so that neither a concurrent load nor a running
    Triton sees half an entry. An entry already there with the same files is left as it is; one
    whose files differ (edited on disk) is replaced. Entries of another Triton version or GPU arch,
    of a kernel not in `kernel_names` (by default sartor's) or whose metadata disagrees with the
    header are skipped with a line."""
    root = Path(cache_dir)
    report = InstallReport(str(root))
    kernel_names = sartor_kernel_names() if kernel_names is None else kernel_names
    for entry in entries:
        problem = _content_problem(entry, triton_version, str(arch), kernel_names)
        if problem is not None:
            report.ignored.append(problem)
            continue
        final = root / entry.key
        if _holds(final, entry):
            report.present.append(entry.key)
            continue
        kernel_cache.make_private(root)
        staging = root / f"tmp.sartor_{os.getpid()}_{uuid.uuid4().hex}"
        stale = None
        try:
            staging.mkdir()
            for name, data in entry.files.items():
                (staging / name).write_bytes(data)
            # The group names the files at their final place (Triton checks each path exists).
            group = {"child_paths": {name: str(final / name) for name in entry.files}}
            (staging / (GROUP_PREFIX + entry.metadata_file)).write_text(json.dumps(group))
            if (final / (GROUP_PREFIX + entry.metadata_file)).exists():
                if _holds(final, entry):  # a concurrent load installed it meanwhile
                    report.present.append(entry.key)
                    continue
                # Files that differ from what the engine carries (edited on disk): moved aside, replaced.
                stale = root / f"tmp.stale_{os.getpid()}_{uuid.uuid4().hex}"
                os.rename(final, stale)
            # rename(2) moves a directory onto a missing or empty one atomically, and fails on a
            # non-empty one: a lookup by Triton leaves an empty directory, a compile fills it.
            os.rename(staging, final)
            report.installed.append(entry.key)
        except OSError:
            if _holds(final, entry):  # a concurrent load installed the same entry
                report.present.append(entry.key)
            elif final.is_dir() and any(final.iterdir()):
                report.busy.append(entry.key)
            else:
                raise
        finally:
            shutil.rmtree(staging, ignore_errors=True)
            if stale is not None:
                shutil.rmtree(stale, ignore_errors=True)
    served = set(report.installed) | set(report.present)
    report.entries = [entry for entry in entries if entry.key in served]
    return report


def cuda_arch(device: torch.device) -> str:
    """The GPU arch as Triton names it in a kernel's target (compute capability 9.0 → "90")."""
    major, minor = torch.cuda.get_device_capability(device)
    return str(major * 10 + minor)


def install_refusal(install_kernels: bool = True) -> str:
    """Why this load must not install an engine's kernels ("" when it may): the caller said so, or
    the environment (`SARTOR_NO_KERNEL_INSTALL=1`) does."""
    if not install_kernels:
        return "sartor.load(install_kernels=False)"
    if os.environ.get(NO_INSTALL_ENV, "") not in ("", "0"):
        return f"{NO_INSTALL_ENV}={os.environ[NO_INSTALL_ENV]}"
    return ""


def install_engine_kernels(header: dict, tensors: dict[str, torch.Tensor], arch: str, refusal: str = "",
                           kernel_names: Collection[str] | None = None, *, digest: str,
                           root: Path | None = None) -> InstallReport | None:
    """Install the kernels an engine file carries into its private directory (kernel_cache.py: by
    the engine's checksum `digest`, under `root` or the private root) and make this process's Triton
    read them there, before the engine's first run, for GPU arch `arch`. None when the file carries
    none. With a `refusal` (install_refusal), nothing is written and the JIT compiles them as it
    would without the file's kernels."""
    record = header.get("kernels")
    entries, problems = unpack_kernels(record, tensors)
    if not is_embedded(record) and not problems:
        return None
    if refusal:
        report = InstallReport(None, ignored=[f"{len(entries)} embedded kernel(s) not installed: {refusal}"])
        log.info("engine kernels: %s (the JIT compiles them)", report.ignored[0])
        return report
    why_not = kernel_cache.foreign_manager()
    directory = kernel_cache.engine_directory(digest, root)
    if why_not:
        report = InstallReport(None, ignored=[f"{len(entries)} embedded kernel(s) not installed: {why_not}"])
    else:
        import triton
        try:
            report = install_kernels(entries, directory, triton.__version__, arch, kernel_names)
            report.ignored += kernel_cache.serve_entries(directory, report.installed + report.present)
        except OSError as exc:
            report = InstallReport(str(directory), ignored=[f"embedded kernels not installed in {directory}: "
                                                            f"{exc.strerror or exc}"])
    report.ignored[:0] = problems
    for line in report.ignored:
        log.warning("%s (the JIT compiles what is missing)", line)
    log.info("engine kernels: %s", report.describe())
    return report


def describe_record(record, device_kind: str = "cuda") -> str:
    """One line for `sartor inspect` and the build log (any JSON value: the record comes from the file)."""
    if not record:
        return ("none (CPU engine)" if device_kind == "cpu" else
                "none recorded (built before kernels were embedded): the first run on a fresh machine JIT-compiles")
    if isinstance(record, dict) and not record.get("embedded"):
        return f"not embedded ({record.get('reason', '')}): the first run on a fresh machine JIT-compiles them"
    malformed = _malformed_record(record)
    if malformed is not None:
        return f"malformed ({malformed}): the first run on a fresh machine JIT-compiles them"
    entries = record_entries(record)
    if not entries:
        return "none: no layer of this engine runs a Triton kernel"
    items = [e for e in entries if isinstance(e, dict)]
    arches = sorted({str(e.get("arch")) for e in items})
    names = sorted({str(e.get("name", "")) for e in items})
    size = record.get("bytes")
    kib = size / 1024 if isinstance(size, (int, float)) and not isinstance(size, bool) else 0.0
    return (f"{len(entries)} Triton kernel(s) embedded, {kib:.1f} KiB (Triton "
            f"{record.get('triton')}{', sm_' + '/'.join(arches) if arches else ''})"
            + (f": {', '.join(names)}" if names else "")
            + (f" [{_other_scheme(record)}]" if _other_scheme(record) else ""))
