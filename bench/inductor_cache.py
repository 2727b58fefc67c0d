"""torch.compile max-autotune's autotuning results carried from one device call to the next, so a
compile longer than one call (EfficientNet-B0 at batch 256: 42 ops benchmarked in ~500 s when the
call ran out, session 23) finishes in a second call that skips the ops already benchmarked.

    python bench/inductor_cache.py export --cache DIR --out autotune_cache.tgz \\
        [--progress autotune_progress.json] [--previous OLD.tgz]
    python bench/inductor_cache.py restore --archive autotune_cache.tgz --cache DIR

DIR is the compile's TORCHINDUCTOR_CACHE_DIR. Only inductor's small result files travel (nothing
compiled), each written by inductor as soon as its op or kernel is tuned, so a compile killed midway
leaves every finished op's result behind:

- `cache/<system hash>`: PersistentCache's JSON, for every GEMM/convolution op (op name, input
  shapes and strides) the benchmarked time of every choice. It is rewritten atomically after each
  op's benchmark. An op whose choices are all in it is neither precompiled nor benchmarked again
  (select_algorithm's make_precompile_fn and do_autotuning both look it up first). Its name hashes
  the GPU's name, the CUDA version and Triton's key, so it only serves the same device image.
- `<xx>/<kernel hash>.best_config`: the winning Triton config of each pointwise/reduction kernel
  (coordinate descent included), written beside the kernel's source the first time it runs; with
  it the kernel runs its one config untuned. Its name hashes the kernel's source and torch's own.

Both formats are torch's (stable from 2.4 to 2.14); this module keys nothing else on torch and does
not import it. The archive also holds manifest.json: the files, the ops counted, and the cells
whose compile the calls ran, with how long an interrupted one had run (from the progress file
bench/h200_table.py writes), so the call that finishes a compile can report the earlier calls'
time beside its own.
"""
from __future__ import annotations

import argparse
import io
import json
import os
import re
import sys
import tarfile
import time
import zlib
from dataclasses import dataclass
from pathlib import Path

MANIFEST = "manifest.json"
PERSISTENT_DIR = "cache"  # PersistentCache's folder under the inductor cache dir
BEST_CONFIG = ".best_config"
MAX_FILE_BYTES = 4 << 20  # a result file is KiBs; anything this large is not one
SAFE_PART = re.compile(r"[A-Za-z0-9_.-]+")


class CacheArchiveError(Exception):
    """An archive that cannot be restored; the message is one line."""


@dataclass
class Restored:
    files: int  # result files written into the cache dir
    manifest: dict


def _cell(entry: dict) -> tuple:
    return entry.get("model"), entry.get("batch")


def _json_object(data: bytes) -> dict | None:
    try:
        value = json.loads(data)
    except (ValueError, UnicodeDecodeError):
        return None
    return value if isinstance(value, dict) else None


def _is_result_path(relative: str) -> bool:
    """`cache/<name>` or `<dirs>/<name>.best_config`, every part a plain name: what export writes
    and the only paths restore will write (no absolute paths, no `..`)."""
    parts = relative.split("/")
    if not all(SAFE_PART.fullmatch(part) and part not in (".", "..") for part in parts):
        return False
    if len(parts) == 2 and parts[0] == PERSISTENT_DIR:
        return True
    return len(parts) >= 2 and parts[-1].endswith(BEST_CONFIG) and parts[0] != PERSISTENT_DIR


def _candidates(cache_dir: Path) -> list[tuple[str, Path]]:
    """(relative path, path) of every regular file where inductor keeps autotuning results."""
    if not cache_dir.is_dir():
        return []
    paths = list((cache_dir / PERSISTENT_DIR).glob("*")) + list(cache_dir.rglob(f"*{BEST_CONFIG}"))
    found = {path.relative_to(cache_dir).as_posix(): path for path in paths
             if not path.is_symlink() and path.is_file()}
    return sorted((relative, path) for relative, path in found.items() if _is_result_path(relative))


def oversized_files(cache_dir: Path) -> list[str]:
    """Result files too large to carry (none expected: each is KiBs), so that export can say so."""
    return [relative for relative, path in _candidates(cache_dir) if path.stat().st_size > MAX_FILE_BYTES]


def result_files(cache_dir: Path) -> list[str]:
    """The autotuning results under `cache_dir`, as sorted relative paths: complete JSON files only
    (a kill mid-write of a best_config leaves a torn file that would fail the next compile)."""
    return [relative for relative, path in _candidates(cache_dir)
            if path.stat().st_size <= MAX_FILE_BYTES and _json_object(path.read_bytes()) is not None]


def _persistent_ops(document: dict) -> int:
    """Ops (op name × input key) recorded in one PersistentCache document."""
    cache = document.get("cache")
    if not isinstance(cache, dict):
        return 0
    return sum(len(inputs) for inputs in cache.values() if isinstance(inputs, dict))


def autotune_op_count(cache_dir: Path) -> int:
    """GEMM/convolution ops whose choices have been benchmarked into `cache_dir`'s PersistentCache."""
    total = 0
    for relative in result_files(cache_dir):
        if relative.startswith(PERSISTENT_DIR + "/"):
            total += _persistent_ops(_json_object((cache_dir / relative).read_bytes()) or {})
    return total


def mark_compile(progress: Path, model: str, batch: int, compile_s: float | None = None) -> None:
    """Record in `progress` that a cell's compile started now (`compile_s` None) or finished, so an
    export after a kill can tell how long the interrupted compile had run."""
    cells = json.loads(progress.read_text()) if progress.is_file() else []
    if compile_s is None:
        cells = [c for c in cells if _cell(c) != (model, batch)]
        cells.append({"model": model, "batch": batch, "started_unix": time.time()})
    for cell in cells:
        if compile_s is not None and _cell(cell) == (model, batch):
            cell["compile_s"] = round(compile_s, 1)
    _write_atomic(progress, json.dumps(cells, indent=1).encode())


def _cells_from_progress(progress: Path | None, now: float) -> list[dict]:
    if progress is None or not progress.is_file():
        return []
    cells = []
    for cell in json.loads(progress.read_text()):
        entry = {"model": cell["model"], "batch": cell["batch"]}
        if "compile_s" in cell:
            entry["compile_s"] = cell["compile_s"]
        else:
            entry["interrupted_after_s"] = round(now - cell["started_unix"], 1)
        cells.append(entry)
    return cells


def earlier_compile_s(manifest: dict | None, model: str, batch: int) -> float:
    """Seconds that earlier calls spent on this cell's compile before they were cut off."""
    if not manifest:
        return 0.0
    cells = list(manifest.get("history", [])) + list(manifest.get("cells", []))
    return round(sum(c.get("interrupted_after_s", 0.0) for c in cells if _cell(c) == (model, batch)), 1)


def archive_has_cell(manifest: dict | None, model: str, batch: int) -> bool:
    cells = list((manifest or {}).get("history", [])) + list((manifest or {}).get("cells", []))
    return any(_cell(c) == (model, batch) for c in cells)


def _write_atomic(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def _read_manifest(archive: Path | None) -> dict | None:
    """The manifest of an earlier archive, or None where there is none or it is unreadable (the
    new archive then starts its own history)."""
    if archive is None or not archive.is_file():
        return None
    try:
        return _read_archive(archive)[1]
    except CacheArchiveError:
        return None


def export_results(cache_dir: Path, archive: Path, progress: Path | None = None,
                   previous: Path | None = None) -> dict | None:
    """Write the result files of `cache_dir` and a manifest to the gzipped tar `archive`; the
    manifest, or None (no archive written) where the cache holds no results."""
    files = result_files(cache_dir)
    if not files:
        return None
    now = time.time()
    earlier = _read_manifest(previous)
    manifest = {
        "format": 1,
        "created_unix": round(now, 1),
        "files": len(files),
        "best_configs": sum(f.endswith(BEST_CONFIG) for f in files),
        "autotune_ops": autotune_op_count(cache_dir),
        "left_out_oversized": oversized_files(cache_dir),
        "cells": _cells_from_progress(progress, now),
        "history": (earlier.get("history", []) + earlier.get("cells", [])) if earlier else [],
    }
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        for name, data in [(MANIFEST, json.dumps(manifest, indent=1).encode())] + [
                (f, (cache_dir / f).read_bytes()) for f in files]:
            info = tarfile.TarInfo(name)
            info.size, info.mtime, info.mode = len(data), int(now), 0o644
            tar.addfile(info, io.BytesIO(data))
    _write_atomic(archive, buffer.getvalue())
    return manifest


def _read_archive(archive: Path) -> tuple[dict[str, bytes], dict]:
    """({relative path: bytes}, manifest) of a whole archive, every member checked first."""
    def fail(reason: str) -> CacheArchiveError:
        return CacheArchiveError(f"{archive}: not a usable autotune archive ({reason})".replace("\n", " "))
    members: dict[str, bytes] = {}
    try:
        with tarfile.open(archive, mode="r:gz") as tar:
            for member in tar:
                if not member.isfile() or member.size > MAX_FILE_BYTES:
                    raise fail(f"member {member.name!r} is not a small regular file")
                if member.name != MANIFEST and not _is_result_path(member.name):
                    raise fail(f"member {member.name!r} is not an autotune result path")
                data = tar.extractfile(member).read()
                if _json_object(data) is None:
                    raise fail(f"member {member.name!r} is not a JSON object")
                members[member.name] = data
    except (tarfile.TarError, OSError, EOFError, zlib.error) as exc:
        raise fail(f"{type(exc).__name__}: {exc}") from None
    if MANIFEST not in members:
        raise fail("no manifest.json")
    manifest = _json_object(members.pop(MANIFEST))
    return members, manifest


def _merge(into: dict, new: dict) -> dict:
    """`new`'s entries added to `into`; where both hold a value, `into`'s stays (this machine's
    own measurement over a carried one)."""
    for key, value in new.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            _merge(into[key], value)
        else:
            into.setdefault(key, value)
    return into


def restore_results(archive: Path, cache_dir: Path) -> Restored | None:
    """Put an archive's result files into `cache_dir` before a compile; None where `archive` does
    not exist. Raises CacheArchiveError (one line), writing nothing, when it cannot be read."""
    if not archive.is_file():
        return None
    members, manifest = _read_archive(archive)
    for relative, data in members.items():
        target = cache_dir / relative
        existing = _json_object(target.read_bytes()) if target.is_file() else None
        if existing is not None and relative.startswith(PERSISTENT_DIR + "/"):
            data = json.dumps(_merge(existing, json.loads(data)), indent=4).encode()
        elif existing is not None:
            continue  # a best_config this cache already holds
        _write_atomic(target, data)
    return Restored(files=len(members), manifest=manifest)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    export = sub.add_parser("export", help="archive the autotuning results of an inductor cache dir")
    export.add_argument("--cache", type=Path, required=True)
    export.add_argument("--out", type=Path, required=True)
    export.add_argument("--progress", type=Path, default=None, help="bench/h200_table.py's autotune_progress.json")
    export.add_argument("--previous", type=Path, default=None, help="the archive this call restored (its history)")
    restore = sub.add_parser("restore", help="put an archive's results into an inductor cache dir")
    restore.add_argument("--archive", type=Path, required=True)
    restore.add_argument("--cache", type=Path, required=True)
    args = parser.parse_args(argv)
    if args.command == "export":
        manifest = export_results(args.cache, args.out, args.progress, args.previous)
        if manifest is None:
            print(f"export: no autotuning results under {args.cache}; nothing written")
        else:
            print(f"export: {args.out} {args.out.stat().st_size} bytes, {manifest['autotune_ops']} ops, "
                  f"{manifest['best_configs']} best configs, left out (too large) {manifest['left_out_oversized']}, "
                  f"cells {manifest['cells']}")
        return 0
    try:
        restored = restore_results(args.archive, args.cache)
    except CacheArchiveError as exc:
        print(f"restore: {exc}", file=sys.stderr)
        return 2
    print(f"restore: {args.archive} absent, nothing restored" if restored is None
          else f"restore: {restored.files} files into {args.cache}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
