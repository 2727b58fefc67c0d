"""bench/h200_serve.py --profile: a model served from an engine of another batch range (the sample
detector's 1-32 holds four 8-image requests per batch), its offline batches and its errors."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

pytest.importorskip("torchvision")  # h200_models, which h200_serve imports, exports torchvision models
from h200_serve import MODELS, parse_profiles, with_profile  # noqa: E402


def test_a_profile_sets_the_engine_range_and_the_offline_batches():
    assert parse_profiles("detector=64/128, resnet50=32/64") == {"detector": (64, 128), "resnet50": (32, 64)}
    spec = with_profile(MODELS["detector"], 64, 128)
    assert (spec["opt_batch"], spec["max_batch"]) == (64, 128)
    assert spec["batches"] == (1, 8, 32, 64, 128)  # the default batches kept, OPT and MAX added
    assert with_profile(MODELS["resnet50"], 8, 16)["batches"] == (1, 8, 16)  # none past MAX
    assert MODELS["detector"]["max_batch"] == 32  # the default spec is left as it was


def test_no_profile_is_the_defaults():
    assert parse_profiles("") == {}


@pytest.mark.parametrize("text", ["detector=128/64", "detector=0/8", "detector=64", "yolo=8/16", "detector=a/b"])
def test_a_bad_profile_says_what_is_expected(text):
    with pytest.raises(ValueError, match=r"NAME=OPT/MAX with NAME one of resnet50, detector, yolov8n and 1 <= OPT <= MAX"):
        parse_profiles(text)
