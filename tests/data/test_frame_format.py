"""`--input-format uint8:HxW[:bgr]` read into a FrameFormat, written back, stored and refused."""
from __future__ import annotations

import pytest

from sartor.data.frame_format import FrameFormat, parse_frame_format
from sartor.errors import ConfigError


@pytest.mark.parametrize("text,size,order", [("uint8:720x1280", (720, 1280), "rgb"),
                                             ("UINT8:480x640:BGR", (480, 640), "bgr"),
                                             ("uint8:1x1:rgb", (1, 1), "rgb")])
def test_formats_parse_describe_and_round_trip(text, size, order):
    frames = parse_frame_format(text)
    assert (frames.size, frames.order, frames.shape(4)) == (size, order, (4, *size, 3))
    assert parse_frame_format(frames.describe()) == frames
    assert FrameFormat.from_json(frames.to_json()) == frames


@pytest.mark.parametrize("text,fragment", [("uint8", "expected uint8:HxW"), ("rgb8:720x1280", "expected uint8:HxW"),
                                           ("uint8:720", "HxW"), ("uint8:0x1280", "positive"),
                                           ("uint8:720x1280:yuv", "'yuv'"), ("uint8:720x1280:bgr:x", "expected")])
def test_bad_formats_are_one_config_error(text, fragment):
    with pytest.raises(ConfigError, match=fragment) as caught:
        parse_frame_format(text)
    assert "\n" not in str(caught.value)


def test_a_malformed_record_is_a_config_error():
    for record in ({"size": [720]}, {"size": [720], "order": "rgb", "name": "frames"},
                   {"size": [720, 1280], "order": "yuv", "name": "frames"}):
        with pytest.raises(ConfigError, match="malformed"):
            FrameFormat.from_json(record)
