"""A buffer the caller reuses gets a graph that reads it where it is (docs/decisions/0069): no copy into
the engine, as TensorRT reads the address given to setTensorAddress. `BoundAddresses` decides which
(a second sighting of the same live buffer, up to a limit); on CUDA the bound graph's outputs equal
those of the engine's own buffers bit for bit and follow the buffer's contents at each run."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import IMAGE, MAX_SHAPES, MIN_SHAPES, OPT_SHAPES

import sartor
from sartor.errors import ConfigError
from sartor.runtime.context import AT, MAX_BOUND_GRAPHS, STAGED, BoundAddresses, _staged

SHAPE = OPT_SHAPES["images"]


def test_a_buffer_is_bound_at_its_second_sighting_while_alive():
    addresses = BoundAddresses(limit=2)
    slot = torch.zeros(4, 3, 8, 8)
    key = ("shape", "address")
    assert not addresses.recurs(key, {"x": slot[:2]})  # first sighting
    assert addresses.recurs(key, {"x": slot[:2]})  # another view of the same buffer: bound
    assert addresses.bound == 1
    assert not addresses.recurs(key, {"x": slot[:2]})  # bound once: the caller keeps the graph after


def test_a_tensor_made_afresh_for_each_call_is_never_bound():
    """At the same address (the allocator's reuse) but another tensor each time: binding it would hold
    every such tensor's memory."""
    addresses = BoundAddresses(limit=8)
    key = ("shape", "address")
    for _ in range(5):
        assert not addresses.recurs(key, {"x": torch.zeros(2, 3)})
    assert addresses.bound == 0


def test_no_more_than_the_limit_are_bound_and_sightings_are_bounded():
    addresses = BoundAddresses(limit=2)
    buffers = [torch.zeros(2) for _ in range(3)]
    for i, b in enumerate(buffers):
        addresses.recurs((i,), {"x": b})
    assert [addresses.recurs((i,), {"x": b}) for i, b in enumerate(buffers)] == [True, True, False]
    many = BoundAddresses(limit=8)
    kept = [torch.zeros(1) for _ in range(BoundAddresses.SIGHTINGS + 1)]
    for i, b in enumerate(kept):
        many.recurs((i,), {"x": b})
    assert len(many._seen) == BoundAddresses.SIGHTINGS and (0,) not in many._seen
    assert not many.recurs((0,), {"x": kept[0]})  # forgotten: a first sighting again


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="bound graphs are CUDA graphs")


def _engine(tiny_onnx, path, precision):
    flags = {}
    if precision == "int8":
        calib = np.random.default_rng(0).standard_normal((8, 3, IMAGE, IMAGE)).astype(np.float32)
        np.save(path.parent / "calib.npy", calib)
        flags["calib"] = str(path.parent / "calib.npy")
    sartor.build(tiny_onnx, path, device="cuda", precision=precision, min_shapes=MIN_SHAPES, opt_shapes=OPT_SHAPES,
                 max_shapes=MAX_SHAPES, builder_effort=0, **flags)
    return sartor.load(path, device="cuda")


def _bound_keys(ctx) -> list:
    return [key for key in ctx._captured if key[-1][0] is AT]


@cuda
@pytest.mark.parametrize("precision", ["int8", "fp16", "fp32"])
def test_a_reused_buffer_is_read_where_it_is_with_the_engines_own_outputs(tiny_onnx, tmp_path, images, precision):
    engine = _engine(tiny_onnx, tmp_path / f"{precision}.plan", precision)
    ctx = engine.context()
    own = ctx.input_buffers({"images": SHAPE})
    x = torch.from_numpy(images).cuda()
    own["images"].copy_(x)
    expected = ctx.run(own)["logits"].clone()
    slot = x.clone()
    assert torch.equal(ctx.run({"images": slot})["logits"], expected) and _bound_keys(ctx) == []  # copied
    assert torch.equal(ctx.run({"images": slot})["logits"], expected)  # second sighting: bound
    (key,) = _bound_keys(ctx)
    assert ctx._captured[key].inputs["images"].data_ptr() == slot.data_ptr()
    slot.copy_(x.flip(0))  # the graph reads the buffer's contents at each run
    assert torch.equal(ctx.run({"images": slot})["logits"], expected.flip(0))
    assert torch.equal(own["images"], x)  # the engine's own buffer untouched
    for _ in range(3):
        ctx.run({"images": x.clone()})  # a fresh tensor each call: copied, never bound
    assert len(_bound_keys(ctx)) == 1


@cuda
def test_past_the_limit_reused_buffers_are_copied(tiny_onnx, tmp_path, images):
    ctx = _engine(tiny_onnx, tmp_path / "fp16.plan", "fp16").context()
    x = torch.from_numpy(images).cuda()
    expected = ctx.run({"images": x})["logits"].clone()
    slots = [x.clone() for _ in range(MAX_BOUND_GRAPHS + 1)]
    for _ in range(2):
        outputs = [ctx.run({"images": slot})["logits"].clone() for slot in slots]
    assert all(torch.equal(o, expected) for o in outputs)
    assert len(_bound_keys(ctx)) == MAX_BOUND_GRAPHS


@cuda
def test_a_context_asked_for_no_bound_graphs_copies_every_input(tiny_onnx, tmp_path, images):
    ctx = _engine(tiny_onnx, tmp_path / "fp16.plan", "fp16").context(bound_graphs=0)
    slot = torch.from_numpy(images).cuda()
    expected = ctx.run({"images": slot})["logits"].clone()
    for _ in range(3):
        assert torch.equal(ctx.run({"images": slot})["logits"], expected)
    assert _bound_keys(ctx) == []


def test_the_bound_graph_count_is_a_whole_number(tiny_engine):
    assert BoundAddresses(limit=0).recurs(("k",), {"x": torch.zeros(1)}) is False
    for wrong in (-1, 1.5, True, "8"):
        with pytest.raises(ConfigError, match="bound_graphs must be a whole number"):
            tiny_engine.context(bound_graphs=wrong)
    assert tiny_engine.context(bound_graphs=0) is not None


@cuda
def test_a_reused_buffer_of_staged_codes_is_read_where_it_is(tiny_onnx, tmp_path, images):
    """The Pipeline's case: its staging slot holds the INT8 stem's codes, run with staged=True."""
    ctx = _engine(tiny_onnx, tmp_path / "int8.plan", "int8").context()
    x = torch.from_numpy(images).cuda()
    expected = ctx.run({"images": x})["logits"].clone()
    form = ctx.staged_forms({"images": SHAPE})["images"]
    slot = _staged({"images": x}, {"images": form})["images"]
    for _ in range(2):
        assert torch.equal(ctx.run({"images": slot}, staged=True)["logits"], expected)
    (key,) = _bound_keys(ctx)
    assert STAGED[0] in key


def test_graph_key_markers_equal_no_input_name():
    """An input named "staged" or "at" must not read as the markers a graph's key ends with."""
    assert STAGED[0] != ("staged", ()) and AT != "at"
    assert (AT, ()) != ("at", ())


def test_a_freed_buffers_graph_goes_and_frees_its_place(tiny_engine):
    """What weakref.finalize calls when a bound buffer is freed: the graph, its memo and its place go;
    a context already gone, or a key already dropped, is left alone."""
    import weakref

    from sartor.runtime.context import _unbind
    ctx = tiny_engine.context()
    key = ("images", (AT, ()))
    ctx._captured[key], ctx._addresses.bound = object(), 1
    ctx.memo_for(key)
    _unbind(weakref.ref(ctx), key)
    assert key not in ctx._captured and key not in ctx._memos and ctx._addresses.bound == 0
    _unbind(weakref.ref(ctx), key)
    assert ctx._addresses.bound == 0


@cuda
def test_a_bound_graph_holds_no_buffer_and_goes_when_it_is_freed(tiny_onnx, tmp_path, images):
    import gc
    ctx = _engine(tiny_onnx, tmp_path / "fp16.plan", "fp16").context()
    x = torch.from_numpy(images).cuda()
    expected = ctx.run({"images": x})["logits"].clone()
    slot = x.clone()
    for _ in range(2):
        ctx.run({"images": slot})
    assert len(_bound_keys(ctx)) == 1 and ctx._addresses.bound == 1
    del slot
    gc.collect()
    assert _bound_keys(ctx) == [] and ctx._addresses.bound == 0
    again = x.clone()
    for _ in range(2):
        assert torch.equal(ctx.run({"images": again})["logits"], expected)
    assert len(_bound_keys(ctx)) == 1


@cuda
def test_warmup_binds_nothing(tiny_onnx, tmp_path):
    ctx = _engine(tiny_onnx, tmp_path / "fp16.plan", "fp16").context()
    ctx.warmup(iterations=3)
    assert _bound_keys(ctx) == [] and ctx._addresses.bound == 0
