"""BatchedNms (`sartor build --nms`) against torchvision: with fewer candidates over the threshold
than topk, the kept boxes, their order and their scores and classes equal `batched_nms` run on the
same candidates, ties included; the topk cap; the settings' parser and its one-line refusals."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from nms_helpers import assert_equal_to_torchvision, grid_head, sorted_candidates, torchvision_kept
from torchvision.ops import batched_nms

from sartor.errors import ConfigError
from sartor.ops import default_registry
from sartor.ops.nms import (
    OUTPUT_NAMES,
    TWO_LEVEL,
    NmsSettings,
    batched_nms_reference,
    batched_nms_tactics,
    corner_boxes,
    flat_candidates,
    nms_candidates,
    parse_nms,
    threshold_in,
    two_level_candidates,
)

# torchvision's batched_nms offsets each class's boxes (float32) up to this many candidates on the
# CPU and runs one NMS; over it, NMS per class and an unstable sort of the kept ones by score.
COORDINATE_TRICK_MAX = 1000


@pytest.mark.parametrize("two_level", [False, True])
@pytest.mark.parametrize("agnostic", [False, True])
@pytest.mark.parametrize("seed,classes,iou", [(0, 80, 0.45), (1, 20, 0.7), (2, 3, 0.3)])
def test_kept_boxes_equal_torchvision_on_random_heads_with_ties(seed, classes, iou, agnostic, two_level):
    pred = grid_head(seed, batch=3, classes=classes, anchors=400, levels=100)
    # some 600 candidates an image: under the coordinate-trick limit, where torchvision has one order
    conf = math.floor((1 - 600 / (classes * 400)) * 100) / 100
    settings = NmsSettings(conf=conf, iou=iou, max_det=300, topk=1000, agnostic=agnostic)
    candidates = (pred[:, 4:] > conf).sum((1, 2))
    assert 50 < int(candidates.min()) and int(candidates.max()) <= COORDINATE_TRICK_MAX
    kept = assert_equal_to_torchvision(pred, settings, batched_nms_reference(pred, settings, two_level))
    assert kept > 30


def test_ties_are_broken_by_class_then_anchor_as_torchvision_does():
    # Three identical boxes with the same score: class 1 anchor 0, class 0 anchor 2, class 0 anchor 1.
    pred = torch.zeros(1, 6, 3)
    pred[0, :4] = torch.tensor([[10.0], [10.0], [8.0], [8.0]])
    pred[0, 4, 1] = pred[0, 4, 2] = pred[0, 5, 0] = 0.5
    count, _, scores, classes = batched_nms_reference(pred, NmsSettings(conf=0.1, iou=0.5, agnostic=True, max_det=5))
    assert int(count[0]) == 1 and int(classes[0, 0]) == 0 and float(scores[0, 0]) == 0.5  # the first tie kept
    keep = batched_nms(torch.tensor([[6.0, 6, 14, 14]] * 3), torch.full((3,), 0.5), torch.zeros(3, dtype=torch.long),
                       0.5)
    assert keep.tolist() == [0]  # torchvision too keeps the first of equal candidates
    count, _, _, classes = batched_nms_reference(pred, NmsSettings(conf=0.1, iou=0.5, max_det=5))
    assert int(count[0]) == 2 and classes[0, :2].tolist() == [0, 1]


def test_more_candidates_than_the_coordinate_trick_keep_the_same_set_in_stable_order():
    # Over 1000 candidates torchvision runs NMS per class and orders the kept boxes of equal score
    # as its unstable sort leaves them; the set is the same, ours in (score, class, anchor) order.
    pred = grid_head(3, batch=2, classes=20, anchors=500)
    settings = NmsSettings(conf=0.7, iou=0.45, max_det=4000, topk=4096)
    assert int((pred[:, 4:] > 0.7).sum((1, 2)).min()) > COORDINATE_TRICK_MAX
    count, boxes, scores, classes = batched_nms_reference(pred, settings)
    for b, (e_boxes, e_scores, e_classes) in enumerate(torchvision_kept(pred, settings)):
        n = int(count[b])
        assert n == len(e_scores)
        ours = sorted(zip(classes[b, :n].tolist(), boxes[b, :n].tolist()))
        assert ours == sorted(zip(e_classes.tolist(), e_boxes.tolist()))
        assert torch.all(scores[b, :n][:-1] >= scores[b, :n][1:])


def test_max_det_keeps_the_first_kept_boxes():
    pred = grid_head(4, batch=2, classes=10, anchors=300)
    settings = NmsSettings(conf=0.75, iou=0.45, max_det=7, topk=1000)
    assert_equal_to_torchvision(pred, settings, batched_nms_reference(pred, settings))
    assert batched_nms_reference(pred, settings)[0].tolist() == [7, 7]


def test_above_topk_only_the_best_candidates_are_suppressed():
    g = torch.Generator().manual_seed(5)
    pred = grid_head(5, batch=1, classes=4, anchors=300)
    pred[:, 4:] = torch.rand((1, 4, 300), generator=g)  # distinct scores: the topk best are one set
    settings = NmsSettings(conf=0.1, iou=0.5, max_det=100, topk=200)
    assert int((pred[:, 4:] > 0.1).sum()) > 1000
    got = batched_nms_reference(pred, settings)
    floor = pred[0, 4:].flatten().topk(200).values[-1]
    capped = pred.clone()
    capped[:, 4:] = torch.where(pred[:, 4:] >= floor, pred[:, 4:], torch.zeros(()))
    assert_equal_to_torchvision(capped, NmsSettings(conf=0.1, iou=0.5, max_det=100, topk=4096), got)


def test_an_image_without_candidates_has_count_zero_and_zero_slots():
    pred = grid_head(6, batch=2, classes=3, anchors=50)
    pred[1, 4:] = 0.0
    count, boxes, scores, classes = batched_nms_reference(pred, NmsSettings(conf=0.5, max_det=10, topk=20))
    assert int(count[1]) == 0 and not boxes[1].any() and not scores[1].any() and not classes[1].any()
    assert int(count[0]) > 0


def test_candidates_are_sorted_valid_first_with_boxes_as_corners():
    pred = grid_head(7, batch=1, classes=5, anchors=100)
    boxes, scores, classes, valid = nms_candidates(pred, NmsSettings(conf=0.5, topk=600))
    n = int(valid.sum())
    assert valid[0, :n].all() and not valid[0, n:].any() and n == int((pred[:, 4:] > 0.5).sum())
    assert torch.all(scores[0, :-1] >= scores[0, 1:]) and 0 <= int(classes.min()) and int(classes.max()) < 5
    assert torch.all(boxes[..., 2] >= boxes[..., 0]) and torch.all(boxes[..., 3] >= boxes[..., 1])


def test_the_op_is_registered_with_its_tactics():
    opdef = default_registry()["BatchedNms"]
    assert opdef.tactics is batched_nms_tactics and not opdef.data_dependent_shape
    pred = grid_head(8, batch=2, classes=3, anchors=40)
    attrs = NmsSettings(conf=0.5, max_det=4, topk=50).to_json()
    assert batched_nms_tactics([pred], attrs) == ["torch", TWO_LEVEL]  # the Triton ones are offered on CUDA only
    for tactic in ("torch", TWO_LEVEL):
        outputs = opdef.impl([pred], dict(attrs, tactic=tactic))
        assert len(outputs) == len(OUTPUT_NAMES)
        assert_equal_to_torchvision(pred, NmsSettings(conf=0.5, max_det=4, topk=50), outputs)


def test_fp16_heads_are_suppressed_in_float32():
    pred = grid_head(9, batch=2, classes=6, anchors=200)
    settings = NmsSettings(conf=0.8, iou=0.45, max_det=50, topk=500)
    half = batched_nms_reference(pred.half(), settings)
    assert half[1].dtype == torch.float32
    assert_equal_to_torchvision(pred.half().float(), settings, half)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_the_threshold_in_a_narrow_dtype_tests_every_value_as_float32_does(dtype):
    """Candidates are ranked in the head's dtype: for every finite value of it, `x > threshold_in`
    there equals float32(x) > float32(conf), including confs that round up into the dtype (0.3)."""
    values = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16).view(dtype)
    values = values[torch.isfinite(values)]
    for conf in (0.25, 0.3, 0.001, 1 / 3, 0.999, 0.0, 1e-8):
        expected = values.float() > torch.tensor(conf, dtype=torch.float32)
        assert torch.equal(values > threshold_in(conf, dtype), expected), conf
    assert threshold_in(0.3, torch.float16) < 0.3 < float(torch.tensor(0.3).half())


def test_fp16_heads_near_the_threshold_keep_what_float32_keeps():
    pred = grid_head(4, batch=2, classes=5, anchors=300)
    pred[:, 4:] *= 0.29  # under conf but for the two below
    rounded_up = float(torch.tensor(0.3).half())  # float16's 0.3 is above float32's: these count
    pred[:, 4, ::3] = rounded_up
    pred[:, 5, 1::3] = threshold_in(0.3, torch.float16)  # and these do not
    settings = NmsSettings(conf=0.3, iou=0.45, max_det=300, topk=1000)
    half = batched_nms_reference(pred.half(), settings)
    assert_equal_to_torchvision(pred.half().float(), settings, half)
    assert rounded_up in half[2][0].tolist()



# ---- the two-level candidates ----------------------------------------------------------------

def valid_candidates(candidates: tuple) -> tuple:
    boxes, scores, classes, valid = candidates
    return valid, boxes[valid], scores[valid], classes[valid]


def assert_candidates_exact(pred: torch.Tensor, settings: NmsSettings) -> int:
    """The two-level stage's valid candidates are a full stable sort's first K (ties at the K-th
    place to the lower (class, anchor)), and the flat stage's where no image ties there."""
    two = two_level_candidates(pred, settings)
    valid, _, scores, classes = valid_candidates(two)
    e_scores, e_classes, e_anchors, e_valid = sorted_candidates(pred, settings)
    assert torch.equal(valid, e_valid)
    assert torch.equal(scores, e_scores[e_valid]) and torch.equal(classes, e_classes[e_valid])
    boxes = corner_boxes(pred, e_classes * pred.shape[2] + e_anchors)[e_valid]
    assert torch.equal(two[0][valid], boxes)
    assert torch.all(two[1][valid] > settings.conf)
    assert torch.all(two[1][~valid] == -1.0)
    k = e_scores.shape[1]
    all_scores = torch.where(pred[:, 4:].flatten(1) > threshold_in(settings.conf, pred.dtype),
                             pred[:, 4:].flatten(1).float(), -1.0).sort(dim=1, descending=True).values
    tied = k < all_scores.shape[1] and bool(((all_scores[:, k - 1] == all_scores[:, k]) & (all_scores[:, k] > -1)).any())
    if not tied:
        for got, expected in zip(valid_candidates(flat_candidates(pred, settings)), valid_candidates(two)):
            assert torch.equal(got, expected)
    return int(valid.sum())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("classes,anchors,levels,conf,topk", [
    (80, 400, 20, 0.5, 1000),    # heavy ties, far more pairs over conf than K (a tie at the K-th place)
    (80, 400, 100, 0.9, 1000),   # ~3000 over conf, ties
    (20, 300, 1000, 0.99, 300),  # fewer over conf than K: invalid slots
    (3, 50, 5, 0.1, 1000),       # K ≥ C·A (K > A)
    (2, 5, 3, 0.0, 4096),        # tiny C·A, conf 0
    (1, 3000, 1000, 0.2, 1000),  # one class: the anchor level alone decides
    (80, 2000, 10, 0.95, 50),    # nothing over conf
])
def test_two_level_candidates_are_the_first_k_of_a_full_stable_sort(classes, anchors, levels, conf, topk, dtype):
    for seed in range(3):
        pred = grid_head(seed, batch=2, classes=classes, anchors=anchors, levels=levels).to(dtype)
        assert_candidates_exact(pred, NmsSettings(conf=conf, topk=topk, max_det=min(300, topk)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_two_level_candidates_equal_the_flat_ones_on_distinct_scores(dtype):
    g = torch.Generator().manual_seed(11)
    pred = grid_head(11, batch=3, classes=80, anchors=2000)
    pred[:, 4:] = torch.sigmoid(torch.randn((3, 80, 2000), generator=g) * 2 - 3)  # ~5000 over conf an image
    pred = pred.to(dtype)
    settings = NmsSettings(conf=0.25, topk=1000)
    assert int((pred[:, 4:] > 0.25).sum((1, 2)).min()) > 1000
    assert assert_candidates_exact(pred, settings) == 3 * 1000
    assert_candidates_exact(pred[:, :, :300], NmsSettings(conf=0.25, topk=4096))  # all valid: K-th place irrelevant


def test_a_tie_at_the_kth_place_keeps_the_lower_class_then_anchor():
    # Four pairs score 0.5 for K = 3 places: (class 1, anchor 0), (class 0, anchor 2), (class 1, anchor 1),
    # (class 2, anchor 0); one scores 0.75 at (class 2, anchor 2). The two kept at 0.5: class 0 anchor 2,
    # then class 1 anchor 0.
    pred = torch.zeros(1, 7, 3)
    pred[0, :4] = torch.tensor([[1.0, 2.0, 3.0], [10.0] * 3, [8.0] * 3, [8.0] * 3])  # cx tells the anchor
    pred[0, 5, 0] = pred[0, 4, 2] = pred[0, 5, 1] = pred[0, 6, 0] = 0.5
    pred[0, 6, 2] = 0.75
    boxes, scores, classes, valid = two_level_candidates(pred, NmsSettings(conf=0.1, topk=3, max_det=3))
    assert valid.all() and scores[0].tolist() == [0.75, 0.5, 0.5] and classes[0].tolist() == [2, 0, 1]
    assert (boxes[0, :, 0] + 4).tolist() == [3.0, 3.0, 1.0]  # anchors 2, 2, 0


def test_a_nan_hides_its_anchors_other_classes_also_where_the_anchor_fills_a_place():
    # Fewer anchors over conf than K: the first level fills its places with anchors under conf,
    # anchor 0 (a NaN at class 0) among them; its class 1 at 0.9 stays hidden all the same.
    pred = torch.zeros(1, 7, 10)
    pred[0, :4] = 5.0
    pred[0, 4, 0] = float("nan")
    pred[0, 5, 0] = 0.9
    pred[0, 6, 5] = 0.8
    _, scores, classes, valid = two_level_candidates(pred, NmsSettings(conf=0.5, topk=4, max_det=4))
    assert valid[0].tolist() == [True, False, False, False]
    assert scores[0, 0] == pred[0, 6, 5] and int(classes[0, 0]) == 2


def test_two_level_candidates_keep_the_float32_threshold_for_fp16_heads():
    pred = grid_head(4, batch=2, classes=5, anchors=300)
    pred[:, 4:] *= 0.29
    pred[:, 4, ::3] = float(torch.tensor(0.3).half())  # float16's 0.3 is above float32's: over conf
    pred[:, 5, 1::3] = threshold_in(0.3, torch.float16)  # under
    settings = NmsSettings(conf=0.3, topk=1000)
    _, _, _, valid = two_level_candidates(pred.half(), settings)
    assert int(valid.sum()) == int((pred.half().float()[:, 4:] > torch.tensor(0.3)).sum()) > 0
    assert_equal_to_torchvision(pred.half().float(), settings, batched_nms_reference(pred.half(), settings, True))


# ---- the settings -----------------------------------------------------------------------------

def test_parse_nms_reads_every_field_in_any_order():
    assert parse_nms("conf=0.3,iou=0.5,max_det=100,topk=2000,agnostic") == NmsSettings(0.3, 0.5, 100, 2000, True)
    assert parse_nms("max-det=10, iou=0.6") == NmsSettings(iou=0.6, max_det=10)
    assert parse_nms("") == NmsSettings()
    assert NmsSettings.from_json(parse_nms("topk=64,max_det=64").to_json()) == NmsSettings(topk=64, max_det=64)


@pytest.mark.parametrize("spec,fragment", [
    ("conf=1.5", "conf=1.5 must be in [0, 1)"),
    ("conf=nan", "conf=nan must be in [0, 1)"),
    ("iou=0", "iou=0 must be in (0, 1]"),
    ("iou=abc", "iou needs a number, not 'abc'"),
    ("max_det=2.5", "max_det needs a whole number"),
    ("max_det=0", "max_det=0 must be in 1..topk"),
    ("max_det=500,topk=300", "max_det=500 must be in 1..topk (300)"),
    ("topk=5000", "topk=5000 must be in 1..4096"),
    ("threshold=0.3", "'threshold=0.3' is not one of conf=X, iou=X, max_det=N, topk=N, agnostic"),
    ("class-agnostic", "is not one of"),
])
def test_bad_settings_are_refused_in_one_line(spec, fragment):
    with pytest.raises(ConfigError) as info:
        parse_nms(spec)
    message = str(info.value)
    assert fragment in message and "\n" not in message and message.startswith("--nms")


@pytest.mark.parametrize("two_level", [False, True])
def test_sample_detector_outputs_are_suppressed_as_torchvision_does(sample_head, two_level):
    settings = NmsSettings(conf=0.25, iou=0.45, max_det=300, topk=1000)
    got = batched_nms_reference(sample_head, settings, two_level)
    assert assert_equal_to_torchvision(sample_head, settings, got) > 10
    low = NmsSettings(conf=0.05, iou=0.6, max_det=100, topk=4096)
    assert int((sample_head[:, 4:] > 0.05).sum((1, 2)).max()) < 4096
    assert_equal_to_torchvision(sample_head, low, batched_nms_reference(sample_head, low, two_level))
    for head in (sample_head, sample_head.half()):  # the candidates themselves, the K-th place included
        assert_candidates_exact(head, NmsSettings(conf=0.01, topk=300))


@pytest.fixture(scope="module")
def sample_head(tmp_path_factory) -> torch.Tensor:
    """The shipped sample detector's raw head on rendered scenes, through ONNX Runtime."""
    import subprocess
    import sys
    from pathlib import Path

    import onnxruntime as ort

    from sartor.data.datasets import iterate_batches, open_dataset
    from sartor.data.preprocess import parse_preprocess
    root = Path(__file__).resolve().parents[2]
    out = tmp_path_factory.mktemp("scenes")
    subprocess.run([sys.executable, str(root / "samples/detector/make_dataset.py"), str(out), "--count", "6",
                    "--seed", "20000001", "--night-fraction", "0.5", "--workers", "1"],
                   check=True, capture_output=True, timeout=300)
    dataset = open_dataset(out / "annotations.json")
    arrays, _, _ = next(iterate_batches(dataset.samples, parse_preprocess("letterbox=320,mean=0,std=255,rgb,nchw"), 6))
    session = ort.InferenceSession(str(root / "samples/detector/sample_detector.onnx"),
                                   providers=["CPUExecutionProvider"])
    (head,) = session.run(["output0"], {"images": np.ascontiguousarray(arrays, dtype=np.float32)})
    return torch.from_numpy(head)


def test_the_builders_check_takes_nms_outputs_equal_or_not_at_all():
    from sartor.tactics import select
    pred = grid_head(10, batch=2, classes=4, anchors=60)
    reference = batched_nms_reference(pred, NmsSettings(conf=0.5, max_det=10, topk=100))
    assert select._mismatch(tuple(t.clone() for t in reference), reference) is None
    other_class = list(reference)
    other_class[3] = reference[3].clone()
    other_class[3][0, 0] += 1
    assert select._mismatch(tuple(other_class), reference) == "output 3: integer output differs from reference"
    assert select._mismatch(reference[:3], reference) == "4 outputs expected"
    moved = list(reference)
    moved[1] = reference[1] + 1.0
    assert select._mismatch(tuple(moved), reference).startswith("output 1: output differs from reference")
