"""`SartorPredictor` under `Dataset.map_batches` on a local Ray (CPU, 2 workers): over real photos
(scikit-image's) given as paths, bytes and decoded frames it returns exactly what `Pipeline.run`
returns, class scores and in-engine NMS detections alike; bad images are refused or reported per
row; the example script writes Parquet over a directory."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import IMAGE, MAX_SHAPES, MIN_SHAPES, OPT_SHAPES, save_photos
from PIL import Image

import sartor
from sartor.errors import ConfigError, DataError
from sartor.integrations.ray_data import SartorPredictor
from sartor.pipeline import Pipeline, YoloNms

ray = pytest.importorskip("ray")
pytest.importorskip("skimage.data")  # the photos save_photos writes
ROOT = Path(__file__).resolve().parents[2]
DETECTOR = ROOT / "samples" / "detector" / "sample_detector.onnx"
PHOTOS = ["astronaut", "coffee", "chelsea", "rocket", "camera", "immunohistochemistry", "hubble_deep_field"]
BATCH = 3  # the Pipeline's and map_batches' batch: the same chunks, so the same runs


@pytest.fixture(scope="module")
def photo_dir(tmp_path_factory) -> Path:
    return save_photos(tmp_path_factory.mktemp("photos"), PHOTOS)


@pytest.fixture(scope="module")
def classifier_plan(tmp_path_factory, tiny_onnx) -> Path:
    out = tmp_path_factory.mktemp("ray_engines") / "classifier.plan"
    sartor.build(tiny_onnx, out, device="cpu", min_shapes=MIN_SHAPES, opt_shapes=OPT_SHAPES, max_shapes=MAX_SHAPES,
                 preprocess=f"letterbox={IMAGE},mean=0,std=255,rgb,nchw")
    return out


def build_detector(folder: Path, nms: str | None) -> Path:
    out = folder / ("detector_nms.plan" if nms else "detector_raw.plan")
    shapes = {"images": (BATCH, 3, 320, 320)}
    sartor.build(DETECTOR, out, device="cpu", preprocess="letterbox=320,mean=0,std=255,rgb,nchw", builder_effort=0,
                 nms=nms, min_shapes={"images": (1, 3, 320, 320)}, opt_shapes=shapes, max_shapes=shapes)
    return out


@pytest.fixture(scope="module")
def detector_plan(tmp_path_factory) -> Path:
    return build_detector(tmp_path_factory.mktemp("ray_engines"), "conf=0.05,iou=0.45,max_det=50,topk=500")


@pytest.fixture(scope="module")
def raw_detector_plan(tmp_path_factory) -> Path:
    return build_detector(tmp_path_factory.mktemp("ray_engines"), None)


def pipeline_results(plan: Path, items: list, **options) -> list:
    """`Pipeline.run` in this process, on one thread as Ray's actors run torch (OMP_NUM_THREADS=1):
    the CPU's convolutions sum in another order on more threads."""
    import torch
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return Pipeline(sartor.load(plan, device="cpu"), batch_size=BATCH, **options).run(items)
    finally:
        torch.set_num_threads(threads)


def paths(folder: Path) -> list[str]:
    return sorted(str(p) for p in folder.iterdir())


def mapped(local_ray, rows: list[dict], plan: Path, **options) -> list[dict]:
    ds = local_ray.data.from_items(rows, override_num_blocks=1)
    ds = ds.map_batches(SartorPredictor, fn_constructor_args=(str(plan),), fn_constructor_kwargs=options,
                        batch_size=BATCH, concurrency=1, batch_format="numpy")
    return ds.take_all()


@pytest.mark.parametrize("form", ["path", "bytes", "frame"])
def test_class_scores_equal_the_pipelines_for_paths_bytes_and_frames(local_ray, photo_dir, classifier_plan, form):
    files = paths(photo_dir)
    items = {"path": files, "bytes": [Path(f).read_bytes() for f in files],
             "frame": [np.asarray(Image.open(f).convert("RGB")) for f in files]}[form]
    rows = mapped(local_ray, [{"image": item, "index": i} for i, item in enumerate(items)], classifier_plan,
                  batch_size=BATCH)
    expected = pipeline_results(classifier_plan, items)
    assert [r["index"] for r in rows] == list(range(len(files)))
    assert ("image" in rows[0]) == (form == "path")  # paths are kept to name the results
    for row, want in zip(rows, expected):
        np.testing.assert_array_equal(row["logits"], want.outputs["logits"])
    assert len({row["logits"].tobytes() for row in rows}) == len(files)  # the photos really differ


def test_detections_equal_the_pipelines_in_engine_nms(local_ray, photo_dir, detector_plan):
    files = paths(photo_dir)
    rows = mapped(local_ray, [{"path": f} for f in files], detector_plan, column="path")
    expected = pipeline_results(detector_plan, files)
    assert [r["path"] for r in rows] == files
    for row, want in zip(rows, expected):
        np.testing.assert_array_equal(np.asarray(row["boxes"]).reshape(-1, 4), want.detections.boxes)
        np.testing.assert_array_equal(np.asarray(row["scores"]), want.detections.scores)
        np.testing.assert_array_equal(np.asarray(row["classes"]), want.detections.classes)
    assert sum(len(r["scores"]) for r in rows) > 0  # something was detected, so equality says something


def test_a_raw_yolo_head_is_decoded_as_the_pipelines_yolonms_decodes(local_ray, photo_dir, raw_detector_plan):
    files = paths(photo_dir)
    rows = mapped(local_ray, [{"path": f} for f in files], raw_detector_plan, column="path", decoder="yolo",
                  conf=0.05, iou=0.5, max_det=20)
    expected = pipeline_results(raw_detector_plan, files, decoder=YoloNms(conf=0.05, iou=0.5, max_det=20),
                                host_outputs=False)
    for row, want in zip(rows, expected):
        np.testing.assert_array_equal(np.asarray(row["boxes"]).reshape(-1, 4), want.detections.boxes)
        np.testing.assert_array_equal(np.asarray(row["scores"]), want.detections.scores)
        np.testing.assert_array_equal(np.asarray(row["classes"]), want.detections.classes)
    assert 0 < max(len(r["scores"]) for r in rows) <= 20
    raw = mapped(local_ray, [{"path": files[0]}], raw_detector_plan, column="path", decoder="none")
    assert "boxes" not in raw[0] and raw[0]["output0"].ndim == 2  # the head's [4+C, N] as it came


def test_bad_images_are_refused_or_reported_per_row(local_ray, photo_dir, classifier_plan):
    files = paths(photo_dir)[:3]
    items = [Path(files[0]).read_bytes(), b"\xff\xd8\xff\xe0 truncated", Path(files[1]).read_bytes()]
    with pytest.raises(Exception, match="1 of 3 images failed: image item 1 is corrupt"):
        mapped(local_ray, [{"image": b} for b in items], classifier_plan)
    rows = mapped(local_ray, [{"image": b} for b in items], classifier_plan, skip_bad=True)
    assert [r["error"] is None for r in rows] == [True, False, True]
    assert np.isnan(rows[1]["logits"]).all() and not np.isnan(rows[0]["logits"]).any()


def test_the_predictor_refuses_what_it_cannot_run(classifier_plan, tmp_path):
    predictor = SartorPredictor(str(classifier_plan), device="cpu")
    with pytest.raises(ConfigError, match="the batch has no column 'image' \\(it has path\\)"):
        predictor({"path": np.array(["a.jpg"])})
    with pytest.raises(ConfigError, match="decoder 'ssd' is not one of auto, none, yolo"):
        SartorPredictor(str(classifier_plan), decoder="ssd")
    with pytest.raises(DataError, match="1 of 1 images failed: image .*missing.jpg cannot be read"):
        predictor({"image": np.array([str(tmp_path / "missing.jpg")])})
    missing = tmp_path / "none.plan"
    with pytest.raises(sartor.SartorError):
        SartorPredictor(str(missing))


@pytest.mark.parametrize("source", ["directory", "listing"])
def test_the_example_writes_parquet_over_a_directory_or_a_listing(photo_dir, classifier_plan, tmp_path, source):
    import pyarrow as pa
    import pyarrow.parquet as pq
    out = tmp_path / "results"
    argv = [str(photo_dir)]
    if source == "listing":
        pq.write_table(pa.table({"file": paths(photo_dir)}), tmp_path / "listing.parquet")
        argv = [str(tmp_path / "listing.parquet"), "--column", "file"]
    done = subprocess.run([sys.executable, str(ROOT / "deploy" / "ray" / "ray_data_directory.py"), str(classifier_plan),
                           argv[0], str(out), *argv[1:], "--num-cpus", "2", "--batch-size", str(BATCH)],
                          capture_output=True, text=True, timeout=600, cwd=ROOT, check=False,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr[-3000:]
    table = pq.read_table(out)
    column = "path" if source == "directory" else "file"
    assert sorted(Path(p).name for p in table.column(column).to_pylist()) == sorted(f"{n}.jpg" for n in PHOTOS)
    expected = {r.name: r.outputs["logits"] for r in pipeline_results(classifier_plan, paths(photo_dir))}
    for path, logits in zip(table.column(column).to_pylist(), table.column("logits").to_pylist()):
        # Ray groups the files into its own batches: equal up to float sums over other batch sizes.
        np.testing.assert_allclose(np.asarray(logits, np.float32), expected[path], rtol=1e-5, atol=1e-6)


# A corrupt image inside a running dataset is left out: on this machine the run took minutes (Ray
# retrying the failed batch); per-row errors are tested through map_batches above.
@pytest.mark.parametrize("problem", ["missing-engine", "batch-too-large"])
def test_the_example_refuses_in_one_line(classifier_plan, tmp_path, problem):
    images = tmp_path / "images"
    images.mkdir()
    (images / "broken.jpg").write_bytes(b"\xff\xd8\xff\xe0 truncated")
    plan = tmp_path / "absent.plan" if problem == "missing-engine" else classifier_plan
    done = subprocess.run([sys.executable, str(ROOT / "deploy" / "ray" / "ray_data_directory.py"), str(plan),
                           str(images), str(tmp_path / "out"), "--num-cpus", "1",
                           "--batch-size", "32" if problem == "batch-too-large" else str(BATCH)],
                          capture_output=True, text=True, timeout=600, cwd=ROOT, check=False,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    last = done.stderr.strip().splitlines()[-1]
    assert done.returncode == 2, done.stderr[-3000:]
    expected = {"missing-engine": "engine file not found",
                "batch-too-large": "batch size 32 is outside 1..4"}[problem]
    assert last.startswith("error: ") and expected in last
