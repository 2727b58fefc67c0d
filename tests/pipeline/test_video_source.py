"""Video files as a pipeline source, on the CPU: clips encoded here with PyAV (H.264 and H.265),
decoded by `VideoSource` (frame count, size, pixels near the source frames, names), truncated and
corrupt clips (one error naming the file and the frame; the frames before it still run), several
streams decoded at once (`ConcurrentStreams`), and `Pipeline.run(clip)`."""
from __future__ import annotations

import threading

import numpy as np
import pytest
from conftest import MAX_SHAPES, MIN_SHAPES, OPT_SHAPES
from video_helpers import (
    FPS,
    HEIGHT,
    WIDTH,
    clip_frames,
    truncated_copy,
    write_audio_only,
    write_clip,
)

import sartor
from sartor.errors import ConfigError, DataError
from sartor.pipeline import Pipeline
from sartor.pipeline.streams import ConcurrentStreams
from sartor.pipeline.video import VideoSource, choose_video_decoder

FRAMES = 30


@pytest.fixture(scope="module")
def source_frames():
    return clip_frames(FRAMES)


@pytest.fixture(scope="module")
def clips(tmp_path_factory, source_frames):
    folder = tmp_path_factory.mktemp("clips")
    return {"h264": write_clip(folder / "clip.mp4", source_frames),
            "h265": write_clip(folder / "clip_hevc.mp4", source_frames, codec="libx265"),
            "faststart": write_clip(folder / "clip_faststart.mp4", source_frames, faststart=True)}


@pytest.mark.parametrize("kind", ["h264", "h265"])
def test_a_clip_decodes_to_its_frames_named_by_index_and_time(clips, source_frames, kind):
    items = list(VideoSource(clips[kind]))
    assert len(items) == FRAMES and all(item.error is None for item in items)
    assert items[0].name == f"{clips[kind]} frame 0 (0.000 s)"
    assert items[FRAMES - 1].name == f"{clips[kind]} frame {FRAMES - 1} ({(FRAMES - 1) / FPS:.3f} s)"
    for item, source in zip(items, source_frames):
        assert item.frame.shape == (HEIGHT, WIDTH, 3)
        apart = np.abs(item.frame.numpy().astype(np.int16) - source)
        # 4:2:0 chroma and the encoder's quantisation: close, never equal everywhere
        assert apart.mean() < 3 and apart.max() <= 16, (item.name, apart.mean(), apart.max())


@pytest.mark.parametrize("fraction", [0.6, 0.9])
def test_a_truncated_clip_ends_with_one_error_naming_the_file_and_frame(clips, tmp_path, fraction):
    cut = truncated_copy(clips["faststart"], tmp_path / "cut.mp4", fraction)
    items = list(VideoSource(cut, name="camera 3"))
    *good, last = items
    assert 0 < len(good) < FRAMES and all(item.error is None for item in good)
    assert last.error == f"video camera 3 is truncated at frame {len(good)}: its index lists {FRAMES} frames"
    assert last.name == f"camera 3 frame {len(good)}"


def test_a_corrupt_clip_ends_where_the_decoder_fails(clips, tmp_path):
    data = bytearray(clips["faststart"].read_bytes())
    at = int(len(data) * 0.7)  # past the index and the first frames' data
    data[at:at + 200] = bytes(200)
    broken = tmp_path / "broken.mp4"
    broken.write_bytes(bytes(data))
    *good, last = list(VideoSource(broken))
    assert 0 < len(good) < FRAMES
    assert last.error.startswith(f"video {broken} is corrupt or truncated at frame {len(good)}: ")


def test_unreadable_videos_are_one_failed_item(clips, tmp_path):
    junk = tmp_path / "junk.mp4"
    junk.write_bytes(b"not a video" * 20)
    no_index = truncated_copy(clips["h264"], tmp_path / "no_index.mp4", 0.5)  # index at the end, cut off
    invalid = "is corrupt, truncated or not a video: Invalid data found when processing input"
    expected = {junk: invalid, no_index: invalid,
                write_audio_only(tmp_path / "sound.mp4"): "has no video stream (not a video, or truncated before "
                                                          "its index)",
                tmp_path / "missing.mp4": "does not exist", tmp_path: "is a directory, not a video file"}
    for path, why in expected.items():
        (item,) = list(VideoSource(path))
        assert item.frame is None and item.error == f"video {path} {why}"


def test_video_decoder_choice_is_refused_where_it_cannot_run():
    assert choose_video_decoder("auto", "cpu") == "pyav" and choose_video_decoder("pyav", "cpu") == "pyav"
    with pytest.raises(ConfigError, match="video decoder 'nvdec' decodes into GPU memory: the engine's device is cpu"):
        choose_video_decoder("nvdec", "cpu")
    with pytest.raises(ConfigError, match="video decoder 'ffmpeg' is not one of auto, pyav, nvdec"):
        choose_video_decoder("ffmpeg", "cpu")


# ---- several streams at once ---------------------------------------------------------------------

def test_concurrent_streams_merge_every_frame_keeping_each_streams_order(clips):
    streams = ConcurrentStreams([VideoSource(clips["h264"], name="a"), VideoSource(clips["h265"], name="b"),
                                 VideoSource(clips["h264"], name="c")], prefetch=2)
    names = [item.name for item in streams]
    assert len(names) == 3 * FRAMES and set(streams.decoded_at) == set(names)
    for label in "abc":
        indices = [int(n.split(" frame ")[1].split()[0]) for n in names if n.startswith(f"{label} frame")]
        assert indices == list(range(FRAMES))


def _stream_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("sartor-stream-")]


def test_closing_early_stops_every_decoder_and_errors_reach_the_consumer(clips):
    frames = iter(ConcurrentStreams([VideoSource(clips["h264"])] * 3, prefetch=1))
    next(frames)
    frames.close()
    assert _stream_threads() == []

    def failing():
        yield from VideoSource(clips["h264"], name="ok")
        raise RuntimeError("camera unplugged")

    with pytest.raises(RuntimeError, match="camera unplugged"):
        list(ConcurrentStreams([failing(), VideoSource(clips["h264"])]))
    assert _stream_threads() == []


# ---- Pipeline over a video -----------------------------------------------------------------------

@pytest.fixture(scope="module")
def letterbox_engine(tmp_path_factory, tiny_onnx):
    out = tmp_path_factory.mktemp("video") / "tiny.plan"
    sartor.build(tiny_onnx, out, device="cpu", min_shapes=MIN_SHAPES, opt_shapes=OPT_SHAPES, max_shapes=MAX_SHAPES,
                 preprocess="letterbox=16,mean=0,std=255,rgb,nchw")
    return sartor.load(out, device="cpu")


def test_pipeline_runs_a_video_path_as_its_decoded_frames(letterbox_engine, clips):
    from_video = Pipeline(letterbox_engine, batch_size=4).run(str(clips["h264"]))
    decoded = [item.frame.numpy() for item in VideoSource(clips["h264"])]
    from_frames = Pipeline(letterbox_engine, batch_size=4).run(decoded)
    assert [r.name for r in from_video] == [item.name for item in VideoSource(clips["h264"])]
    assert all(r.error is None for r in from_video) and from_video[0].meta.orig_size == (HEIGHT, WIDTH)
    np.testing.assert_array_equal(np.stack([r.outputs["logits"] for r in from_video]),
                                  np.stack([r.outputs["logits"] for r in from_frames]))


def test_a_truncated_video_runs_its_good_frames_then_fails_or_is_skipped(letterbox_engine, clips, tmp_path):
    cut = truncated_copy(clips["faststart"], tmp_path / "cut.mp4", 0.6)
    good = len(list(VideoSource(cut))) - 1
    skipped = Pipeline(letterbox_engine, batch_size=4, skip_bad=True).run(VideoSource(cut))
    assert [r.error is None for r in skipped] == [True] * good + [False]
    assert skipped[-1].error == f"video {cut} is truncated at frame {good}: its index lists {FRAMES} frames"
    ran = []
    with pytest.raises(DataError, match=rf"video {cut} is truncated at frame {good}.*skip_bad=True runs the others"):
        ran.extend(Pipeline(letterbox_engine, batch_size=4).stream(cut))
    assert len(ran) == good // 4 * 4  # every whole batch before the failing one ran
    assert _stream_threads() == []  # the decoder thread stopped with the error


def test_a_pipeline_stopped_early_stops_its_decoder(letterbox_engine, clips):
    results = Pipeline(letterbox_engine, batch_size=2).stream(clips["h264"])
    next(results)
    assert len(_stream_threads()) == 1
    results.close()
    assert _stream_threads() == []
