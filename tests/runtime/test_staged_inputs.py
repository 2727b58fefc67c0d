"""An input copied into the engine is written as its readers take it (docs/decisions/0068): the INT8
codes an INT8 stem would quantize it to, or the dtype and channels-last layout the run would convert
it to. `Executor.staged_form` says which; on CUDA the context's copy writes that form into the buffer
of a graph captured from it, and the engine's own buffers (`input_buffers`) keep the declared form.
The numbers do not change."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import IMAGE, MAX_SHAPES, MIN_SHAPES, OPT_SHAPES

import sartor
from sartor.errors import InputError, ProfileError
from sartor.ops.quantized import quantize
from sartor.runtime.context import STAGED, _staged

SHAPE = OPT_SHAPES["images"]


def _build(tiny_onnx, path, device: str, precision: str, **flags):
    if precision in ("int8", "fp8"):
        calib = path.parent / "calib.npy"
        np.save(calib, np.random.default_rng(0).standard_normal((8, 3, IMAGE, IMAGE)).astype(np.float32))
        flags = dict(flags, calib=str(calib))
    sartor.build(tiny_onnx, path, device=device, precision=precision, min_shapes=MIN_SHAPES, opt_shapes=OPT_SHAPES,
                 max_shapes=MAX_SHAPES, builder_effort=0, **flags)
    return sartor.load(path, device=device)


def test_an_input_only_int8_layers_read_is_staged_as_their_codes(tiny_onnx, tmp_path, images):
    """The tiny classifier's first convolution is its input's only reader: INT8, so the input's staged
    form is that layer's codes, and a run fed those codes gives the float input's outputs exactly."""
    engine = _build(tiny_onnx, tmp_path / "int8.plan", "cpu", "int8")
    executor = engine.executor
    x = torch.from_numpy(images)
    form = executor.staged_form("images", x)
    stem = next(step for step in executor.steps if step.node.inputs[0] == "images")
    assert stem.node.op_type == "QConv"
    assert form is not None and form.dtype == torch.int8 and not form.channels_last
    assert form.codes == (stem.node.attrs["input_inv_scale"], stem.node.attrs.get("qmin", -127))
    codes = quantize(x, *form.codes)
    assert codes.unique().numel() > 50  # the image spans many codes
    from_floats = executor.run({"images": x})["logits"]
    assert torch.equal(executor.run({"images": codes})["logits"], from_floats)


@pytest.mark.parametrize("precision,pins", [("fp32", None), ("int8", {"conv1": "fp32"})])
def test_an_input_a_float_layer_reads_is_not_staged_on_the_cpu(tiny_onnx, tmp_path, images, precision, pins):
    """No INT8 reader (an FP32 engine, or the stem pinned to FP32), and on the CPU the run converts no
    input: the input is copied as it comes."""
    engine = _build(tiny_onnx, tmp_path / f"{precision}.plan", "cpu", precision, layer_precision=pins)
    assert engine.executor.feed_codes == {}
    assert engine.executor.staged_form("images", torch.from_numpy(images)) is None


def test_staged_inputs_keep_a_buffer_of_their_own_in_their_layout(tiny_engine, images):
    """The buffers graphs are captured from: a staged float32 channels-last input (the declared dtype)
    gets a buffer apart from the declared one, so a copied run never writes what a caller put in
    the engine's own buffer, viewed in the staged layout; each is shared by every shape."""
    ctx = tiny_engine.context()
    x = torch.from_numpy(images)
    declared = ctx._shared_input("images", x)
    staged = ctx._shared_input("images", x.contiguous(memory_format=torch.channels_last), staged=True)
    assert torch.equal(declared, x) and torch.equal(staged, x)
    assert declared.is_contiguous() and staged.is_contiguous(memory_format=torch.channels_last)
    assert staged.untyped_storage().data_ptr() != declared.untyped_storage().data_ptr()
    smaller = ctx._shared_input("images", x[:1].contiguous(memory_format=torch.channels_last), staged=True)
    assert smaller.data_ptr() == staged.data_ptr() and smaller.stride() == x[:1].contiguous(
        memory_format=torch.channels_last).stride()


def test_the_staged_copy_writes_each_form(images):
    """What a graph is captured from and what each copied run writes: the INT8 codes of the form's
    quantization, a float16 channels-last copy, or the tensor as it comes where it has no form."""
    from sartor.runtime.context import _copy_in
    from sartor.runtime.executor import StagedForm
    x = torch.from_numpy(images)
    forms = {"codes": StagedForm(torch.int8, codes=(20.0, -128)), "half": StagedForm(torch.float16, channels_last=True)}
    staged = _staged({"codes": x, "half": x, "plain": x}, forms)
    assert torch.equal(staged["codes"], quantize(x, 20.0, -128)) and staged["codes"].is_contiguous()
    assert torch.equal(staged["half"], x.half()) and staged["half"].is_contiguous(memory_format=torch.channels_last)
    assert staged["plain"] is x
    flipped = x.flip(0).contiguous()
    _copy_in(flipped, staged["codes"], forms["codes"])
    assert torch.equal(staged["codes"], quantize(flipped, 20.0, -128))


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="the staged copy feeds CUDA graphs")


@cuda
@pytest.mark.parametrize("precision,form", [("int8", (torch.int8, False)), ("fp16", (torch.float16, True)),
                                            ("fp32", (torch.float32, True))])
def test_a_copied_input_runs_the_staged_graph_with_the_outputs_of_the_engines_own_buffers(
        tiny_onnx, tmp_path, images, precision, form):
    """On CUDA: INT8 codes for the INT8 engine, float16 channels-last pixels for the FP16 one,
    channels-last float32 for the FP32 one. A copied input replays the graph captured from its staged
    form; the engine's own buffers replay the graph of the declared form; both give the same
    outputs, bit for bit, and a copied run leaves the engine's buffers as they were."""
    engine = _build(tiny_onnx, tmp_path / f"{precision}.plan", "cuda", precision)
    ctx = engine.context()
    x = torch.from_numpy(images).cuda()
    copied = ctx.run({"images": x})["logits"].clone()
    staged = [g for key, g in ctx._captured.items() if key[-len(STAGED):] == STAGED]
    assert len(staged) == 1
    buffer = staged[0].inputs["images"]
    assert (buffer.dtype, buffer.is_contiguous(memory_format=torch.channels_last) and not buffer.is_contiguous()) \
        == form
    buffers = ctx.input_buffers({"images": SHAPE})
    assert buffers["images"].dtype == torch.float32 and buffers["images"].data_ptr() != buffer.data_ptr()
    buffers["images"].copy_(x)
    assert torch.equal(ctx.run(buffers)["logits"], copied)
    flipped = ctx.run({"images": x.flip(0).contiguous()})["logits"].clone()
    assert torch.equal(buffers["images"], x)  # a copied run wrote the staged buffer, not this one
    assert torch.equal(flipped, copied.flip(0))
    if precision == "int8":
        stem = next(step for step in engine.executor.steps if step.node.inputs[0] == "images")
        assert torch.equal(buffer, quantize(x.flip(0), stem.node.attrs["input_inv_scale"],
                                            stem.node.attrs.get("qmin", -127)))


def test_run_takes_inputs_already_in_their_staged_form(tiny_onnx, tmp_path, images):
    """A caller that prepares its inputs (the Pipeline) asks `staged_forms` and writes them so: fed the
    INT8 stem's codes, `run(staged=True)` gives the float input's outputs exactly. Each gate names
    the dtype the other one takes."""
    engine = _build(tiny_onnx, tmp_path / "int8.plan", "cpu", "int8")
    ctx = engine.context()
    forms = ctx.staged_forms({"images": SHAPE})
    assert set(forms) == {"images"} and forms["images"] == engine.executor.staged_form("images", torch.zeros(SHAPE))
    x = torch.from_numpy(images)
    codes = quantize(x, *forms["images"].codes)
    expected = ctx.run({"images": x})["logits"].clone()
    assert torch.equal(ctx.run({"images": codes}, staged=True)["logits"], expected)
    assert np.array_equal(ctx.run({"images": codes.numpy()}, staged=True)["logits"], expected.numpy())
    with pytest.raises(InputError, match=r"input 'images' has dtype float32; run\(staged=True\) takes its staged "
                                         r"form, int8 codes \(inv_scale [0-9.e+-]+, qmin -12[78]\)"):
        ctx.run({"images": x}, staged=True)
    with pytest.raises(InputError, match="has dtype int8; the engine expects float32"):
        ctx.run({"images": codes})


def test_an_input_without_a_staged_form_comes_to_a_staged_run_as_declared(tiny_engine, images):
    ctx = tiny_engine.context()
    assert ctx.staged_forms({"images": SHAPE}) == {}
    x = torch.from_numpy(images)
    expected = ctx.run({"images": x})["logits"].clone()
    assert torch.equal(ctx.run({"images": x}, staged=True)["logits"], expected)
    with pytest.raises(InputError, match=r"has dtype int8; run\(staged=True\) takes float32, as declared \(it has "
                                         r"no staged form\)"):
        ctx.run({"images": x.to(torch.int8)}, staged=True)


def test_the_staged_gate_refuses_what_run_refuses(tiny_engine, images):
    ctx = tiny_engine.context()
    x = torch.from_numpy(images)
    with pytest.raises(InputError, match="unknown input name.*pixels"):
        ctx.staged_forms({"pixels": SHAPE})
    with pytest.raises(ProfileError, match="outside the allowed ranges"):
        ctx.staged_forms({"images": (9, *SHAPE[1:])})
    with pytest.raises(ProfileError, match="outside the allowed ranges"):
        ctx.run({"images": torch.zeros((9, *SHAPE[1:]))}, staged=True)
    with pytest.raises(InputError, match="missing input"):
        ctx.run({}, staged=True)
    with pytest.raises(InputError, match="unknown input name.*pixels"):
        ctx.run({"images": x, "pixels": x}, staged=True)
    with pytest.raises(InputError, match="must be a numpy array or torch tensor, not list"):
        ctx.run({"images": [1.0]}, staged=True)
    with pytest.raises(InputError, match="has rank 3"):
        ctx.run({"images": x[0]}, staged=True)
    with pytest.raises(InputError, match="inputs must be a dict"):
        ctx.run([x], staged=True)


@cuda
@pytest.mark.parametrize("precision", ["int8", "fp16", "fp32"])
def test_a_staged_run_on_cuda_replays_the_copied_runs_graph_with_its_outputs(tiny_onnx, tmp_path, images, precision):
    """Inputs already in their staged form are copied in as they are, into the graph a copied run
    captured: the same outputs bit for bit, and no second graph."""
    engine = _build(tiny_onnx, tmp_path / f"{precision}.plan", "cuda", precision)
    ctx = engine.context()
    form = ctx.staged_forms({"images": SHAPE})["images"]
    x = torch.from_numpy(images).cuda()
    expected = ctx.run({"images": x})["logits"].clone()
    ready = _staged({"images": x}, {"images": form})["images"]
    assert torch.equal(ctx.run({"images": ready}, staged=True)["logits"], expected)
    assert len(ctx._captured) == 1 and next(iter(ctx._captured))[-len(STAGED):] == STAGED
    flipped = _staged({"images": x.flip(0).contiguous()}, {"images": form})["images"]
    assert torch.equal(ctx.run({"images": flipped}, staged=True)["logits"], expected.flip(0))
