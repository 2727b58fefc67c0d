"""`sartor deploy`: a new release of a model on this device, preflighted, swapped in, watched, and
rolled back when its watch fails; and the start-up check that makes `current` match this machine.

The steps, each a point a kill -9 may hit (PAUSE_STEPS, for the crash-safety tests):

    staged              the engine (and bundle) copied into releases/.staging-* (hidden, never served)
    preflighted         preflight passed (preflight.py); a failure removes the staging directory
    published           staging renamed to releases/<id>
    swap-link-made      a temporary link to it made beside `current`
    swapped             the temporary link renamed over `current` (rename(2): atomic)
    rollback-link-made  (watch failed) a temporary link to the previous release beside `current`
    rolled-back         `current` names the previous release again

Until `swapped`, `current` names the previous release; from then, the new one (or, after a
rollback, the previous one again). The layout is in releases.py.
"""
from __future__ import annotations

import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import ConfigError
from ..runtime.fingerprint import device_fingerprint, parse_device
from .archive import extracted, is_archive
from .golden import DEFAULT_MIN_COSINE
from .health import WatchResult, server_url, watch
from .manifest import ENGINE, MANIFEST, BundleError
from .preflight import DEFAULT_TAKT_RUNS, PreflightReport, preflight
from .releases import (
    BUNDLE_DIR,
    ENGINE_FILE,
    PREFLIGHT_JSON,
    RELEASE_JSON,
    RELEASES,
    ROLLED_BACK_JSON,
    STAGING_PREFIX,
    ReleaseError,
    choose_release,
    current_id,
    deploy_lock,
    mark_known_good,
    pause_point,
    point_current,
    read_json,
    release_dir,
    remove_leftovers,
)

PAUSE_STEPS = ("staged", "preflighted", "published", "swap-link-made", "swapped", "rollback-link-made", "rolled-back")


def _json_bytes(data) -> bytes:
    import json
    return (json.dumps(data, indent=1, sort_keys=True) + "\n").encode("utf-8")


def _write(path: Path, data) -> None:
    from ..runtime.engine_file import write_atomic
    write_atomic(path, _json_bytes(data))


@dataclass
class DeployOptions:
    device: str | None = None
    trust: str | None = None
    compatibility: str | None = None
    min_cosine: float = DEFAULT_MIN_COSINE
    takt_runs: int = DEFAULT_TAKT_RUNS
    server: str | None = None  # the running `sartor serve` to watch (its HTTP URL)
    watch_seconds: float = 0.0
    watch_interval: float = 0.5
    allow_rebuild: bool = False  # a bundle whose engine is not beside it (or does not run here) is rebuilt here


@dataclass
class DeployReport:
    model_dir: str
    release: int | None = None
    previous: int | None = None
    preflight: PreflightReport | None = None
    swapped: bool = False
    watch: WatchResult | None = None
    rolled_back: bool = False
    known_good: bool = False
    rebuilt: bool = False
    leftovers: list = field(default_factory=list)
    seconds: float = 0.0

    @property
    def passed(self) -> bool:
        return self.swapped and not self.rolled_back and (self.watch is None or self.watch.passed)

    def to_json(self) -> dict:
        return {"model_dir": self.model_dir, "release": self.release, "previous": self.previous,
                "passed": self.passed, "swapped": self.swapped, "rolled_back": self.rolled_back,
                "known_good": self.known_good, "rebuilt": self.rebuilt, "leftovers_removed": self.leftovers,
                "seconds": round(self.seconds, 3),
                "preflight": self.preflight.to_json() if self.preflight else None,
                "watch": None if self.watch is None else {"passed": self.watch.passed, "detail": self.watch.detail}}


def is_bundle(path: Path) -> bool:
    return is_archive(path) or (path.is_dir() and (path / MANIFEST).is_file())


def _model_dir(root: str | os.PathLike, name: str) -> Path:
    root = Path(root)
    if not root.is_dir():
        raise ReleaseError(f"--root {root} is not a directory")
    if not name or name.startswith(".") or "/" in name or name in (".", ".."):
        raise ReleaseError(f"--name {name!r} is not a model name (a directory name not starting with '.')")
    model_dir = root / name
    if model_dir.exists() and not model_dir.is_dir():
        raise ReleaseError(f"{model_dir} exists and is not a directory")
    if model_dir.is_dir() and any(p.name.isdigit() for p in model_dir.iterdir()) and not (model_dir / RELEASES).is_dir():
        raise ReleaseError(f"{model_dir} holds Triton-layout version directories: deploy into a model directory of "
                           f"its own (releases/ and current)")
    return model_dir


def _stage_bundle(bundle: Path, staging: Path) -> Path:
    """The bundle copied (a .tar extracted) into the staging directory; its manifest is checked by preflight."""
    target = staging / BUNDLE_DIR
    if is_archive(bundle):
        with extracted(bundle, staging) as directory:
            shutil.copytree(directory, target)
    else:
        shutil.copytree(bundle, target, symlinks=True)
    return target


def deploy(source: str | os.PathLike, root: str | os.PathLike, name: str, options: DeployOptions | None = None,
           engine: str | os.PathLike | None = None, bundle: str | os.PathLike | None = None,
           say=lambda line: None, force_rebuild: bool = False) -> DeployReport:
    """Deploy `source` (an engine file, or a bundle: its directory or .tar) as a new release of
    ROOT/NAME. `engine` names a bundle's engine file; `bundle` gives an engine its bundle."""
    options = options or DeployOptions()
    source = Path(source)
    model_dir = _model_dir(root, name)
    if not source.exists():
        raise ReleaseError(f"{source} not found")
    if is_bundle(source):
        bundle_path, engine_path = source, Path(engine) if engine else None
        if engine_path is None and not force_rebuild and source.is_dir():
            named = (read_json(source / ENGINE) or {}).get("name")
            beside = source.parent / named if isinstance(named, str) and "/" not in named else None
            if beside is not None and beside.is_file():
                engine_path = beside
    else:
        if bundle is not None and not is_bundle(Path(bundle)):
            raise BundleError(f"--bundle {bundle} is not a bundle (a directory with {MANIFEST}, or its .tar)")
        bundle_path, engine_path = (Path(bundle) if bundle else None), source
    if engine_path is not None and not engine_path.is_file():
        raise ReleaseError(f"engine {engine_path} not found")
    if engine_path is None and not (options.allow_rebuild or force_rebuild):
        raise ReleaseError(f"bundle {source}: its engine is not beside it; give it with --engine PATH, or build it "
                           f"here from the bundle with --allow-rebuild")
    if options.watch_seconds and not options.server:
        raise ReleaseError("--watch needs --server URL: the running `sartor serve` whose health is watched")
    started = time.perf_counter()
    report = DeployReport(str(model_dir))
    (model_dir / RELEASES).mkdir(parents=True, exist_ok=True)
    with deploy_lock(model_dir):
        report.leftovers = remove_leftovers(model_dir)
        report.previous = current_id(model_dir)
        taken = [int(p.name) for p in (model_dir / RELEASES).iterdir() if p.name.isdigit()]
        report.release = release = max(taken, default=0) + 1
        staging = model_dir / RELEASES / f"{STAGING_PREFIX}{release}-{os.getpid()}"
        staging.mkdir()
        try:
            staged_bundle = _stage_bundle(bundle_path, staging) if bundle_path is not None else None
            if engine_path is not None:
                shutil.copyfile(engine_path, staging / ENGINE_FILE)
            else:
                say(f"building release {release} here from bundle {bundle_path}")
                from .rebuild import rebuild
                rebuild(staged_bundle, staging / ENGINE_FILE, device=options.device, min_cosine=options.min_cosine)
                report.rebuilt = True
            pause_point("staged")
            say(f"preflight of release {release} on this device")
            report.preflight = checked = preflight(staging / ENGINE_FILE, staged_bundle, options.device, options.trust,
                                                   options.compatibility, options.min_cosine, options.takt_runs)
            _write(staging / PREFLIGHT_JSON, checked.to_json())
            if not checked.passed:
                return report
            _write(staging / RELEASE_JSON, {
                "release": release, "source": str(source), "engine": str(engine_path) if engine_path else None,
                "bundle": str(bundle_path) if bundle_path else None, "rebuilt": report.rebuilt,
                "fingerprint": checked.fingerprint,
                "deployed_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())})
            pause_point("preflighted")
            os.rename(staging, release_dir(model_dir, release))
            staging = None
        finally:
            if staging is not None:
                shutil.rmtree(staging, ignore_errors=True)
        pause_point("published")
        point_current(model_dir, release, "swap-link-made")
        report.swapped = True
        pause_point("swapped")
        say(f"current is release {release}" + (f" (was {report.previous})" if report.previous else ""))
        if options.server and options.watch_seconds:
            say(f"watching {name} on {options.server} for {options.watch_seconds:g} s")
            report.watch = watch(server_url(options.server), name, str(release), options.watch_seconds,
                                 options.watch_interval)
            if not report.watch.passed:
                _write(release_dir(model_dir, release) / ROLLED_BACK_JSON,
                       {"reason": report.watch.detail, "restored": report.previous,
                        "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())})
                if report.previous is not None:
                    point_current(model_dir, report.previous, "rollback-link-made")
                    report.rolled_back = True
                    pause_point("rolled-back")
        if report.passed:
            here = device_fingerprint(parse_device(report.preflight.device))
            mark_known_good(model_dir, release, here)
            report.known_good = True
    report.seconds = time.perf_counter() - started
    return report


@dataclass
class StartCheck:
    release: int
    note: str | None  # what changed, when `current` did
    deploy: DeployReport | None = None  # the rebuild's, when one was needed


def check_current(root: str | os.PathLike, name: str, options: DeployOptions | None = None,
                  say=lambda line: None) -> StartCheck:
    """Make `current` a release that runs on this machine (the start-up step): itself when it does;
    else the release known good here, else the newest that runs here; else, when allowed, a rebuild
    from current's bundle (preflighted as any deploy). Raises ReleaseError naming both sides when
    none of these is possible."""
    options = options or DeployOptions()
    model_dir = Path(root) / name
    if not (model_dir / RELEASES).is_dir():
        raise ConfigError(f"{model_dir} is not a deployed model (no {RELEASES}/ directory)")
    try:
        choice = choose_release(model_dir, options.compatibility)
    except ReleaseError:
        current = current_id(model_dir)
        bundle = release_dir(model_dir, current) / BUNDLE_DIR if current is not None else None
        if not options.allow_rebuild or bundle is None or not bundle.is_dir():
            raise
        say(f"no release of {name} runs on this machine: rebuilding release {current}'s bundle here")
        report = deploy(bundle, root, name, options, force_rebuild=True, say=say)
        if not report.passed:
            failure = report.preflight.failure if report.preflight else None
            raise ReleaseError(f"the rebuild of {name} from release {current}'s bundle failed its preflight"
                               + (f" ({failure.name}: {failure.detail})" if failure else "")) from None
        return StartCheck(report.release, f"rebuilt release {current}'s bundle here as release {report.release}",
                          report)
    if choice.note is None:
        return StartCheck(choice.release, None)
    with deploy_lock(model_dir):
        point_current(model_dir, choice.release)
    return StartCheck(choice.release, choice.note)
