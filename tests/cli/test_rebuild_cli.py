"""`sartor build --bundle` and `sartor rebuild` on the command line: exit 0 for a byte-identical
rebuild, 1 when the rebuild differs or its golden outputs disagree, 2 with one line for a modified
bundle or a bad option."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from conftest import MAX_SHAPES, MIN_SHAPES, OPT_SHAPES, assert_cli_error, shape_flag

from sartor.deploy.golden import read_npz
from sartor.deploy.manifest import write_manifest


@pytest.fixture(scope="module")
def cli_bundle(tiny_onnx, tmp_path_factory) -> tuple[Path, Path]:
    from sartor.cli.main import main
    work = tmp_path_factory.mktemp("cli_bundle")
    engine, bundle = work / "tiny.plan", work / "tiny.bundle"
    code = main(["build", str(tiny_onnx), "-o", str(engine), "--device", "cpu", "--min-shapes", shape_flag(MIN_SHAPES),
                 "--opt-shapes", shape_flag(OPT_SHAPES), "--max-shapes", shape_flag(MAX_SHAPES),
                 "--bundle", str(bundle)])
    assert code == 0
    return engine, bundle


def _copy(bundle: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "copy.bundle"
    shutil.copytree(bundle, copy)
    return copy


def test_rebuild_is_identical_and_exits_0(cli_bundle, cli, tmp_path):
    engine, bundle = cli_bundle
    result = cli("rebuild", bundle, "-o", tmp_path / "again.plan")
    assert result.code == 0, result
    assert "identical to the bundle's engine" in result.out and "PASS: the same engine file" in result.out
    assert (tmp_path / "again.plan").read_bytes() == engine.read_bytes()
    as_json = cli("rebuild", bundle, "-o", tmp_path / "again.plan", "--json")
    report = json.loads(as_json.out)
    assert as_json.code == 0 and report["identical"] and report["same_machine"] and report["timed"] == 0


def test_build_prints_the_bundle(tiny_onnx, cli, tmp_path):
    result = cli("build", tiny_onnx, "-o", tmp_path / "e.plan", "--device", "cpu", "--builder-effort", "0",
                 "--opt-shapes", shape_flag(OPT_SHAPES), "--bundle", tmp_path / "b")
    assert result.code == 0, result
    assert f"bundle: {tmp_path / 'b'}" in result.out and "sartor rebuild" in result.out
    assert (tmp_path / "b" / "manifest.json").is_file()


def test_a_rebuild_that_differs_exits_1_naming_the_fields(cli_bundle, cli, tmp_path):
    _, bundle = cli_bundle
    moved = _copy(bundle, tmp_path)
    record = json.loads((moved / "engine.json").read_text())
    record["built_at"] = "2020-01-01T00:00:00Z"  # the rebuild records this time: another file
    (moved / "engine.json").write_text(json.dumps(record))
    write_manifest(moved)
    result = cli("rebuild", moved, "-o", tmp_path / "again.plan")
    assert result.code == 1, result
    assert "DIFFERS from the bundle's engine" in result.out and "provenance.built_at" in result.out


def test_golden_outputs_out_of_tolerance_exit_1(cli_bundle, cli, tmp_path):
    _, bundle = cli_bundle
    moved = _copy(bundle, tmp_path)
    cache = json.loads((moved / "timing_cache.json").read_text())
    for device in cache["devices"].values():
        device["fingerprint"]["torch"] = "0.0.0-another-toolkit"
    (moved / "timing_cache.json").write_text(json.dumps(cache))
    write_manifest(moved)
    result = cli("rebuild", moved, "-o", tmp_path / "retimed.plan")
    assert result.code == 0, result  # re-timed on this machine: the golden outputs agree
    assert "re-timed" in result.out and "PASS: all 1 golden output(s) agree" in result.out
    golden = read_npz(moved / "golden/engine_outputs.npz")
    np.savez(moved / "golden/engine_outputs.npz", **{k: v + 1.0 for k, v in golden.items()})
    write_manifest(moved)
    result = cli("rebuild", moved, "-o", tmp_path / "retimed.plan", "--min-cosine", "0.9999999")
    assert result.code == 1, result
    assert "FAIL: 1 golden output(s) below cosine" in result.out


def test_rebuild_errors_are_one_line(cli_bundle, cli, tmp_path):
    _, bundle = cli_bundle
    tampered = _copy(bundle, tmp_path)
    with open(tampered / "build_options.json", "a") as handle:
        handle.write(" ")
    assert_cli_error(cli("rebuild", tampered, "-o", tmp_path / "x.plan"), "was modified: build_options.json")
    assert_cli_error(cli("rebuild", tmp_path / "nowhere", "-o", tmp_path / "x.plan"), "not found")
    assert_cli_error(cli("rebuild", tmp_path, "-o", tmp_path / "x.plan"), "has no manifest.json")
    assert_cli_error(cli("rebuild", bundle, "-o", tmp_path / "x.plan", "--min-cosine", "2"), "--min-cosine 2")
    assert_cli_error(cli("rebuild", bundle, "-o", tmp_path / "no" / "x.plan"), "does not exist")
    assert not (tmp_path / "x.plan").exists()


@pytest.mark.parametrize("edit", [{"profiles": "oops"}, {"layer_precision": ["x"]}, {"builder_effort": "2"}])
def test_malformed_options_in_a_consistent_bundle_are_one_line(cli_bundle, cli, tmp_path, edit):
    """A bundle whose author rewrote the options and the manifest: refused in one line, not a traceback."""
    _, bundle = cli_bundle
    edited = _copy(bundle, tmp_path)
    options = json.loads((edited / "build_options.json").read_text())
    options["options"].update(edit)
    (edited / "build_options.json").write_text(json.dumps(options))
    write_manifest(edited)
    assert_cli_error(cli("rebuild", edited, "-o", tmp_path / "x.plan"), "build options are malformed")
    (edited / "golden/inputs.npz").write_bytes(b"not a zip")
    options["options"] = json.loads((bundle / "build_options.json").read_text())["options"]
    (edited / "build_options.json").write_text(json.dumps(options))
    write_manifest(edited)
    assert_cli_error(cli("rebuild", edited, "-o", tmp_path / "x.plan"), "inputs.npz is not a readable .npz")


def test_build_bundle_errors_are_one_line(tiny_onnx, cli_bundle, cli, tmp_path):
    _, bundle = cli_bundle
    out = tmp_path / "e.plan"
    assert_cli_error(cli("build", tiny_onnx, "-o", out, "--device", "cpu", "--bundle", bundle), "already exists")
    assert_cli_error(cli("build", tiny_onnx, "-o", out, "--device", "cpu", "--bundle", tmp_path / "no" / "b"),
                     "does not exist")
    # A build that fails (here: a dynamic input without shapes) leaves no bundle and no staging directory.
    assert_cli_error(cli("build", tiny_onnx, "-o", out, "--device", "cpu", "--bundle", tmp_path / "b"),
                     "dynamic shape")
    assert sorted(p.name for p in tmp_path.iterdir()) == []
