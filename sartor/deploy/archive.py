"""A bundle as one file (`--bundle NAME.tar`): the bundle directory in a tar, one thing to copy to a
device. Written with sorted names, no owner and the bundle's build time as every member's time, so
the same directory gives the same tar; read with tarfile's "data" filter, which refuses absolute
names, names leaving the directory, links out of it and device files."""
from __future__ import annotations

import calendar
import os
import shutil
import tarfile
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from .manifest import BundleError

SUFFIX = ".tar"


def is_archive(path: str | os.PathLike) -> bool:
    return str(path).endswith(SUFFIX)


def write_archive(directory: Path, path: Path, built_at: str) -> None:
    """Tar `directory`'s files (relative names) into `path`: a temporary file beside it, then a rename."""
    mtime = calendar.timegm(time.strptime(built_at, "%Y-%m-%dT%H:%M:%SZ"))

    def normalised(info: tarfile.TarInfo) -> tarfile.TarInfo:
        info.uid = info.gid = 0
        info.uname = info.gname = ""
        info.mtime = mtime
        return info

    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent if str(path.parent) else ".")
    try:
        with os.fdopen(fd, "wb") as handle, tarfile.open(fileobj=handle, mode="w", format=tarfile.PAX_FORMAT) as tar:
            for name in sorted(p.relative_to(directory).as_posix() for p in directory.rglob("*") if p.is_file()):
                tar.add(directory / name, arcname=name, recursive=False, filter=normalised)
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, path)
        tmp = None
    finally:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


@contextmanager
def extracted(path: Path, beside: Path) -> Iterator[Path]:
    """The bundle tar `path` extracted into a temporary directory under `beside`, removed after."""
    if not path.is_file():
        raise BundleError(f"bundle {path} not found" if not path.exists() else f"bundle {path} is not a file")
    work = Path(os.path.abspath(tempfile.mkdtemp(prefix=".sartor-bundle.", suffix=".tmp", dir=beside)))
    try:
        try:
            with tarfile.open(path, mode="r:") as tar:
                tar.extractall(work, filter="data")
        except tarfile.FilterError as exc:
            raise BundleError(f"bundle {path} holds a member sartor will not extract ({exc})") from None
        except (tarfile.TarError, OSError, EOFError) as exc:
            raise BundleError(f"bundle {path} is not a readable tar ({type(exc).__name__})") from None
        yield work
    finally:
        shutil.rmtree(work, ignore_errors=True)
