"""Concat written in place (runtime/concat_plan.py): which values the plan places in a Concat's
buffer, that it does not fire where it must not, and that engines running it still match ONNX
Runtime, run after run (the first run records shapes, the next ones write in place)."""
from __future__ import annotations

import weakref

import numpy as np
import onnxruntime as ort
import pytest
import torch

import sartor
from sartor.runtime.concat_plan import ConcatBuffers, ConcatPlan, ShapeMemo, SliceTarget
from tests.conftest import save
from tests.passes_helpers import OnnxBuilder

SHAPE = (2, 3, 8, 8)


def c2f_block(order: str = "ab", axis: int = 1, repeat: bool = False):
    """YOLOv8's C2f in small: conv → Split in halves a, b → bottleneck on b (conv, ReLU, + b) →
    Concat(a, b, bottleneck) → conv. `order` "ba" swaps the halves in the Concat."""
    b = OnnxBuilder(seed=4)
    x = b.input("images", list(SHAPE))
    y = b.node("Relu", [b.conv(x, 3, 8, "cv1", k=1)], name="cv1_act")
    a, h = b.node("Split", [y, b.const("sizes", np.array([4, 4], dtype=np.int64))], name="split", axis=1, outputs=2)
    m = b.node("Add", [h, b.node("Relu", [b.conv(h, 4, 4, "m")], name="m_act")], name="m_add")
    halves = [a, h] if order == "ab" else [h, a]
    parts = [a, a, m] if repeat else halves + [m]
    cat = b.node("Concat", parts, name="cat", axis=axis)
    channels = 12 if axis == 1 else 4
    out = b.conv(cat, channels, 6, "cv2", k=1)
    return b.model([out])


def _engine(model, tmp_path):
    onnx_path = save(model, tmp_path / "model.onnx")
    shapes = {"images": SHAPE}
    sartor.build(str(onnx_path), str(tmp_path / "model.plan"), device="cpu", precision="fp32",
                 min_shapes=shapes, opt_shapes=shapes, max_shapes=shapes)
    return onnx_path, sartor.load(str(tmp_path / "model.plan"))


def test_c2f_concat_is_assembled_in_place_and_matches_onnxruntime(tmp_path, monkeypatch):
    onnx_path, engine = _engine(c2f_block(), tmp_path)
    plan = engine.executor.concat_plan
    assert list(plan.concats) == ["cat_out"]
    # The Split's input (cv1 fused with its ReLU) sits at the buffer's start, so the Split's halves
    # are views already in place; the bottleneck (conv, ReLU, + b fused) writes after them.
    assert plan.targets == {"cv1_act_out": SliceTarget("cat_out", 0), "m_add_out": SliceTarget("cat_out", 2)}

    assembled = []
    original = ConcatBuffers.assemble

    def spy(self, concat, parts):
        result = original(self, concat, parts)
        assembled.append(result is not None)
        return result
    monkeypatch.setattr(ConcatBuffers, "assemble", spy)
    x = np.random.default_rng(0).random(SHAPE, dtype=np.float32)
    expected = ort.InferenceSession(str(onnx_path)).run(None, {"images": x})[0]
    ctx = engine.context()
    for _ in range(3):
        got = next(iter(ctx.run({"images": x}).values()))
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)
    assert assembled == [True, True]  # the first run records shapes, the next two assemble in place


@pytest.mark.parametrize("variant", ["halves swapped", "axis 2", "repeated input"])
def test_plan_does_not_fire_where_it_must_not(variant, tmp_path):
    model = {"halves swapped": lambda: c2f_block(order="ba"), "axis 2": lambda: c2f_block(axis=2),
             "repeated input": lambda: c2f_block(repeat=True)}[variant]()
    onnx_path, engine = _engine(model, tmp_path)
    plan = engine.executor.concat_plan
    if variant == "halves swapped":
        # The halves are not in the Split's order: the Split's input cannot be placed, only the
        # bottleneck's output can.
        assert plan.targets == {"m_add_out": SliceTarget("cat_out", 2)}
    else:
        assert plan.concats == {} and plan.targets == {}
    x = np.random.default_rng(1).random(SHAPE, dtype=np.float32)
    expected = ort.InferenceSession(str(onnx_path)).run(None, {"images": x})[0]
    ctx = engine.context()
    for _ in range(2):
        np.testing.assert_allclose(next(iter(ctx.run({"images": x}).values())), expected, rtol=1e-5, atol=1e-5)


def test_parts_in_place_are_kept_and_others_copied():
    plan = ConcatPlan(targets={"p": SliceTarget("cat", 0)}, concats={"cat": ["p", "q"]})
    meta = {"cat": ((1, 5, 2, 2), torch.float32, True), "p": ((1, 3, 2, 2), torch.float32, True),
            "q": ((1, 2, 2, 2), torch.float32, True)}
    buffers = ConcatBuffers(plan, meta, torch.device("cpu"))
    p = buffers.slice_for("p")
    assert p.shape == (1, 3, 2, 2) and buffers.slice_for("q") is None
    p.fill_(1.0)
    q = torch.full((1, 2, 2, 2), 2.0).contiguous(memory_format=torch.channels_last)
    out = buffers.assemble("cat", [p, q])
    assert out.data_ptr() == p.data_ptr() and out.is_contiguous(memory_format=torch.channels_last)
    torch.testing.assert_close(out, torch.cat([torch.ones(1, 3, 2, 2), torch.full((1, 2, 2, 2), 2.0)], 1))
    # Shapes other than those recorded: the Concat runs as a plain one.
    assert ConcatBuffers(plan, meta, torch.device("cpu")).assemble("cat", [torch.ones(1, 3, 4, 4), q]) is None


def test_a_memo_records_shapes_on_its_first_run_only(tmp_path):
    _, engine = _engine(c2f_block(), tmp_path)
    executor = engine.executor
    memo = ShapeMemo()
    x = torch.from_numpy(np.random.default_rng(2).random(SHAPE, dtype=np.float32))
    executor.run({"images": x}, memo)
    recorded = memo.value_meta
    assert set(recorded) == executor.concat_plan.values
    assert recorded["cat_out"] == ((2, 12, 8, 8), torch.float32, False)
    executor.run({"images": x}, memo)
    assert memo.value_meta is recorded


def test_an_nchw_buffer_gets_no_slices_and_producers_refuse_non_channels_last_outputs():
    """On the H200 a YOLO11n Concat fed by reshaped attention outputs came out NCHW; its producers
    must then leave the Concat to copy rather than write pixels into a layout they cannot store."""
    from sartor.ops.conv import fused_conv_into
    from sartor.ops.pool import max_pool_into
    plan = ConcatPlan(targets={"p": SliceTarget("cat", 0)}, concats={"cat": ["p", "q"]})
    meta = {"cat": ((1, 5, 2, 2), torch.float32, False), "p": ((1, 3, 2, 2), torch.float32, False),
            "q": ((1, 2, 2, 2), torch.float32, False)}
    assert ConcatBuffers(plan, meta, torch.device("cpu")).slice_for("p") is None
    nchw_slice = torch.empty(1, 5, 2, 2).narrow(1, 0, 3)
    x = torch.randn(1, 4, 2, 2).contiguous(memory_format=torch.channels_last)
    conv_attrs = {"tactic": "igemm.16x16x32.w1.s1", "kernel_shape": [1, 1]}
    assert fused_conv_into([x, torch.randn(3, 4, 1, 1)], conv_attrs, nchw_slice) is None
    pool_attrs = {"tactic": "max_pool.elements4096.channels64.w4", "kernel_shape": [1, 1]}
    assert max_pool_into([x[:, :3]], pool_attrs, nchw_slice) is None


def test_the_recording_run_frees_each_value_after_its_last_reader(tmp_path):
    """The first run records the shapes the plan needs, not the values: holding each Concat input
    to the end of that run took YOLOv8n's first run at batch 32 over three times its arena."""
    _, engine = _engine(c2f_block(), tmp_path)
    executor, memo = engine.executor, ShapeMemo()
    state = executor.begin({"images": torch.rand(SHAPE)}, memo)
    made = {}
    for index in range(len(executor.steps)):
        executor.run_steps(state, index, index + 1)
        made.update({name: weakref.ref(t) for name, t in state.env.items() if isinstance(t, torch.Tensor)})
    assert state.recorded, "the first run records what the Concat plan needs"
    released = {name for name in made if name not in state.env}
    assert {"cv1_act_out", "m_add_out"} <= released
    assert {name for name in released if made[name]() is not None} == set()
    executor.finish(state)
    assert memo.value_meta["m_add_out"] == ((2, 4, 8, 8), torch.float32, False)


class _FakeStream:
    """A stream's part in ConcatBuffers' ordering: the events it records and those it waits for."""

    def __init__(self, name: str) -> None:
        self.name, self.waited = name, []

    def record_event(self):
        return f"{self.name}@allocation"

    def wait_event(self, event) -> None:
        self.waited.append(event)


def test_writers_on_other_streams_wait_for_the_buffers_allocation(monkeypatch):
    """Run on several streams (branch_streams.py): the buffer is allocated by its first producer's
    stream, and another stream that writes a slice of it, or assembles it, first waits for that
    stream's event at the allocation (the allocator may have given it memory that stream still
    reads). The allocating stream itself does not wait."""
    plan = ConcatPlan(targets={"p": SliceTarget("cat", 0), "q": SliceTarget("cat", 1)}, concats={"cat": ["p", "q"]})
    meta = {"cat": ((1, 5, 2, 2), torch.float32, True), "p": ((1, 3, 2, 2), torch.float32, True),
            "q": ((1, 2, 2, 2), torch.float32, True)}
    first, second, third = _FakeStream("first"), _FakeStream("second"), _FakeStream("third")
    current = [first]
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: current[0])
    buffers = ConcatBuffers(plan, meta, torch.device("cpu"))
    buffers.track_streams = True
    p = buffers.slice_for("p")
    current[0] = second
    q = buffers.slice_for("q")
    current[0] = first
    buffers.slice_for("p")
    current[0] = third
    buffers.assemble("cat", [p, q])
    assert (first.waited, second.waited, third.waited) == ([], ["first@allocation"], ["first@allocation"])
    untracked = ConcatBuffers(plan, meta, torch.device("cpu"))
    untracked.slice_for("p")
    current[0] = second
    untracked.slice_for("q")
    assert second.waited == ["first@allocation"]  # one stream (the default): nothing recorded, nothing waited
