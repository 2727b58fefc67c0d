"""`sartor infer --ray` on a local Ray (CPU): over real photos (scikit-image's) it writes exactly what
the single-process path returns, as its own process with its own cluster and in this one; the
actor count follows the cluster; a bad address, more actors than CPUs and a CUDA engine on a
cluster without GPUs are refused in one line."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import IMAGE, MAX_SHAPES, MIN_SHAPES, OPT_SHAPES, assert_cli_error, save_photos

import sartor
from sartor.errors import ConfigError
from sartor.pipeline import Pipeline

ray = pytest.importorskip("ray")
pq = pytest.importorskip("pyarrow.parquet")
pytest.importorskip("skimage.data")  # the photos save_photos writes
from sartor.integrations.ray_infer import actors_for  # noqa: E402 - after the skip: it is Ray's

ROOT = Path(__file__).resolve().parents[2]
DETECTOR = ROOT / "samples" / "detector" / "sample_detector.onnx"
PHOTOS = ["astronaut", "coffee", "chelsea", "rocket", "camera", "immunohistochemistry", "hubble_deep_field"]
BATCH = 3


@pytest.fixture(scope="module")
def photo_dir(tmp_path_factory) -> Path:
    return save_photos(tmp_path_factory.mktemp("photos"), PHOTOS)


@pytest.fixture(scope="module")
def detector_plan(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("ray_infer_engines") / "detector_nms.plan"
    shapes = {"images": (BATCH, 3, 320, 320)}
    sartor.build(DETECTOR, out, device="cpu", preprocess="letterbox=320,mean=0,std=255,rgb,nchw", builder_effort=0,
                 nms="conf=0.05,iou=0.45,max_det=50,topk=500", min_shapes={"images": (1, 3, 320, 320)},
                 opt_shapes=shapes, max_shapes=shapes)
    return out


@pytest.fixture(scope="module")
def classifier_plan(tmp_path_factory, tiny_onnx) -> Path:
    out = tmp_path_factory.mktemp("ray_infer_engines") / "classifier.plan"
    sartor.build(tiny_onnx, out, device="cpu", min_shapes=MIN_SHAPES, opt_shapes=OPT_SHAPES, max_shapes=MAX_SHAPES,
                 preprocess=f"letterbox={IMAGE},mean=0,std=255,rgb,nchw")
    return out


def photos(folder: Path) -> list[str]:
    return sorted(str(p) for p in folder.iterdir())


def single_process(plan: Path, files: list[str], batch: int) -> list:
    """The single-process path on one thread, as Ray's actors run torch (OMP_NUM_THREADS=1): the
    CPU's convolutions sum in another order on more threads."""
    import torch
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return Pipeline(sartor.load(plan, device="cpu"), batch_size=batch).run(files)
    finally:
        torch.set_num_threads(threads)


def test_the_command_on_its_own_local_cluster_writes_the_single_process_detections(photo_dir, detector_plan,
                                                                                   tmp_path):
    out = tmp_path / "results.parquet"
    # Ray batches of 2 engine batches: 7 photos make Ray batches of 6 and 1 rows, run by 2 actors.
    done = subprocess.run([sys.executable, "-m", "sartor", "infer", str(detector_plan), str(photo_dir), "-o", str(out),
                           "--ray", "--ray-address", "local", "--batch-size", str(BATCH), "--ray-batches", "2"],
                          capture_output=True, text=True, timeout=300, cwd=ROOT, check=False,
                          env={**os.environ,
                               "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])})
    assert done.returncode == 0, done.stderr[-3000:]
    assert "7 images over 2 CPU actor(s)" in done.stderr, done.stderr[-3000:]
    rows = pq.read_table(out).to_pylist()
    files = photos(photo_dir)
    assert [r["path"] for r in rows] == files
    for row, want in zip(rows, single_process(detector_plan, files, BATCH)):
        np.testing.assert_array_equal(np.asarray(row["boxes"], np.float32).reshape(-1, 4), want.detections.boxes)
        np.testing.assert_array_equal(np.asarray(row["scores"], np.float32), want.detections.scores)
        np.testing.assert_array_equal(np.asarray(row["classes"]), want.detections.classes)
    assert sum(len(r["scores"]) for r in rows) > 0  # something was detected, so equality says something


def test_in_a_connected_process_bad_images_become_rows_and_class_scores_equal(local_ray, cli, photo_dir,
                                                                              classifier_plan, tmp_path):
    files = photos(photo_dir)
    bad = tmp_path / "broken.jpg"
    bad.write_bytes(b"\xff\xd8\xff\xe0 truncated")
    out = tmp_path / "scores.jsonl"
    result = cli("infer", classifier_plan, *files[:4], bad, *files[4:], "-o", out, "--ray", "--skip-bad",
                 "--batch-size", "2", "--ray-batches", "1", "--concurrency", "1")
    assert result.code == 0, result
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["path"] for r in rows] == [*files[:4], str(bad), *files[4:]]
    assert [r["error"] is None for r in rows] == [True] * 4 + [False] + [True] * 3
    assert "corrupt" in rows[4]["error"] and rows[4]["logits"] is None
    # the same batches of 2 as the command cut (the bad image's batch included)
    expected = single_process(classifier_plan, [*files[:4], *files[4:]], 2)
    good = [r for r in rows if r["error"] is None]
    for row, want in zip(good[:4], expected[:4]):
        np.testing.assert_array_equal(np.asarray(row["logits"], np.float32), want.outputs["logits"])
    assert "1 image(s) failed" in result.err
    assert ray.is_initialized()  # the command used this process's connection and left it open


def test_actors_follow_the_cluster_and_what_it_lacks_is_refused(local_ray):
    assert actors_for(local_ray, "cpu", None) == (2, 0)  # one per CPU of the 2-CPU cluster
    assert actors_for(local_ray, "cpu", 1) == (1, 0)
    with pytest.raises(ConfigError, match=r"--concurrency 3: the Ray cluster has 2 CPU\(s\)"):
        actors_for(local_ray, "cpu", 3)
    with pytest.raises(ConfigError, match="the engine is a CUDA engine and the Ray cluster has no GPU"):
        actors_for(local_ray, "cuda", None)


@pytest.mark.parametrize("address", ["closed-port", "no-port"])
def test_an_address_without_a_cluster_is_refused_in_one_line_at_once(cli, classifier_plan, photo_dir, tmp_path,
                                                                     address):
    if ray.is_initialized():
        ray.shutdown()  # a connected process would not look at the address
    with socket.socket() as s:  # a port just freed: nothing listens there
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    given = {"closed-port": f"127.0.0.1:{port}", "no-port": "head-node"}[address]
    expected = {"closed-port": f"no Ray cluster at 127.0.0.1:{port}: Connection refused",
                "no-port": "--ray-address head-node: give HOST:PORT"}[address]
    assert_cli_error(cli("infer", classifier_plan, photo_dir, "-o", tmp_path / "r.jsonl", "--ray",
                         "--ray-address", given), expected)
