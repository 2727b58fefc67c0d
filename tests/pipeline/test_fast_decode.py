"""The CPU fast path: JPEGs decoded on the host at 1/2, 1/4 or 1/8 scale in the DCT domain when the
preprocessing shrinks them that much (`fast_decode`), the geometry kept from the file's own size;
the exact path, which gives the reference's values; and `decode_on_host`'s refusals (one line
each)."""
from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from PIL import Image

import sartor
from sartor.data.preprocess import parse_preprocess, placement, preprocess_image
from sartor.errors import DataError
from sartor.pipeline import Pipeline, decode_frames, prepare_batch, read_sources
from sartor.pipeline.decode import ImageTooLarge, decode_on_host

skimage_data = pytest.importorskip("skimage.data")
CPU = torch.device("cpu")
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def frame_bytes(name: str = "astronaut", size: tuple[int, int] = (1280, 720), fmt: str = "JPEG") -> bytes:
    """A camera-sized (W, H) frame made from a real photo, encoded."""
    image = Image.fromarray(getattr(skimage_data, name)()).resize(size, Image.Resampling.BICUBIC)
    buffer = io.BytesIO()
    image.save(buffer, fmt, quality=90)
    return buffer.getvalue()


@pytest.mark.parametrize("text,decoded", [
    ("letterbox=640,mean=0,std=255,rgb,nchw", (360, 640)),  # 1/2: exactly the letterbox's size
    ("letterbox=320,mean=0,std=255,rgb,nchw", (180, 320)),  # 1/4
    ("letterbox=160,mean=0,std=255,rgb,nchw", (90, 160)),  # 1/8
    ("letterbox=480,mean=0,std=255,rgb,nchw", (360, 640)),  # 1/2, then a resize to 480x270
    ("resize=224x224,mean=0,std=1,rgb,nchw,dtype=uint8", (360, 640)),  # 1/4 would be under 224 high
    ("letterbox=1000,mean=0,std=255,rgb,nchw", (720, 1280)),  # shrinks by less than 2: full size
    ("none,mean=0,std=255,rgb,nchw", (720, 1280)),  # no resize: full size
])
def test_fast_decode_picks_the_smallest_dct_scale_that_still_covers_the_resize(text, decoded):
    spec = parse_preprocess(text)
    (frame,) = decode_frames(read_sources([frame_bytes()]), CPU, spec, fast=True)
    assert tuple(frame.pixels.shape) == (3, *decoded) and frame.size == (720, 1280)
    (exact,) = decode_frames(read_sources([frame_bytes()]), CPU, spec, fast=False)
    resized = (720, 1280) if spec.resize == "none" else placement(720, 1280, spec).resized
    assert tuple(exact.pixels.shape) == (3, *resized) and exact.size == (720, 1280)  # resized by Pillow


def test_fast_decode_leaves_png_at_full_size():
    spec = parse_preprocess("letterbox=320,mean=0,std=255,rgb,nchw")
    (frame,) = decode_frames(read_sources([frame_bytes(fmt="PNG")]), CPU, spec, fast=True)
    assert tuple(frame.pixels.shape) == (3, 720, 1280)


@pytest.mark.parametrize("name", ["astronaut", "coffee", "rocket"])
@pytest.mark.parametrize("text", ["letterbox=640,mean=0,std=255,rgb,nchw", "letterbox=320,mean=0,std=255,bgr,nhwc",
                                  "letterbox=480,mean=0,std=255,rgb,nchw",
                                  "resize=224x224,mean=123.675:116.28:103.53,std=58.395:57.12:57.375"])
def test_fast_decode_keeps_the_geometry_and_lands_near_the_exact_pixels(name, text):
    spec = parse_preprocess(text)
    data = frame_bytes(name)
    reference, meta = preprocess_image(Image.open(io.BytesIO(data)).convert("RGB"), spec, path="item 0")
    (frame,) = decode_frames(read_sources([data]), CPU, spec, fast=True)
    batch, (ours_meta,) = prepare_batch([frame.pixels], ["item 0"], spec, orig_sizes=[frame.size])
    assert ours_meta == meta  # boxes map back to the file's own pixels exactly
    std = np.asarray(spec.std).reshape((3, 1, 1) if spec.layout == "nchw" else (1, 1, 3))
    apart = np.abs(batch[0].numpy().astype(np.float64) - reference) * std
    # A DCT low-pass in place of a bilinear filter: most pixels within a level or two, edges more.
    assert 0.05 < apart.mean() < 1.5 and np.percentile(apart, 99) <= 16, (apart.mean(), np.percentile(apart, 99))


@pytest.mark.parametrize("fmt", ["JPEG", "PNG"])
@pytest.mark.parametrize("text", ["letterbox=640,mean=0,std=255,rgb,nchw", "letterbox=320,mean=0,std=255,bgr,nhwc",
                                  "resize=224x224,mean=123.675:116.28:103.53,std=58.395:57.12:57.375",
                                  "letterbox=1000,mean=10,std=3,rgb,nhwc,dtype=uint8",
                                  "letterbox=256,mean=0,std=1,rgb,nchw,dtype=float16,pad=0"])
@pytest.mark.parametrize("device", DEVICES)
def test_the_exact_path_gives_the_references_values(device, fmt, text):
    """On a CUDA engine too: decoded and resized on the host, normalised on the device."""
    spec = parse_preprocess(text)
    data = frame_bytes("coffee", fmt=fmt)
    reference, meta = preprocess_image(Image.open(io.BytesIO(data)).convert("RGB"), spec, path="item 0")
    (frame,) = decode_frames(read_sources([data]), torch.device(device), spec, fast=False)
    assert frame.pixels.device.type == device
    batch, (ours_meta,) = prepare_batch([frame.pixels], ["item 0"], spec, orig_sizes=[frame.size])
    assert ours_meta == meta
    np.testing.assert_array_equal(batch[0].cpu().numpy(), reference)


def engine_on(engine, data: bytes, fast: bool) -> np.ndarray:
    (frame,) = decode_frames(read_sources([data]), CPU, engine.preprocess, fast=fast)
    batch, _ = prepare_batch([frame.pixels], ["x"], engine.preprocess, orig_sizes=[frame.size])
    return engine.context().run({"images": batch.numpy()})["logits"][0]


def test_a_cpu_pipeline_decodes_fast_by_default_and_exactly_on_request(letterbox_plan):
    engine = sartor.load(letterbox_plan, device="cpu")
    items = [frame_bytes(name) for name in ("astronaut", "coffee", "rocket")]
    fast, exact = Pipeline(engine), Pipeline(engine, fast_decode=False)
    assert fast.fast_decode and not exact.fast_decode
    fast_logits = np.stack([r.outputs["logits"] for r in fast.run(items)])
    exact_results = exact.run(items)
    exact_logits = np.stack([r.outputs["logits"] for r in exact_results])
    np.testing.assert_allclose(fast_logits, [engine_on(engine, d, True) for d in items], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(exact_logits, [engine_on(engine, d, False) for d in items], rtol=1e-5, atol=1e-5)
    assert not np.allclose(fast_logits, exact_logits, rtol=1e-5, atol=1e-5)  # the two paths differ
    assert exact_results[0].meta.orig_size == (720, 1280)


def test_decode_on_host_refusals_are_one_line():
    data = frame_bytes(size=(64, 32))
    with pytest.raises(ImageTooLarge, match=r"^image of 64x32 pixels exceeds 1000 pixels$"):
        decode_on_host(data, max_pixels=1000)
    pixels, size = decode_on_host(data, max_pixels=64 * 32)
    assert tuple(pixels.shape) == (3, 32, 64) and size == (32, 64)
    with pytest.raises(DataError, match=r"^Pillow cannot identify it$"):
        decode_on_host(b"not an image at all")
    with pytest.raises(DataError) as truncated:
        decode_on_host(frame_bytes(fmt="PNG")[:200])
    assert "truncat" in str(truncated.value) and "\n" not in str(truncated.value)
