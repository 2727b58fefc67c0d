"""Engines that take raw uint8 frames (`--input-format uint8:HxW`): the engine preprocesses inside
itself and equals the float-input engine fed `prepare_batch`'s output; the pipeline feeds it decoded
frames (a frame of another size fails alone); the gate refuses other frame sizes in one line. An
INT8 one's preprocessing writes its stem's codes and computes what it computed writing floats
(passes/quantize_in_preprocess.py)."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import IMAGE

import sartor
from sartor.builder import pipeline as builder_pipeline
from sartor.builder.config import BuildConfig
from sartor.builder.pipeline import build
from sartor.data.frame_format import FrameFormat
from sartor.data.preprocess import parse_preprocess
from sartor.errors import ConfigError, DataError, InputError
from sartor.pipeline import Pipeline, prepare_batch
from sartor.runtime.engine import rebuild_command

FRAME = (37, 53)  # odd, wider than tall: letterboxed into IMAGE × IMAGE with pad bands
SPEC = f"letterbox={IMAGE},mean=0:1:2,std=255:128:64,bgr,nchw"
PROFILE = [{"min": {"images": (1, 3, IMAGE, IMAGE)}, "opt": {"images": (2, 3, IMAGE, IMAGE)},
            "max": {"images": (4, 3, IMAGE, IMAGE)}}]


@pytest.fixture(scope="module")
def engines(tiny_onnx, tmp_path_factory):
    """(the float-input engine, the raw-frames engine) of the tiny classifier, on the CPU."""
    folder = tmp_path_factory.mktemp("frames")
    common = {"device": "cpu", "profiles": PROFILE, "preprocess": SPEC}
    build(BuildConfig(str(tiny_onnx), str(folder / "float.plan"), **common))
    build(BuildConfig(str(tiny_onnx), str(folder / "frames.plan"), input_format="uint8:37x53", **common))
    return sartor.load(folder / "float.plan", device="cpu"), sartor.load(folder / "frames.plan", device="cpu")


def camera_frames(count: int, size=FRAME, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (count, *size, 3), dtype=np.uint8)


def test_the_engine_declares_frames_and_records_how_it_preprocesses(engines):
    _, frames_engine = engines
    (declared,) = frames_engine.inputs
    assert (declared.name, declared.dtype, tuple(declared.shape[1:])) == ("frames", "uint8", (*FRAME, 3))
    assert frames_engine.input_format == FrameFormat(FRAME, "rgb", "frames")
    assert frames_engine.preprocess.describe() == SPEC
    assert frames_engine.header["input_format"]["text"] == "uint8:37x53"
    assert frames_engine.profiles[0].describe() == "frames 1x37x53x3..4x37x53x3 (opt 2x37x53x3)"
    assert frames_engine.layers[0]["op"] == "Preprocess"
    assert "--input-format uint8:37x53" in rebuild_command(frames_engine.header)


@pytest.mark.parametrize("batch", [1, 3])
def test_frames_in_equal_the_float_engine_fed_prepare_batch(engines, batch):
    float_engine, frames_engine = engines
    frames = torch.from_numpy(camera_frames(batch, seed=batch))
    prepared, _ = prepare_batch(list(frames.permute(0, 3, 1, 2)), [str(i) for i in range(batch)],
                                float_engine.preprocess)
    expected = float_engine.context().run({"images": prepared})["logits"]
    ours = frames_engine.context().run({"frames": frames})["logits"]
    # The same torch ops on the same CPU: equal. (On CUDA the kernel's pixels are Pillow's, the
    # float path's within a level: tests/kernels/test_kernels_preprocess.py.)
    assert torch.allclose(ours, expected, rtol=0, atol=1e-5), (ours - expected).abs().max()


def test_the_gate_refuses_frames_of_another_size_in_one_line(engines):
    _, frames_engine = engines
    with pytest.raises(InputError) as caught:
        frames_engine.context().run({"frames": camera_frames(2, size=(36, 53))})
    message = str(caught.value)
    assert "\n" not in message and "36x53 frames" in message and "37x53x3" in message
    with pytest.raises(InputError, match="dtype float32"):
        frames_engine.context().run({"frames": camera_frames(2).astype(np.float32)})


def test_the_pipeline_feeds_decoded_frames_and_maps_boxes_back(engines):
    float_engine, frames_engine = engines
    items = list(camera_frames(5, seed=9))
    ours = Pipeline(frames_engine, batch_size=2).run(items)
    expected = Pipeline(float_engine, batch_size=2).run(items)
    for a, b in zip(ours, expected):
        assert a.error is None and a.meta == b.meta
        np.testing.assert_allclose(a.outputs["logits"], b.outputs["logits"], rtol=0, atol=1e-5)
    assert ours[0].meta.pad != (0, 0)  # letterboxed: the metadata maps boxes back through the bands


@pytest.mark.parametrize("file_format", ["PNG", "JPEG"])
def test_image_files_are_decoded_at_their_own_size_for_the_engine_to_resize(engines, file_format):
    """Files go to a raw-frames engine as decoded, full size: the engine letterboxes them itself
    (decoding them resized for the letterbox, as a float engine's files are, would make frames
    of another size, and every one would fail)."""
    import io

    from PIL import Image
    _, frames_engine = engines
    frames = camera_frames(2, seed=5)
    files = []
    for frame in frames:
        buffer = io.BytesIO()
        Image.fromarray(frame).save(buffer, format=file_format)
        files.append(buffer.getvalue())
    decoded = [np.asarray(Image.open(io.BytesIO(data)).convert("RGB")) for data in files]
    ours = Pipeline(frames_engine, batch_size=2).run(files)
    expected = Pipeline(frames_engine, batch_size=2).run(decoded)
    for a, b in zip(ours, expected):
        assert a.error is None, a.error
        np.testing.assert_allclose(a.outputs["logits"], b.outputs["logits"], rtol=0, atol=1e-6)


def test_a_frame_of_another_size_fails_alone(engines):
    _, frames_engine = engines
    items = [camera_frames(1)[0], camera_frames(1, size=(40, 40))[0], camera_frames(1, seed=3)[0]]
    results = Pipeline(frames_engine, skip_bad=True).run(items)
    assert [r.error is None for r in results] == [True, False, True]
    assert "40x40 frame" in results[1].error and "37x53" in results[1].error
    with pytest.raises(DataError, match="40x40 frame"):
        Pipeline(frames_engine).run(items)


def test_another_preprocess_cannot_apply_to_an_engine_that_preprocesses_itself(engines):
    _, frames_engine = engines
    with pytest.raises(ConfigError, match="preprocesses its frames itself"):
        Pipeline(frames_engine, preprocess=parse_preprocess(f"resize={IMAGE}x{IMAGE}"))


@pytest.mark.parametrize("input_format,preprocess,fragment", [
    ("uint8:37x53", None, "needs --preprocess"),
    ("uint8:37x53", "none,mean=0,std=255", "needs --preprocess with letterbox= or resize="),
    ("uint8:37", SPEC, "HxW"),
    ("float16:37x53", SPEC, "expected uint8:HxW"),
    ("uint8:37x53:yuv", SPEC, "channel order 'yuv'"),
])
def test_bad_input_formats_are_refused_before_building(tiny_onnx, tmp_path, input_format, preprocess, fragment):
    config = BuildConfig(str(tiny_onnx), str(tmp_path / "x.plan"), device="cpu", profiles=PROFILE,
                         preprocess=preprocess, input_format=input_format)
    with pytest.raises(ConfigError, match=fragment.replace("(", r"\(")):
        build(config)
    assert not (tmp_path / "x.plan").exists()


def test_validate_refuses_an_engine_of_raw_frames_in_one_line(engines, tmp_path):
    from sartor.validate.runner import validate
    _, frames_engine = engines
    with pytest.raises(ConfigError, match="takes raw 37x53 frames") as caught:
        validate(frames_engine, str(tmp_path))
    assert "\n" not in str(caught.value)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_on_cuda_the_engine_preprocesses_inside_its_graph_as_prepare_batch_does(tiny_onnx, tmp_path):
    common = {"device": "cuda", "profiles": PROFILE, "preprocess": SPEC}
    build(BuildConfig(str(tiny_onnx), str(tmp_path / "float.plan"), **common))
    build(BuildConfig(str(tiny_onnx), str(tmp_path / "frames.plan"), input_format="uint8:37x53", **common))
    float_engine, frames_engine = (sartor.load(tmp_path / name) for name in ("float.plan", "frames.plan"))
    assert frames_engine.layers[0]["op"] == "Preprocess" and frames_engine.header["tactics"]["timed"] >= 1
    frames = torch.from_numpy(camera_frames(4, seed=11)).cuda()
    prepared, _ = prepare_batch(list(frames.permute(0, 3, 1, 2)), list("abcd"), float_engine.preprocess)
    expected = float_engine.context().run({"images": prepared})["logits"].float()
    context = frames_engine.context()
    for _ in range(4):  # two eager runs, the capture, then a replay of the CUDA graph
        ours = context.run({"frames": frames})["logits"].float()
        # The layer's tactic is the kernel (Pillow's pixels, as prepare_batch's) or the float torch
        # path (within a level of them): the logits agree to a level's effect.
        assert torch.nn.functional.cosine_similarity(ours, expected, dim=1).min() > 0.9999


def calibration_images(folder, frame_size=FRAME, spec: str = SPEC) -> str:
    """Calibration samples as the model takes them: camera frames through `spec`."""
    frames = torch.from_numpy(camera_frames(24, size=frame_size, seed=21)).permute(0, 3, 1, 2)
    images, _ = prepare_batch(list(frames), [str(i) for i in range(len(frames))], parse_preprocess(spec))
    path = folder / "calib.npy"
    np.save(path, images.numpy())
    return str(path)


def int8_frame_engines(onnx, folder, device: str, frame_size=FRAME, spec: str = SPEC, **options) -> tuple:
    """(the build result and engine of INT8 raw frames whose preprocessing writes the stem's codes,
    the engine built the same without passes/quantize_in_preprocess.py: its preprocessing writes
    floats the stem quantizes). One calibration (cached) for both."""
    def config(name: str) -> BuildConfig:
        return BuildConfig(str(onnx), str(folder / name), device=device, profiles=PROFILE, preprocess=spec,
                           input_format=f"uint8:{frame_size[0]}x{frame_size[1]}", precision="int8",
                           calib=calibration_images(folder, frame_size, spec), calib_cache=str(folder / "calib.cache"),
                           **options)
    result = build(config("codes.plan"))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(builder_pipeline, "quantize_in_preprocess", lambda graph: 0)
        build(config("floats.plan"))
    return result, sartor.load(folder / "codes.plan", device=device), sartor.load(folder / "floats.plan", device=device)


def assert_the_preprocessing_writes_the_stems_codes(result, codes_engine, floats_engine) -> None:
    preprocess, stem = codes_engine.layers[:2]
    assert preprocess["op"] == "Preprocess" and stem["op"] == "QConv" and stem["precision"] == "int8"
    assert preprocess["attrs"]["output_scale"] == stem["attrs"]["input_scale"]
    assert "writes the INT8 codes its readers take" in preprocess["reason"]
    assert any("quantize_in_preprocess" in line for line in result.log)
    assert "output_scale" not in floats_engine.layers[0]["attrs"]


@pytest.fixture(scope="module")
def int8_engines(tiny_onnx, tmp_path_factory):
    return int8_frame_engines(tiny_onnx, tmp_path_factory.mktemp("frames_int8"), "cpu")


def test_an_int8_engines_preprocessing_writes_its_stems_codes(int8_engines):
    assert_the_preprocessing_writes_the_stems_codes(*int8_engines)


@pytest.mark.parametrize("batch", [1, 3])
def test_int8_frames_engines_compute_the_same_with_codes_or_floats_between_their_first_layers(int8_engines, batch):
    _, codes_engine, floats_engine = int8_engines
    frames = torch.from_numpy(camera_frames(batch, seed=30 + batch))
    ours = codes_engine.context().run({"frames": frames})["logits"]
    expected = floats_engine.context().run({"frames": frames})["logits"]
    assert torch.equal(ours, expected), (ours - expected).abs().max()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_on_cuda_int8_frames_engines_compute_the_same_with_codes_or_floats(tiny_onnx, tmp_path):
    """Frames of the input's size: every preprocessing tactic makes the same pixels (no resampling),
    and the two builds share a timing cache, so each layer they share runs one tactic in both."""
    size, spec = (IMAGE, IMAGE), f"letterbox={IMAGE},mean=0:1:2,std=255:128:64,bgr,nchw"
    built = int8_frame_engines(tiny_onnx, tmp_path, "cuda", size, spec, timing_cache=str(tmp_path / "timing.json"))
    assert_the_preprocessing_writes_the_stems_codes(*built)
    _, codes_engine, floats_engine = built
    frames = torch.from_numpy(camera_frames(4, size=size, seed=12)).cuda()
    expected = floats_engine.context().run({"frames": frames})["logits"]
    context = codes_engine.context()
    for _ in range(4):  # two eager runs, the capture, then a replay of the CUDA graph
        ours = context.run({"frames": frames})["logits"]
        assert torch.equal(ours, expected), (ours.float() - expected.float()).abs().max()
