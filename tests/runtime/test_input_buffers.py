"""ExecutionContext.input_buffers: the engine's own input buffers (TensorRT's bound buffers), filled
in place and run without a copy. On the CPU they are plain tensors that `run` reads; on CUDA they are
the captured graph's inputs. The gate applies to them as to `run`."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import IMAGE, MAX_SHAPES, MIN_SHAPES, OPT_SHAPES

import sartor
from sartor.errors import InputError, ProfileError

SHAPE = (2, 3, IMAGE, IMAGE)


def test_cpu_buffers_are_zeros_of_the_declared_dtype_that_run_reads(tiny_engine, images):
    ctx = tiny_engine.context()
    buffers = ctx.input_buffers({"images": SHAPE})
    assert list(buffers) == ["images"]
    buffer = buffers["images"]
    assert buffer.shape == SHAPE and buffer.dtype == torch.float32 and not buffer.any()
    buffer.copy_(torch.from_numpy(images))
    got = ctx.run(buffers)["logits"]
    np.testing.assert_allclose(got.numpy(), ctx.run({"images": images})["logits"], rtol=1e-6, atol=1e-6)


def test_the_gate_refuses_buffers_as_it_refuses_inputs(tiny_engine):
    ctx = tiny_engine.context()
    with pytest.raises(InputError, match=r"unknown input name\(s\) pixels; the engine's inputs are images"):
        ctx.input_buffers({"pixels": SHAPE})
    with pytest.raises(InputError, match="missing input"):
        ctx.input_buffers({})
    with pytest.raises(ProfileError, match="outside the allowed ranges"):
        ctx.input_buffers({"images": (8, 3, IMAGE, IMAGE)})


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_cuda_buffers_are_the_graphs_inputs_and_run_without_a_copy(tiny_onnx, tmp_path, images):
    plan = tmp_path / "tiny_cuda.plan"
    sartor.build(tiny_onnx, plan, device="cuda", min_shapes=MIN_SHAPES, opt_shapes=OPT_SHAPES,
                 max_shapes=MAX_SHAPES)
    ctx = sartor.load(plan).context()
    first = torch.from_numpy(images).cuda()
    expected = ctx.run({"images": first})["logits"].clone()
    buffers = ctx.input_buffers({"images": SHAPE})
    buffer = buffers["images"]
    assert buffer.device.type == "cuda" and buffer.data_ptr() == ctx.input_buffers({"images": SHAPE})["images"].data_ptr()
    buffer.copy_(first)
    torch.testing.assert_close(ctx.run(buffers)["logits"], expected)
    # Another tensor is still copied in, into the buffer of the graph captured from its staged form
    # (channels-last here, docs/decisions/0068): the engine's own buffer keeps what was written there,
    # and writing it in place is what the next run reads.
    second = first.flip(0).contiguous()
    flipped = ctx.run({"images": second})["logits"].clone()
    assert torch.equal(buffer, first)
    torch.testing.assert_close(ctx.run(buffers)["logits"], expected)
    buffer.copy_(second)
    torch.testing.assert_close(ctx.run(buffers)["logits"], flipped)
    torch.testing.assert_close(flipped, expected.flip(0))
