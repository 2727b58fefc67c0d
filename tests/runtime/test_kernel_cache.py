"""The private kernel cache (runtime/kernel_cache.py): where engines' kernels go, and which entry
this process's Triton reads for a key. Triton's real cache manager and file cache are used."""
from __future__ import annotations

import stat
from pathlib import Path

import pytest
import triton
from triton.runtime.cache import get_cache_manager

from sartor.runtime import kernel_cache

KEY_HASH = "cd" * 32  # a compilation hash, as Triton's compiler makes it (hex)


def _key() -> str:
    from triton.runtime.cache import _base32
    return _base32(KEY_HASH)


@pytest.fixture(autouse=True)
def _clean_triton_knobs(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "user_wide"))
    yield
    kernel_cache.forget_served()
    del triton.knobs.cache.manager_class


def _entry(directory: Path, cubin: bytes) -> Path:
    entry = directory / _key()
    entry.mkdir(parents=True)
    (entry / "k.cubin").write_bytes(cubin)
    (entry / "k.json").write_text("{}")
    (entry / "__grp__k.json").write_text(f'{{"child_paths": {{"k.json": "{entry / "k.json"}"}}}}')
    return entry


def test_the_private_root_follows_sartor_cache_dir_then_xdg_then_home(monkeypatch, tmp_path):
    monkeypatch.setenv(kernel_cache.CACHE_ENV, str(tmp_path / "s"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "x"))
    assert kernel_cache.private_root() == tmp_path / "s" / "kernels"
    monkeypatch.setenv(kernel_cache.CACHE_ENV, "")
    assert kernel_cache.private_root() == tmp_path / "x" / "sartor" / "kernels"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "h"))
    assert kernel_cache.private_root() == tmp_path / "h" / ".cache" / "sartor" / "kernels"
    assert ".triton" not in str(kernel_cache.private_root())


def test_each_engine_has_its_own_directory_by_digest(tmp_path):
    one, two = (kernel_cache.engine_directory(d, tmp_path) for d in ("ab" * 32, "cd" * 32))
    assert one == tmp_path / ("ab" * 32) and one != two
    for bad in ("", "../x", "AB" * 32):
        with pytest.raises(ValueError):
            kernel_cache.engine_directory(bad, tmp_path)


def test_private_directories_are_the_owners_only(tmp_path):
    directory = tmp_path / "a" / "b"
    kernel_cache.make_private(directory)
    assert stat.S_IMODE(directory.stat().st_mode) == 0o700


def test_a_served_key_is_read_from_the_engines_entry_not_the_user_wide_cache(tmp_path):
    private = tmp_path / "private" / ("ab" * 32)
    entry = _entry(private, b"engine's")
    assert kernel_cache.serve_entries(private, [_key()]) == []
    manager = get_cache_manager(KEY_HASH)
    assert manager.cache_dir == str(entry)
    assert manager.get_group("k.json") == {"k.json": str(entry / "k.json")}
    assert not (tmp_path / "user_wide").exists(), "nothing made in the user-wide cache for a served key"


def test_other_keys_stay_with_tritons_own_cache(tmp_path):
    private = tmp_path / "private" / ("ab" * 32)
    _entry(private, b"engine's")
    kernel_cache.serve_entries(private, [_key()])
    other = get_cache_manager("ef" * 32)
    assert Path(other.cache_dir).parent == tmp_path / "user_wide", "Triton's own compiles go where they always did"


def test_without_serving_triton_reads_its_own_cache(tmp_path):
    _entry(tmp_path / "private" / ("ab" * 32), b"engine's")
    assert Path(get_cache_manager(KEY_HASH).cache_dir).parent == tmp_path / "user_wide"


def test_two_engines_with_the_same_entry_share_it(tmp_path):
    first, second = tmp_path / ("ab" * 32), tmp_path / ("cd" * 32)
    _entry(first, b"same")
    _entry(second, b"same")
    assert kernel_cache.serve_entries(first, [_key()]) == []
    assert kernel_cache.serve_entries(second, [_key()]) == []
    assert kernel_cache.served_directory(_key()) == first / _key()


def test_a_second_engine_cannot_take_over_a_key_with_other_binaries(tmp_path):
    first, second = tmp_path / ("ab" * 32), tmp_path / ("cd" * 32)
    _entry(first, b"first")
    _entry(second, b"other")
    kernel_cache.serve_entries(first, [_key()])
    conflicts = kernel_cache.serve_entries(second, [_key()])
    assert len(conflicts) == 1 and "differs from the one an engine loaded earlier" in conflicts[0]
    assert get_cache_manager(KEY_HASH).cache_dir == str(first / _key())


def test_another_cache_manager_is_left_in_charge(monkeypatch):
    assert kernel_cache.foreign_manager() == ""
    monkeypatch.setenv("TRITON_CACHE_MANAGER", "triton.runtime.cache:FileCacheManager")
    assert "FileCacheManager" in kernel_cache.foreign_manager()
