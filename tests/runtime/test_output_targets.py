"""Graph outputs written where a context keeps them (OpDef.write_outputs): the graphs a context
captures after its first (other batch sizes, buffers read where they are) keep their outputs in the
context's shared output buffers, and an op that can write there spares the copy into them. The
executor's part runs here on the NMS kernel (through Triton's interpreter without a GPU); on CUDA,
an NMS engine's later graphs return outputs in the shared buffers, equal to a fresh context's."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from nms_helpers import grid_head

from sartor.ir import Graph, Node, ValueInfo
from sartor.ops.nms import REFERENCE, TRITON, NmsSettings, batched_nms_reference
from sartor.runtime.executor import Executor

pytest.importorskip("triton")
ROOT = Path(__file__).resolve().parents[2]
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
SETTINGS = NmsSettings(conf=0.5, iou=0.45, max_det=6, topk=40)
OUTPUTS = ["count", "boxes", "scores", "classes"]


def _nms_executor(tactic: str) -> Executor:
    node = Node("BatchedNms", "nms", ["head"], OUTPUTS, dict(SETTINGS.to_json(), tactic=tactic))
    shapes = (("int32", [2]), ("float32", [2, SETTINGS.max_det, 4]), ("float32", [2, SETTINGS.max_det]),
              ("int32", [2, SETTINGS.max_det]))
    graph = Graph([node], [ValueInfo("head", "float32", [2, 7, 12])],
                  [ValueInfo(name, dtype, shape) for name, (dtype, shape) in zip(OUTPUTS, shapes)], {})
    return Executor(graph, {}, DEVICE)


def _targets() -> dict:
    """Buffers holding another run's values."""
    return {"count": torch.full((2,), 9, dtype=torch.int32, device=DEVICE),
            "boxes": torch.full((2, SETTINGS.max_det, 4), 9.0, device=DEVICE),
            "scores": torch.full((2, SETTINGS.max_det), 9.0, device=DEVICE),
            "classes": torch.full((2, SETTINGS.max_det), 9, dtype=torch.int32, device=DEVICE)}


def _run(executor: Executor, head: torch.Tensor, targets: dict | None) -> dict:
    state = executor.begin({"head": head}, output_targets=targets)
    executor.run_steps(state, 0, len(executor.steps))
    return executor.finish(state)


def test_an_op_that_can_writes_its_outputs_into_the_targets():
    head = grid_head(3, batch=2, classes=3, anchors=12, levels=10, size=16).to(DEVICE)
    expected = dict(zip(OUTPUTS, batched_nms_reference(head.cpu(), SETTINGS)))
    targets = _targets()
    outputs = _run(_nms_executor(TRITON), head, targets)
    assert all(outputs[name] is targets[name] for name in OUTPUTS)
    assert all(torch.equal(outputs[name].cpu(), expected[name]) for name in OUTPUTS)
    assert all(torch.equal(a, b) for a, b in zip(_run(_nms_executor(TRITON), head, None).values(), outputs.values()))


def test_where_the_op_cannot_its_outputs_are_made_as_usual_and_the_targets_left_alone():
    head = grid_head(4, batch=2, classes=3, anchors=12, levels=10, size=16).to(DEVICE)
    expected = dict(zip(OUTPUTS, batched_nms_reference(head.cpu(), SETTINGS)))
    targets = _targets()
    partial = {name: targets[name] for name in OUTPUTS[:3]}  # the kernel writes all four or none
    for tactic, given in ((REFERENCE, targets), (TRITON, partial)):
        outputs = _run(_nms_executor(tactic), head, given)
        assert not any(outputs[name] is targets[name] for name in OUTPUTS)
        assert all(torch.equal(outputs[name].cpu(), expected[name]) for name in OUTPUTS)
        assert all(torch.equal(t.cpu(), _targets()[name].cpu()) for name, t in targets.items())


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="shared output buffers are a CUDA context's")


@cuda
def test_a_later_graphs_nms_outputs_are_written_in_the_shared_buffers(tmp_path):
    """The sample detector with --nms: the first graph (batch 4) keeps its outputs where it wrote them;
    the batch-2 graph and a reused buffer's bound graph return theirs in the shared buffers, written
    there by the NMS kernel (no copy), equal to what a fresh context's first graph returns."""
    import sartor
    from sartor.ops.nms import FUSED_TRITON, TWO_LEVEL_TRITON
    plan = tmp_path / "nms.plan"
    sartor.build(ROOT / "samples/detector/sample_detector.onnx", plan, device="cuda", precision="fp16",
                 nms="conf=0.25,iou=0.45,max_det=50", min_shapes={"images": (1, 3, 320, 320)},
                 opt_shapes={"images": (4, 3, 320, 320)}, max_shapes={"images": (4, 3, 320, 320)}, builder_effort=1)
    engine = sartor.load(plan, device="cuda")
    (nms,) = [node for node in engine.graph.nodes if node.op_type == "BatchedNms"]
    images = torch.from_numpy(np.random.default_rng(0).random((4, 3, 320, 320), dtype=np.float32)).cuda()
    ctx = engine.context()
    ctx.run({"images": images})  # the first graph
    arriving = []  # each later graph's outputs as its layers left them, before any copy
    shared = ctx._shared_outputs
    ctx._shared_outputs = lambda outputs: (arriving.append({n: v.data_ptr() for n, v in outputs.items()}),
                                           shared(outputs))[1]
    stores = {name: store.data_ptr() for name, store in ctx._output_store.items()}
    slot = images[:2].clone()
    for _ in range(2):  # copied into the batch-2 graph's buffer, then bound at the second sighting
        returned = ctx.run({"images": slot})
        assert {name: value.data_ptr() for name, value in returned.items()} == stores
    got = {name: value.clone() for name, value in returned.items()}
    assert len(arriving) == 2
    if nms.attrs["tactic"] in (TRITON, TWO_LEVEL_TRITON, FUSED_TRITON):
        assert arriving == [stores, stores]
    expected = engine.context().run({"images": images[:2].clone()})
    for name, value in expected.items():
        assert torch.equal(got[name], value)
