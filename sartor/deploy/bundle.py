"""`sartor build --bundle DIR`: the engine, and beside it a directory that keeps what made it.

    DIR/manifest.json              every other file's SHA-256 and size (manifest.py)
    DIR/model.onnx                 the ONNX model as built
    DIR/build_options.json         the options `sartor rebuild` turns back into a BuildConfig, and
                                   the options as given
    DIR/calibration_cache.json     INT8/FP8 builds: the thresholds (and bias corrections)
    DIR/calibration/samples.json   the --calib files' SHA-256 list; their copy under
                                   calibration/samples/ when at most CALIB_COPY_LIMIT bytes
    DIR/timing_cache.json          what tactic selection measured, by device fingerprint
    DIR/fingerprint.json, versions.json
    DIR/engine.json                the engine file's SHA-256, size and build time
    DIR/engine_header.json         its header (what `sartor rebuild` names when a rebuild differs)
    DIR/golden/                    inputs, the engine's outputs and the FP32 reference's (.npz)
    DIR/validation/                --data (labelled validation folders up to CALIB_COPY_LIMIT bytes)
                                   and the engine's and FP32 model's task metric on it (accuracy.py)

The bundle is assembled in a temporary directory beside DIR and renamed to DIR when complete; a
DIR ending in .tar is written as one tar file instead (archive.py).

The engine written to -o is the second of two builds: the first calibrates and times (filling the
caches), the second builds from the bundle's own caches and files exactly as `sartor rebuild`
will, so that a rebuild on this machine writes the same bytes
(docs/decisions/0026-reproducible-bundle-builds.md).
"""
from __future__ import annotations

import dataclasses
import json
import os
import platform
import shutil
import tempfile
import time
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from ..builder import BuildConfig, BuildResult, build
from ..builder.pipeline import Reproducible
from ..errors import ConfigError
from ..runtime.engine import BUNDLE_LABEL, load
from ..runtime.engine_file import (
    check_writable,
    npz_bytes,
    read_engine_file,
    termination_cleans_up,
    write_atomic,
)
from ..runtime.fingerprint import device_fingerprint, parse_device
from ..version import __version__
from .accuracy import DATA_DIR, record_validation
from .archive import is_archive, write_archive
from .golden import engine_outputs, golden_inputs, reference_outputs
from .manifest import (  # noqa: F401 (the file names, bundle.ENGINE etc., as before they moved)
    CALIB_CACHE,
    ENGINE,
    ENGINE_HEADER,
    FORMAT,
    GOLDEN,
    MANIFEST,
    MODEL,
    OPTIONS,
    SAMPLES,
    SAMPLES_DIR,
    TIMING_CACHE,
    BundleError,
    file_sha256,
    write_manifest,
)
# --calib files up to this many bytes in all are copied into the bundle; larger sets keep only
# their SHA-256 list (a rebuild reads the calibration cache, never the samples).
CALIB_COPY_LIMIT = 64 << 20
# What a reproducible build's header says instead of the engine file it wrote (and BUNDLE_LABEL
# instead of the directory it read the bundle from): Reproducible.path_labels.
OUTPUT_LABEL = "<output>"
VERSIONED = ("torch", "triton", "onnx", "onnxruntime", "numpy", "safetensors")
# Options whose work a build from the bundle's caches cannot repeat without the data they name.
_NOT_BUNDLED = (("accuracy_budget", "--accuracy-budget"), ("min_cosine", "--min-cosine"), ("min_snr", "--min-snr"),
                ("fallback_where_faster", "--fallback-where-faster"))


@dataclass
class BundleResult:
    build: BuildResult  # the engine written to the output path (the build from the bundle)
    path: str  # the bundle directory
    files: int
    bytes: int


def check_bundle_options(config: BuildConfig) -> None:
    for key, flag in _NOT_BUNDLED:
        if getattr(config, key):
            raise ConfigError(f"--bundle cannot record a build with {flag} yet (its search measures on data the "
                              f"rebuild does not have): build without it, or pin the layers it chose with "
                              f"--layer-precision")


def reproducible_options(config: BuildConfig, quantized: bool) -> dict:
    """The options of the build from the bundle, with bundle-relative paths: what build_options.json
    keeps and `sartor rebuild` reads back. The calibration and validation data are left out (the
    caches stand for them)."""
    options = config.to_json()
    options.update(model_path=MODEL, output_path=None, calib=None, data=None, split_by=None, classes=None,
                   calib_balance_by=None, calib_cache=CALIB_CACHE if quantized else None, timing_cache=TIMING_CACHE)
    return options


def config_from_options(options: dict, directory: Path, output: str) -> BuildConfig:
    """BuildConfig from build_options.json's options, its paths inside `directory`."""
    known = {f.name for f in dataclasses.fields(BuildConfig)}
    unknown = sorted(set(options) - known)
    if unknown:
        raise BundleError(f"the bundle's build options include {', '.join(unknown)}, which this sartor does not "
                          f"know: rebuild it with the sartor that made it ({__version__} here)")
    values = dict(options, model_path=str(directory / MODEL), output_path=output)
    try:
        for key in ("calib_cache", "timing_cache"):
            if values.get(key):
                values[key] = str(directory / values[key])
        config = BuildConfig(**values)
        if not (isinstance(config.profiles, list) and all(isinstance(p, dict) for p in config.profiles)):
            raise TypeError("profiles must be a list of {min, opt, max} objects")
        config.validate()  # before the build: a wrong type here is the bundle's fault, not a bug
    except ConfigError as exc:  # the flags it names were the bundle's, not this command's
        raise BundleError(f"the bundle's build options are malformed: {exc}") from None
    except (TypeError, ValueError, KeyError, AttributeError) as exc:
        raise BundleError(f"the bundle's build options are malformed ({type(exc).__name__}: {exc})") from None
    return config


def labels(directory: Path, output: str) -> dict:
    """Reproducible.path_labels for a build reading `directory` and writing `output`, longest first."""
    found = {os.path.abspath(directory): BUNDLE_LABEL, os.path.abspath(output): OUTPUT_LABEL}
    return dict(sorted(found.items(), key=lambda item: -len(item[0])))


def versions() -> dict:
    found = {"python": platform.python_version(), "sartor": __version__}
    for package in VERSIONED:
        try:
            found[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            found[package] = None
    return found


def _json(data) -> bytes:
    return (json.dumps(data, indent=1, sort_keys=True) + "\n").encode("utf-8")


def _data_files(source: Path) -> list[Path]:
    if source.is_dir():
        return sorted(p for p in source.rglob("*") if p.is_file())
    return [source]


def keep_data(source: str, staging: Path, into: str, copy_files: bool = True) -> dict:
    """List the files of `source` (a file or a folder) by SHA-256, and copy them to `staging/into`
    when they are at most CALIB_COPY_LIMIT bytes in all (and `copy_files`)."""
    root = Path(source)
    files = _data_files(root)
    total = sum(p.stat().st_size for p in files)
    copied = copy_files and total <= CALIB_COPY_LIMIT
    (staging / into).parent.mkdir(parents=True, exist_ok=True)
    if copied:
        if root.is_dir():
            shutil.copytree(root, staging / into, copy_function=shutil.copyfile)
        else:
            (staging / into).mkdir()
            shutil.copyfile(root, staging / into / root.name)
    record = {"source": source, "bytes": total, "copy_limit_bytes": CALIB_COPY_LIMIT, "copied": copied,
              "files": [{"path": (p.relative_to(root).as_posix() if root.is_dir() else p.name),
                         "sha256": file_sha256(p), "bytes": p.stat().st_size} for p in files]}
    if root.is_file() and root.suffix not in (".npy", ".npz"):  # a COCO .json or a manifest names images elsewhere
        record["note"] = "an index of images: the images it names are not in this list"
    return record


def _staging_directory(bundle: Path) -> Path:
    if bundle.exists() or bundle.is_symlink():
        raise BundleError(f"bundle directory {bundle} already exists: remove it or choose another")
    parent = bundle.parent
    check_writable(parent / f".{bundle.name}.probe")  # the parent exists and is writable
    staging = Path(os.path.abspath(tempfile.mkdtemp(prefix=f".{bundle.name}.", suffix=".tmp", dir=parent)))
    mask = os.umask(0o022)
    os.umask(mask)
    os.chmod(staging, 0o777 & ~mask)  # mkdtemp's 0700 would outlive the rename
    return staging


def build_bundle(config: BuildConfig, bundle_dir: str | os.PathLike, progress=None, warn=None) -> BundleResult:
    """Build `config`'s engine and write its provenance bundle to `bundle_dir` (which must not exist;
    a name ending in .tar makes it one tar file)."""
    config.validate()
    check_bundle_options(config)
    check_writable(config.output_path)
    bundle = Path(bundle_dir)
    with termination_cleans_up():
        return _build_bundle(config, bundle, _staging_directory(bundle), progress, warn)


def _build_bundle(config: BuildConfig, bundle: Path, staging: Path, progress, warn) -> BundleResult:
    try:
        as_given = config.to_json()
        built_at = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        shutil.copyfile(config.model_path, staging / MODEL)
        # Samples given from Python have no files to keep: the bundle's calibration cache stands for them.
        samples = keep_data(config.calib, staging, SAMPLES_DIR) if config.calib and config.calib_data is None else None
        # First build: as asked, its caches (the user's, else the bundle's) filled by calibration and timing.
        first = dataclasses.replace(config, output_path=str(staging / ".first.plan"),
                                    calib_cache=config.calib_cache or str(staging / CALIB_CACHE),
                                    timing_cache=config.timing_cache or str(staging / TIMING_CACHE))
        first_result = build(first, progress, warn)
        Path(first.output_path).unlink()
        quantized = first_result.header["provenance"].get("calibration") is not None
        for source, name in ((first.calib_cache, CALIB_CACHE), (first.timing_cache, TIMING_CACHE)):
            if Path(source) != staging / name and Path(source).is_file() and (quantized or name != CALIB_CACHE):
                shutil.copyfile(source, staging / name)
        if not quantized:
            (staging / CALIB_CACHE).unlink(missing_ok=True)
        # Second build: from the bundle alone, as `sartor rebuild` builds.
        options = reproducible_options(config, quantized)
        output = os.path.abspath(config.output_path)
        second = config_from_options(options, staging, output)
        if progress is not None:
            progress("bundle")  # the build from the bundle repeats the stages above, from the caches
        result = build(second, None, None, Reproducible(built_at, labels(staging, output)))
        header, _ = read_engine_file(output)
        write_atomic(staging / OPTIONS, _json({"format": FORMAT, "options": options, "as_given": as_given}))
        write_atomic(staging / ENGINE, _json({"sha256": file_sha256(Path(output)), "bytes": Path(output).stat().st_size,
                                              "built_at": built_at, "name": Path(output).name}))
        write_atomic(staging / ENGINE_HEADER, _json(header))
        write_atomic(staging / "fingerprint.json", _json(header["fingerprint"]))
        write_atomic(staging / "versions.json", _json(versions()))
        if samples is not None:
            write_atomic(staging / SAMPLES, _json(samples))
        engine = load(output, device=str(parse_device(config.device)))
        _write_golden(staging, engine, config)
        if config.data:
            kept = keep_data(config.data, staging, DATA_DIR, copy_files=Path(config.data).is_dir())
            record_validation(kept, staging, engine, staging / MODEL, config.split_by, config.classes)
        manifest = write_manifest(staging)
        if is_archive(bundle):
            write_archive(staging, bundle, built_at)  # the staging directory goes in `finally`
        else:
            os.rename(staging, bundle)
            staging = None
    finally:
        if staging is not None:
            shutil.rmtree(staging, ignore_errors=True)
    files = manifest["files"]
    return BundleResult(result, str(bundle), len(files) + 1, sum(f["bytes"] for f in files.values()))


def _write_golden(staging: Path, engine, config: BuildConfig) -> None:
    device = engine.device
    feeds, source = golden_inputs(engine, config.calib, config.preprocess_spec(), config.seed)
    reference, reference_source = reference_outputs(staging / MODEL, feeds)
    golden = staging / GOLDEN
    golden.mkdir()
    write_atomic(golden / "inputs.npz", npz_bytes(feeds))
    write_atomic(golden / "engine_outputs.npz", npz_bytes(engine_outputs(engine, feeds)))
    if reference is not None:
        write_atomic(golden / "reference_outputs.npz", npz_bytes(reference))
    write_atomic(golden / "golden.json", _json({"inputs": source, "reference": reference_source,
                                                "shapes": {k: list(v.shape) for k, v in feeds.items()},
                                                "device": str(device),
                                                "fingerprint": device_fingerprint(device)}))


__all__ = ["MANIFEST", "BundleError", "BundleResult", "build_bundle"]
