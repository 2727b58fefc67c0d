"""A model's releases on a device, the `current` link, and which release this machine can serve.

    ROOT/MODEL/releases/<id>/model.plan         the engine (<id> is 1, 2, 3, ...: the served version)
    ROOT/MODEL/releases/<id>/bundle/ (or bundle.tar)  its provenance bundle, when deployed from one
    ROOT/MODEL/releases/<id>/release.json       what it is: engine SHA-256, fingerprint, source, time
    ROOT/MODEL/releases/<id>/preflight.json     what preflight checked and measured on this device
    ROOT/MODEL/releases/<id>/rolled-back.json   present once its health watch failed
    ROOT/MODEL/current -> releases/<id>         replaced by rename(2) of a temporary link, never edited
    ROOT/MODEL/known-good/<key> -> ../releases/<id>     the last release proven on each fingerprint
    ROOT/MODEL/config.pbtxt                     optional, as in Triton's layout

A release directory is assembled as `releases/.staging-*` and renamed to its id when whole, so a
kill at any moment leaves `current` naming a whole release (the old one or the new one); what a
killed deploy left behind (a staging directory, a temporary link) is hidden and removed by the next
deploy (docs/decisions/0028-releases-swap-watch-rollback.md).
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from ..errors import DeviceError, SartorError
from ..runtime.fingerprint import (
    compare_fingerprints,
    compatibility_level,
    describe,
    device_fingerprint,
    parse_device,
)

RELEASES, CURRENT, KNOWN_GOOD = "releases", "current", "known-good"
ENGINE_FILE = "model.plan"
RELEASE_JSON, PREFLIGHT_JSON, ROLLED_BACK_JSON = "release.json", "preflight.json", "rolled-back.json"
BUNDLE_DIR, BUNDLE_TAR = "bundle", "bundle.tar"
STAGING_PREFIX = ".staging-"
LOCK_FILE = ".deploy.lock"
# Tests (and anyone checking crash safety) set this to a step name: the deploy stops there, says so
# on stderr and waits to be killed (see PAUSE_STEPS in update.py).
PAUSE_ENVIRONMENT = "SARTOR_DEPLOY_PAUSE_AT"


class ReleaseError(SartorError):
    """A release root is malformed, or none of a model's releases can run on this machine."""


def pause_point(step: str) -> None:
    """Stop here for good when $SARTOR_DEPLOY_PAUSE_AT names `step` (a crash-safety test kills the
    process while it waits)."""
    if os.environ.get(PAUSE_ENVIRONMENT) != step:
        return
    print(f"sartor deploy: paused at {step} ({PAUSE_ENVIRONMENT})", file=sys.stderr, flush=True)
    while True:
        time.sleep(3600)


def is_release_model(model_dir: Path) -> bool:
    """Whether a model directory uses this layout (rather than Triton's numbered versions)."""
    return (model_dir / RELEASES).is_dir() or (model_dir / CURRENT).is_symlink()


def release_dir(model_dir: Path, release_id: int) -> Path:
    return model_dir / RELEASES / str(release_id)


def release_ids(model_dir: Path) -> list[int]:
    """The whole releases (named by their id, with an engine), oldest first."""
    try:
        entries = list((model_dir / RELEASES).iterdir())
    except OSError:
        return []
    return sorted(int(p.name) for p in entries
                  if p.name.isdigit() and int(p.name) > 0 and (p / ENGINE_FILE).is_file())


def _link_id(link: Path) -> int | None:
    try:
        target = os.readlink(link)
    except OSError:
        return None
    name = Path(target).name
    return int(name) if name.isdigit() else None


def current_id(model_dir: Path) -> int | None:
    """The release `current` names, or None when there is none (no deploy finished yet)."""
    release = _link_id(model_dir / CURRENT)
    if release is not None and not (release_dir(model_dir, release) / ENGINE_FILE).is_file():
        raise ReleaseError(f"{model_dir / CURRENT} names release {release}, which has no {ENGINE_FILE}")
    return release


def _fsync_directory(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def swap_link(link: Path, target: str, pause_step: str | None = None) -> None:
    """Point `link` at `target` in one step: a temporary link beside it, renamed over it (rename(2)
    replaces the old link atomically: a reader sees the old target or the new one, never neither)."""
    temporary = link.parent / f".{link.name}.{os.getpid()}.tmp"
    temporary.unlink(missing_ok=True)
    os.symlink(target, temporary)
    if pause_step:
        pause_point(pause_step)
    os.replace(temporary, link)
    _fsync_directory(link.parent)


def point_current(model_dir: Path, release_id: int, pause_step: str | None = None) -> None:
    swap_link(model_dir / CURRENT, f"{RELEASES}/{release_id}", pause_step)


def read_json(path: Path) -> dict | None:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    return data if isinstance(data, dict) else None


def fingerprint_key(fingerprint: dict) -> str:
    """A file name for one device fingerprint (driver and toolkit included): its kind and a digest."""
    text = json.dumps(fingerprint, sort_keys=True, separators=(",", ":"))
    return f"{fingerprint.get('kind', 'unknown')}-{hashlib.sha256(text.encode()).hexdigest()[:16]}"


def mark_known_good(model_dir: Path, release_id: int, fingerprint: dict) -> None:
    directory = model_dir / KNOWN_GOOD
    directory.mkdir(exist_ok=True)
    swap_link(directory / fingerprint_key(fingerprint), f"../{RELEASES}/{release_id}")


def is_rolled_back(model_dir: Path, release_id: int) -> bool:
    return (release_dir(model_dir, release_id) / ROLLED_BACK_JSON).exists()


def preflight_passed(model_dir: Path, release_id: int) -> bool:
    record = read_json(release_dir(model_dir, release_id) / PREFLIGHT_JSON)
    return bool(record and record.get("passed"))


@contextmanager
def deploy_lock(model_dir: Path) -> Iterator[None]:
    """One deploy per model at a time (a lock the kernel drops when its holder dies, kill -9 included)."""
    model_dir.mkdir(parents=True, exist_ok=True)
    with open(model_dir / LOCK_FILE, "a+") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise ReleaseError(f"another sartor deploy is working on {model_dir}") from None
        yield


def remove_leftovers(model_dir: Path) -> list[str]:
    """What a killed deploy left: staging directories and temporary links (hidden, never served)."""
    removed = []
    for directory in (model_dir / RELEASES, model_dir, model_dir / KNOWN_GOOD):
        try:
            entries = list(directory.iterdir())
        except OSError:
            continue
        for entry in entries:
            if entry.name.startswith(STAGING_PREFIX) and entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry, ignore_errors=True)
            elif entry.name.startswith(".") and entry.name.endswith(".tmp") and entry.is_symlink():
                entry.unlink(missing_ok=True)
            else:
                continue
            removed.append(str(entry))
    return removed


# ---- which release this machine serves ----------------------------------------------------------------

class _Here:
    """This machine's fingerprint per device kind, computed once (None: no such device here)."""

    def __init__(self) -> None:
        self._by_kind: dict = {}

    def __call__(self, kind: str) -> dict | None:
        if kind not in self._by_kind:
            try:
                self._by_kind[kind] = device_fingerprint(parse_device("cuda" if kind == "cuda" else "cpu"))
            except DeviceError:
                self._by_kind[kind] = None
        return self._by_kind[kind]


@dataclass(frozen=True)
class Choice:
    release: int
    engine: Path
    note: str | None  # why not `current`, when another release is chosen


def release_fingerprint(model_dir: Path, release_id: int) -> dict | None:
    record = read_json(release_dir(model_dir, release_id) / RELEASE_JSON)
    fingerprint = record.get("fingerprint") if record else None
    return fingerprint if isinstance(fingerprint, dict) else None


def _runs_here(model_dir: Path, release_id: int, here: _Here, level: str) -> tuple[bool, str]:
    """(whether the release's engine may load here at `level`, what it was built for)."""
    built_for = release_fingerprint(model_dir, release_id)
    if built_for is None:
        return False, f"release {release_id} has no readable {RELEASE_JSON}"
    this = here(str(built_for.get("kind")))
    if this is None:
        return False, f"[{describe(built_for)}] (no {built_for.get('kind')} device here)"
    return compare_fingerprints(built_for, this, level).loads, f"[{describe(built_for)}]"


def choose_release(model_dir: Path, level: str | None = None, here=None) -> Choice:
    """`current` when it runs on this machine at the compatibility level; else the release known
    good for this machine's fingerprint; else the newest release that passed preflight, was not
    rolled back and runs here. Raises ReleaseError naming both sides when none does."""
    level = compatibility_level(level)
    here = here or _Here()
    current = current_id(model_dir)
    if current is None:
        raise ReleaseError(f"{model_dir} has no {CURRENT} release yet: deploy one with "
                           f"`sartor deploy ENGINE_OR_BUNDLE --root {model_dir.parent} --name {model_dir.name}`")
    runs, built_for = _runs_here(model_dir, current, here, level)
    if runs:
        return Choice(current, release_dir(model_dir, current) / ENGINE_FILE, None)
    candidates = []
    for kind in ("cuda", "cpu"):
        fingerprint = here(kind)
        known = _link_id(model_dir / KNOWN_GOOD / fingerprint_key(fingerprint)) if fingerprint else None
        if known is not None and (release_dir(model_dir, known) / ENGINE_FILE).is_file():
            candidates.append((known, "known good for this machine's fingerprint"))
    candidates += [(r, "the newest release that runs here") for r in reversed(release_ids(model_dir))
                   if r != current and preflight_passed(model_dir, r) and not is_rolled_back(model_dir, r)]
    for release, why in candidates:
        if _runs_here(model_dir, release, here, level)[0]:
            note = (f"model {model_dir.name}: current release {current} was built for {built_for}, which does not "
                    f"run on this machine at compatibility '{level}': serving release {release} ({why})")
            return Choice(release, release_dir(model_dir, release) / ENGINE_FILE, note)
    mine = "; ".join(describe(fp) for fp in (here("cuda"), here("cpu")) if fp)
    raise ReleaseError(f"model {model_dir.name}: current release {current} was built for {built_for} but this machine "
                       f"is [{mine}] and no other release runs here at compatibility '{level}'; rebuild it from its "
                       f"bundle: sartor deploy --check --allow-rebuild --root {model_dir.parent} --name {model_dir.name}")
