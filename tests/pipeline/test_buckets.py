"""Resolution buckets (issue 30 part 5, docs/decisions/0037-resolution-buckets.md): the routing rule
and its refusal, engines built with `--preprocess letterbox=32|48|64` on the CPU whose every bucket
gives what a single-size engine of that size gives, mixed-size batches back in input order, old
single-size engines unchanged, and the errors a user can reach through the CLI."""
from __future__ import annotations

import io
import json
from importlib.util import find_spec

import numpy as np
import onnx
import pytest
import torch
from conftest import assert_cli_error, make_model, save
from onnx import TensorProto, helper, numpy_helper
from PIL import Image

import sartor
from sartor.data.buckets import BucketRefused, Buckets, buckets_from_header, downscale, parse_buckets
from sartor.data.preprocess import parse_preprocess
from sartor.errors import ConfigError, DataError, ProfileError
from sartor.pipeline import Pipeline, YoloNms

SPEC = "mean=0,std=255,rgb,nchw"
SIZES = (32, 48, 64)
SHAPES = {"min_shapes": {"images": (1, 3, 64, 64)}, "opt_shapes": {"images": (2, 3, 64, 64)},
          "max_shapes": {"images": (4, 3, 64, 64)}}
CLASSES = 2
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


# ---- the routing rule -----------------------------------------------------------------------------

def test_a_frame_goes_to_the_smallest_bucket_that_holds_it_whole():
    buckets = parse_buckets(f"letterbox=640|320|480,{SPEC}")
    assert [s.size for s in buckets.specs] == [(320, 320), (480, 480), (640, 640)]  # smallest first
    assert buckets.max_downscale == 1.0  # several sizes: never shrunk unless the policy says so
    for (h, w), size in [((200, 300), 320), ((320, 320), 320), ((100, 321), 480), ((480, 480), 480),
                         ((481, 10), 640), ((480, 640), 640), ((640, 640), 640), ((12, 8), 320)]:
        assert buckets.specs[buckets.route(h, w)].height == size, (h, w)
    assert downscale(buckets.specs[0], 640, 640) == 2.0 and downscale(buckets.specs[2], 720, 1280) == 2.0


def test_a_frame_larger_than_every_bucket_is_refused_in_one_line_unless_the_policy_allows_it():
    buckets = parse_buckets(f"letterbox=320|480|640,{SPEC}")
    with pytest.raises(BucketRefused) as refused:
        buckets.route(720, 1280)
    line = str(refused.value)
    assert "\n" not in line and "720x1280" in line and "640x640" in line and "2x" in line
    assert "max_downscale=2" in line and "--max-downscale 2" in line and "refused, not shrunk" in line
    assert isinstance(refused.value, DataError)
    two = buckets.with_max_downscale(2.0)  # the override: a 720p camera frame letterboxed into 640
    assert two.specs[two.route(720, 1280)].height == 640 and two.route(200, 200) == 0  # small frames stay small
    with pytest.raises(BucketRefused, match="1080x1920 frame .* 3x, over max_downscale 2"):
        two.route(1080, 1920)
    anything = parse_buckets(f"letterbox=320|480|640,{SPEC},max_downscale=any")
    assert anything.max_downscale is None and anything.specs[anything.route(4000, 6000)].height == 640
    assert anything.route(300, 300) == 0  # any shrink is allowed above the largest, not a smaller bucket


def test_one_size_keeps_letterboxing_any_frame_unless_given_a_policy():
    one = parse_buckets(f"letterbox=320,{SPEC}")
    assert len(one) == 1 and one.max_downscale is None and one.route(1080, 1920) == 0  # as before buckets
    strict = parse_buckets(f"letterbox=320,{SPEC},max_downscale=1")  # the "320-only engine"
    with pytest.raises(BucketRefused, match="a 640x640 frame fits no bucket .*320x320 would shrink it 2x"):
        strict.route(640, 640)
    assert strict.route(320, 240) == 0


def test_non_square_and_stretching_buckets():
    wide = parse_buckets(f"letterbox=384x640|640,{SPEC},max_downscale=2")
    assert [s.size for s in wide.specs] == [(384, 640), (640, 640)]
    assert wide.specs[wide.route(360, 640)].size == (384, 640)
    assert wide.specs[wide.route(480, 640)].size == (640, 640)
    assert wide.specs[wide.route(720, 1280)].size == (384, 640)  # both shrink it 2x: the smaller one
    stretch = parse_buckets(f"resize=32x32|64x64,{SPEC}")
    assert stretch.specs[stretch.route(20, 40)].size == (64, 64)


def test_the_bucket_text_round_trips_and_old_records_load_without_a_policy():
    for text in (f"letterbox=32|48|64,{SPEC}", f"letterbox=32|64,{SPEC},max_downscale=1.5",
                 f"letterbox=32|64,{SPEC},max_downscale=any", f"resize=32x32|48x64,{SPEC}", f"letterbox=32,{SPEC}"):
        buckets = parse_buckets(text)
        assert parse_buckets(buckets.describe()) == buckets, text
    assert parse_buckets(f"letterbox=32|48|64,{SPEC}").describe() == f"letterbox=32|48|64,{SPEC}"
    assert parse_preprocess(f"letterbox=32,{SPEC}").describe() == f"letterbox=32,{SPEC}"  # one size: text as before
    record = parse_preprocess(f"letterbox=32,{SPEC}").to_json()
    record.pop("max_downscale")  # an engine header from before buckets
    assert buckets_from_header({"preprocess": record}).max_downscale is None


@pytest.mark.parametrize("text,fragment", [
    (f"letterbox=32|32,{SPEC}", "names the size 32x32 twice"),
    (f"letterbox=32|32x32,{SPEC}", "twice"),
    (f"resize=256|320,crop=224,{SPEC}", "not with crop"),
    (f"letterbox=32|,{SPEC}", "has an empty size"),
    (f"letterbox=32|64,{SPEC},max_downscale=0.5", "max_downscale '0.5' must be a number ≥ 1"),
    (f"letterbox=32|64,{SPEC},max_downscale=wide", "must be a number ≥ 1"),
])
def test_malformed_bucket_specs_are_one_line_errors(text, fragment):
    with pytest.raises(ConfigError, match=fragment):
        parse_buckets(text)


def test_a_spec_of_several_sizes_is_refused_where_one_is_expected():
    with pytest.raises(ConfigError, match="names several sizes"):
        parse_preprocess(f"letterbox=32|64,{SPEC}")


# ---- engines built with buckets --------------------------------------------------------------------

def detector_model(seed: int = 0) -> onnx.ModelProto:
    """A tiny YOLO-format detector of any input size: a stride-2 conv, a box branch in pixels and
    a sigmoid score branch, reshaped to [B, 4+C, H/2·W/2]."""
    rng = np.random.default_rng(seed)

    def w(name, *shape, scale=1.0):
        data = rng.standard_normal(shape) / np.sqrt(np.prod(shape[1:])) * scale
        return numpy_helper.from_array(data.astype(np.float32), name)
    inits = [w("c1.w", 8, 3, 3, 3, scale=3), w("box.w", 4, 8, 1, 1), w("cls.w", CLASSES, 8, 1, 1, scale=2),
             numpy_helper.from_array(np.array(12, np.float32), "px"),
             numpy_helper.from_array(np.array([0, 4 + CLASSES, -1], np.int64), "head_shape")]
    nodes = [helper.make_node("Conv", ["images", "c1.w"], ["c1"], name="c1", pads=[1, 1, 1, 1], strides=[2, 2]),
             helper.make_node("Relu", ["c1"], ["r1"], name="r1"),
             helper.make_node("Conv", ["r1", "box.w"], ["b"], name="box"),
             helper.make_node("Relu", ["b"], ["br"], name="box_relu"),
             helper.make_node("Mul", ["br", "px"], ["boxes"], name="to_pixels"),
             helper.make_node("Conv", ["r1", "cls.w"], ["s"], name="cls"),
             helper.make_node("Sigmoid", ["s"], ["scores"], name="sigmoid"),
             helper.make_node("Concat", ["boxes", "scores"], ["head"], name="concat", axis=1),
             helper.make_node("Reshape", ["head", "head_shape"], ["output0"], name="reshape")]
    model = make_model(nodes, [helper.make_tensor_value_info("images", TensorProto.FLOAT, ["batch", 3, "h", "w"])],
                       [helper.make_tensor_value_info("output0", TensorProto.FLOAT, ["batch", 4 + CLASSES, "anchors"])],
                       inits, name="bucket_detector")
    onnx.checker.check_model(model)
    return model


@pytest.fixture(scope="module", params=DEVICES)
def plans(request, tmp_path_factory) -> dict:
    """The detector with buckets 32|48|64, and one engine of each size alone (no policy: as before),
    built for each device here."""
    device = request.param
    folder = tmp_path_factory.mktemp(f"buckets_{device}")
    onnx_path = save(detector_model(), folder / "det.onnx")
    built = {"onnx": onnx_path, "buckets": folder / "buckets.plan", "device": device}
    sartor.build(onnx_path, built["buckets"], device=device, builder_effort=0,
                 preprocess=f"letterbox={'|'.join(map(str, SIZES))},{SPEC}", **SHAPES)
    for size in SIZES:
        built[size] = folder / f"single{size}.plan"
        sartor.build(onnx_path, built[size], device=device, builder_effort=0, preprocess=f"letterbox={size},{SPEC}",
                     **{k: {"images": (v["images"][0], 3, size, size)} for k, v in SHAPES.items()})
    return built


def load(plans: dict, key="buckets"):
    return sartor.load(plans[key], device=plans["device"])


def frames(sizes, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, (h, w, 3), dtype=np.uint8) for h, w in sizes]


# Interleaved sizes, each bucket's frames apart: 32 ← (20, 30), (32, 32), (12, 31); 48 ← (40, 40),
# (48, 10), (33, 20); 64 ← (64, 64), (30, 60), (64, 48), (49, 5).
MIXED = [(20, 30), (64, 64), (40, 40), (48, 10), (30, 60), (32, 32), (64, 48), (33, 20), (12, 31), (49, 5)]
BUCKET_OF = [32, 64, 48, 48, 64, 32, 64, 48, 32, 64]


def test_the_engine_holds_a_profile_per_bucket_and_records_each_spec(plans):
    engine = load(plans)
    assert [p.shapes["images"].opt for p in engine.profiles] == [(2, 3, s, s) for s in SIZES]
    assert [p.shapes["images"].min[0] for p in engine.profiles] == [1, 1, 1]
    assert engine.buckets.describe() == f"letterbox=32|48|64,{SPEC}" and engine.buckets.max_downscale == 1.0
    assert engine.preprocess.size == (64, 64)  # the single-spec field: the largest bucket's
    assert len(engine.header["preprocess_buckets"]) == 3
    assert any(line.startswith("buckets: letterbox=32|48|64") for line in engine.header["build_log"])
    single = load(plans, 32)
    assert "preprocess_buckets" not in single.header and single.buckets.max_downscale is None


@pytest.mark.parametrize("batch,overlap", [(1, True), (4, True), (4, False)])
def test_each_bucket_detects_what_a_single_size_engine_of_that_size_does_in_input_order(plans, batch, overlap):
    """Frame by frame on the CPU the outputs are equal bit for bit; in batches of 4 the buckets'
    sub-batches (1 to 3 frames) differ from the single engines' batches, and torch's convolutions
    round the last bit differently by batch size."""
    engine = load(plans)
    items = frames(MIXED)
    results = Pipeline(engine, decoder=YoloNms(conf=0.3), batch_size=batch, overlap=overlap).run(items)
    assert [r.name for r in results] == [f"item {i}" for i in range(len(items))]
    assert [r.meta.input_size for r in results] == [(s, s) for s in BUCKET_OF]
    exact = batch == 1 and plans["device"] == "cpu"  # on CUDA cuDNN times its algorithms per context
    same = np.array_equal if exact else (lambda a, b: np.allclose(a, b, rtol=1e-4, atol=1e-4))
    for size in SIZES:
        mine = [i for i, s in enumerate(BUCKET_OF) if s == size]
        alone = Pipeline(load(plans, size), decoder=YoloNms(conf=0.3),
                         batch_size=batch).run([items[i] for i in mine])
        for i, expected in zip(mine, alone):
            got = results[i]
            assert (got.meta.orig_size, got.meta.scale, got.meta.pad, got.meta.input_size) == \
                (expected.meta.orig_size, expected.meta.scale, expected.meta.pad, expected.meta.input_size)
            assert same(got.outputs["output0"], expected.outputs["output0"])
            assert len(got.detections) == len(expected.detections) > 0
            assert same(got.detections.boxes, expected.detections.boxes)
            assert same(got.detections.scores, expected.detections.scores)
            assert np.array_equal(got.detections.classes, expected.detections.classes)


def test_encoded_images_route_before_decoding_and_device_outputs_decode_per_bucket(plans, tmp_path):
    engine = load(plans)
    paths = []
    for k, pixels in enumerate(frames([(40, 40), (20, 64), (64, 20)], seed=3)):
        paths.append(tmp_path / f"{k}.png")
        Image.fromarray(pixels).save(paths[-1])
    exact = Pipeline(engine, decoder=YoloNms(conf=0.3), fast_decode=False, host_outputs=False).run(paths)
    assert [r.meta.input_size for r in exact] == [(48, 48), (64, 64), (64, 64)]
    alone = Pipeline(load(plans, 64), decoder=YoloNms(conf=0.3), fast_decode=False).run(paths[1:])
    for got, expected in zip(exact[1:], alone):
        assert np.array_equal(got.detections.boxes, expected.detections.boxes) and got.outputs == {}


def test_a_frame_no_bucket_takes_fails_alone_or_stops_the_batch_in_one_line(plans):
    engine = load(plans)
    items = frames([(20, 20), (100, 50), (64, 64)])
    results = Pipeline(engine, skip_bad=True).run(items)
    assert results[1].error.startswith("item 1: a 100x50 frame fits no bucket (letterbox 32x32, 48x48, 64x64)")
    assert results[0].error is None and results[2].error is None and results[2].meta.input_size == (64, 64)
    with pytest.raises(DataError, match="item 1: a 100x50 frame fits no bucket") as raised:
        Pipeline(engine).run(items)
    assert "\n" not in str(raised.value)
    allowed = Pipeline(engine, max_downscale=2).run(items)  # the run-time override
    assert allowed[1].meta.input_size == (64, 64) and allowed[1].meta.scale == (0.64, 0.64)
    assert Pipeline(engine, max_downscale="any").run(items)[1].error is None
    with pytest.raises(ConfigError, match="max_downscale '0.9' must be a number ≥ 1"):
        Pipeline(engine, max_downscale=0.9)


def test_one_profile_or_one_spec_narrows_the_pipeline_to_one_bucket(plans):
    engine = load(plans)
    pinned = Pipeline(engine, profile=1)
    assert len(pinned.buckets) == 1 and pinned.spec.size == (48, 48)
    assert pinned.run(frames([(20, 20)]))[0].meta.input_size == (48, 48)
    with pytest.raises(DataError, match="a 64x64 frame fits no bucket \\(letterbox 48x48\\)"):
        pinned.run(frames([(64, 64)]))
    one = Pipeline(engine, preprocess=parse_preprocess(f"letterbox=32,{SPEC}"))  # no policy: letterboxes anything
    assert one.run(frames([(64, 64)]))[0].meta.input_size == (32, 32)
    with pytest.raises(ConfigError, match="batch size 5 is outside 1..4"):
        Pipeline(engine, batch_size=5)


def test_the_gate_still_refuses_a_tensor_of_a_size_between_buckets(plans):
    engine = load(plans)
    context = engine.context()
    assert context.run({"images": np.zeros((1, 3, 48, 48), np.float32)})["output0"].shape == (1, 6, 576)
    with pytest.raises(ProfileError, match="images 1x3x40x40 outside the allowed ranges"):
        context.run({"images": np.zeros((1, 3, 40, 40), np.float32)})


def test_one_profile_per_size_as_given(plans, tmp_path):
    out = tmp_path / "per_size.plan"
    profiles = [{"min": {"images": (1, 3, 32, 32)}, "opt": {"images": (4, 3, 32, 32)}, "max": {"images": (8, 3, 32, 32)}},
                {"min": {"images": (1, 3, 64, 64)}, "max": {"images": (2, 3, 64, 64)}}]
    sartor.build(plans["onnx"], out, device=plans["device"], builder_effort=0, preprocess=f"letterbox=64|32,{SPEC}",
                 profiles=profiles)
    engine = sartor.load(out, device=plans["device"])
    assert [p.shapes["images"].max for p in engine.profiles] == [(8, 3, 32, 32), (2, 3, 64, 64)]
    pipeline = Pipeline(engine)
    assert pipeline.batch_size == 2  # what every bucket admits
    results = pipeline.run(frames([(10, 10), (60, 60), (20, 20)]))
    assert [r.meta.input_size for r in results] == [(32, 32), (64, 64), (32, 32)]


def test_old_single_size_engines_are_unchanged(letterbox_plan):
    engine = sartor.load(letterbox_plan, device="cpu")
    assert "preprocess_buckets" not in engine.header and "max_downscale" not in engine.preprocess.describe()
    assert len(engine.buckets) == 1 and engine.buckets.max_downscale is None
    pipeline = Pipeline(engine)
    big = pipeline.run(frames([(640, 480)]))[0]  # shrunk 40x into the 16x16 input, as before buckets
    assert big.error is None and big.meta.input_size == (16, 16) and big.outputs["logits"].shape == (10,)
    assert pipeline.batch_size == 4 and pipeline.profile == 0


# ---- the CLI ----------------------------------------------------------------------------------------

def _build(cli, model, out, preprocess, *extra):
    return cli("build", model, "-o", out, "--device", "cpu", "--builder-effort", "0", "--preprocess", preprocess,
               *extra)


@pytest.mark.parametrize("preprocess,extra,fragments", [
    (f"letterbox=32|32,{SPEC}", ("--max-shapes", "images:2x3x32x32"), ("names the size 32x32 twice",)),
    (f"letterbox=32|64,{SPEC},max_downscale=0.5", ("--max-shapes", "images:2x3x64x64"), ("must be a number ≥ 1",)),
    (f"letterbox=32|64,{SPEC}", ("--max-shapes", "images:2x3x40x40"),
     ("--max-shapes images:2x3x40x40", "not one of the buckets", "32x32, 64x64")),
    (f"letterbox=32|48|64,{SPEC}", ("--max-shapes", "images:2x3x32x32", "--profile", "--max-shapes",
                                    "images:2x3x64x64"), ("name the sizes 32x32, 64x64 but not 48x48",)),
    (f"letterbox=32|64,{SPEC}", ("--min-shapes", "images:1x3x32x32", "--max-shapes", "images:2x3x64x64"),
     ("profile 0 ranges over 32x32, 64x64",)),
    (f"letterbox=32|64,{SPEC}", ("--max-shapes", "images:2x3x64x64", "--input-format", "uint8:64x64"),
     ("takes frames of one size", "build one engine per frame size")),
    (f"letterbox=32,{SPEC},max_downscale=1", ("--max-shapes", "images:2x3x32x32", "--input-format", "uint8:64x64"),
     ("--input-format uint8:64x64", "a 64x64 frame fits no bucket")),
    (f"letterbox=32|64,{SPEC}", ("--max-shapes", "images:batchx3x64x64"), ("must look like NAME:1x3x224x224",)),
])
def test_build_errors_are_one_line(cli, plans, tmp_path, preprocess, extra, fragments):
    out = tmp_path / "bad.plan"
    assert_cli_error(_build(cli, plans["onnx"], out, preprocess, *extra), *fragments)
    assert not out.exists()


def test_a_model_of_one_input_size_cannot_hold_other_buckets(cli, tmp_path):
    out = tmp_path / "fixed.plan"
    model = save(make_model([helper.make_node("Relu", ["images"], ["out"], name="relu")],
                            [helper.make_tensor_value_info("images", TensorProto.FLOAT, [1, 3, 32, 32])],
                            [helper.make_tensor_value_info("out", TensorProto.FLOAT, [1, 3, 32, 32])]), tmp_path / "f.onnx")
    assert_cli_error(_build(cli, model, out, f"letterbox=32|64,{SPEC}"), "1x3x64x64", "does not fit the model's declared")


def test_build_summary_inspect_and_rebuild_command_name_the_buckets(cli, plans):
    from sartor.runtime.engine import rebuild_command
    engine = load(plans)
    assert "'letterbox=32|48|64,mean=0,std=255,rgb,nchw'" in rebuild_command(engine.header)
    shown = cli("inspect", plans["buckets"])
    assert shown.code == 0 and "letterbox=32|48|64" in shown.out and "never shrink" in shown.out


def _images(folder, sizes, seed=0):
    folder.mkdir()
    for k, pixels in enumerate(frames(sizes, seed)):
        Image.fromarray(pixels).save(folder / f"{k:02d}.png")
    return folder


def test_validate_routes_each_image_and_the_reference_alike(cli, plans, tmp_path):
    # The GPU machine has no build extra; CI installs it, where this runs on the CPU.
    if not (find_spec("pycocotools") or find_spec("faster_coco_eval")):
        pytest.skip("COCO mAP needs the build extra's pycocotools (or faster_coco_eval)")
    data = _images(tmp_path / "images", MIXED)
    result = cli("validate", plans["buckets"], "--data", data, "--json", "--conf", "0.3", "--pseudo-conf", "0.3")
    assert result.code == 0, result
    report = json.loads(result.out)
    assert report["preprocess"] == f"letterbox=32|48|64,{SPEC}" and abs(report["overall"]["drop"]) < 1e-3
    assert any("images per bucket: 32x32 3, 48x48 3, 64x64 4" in note for note in report["notes"])
    Image.fromarray(frames([(100, 50)])[0]).save(data / "99.png")
    assert_cli_error(cli("validate", plans["buckets"], "--data", data), "99.png", "a 100x50 frame fits no bucket",
                     "--max-downscale 1.57")
    allowed = cli("validate", plans["buckets"], "--data", data, "--json", "--max-downscale", "2", "--conf", "0.3",
                  "--pseudo-conf", "0.3")
    assert allowed.code == 0 and "64x64 5" in " ".join(json.loads(allowed.out)["notes"])
    assert_cli_error(cli("validate", plans["buckets"], "--data", data, "--max-downscale", "wide"),
                     "max_downscale 'wide' must be a number")
    assert_cli_error(cli("validate", plans["buckets"], "--data", data, "--preprocess", f"letterbox=32|64,{SPEC}"),
                     "names several sizes")


def test_bench_end_to_end_counts_the_buckets(cli, plans, tmp_path):
    data = _images(tmp_path / "images", MIXED)
    result = cli("bench", plans["buckets"], "--end-to-end", "--images", data, "--passes", "2", "--json",
                 "--decoder", "none")
    assert result.code == 0, result
    report = json.loads(result.out)
    assert report["buckets"] == {"32x32": 3, "48x48": 3, "64x64": 4} and report["stage_bucket"] == "64x64"
    assert_cli_error(cli("bench", plans["buckets"], "--max-downscale", "2"), "--max-downscale goes with --end-to-end")


def test_serve_image_route_runs_the_bucket_and_refuses_with_400(plans):
    from types import SimpleNamespace

    pytest.importorskip("tritonclient", reason="sartor serve needs the serve extra (CI installs it)")

    from sartor.serve.errors import InvalidRequest
    from sartor.serve.image import prepare, respond
    engine = load(plans)
    model = SimpleNamespace(name="det", version="1", engine=engine, preprocess=engine.preprocess, buckets=engine.buckets)

    def png(h, w):
        buffer = io.BytesIO()
        Image.fromarray(frames([(h, w)])[0]).save(buffer, format="PNG")
        return buffer.getvalue()
    inputs, meta, options = prepare(model, png(40, 40), {})
    assert inputs["images"].shape == (1, 3, 48, 48) and meta.input_size == (48, 48)
    reply = respond(model, engine.context().run(inputs), meta, options)
    assert reply["preprocess"] == f"letterbox=48,{SPEC},max_downscale=1"
    with pytest.raises(InvalidRequest, match="a 100x50 frame fits no bucket") as refused:
        prepare(model, png(100, 50), {})
    assert refused.value.http_status == 400
    model.buckets = engine.buckets.with_max_downscale(2.0)  # config.pbtxt's max_downscale parameter
    assert prepare(model, png(100, 50), {})[0]["images"].shape == (1, 3, 64, 64)


def test_python_build_accepts_buckets(plans, tmp_path):
    out = tmp_path / "from_buckets.plan"
    sartor.build(plans["onnx"], out, device=plans["device"], builder_effort=0,
                 preprocess=Buckets((parse_preprocess(f"letterbox=48,{SPEC}"), parse_preprocess(f"letterbox=32,{SPEC}"))),
                 max_shapes={"images": (2, 3, 48, 48)})
    engine = sartor.load(out, device=plans["device"])
    assert engine.buckets.describe() == f"letterbox=32|48,{SPEC},max_downscale=any"
    assert Pipeline(engine).run(frames([(100, 100)]))[0].meta.input_size == (48, 48)


def test_served_model_routes_by_size_under_config_pbtxt_policy(plans, tmp_path):
    """Through a running server: a small image runs at its bucket, a large one is refused with 400
    and the line, until config.pbtxt's max_downscale parameter allows it."""
    import http.client

    from serve_helpers import HOST, add_model, running

    def post(server, model, h, w):
        buffer = io.BytesIO()
        Image.fromarray(frames([(h, w)])[0]).save(buffer, format="PNG")
        conn = http.client.HTTPConnection(HOST, server.http_port, timeout=20)
        try:
            conn.request("POST", f"/v2/models/{model}/infer_image?conf=0.3", body=buffer.getvalue(),
                         headers={"Content-Type": "image/png"})
            response = conn.getresponse()
            return response.status, json.loads(response.read())
        finally:
            conn.close()
    root = tmp_path / "repo"
    add_model(root, "strict", plans["buckets"], "max_batch_size: 4\ndynamic_batching { }\n")
    add_model(root, "loose", plans["buckets"], 'max_batch_size: 4\nparameters { key: "max_downscale" value { '
                                               'string_value: "2" } }\n')
    with running(root) as server:
        status, small = post(server, "strict", 40, 40)
        assert status == 200 and small["preprocess"] == f"letterbox=48,{SPEC},max_downscale=1"
        assert small["decoder"] == "yolo" and small["detections"]
        status, refused = post(server, "strict", 100, 50)
        assert status == 400 and "a 100x50 frame fits no bucket" in refused["error"]
        status, allowed = post(server, "loose", 100, 50)
        assert status == 200 and allowed["image"] == {"width": 50, "height": 100}


def test_config_pbtxt_max_downscale_is_checked(tmp_path, tiny_engine):
    from sartor.serve.config import complete_config, read_config
    (tmp_path / "config.pbtxt").write_text('parameters { key: "max_downscale" value { string_value: "any" } }\n')
    _, settings = complete_config(*read_config(tmp_path), "tiny", tiny_engine, None, "tiny")
    assert settings.max_downscale == "any"
    (tmp_path / "config.pbtxt").write_text('parameters { key: "max_downscale" value { string_value: "0.5" } }\n')
    with pytest.raises(ConfigError, match="tiny: parameter max_downscale '0.5' must be a number ≥ 1"):
        complete_config(*read_config(tmp_path), "tiny", tiny_engine, None, "tiny")
