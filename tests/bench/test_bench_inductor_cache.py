"""bench/inductor_cache.py: inductor's autotuning results exported from a (killed) compile's cache
dir and restored into a fresh one, on a synthetic cache dir laid out as torch's inductor lays it."""
from __future__ import annotations

import io
import json
import sys
import tarfile
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import inductor_cache  # noqa: E402
from inductor_cache import (CacheArchiveError, autotune_op_count, earlier_compile_s, export_results,  # noqa: E402
                            mark_compile, restore_results, result_files)

SYSTEM = "44136fa355b3678a1146ad16f7e8649e94fb4fc21fe77e8310c060f61caaff8a"
CONV_KEY = "[('cuda', 'torch.float16', 256, 32, 112, 112, 1, 0)]"
PERSISTENT = {"system": {"hash": SYSTEM}, "cache": {
    "convolution": {CONV_KEY: {"highest": {"triton_convolution2d-abc": 0.11, "aten_convolution-def": 0.09}},
                    "[('cuda', 'torch.float16', 256, 96, 56, 56, 1, 0)]": {"highest": {"aten_convolution-def": 0.2}}},
    "mm": {"[('cuda', 'torch.float16', 256, 1280)]": {"highest": {"triton_mm-123": 0.01}}}}}
BEST = {"XBLOCK": 128, "num_warps": 4, "num_stages": 1, "configs_hash": "h", "found_by_coordesc": True}
RESULTS = [f"cache/{SYSTEM}", "ab/cabkernel.best_config", "q7/cq7kernel.best_config"]


def _write(path: Path, data: str | bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data.encode() if isinstance(data, str) else data)


@pytest.fixture()
def cache_dir(tmp_path: Path) -> Path:
    """A cache dir after a killed max-autotune compile: the results among compiled kernels, graph
    caches, locks, and files a kill tore mid-write."""
    root = tmp_path / "inductor"
    _write(root / RESULTS[0], json.dumps(PERSISTENT))
    _write(root / RESULTS[1], json.dumps(BEST))
    _write(root / RESULTS[2], json.dumps(dict(BEST, XBLOCK=64)))
    _write(root / "cache" / "0badtorn", '{"system": {}, "cache": {"mm"')  # torn: not valid JSON
    _write(root / "cd" / "ccdtorn.best_config", '{"XBLOCK": 1')
    _write(root / "ab" / "cabkernel.py", "import triton\n")
    _write(root / "ab" / "cabkernel.so", b"\x7fELF" + bytes(64))
    _write(root / "triton" / "0" / "XYZ" / "triton_poi.cubin", bytes(128))
    _write(root / "triton" / "0" / "XYZ" / "triton_poi.json", "{}")
    _write(root / "fxgraph" / "fi" / "ffiy" / "entry", bytes(32))
    _write(root / "aotautograd" / "ah7u" / "entry", bytes(32))
    _write(root / "locks" / "cabkernel.lock", "")
    _write(root / "cache" / "nested" / "not_ours.json", "{}")  # PersistentCache keeps no folders
    return root


def test_only_complete_result_files_are_selected(cache_dir: Path):
    assert result_files(cache_dir) == sorted(RESULTS)
    assert autotune_op_count(cache_dir) == 3  # two convolutions and one mm benchmarked


def test_oversized_file_is_not_a_result(cache_dir: Path, monkeypatch):
    monkeypatch.setattr(inductor_cache, "MAX_FILE_BYTES", 100)
    assert result_files(cache_dir) == sorted(RESULTS[1:])  # the persistent cache (several hundred bytes) is left out
    assert export_results(cache_dir, cache_dir.parent / "a.tgz")["left_out_oversized"] == [RESULTS[0]]


def test_export_then_restore_into_a_fresh_dir(cache_dir: Path, tmp_path: Path):
    progress = tmp_path / "autotune_progress.json"
    mark_compile(progress, "resnet50", 1)
    mark_compile(progress, "resnet50", 1, compile_s=80.04)
    mark_compile(progress, "efficientnet_b0", 256)  # the compile the kill interrupted
    archive = tmp_path / "out" / "autotune_cache.tgz"
    manifest = export_results(cache_dir, archive, progress)
    assert manifest["files"] == 3 and manifest["best_configs"] == 2 and manifest["autotune_ops"] == 3
    assert manifest["cells"][0] == {"model": "resnet50", "batch": 1, "compile_s": 80.0}
    assert manifest["cells"][1]["interrupted_after_s"] >= 0
    with tarfile.open(archive) as tar:
        assert sorted(tar.getnames()) == sorted(RESULTS + ["manifest.json"])
    fresh = tmp_path / "fresh"
    restored = restore_results(archive, fresh)
    assert restored.files == 3 and restored.manifest == manifest
    assert sorted(p.relative_to(fresh).as_posix() for p in fresh.rglob("*") if p.is_file()) == sorted(RESULTS)
    for relative in RESULTS:
        assert json.loads((fresh / relative).read_text()) == json.loads((cache_dir / relative).read_text())
    assert autotune_op_count(fresh) == 3


def test_a_second_export_carries_the_first_calls_history(cache_dir: Path, tmp_path: Path):
    progress = tmp_path / "a" / "autotune_progress.json"
    mark_compile(progress, "efficientnet_b0", 256)
    export_results(cache_dir, tmp_path / "a.tgz", progress)
    # Call B, restored from A and cut off again: call C must count A's and B's time.
    second_progress = tmp_path / "b" / "autotune_progress.json"
    mark_compile(second_progress, "efficientnet_b0", 256)
    restore_results(tmp_path / "a.tgz", tmp_path / "b_cache")
    second = export_results(tmp_path / "b_cache", tmp_path / "b.tgz", second_progress, previous=tmp_path / "a.tgz")
    assert [c["model"] for c in second["history"] + second["cells"]] == ["efficientnet_b0"] * 2
    assert autotune_op_count(tmp_path / "b_cache") == 3
    second["history"][0]["interrupted_after_s"] = 570.0  # as if the calls had run that long
    second["cells"][0]["interrupted_after_s"] = 300.0
    assert earlier_compile_s(second, "efficientnet_b0", 256) == 870.0
    assert earlier_compile_s(second, "efficientnet_b0", 1) == 0.0
    assert earlier_compile_s(None, "efficientnet_b0", 256) == 0.0


def test_restore_merges_into_an_existing_cache(cache_dir: Path, tmp_path: Path):
    archive = tmp_path / "a.tgz"
    export_results(cache_dir, archive)
    target = tmp_path / "target"
    own = {"system": {"hash": SYSTEM}, "cache": {"convolution": {CONV_KEY: {"highest": {"aten_convolution-def": 0.5}}}}}
    _write(target / RESULTS[0], json.dumps(own))
    _write(target / RESULTS[1], json.dumps({"XBLOCK": 1024}))
    restore_results(archive, target)
    merged = json.loads((target / RESULTS[0]).read_text())["cache"]
    assert merged["convolution"][CONV_KEY]["highest"] == {"aten_convolution-def": 0.5, "triton_convolution2d-abc": 0.11}
    assert len(merged["convolution"]) == 2 and "mm" in merged
    assert json.loads((target / RESULTS[1]).read_text()) == {"XBLOCK": 1024}  # this machine's own stays
    assert autotune_op_count(target) == 3


def test_missing_archive_is_a_no_op(tmp_path: Path):
    assert restore_results(tmp_path / "absent.tgz", tmp_path / "target") is None
    assert not (tmp_path / "target").exists()


def test_no_results_writes_no_archive(tmp_path: Path):
    _write(tmp_path / "inductor" / "ab" / "cabkernel.py", "import triton\n")
    assert export_results(tmp_path / "inductor", tmp_path / "a.tgz") is None
    assert not (tmp_path / "a.tgz").exists()


def _tar(path: Path, members: dict[str, bytes]) -> Path:
    with tarfile.open(path, "w:gz") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


@pytest.mark.parametrize("make", [
    lambda d: _write(d / "x.tgz", b"not a gzip at all") or d / "x.tgz",
    lambda d: _write(d / "x.tgz", (d / "good.tgz").read_bytes()[:60]) or d / "x.tgz",  # truncated
    lambda d: _tar(d / "x.tgz", {"manifest.json": b"{}", "../escape.best_config": b"{}"}),
    lambda d: _tar(d / "x.tgz", {"manifest.json": b"{}", "ab/ckernel.so": b"\x7fELF"}),
    lambda d: _tar(d / "x.tgz", {"manifest.json": b"{}", "triton/0/XYZ/triton_poi.json": b"{}"}),
    lambda d: _tar(d / "x.tgz", {"manifest.json": b"{}", "ab/c.best_config": b'{"XBLOCK": 1'}),
    lambda d: _tar(d / "x.tgz", {"ab/c.best_config": b"{}"}),  # no manifest
], ids=["garbage", "truncated", "path-escape", "compiled-file", "json-elsewhere", "torn-json",
                                                "no-manifest"])
def test_unusable_archive_is_a_one_line_error_and_writes_nothing(cache_dir: Path, tmp_path: Path, make):
    export_results(cache_dir, tmp_path / "good.tgz")
    archive = make(tmp_path)
    target = tmp_path / "target"
    with pytest.raises(CacheArchiveError) as info:
        restore_results(archive, target)
    assert "\n" not in str(info.value) and str(archive) in str(info.value)
    assert not target.exists() or not any(target.rglob("*"))


def test_cli_restore_of_a_corrupt_archive_exits_2_with_one_line(tmp_path: Path, capsys):
    _write(tmp_path / "x.tgz", b"\x1f\x8b garbage")
    assert inductor_cache.main(["restore", "--archive", str(tmp_path / "x.tgz"), "--cache", str(tmp_path / "c")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("restore: ")
