"""Compiled Triton kernels inside the engine file, so that loading on a fresh machine compiles nothing.

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
"""
from __future__ import annotations

import base64
import json
import logging
import os
import re
import shutil
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import torch

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
_FILE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-]{0,199}")
MAX_ENTRIES = 4096


@dataclass(frozen=True)
class KernelEntry:
    """One compiled kernel: its cache key and the files Triton needs to load it."""
    key: str
    name: str
    triton: str
    arch: str
    files: dict  # file name -> bytes

    @property
    def metadata_file(self) -> str:
        return next(f for f in self.files if f.endswith(METADATA_SUFFIX))

    @property
    def nbytes(self) -> int:
        return sum(len(b) for b in self.files.values())


def entry_key(kernel_hash: str) -> str:
    """The directory Triton's file cache gives a compilation hash (triton.runtime.cache._base32)."""
    return base64.b32encode(bytes.fromhex(kernel_hash)).decode("ascii").rstrip("=")


def _valid_file(name: str) -> bool:
    return (bool(_FILE.fullmatch(name)) and ".." not in name and not name.startswith(GROUP_PREFIX)
            and name.endswith((*BINARY_SUFFIXES, METADATA_SUFFIX)))


# ---- build: which kernels ran, and their files ------------------------------------------------

class KernelRecorder:
    """A Triton compilation listener (`triton.knobs.compilation.listener`): Triton calls it after
    every compile, cache hits included, with the entry's files ({file name: path})."""

    def __init__(self) -> None:
        self.groups: dict[str, dict[str, str]] = {}

    def __call__(self, **event) -> None:
        group = dict(event.get("metadata_group") or {})
        metadata = next((p for f, p in group.items() if f.endswith(METADATA_SUFFIX)), None)
        if metadata is not None:
            self.groups[metadata] = group


def entry_from_group(group: dict[str, str], triton_version: str = "") -> KernelEntry | None:
    """The entry a compile produced, from its files; None when it has no GPU binary to load.
    `triton_version`: the compiling Triton's, where the metadata does not say."""
    metadata_name = next((f for f in group if f.endswith(METADATA_SUFFIX) and not f.startswith(GROUP_PREFIX)), None)
    binaries = [f for f in group if f.endswith(BINARY_SUFFIXES)]
    if metadata_name is None or not binaries:
        return None
    raw = Path(group[metadata_name]).read_bytes()
    metadata = json.loads(raw)
    target = metadata.get("target") or {}
    files = {metadata_name: raw, **{f: Path(group[f]).read_bytes() for f in binaries}}
    return KernelEntry(entry_key(metadata["hash"]), str(metadata.get("name", metadata_name[:-5])),
                       str(metadata.get("triton_version") or triton_version), str(target.get("arch", "")), files)


def collect_entries(groups, triton_version: str = "") -> list[KernelEntry]:
    """The entries of the recorded compiles, one per key, in key order."""
    entries = {}
    for group in groups:
        entry = entry_from_group(group, triton_version)
        if entry is not None:
            entries[entry.key] = entry
    return [entries[k] for k in sorted(entries)]


# ---- the engine file: header record + uint8 tensors ------------------------------------------

def pack_kernels(entries: list[KernelEntry], triton_version: str) -> tuple[dict, dict[str, torch.Tensor]]:
    """The header record (`header["kernels"]`) and the tensors that carry the files."""
    tensors = {f"{TENSOR_PREFIX}{e.key}/{name}": torch.frombuffer(bytearray(data), dtype=torch.uint8)
               for e in entries for name, data in e.files.items()}
    record = {"embedded": True, "scheme": SCHEME, "triton": triton_version,
              "entries": [{"key": e.key, "name": e.name, "triton": e.triton, "arch": e.arch,
                           "files": {name: len(data) for name, data in e.files.items()}} for e in entries],
              "bytes": sum(e.nbytes for e in entries)}
    return record, tensors


def not_embedded(reason: str) -> dict:
    return {"embedded": False, "reason": reason, "entries": [], "bytes": 0}


def split_kernel_tensors(tensors: dict[str, torch.Tensor]) -> tuple[dict, dict]:
    """(the engine's own tensors, the kernel files' tensors)."""
    own = {k: t for k, t in tensors.items() if not k.startswith(TENSOR_PREFIX)}
    return own, {k: t for k, t in tensors.items() if k.startswith(TENSOR_PREFIX)}


def unpack_kernels(record: dict | None, tensors: dict[str, torch.Tensor]) -> tuple[list[KernelEntry], list[str]]:
    """The entries an engine carries, and a line per entry it carries malformed (skipped)."""
    if not record or not record.get("embedded"):
        return [], []
    if record.get("scheme") != SCHEME:
        return [], [f"kernel scheme {record.get('scheme')!r} is not {SCHEME!r}: all {len(record.get('entries', []))} "
                     f"embedded kernel(s) ignored"]
    entries, problems = [], []
    for item in list(record.get("entries") or [])[:MAX_ENTRIES]:
        key, files = str(item.get("key", "")), dict(item.get("files") or {})
        data = {name: tensors.get(f"{TENSOR_PREFIX}{key}/{name}") for name in files}
        valid = (_KEY.fullmatch(key) and files and all(_valid_file(n) for n in files)
                 and sum(n.endswith(METADATA_SUFFIX) for n in files) == 1
                 and any(n.endswith(BINARY_SUFFIXES) for n in files)
                 and all(t is not None and t.dtype == torch.uint8 and t.dim() == 1 and t.numel() == files[n]
                         for n, t in data.items()))
        if not valid:
            problems.append(f"kernel entry {key[:16]!r} is malformed: skipped")
            continue
        entries.append(KernelEntry(key, str(item.get("name", "")), str(item.get("triton", "")),
                                   str(item.get("arch", "")),
                                   {n: t.contiguous().numpy().tobytes() for n, t in data.items()}))
    return entries, problems


# ---- load: entries into the cache directory Triton reads --------------------------------------

@dataclass
class InstallReport:
    cache_dir: str | None
    installed: list = field(default_factory=list)  # keys written now
    present: list = field(default_factory=list)  # keys Triton already had (left as they are)
    busy: list = field(default_factory=list)  # keys whose directory holds files but no group (left alone)
    ignored: list = field(default_factory=list)  # one line per entry or reason not installed

    def describe(self) -> str:
        line = (f"{len(self.installed)} Triton kernel(s) installed, {len(self.present)} already cached"
                + (f", {len(self.busy)} being written by Triton" if self.busy else "")
                + (f", {len(self.ignored)} ignored" if self.ignored else ""))
        return line + (f" ({self.cache_dir})" if self.cache_dir else "")


def install_kernels(entries: list[KernelEntry], cache_dir: str | os.PathLike, triton_version: str,
                    arch: str) -> InstallReport:
    """Write each entry Triton's cache lacks, atomically (built in a temporary directory, then
    renamed into place), so that neither a concurrent load nor a running Triton sees half an entry.
    An existing entry is never overwritten. Entries of another Triton version or GPU arch are skipped."""
    root = Path(cache_dir)
    report = InstallReport(str(root))
    for entry in entries:
        if entry.triton != triton_version or entry.arch != str(arch):
            report.ignored.append(f"kernel {entry.name} ({entry.key[:12]}…) was compiled by Triton {entry.triton} "
                                  f"for arch {entry.arch}; this process runs Triton {triton_version} on arch {arch}")
            continue
        final = root / entry.key
        if (final / (GROUP_PREFIX + entry.metadata_file)).exists():
            report.present.append(entry.key)
            continue
        root.mkdir(parents=True, exist_ok=True)
        staging = root / f"tmp.sartor_{os.getpid()}_{uuid.uuid4().hex}"
        try:
            staging.mkdir()
            for name, data in entry.files.items():
                (staging / name).write_bytes(data)
            # The group names the files at their final place (Triton checks each path exists).
            group = {"child_paths": {name: str(final / name) for name in entry.files}}
            (staging / (GROUP_PREFIX + entry.metadata_file)).write_text(json.dumps(group))
            # rename(2) moves a directory onto a missing or empty one atomically, and fails on a
            # non-empty one: a lookup by Triton leaves an empty directory, a compile fills it.
            os.rename(staging, final)
            report.installed.append(entry.key)
        except OSError:
            if (final / (GROUP_PREFIX + entry.metadata_file)).exists():
                report.present.append(entry.key)
            elif final.is_dir() and any(final.iterdir()):
                report.busy.append(entry.key)
            else:
                raise
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return report


def triton_cache_dir() -> tuple[str | None, str]:
    """Where Triton's JIT in this process reads its cache (None and why when it is not a directory)."""
    try:
        from triton import knobs
    except ImportError:
        return None, "triton is not installed"
    if knobs.cache.manager_class is not None:
        return None, f"Triton uses the cache manager {knobs.cache.manager_class.__name__}, not its file cache"
    directory = knobs.cache.dir
    return (directory, "") if directory else (None, "Triton has no cache directory")


def cuda_arch(device: torch.device) -> str:
    """The GPU arch as Triton names it in a kernel's target (compute capability 9.0 → "90")."""
    major, minor = torch.cuda.get_device_capability(device)
    return str(major * 10 + minor)


def install_engine_kernels(header: dict, tensors: dict[str, torch.Tensor], arch: str) -> InstallReport | None:
    """Install the kernels an engine file carries into this process' Triton cache before its first
    run, for GPU arch `arch` (None when the file carries none)."""
    record = header.get("kernels")
    if not record or not record.get("embedded"):
        return None
    entries, problems = unpack_kernels(record, tensors)
    cache_dir, why_not = triton_cache_dir()
    if cache_dir is None:
        report = InstallReport(None, ignored=[f"{len(entries)} embedded kernel(s) not installed: {why_not}"])
    else:
        import triton
        try:
            report = install_kernels(entries, cache_dir, triton.__version__, arch)
        except OSError as exc:
            report = InstallReport(cache_dir, ignored=[f"embedded kernels not installed in {cache_dir}: "
                                                       f"{exc.strerror or exc}"])
    report.ignored[:0] = problems
    for line in report.ignored:
        log.warning("%s (the JIT compiles what is missing)", line)
    log.info("engine kernels: %s", report.describe())
    return report


def describe_record(record: dict | None, device_kind: str = "cuda") -> str:
    """One line for `sartor inspect` and the build log."""
    if not record:
        return ("none (CPU engine)" if device_kind == "cpu" else
                "none recorded (built before kernels were embedded): the first run on a fresh machine JIT-compiles")
    if not record.get("embedded"):
        return f"not embedded ({record.get('reason', '')}): the first run on a fresh machine JIT-compiles them"
    entries = record.get("entries") or []
    if not entries:
        return "none: no layer of this engine runs a Triton kernel"
    arches = sorted({str(e.get("arch")) for e in entries})
    names = sorted({e.get("name", "") for e in entries})
    return (f"{len(entries)} Triton kernel(s) embedded, {record.get('bytes', 0) / 1024:.1f} KiB (Triton "
            f"{record.get('triton')}{', sm_' + '/'.join(arches) if arches else ''})"
            + (f": {', '.join(names)}" if names else ""))
