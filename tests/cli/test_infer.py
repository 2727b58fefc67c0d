"""`sartor infer` in one process: real photos (scikit-image's) through folders, files and listings
write what `Pipeline.run` returns, detections and class scores alike, to JSON Lines and Parquet;
every input a user can get wrong is refused in one line (exit 2), `--ray` without Ray too. The
`--ray` runs themselves are in tests/integrations/test_ray_infer.py."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import IMAGE, MAX_SHAPES, MIN_SHAPES, OPT_SHAPES, assert_cli_error, save_photos

import sartor
from sartor.pipeline import Pipeline

pytest.importorskip("skimage.data")  # the photos save_photos writes
ROOT = Path(__file__).resolve().parents[2]
DETECTOR = ROOT / "samples" / "detector" / "sample_detector.onnx"
PHOTOS = ["astronaut", "coffee", "chelsea", "rocket", "camera"]
BATCH = 2


@pytest.fixture(scope="module")
def photo_dir(tmp_path_factory) -> Path:
    return save_photos(tmp_path_factory.mktemp("photos"), PHOTOS)


@pytest.fixture(scope="module")
def classifier_plan(tmp_path_factory, tiny_onnx) -> Path:
    out = tmp_path_factory.mktemp("infer_engines") / "classifier.plan"
    sartor.build(tiny_onnx, out, device="cpu", min_shapes=MIN_SHAPES, opt_shapes=OPT_SHAPES, max_shapes=MAX_SHAPES,
                 preprocess=f"letterbox={IMAGE},mean=0,std=255,rgb,nchw")
    return out


@pytest.fixture(scope="module")
def detector_plan(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("infer_engines") / "detector_nms.plan"
    shapes = {"images": (BATCH, 3, 320, 320)}
    sartor.build(DETECTOR, out, device="cpu", preprocess="letterbox=320,mean=0,std=255,rgb,nchw", builder_effort=0,
                 nms="conf=0.05,iou=0.45,max_det=50,topk=500", min_shapes={"images": (1, 3, 320, 320)},
                 opt_shapes=shapes, max_shapes=shapes)
    return out


def photos(folder: Path) -> list[str]:
    return sorted(str(p) for p in folder.iterdir())


def read_rows(path: Path) -> list[dict]:
    if path.suffix == ".jsonl":
        return [json.loads(line) for line in path.read_text().splitlines()]
    import pyarrow.parquet as pq
    return pq.read_table(path).to_pylist()


def test_detections_equal_the_pipelines_in_both_formats(cli, photo_dir, detector_plan, tmp_path):
    files = photos(photo_dir)
    expected = Pipeline(sartor.load(detector_plan, device="cpu"), batch_size=BATCH).run(files)
    formats = [".jsonl"] + ([".parquet"] if _has("pyarrow") else [])
    for suffix in formats:
        out = tmp_path / f"results{suffix}"
        result = cli("infer", detector_plan, photo_dir, "-o", out, "--device", "cpu", "--ray-batches", "1")
        assert result.code == 0, result
        rows = read_rows(out)
        assert [r["path"] for r in rows] == files
        for row, want in zip(rows, expected):
            assert set(row) == {"path", "boxes", "scores", "classes"}
            np.testing.assert_array_equal(np.asarray(row["boxes"], np.float32).reshape(-1, 4), want.detections.boxes)
            np.testing.assert_array_equal(np.asarray(row["scores"], np.float32), want.detections.scores)
            np.testing.assert_array_equal(np.asarray(row["classes"]), want.detections.classes)
        assert sum(len(r["scores"]) for r in rows) > 0  # something was detected, so equality says something


def test_class_scores_from_files_and_a_listing_keep_their_order_and_names(cli, photo_dir, classifier_plan, tmp_path):
    files = photos(photo_dir)
    (tmp_path / "sub").mkdir()
    copied = tmp_path / "sub" / "copy.jpg"
    copied.write_bytes(Path(files[4]).read_bytes())
    listing = tmp_path / "frames.txt"  # one absolute path, one relative to the listing's folder
    listing.write_text(f"# chosen frames\n{files[3]}\n\nsub/copy.jpg\n")
    out = tmp_path / "scores.jsonl"
    result = cli("infer", classifier_plan, files[1], listing, files[0], "-o", out, "--batch-size", "3")
    assert result.code == 0, result
    rows = read_rows(out)
    order = [files[1], files[3], str(copied), files[0]]
    assert [r["path"] for r in rows] == order
    expected = Pipeline(sartor.load(classifier_plan, device="cpu"), batch_size=3).run(order)
    for row, want in zip(rows, expected):
        np.testing.assert_array_equal(np.asarray(row["logits"], np.float32), want.outputs["logits"])
    assert len({json.dumps(r["logits"]) for r in rows}) == len(rows)  # the photos really differ
    assert "wrote 4 row(s)" in result.err


def test_a_bad_image_stops_the_run_or_becomes_a_row_with_its_error(cli, photo_dir, classifier_plan, tmp_path):
    bad = tmp_path / "broken.jpg"
    bad.write_bytes(b"\xff\xd8\xff\xe0 truncated")
    out = tmp_path / "scores.jsonl"
    line = assert_cli_error(cli("infer", classifier_plan, photos(photo_dir)[0], bad, "-o", out),
                            "1 of 2 images failed", "broken.jpg")
    assert not out.exists(), line
    result = cli("infer", classifier_plan, photos(photo_dir)[0], bad, "-o", out, "--skip-bad")
    assert result.code == 0, result
    good, failed = read_rows(out)
    assert good["error"] is None and len(good["logits"]) > 0
    assert "corrupt" in failed["error"] and failed["logits"] is None
    assert "1 image(s) failed" in result.err


@pytest.mark.parametrize("problem", ["empty-folder", "empty-listing", "missing-input", "format", "engine", "batch",
                                     "ray-options"])
def test_what_a_user_can_get_wrong_is_refused_in_one_line(cli, classifier_plan, photo_dir, tmp_path, problem):
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "notes.txt.bak").write_text("not an image")
    (tmp_path / "none.txt").write_text("# nothing yet\n\n")
    argv, expected = {
        "empty-folder": ([classifier_plan, empty, "-o", tmp_path / "r.jsonl"], "no image files"),
        "empty-listing": ([classifier_plan, tmp_path / "none.txt", "-o", tmp_path / "r.jsonl"], "names no image"),
        "missing-input": ([classifier_plan, tmp_path / "absent", "-o", tmp_path / "r.jsonl"], "no such file or folder"),
        "format": ([classifier_plan, photo_dir, "-o", tmp_path / "r.csv"], "write .parquet or .jsonl"),
        "engine": ([tmp_path / "absent.plan", photo_dir, "-o", tmp_path / "r.jsonl"], "engine file not found"),
        "batch": ([classifier_plan, photo_dir, "-o", tmp_path / "r.jsonl", "--batch-size", "32"],
                  "batch size 32 is outside 1..4"),
        "ray-options": ([classifier_plan, photo_dir, "-o", tmp_path / "r.jsonl", "--concurrency", "2"], "add --ray"),
    }[problem]
    assert_cli_error(cli("infer", *argv), expected)
    assert not (tmp_path / "r.jsonl").exists()


def test_ray_without_ray_names_the_extra(classifier_plan, photo_dir, tmp_path):
    # Ray made unimportable as if never installed (how tests/test_installs.py hides packages).
    code = ("import sys; sys.modules['ray'] = None; from sartor.cli.main import main; "
            f"sys.exit(main(['infer', {str(classifier_plan)!r}, {str(photo_dir)!r}, '-o', "
            f"{str(tmp_path / 'r.jsonl')!r}, '--ray']))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT,
                          check=False)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    assert lines[0].startswith("error: sartor infer --ray needs the ray extra: pip install 'sartor[ray]'"), lines


def _has(module: str) -> bool:
    import importlib.util
    return importlib.util.find_spec(module) is not None
