"""The frames-to-results pipeline on the CPU: sources, decode, preprocessing against the PIL
reference (`sartor.data.preprocess`), and `Pipeline` against the engine run on reference batches.
On a GPU machine the same file runs the CUDA paths too (nvJPEG decode, float resize)."""
from __future__ import annotations

import io
import itertools
import os

import numpy as np
import pytest
import torch
from conftest import IMAGE, MAX_SHAPES, MIN_SHAPES, OPT_SHAPES
from PIL import Image

import sartor
from sartor.data.preprocess import parse_preprocess, preprocess_image
from sartor.errors import ConfigError, DataError
from sartor.pipeline import Pipeline, decode_frames, prepare_batch, read_sources
from sartor.pipeline.prepare import stack_frames
from sartor.pipeline.sources import FrameSource

skimage_data = pytest.importorskip("skimage.data")
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
# Pillow rounds its bilinear resize to uint8 after each pass; the GPU resizes in float32 in one pass
# and rounds once, so a pixel may land one level away. torch's uint8 path on the CPU rounds as Pillow
# does with other fixed-point weights: a few pixels two levels away.
MAX_LEVELS = {"cpu": 2, "cuda": 1}
SPECS = ["letterbox=320,mean=0,std=255,rgb,nchw", "letterbox=480x640,mean=0,std=255,bgr,nhwc,dtype=float16",
         "resize=224x224,mean=123.675:116.28:103.53,std=58.395:57.12:57.375",
         "letterbox=256,mean=0,std=1,rgb,nchw,dtype=uint8,pad=0", "letterbox=1000,mean=10,std=3,rgb,nhwc,dtype=uint8",
         "none,mean=0,std=255,rgb,nchw"]


def photo(name: str) -> np.ndarray:
    return getattr(skimage_data, name)()


def encoded(pixels: np.ndarray, fmt: str = "JPEG") -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, fmt, quality=90)
    return buffer.getvalue()


def levels_apart(ours: np.ndarray, reference: np.ndarray, spec) -> np.ndarray:
    """|ours - reference| in 0..255 pixel levels (undoing the spec's std)."""
    std = np.asarray(spec.std).reshape((3, 1, 1) if spec.layout == "nchw" else (1, 1, 3))
    scale = 1.0 if spec.dtype == "uint8" else std
    return np.abs(ours.astype(np.float64) - reference.astype(np.float64)) * scale


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name,fmt,text", list(itertools.product(["astronaut", "coffee", "rocket"], ["JPEG", "PNG"], SPECS)))
def test_preprocessing_matches_the_pil_reference(device, name, fmt, text):
    spec = parse_preprocess(text)
    data = encoded(photo(name), fmt)
    reference, meta = preprocess_image(Image.open(io.BytesIO(data)).convert("RGB"), spec, path="item 0")
    (frame,) = decode_frames(read_sources([data]), torch.device("cpu"))  # the same pixels as Pillow's
    assert frame.error is None
    batch, (ours_meta,) = prepare_batch([frame.pixels.to(device)], ["item 0"], spec)
    assert ours_meta == meta  # letterbox geometry exact
    ours = batch[0].cpu().numpy()
    assert ours.shape == reference.shape and ours.dtype == reference.dtype
    apart = levels_apart(ours, reference, spec)
    if spec.dtype == "float16":
        apart = np.maximum(apart - 0.5, 0)  # float16 holds 0..1 to 2^-11: up to half a level more
    assert apart.max() <= MAX_LEVELS[device] + 1e-3
    assert (apart > 0.01).mean() < 0.25  # most pixels equal: a shifted or blurred image fails here


@pytest.mark.parametrize("device", DEVICES)
def test_frames_of_several_sizes_share_a_batch(device):
    spec = parse_preprocess("letterbox=320,mean=0,std=255,bgr,nhwc")
    a, b = (torch.from_numpy(photo(n)).permute(2, 0, 1).to(device) for n in ("astronaut", "coffee"))
    batch, metas = prepare_batch([a, b, a, b, b], list("abcde"), spec)  # groups {0, 2} and {1, 3, 4}
    for i, frame in enumerate([a, b, a, b, b]):
        alone, (meta,) = prepare_batch([frame], [metas[i].path], spec)
        assert torch.equal(batch[i], alone[0]) and meta == metas[i]


@pytest.mark.parametrize("device", DEVICES)
def test_frames_evenly_spaced_in_one_tensor_are_stacked_as_a_view_and_others_are_copied(device):
    batch = torch.from_numpy(np.stack([photo("astronaut")[:64, :80]] * 4)).to(device)  # 4×H×W×3
    batch += torch.arange(4, dtype=torch.uint8, device=device).view(4, 1, 1, 1)  # four different frames
    frames = list(batch.permute(0, 3, 1, 2).unbind(0))  # channels first, as the decoders hand them on
    for chosen in (frames, frames[::2], frames[1:3]):
        stacked = stack_frames(chosen)
        assert stacked.data_ptr() == chosen[0].data_ptr() and torch.equal(stacked, torch.stack(chosen))
    for chosen in ([frames[1], frames[0]], [frames[0], frames[0]], [frames[0], frames[1].clone()],
                   [frames[0], frames[2], frames[3]]):
        stacked = stack_frames(chosen)  # out of order, repeated, in two storages, unevenly spaced
        assert stacked.data_ptr() != chosen[0].data_ptr() and torch.equal(stacked, torch.stack(chosen))
    spec = parse_preprocess("letterbox=96,mean=0,std=255,rgb,nchw")
    viewed, metas = prepare_batch(frames, list("abcd"), spec)
    copied, _ = prepare_batch([f.clone() for f in frames], list("abcd"), spec)
    assert torch.equal(viewed, copied) and [m.path for m in metas] == list("abcd")


def test_jpeg_markers_are_looked_at_when_an_item_is_read_and_once_for_a_source_made_directly():
    whole = encoded(photo("coffee")[:64, :64])
    truncated, not_jpeg = whole[:len(whole) // 2], encoded(photo("coffee")[:64, :64], "PNG")
    sources = read_sources([whole, truncated, not_jpeg])
    assert [s.marks for s in sources] == [(True, True), (True, False), (False, False)]
    direct = FrameSource("made", encoded=torch.frombuffer(bytearray(whole + b"\0" * 100), dtype=torch.uint8))
    assert direct.marks is None and direct.jpeg_marks() == (True, True) and direct.marks == (True, True)


@pytest.mark.parametrize("device", DEVICES)
def test_decode_equals_pillow_and_raw_frames_pass_through(device):
    pixels = photo("chelsea")
    for fmt in ("JPEG", "PNG"):
        data = encoded(pixels, fmt)
        (frame,) = decode_frames(read_sources([data]), torch.device(device))
        pil = np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))
        apart = np.abs(frame.pixels.permute(1, 2, 0).cpu().numpy().astype(int) - pil.astype(int))
        if device == "cpu" or fmt == "PNG":
            assert apart.max() == 0
        else:  # nvJPEG's IDCT and chroma upsampling are not libjpeg's: close, not equal
            assert apart.mean() < 1.0 and np.percentile(apart, 99) <= 8, (apart.mean(), np.percentile(apart, 99),
                                                                          apart.max())
    rgb, bgr = decode_frames(read_sources([pixels, np.ascontiguousarray(pixels[..., ::-1])]), torch.device(device))
    assert torch.equal(rgb.pixels.cpu(), torch.from_numpy(pixels).permute(2, 0, 1))
    (as_bgr,) = decode_frames(read_sources([np.ascontiguousarray(pixels[..., ::-1])], frame_order="bgr"),
                              torch.device(device))
    assert torch.equal(as_bgr.pixels.cpu(), rgb.pixels.cpu())
    assert not torch.equal(bgr.pixels.cpu(), rgb.pixels.cpu())


@pytest.mark.parametrize("device", DEVICES)
def test_bad_items_fail_alone_with_a_reason_naming_them(device, tmp_path):
    good = encoded(photo("astronaut"))
    folder = tmp_path / "folder"
    folder.mkdir()
    items = [good, good[:len(good) // 3], b"not an image at all", str(tmp_path / "missing.jpg"), str(folder),
             np.zeros((4, 4), np.uint8), np.zeros((4, 4, 3), np.float32), b"", 3.5, good]
    frames = decode_frames(read_sources(items), torch.device(device))
    assert [f.error is None for f in frames] == [True] + [False] * 8 + [True]
    reasons = [f.error for f in frames[1:-1]]
    assert reasons[0].startswith("image item 1 is corrupt, truncated or not an image")
    assert reasons[1].startswith("image item 2 is corrupt, truncated or not an image")
    assert reasons[2].startswith(f"image {tmp_path / 'missing.jpg'} cannot be read")
    assert reasons[3] == f"image {folder} is a directory, not an image file"
    assert reasons[4] == "item 5 of shape (4, 4) is not an H×W×3 frame"
    assert reasons[5] == "item 6 is a torch.float32 tensor; frames are uint8"
    assert reasons[6] == "item 7 is empty bytes"
    assert reasons[7] == "item 8 is a float: expected a path, image bytes or an H×W×3 uint8 array"
    assert torch.equal(frames[0].pixels, frames[-1].pixels)


# ---- Pipeline over an engine --------------------------------------------------------------------

SPEC = "letterbox=16,mean=0,std=255,rgb,nchw"


@pytest.fixture(scope="module")
def preprocessed_plan(tmp_path_factory, tiny_onnx):
    out = tmp_path_factory.mktemp("pipeline") / "tiny_letterbox.plan"
    sartor.build(tiny_onnx, out, device="cpu", min_shapes=MIN_SHAPES, opt_shapes=OPT_SHAPES, max_shapes=MAX_SHAPES,
                 preprocess=SPEC)
    return out


def photos(count: int) -> list[bytes]:
    names = ["astronaut", "coffee", "chelsea", "rocket", "camera"]
    return [encoded(np.ascontiguousarray(np.broadcast_to(p[..., None], p.shape + (3,))) if p.ndim == 2 else p)
            for p in (photo(names[i % len(names)]) for i in range(count))]


def expected_logits(engine, items: list[bytes]) -> np.ndarray:
    """The engine on batches that the pipeline's own preprocessing makes, one image at a time (twice,
    for engines whose minimum batch is 2), decoded as a CPU Pipeline decodes by default (fast)."""
    spec = engine.preprocess
    rows = []
    for item in items:
        (frame,) = decode_frames(read_sources([item]), torch.device("cpu"), spec, fast=True)
        batch, _ = prepare_batch([frame.pixels] * 2, ["x"] * 2, spec, orig_sizes=[frame.size] * 2)
        rows.append(engine.context().run({"images": batch.numpy()})["logits"][0])
    return np.stack(rows)


@pytest.mark.parametrize("overlap", [True, False])
def test_pipeline_runs_every_item_in_order_with_partial_and_filled_batches(preprocessed_plan, overlap):
    engine = sartor.load(preprocessed_plan, device="cpu")
    items = photos(7)
    results = Pipeline(engine, batch_size=3, overlap=overlap).run(items)  # batches of 3, 3, 1
    assert [r.name for r in results] == [f"item {i}" for i in range(7)]
    assert all(r.error is None for r in results)
    np.testing.assert_allclose(np.stack([r.outputs["logits"] for r in results]), expected_logits(engine, items),
                               rtol=1e-5, atol=1e-5)
    h, w = photo("astronaut").shape[:2]
    assert results[0].meta.orig_size == (h, w) and results[0].meta.input_size == (IMAGE, IMAGE)


def test_launching_ahead_returns_every_batch_in_order_and_refuses_a_bad_one_after_the_one_before(
        preprocessed_plan):
    """On CUDA batch n+1 is launched before batch n's results are finished. Forced on the CPU (the
    outputs then copied apart, as on CUDA), the results equal the plain run's, and a batch with a
    bad item is refused only after the batch before it came back."""
    engine = sartor.load(preprocessed_plan, device="cpu")
    items = photos(7)
    ahead = Pipeline(engine, batch_size=3)
    ahead.launch_ahead = True
    results = ahead.run(items)
    assert [r.name for r in results] == [f"item {i}" for i in range(7)]
    np.testing.assert_allclose(np.stack([r.outputs["logits"] for r in results]), expected_logits(engine, items),
                               rtol=1e-5, atol=1e-5)
    seen = []
    with pytest.raises(DataError, match="1 of 3 images failed: image item 4"):
        for result in ahead.stream(items[:4] + [b"junk"] + items[4:]):
            seen.append(result.name)
    assert seen == ["item 0", "item 1", "item 2"]


def test_a_last_batch_under_the_profiles_minimum_is_filled_and_trimmed(tmp_path, tiny_onnx):
    plan = tmp_path / "min2.plan"
    sartor.build(tiny_onnx, plan, device="cpu", min_shapes={"images": (2, 3, IMAGE, IMAGE)},
                 opt_shapes={"images": (2, 3, IMAGE, IMAGE)}, max_shapes={"images": (4, 3, IMAGE, IMAGE)},
                 preprocess=SPEC)
    engine = sartor.load(plan, device="cpu")
    items = photos(5)
    results = Pipeline(engine, batch_size=4).run(items)  # 4, then 1 filled to 2
    assert len(results) == 5
    np.testing.assert_allclose(np.stack([r.outputs["logits"] for r in results]), expected_logits(engine, items),
                               rtol=1e-5, atol=1e-5)


def test_bad_items_raise_naming_them_or_are_skipped(preprocessed_plan):
    engine = sartor.load(preprocessed_plan, device="cpu")
    good = photos(2)
    items = [good[0], b"\xff\xd8\xff\xe0 truncated", good[1]]
    with pytest.raises(DataError, match=r"1 of 3 images failed: image item 1 is corrupt, truncated or not an "
                                        r"image.*skip_bad=True runs the others"):
        Pipeline(engine, batch_size=4).run(items)
    results = Pipeline(engine, batch_size=4, skip_bad=True).run(items)
    assert [r.error is None for r in results] == [True, False, True]
    assert results[1].outputs == {} and results[1].meta is None
    np.testing.assert_allclose(np.stack([results[0].outputs["logits"], results[2].outputs["logits"]]),
                               expected_logits(engine, good), rtol=1e-5, atol=1e-5)
    only_bad = Pipeline(engine, skip_bad=True).run([b"junk"])
    assert len(only_bad) == 1 and only_bad[0].error.startswith("image item 0 is corrupt")


def test_a_decoder_turns_outputs_into_per_item_results(preprocessed_plan):
    engine = sartor.load(preprocessed_plan, device="cpu")
    seen = []

    def top_class(outputs, metas):
        seen.append(len(metas))
        return [int(np.argmax(row)) for row in outputs["logits"]]

    results = Pipeline(engine, batch_size=2, decoder=top_class).run(photos(3))
    assert seen == [2, 1]
    assert [r.detections for r in results] == [int(np.argmax(r.outputs["logits"])) for r in results]


def test_pipeline_refusals_are_one_line(preprocessed_plan, tiny_plan):
    engine = sartor.load(preprocessed_plan, device="cpu")
    with pytest.raises(ConfigError, match=r"batch size 5 is outside 1\.\.4"):
        Pipeline(engine, batch_size=5)
    with pytest.raises(ConfigError, match="records no preprocessing"):
        Pipeline(sartor.load(tiny_plan, device="cpu"))
    with pytest.raises(ConfigError, match=r"makes 3x32x32 inputs, which no profile of the engine admits"):
        Pipeline(engine, preprocess=parse_preprocess("letterbox=32,mean=0,std=255,rgb,nchw"))
    with pytest.raises(ConfigError, match="frame order 'yuv' is not one of rgb, bgr"):
        Pipeline(engine, frame_order="yuv")


# ---- detections decoded on the device -----------------------------------------------------------

def yolo_head(seed: int, batch: int = 3, classes: int = 5, anchors: int = 600, size: int = 320) -> np.ndarray:
    """Random [B, 4+C, N] head outputs: centres and sizes in input pixels, clustered so that NMS has
    overlaps to suppress, class scores in 0..1."""
    rng = np.random.default_rng(seed)
    centres = rng.uniform(0, size, (batch, 2, 8)).repeat(anchors // 8, axis=2) + rng.normal(0, 6, (batch, 2, anchors))
    sizes = rng.uniform(8, 90, (batch, 2, anchors))
    scores = rng.beta(0.4, 3.0, (batch, classes, anchors))
    return np.concatenate([centres, sizes, scores], axis=1).astype(np.float32)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("conf,iou,agnostic", [(0.001, 0.7, False), (0.25, 0.45, False), (0.25, 0.45, True)])
def test_yolo_nms_keeps_exactly_what_the_host_decoder_keeps(device, conf, iou, agnostic):
    from sartor.data.preprocess import ImageMeta
    from sartor.pipeline import YoloNms
    from sartor.validate.decoders import DecodeOptions, decode_yolo
    head = yolo_head(seed=int(conf * 1000) + agnostic)
    metas = [ImageMeta(path=f"{i}", orig_size=(720, 1280), scale=(0.25, 0.25), pad=(70, 0), input_size=(320, 320))
             for i in range(len(head))]
    host = decode_yolo({"output0": head}, metas, DecodeOptions(conf=conf, iou=iou, agnostic=agnostic))
    ours = YoloNms(conf=conf, iou=iou, agnostic=agnostic)({"output0": torch.from_numpy(head).to(device)}, metas)
    assert sum(len(d) for d in host) > 20
    for expected, got in zip(host, ours):
        assert len(got) == len(expected)
        order_e, order_g = np.lexsort((expected.classes, -expected.scores)), np.lexsort((got.classes, -got.scores))
        np.testing.assert_array_equal(got.classes[order_g], expected.classes[order_e])
        np.testing.assert_allclose(got.scores[order_g], expected.scores[order_e], rtol=0, atol=0)
        np.testing.assert_allclose(got.boxes[order_g], expected.boxes[order_e], rtol=1e-5, atol=1e-3)


def test_yolo_nms_keeps_the_best_candidates_of_a_crowded_image():
    from sartor.pipeline import YoloNms
    from sartor.pipeline.detections import MAX_CANDIDATES
    from sartor.validate.decoders import DecodeOptions, decode_yolo
    head = yolo_head(seed=7, batch=2, classes=5, anchors=7200)  # 36,000 candidates an image at conf 0
    assert head.shape[1:] == (9, 7200) and 5 * 7200 > MAX_CANDIDATES
    host = decode_yolo({"output0": head}, [None, None], DecodeOptions(conf=0.0, iou=0.5))
    ours = YoloNms(conf=0.0, iou=0.5)({"output0": torch.from_numpy(head)}, [None, None])
    for expected, got in zip(host, ours):
        assert len(got) == len(expected) == 300
        np.testing.assert_array_equal(np.sort(got.scores), np.sort(expected.scores))


def test_host_outputs_off_needs_a_decoder(preprocessed_plan):
    with pytest.raises(ConfigError, match="host_outputs=False needs a decoder"):
        Pipeline(sartor.load(preprocessed_plan, device="cpu"), host_outputs=False)


def test_a_batch_prepared_in_the_calling_thread_returns_its_result_or_raises_at_result():
    from sartor.pipeline.pipeline import _prepared_now

    assert _prepared_now(lambda a, b: a + b, 2, 3).result() == 5
    failed = _prepared_now(lambda: (_ for _ in ()).throw(DataError("bad frame")))
    with pytest.raises(DataError, match="bad frame"):
        failed.result()


def test_files_are_read_whole_from_disk_and_from_a_pipe(tmp_path):
    import threading
    data = bytes(range(256)) * 1000
    (tmp_path / "frame.jpg").write_bytes(data)
    (tmp_path / "empty.jpg").write_bytes(b"")
    fifo = tmp_path / "camera.pipe"  # no size to read ahead of time: read until its end
    os.mkfifo(fifo)
    writer = threading.Thread(target=lambda: fifo.write_bytes(data[:70_000]))
    writer.start()
    whole, empty, piped = read_sources([tmp_path / "frame.jpg", tmp_path / "empty.jpg", fifo])
    writer.join()
    assert bytes(whole.encoded.numpy()) == data and whole.encoded.dtype == torch.uint8
    assert empty.error == f"image {tmp_path / 'empty.jpg'} is empty"
    assert bytes(piped.encoded.numpy()) == data[:70_000]


def test_files_are_read_ahead_in_order_and_live_frames_are_not_waited_for(tmp_path):
    from concurrent.futures import ThreadPoolExecutor

    from sartor.pipeline.read_ahead import Chunk, read_ahead

    paths = []
    for i in range(5):
        paths.append(tmp_path / f"{i}.jpg")
        paths[-1].write_bytes(bytes([i]) * (i + 1))
    frame = torch.zeros(4, 4, 3, dtype=torch.uint8)
    given = [Chunk([paths[0], paths[1]], 0), Chunk([paths[2]], 2), Chunk([paths[3]], 3), Chunk([frame], 4),
             Chunk([paths[4]], 5)]
    pulled = []

    def chunks():
        for chunk in given:
            pulled.append(chunk.first)
            yield chunk

    with ThreadPoolExecutor(1) as reader:
        out = read_ahead(chunks(), reader, "rgb", depth=2)
        first = next(out)
        assert first.first == 0 and pulled == [0, 2, 3]  # two chunks of files read ahead of the first
        assert [s.name for s in first.items] == [str(paths[0]), str(paths[1])]
        assert [bytes(s.encoded.numpy()) for s in first.items] == [b"\x00", b"\x01\x01"]
        rest = [next(out) for _ in range(3)]
        assert [c.first for c in rest] == [2, 3, 4]
        assert pulled == [0, 2, 3, 4]  # the live frame is passed on without pulling the chunk after it
        assert rest[2].items[0] is frame
        last = next(out)
        assert last.first == 5 and bytes(last.items[0].encoded.numpy()) == b"\x04" * 5
        assert next(out, None) is None


@pytest.mark.parametrize("overlap", [True, False])
def test_files_and_a_missing_one_give_the_same_results_read_ahead_or_not(preprocessed_plan, tmp_path, overlap):
    engine = sartor.load(preprocessed_plan, device="cpu")
    paths = []
    for i, pixels in enumerate(photos(5)):  # JPEG bytes
        paths.append(tmp_path / f"{i}.jpg")
        paths[-1].write_bytes(pixels)
    items = paths[:2] + [tmp_path / "missing.jpg"] + paths[2:]
    results = Pipeline(engine, batch_size=2, overlap=overlap, skip_bad=True).run(items)
    assert [r.name for r in results] == [str(p) for p in items]
    assert results[2].error == f"image {tmp_path / 'missing.jpg'} cannot be read: No such file or directory"
    good = [r for r in results if r.error is None]
    inline = Pipeline(engine, batch_size=1, overlap=False).run(paths)
    np.testing.assert_allclose(np.stack([r.outputs["logits"] for r in good]),
                               np.stack([r.outputs["logits"] for r in inline]), rtol=1e-5, atol=1e-5)
