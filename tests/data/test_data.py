"""The data layer: preprocessing specs and numbers, COCO / ImageFolder / manifest datasets, their
errors, batches, balanced sampling, and --preprocess stored in an engine."""
from __future__ import annotations

import csv
import io
import json
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from conftest import IMAGE, MAX_SHAPES, MIN_SHAPES, OPT_SHAPES, assert_cli_error, shape_flag
from PIL import Image

import sartor
from sartor.data import (Dataset, ImageMeta, PreprocessSpec, Sample, balanced_sample, iterate_batches, load_coco,
                         load_image, load_image_folder, load_manifest, open_dataset, parse_preprocess,
                         preprocess_batch, preprocess_image)
from sartor.errors import ConfigError, DataError
from sartor.runtime.engine import rebuild_command

SHAPE_ARGS = ["--min-shapes", shape_flag(MIN_SHAPES), "--opt-shapes", shape_flag(OPT_SHAPES),
              "--max-shapes", shape_flag(MAX_SHAPES)]


def write_image(path: Path, width: int, height: int, color=(200, 30, 60), fmt: str | None = None) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", (width, height), color).save(path, format=fmt)
    return path


def one_line(exc: pytest.ExceptionInfo) -> str:
    message = str(exc.value)
    assert "\n" not in message
    return message


# ---- the spec --------------------------------------------------------------------------------------

def test_parse_defaults_and_every_token():
    spec = parse_preprocess("rgb")
    assert (spec.resize, spec.size, spec.mean, spec.std, spec.channels, spec.layout, spec.dtype, spec.pad_value) == \
        ("none", (0, 0), (0, 0, 0), (1, 1, 1), "rgb", "nchw", "float32", 114)
    spec = parse_preprocess("letterbox=320,mean=0,std=255,rgb,nchw")
    assert spec == PreprocessSpec("letterbox", (320, 320), (0, 0, 0), (255, 255, 255), "rgb", "nchw", "float32")
    assert parse_preprocess("letterbox=320x416").size == (320, 416)
    spec = parse_preprocess("resize=224x224, mean=123.675:116.28:103.53, std=58.395:57.12:57.375, BGR, nhwc, "
                            "dtype=float16")
    assert spec.resize == "resize" and spec.size == (224, 224)
    assert spec.mean == (123.675, 116.28, 103.53) and spec.std == (58.395, 57.12, 57.375)
    assert (spec.channels, spec.layout, spec.dtype) == ("bgr", "nhwc", "float16")
    assert parse_preprocess("letterbox=64,pad=0,dtype=uint8").pad_value == 0
    assert parse_preprocess("letterbox=64").input_shape(2) == (2, 3, 64, 64)
    assert parse_preprocess("resize=32x48,nhwc").input_shape() == (1, 32, 48, 3)


@pytest.mark.parametrize("text", [
    "letterbox=320,mean=0,std=255,rgb,nchw", "letterbox=320x416,pad=0", "resize=224x224,bgr,nhwc,dtype=uint8",
    "resize=224x224,mean=123.675:116.28:103.53,std=58.395:57.12:57.375", "none,mean=0.5,std=0.25,dtype=float16",
])
def test_spec_round_trips_through_text_and_json(text):
    spec = parse_preprocess(text)
    assert parse_preprocess(spec.describe()) == spec
    assert PreprocessSpec.from_json(json.loads(json.dumps(spec.to_json()))) == spec
    assert spec.to_json()["text"] == spec.describe() == str(spec)


@pytest.mark.parametrize("text, fragment", [
    ("letterbox=320,sharpen", "'sharpen'"),
    ("letterbox=abc", "'letterbox=abc'"),
    ("letterbox=0", "'letterbox=0'"),
    ("resize=2x3x4", "'resize=2x3x4'"),
    ("mean=1:2", "'mean=1:2'"),
    ("std=0", "'std=0'"),
    ("std=x", "'std=x'"),
    ("dtype=int32", "'dtype=int32'"),
    ("rgb,bgr", "'bgr'"),
    ("letterbox=64,resize=64x64", "'resize=64x64'"),
    ("pad=300", "'pad=300'"),
    ("mean=", "'mean='"),
    ("rgb,,nchw", "empty token"),
    ("", "empty"),
])
def test_parse_errors_name_the_bad_token(text, fragment):
    with pytest.raises(ConfigError) as exc:
        parse_preprocess(text)
    assert fragment in one_line(exc)


# ---- preprocessing numbers ---------------------------------------------------------------------------

def test_letterbox_geometry_matches_ultralytics_and_maps_back():
    image = Image.new("RGB", (200, 100), (255, 0, 0))  # W 200, H 100
    array, meta = preprocess_image(image, parse_preprocess("letterbox=64"), path="wide.jpg")
    assert array.shape == (3, 64, 64) and array.dtype == np.float32
    # r = 0.32 → 64x32 content, centered: 16 rows of padding above and below
    assert meta.orig_size == (100, 200) and meta.pad == (16, 0) and meta.input_size == (64, 64)
    assert meta.scale == pytest.approx((0.32, 0.32))
    assert np.all(array[:, :16] == 114) and np.all(array[:, 48:] == 114)
    assert np.all(array[:, 16:48] == np.array([255, 0, 0], np.float32)[:, None, None])
    whole = np.array([[0, 0, 200, 100]], np.float32)
    assert np.allclose(meta.to_input(whole), [[0, 16, 64, 48]])
    boxes = np.array([[10, 20, 50, 80], [150.5, 3, 199, 97.25]], np.float32)
    assert np.allclose(meta.to_original(meta.to_input(boxes)), boxes, atol=1e-4)
    # a box reaching into the padding is clipped to the image
    assert np.allclose(meta.to_original(np.array([[-5, 0, 70, 64]], np.float32)), [[0, 0, 200, 100]])
    assert meta.to_original(np.zeros((0, 4), np.float32)).shape == (0, 4)


def test_letterbox_odd_padding_rounds_as_ultralytics():
    # H 51, W 100 → r 0.64 → 64x33; dh 15.5 → top round(15.4) = 15, bottom 16
    array, meta = preprocess_image(Image.new("RGB", (100, 51), (0, 255, 0)), parse_preprocess("letterbox=64,pad=7"))
    assert meta.pad == (15, 0) and meta.scale == pytest.approx((33 / 51, 0.64))
    assert np.all(array[:, :15] == 7) and np.all(array[:, 48:] == 7) and np.all(array[1, 15:48] == 255)
    # a tall image pads left and right
    _, meta = preprocess_image(Image.new("RGB", (50, 100)), parse_preprocess("letterbox=64x128"))
    assert meta.pad == (0, 48) and meta.scale == pytest.approx((0.64, 0.64))


def test_resize_stretches_and_maps_back():
    _, meta = preprocess_image(Image.new("RGB", (40, 10)), parse_preprocess("resize=20x20"))
    assert meta.scale == (2.0, 0.5) and meta.pad == (0, 0)
    assert np.allclose(meta.to_original(np.array([[0, 0, 20, 20]])), [[0, 0, 40, 10]])


def test_mean_std_channels_layout_dtype():
    pixels = np.array([[[10, 20, 30], [40, 50, 60]], [[70, 80, 90], [100, 110, 120]]], np.uint8)  # 2x2 RGB
    spec = parse_preprocess("mean=10:20:30,std=2:4:5")
    array, meta = preprocess_image(pixels, spec)
    expected = (pixels.astype(np.float32) - [10, 20, 30]) / [2, 4, 5]
    assert array.shape == (3, 2, 2) and np.allclose(array, expected.transpose(2, 0, 1))
    assert meta.scale == (1.0, 1.0) and meta.orig_size == (2, 2)
    # bgr swaps the channels before mean/std (mean/std are in the output order)
    array, _ = preprocess_image(pixels, parse_preprocess("bgr,nhwc,mean=30:20:10"))
    assert array.shape == (2, 2, 3) and np.allclose(array, pixels[..., ::-1].astype(np.float32) - [30, 20, 10])
    array, _ = preprocess_image(pixels, parse_preprocess("dtype=uint8,nhwc"))
    assert array.dtype == np.uint8 and np.array_equal(array, pixels)
    array, _ = preprocess_image(pixels, parse_preprocess("std=255,dtype=float16"))
    assert array.dtype == np.float16 and np.allclose(array, pixels.transpose(2, 0, 1) / 255, atol=1e-3)
    batch, metas = preprocess_batch([pixels, Image.fromarray(pixels)], parse_preprocess("std=255"))
    assert batch.shape == (2, 3, 2, 2) and len(metas) == 2 and np.array_equal(batch[0], batch[1])


def test_batch_of_different_sizes_needs_a_resize(tmp_path):
    a, b = write_image(tmp_path / "a.png", 8, 8), write_image(tmp_path / "b.png", 8, 6)
    with pytest.raises(DataError) as exc:
        preprocess_batch([a, b], parse_preprocess("rgb"))
    assert "different sizes" in one_line(exc) and "letterbox" in str(exc.value)
    batch, metas = preprocess_batch([a, b], parse_preprocess("letterbox=8"))
    assert batch.shape == (2, 3, 8, 8) and metas[1].path == str(b) and metas[1].pad == (1, 0)


def test_load_image_errors(tmp_path):
    with pytest.raises(DataError) as exc:
        load_image(tmp_path / "nope.jpg")
    assert "nope.jpg" in one_line(exc) and "does not exist" in str(exc.value)
    garbage = tmp_path / "garbage.jpg"
    garbage.write_bytes(b"\x00not a jpeg at all" * 10)
    with pytest.raises(DataError) as exc:
        load_image(garbage)
    assert "garbage.jpg" in one_line(exc)
    buffer = io.BytesIO()
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (64, 64, 3), dtype=np.uint8)).save(buffer, "JPEG")
    truncated = tmp_path / "truncated.jpg"
    truncated.write_bytes(buffer.getvalue()[: len(buffer.getvalue()) // 2])
    with pytest.raises(DataError) as exc:
        load_image(truncated)
    assert "truncated.jpg" in one_line(exc)
    gray = write_image(tmp_path / "gray.png", 5, 4)
    Image.open(gray).convert("L").save(gray)
    assert load_image(gray).mode == "RGB" and load_image(gray).size == (5, 4)


# ---- COCO --------------------------------------------------------------------------------------------

def coco_dataset(root: Path, **overrides) -> Path:
    """Three images; categories 3 'dog' and 1 'person' (listed out of order); a crowd box; lighting
    on two images."""
    write_image(root / "images" / "a.jpg", 100, 80)
    write_image(root / "images" / "b.jpg", 60, 40)
    write_image(root / "images" / "c.png", 50, 50)
    data = {
        "images": [{"id": 7, "file_name": "images/a.jpg", "width": 100, "height": 80, "lighting": "day"},
                   {"id": 8, "file_name": "images/b.jpg", "width": 60, "height": 40, "lighting": "night",
                    "license": 1},
                   {"id": 9, "file_name": "images/c.png", "width": 50, "height": 50}],
        "categories": [{"id": 3, "name": "dog"}, {"id": 1, "name": "person"}],
        "annotations": [
            {"id": 1, "image_id": 7, "category_id": 1, "bbox": [10, 20, 30, 40], "iscrowd": 0},
            {"id": 2, "image_id": 7, "category_id": 3, "bbox": [0, 0, 100, 80]},
            {"id": 3, "image_id": 8, "category_id": 3, "bbox": [5.5, 6, 10, 4.5]},
            {"id": 4, "image_id": 8, "category_id": 1, "bbox": [0, 0, 60, 40], "iscrowd": 1},
        ],
    }
    data.update(overrides)
    path = root / "annotations.json"
    path.write_text(json.dumps(data))
    return path


def test_coco_boxes_classes_attributes_and_splits(tmp_path):
    path = coco_dataset(tmp_path)
    dataset = load_coco(path)
    assert dataset.task == "detect" and dataset.format == "coco" and len(dataset) == 3
    assert dataset.class_names == ["person", "dog"] and dataset.category_ids == [1, 3]
    a, b, c = dataset.samples
    assert a.path == str(tmp_path / "images" / "a.jpg") and a.image_id == 7 and a.size == (80, 100)
    assert a.boxes.dtype == np.float32 and np.allclose(a.boxes, [[10, 20, 40, 60], [0, 0, 100, 80]])
    assert a.classes.dtype == np.int64 and a.classes.tolist() == [0, 1]
    assert np.allclose(b.boxes, [[5.5, 6, 15.5, 10.5]]) and b.classes.tolist() == [1]
    assert np.allclose(b.crowd_boxes, [[0, 0, 60, 40]]) and b.crowd_classes.tolist() == [0]
    assert c.boxes.shape == (0, 4) and c.classes.shape == (0,) and c.attributes == {}
    assert a.attributes == {"lighting": "day"} and b.attributes == {"lighting": "night"}
    splits = dataset.splits("lighting")
    assert list(splits) == ["day", "night", "(none)"]
    assert [s.image_id for s in splits["night"]] == [8] and [s.image_id for s in splits["(none)"]] == [9]
    assert dataset.attributes() == ["lighting"] and "3 images" in dataset.describe()
    # the same through open_dataset: the folder, or the file
    assert [s.path for s in open_dataset(tmp_path).samples] == [s.path for s in dataset.samples]
    assert open_dataset(path, task="detect").class_names == ["person", "dog"]
    with pytest.raises(DataError) as exc:
        open_dataset(tmp_path, task="classify")
    assert "detection dataset" in one_line(exc)


def test_coco_standard_layout_finds_images_beside_the_annotations_folder(tmp_path):
    write_image(tmp_path / "val2017" / "000000000139.jpg", 32, 24)
    (tmp_path / "annotations").mkdir()
    path = tmp_path / "annotations" / "instances_val2017.json"
    path.write_text(json.dumps({"images": [{"id": 139, "file_name": "000000000139.jpg", "width": 32, "height": 24}],
                                "categories": [{"id": 1, "name": "person"}], "annotations": []}))
    assert load_coco(path).samples[0].path == str(tmp_path / "val2017" / "000000000139.jpg")
    assert len(load_coco(path, image_root=tmp_path / "val2017")) == 1


def test_open_dataset_folder_with_annotations_subfolder(tmp_path):
    write_image(tmp_path / "val2017" / "1.jpg", 20, 10)
    (tmp_path / "annotations").mkdir()
    record = {"images": [{"id": 1, "file_name": "1.jpg", "width": 20, "height": 10}],
              "categories": [{"id": 1, "name": "person"}],
              "annotations": [{"id": 1, "image_id": 1, "category_id": 1, "bbox": [1, 1, 5, 5]}]}
    (tmp_path / "annotations" / "instances_val2017.json").write_text(json.dumps(record))
    dataset = open_dataset(tmp_path)
    assert dataset.format == "coco" and dataset.samples[0].path == str(tmp_path / "val2017" / "1.jpg")
    (tmp_path / "annotations" / "instances_train2017.json").write_text(json.dumps(record))
    with pytest.raises(DataError) as exc:
        open_dataset(tmp_path)
    assert "several COCO files" in one_line(exc) and "instances_train2017.json" in str(exc.value)


def test_image_size_must_match_the_annotations(tmp_path):
    path = coco_dataset(tmp_path)
    write_image(tmp_path / "images" / "b.jpg", 40, 60)  # annotations say 60x40 (WxH)
    dataset = load_coco(path)
    with pytest.raises(DataError) as exc:
        list(iterate_batches(dataset, parse_preprocess("letterbox=32"), batch_size=3))
    assert "b.jpg" in one_line(exc) and "40x60" in str(exc.value)


@pytest.mark.parametrize("change, fragments", [
    ({"annotations": [{"id": 5, "image_id": 7, "category_id": 1, "bbox": [90, 10, 20, 10]}]},
     ["outside", "a.jpg", "annotation 5", "[90, 10, 20, 10]"]),
    ({"annotations": [{"id": 5, "image_id": 7, "category_id": 1, "bbox": [10, 10, 0, 10]}]},
     ["non-positive", "a.jpg"]),
    ({"annotations": [{"id": 5, "image_id": 42, "category_id": 1, "bbox": [1, 1, 2, 2]}]},
     ["unknown image id", "42"]),
    ({"annotations": [{"id": 5, "image_id": 7, "category_id": 99, "bbox": [1, 1, 2, 2]}]},
     ["unknown category", "99"]),
    ({"images": []}, ["empty"]),
])
def test_coco_errors(tmp_path, change, fragments):
    path = coco_dataset(tmp_path, **change)
    with pytest.raises(DataError) as exc:
        load_coco(path)
    message = one_line(exc)
    for fragment in fragments:
        assert fragment in message, (fragment, message)


def test_coco_box_within_tolerance_is_accepted(tmp_path):
    path = coco_dataset(tmp_path, annotations=[{"id": 5, "image_id": 7, "category_id": 1,
                                                "bbox": [-0.5, 0, 101, 80.9]}])
    assert np.allclose(load_coco(path).samples[0].boxes, [[-0.5, 0, 100.5, 80.9]])


def test_coco_file_errors(tmp_path):
    empty = tmp_path / "empty.json"
    empty.write_text("")
    with pytest.raises(DataError) as exc:
        load_coco(empty)
    assert "empty" in one_line(exc) and "empty.json" in str(exc.value)
    broken = tmp_path / "broken.json"
    broken.write_text('{"images": [')
    with pytest.raises(DataError) as exc:
        open_dataset(broken)
    assert "not valid JSON" in one_line(exc)
    other = tmp_path / "other.json"
    other.write_text('{"hello": 1}')
    with pytest.raises(DataError) as exc:
        load_coco(other)
    assert "not a COCO" in one_line(exc)
    with pytest.raises(DataError) as exc:
        open_dataset(tmp_path / "missing")
    assert "does not exist" in one_line(exc)


def test_missing_images_are_listed_with_their_count(tmp_path):
    images = [{"id": i, "file_name": f"img{i}.jpg", "width": 10, "height": 10} for i in range(8)]
    path = tmp_path / "annotations.json"
    path.write_text(json.dumps({"images": images, "categories": [], "annotations": []}))
    write_image(tmp_path / "img0.jpg", 10, 10)
    with pytest.raises(DataError) as exc:
        load_coco(path)
    message = one_line(exc)
    assert "7 of 8" in message and "img1.jpg" in message and "img5.jpg" in message
    assert "img6.jpg" not in message and "..." in message


# ---- ImageFolder ---------------------------------------------------------------------------------------

def test_image_folder(tmp_path):
    write_image(tmp_path / "dog" / "1.jpg", 10, 10)
    write_image(tmp_path / "dog" / "sub" / "2.PNG", 10, 10, fmt="PNG")
    write_image(tmp_path / "cat" / "3.bmp", 10, 10)
    (tmp_path / "cat" / "notes.txt").write_text("not an image")
    dataset = open_dataset(tmp_path)
    assert dataset.task == "classify" and dataset.format == "imagefolder" and dataset.class_names == ["cat", "dog"]
    assert [(Path(s.path).name, s.label) for s in dataset.samples] == [("3.bmp", 0), ("1.jpg", 1), ("2.PNG", 1)]
    assert all(s.boxes.shape == (0, 4) for s in dataset.samples)
    reordered = load_image_folder(tmp_path, class_names=["dog", "cat", "bird"])
    assert [s.label for s in reordered.samples] == [1, 0, 0] and reordered.class_names == ["dog", "cat", "bird"]
    with pytest.raises(DataError) as exc:
        load_image_folder(tmp_path, class_names=["dog"])
    assert "cat" in one_line(exc)
    empty = tmp_path / "empty"
    (empty / "a").mkdir(parents=True)
    with pytest.raises(DataError) as exc:
        open_dataset(empty)
    assert "empty" in one_line(exc)


# ---- manifests ---------------------------------------------------------------------------------------

def test_jsonl_manifest_with_names_and_attributes(tmp_path):
    write_image(tmp_path / "imgs" / "a.jpg", 10, 10)
    write_image(tmp_path / "imgs" / "b.jpg", 10, 10)
    absolute = write_image(tmp_path / "elsewhere" / "c.jpg", 10, 10)
    rows = [{"path": "imgs/a.jpg", "label": "zebra", "lighting": "night"},
            {"path": "imgs/b.jpg", "label": "ant", "lighting": "day", "camera": 2},
            {"path": str(absolute), "label": "zebra"}]
    path = tmp_path / "manifest.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    dataset = open_dataset(path)
    assert dataset.format == "manifest" and dataset.class_names == ["ant", "zebra"]
    assert [s.label for s in dataset.samples] == [1, 0, 1]
    assert dataset.samples[0].path == str(tmp_path / "imgs" / "a.jpg") and dataset.samples[2].path == str(absolute)
    assert dataset.samples[1].attributes == {"lighting": "day", "camera": 2}
    assert {k: len(v) for k, v in dataset.splits("lighting").items()} == {"day": 1, "night": 1, "(none)": 1}
    given = open_dataset(path, class_names=["zebra", "ant", "yak"])
    assert [s.label for s in given.samples] == [0, 1, 0]
    with pytest.raises(DataError) as exc:
        open_dataset(path, class_names=["zebra", "horse"])
    assert "ant" in one_line(exc) and "not among" in str(exc.value)
    with pytest.raises(DataError) as exc:
        open_dataset(path, task="detect")
    assert "classification dataset" in one_line(exc)


def test_csv_manifest_with_integer_labels(tmp_path):
    for name in ("x.png", "y.png"):
        write_image(tmp_path / name, 6, 6)
    path = tmp_path / "list.csv"
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["path", "label", "weather"])
        writer.writerow(["x.png", "3", "rain"])
        writer.writerow(["y.png", "0", ""])
    dataset = load_manifest(path)
    assert [s.label for s in dataset.samples] == [3, 0] and dataset.class_names == ["0", "1", "2", "3"]
    assert dataset.samples[0].attributes == {"weather": "rain"}
    assert list(dataset.splits("weather")) == ["rain", "(none)"]
    assert [s.label for s in load_manifest(path, class_names=[f"c{i}" for i in range(5)]).samples] == [3, 0]


def test_manifest_errors(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text("".join(json.dumps({"path": f"missing{i}.jpg", "label": "a"}) + "\n" for i in range(6)))
    with pytest.raises(DataError) as exc:
        load_manifest(path)
    assert "6 of 6" in one_line(exc) and "missing0.jpg" in str(exc.value) and "missing5.jpg" not in str(exc.value)
    path.write_text('{"path": "a.jpg"}\nnot json\n')
    with pytest.raises(DataError) as exc:
        load_manifest(path)
    assert "line 2" in one_line(exc)
    path.write_text("")
    with pytest.raises(DataError) as exc:
        load_manifest(path)
    assert "empty" in one_line(exc)
    bad_csv = tmp_path / "m.csv"
    bad_csv.write_text("file,label\na.jpg,1\n")
    with pytest.raises(DataError) as exc:
        load_manifest(bad_csv)
    assert '"path"' in one_line(exc)
    (tmp_path / "m.txt").write_text("x")
    with pytest.raises(DataError) as exc:
        open_dataset(tmp_path / "m.txt")
    assert "expected a folder" in one_line(exc)


# ---- batches and sampling ------------------------------------------------------------------------------

def test_iterate_batches(tmp_path):
    samples = [Sample(path=str(write_image(tmp_path / f"{i}.png", 10 + i, 8, color=(i * 40, 0, 0))), label=i)
               for i in range(5)]
    dataset = Dataset(samples, [str(i) for i in range(5)], "classify", str(tmp_path))
    spec = parse_preprocess("letterbox=16,std=255")
    batches = list(iterate_batches(dataset, spec, batch_size=2, progress=True))
    assert [b[0].shape for b in batches] == [(2, 3, 16, 16), (2, 3, 16, 16), (1, 3, 16, 16)]
    assert [s.label for _, _, chunk in batches for s in chunk] == [0, 1, 2, 3, 4]
    assert [m.path for _, metas, _ in batches for m in metas] == [s.path for s in samples]
    assert [m.orig_size for m in batches[1][1]] == [(8, 12), (8, 13)]
    assert batches[2][0][0, 0, 8, 8] == pytest.approx(160 / 255)
    single = list(iterate_batches(samples[:3], spec, batch_size=3, workers=1))
    assert len(single) == 1 and np.array_equal(single[0][0], np.concatenate([batches[0][0], batches[1][0][:1]]))
    bad = tmp_path / "bad.jpg"
    bad.write_bytes(b"garbage" * 20)
    with pytest.raises(DataError) as exc:
        list(iterate_batches(samples[:2] + [Sample(path=str(bad))], spec, batch_size=2))
    assert "bad.jpg" in one_line(exc)
    with pytest.raises(DataError) as exc:
        list(iterate_batches(samples, parse_preprocess("rgb"), batch_size=2))
    assert "different sizes" in one_line(exc)


def test_balanced_sample():
    samples = ([Sample(path=f"day{i}", attributes={"lighting": "day"}) for i in range(10)]
               + [Sample(path=f"night{i}", attributes={"lighting": "night"}) for i in range(3)]
               + [Sample(path=f"none{i}") for i in range(5)])
    dataset = Dataset(samples, [], "detect", "mem")
    picked = balanced_sample(dataset, "lighting", 12, seed=0)
    counts = Counter(s.attributes.get("lighting", "(none)") for s in picked)
    assert sum(counts.values()) == 12 and len({s.path for s in picked}) == 12
    assert counts["night"] == 3 and abs(counts["day"] - counts["(none)"]) <= 1
    prefix = Counter(s.attributes.get("lighting", "(none)") for s in picked[:6])
    assert prefix == {"day": 2, "night": 2, "(none)": 2}
    assert [s.path for s in balanced_sample(dataset, "lighting", 12, seed=0)] == [s.path for s in picked]
    assert [s.path for s in balanced_sample(dataset, "lighting", 12, seed=1)] != [s.path for s in picked]
    assert len(balanced_sample(samples, "lighting", 100, seed=0)) == 18
    small = Counter(s.attributes.get("lighting", "(none)") for s in balanced_sample(dataset, "lighting", 4, seed=3))
    assert sorted(small.values()) == [1, 1, 2]
    with pytest.raises(DataError):
        balanced_sample(dataset, "lighting", 0, seed=0)


# ---- --preprocess in the build -------------------------------------------------------------------------

def test_build_stores_preprocess_and_inspect_shows_it(cli, tiny_onnx, tmp_path):
    out = tmp_path / "pre.plan"
    result = cli("build", tiny_onnx, "-o", out, "--device", "cpu", *SHAPE_ARGS,
                 "--preprocess", f"resize={IMAGE}x{IMAGE},mean=0,std=255,rgb,nchw")
    assert result.code == 0, result
    assert "resize=16x16,mean=0,std=255,rgb,nchw" in result.out
    engine = sartor.load(out, device="cpu")
    assert engine.preprocess == parse_preprocess("resize=16x16,std=255")
    assert "--preprocess resize=16x16,mean=0,std=255,rgb,nchw" in rebuild_command(engine.header)
    shown = cli("inspect", out)
    assert shown.code == 0 and "resize=16x16,mean=0,std=255,rgb,nchw" in shown.out
    info = json.loads(cli("inspect", out, "--json").out)
    assert PreprocessSpec.from_json(info["preprocess"]) == engine.preprocess
    # an engine built without it says so
    plain = tmp_path / "plain.plan"
    sartor.build(tiny_onnx, plain, device="cpu", min_shapes=MIN_SHAPES, max_shapes=MAX_SHAPES)
    assert sartor.load(plain, device="cpu").preprocess is None
    assert json.loads(cli("inspect", plain, "--json").out)["preprocess"] is None
    # the Python API takes a string or a spec
    api = tmp_path / "api.plan"
    sartor.build(tiny_onnx, api, device="cpu", min_shapes=MIN_SHAPES, max_shapes=MAX_SHAPES,
                 preprocess=parse_preprocess("letterbox=16,bgr"))
    assert sartor.load(api, device="cpu").preprocess.channels == "bgr"


def test_build_refuses_a_preprocess_that_does_not_fit(cli, tiny_onnx, tmp_path):
    out = tmp_path / "bad.plan"
    line = assert_cli_error(cli("build", tiny_onnx, "-o", out, "--device", "cpu", *SHAPE_ARGS,
                                "--preprocess", "letterbox=320,std=255"), "320x320", "16x16", "profile 0")
    assert "letterbox=16" in line and not out.exists()
    assert_cli_error(cli("build", tiny_onnx, "-o", out, "--device", "cpu", *SHAPE_ARGS,
                         "--preprocess", "letterbox=16,nhwc"), "nhwc")
    assert_cli_error(cli("build", tiny_onnx, "-o", out, "--device", "cpu", *SHAPE_ARGS,
                         "--preprocess", "letterbox=16,dtype=uint8"), "uint8", "float32")
    assert_cli_error(cli("build", tiny_onnx, "-o", out, "--device", "cpu", *SHAPE_ARGS,
                         "--preprocess", "letterbox=16,blur"), "'blur'")
    with pytest.raises(ConfigError, match="profile 0"):
        sartor.build(tiny_onnx, out, device="cpu", min_shapes=MIN_SHAPES, max_shapes=MAX_SHAPES,
                     preprocess="resize=16x32")


def test_image_meta_is_plain_data():
    meta = ImageMeta(path="p", orig_size=(10, 20), scale=(0.5, 0.5), pad=(3, 0))
    assert np.allclose(meta.to_original(np.array([[0, 3, 10, 8]])), [[0, 0, 20, 10]])
