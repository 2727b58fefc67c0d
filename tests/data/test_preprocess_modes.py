"""Preprocessing modes of issue 37: `resize=N,crop=C` against torchvision's ImageNet evaluation, and
`resampler=cv2` against cv2.resize and Ultralytics' LetterBox, on real photos (scikit-image's);
every consumer (the CPU reference, the pipeline's host decode and torch path, calibration) agrees;
old specs keep their meaning; OpenCV stays optional."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from sartor.data.preprocess import PreprocessSpec, parse_preprocess, placement, preprocess_image
from sartor.errors import ConfigError, MissingDependencyError
from sartor.ir.graph import ValueInfo
from sartor.kernels.preprocess.letterbox import kernel_supports
from sartor.kernels.preprocess.torch_path import float_levels
from sartor.pipeline.decode import decode_on_host
from sartor.pipeline.prepare import prepare_batch, uses_kernel
from sartor.quant.data import open_calibration

skimage_data = pytest.importorskip("skimage.data")
cv2 = pytest.importorskip("cv2")

# square, landscape, portrait, grey: shorter side on either axis, odd sizes (chelsea 300x451)
PHOTOS = ("astronaut", "coffee", "chelsea", "rocket", "camera")
IMAGENET = "resize=256,crop=224,mean=0,std=1,rgb,nhwc,dtype=uint8"
YOLO_CV2 = "letterbox=640,mean=0,std=1,rgb,nhwc,dtype=uint8,resampler=cv2"


def photo(name: str) -> np.ndarray:
    return np.asarray(Image.fromarray(getattr(skimage_data, name)()).convert("RGB"))


def chw(pixels: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(pixels)).permute(2, 0, 1)


# ---- the spec ------------------------------------------------------------------------------------

def test_new_fields_parse_round_trip_and_refuse_what_they_cannot_mean():
    spec = parse_preprocess("resize=256,crop=224,mean=0,std=255,rgb,nchw")
    assert (spec.resize, spec.shorter_side, spec.size) == ("crop", 256, (224, 224))
    assert spec.input_shape(2) == (2, 3, 224, 224)
    for text in ("resize=256,crop=224x192,mean=0,std=1,bgr,nhwc", YOLO_CV2, "letterbox=320,resampler=pil"):
        spec = parse_preprocess(text)
        assert parse_preprocess(spec.describe()) == spec and PreprocessSpec.from_json(spec.to_json()) == spec
    assert parse_preprocess("letterbox=640,resampler=opencv").resampler == "cv2"
    for bad, words in (("resize=256x300,crop=224", "needs resize=N"), ("letterbox=640,crop=224", "needs resize=N"),
                       ("crop=224", "needs resize=N"), ("resize=200,crop=224", "at least the crop"),
                       ("resize=256,crop=0", "positive"), ("letterbox=64,resampler=lanczos", "pillow, cv2"),
                       ("letterbox=64,resampler=cv2,resampler=pillow", "again")):
        with pytest.raises(ConfigError, match=words):
            parse_preprocess(bad)


def test_old_specs_keep_their_meaning():
    """Engine headers store to_json() records and --preprocess text; both must read as before."""
    old_record = {"resize": "letterbox", "size": [640, 640], "mean": [0, 0, 0], "std": [255, 255, 255],
                  "channels": "rgb", "layout": "nchw", "dtype": "float32", "pad_value": 114}
    spec = PreprocessSpec.from_json(old_record)
    assert spec.resampler == "pillow" and spec.shorter_side == 0 and spec.resize == "letterbox"
    assert spec.describe() == "letterbox=640,mean=0,std=255,rgb,nchw"  # the text older builds wrote
    square = parse_preprocess("resize=256,mean=0,std=1,rgb,nchw")  # one number without crop: still 256x256
    assert (square.resize, square.size) == ("resize", (256, 256))
    assert placement(100, 300, square).resized == (256, 256)


# ---- resize=N,crop=C against torchvision ----------------------------------------------------------

@pytest.mark.parametrize("name", PHOTOS)
def test_crop_equals_torchvision_imagenet_eval(name):
    """torchvision's PIL path (Resize(256) + CenterCrop(224)) is Pillow's antialiased bilinear, so the
    tolerance is 0; its tensor path (antialias=True) is within 1 level of it."""
    T = pytest.importorskip("torchvision.transforms")
    image = Image.fromarray(photo(name))
    ours, meta = preprocess_image(image, parse_preprocess(IMAGENET))
    expected = np.asarray(T.Compose([T.Resize(256), T.CenterCrop(224)])(image))
    assert ours.shape == (224, 224, 3) and np.array_equal(ours, expected)
    tensor_path = T.Compose([T.PILToTensor(), T.Resize(256, antialias=True), T.CenterCrop(224)])(image)
    assert np.abs(ours.astype(int) - tensor_path.permute(1, 2, 0).numpy()).max() <= 1
    # the meta maps the crop back: input pixel (0, 0) is the crop's corner in the original image
    h, w = image.size[1], image.size[0]
    corner = meta.to_original(np.array([[0, 0, 224, 224]]))[0]
    assert corner[0] >= 0 and corner[1] >= 0 and corner[2] <= w and corner[3] <= h
    assert (corner[2] - corner[0]) == pytest.approx(224 / meta.scale[1], abs=1e-3)


# ---- resampler=cv2 against cv2 and Ultralytics --------------------------------------------------------

@pytest.mark.parametrize("name", PHOTOS[:4])
def test_cv2_letterbox_equals_cv2_and_ultralytics(name):
    """cv2.resize(INTER_LINEAR) and a 114 border, in Ultralytics' geometry: equal arrays (the same
    call on the same pixels), and equal to Ultralytics' own LetterBox on the BGR image it reads."""
    rgb = photo(name)
    ours, meta = preprocess_image(rgb, parse_preprocess(YOLO_CV2))
    h, w = rgb.shape[:2]
    r = min(640 / h, 640 / w)
    new_w, new_h = round(w * r), round(h * r)
    dw, dh = (640 - new_w) / 2, (640 - new_h) / 2
    top, bottom = round(dh - 0.1), round(dh + 0.1)
    left, right = round(dw - 0.1), round(dw + 0.1)
    resized = cv2.resize(rgb, (new_w, new_h), interpolation=cv2.INTER_LINEAR)
    expected = cv2.copyMakeBorder(resized, top, bottom, left, right, cv2.BORDER_CONSTANT, value=(114, 114, 114))
    assert np.array_equal(ours, expected) and meta.pad == (top, left)
    augment = pytest.importorskip("ultralytics.data.augment")
    letterboxed = augment.LetterBox(new_shape=(640, 640), auto=False, scaleup=True, center=True)(
        image=np.ascontiguousarray(rgb[..., ::-1]))
    assert np.array_equal(ours, letterboxed[..., ::-1])
    pillow, _ = preprocess_image(rgb, parse_preprocess(YOLO_CV2.replace(",resampler=cv2", "")))
    # the two filters differ on a shrink (the field matters); rocket (427x640) is not resized at all
    assert np.array_equal(ours, pillow) == (r == 1)


# ---- every consumer ---------------------------------------------------------------------------------

@pytest.mark.parametrize("text", [IMAGENET, YOLO_CV2.replace("640", "320"),
                                  "resize=160,crop=128x96,mean=0,std=1,bgr,nhwc,dtype=uint8,resampler=cv2"])
def test_pipeline_host_paths_follow_the_spec(text, tmp_path):
    """The pipeline's exact host decode resizes as the reference; its CPU torch path lays out (and
    crops) what the reference does: exactly with cv2, within 2 levels with Pillow's filter (torch's
    uint8 antialiased resize)."""
    spec = parse_preprocess(text)
    tolerance = 0 if spec.resampler == "cv2" else 2
    for name in ("coffee", "chelsea"):
        rgb = photo(name)
        path = tmp_path / f"{name}.png"
        Image.fromarray(rgb).save(path)
        expected, meta = preprocess_image(path, spec)
        decoded, size = decode_on_host(path.read_bytes(), spec, fast=False)
        prepared, metas = prepare_batch([decoded], [name], spec, kernel=False, orig_sizes=[size])
        assert np.array_equal(prepared[0].numpy(), expected)  # resized on the host exactly as the reference
        raw, metas = prepare_batch([chw(rgb)], [name], spec, kernel=False)  # the torch ops resize
        assert np.abs(raw[0].numpy().astype(int) - expected).max() <= tolerance
        assert metas[0].pad == meta.pad and metas[0].scale == meta.scale


def test_cuda_float_resize_is_within_one_level_of_cv2():
    """What the torch path runs on CUDA for resampler=cv2 (bilinear, no antialias, float32, rounded)
    against OpenCV's 11-bit fixed point: at most one level apart, shrinking and enlarging."""
    rgb = photo("astronaut")
    for size in ((320, 320), (200, 333), (700, 900), (256, 256)):  # 256: the exact 2x, OpenCV's area path
        expected = cv2.resize(rgb, size[::-1], interpolation=cv2.INTER_LINEAR)
        got = float_levels(chw(rgb)[None], size, antialias=False)[0].permute(1, 2, 0).numpy()
        assert np.abs(got - expected).max() <= 1


def test_fused_kernel_takes_pillow_specs_only():
    cv2_spec = parse_preprocess(YOLO_CV2)
    assert kernel_supports(parse_preprocess(IMAGENET)) and not kernel_supports(cv2_spec)
    assert not uses_kernel(torch.device("cuda"), cv2_spec)
    with pytest.raises(ConfigError, match="Pillow's filter only"):
        prepare_batch([chw(photo("coffee"))], ["coffee"], cv2_spec, kernel=True)


def test_calibration_from_a_folder_follows_crop_and_resampler(tmp_path):
    for name in ("coffee", "chelsea", "rocket"):
        Image.fromarray(photo(name)).save(tmp_path / f"{name}.png")
    for text in ("resize=96,crop=64,mean=0,std=255,rgb,nchw", "letterbox=64,mean=0,std=255,rgb,nchw,resampler=cv2"):
        spec = parse_preprocess(text)
        info = ValueInfo("images", "float32", ("batch", 3, 64, 64))
        calib = open_calibration(tmp_path, [info], limit=3, batch_size=3, preprocess=spec)
        (batch,) = list(calib)
        expected = np.stack([preprocess_image(tmp_path / f"{n}.png", spec)[0]
                             for n in sorted(p.stem for p in tmp_path.glob("*.png"))])
        assert np.array_equal(batch["images"], expected)


# ---- OpenCV stays optional ------------------------------------------------------------------------------

def test_cv2_is_imported_only_when_asked_and_missing_is_one_error(monkeypatch):
    code = ("import sys, numpy as np\nfrom sartor.data.preprocess import parse_preprocess, preprocess_image\n"
            "preprocess_image(np.zeros((20, 30, 3), np.uint8), parse_preprocess('letterbox=16'))\n"
            "print('cv2' in sys.modules)")
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=root,
                         env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"}, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"
    monkeypatch.setitem(sys.modules, "cv2", None)  # import cv2 now raises ImportError
    with pytest.raises(MissingDependencyError, match="pip install opencv-python-headless"):
        preprocess_image(np.zeros((20, 30, 3), np.uint8), parse_preprocess("letterbox=16,resampler=cv2"))
