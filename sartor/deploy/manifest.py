"""A bundle's manifest: every file of the bundle with its SHA-256 and size, written last, checked
first. A bundle whose files differ from it (edited, missing or added) is refused in one line.

    {"format": "sartor-bundle-1", "files": {"model.onnx": {"sha256": ..., "bytes": N}, ...}}

The manifest proves that a bundle is whole, not who made it: a bundle rewritten together with its
manifest verifies (the engine's Ed25519 signature, issue 31 part 1, is what says who built it).
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from ..errors import SartorError
from ..runtime.engine_file import write_atomic

FORMAT = "sartor-bundle-1"
MANIFEST = "manifest.json"
# The files of a bundle (bundle.py's docstring), named here so that the device side (preflight,
# update) reads a bundle without importing bundle.py, which builds and so needs the build extra.
MODEL = "model.onnx"
OPTIONS = "build_options.json"
CALIB_CACHE = "calibration_cache.json"
TIMING_CACHE = "timing_cache.json"
ENGINE = "engine.json"
ENGINE_HEADER = "engine_header.json"
SAMPLES = "calibration/samples.json"
SAMPLES_DIR = "calibration/samples"
GOLDEN = "golden"
_CHUNK = 1 << 20


class BundleError(SartorError):
    """A provenance bundle is missing, malformed, tampered with, or cannot be written."""


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(_CHUNK), b""):
            digest.update(chunk)
    return digest.hexdigest()


def bundle_files(root: Path) -> list[str]:
    """Every regular file under `root` but the manifest, as sorted '/'-separated relative paths."""
    found = []
    for directory, _, names in os.walk(root):
        for name in names:
            relative = (Path(directory) / name).relative_to(root).as_posix()
            if relative != MANIFEST:
                found.append(relative)
    return sorted(found)


def write_manifest(root: Path) -> dict:
    """Hash every file under `root` into its manifest.json; returns the manifest."""
    files = {name: {"sha256": file_sha256(root / name), "bytes": (root / name).stat().st_size}
             for name in bundle_files(root)}
    manifest = {"format": FORMAT, "files": files}
    write_atomic(root / MANIFEST, (json.dumps(manifest, indent=1, sort_keys=True) + "\n").encode("utf-8"))
    return manifest


def read_manifest(root: Path) -> dict:
    """The manifest of the bundle at `root`, its form checked (not yet the files)."""
    if not root.exists():
        raise BundleError(f"bundle {root} not found")
    if not root.is_dir():
        raise BundleError(f"bundle {root} is not a directory (a bundle is the directory `sartor build --bundle` "
                          f"writes)")
    path = root / MANIFEST
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise BundleError(f"bundle {root} has no {MANIFEST}: not a sartor bundle") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise BundleError(f"bundle {root}: {MANIFEST} is not readable JSON ({type(exc).__name__})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        found = manifest.get("format") if isinstance(manifest, dict) else type(manifest).__name__
        raise BundleError(f"bundle {root}: {MANIFEST} is of format {found!r}; this sartor reads {FORMAT!r}")
    files = manifest.get("files")
    if not (isinstance(files, dict) and all(isinstance(v, dict) and isinstance(v.get("sha256"), str)
                                            for v in files.values())):
        raise BundleError(f"bundle {root}: {MANIFEST} is malformed (\"files\" must map each path to its sha256)")
    return manifest


def verify_bundle(root: str | os.PathLike) -> dict:
    """Check every file of the bundle against its manifest; returns the manifest. Refuses, naming
    the first difference, a file edited, missing or not in the manifest."""
    root = Path(root)
    manifest = read_manifest(root)
    listed = manifest["files"]
    for name in sorted(listed):
        path = root / name
        if ".." in Path(name).parts or Path(name).is_absolute() or not path.is_file():
            raise BundleError(f"bundle {root} is incomplete: {name} is listed in its manifest but missing")
        if file_sha256(path) != listed[name]["sha256"]:
            raise BundleError(f"bundle {root} was modified: {name} does not match its SHA-256 in the manifest "
                              f"(tampered or corrupted); use the bundle as `sartor build --bundle` wrote it")
    extra = [name for name in bundle_files(root) if name not in listed]
    if extra:
        raise BundleError(f"bundle {root} was modified: {extra[0]} is not in its manifest"
                          + (f" (and {len(extra) - 1} other file(s))" if len(extra) > 1 else ""))
    return manifest
