"""runtime/branch_streams.py: independent branches of an engine on auxiliary CUDA streams. The
plan is checked on the CPU on the shipped detectors' steps (every value read from another stream
is waited for; the YOLO head's chains run beside each other); the runs on the GPU must equal the
one-stream runs, captured and eager."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

import sartor
from sartor.errors import ConfigError
from sartor.runtime.branch_streams import MAIN, MAX_AUX_STREAMS, plan_branches
from sartor.runtime.context import ExecutionContext

ROOT = Path(__file__).resolve().parents[2]
YOLOV8N = ROOT / "samples" / "yolo" / "yolov8n_scenes.onnx"
DETECTOR = ROOT / "samples" / "detector" / "sample_detector.onnx"


def _engine(onnx: Path, size: int, tmp_path_factory, device: str = "cpu", precision: str = "fp32"):
    shape = {"images": (1, 3, size, size)}
    plan = tmp_path_factory.mktemp("branches") / f"{onnx.stem}_{device}.plan"
    sartor.build(str(onnx), str(plan), device=device, precision=precision, builder_effort=0,
                 min_shapes=shape, opt_shapes=shape, max_shapes=shape)
    return sartor.load(str(plan), device=device)


@pytest.fixture(scope="module")
def yolov8n(tmp_path_factory):
    return _engine(YOLOV8N, 640, tmp_path_factory)


def _producers(steps) -> list[list[int]]:
    made, found = {}, []
    for index, step in enumerate(steps):
        found.append([made[name] for name in step.node.present_inputs() if name in made])
        for name in step.node.outputs:
            if name and not step.on_host:
                made[name] = index
    return found


def _makespan(steps, plan) -> int:
    """Steps of unit time, each stream in order, each step after what it waits for."""
    free = {}
    done = {}
    for index, step in enumerate(steps):
        stream = plan.stream_of[index]
        if stream is None:
            continue
        cost = 0 if step.node.op_type in ("Split", "Concat") else 1  # views and in-place Concats launch nothing
        start = max([free.get(stream, 0)] + [done[p] for p in plan.waits[index]])
        done[index] = free[stream] = start + cost
    return max(done.values())


def test_every_value_read_from_another_stream_is_waited_for(yolov8n):
    steps = yolov8n.executor.steps
    for aux in (1, 3, MAX_AUX_STREAMS):
        plan = plan_branches(steps, aux)
        for index, producers in enumerate(_producers(steps)):
            if steps[index].on_host:
                assert plan.stream_of[index] is None
                continue
            for producer in producers:
                assert plan.stream_of[producer] == plan.stream_of[index] or producer in plan.waits[index]
        assert set(p for waited in plan.waits for p in waited) == plan.signals
        assert plan.streams_used <= aux + 1


def test_without_auxiliary_streams_every_layer_stays_on_the_callers_stream(yolov8n):
    plan = plan_branches(yolov8n.executor.steps, 0)
    assert {s for s in plan.stream_of if s is not None} == {MAIN} and not plan.signals


def test_the_yolo_heads_chains_run_beside_each_other(yolov8n):
    steps = yolov8n.executor.steps
    plan = plan_branches(steps, 3)
    stream = {step.node.name: plan.stream_of[i] for i, step in enumerate(steps)}
    box = [stream[f"/model.22/cv2.0/cv2.0.{k}/conv/Conv"] for k in (0, 1)] + [stream["/model.22/cv2.0/cv2.0.2/Conv"]]
    cls = [stream[f"/model.22/cv3.0/cv3.0.{k}/conv/Conv"] for k in (0, 1)] + [stream["/model.22/cv3.0/cv3.0.2/Conv"]]
    assert len(set(box)) == 1 and len(set(cls)) == 1 and box[0] != cls[0]  # one stream a chain, two chains
    sequential = _makespan(steps, plan_branches(steps, 0))
    assert _makespan(steps, plan) <= 0.85 * sequential  # 54 of 69 launching steps on the longest path


def test_aux_streams_must_be_a_small_whole_number(yolov8n):
    for wrong in (-1, MAX_AUX_STREAMS + 1, 1.5, True):
        with pytest.raises(ConfigError, match="aux_streams"):
            ExecutionContext(yolov8n, aux_streams=wrong)


def test_a_cpu_context_ignores_auxiliary_streams(yolov8n):
    x = np.random.default_rng(0).random((1, 3, 640, 640), dtype=np.float32)
    plain = yolov8n.context().run({"images": x})
    branched_context = yolov8n.context(aux_streams=2)
    assert branched_context.branches is None
    branched = branched_context.run({"images": x})
    for name, value in plain.items():
        np.testing.assert_array_equal(np.asarray(branched[name]), np.asarray(value))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="streams are CUDA's")
@pytest.mark.parametrize("graphs", [True, False], ids=["captured", "eager"])
def test_branched_runs_equal_one_stream_runs_on_the_gpu(tmp_path_factory, graphs):
    engine = _engine(DETECTOR, 320, tmp_path_factory, device="cuda", precision="fp16")
    one = ExecutionContext(engine, use_cuda_graphs=graphs)
    branched = ExecutionContext(engine, use_cuda_graphs=graphs, aux_streams=3)
    assert branched.branches is not None and engine.executor.branch_plan(3).streams_used > 1
    for seed in range(3):  # the first run records, the next capture and replay
        x = torch.from_numpy(np.random.default_rng(seed).random((1, 3, 320, 320), dtype=np.float32)).cuda()
        expected = {k: v.clone() for k, v in one.run({"images": x}).items()}
        got = branched.run({"images": x})
        for name, value in expected.items():
            assert torch.equal(got[name], value), name
