"""Calibration data from what users have: a plain folder of photos, COCO, a manifest, .npy/.npz, and
from Python (arrays, tensors, lists of arrays, PIL images or paths), with the same checks for all."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import skimage
import torch
from conftest import (
    IMAGE,
    assert_cli_error,
    classifier_model,
    cosine,
    first_output_on_cpu,
    gaussian_images,
    save,
    shape_flag,
)
from PIL import Image

import sartor
from sartor.data import open_dataset
from sartor.errors import ConfigError, DataError
from sartor.runtime.engine import rebuild_command
from sartor.runtime.engine_file import read_engine_file

SHAPES = {"min": {"images": (1, 3, IMAGE, IMAGE)}, "opt": {"images": (2, 3, IMAGE, IMAGE)},
          "max": {"images": (4, 3, IMAGE, IMAGE)}}
SHAPE_ARGS = ("--min-shapes", shape_flag(SHAPES["min"]), "--opt-shapes", shape_flag(SHAPES["opt"]),
              "--max-shapes", shape_flag(SHAPES["max"]))
PREPROCESS = f"resize={IMAGE}x{IMAGE},std=255"
# Real photos shipped with scikit-image (no download): colour, grey and a JPEG among them.
PHOTOS = ("astronaut.png", "chelsea.png", "coffee.png", "rocket.jpg", "camera.png", "motorcycle_left.png")


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return save(classifier_model(), tmp_path_factory.mktemp("sources") / "m.onnx")


@pytest.fixture(scope="module")
def photos(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("photos") / "photos"
    folder.mkdir()
    for name in PHOTOS:
        shutil.copy(Path(skimage.data_dir) / name, folder / name)
    return folder


def _build(model: Path, out: Path, **kwargs):
    return sartor.build(model, out, device="cpu", profiles=[SHAPES], precision="int8", **kwargs)


def _calibration(result) -> dict:
    return result.header["provenance"]["calibration"]


def test_a_plain_folder_of_photos_calibrates(model, photos, tmp_path, cli):
    dataset = open_dataset(photos)
    assert (dataset.format, len(dataset), dataset.class_names) == ("images", len(PHOTOS), [])
    assert [Path(s.path).name for s in dataset] == sorted(PHOTOS) and all(s.label is None for s in dataset)
    result = cli("build", model, "-o", tmp_path / "a.plan", "--device", "cpu", "--precision", "int8", *SHAPE_ARGS,
                 "--calib", photos, "--preprocess", PREPROCESS)
    assert result.code == 0, result
    calibration = read_engine_file(tmp_path / "a.plan")[0]["provenance"]["calibration"]
    assert calibration["calib_size"] == len(PHOTOS) and calibration["source"] == str(photos)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a CUDA engine")
def test_a_plain_folder_calibrates_a_cuda_engine_as_it_does_the_cpu_one(model, photos, tmp_path):
    """`--calib DIR` on the GPU: the same samples (one digest) calibrated there, and the CUDA
    engine's INT8 kernels agree with the CPU engine's emulation (the float layers at FP32 on both)."""
    options = dict(profiles=[SHAPES], precision="int8", calib=photos, preprocess=PREPROCESS,
                   int8_fallback_precision="fp32")
    cpu = sartor.build(model, tmp_path / "cpu.plan", device="cpu", **options)
    cuda = sartor.build(model, tmp_path / "cuda.plan", device="cuda", builder_effort=1, **options)
    assert _calibration(cuda)["calib_sha256"] == _calibration(cpu)["calib_sha256"]
    assert any(layer["precision"] == "int8" for layer in cuda.header["layers"])
    images = gaussian_images(7, 4)  # seed 7, a batch of 4
    expected = first_output_on_cpu(tmp_path / "cpu.plan", images)
    got = next(iter(sartor.load(tmp_path / "cuda.plan", device="cuda").context().run({"images": images}).values()))
    got = got.cpu().numpy() if isinstance(got, torch.Tensor) else np.asarray(got)
    # Thresholds calibrated from the GPU's float32 activations may differ from the CPU's in their
    # last bits, moving a few codes by one: close, not equal.
    assert cosine(expected, got) >= 0.999


def test_photos_from_python_match_the_folder(model, photos, tmp_path):
    """Paths, PIL images and the folder give the very same samples (one digest)."""
    folder = _calibration(_build(model, tmp_path / "a.plan", calib=photos, preprocess=PREPROCESS))
    paths = sorted(photos.iterdir())
    by_path = _calibration(_build(model, tmp_path / "b.plan", calib=paths, preprocess=PREPROCESS))
    images = [Image.open(p) for p in paths]
    by_image = _calibration(_build(model, tmp_path / "c.plan", calib=images, preprocess=PREPROCESS))
    assert folder["calib_sha256"] == by_path["calib_sha256"] == by_image["calib_sha256"]
    assert by_image["source"].startswith("<python: 6 image(s)") and by_path["source"].startswith("<python: 6 path(s)")
    # Only the first calib_size samples are used, in order.
    first = _calibration(_build(model, tmp_path / "d.plan", calib=iter(paths), preprocess=PREPROCESS, calib_size=2))
    two = _calibration(_build(model, tmp_path / "e.plan", calib=paths[:2], preprocess=PREPROCESS))
    assert first["calib_size"] == 2 and first["calib_sha256"] == two["calib_sha256"]


def test_arrays_and_tensors_from_python_match_the_npy(model, tmp_path):
    samples = gaussian_images(3, 12)
    np.save(tmp_path / "calib.npy", samples)
    reference = _calibration(_build(model, tmp_path / "a.plan", calib=tmp_path / "calib.npy"))
    sources = {"array": samples, "tensor": torch.from_numpy(samples), "dict": {"images": samples},
               "list of samples": list(samples), "list of batches": [samples[:5], torch.from_numpy(samples[5:])]}
    for what, data in sources.items():
        result = _build(model, tmp_path / f"{what}.plan", calib=data, calib_cache=tmp_path / f"{what}.json")
        calibration = _calibration(result)
        assert calibration["calib_sha256"] == reference["calib_sha256"], what
        assert calibration["calib_size"] == 12 and calibration["source"].startswith("<python:"), what
    # The engine records the data's label, never the data; the rebuild command cannot name it.
    header, _ = read_engine_file(tmp_path / "array.plan")
    assert header["build_config"]["calib"] == "<python: ndarray 12x3x16x16 float32>"
    assert "calib_data" not in header["build_config"]
    assert "--calib " not in rebuild_command(header) and "--precision int8" in rebuild_command(header)
    # A rebuild from the cache alone needs no data.
    again = _build(model, tmp_path / "again.plan", calib_cache=tmp_path / "array.json")
    assert _calibration(again)["from_cache"]


def test_held_out_samples_from_python_follow_the_calibration_draw(model, tmp_path):
    samples = gaussian_images(4, 24)
    result = _build(model, tmp_path / "a.plan", calib=samples, calib_size=16, min_cosine=0.5)
    held = result.header["planner"]["held_out"]
    assert held["samples"] == 8 and "samples 16..23" in held["source"]
    with pytest.raises(ConfigError, match="holds 24 and calibration uses 24"):
        _build(model, tmp_path / "b.plan", calib=samples, calib_size=24, min_cosine=0.5)


def test_coco_and_manifest_calibrate(model, photos, tmp_path):
    images = [{"id": k, "file_name": p.name, "lighting": "day" if k % 2 else "night"}
              for k, p in enumerate(sorted(photos.iterdir()))]
    coco = tmp_path / "annotations.json"
    coco.write_text(json.dumps({"images": images, "annotations": [], "categories": [{"id": 1, "name": "thing"}]}))
    shutil.copytree(photos, tmp_path / "images")
    result = _build(model, tmp_path / "a.plan", calib=coco, preprocess=PREPROCESS, calib_balance_by="lighting")
    assert _calibration(result)["splits"]["lighting"] == {"day": 3, "night": 3}
    manifest = tmp_path / "calib.jsonl"
    manifest.write_text("".join(json.dumps({"path": str(p)}) + "\n" for p in sorted(photos.iterdir())))
    folder = _calibration(_build(model, tmp_path / "b.plan", calib=photos, preprocess=PREPROCESS))
    listed = _calibration(_build(model, tmp_path / "c.plan", calib=manifest, preprocess=PREPROCESS))
    assert listed["calib_sha256"] == folder["calib_sha256"]


def test_plain_folder_refusals(model, photos, tmp_path, cli):
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "notes.txt").write_text("no images here")
    with pytest.raises(DataError, match="holds no image with an extension of"):
        open_dataset(empty)
    mixed = tmp_path / "mixed"
    shutil.copytree(photos, mixed)
    (mixed / "night").mkdir()
    shutil.copy(photos / "chelsea.png", mixed / "night" / "cat.png")
    with pytest.raises(DataError, match="mixes 6 image\\(s\\) at its top level .* with class sub-folders \\(night\\)"):
        open_dataset(mixed)
    broken = tmp_path / "broken"
    shutil.copytree(photos, broken)
    (broken / "zz_truncated.jpg").write_bytes((photos / "rocket.jpg").read_bytes()[:300])
    line = assert_cli_error(cli("build", model, "-o", tmp_path / "a.plan", "--device", "cpu", "--precision", "int8",
                                *SHAPE_ARGS, "--calib", broken, "--preprocess", PREPROCESS), "zz_truncated.jpg")
    assert "corrupt or truncated" in line or "not an image" in line
    assert not (tmp_path / "a.plan").exists()


@pytest.mark.parametrize("data, message", [
    (gaussian_images(0, 4).astype(np.float64), "is float64, the input takes float32"),
    (np.zeros((4, 1, IMAGE, IMAGE), np.float32), "has size 3 on axis 1, the samples 1"),
    (np.zeros((4, IMAGE, IMAGE), np.float32), "not \\[samples, ...\\] of rank 4"),
    ([], "holds no samples"),
    ([np.zeros((3, IMAGE, IMAGE), np.float32), 7], "item 1 is a int, not an array"),
    ({"pixels": np.zeros((4, 3, IMAGE, IMAGE), np.float32)}, "the model's inputs images are missing"),
    (np.zeros((0, 3, IMAGE, IMAGE), np.float32), "holds no samples"),
    (3.5, "a float is not calibration data"),
])
def test_python_data_refusals(model, tmp_path, data, message):
    with pytest.raises(ConfigError, match=message):
        _build(model, tmp_path / "a.plan", calib=data)
    assert not (tmp_path / "a.plan").exists()


def test_python_image_refusals(model, photos, tmp_path):
    with pytest.raises(ConfigError, match="item 0 is an image: give preprocess="):
        _build(model, tmp_path / "a.plan", calib=[photos / "chelsea.png"])
    with pytest.raises(ConfigError, match="wrap one image in a list"):
        _build(model, tmp_path / "a.plan", calib=Image.open(photos / "chelsea.png"), preprocess=PREPROCESS)
    truncated = tmp_path / "cut.png"
    truncated.write_bytes((photos / "coffee.png").read_bytes()[:200])
    with pytest.raises(DataError, match="cut.png"):
        _build(model, tmp_path / "a.plan", calib=[photos / "chelsea.png", truncated], preprocess=PREPROCESS)
    with pytest.raises(DataError, match="missing.png does not exist"):
        _build(model, tmp_path / "a.plan", calib=[tmp_path / "missing.png"], preprocess=PREPROCESS)
    sizes = [Image.new("RGB", (20, 10)), Image.new("RGB", (10, 20))]
    with pytest.raises(ConfigError, match="samples of different shapes"):
        _build(model, tmp_path / "a.plan", calib=sizes, preprocess="std=255")
