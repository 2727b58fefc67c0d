"""The Triton candidate stage (`fused_triton_greedy_nms`, `kernels/detection/nms_candidates.py`)
against the two-level stage, through Triton's interpreter on CPU with small heads (and natively on
a GPU): its valid candidates, their order, scores, classes and boxes equal bit for bit on realistic,
dense and tied heads, NaN, float16 and float32, K over A, batch 1, and the exact path taken when
more pairs qualify than the buffer holds; the op's outputs equal the reference tactics'."""
from __future__ import annotations

import pytest
import torch

# conftest.py switches Triton to its interpreter when there is no GPU.
triton = pytest.importorskip("triton")

from nms_helpers import assert_equal_to_torchvision, grid_head, sorted_candidates

from sartor.kernels.detection.nms_candidates import collect_pairs
from sartor.kernels.registry import parse_tactic
from sartor.ops.nms import (
    FUSED_TRITON,
    REFERENCE,
    TWO_LEVEL,
    NmsSettings,
    batched_nms_op,
    candidate_count,
    batched_nms_tactics,
    fused_candidates,
    threshold_in,
    two_level_candidates,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def sigmoid_head(seed: int, batch: int, classes: int, anchors: int, centre: float = -4.0) -> torch.Tensor:
    """Boxes in a 64-pixel image and sigmoid class scores: distinct scores, a YOLO head's spread."""
    pred = grid_head(seed, batch=batch, classes=classes, anchors=anchors)
    g = torch.Generator().manual_seed(seed)
    pred[:, 4:] = torch.sigmoid(torch.randn((batch, classes, anchors), generator=g) * 1.5 + centre)
    return pred


def assert_fused_equals_two_level(pred: torch.Tensor, settings: NmsSettings, capacity: int) -> int:
    """The valid candidates (mask, boxes, scores, classes) equal; invalid slots score −1."""
    expected = two_level_candidates(pred, settings)
    got = tuple(t.cpu() for t in fused_candidates(pred.to(DEVICE), settings, capacity))
    valid = expected[3]
    assert torch.equal(got[3], valid)
    for g, e in zip(got[:3], expected[:3]):
        assert g.dtype == e.dtype and torch.equal(g[valid], e[valid])
    assert torch.all(got[1][~valid] == -1.0)
    return int(valid.sum())


def qualifying_pairs(pred: torch.Tensor, settings: NmsSettings, capacity: int) -> torch.Tensor:
    """[B] the pairs an image's buffer was offered (over `capacity`: the exact, slow path)."""
    k = candidate_count(pred, settings)
    return collect_pairs(pred.to(DEVICE), threshold_in(settings.conf, pred.dtype), k, capacity)[3].cpu()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("case", ["realistic", "dense", "ties", "k_over_anchors", "batch_1"])
def test_fused_candidates_equal_the_two_level_ones(case, dtype):
    settings = NmsSettings(conf=0.25, topk=64, max_det=64)
    if case == "realistic":  # a few pairs over conf an anchor at most: the floor prunes most anchors
        pred, capacity = sigmoid_head(0, batch=2, classes=12, anchors=300), 256
    elif case == "dense":  # most pairs over conf, distinct scores
        pred, capacity = sigmoid_head(1, batch=2, classes=12, anchors=300, centre=3.0), 256
    elif case == "ties":  # 8 score levels: ties at the K-th place and at the floor
        pred, capacity = grid_head(2, batch=2, classes=6, anchors=200, levels=8), 512
        settings = NmsSettings(conf=0.5, topk=100, max_det=100)
    elif case == "k_over_anchors":  # every anchor among the K best: floor 0, all pairs over conf sorted
        pred, capacity = grid_head(3, batch=2, classes=3, anchors=40, levels=10), 256
        settings = NmsSettings(conf=0.3, topk=100, max_det=100)
    else:
        pred, capacity = sigmoid_head(4, batch=1, classes=5, anchors=200, centre=-1.0), 128
    pred = pred.to(dtype)
    valid = assert_fused_equals_two_level(pred, settings, capacity)
    assert valid > 0
    assert int(qualifying_pairs(pred, settings, capacity).max()) <= capacity  # the buffer held them


def test_a_tie_at_the_kth_place_keeps_the_lower_class_then_anchor():
    # As in tests/ops/test_nms_op.py: of four pairs scoring 0.5 for two places, class 0 anchor 2
    # and class 1 anchor 0 go on, after the 0.75 at class 2 anchor 2.
    pred = torch.zeros(1, 7, 3)
    pred[0, :4] = torch.tensor([[1.0, 2.0, 3.0], [10.0] * 3, [8.0] * 3, [8.0] * 3])
    pred[0, 5, 0] = pred[0, 4, 2] = pred[0, 5, 1] = pred[0, 6, 0] = 0.5
    pred[0, 6, 2] = 0.75
    boxes, scores, classes, valid = fused_candidates(pred.to(DEVICE), NmsSettings(conf=0.1, topk=3, max_det=3))
    assert valid.all() and scores[0].tolist() == [0.75, 0.5, 0.5] and classes[0].tolist() == [2, 0, 1]
    assert (boxes[0, :, 0].cpu() + 4).tolist() == [3.0, 3.0, 1.0]


@pytest.mark.parametrize("fill", ["sparse", "dense"])
def test_nan_hides_its_anchors_other_classes(fill):
    # sparse: fewer anchors over conf than K, so NaN anchors fill places at the two-level stage's
    # first level; dense: they do not.
    pred = sigmoid_head(5, batch=2, classes=6, anchors=120, centre=-4.0 if fill == "sparse" else 2.0)
    pred[0, 4, :5] = float("nan")  # anchors 0..4: class 0 NaN, their class 1 over conf, hidden
    pred[0, 5, :5] = 0.9
    pred[1, 9, 7] = float("nan")
    settings = NmsSettings(conf=0.25, topk=64, max_det=64)
    over = (pred[:, 4:] > 0.25).any(1).sum(1)
    assert bool((over < 64).all()) if fill == "sparse" else bool((over > 64).all())
    assert_fused_equals_two_level(pred, settings, 256)
    without = pred.clone()
    without[0, 4:, :5] = without[1, 4:, 7] = 0.0
    e_scores, e_classes, _, e_valid = sorted_candidates(without, settings)
    _, scores, classes, valid = fused_candidates(pred.to(DEVICE), settings, 256)
    assert torch.equal(valid.cpu(), e_valid) and torch.equal(scores.cpu()[valid.cpu()], e_scores[e_valid])
    assert torch.equal(classes.cpu()[valid.cpu()], e_classes[e_valid])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_more_qualifying_pairs_than_the_buffer_take_the_exact_path(dtype):
    # Every class of an anchor scores alike, so the pairs at or over the K-th anchor's score are
    # about C·K, more than the 16 slots: the kernel finds the K-th key by bisection instead.
    pred = grid_head(6, batch=2, classes=4, anchors=24, levels=6)
    pred[:, 5:] = pred[:, 4:5]  # ties at the K-th place too
    pred[1, 4:, 3] = 0.9  # image 1: one anchor above all the others
    pred = pred.to(dtype)
    settings = NmsSettings(conf=0.1, topk=12, max_det=12)
    assert int(qualifying_pairs(pred, settings, 16)[0]) > 16
    assert assert_fused_equals_two_level(pred, settings, 16) == 2 * 12
    few_anchors = NmsSettings(conf=0.1, topk=16, max_det=16)  # floor 0: every pair over conf qualifies
    assert int(qualifying_pairs(pred[:, :, :8], few_anchors, 16).min()) > 16
    assert assert_fused_equals_two_level(pred[:, :, :8], few_anchors, 16) == 2 * 16


def test_the_fused_tactic_is_offered_on_cuda_only_and_runs_by_name():
    class CudaHead:  # what batched_nms_tactics reads of a CUDA head, without a GPU
        shape, dtype, is_cuda = torch.Size((32, 84, 8400)), torch.float16, True

        def dim(self):
            return 3

        def numel(self):
            return 32 * 84 * 8400

    attrs = NmsSettings().to_json()
    assert FUSED_TRITON in batched_nms_tactics([CudaHead()], attrs)
    assert FUSED_TRITON not in batched_nms_tactics([torch.zeros(2, 84, 100)], attrs)
    assert parse_tactic(FUSED_TRITON).FAMILY == FUSED_TRITON
    pred = sigmoid_head(7, batch=2, classes=5, anchors=150, centre=-1.0)
    for agnostic in (False, True):
        settings = NmsSettings(conf=0.25, iou=0.5, max_det=20, topk=40, agnostic=agnostic)
        attrs = dict(settings.to_json(), tactic=FUSED_TRITON)
        got = tuple(t.cpu() for t in batched_nms_op([pred.to(DEVICE)], attrs))
        for tactic in (REFERENCE, TWO_LEVEL):  # distinct scores: the flat stage agrees too
            for g, e in zip(got, batched_nms_op([pred], dict(attrs, tactic=tactic))):
                assert g.dtype == e.dtype and torch.equal(g, e)
        if int((pred[:, 4:] > 0.25).sum((1, 2)).max()) <= settings.topk:
            assert_equal_to_torchvision(pred, settings, got)
