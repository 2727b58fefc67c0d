"""The greedy NMS kernel (`triton_greedy_nms`) against the torch tactic and torchvision, through
Triton's interpreter on CPU with small K (and natively on a GPU): ties, groups, max_det, images
without candidates, K not a power of two; and the float32 threshold it compares against."""
from __future__ import annotations

import numpy as np
import pytest
import torch

# conftest.py switches Triton to its interpreter when there is no GPU.
triton = pytest.importorskip("triton")

from nms_helpers import assert_equal_to_torchvision, grid_head

from sartor.kernels.detection.greedy_nms import float32_threshold, greedy_nms
from sartor.ops.nms import (
    TRITON,
    TWO_LEVEL_TRITON,
    NmsSettings,
    batched_nms_op,
    batched_nms_reference,
    nms_candidates,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def kernel_outputs(pred: torch.Tensor, settings: NmsSettings) -> tuple:
    boxes, scores, classes, valid = nms_candidates(pred.to(DEVICE), settings)
    groups = torch.zeros_like(classes) if settings.agnostic else classes
    return tuple(t.cpu() for t in greedy_nms(boxes, scores, groups, classes, valid.sum(1), settings.iou,
                                               settings.max_det))


@pytest.mark.parametrize("settings", [
    NmsSettings(conf=0.5, iou=0.45, max_det=20, topk=48),
    NmsSettings(conf=0.5, iou=0.3, max_det=20, topk=48, agnostic=True),
    NmsSettings(conf=0.3, iou=0.7, max_det=5, topk=37),  # max_det reached; K not a power of two
    NmsSettings(conf=0.0, iou=1.0, max_det=64, topk=64),  # IoU 1 suppresses nothing: every candidate kept
])
def test_kernel_equals_the_torch_tactic_and_torchvision(settings):
    pred = grid_head(11, batch=3, classes=4, anchors=12, levels=10, size=16)
    pred[2, 4:] = 0.0  # an image without candidates
    got = kernel_outputs(pred, settings)
    expected = batched_nms_reference(pred, settings)
    for g, e in zip(got, expected):
        assert g.dtype == e.dtype and torch.equal(g, e)
    assert int(got[0][2]) == 0 and int(got[0][:2].min()) > 0
    if int((pred[:, 4:] > settings.conf).sum((1, 2)).max()) <= settings.topk:
        assert_equal_to_torchvision(pred, settings, got)


@pytest.mark.parametrize("tactic", [TRITON, TWO_LEVEL_TRITON])
def test_kernel_runs_as_the_ops_triton_tactics(tactic):
    pred = grid_head(12, batch=2, classes=3, anchors=10, levels=8, size=16).to(DEVICE)
    attrs = dict(NmsSettings(conf=0.4, iou=0.5, max_det=8, topk=30).to_json(), tactic=tactic)
    expected = batched_nms_reference(pred, NmsSettings.from_json(attrs), two_level=tactic == TWO_LEVEL_TRITON)
    for g, e in zip(batched_nms_op([pred], attrs), expected):
        assert torch.equal(g, e)


def test_iou_exactly_at_the_threshold_is_not_suppressed():
    # Two 3×1 boxes overlapping by 2: IoU exactly 2 / 4; torchvision suppresses only IoU > threshold.
    pred = torch.zeros(1, 5, 2)
    pred[0, :4, 0] = torch.tensor([1.5, 0.5, 3.0, 1.0])  # x 0..3
    pred[0, :4, 1] = torch.tensor([2.5, 0.5, 3.0, 1.0])  # x 1..4
    pred[0, 4] = torch.tensor([0.9, 0.8])
    for iou, kept in ((0.5, 2), (0.4999999, 1)):
        settings = NmsSettings(conf=0.1, iou=iou, max_det=4, topk=2)
        assert int(kernel_outputs(pred, settings)[0][0]) == kept
        assert int(batched_nms_reference(pred, settings)[0][0]) == kept
        assert_equal_to_torchvision(pred, settings, kernel_outputs(pred, settings))


def test_float32_threshold_makes_the_float_test_the_double_one():
    rng = np.random.default_rng(0)
    for threshold in [0.45, 0.5, 1 / 3, 0.7, 0.1, *rng.uniform(0, 1, 50)]:
        t32 = np.float32(float32_threshold(threshold))
        assert float(t32) <= threshold < float(np.nextafter(t32, np.float32(np.inf)))
        around = t32 + np.arange(-3, 4, dtype=np.float32) * np.spacing(t32)
        assert np.array_equal(around > t32, around.astype(np.float64) > threshold)


@pytest.mark.parametrize("max_det", [20, 300])  # 300: the zeroing walks its slots in two blocks
def test_kernel_writes_into_given_outputs_whatever_they_held(max_det):
    """The context's shared output buffers hold the last run's boxes: every slot past an image's count
    comes back zero, and the given tensors are the ones returned."""
    pred = grid_head(13, batch=3, classes=4, anchors=80, levels=10, size=16)
    pred[2, 4:] = 0.0  # an image without candidates
    settings = NmsSettings(conf=0.5, iou=0.45, max_det=max_det, topk=320)
    boxes, scores, classes, valid = nms_candidates(pred.to(DEVICE), settings)
    out = (torch.full((3,), 7, dtype=torch.int32), torch.full((3, max_det, 4), 7.0),
           torch.full((3, max_det), 7.0), torch.full((3, max_det), 7, dtype=torch.int32))
    out = tuple(t.to(DEVICE) for t in out)
    got = greedy_nms(boxes, scores, classes, classes, valid.sum(1), settings.iou, max_det, out=out)
    assert all(g is o for g, o in zip(got, out))
    for g, e in zip(got, batched_nms_reference(pred, settings)):
        assert torch.equal(g.cpu(), e)
    assert int(got[0][2]) == 0 and (max_det == 20 or int(got[0].max()) < max_det)  # slots past the kept zeroed
    with pytest.raises(ValueError, match="`out` must be"):
        greedy_nms(boxes, scores, classes, classes, valid.sum(1), settings.iou, max_det, out=out[:3])
