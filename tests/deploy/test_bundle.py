"""Provenance bundles (`sartor build --bundle`) and `sartor rebuild`: what a bundle holds, byte-identical
rebuilds (FP32, and INT8 from the calibration cache), modified bundles refused, and a rebuild on
another fingerprint that re-times and judges the golden outputs."""
from __future__ import annotations

import io
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import MAX_SHAPES, MIN_SHAPES, OPT_SHAPES, gaussian_images
from PIL import Image

import sartor
from sartor.builder import BuildConfig
from sartor.deploy import BundleError, rebuild, verify_bundle
from sartor.deploy import bundle as bundle_module
from sartor.deploy.archive import write_archive
from sartor.deploy.bundle import config_from_options
from sartor.deploy.golden import read_npz
from sartor.deploy.manifest import file_sha256, write_manifest
from sartor.errors import ConfigError, FingerprintMismatchError
from sartor.runtime.engine_file import pack, read_engine_file

SHAPES = {"min": MIN_SHAPES, "opt": OPT_SHAPES, "max": MAX_SHAPES}
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("bundles")


@pytest.fixture(scope="module")
def fp32_bundle(tiny_onnx, work) -> tuple[Path, Path]:
    engine, bundle = work / "tiny.plan", work / "tiny.bundle"
    result = sartor.build(tiny_onnx, engine, device="cpu", profiles=[SHAPES], bundle=bundle)
    assert result.path == str(bundle) and result.build.path == str(engine)
    return engine, bundle


@pytest.fixture(scope="module")
def calib_npy(work) -> Path:
    path = work / "calib.npy"
    np.save(path, gaussian_images(3, 12))
    return path


@pytest.fixture(scope="module")
def int8_bundle(tiny_onnx, work, calib_npy) -> tuple[Path, Path]:
    engine, bundle = work / "tiny_int8.plan", work / "tiny_int8.bundle"
    sartor.build(tiny_onnx, engine, device="cpu", profiles=[SHAPES], precision="int8", calib=calib_npy,
                 bias_correction=True, bundle=bundle)
    return engine, bundle


def copy_bundle(bundle: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "copy.bundle"
    shutil.copytree(bundle, copy)
    return copy


def test_bundle_holds_what_made_the_engine(fp32_bundle, tiny_onnx):
    engine, bundle = fp32_bundle
    manifest = verify_bundle(bundle)
    files = set(manifest["files"])
    assert {"model.onnx", "build_options.json", "timing_cache.json", "fingerprint.json", "versions.json",
            "engine.json", "engine_header.json", "golden/inputs.npz", "golden/engine_outputs.npz",
            "golden/reference_outputs.npz", "golden/golden.json"} <= files
    assert "calibration_cache.json" not in files  # an FP32 build has none
    for name, entry in manifest["files"].items():
        assert file_sha256(bundle / name) == entry["sha256"]
    assert (bundle / "model.onnx").read_bytes() == tiny_onnx.read_bytes()
    assert json.loads((bundle / "engine.json").read_text())["sha256"] == file_sha256(engine)
    header, _ = read_engine_file(engine)
    assert json.loads((bundle / "fingerprint.json").read_text()) == header["fingerprint"]
    assert json.loads((bundle / "engine_header.json").read_text()) == header
    # The engine records the bundle's files by label, not the temporary directory they were in.
    assert header["build_config"]["model_path"] == "<bundle>/model.onnx"
    assert header["build_config"]["output_path"] == "<output>"
    assert "build_seconds" not in header["provenance"]
    # Its options turn back into the BuildConfig the engine was built from.
    options = json.loads((bundle / "build_options.json").read_text())
    config = config_from_options(options["options"], bundle, "x.plan")
    assert config.profiles == header["build_config"]["profiles"] and config.device == "cpu"
    assert options["as_given"]["model_path"] == str(tiny_onnx)
    # The golden outputs are the engine's on the golden inputs, and agree with ONNX Runtime.
    feeds = read_npz(bundle / "golden/inputs.npz")
    assert feeds["images"].shape == OPT_SHAPES["images"]
    outputs = sartor.load(engine, device="cpu").context().run(feeds)
    np.testing.assert_array_equal(read_npz(bundle / "golden/engine_outputs.npz")["logits"], outputs["logits"])
    np.testing.assert_allclose(read_npz(bundle / "golden/reference_outputs.npz")["logits"], outputs["logits"],
                               atol=1e-4)
    versions = json.loads((bundle / "versions.json").read_text())
    assert versions["sartor"] == sartor.__version__ and versions["torch"]
    assert not [p for p in bundle.parent.iterdir() if p.name.startswith(".tiny.bundle.")]  # no staging left


def test_fp32_rebuild_is_byte_identical(fp32_bundle, tmp_path):
    engine, bundle = fp32_bundle
    report = rebuild(bundle, tmp_path / "again.plan")
    assert report.same_machine and report.timed == 0, report.why_retimed
    assert report.identical and report.passed and report.differing_fields == []
    assert (tmp_path / "again.plan").read_bytes() == engine.read_bytes()
    assert [row.cosine for row in report.agreement] == [pytest.approx(1.0)]
    verify_bundle(bundle)  # the rebuild wrote nothing into the bundle


def test_int8_rebuild_from_the_calibration_cache_is_byte_identical(int8_bundle, calib_npy, tmp_path):
    engine, bundle = int8_bundle
    header, _ = read_engine_file(engine)
    calibration = header["provenance"]["calibration"]
    assert calibration["from_cache"] and calibration["cache"] == "<bundle>/calibration_cache.json"
    assert header["provenance"]["calibration"]["bias_correction"]
    assert any(layer["precision"] == "int8" for layer in header["layers"])
    samples = json.loads((bundle / "calibration/samples.json").read_text())
    assert samples["copied"] and samples["files"] == [{"path": "calib.npy", "sha256": file_sha256(calib_npy),
                                                       "bytes": calib_npy.stat().st_size}]
    assert (bundle / "calibration/samples/calib.npy").read_bytes() == calib_npy.read_bytes()
    cache = json.loads((bundle / "calibration_cache.json").read_text())
    assert cache["calib_sha256"] == calibration["calib_sha256"] and cache["bias_correction"]
    # Real calibration samples are the golden inputs.
    np.testing.assert_array_equal(read_npz(bundle / "golden/inputs.npz")["images"], np.load(calib_npy)[:2])
    report = rebuild(bundle, tmp_path / "again.plan")
    assert report.same_machine and report.timed == 0 and report.identical and report.passed
    assert (tmp_path / "again.plan").read_bytes() == engine.read_bytes()


def test_large_calibration_sets_are_listed_not_copied(tiny_onnx, calib_npy, tmp_path, monkeypatch):
    monkeypatch.setattr(bundle_module, "CALIB_COPY_LIMIT", calib_npy.stat().st_size - 1)
    bundle = tmp_path / "b"
    sartor.build(tiny_onnx, tmp_path / "e.plan", device="cpu", profiles=[SHAPES], precision="int8",
                 calib=calib_npy, builder_effort=0, bundle=bundle)
    samples = json.loads((bundle / "calibration/samples.json").read_text())
    assert not samples["copied"] and samples["copy_limit_bytes"] == calib_npy.stat().st_size - 1
    assert samples["files"][0]["sha256"] == file_sha256(calib_npy)
    assert not (bundle / "calibration/samples").exists()
    assert rebuild(bundle, tmp_path / "again.plan").identical  # the calibration cache stands for the samples


def test_modified_bundles_are_refused(fp32_bundle, tmp_path):
    _, bundle = fp32_bundle
    edited = copy_bundle(bundle, tmp_path)
    model = bytearray((edited / "model.onnx").read_bytes())
    model[-1] ^= 1
    (edited / "model.onnx").write_bytes(bytes(model))
    with pytest.raises(BundleError, match="was modified: model.onnx does not match its SHA-256"):
        rebuild(edited, tmp_path / "out.plan")
    assert not (tmp_path / "out.plan").exists()
    shutil.rmtree(edited)
    added = copy_bundle(bundle, tmp_path)
    (added / "golden" / "extra.npz").write_bytes(b"x")
    with pytest.raises(BundleError, match="golden/extra.npz is not in its manifest"):
        verify_bundle(added)
    (added / "golden" / "extra.npz").unlink()
    (added / "timing_cache.json").unlink()
    with pytest.raises(BundleError, match="incomplete: timing_cache.json is listed"):
        verify_bundle(added)
    (added / "manifest.json").write_text("{not json")
    with pytest.raises(BundleError, match="manifest.json is not readable JSON"):
        verify_bundle(added)
    with pytest.raises(BundleError, match="has no manifest.json"):
        verify_bundle(tmp_path)
    with pytest.raises(BundleError, match="not found"):
        verify_bundle(tmp_path / "missing")


def _edit_json(bundle: Path, name: str, edit) -> None:
    """Change one of the bundle's files and write its manifest again, as a bundle's author would."""
    path = bundle / name
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))
    write_manifest(bundle)


def _other_sartor(cache: dict) -> None:
    for device in cache["devices"].values():
        device["fingerprint"]["sartor"] = "0.0.1"


def test_a_changed_fingerprint_retimes_and_judges_the_golden_outputs(fp32_bundle, tmp_path):
    _, bundle = fp32_bundle
    moved = copy_bundle(bundle, tmp_path)
    _edit_json(moved, "timing_cache.json", _other_sartor)  # the timings were measured under another toolkit
    report = rebuild(moved, tmp_path / "retimed.plan")
    assert not report.same_machine and "no timings for this machine" in report.why_retimed
    assert report.timed > 0 and report.passed  # the same machine in truth: the same outputs
    assert all(row.cosine == pytest.approx(1.0) and row.reference_cosine > 0.9999 for row in report.agreement)
    header, _ = read_engine_file(tmp_path / "retimed.plan")
    assert {layer["tactic_source"] for layer in header["layers"]} >= {"timed"}
    # The fingerprint the bundle was built on differs from this machine's: named in the report.
    _edit_json(moved, "fingerprint.json", lambda fp: fp.update(cpu="another CPU"))
    report = rebuild(moved, tmp_path / "retimed.plan")
    assert not report.same_machine and "differs from the bundle's in cpu" in report.why_retimed


def test_golden_outputs_outside_tolerance_fail(fp32_bundle, tmp_path):
    _, bundle = fp32_bundle
    moved = copy_bundle(bundle, tmp_path)
    _edit_json(moved, "timing_cache.json", _other_sartor)
    golden = read_npz(moved / "golden/engine_outputs.npz")
    np.savez(moved / "golden/engine_outputs.npz", **{name: -value for name, value in golden.items()})
    write_manifest(moved)
    report = rebuild(moved, tmp_path / "retimed.plan")
    assert not report.passed and [row.passed for row in report.agreement] == [False]
    assert report.agreement[0].cosine == pytest.approx(-1.0)


def test_bundle_refusals(tiny_onnx, fp32_bundle, calib_npy, tmp_path):
    _, bundle = fp32_bundle
    with pytest.raises(BundleError, match="already exists"):
        sartor.build(tiny_onnx, tmp_path / "e.plan", device="cpu", profiles=[SHAPES], bundle=bundle)
    with pytest.raises(ConfigError, match="--bundle cannot record a build with --min-cosine"):
        sartor.build(tiny_onnx, tmp_path / "e.plan", device="cpu", profiles=[SHAPES], precision="int8",
                     calib=calib_npy, min_cosine=0.99, bundle=tmp_path / "b")
    assert not (tmp_path / "b").exists() and not (tmp_path / "e.plan").exists()
    with pytest.raises(BundleError, match="inside the bundle"):
        rebuild(bundle, bundle / "again.plan")
    with pytest.raises(BundleError, match="which this sartor does not know"):
        config_from_options(dict(BuildConfig("m", "o").to_json(), future_option=1), bundle, "o")


def test_sigterm_during_a_bundle_build_leaves_no_directory(tiny_onnx, tmp_path):
    """A real process told to stop while its bundle is half made (held in its progress callback)
    removes the temporary directory: neither the bundle nor a staging directory stays."""
    marker, bundle = tmp_path / "building", tmp_path / "b"
    script = textwrap.dedent(f"""
        import time
        from pathlib import Path
        from sartor.builder import BuildConfig
        from sartor.deploy import build_bundle

        def progress(stage):
            if stage == "tactics":  # the staging directory holds the model and the first caches by now
                Path({str(marker)!r}).touch()
                time.sleep(600)

        config = BuildConfig({str(tiny_onnx)!r}, {str(tmp_path / "e.plan")!r}, device="cpu",
                             profiles=[{SHAPES!r}])
        build_bundle(config, {str(bundle)!r}, progress=progress)
    """)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    child = subprocess.Popen([sys.executable, "-c", script], env=env, stderr=subprocess.PIPE)
    try:
        while not marker.exists():
            assert child.poll() is None, child.stderr.read().decode()
            time.sleep(0.05)
        assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".b.")]  # staging, while it builds
        child.send_signal(signal.SIGTERM)
        assert child.wait(timeout=120) == 128 + signal.SIGTERM
    finally:
        if child.poll() is None:
            child.kill()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["building"]


def image_folder(directory: Path) -> Path:
    """An ImageFolder of three of the tiny classifier's ten classes, two noise images each."""
    rng = np.random.default_rng(5)
    for label in ("c0", "c3", "c7"):
        (directory / label).mkdir(parents=True)
        for k in range(2):
            Image.fromarray(rng.integers(0, 256, (16, 16, 3), dtype=np.uint8)).save(directory / label / f"{k}.png")
    return directory


def test_labelled_validation_data_measures_the_accuracy_drop(tiny_onnx, calib_npy, tmp_path, cli):
    data = image_folder(tmp_path / "val")
    classes = [f"c{k}" for k in range(10)]
    bundle = tmp_path / "b"
    sartor.build(tiny_onnx, tmp_path / "e.plan", device="cpu", profiles=[SHAPES], precision="int8", calib=calib_npy,
                 builder_effort=0, data=data, classes=classes, preprocess="resize=16x16,mean=0,std=255,rgb,nchw",
                 bundle=bundle)
    record = json.loads((bundle / "validation/validation.json").read_text())
    measured = record["measured"]
    assert record["copied"] and measured["metric"] == "top-1" and measured["images"] == 6
    assert (bundle / "validation/data/c3/1.png").read_bytes() == (data / "c3/1.png").read_bytes()
    report = rebuild(bundle, tmp_path / "again.plan")
    assert report.identical and report.accuracy is not None and report.accuracy.drop == 0.0 and report.passed
    assert report.accuracy.reference == measured["reference"]
    # A bundle that says its engine scored higher: the rebuild's drop is over the limit.
    _edit_json(bundle, "validation/validation.json", lambda r: r["measured"].update(engine=r["measured"]["engine"] + 0.5))
    report = rebuild(bundle, tmp_path / "again.plan", max_drop=0.1)
    assert report.identical and report.accuracy.drop == pytest.approx(0.5) and not report.passed
    result = cli("rebuild", bundle, "-o", tmp_path / "again.plan", "--max-drop", "0.1")
    assert result.code == 1 and "FAIL: the validation top-1 dropped by more than 0.1" in result.out, result
    assert "drop 0.5000" in result.out


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: on the CPU Triton's interpreter "
                    "compiles nothing, so no kernel is embedded")
def test_cuda_int8_rebuild_is_byte_identical_even_with_an_empty_triton_cache(tiny_onnx, calib_npy, tmp_path):
    engine, bundle = tmp_path / "e.plan", tmp_path / "b"
    sartor.build(tiny_onnx, engine, device="cuda", profiles=[SHAPES], precision="int8", calib=calib_npy,
                 bundle=bundle)
    assert read_engine_file(engine)[0]["kernels"]["embedded"]
    report = rebuild(bundle, tmp_path / "same.plan")
    assert report.same_machine and report.identical and report.passed, report.differing_fields
    # A fresh process with an empty Triton cache compiles every kernel again: still the same file.
    env = dict(os.environ, TRITON_CACHE_DIR=str(tmp_path / "empty_triton_cache"), PYTHONPATH=str(ROOT))
    env.pop("TRITON_INTERPRET", None)
    run = subprocess.run([sys.executable, "-m", "sartor", "rebuild", str(bundle), "-o", str(tmp_path / "fresh.plan"),
                          "--json"], check=False, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, (run.stdout[-3000:], run.stderr[-3000:])
    assert (tmp_path / "fresh.plan").read_bytes() == engine.read_bytes()


def test_a_bundled_engine_on_another_machine_names_sartor_rebuild(fp32_bundle, tmp_path):
    engine, _ = fp32_bundle
    header, tensors = read_engine_file(engine)
    # Another CPU architecture: a difference every compatibility level refuses (a CPU model name
    # alone is only warned about).
    header["fingerprint"]["cpu"] = "another CPU"
    header["fingerprint"]["arch"] = "riscv64"
    moved = tmp_path / "moved.plan"
    moved.write_bytes(pack(header, tensors))
    with pytest.raises(FingerprintMismatchError, match=r"differs in arch.*sartor rebuild BUNDLE -o OUT.plan"):
        sartor.load(moved, device="cpu")


def test_a_bundle_as_one_tar_file(tiny_onnx, tmp_path):
    archive = tmp_path / "tiny.tar"
    engine = tmp_path / "e.plan"
    sartor.build(tiny_onnx, engine, device="cpu", profiles=[SHAPES], bundle=archive)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["e.plan", "tiny.tar"]  # no staging directory left
    with tarfile.open(archive) as tar:
        names = tar.getnames()
        assert names == sorted(names) and "manifest.json" in names and "model.onnx" in names
        assert {(m.uid, m.uname) for m in tar.getmembers()} == {(0, "")}
        tar.extractall(tmp_path / "unpacked", filter="data")
    # The same directory gives the same tar, byte for byte.
    write_archive(tmp_path / "unpacked", tmp_path / "again.tar", "2026-01-01T00:00:00Z")
    write_archive(tmp_path / "unpacked", tmp_path / "twice.tar", "2026-01-01T00:00:00Z")
    assert (tmp_path / "again.tar").read_bytes() == (tmp_path / "twice.tar").read_bytes()
    report = rebuild(archive, tmp_path / "rebuilt.plan")
    assert report.identical and report.passed and report.bundle == str(archive)
    assert (tmp_path / "rebuilt.plan").read_bytes() == engine.read_bytes()
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]  # the extracted copy is gone
    # A member edited: refused, named by the tar.
    model = tmp_path / "unpacked" / "model.onnx"
    model.write_bytes(model.read_bytes() + b"\0")
    write_archive(tmp_path / "unpacked", tmp_path / "edited.tar", "2026-01-01T00:00:00Z")
    with pytest.raises(BundleError, match=rf"bundle {tmp_path / 'edited.tar'} was modified: model.onnx"):
        rebuild(tmp_path / "edited.tar", tmp_path / "x.plan")
    # Members that would land outside the extraction directory, and files that are not tars.
    with tarfile.open(tmp_path / "evil.tar", "w") as tar:
        info = tarfile.TarInfo("../outside.txt")
        info.size = 1
        tar.addfile(info, io.BytesIO(b"x"))
    with pytest.raises(BundleError, match="holds a member sartor will not extract"):
        rebuild(tmp_path / "evil.tar", tmp_path / "x.plan")
    assert not (tmp_path.parent / "outside.txt").exists()
    (tmp_path / "junk.tar").write_bytes(b"not a tar at all" * 64)
    with pytest.raises(BundleError, match="is not a readable tar"):
        rebuild(tmp_path / "junk.tar", tmp_path / "x.plan")
    with pytest.raises(BundleError, match="not found"):
        rebuild(tmp_path / "missing.tar", tmp_path / "x.plan")
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]
