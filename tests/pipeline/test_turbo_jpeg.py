"""The fast host path's JPEGs through libjpeg-turbo (simplejpeg; docs/decisions/0059): the frames
are Pillow's bit for bit at every DCT scale, subsampling, grey and progressive files; what it does
not take (CMYK, corrupt and truncated files, no simplejpeg) goes to Pillow with Pillow's result and
errors; refusals come before decoding; a caller's buffer is decoded into."""
from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from PIL import Image

from sartor.data.buckets import BucketRefused, Buckets
from sartor.data.preprocess import parse_preprocess
from sartor.errors import DataError
from sartor.pipeline import turbo_jpeg
from sartor.pipeline.decode import ImageTooLarge, decode_on_host

skimage_data = pytest.importorskip("skimage.data")
pytest.importorskip("simplejpeg")


def jpeg(size: tuple[int, int] = (1280, 720), mode: str = "RGB", photo: str = "astronaut", **save) -> bytes:
    image = Image.fromarray(getattr(skimage_data, photo)()).resize(size, Image.Resampling.BICUBIC).convert(mode)
    buffer = io.BytesIO()
    image.save(buffer, "JPEG", quality=90, **save)
    return buffer.getvalue()


@pytest.fixture
def decoded_by():
    """Calls into libjpeg-turbo's decode, counted: which path a file took."""
    calls = []
    real = turbo_jpeg.decode

    def counted(*args, **kwargs):
        calls.append(args[1])
        return real(*args, **kwargs)
    turbo_jpeg.decode = counted
    yield calls
    turbo_jpeg.decode = real


def by_pillow(monkeypatch, data, spec, **kwargs):
    with monkeypatch.context() as patch:
        patch.setattr(turbo_jpeg, "simplejpeg", None)
        return decode_on_host(data, spec, fast=True, **kwargs)


@pytest.mark.parametrize("size", [(1280, 720), (1281, 719), (643, 361), (1920, 1080), (333, 777), (17, 9)])
@pytest.mark.parametrize("letterbox", [640, 320, 160, 1000])
@pytest.mark.parametrize("kind", [{}, {"subsampling": 0}, {"subsampling": 1}, {"progressive": True}, {"mode": "L"}])
def test_the_frames_are_pillows_bit_for_bit(monkeypatch, decoded_by, size, letterbox, kind):
    data = jpeg(size, **kind)
    spec = parse_preprocess(f"letterbox={letterbox},mean=0,std=255,rgb,nchw")
    pixels, orig = decode_on_host(data, spec, fast=True)
    assert len(decoded_by) == 1  # libjpeg-turbo took it
    reference, reference_orig = by_pillow(monkeypatch, data, spec)
    assert orig == reference_orig == (size[1], size[0])
    assert torch.equal(pixels, reference)


def test_without_a_resize_the_frame_is_full_size(decoded_by):
    pixels, orig = decode_on_host(jpeg(), parse_preprocess("none,mean=0,std=255,rgb,nchw"), fast=True)
    assert tuple(pixels.shape) == (3, 720, 1280) and orig == (720, 1280) and len(decoded_by) == 1


def test_the_exact_path_never_takes_it(decoded_by):
    decode_on_host(jpeg(), parse_preprocess("letterbox=640,mean=0,std=255,rgb,nchw"), fast=False)
    assert decoded_by == []


def test_cmyk_goes_to_pillow(monkeypatch, decoded_by):
    data = jpeg(mode="CMYK")
    spec = parse_preprocess("letterbox=640,mean=0,std=255,rgb,nchw")
    pixels, orig = decode_on_host(data, spec, fast=True)
    assert decoded_by == [] and torch.equal(pixels, by_pillow(monkeypatch, data, spec)[0])


def test_without_simplejpeg_pillow_decodes(monkeypatch, decoded_by):
    monkeypatch.setattr(turbo_jpeg, "simplejpeg", None)
    pixels, _ = decode_on_host(jpeg(), parse_preprocess("letterbox=640,mean=0,std=255,rgb,nchw"), fast=True)
    assert tuple(pixels.shape) == (3, 360, 640) and decoded_by == []


@pytest.mark.parametrize("damage", ["truncated", "corrupt header", "corrupt scan"])
def test_a_file_it_refuses_fails_with_pillows_error(monkeypatch, damage):
    data = jpeg((256, 144))
    bad = {"truncated": data[:len(data) // 2],
           "corrupt header": data[:2] + b"\xff\xc0\x00\x03" + data[6:],
           "corrupt scan": data[:len(data) // 2] + bytes(64) + b"\xff\xd9"}[damage]
    spec = parse_preprocess("letterbox=64,mean=0,std=255,rgb,nchw")
    try:
        expected = by_pillow(monkeypatch, bad, spec)
    except DataError as exc:
        with pytest.raises(DataError) as got:
            decode_on_host(bad, spec, fast=True)
        assert str(got.value) == str(exc)
    else:  # a damage Pillow decodes through: so must this path, to the same pixels
        assert torch.equal(decode_on_host(bad, spec, fast=True)[0], expected[0])


def test_refusals_come_before_decoding(decoded_by):
    data = jpeg((64, 32))
    with pytest.raises(ImageTooLarge, match=r"^image of 64x32 pixels exceeds 1000 pixels$"):
        decode_on_host(data, fast=True, max_pixels=1000)
    buckets = Buckets((parse_preprocess("letterbox=16,mean=0,std=255,rgb,nchw"),)).with_max_downscale(1.0)
    with pytest.raises(BucketRefused):
        decode_on_host(data, buckets, fast=True)
    assert decoded_by == []


def test_it_decodes_into_the_callers_buffer():
    buffers = []

    def allocate(shape):
        buffers.append(np.zeros(shape, np.uint8))
        return buffers[-1]
    spec = parse_preprocess("letterbox=640,mean=0,std=255,rgb,nchw")
    pixels, _ = decode_on_host(jpeg(), spec, fast=True, allocate=allocate)
    assert [b.shape for b in buffers] == [(360, 640, 3)]
    assert pixels.data_ptr() == buffers[0].ctypes.data and torch.equal(pixels, decode_on_host(jpeg(), spec, True)[0])


@pytest.mark.parametrize("height,width,target,size", [
    (720, 1280, (360, 640), (360, 640)), (720, 1280, (361, 640), (720, 1280)), (720, 1280, (90, 160), (90, 160)),
    (720, 1280, (10, 10), (90, 160)),  # 1/8 at most
    (719, 1281, (179, 320), (180, 321)),  # rounded up, as libjpeg sizes a scaled frame
    (720, 1280, None, (720, 1280)),
])
def test_draft_size_is_pillows_choice(height, width, target, size):
    assert turbo_jpeg.draft_size(height, width, target) == size
