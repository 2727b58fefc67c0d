"""A Pipeline prepares its batches in the form the engine's copy would write them (decision 0068): an
INT8 stem's codes, channels-last float16 for an FP16 engine on CUDA. `staging_for` says which, from
the context's `staged_forms`; the run then copies the batch in as it is (`run(staged=True)`), and
the results are those of the float batch. On the CPU the preprocessing kernel runs through Triton's
interpreter where a test asks for it."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import IMAGE, MAX_SHAPES, MIN_SHAPES, OPT_SHAPES

import sartor
from sartor.data.preprocess import parse_preprocess
from sartor.kernels.preprocess.letterbox import InputCodes
from sartor.pipeline import Pipeline
from sartor.pipeline import prepare as prepare_module
from sartor.pipeline.prepare import staging_for
from sartor.runtime.executor import StagedForm

pytest.importorskip("triton")
SPEC = f"letterbox={IMAGE},mean=0,std=255,rgb,nchw"
CUDA = torch.device("cuda")


def camera_frames(count: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (count, 37, 53, 3), dtype=np.uint8)


def test_staging_follows_the_form_where_the_kernel_writes_it(monkeypatch):
    spec = parse_preprocess(SPEC)
    monkeypatch.setattr(prepare_module, "uses_kernel", lambda device, spec=None: device.type == "cuda")
    codes = staging_for(spec, StagedForm(torch.int8, codes=(41.5, -128)), CUDA)
    assert codes.codes == InputCodes(41.5, -128) and codes.spec == spec and not codes.channels_last
    half = staging_for(spec, StagedForm(torch.float16, channels_last=True), CUDA)
    assert half.codes is None and half.channels_last and half.spec == parse_preprocess(SPEC + ",dtype=float16")
    buffer = half.tensor(3, torch.device("cpu"))
    assert buffer.shape == (3, 3, IMAGE, IMAGE) and buffer.dtype == torch.float16
    assert buffer.is_contiguous(memory_format=torch.channels_last) and not buffer.is_contiguous()
    assert codes.tensor(2, torch.device("cpu")).dtype == torch.int8
    # Prepared as the spec says: no form, no kernel there, a dtype --preprocess has no name for,
    # channels-last asked of an NHWC spec, or images kept at their own size.
    assert staging_for(spec, None, CUDA) is None
    assert staging_for(spec, StagedForm(torch.int8, codes=(41.5, -128)), torch.device("cpu")) is None
    assert staging_for(spec, StagedForm(torch.bfloat16, channels_last=True), CUDA) is None
    assert staging_for(parse_preprocess(f"letterbox={IMAGE},mean=0,std=255,rgb,nhwc"),
                       StagedForm(torch.float16, channels_last=True), CUDA) is None
    assert staging_for(parse_preprocess("none,mean=0,std=255,rgb,nchw"), StagedForm(torch.int8, codes=(1.0, -127)),
                       CUDA) is None


@pytest.fixture(scope="module")
def int8_engine(tiny_onnx, tmp_path_factory):
    folder = tmp_path_factory.mktemp("staged_pipeline")
    frames = torch.from_numpy(camera_frames(16, seed=5)).permute(0, 3, 1, 2)
    images, _ = sartor.pipeline.prepare_batch(list(frames), [str(i) for i in range(16)], parse_preprocess(SPEC))
    np.save(folder / "calib.npy", images.numpy())
    sartor.build(tiny_onnx, folder / "int8.plan", device="cpu", precision="int8", calib=str(folder / "calib.npy"),
                 min_shapes=MIN_SHAPES, opt_shapes=OPT_SHAPES, max_shapes=MAX_SHAPES, preprocess=SPEC,
                 builder_effort=0)
    return sartor.load(folder / "int8.plan", device="cpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="Triton runs CPU tensors only in its interpreter, which "
                    "conftest.py turns on where there is no GPU; the CUDA test below covers the GPU")
def test_an_int8_engines_batches_are_prepared_as_its_stems_codes_with_the_float_batches_results(
        int8_engine, monkeypatch):
    """With the kernel forced on the CPU, the INT8 engine's batches are staged as its stem's codes:
    the logits equal those of the same Pipeline preparing floats, exactly, partial batch included.
    Without overlap: Triton's interpreter cannot run on two worker threads at once."""
    overlap = False
    monkeypatch.setattr(prepare_module, "uses_kernel", lambda device, spec=None: True)
    frames = list(camera_frames(5, seed=9))
    staged = Pipeline(int8_engine, batch_size=2, overlap=overlap)
    (bucket,) = staged._buckets
    assert bucket.staged is not None and bucket.staged.codes is not None
    ran = []
    run = type(bucket.context).run
    monkeypatch.setattr(type(bucket.context), "run", lambda self, feeds, **kw: ran.append(
        (feeds["images"].dtype, kw.get("staged"))) or run(self, feeds, **kw))
    ours = staged.run(frames)
    assert ran == [(torch.int8, True)] * 3
    floats = Pipeline(int8_engine, batch_size=2, overlap=overlap)
    floats._buckets[0].staged = None
    expected = floats.run(frames)
    assert ran[3:] == [(torch.float32, False)] * 3
    assert [r.name for r in ours] == [r.name for r in expected] and all(r.error is None for r in ours)
    for a, b in zip(ours, expected):
        assert np.array_equal(a.outputs["logits"], b.outputs["logits"])
        assert a.meta == b.meta


def test_a_float_engine_on_the_cpu_prepares_as_its_spec_says(tiny_onnx, tmp_path):
    plan = tmp_path / "fp32.plan"
    sartor.build(tiny_onnx, plan, device="cpu", min_shapes=MIN_SHAPES, opt_shapes=OPT_SHAPES, max_shapes=MAX_SHAPES,
                 preprocess=SPEC)
    pipeline = Pipeline(sartor.load(plan, device="cpu"), batch_size=2)
    assert pipeline._buckets[0].staged is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA engines stage FP16 and INT8 inputs")
@pytest.mark.parametrize("precision", ["int8", "fp16"])
def test_cuda_pipelines_stage_their_batches_with_the_float_batches_results(tiny_onnx, tmp_path, precision):
    """On CUDA: codes for INT8, channels-last float16 for FP16; results bit for bit those of the same
    Pipeline preparing float32 batches that the run converts."""
    frames = torch.from_numpy(camera_frames(16, seed=5)).permute(0, 3, 1, 2)
    images, _ = sartor.pipeline.prepare_batch(list(frames), [str(i) for i in range(16)], parse_preprocess(SPEC))
    np.save(tmp_path / "calib.npy", images.numpy())
    plan = tmp_path / f"{precision}.plan"
    sartor.build(tiny_onnx, plan, device="cuda", precision=precision, calib=str(tmp_path / "calib.npy"),
                 min_shapes=MIN_SHAPES, opt_shapes=OPT_SHAPES, max_shapes=MAX_SHAPES, preprocess=SPEC,
                 builder_effort=0)
    engine = sartor.load(plan, device="cuda")
    frames = list(camera_frames(7, seed=3))
    staged = Pipeline(engine, batch_size=4)
    form = staged._buckets[0].staged
    assert form is not None and (form.codes is not None if precision == "int8" else form.channels_last)
    ours = staged.run(frames)
    floats = Pipeline(engine, batch_size=4)
    floats._buckets[0].staged = None
    for a, b in zip(ours, floats.run(frames)):
        assert a.error is None and np.array_equal(a.outputs["logits"], b.outputs["logits"])
