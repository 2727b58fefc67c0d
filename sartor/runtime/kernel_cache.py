"""The private cache that an engine's embedded Triton kernels are installed into, and how this
process's Triton finds them there.

Each engine's entries go to `<root>/<engine checksum>/<key>/`, the root being
`$SARTOR_CACHE_DIR/kernels`, else `$XDG_CACHE_HOME/sartor/kernels`, else `~/.cache/sartor/kernels`
(directories mode 0700). Nothing is written into Triton's user-wide cache (`~/.triton/cache`), so a
process that does not load the engine never runs its GPU code.

Triton has one cache directory per process, but it asks a cache manager
(`triton.knobs.cache.manager_class`) for every compilation key. sartor's manager answers the keys
of the engines this process loaded from their private directories, and every other key from
Triton's own file cache as before, where Triton keeps what it compiles itself (its host launchers
too). So several engines in one process each serve their own keys; a key that two engines carry
with different binaries is served from the first one loaded, and the second's copy is reported and
left unused. See docs/decisions/0021-signed-engines-private-kernel-cache.md.
"""
from __future__ import annotations

import functools
import os
import threading
from pathlib import Path

CACHE_ENV = "SARTOR_CACHE_DIR"
GROUP_PREFIX = "__grp__"

_lock = threading.Lock()
_served: dict[str, Path] = {}  # compilation key -> the private entry directory Triton reads it from


def private_root() -> Path:
    """Where engines' kernels are installed (one directory per engine checksum below it)."""
    base = os.environ.get(CACHE_ENV) or ""
    if base:
        return Path(base) / "kernels"
    xdg = os.environ.get("XDG_CACHE_HOME") or ""
    return (Path(xdg) if xdg else Path.home() / ".cache") / "sartor" / "kernels"


def engine_directory(digest: str, root: Path | None = None) -> Path:
    """The private directory of the engine whose payload checksum is `digest` (hex)."""
    if not digest or any(c not in "0123456789abcdef" for c in digest):
        raise ValueError(f"an engine digest is lowercase hex, not {digest!r}")
    return (root or private_root()) / digest


def make_private(directory: Path) -> None:
    """Create `directory` (and its parents) readable by this user only."""
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    directory.chmod(0o700)


def served_directory(key: str) -> Path | None:
    """The private entry directory this process serves compilation key `key` from, if any."""
    with _lock:
        return _served.get(key)


@functools.cache
def manager_class():
    """sartor's Triton cache manager: the engines' keys from their private entries, others as Triton's own."""
    from triton.runtime.cache import FileCacheManager

    class EngineKernelCache(FileCacheManager):
        def __init__(self, key, override=False, dump=False):
            directory = None if (override or dump) else served_directory(key)
            if directory is None:
                super().__init__(key, override=override, dump=dump)
                return
            self.key = key
            self.cache_dir = str(directory)
            self.lock_path = os.path.join(self.cache_dir, "lock")

    EngineKernelCache.__qualname__ = "EngineKernelCache"
    EngineKernelCache.__module__ = __name__
    return EngineKernelCache


def foreign_manager() -> str:
    """Why sartor cannot serve kernels through Triton's cache here ("" when it can): another cache
    manager (TRITON_CACHE_MANAGER: a remote cache, say) is in charge."""
    try:
        from triton import knobs
    except ImportError:
        return "triton is not installed"
    current = knobs.cache.manager_class
    if current is None or current is manager_class():
        return ""
    return f"Triton uses the cache manager {current.__name__}, not its file cache"


def _same_files(one: Path, other: Path) -> bool:
    """Whether two entry directories hold the same kernel files (group files name their own paths)."""
    def files(directory: Path) -> dict:
        return {p.name: p.read_bytes() for p in directory.iterdir()
                if p.is_file() and not p.name.startswith(GROUP_PREFIX)}
    try:
        return files(one) == files(other)
    except OSError:
        return False


def serve_entries(directory: Path, keys: list[str]) -> list[str]:
    """Make this process's Triton read `keys` from their entries under `directory`. Returns a line per
    key already served from another engine's entry with different files (that one stays)."""
    from triton import knobs
    conflicts = []
    with _lock:
        for key in keys:
            entry = directory / key
            current = _served.get(key)
            if current is None or current == entry:
                _served[key] = entry
            elif not _same_files(current, entry):
                conflicts.append(f"kernel entry {key[:12]}… differs from the one an engine loaded earlier in this "
                                 f"process installed ({current.parent.name[:12]}…): that one is used")
        knobs.cache.manager_class = manager_class()
    return conflicts


def forget_served() -> None:
    """Serve no engine's entries any more (Triton's own cache answers every key); for tests."""
    with _lock:
        _served.clear()
