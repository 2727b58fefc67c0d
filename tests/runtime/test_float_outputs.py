"""INT8 layers storing their float output in their readers' float16 (runtime/float_outputs.py): which
layers the plan marks, that it does not fire where it must not, and that the engine's numbers do not
move (the layer rounds to float16 what each reader converted on reading)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import sartor
from sartor.ops.registry import FLOAT_OUTPUT
from sartor.runtime import float_outputs
from tests.conftest import save
from tests.passes_helpers import OnnxBuilder

SHAPE = (2, 3, 8, 8)


def chain(second_reader: str | None = None):
    """stem conv (ReLU) → entry conv (ReLU) → head conv → output: the head stays float (decision 0045),
    so the INT8 entry writes floats for it. `second_reader`: "fp32 conv" adds a second conv
    reading the entry's output, "output" makes that output a graph output too (an output head then,
    which stays INT8 only when asked)."""
    b = OnnxBuilder(seed=7)
    x = b.input("images", list(SHAPE))
    stem = b.node("Relu", [b.conv(x, 3, 8, "stem")], name="stem_act")
    entry = b.node("Relu", [b.conv(stem, 8, 8, "entry")], name="entry_act")
    outputs = [b.conv(entry, 8, 4, "head", k=1)]
    if second_reader == "fp32 conv":
        outputs.append(b.conv(entry, 8, 4, "other", k=1))
    elif second_reader == "output":
        outputs.append(entry)
    return b.model(outputs)


def _engine(tmp_path, model, layer_precision: dict):
    path = save(model, tmp_path / "chain.onnx")
    np.save(tmp_path / "calib.npy", np.random.default_rng(3).random((8, *SHAPE[1:]), dtype=np.float32))
    sartor.build(str(path), str(tmp_path / "chain.plan"), device="cpu", profiles=[{"min": {"images": SHAPE},
                 "opt": {"images": SHAPE}, "max": {"images": SHAPE}}], precision="int8",
                 calib=str(tmp_path / "calib.npy"), layer_precision=layer_precision)
    return sartor.load(str(tmp_path / "chain.plan"))


def _run(engine, x):
    """The engine's outputs and the dtype each layer's first output had."""
    dtypes = {}
    outputs = engine.executor.run({"images": torch.from_numpy(x)},
                                  observe=lambda index, step, values: dtypes.setdefault(step.node.name,
                                                                                        values[0].dtype))
    return outputs, dtypes


def _entry_layer(engine) -> str:
    return next(s.node.name for s in engine.executor.steps if s.node.op_type == "QConv" and "entry" in s.node.name)


def test_int8_layer_writes_float16_for_its_float16_reader_and_numbers_stay(tmp_path, monkeypatch):
    engine = _engine(tmp_path, chain(), {"head*": "fp16"})
    entry = _entry_layer(engine)
    assert engine.executor.float_outputs == {entry: "float16"}
    x = np.random.default_rng(0).random(SHAPE, dtype=np.float32)
    planned, dtypes = _run(engine, x)
    assert dtypes[entry] == torch.float16

    monkeypatch.setattr(float_outputs, "plan_float_outputs", lambda steps, outputs: {})
    step = next(s for s in engine.executor.steps if s.node.name == entry)
    del step.attrs[FLOAT_OUTPUT]
    unplanned, dtypes = _run(engine, x)
    assert dtypes[entry] == torch.float32
    for name, value in planned.items():
        assert torch.equal(value, unplanned[name]), name


@pytest.mark.parametrize("case", ["float32 reader", "a float32 reader besides", "graph output"])
def test_plan_does_not_fire_where_it_must_not(case, tmp_path):
    model = chain({"float32 reader": None, "a float32 reader besides": "fp32 conv", "graph output": "output"}[case])
    layer_precision = {"float32 reader": {}, "a float32 reader besides": {"head*": "fp16"},
                       "graph output": {"head*": "fp16", "entry*": "int8"}}[case]
    engine = _engine(tmp_path, model, layer_precision)
    assert engine.executor.float_outputs == {}
    x = np.random.default_rng(1).random(SHAPE, dtype=np.float32)
    _, dtypes = _run(engine, x)
    assert dtypes[_entry_layer(engine)] == torch.float32


@pytest.mark.parametrize("model,size", [("samples/yolo/yolo11n_scenes.onnx", 64),
                                        ("samples/detector/sample_detector.onnx", 320)])  # its size is fixed
def test_int8_detectors_with_float16_fallbacks_convert_no_value_between_floats(model, size, tmp_path):
    """The shipped detectors' INT8 engines, run as on CUDA (their float layers at FP16): no layer
    reads a float value in another float dtype than it computes in, so no conversion runs between
    layers (YOLO11n's head-branch entries and its attention block's INT8 layers made nine), nor
    when the run finishes (the decode writes the engine's float32 output)."""
    from sartor.runtime.engine_file import read_engine_file
    from sartor.runtime.executor import Executor
    from sartor.runtime.graph_codec import decode_graph
    shape = {"images": (1, 3, size, size)}
    np.save(tmp_path / "calib.npy", np.random.default_rng(0).random((4, 3, size, size), dtype=np.float32))
    sartor.build(model, str(tmp_path / "m.plan"), device="cpu", precision="int8", calib=str(tmp_path / "calib.npy"),
                 min_shapes=shape, opt_shapes=shape, max_shapes=shape, builder_effort=0)
    header, tensors = read_engine_file(str(tmp_path / "m.plan"))
    graph, weights = decode_graph(header["graph"], tensors)
    as_on_cuda = {layer["name"]: "fp16" if layer["precision"] == "fp32" else layer["precision"]
                  for layer in header["layers"]}
    executor = Executor(graph, weights, torch.device("cpu"), as_on_cuda)
    decode = next(step.node.name for step in executor.steps if step.node.op_type == "YoloDecode")
    assert executor.float_outputs.pop(decode) == "float32"  # the engine's output, from an FP32 decode
    assert executor.float_outputs and set(executor.float_outputs.values()) == {"float16"}
    made: dict[str, torch.dtype] = {}
    converted = []

    def before(index, step, args):
        converted.extend((name, made[name], step.compute_dtype) for name in step.node.inputs
                         if step.compute_dtype is not None and name in made and made[name].is_floating_point
                         and made[name] != step.compute_dtype)

    def observe(index, step, outputs):
        made.update((name, value.dtype) for name, value in zip(step.node.outputs, outputs)
                    if name and isinstance(value, torch.Tensor))
    outputs = executor.run({"images": torch.rand(*shape["images"])}, observe=observe, before=before)
    assert converted == []
    assert [made[name] for name in outputs] == [torch.float32] * len(outputs)
