"""`sartor build --input-format uint8:HxW`: the summary and `inspect` say the engine takes raw
frames; `sartor run` feeds it frames, and frames of another size are refused in one line; a bad
or incomplete --input-format exits 2 in one line, before anything is built."""
from __future__ import annotations

import json

import numpy as np
from conftest import IMAGE, assert_cli_error

SHAPES = ["--min-shapes", f"images:1x3x{IMAGE}x{IMAGE}", "--opt-shapes", f"images:2x3x{IMAGE}x{IMAGE}",
          "--max-shapes", f"images:4x3x{IMAGE}x{IMAGE}"]
SPEC = f"letterbox={IMAGE},mean=0,std=255,rgb,nchw"


def test_build_inspect_and_run_an_engine_of_raw_frames(tiny_onnx, tmp_path, cli):
    plan = tmp_path / "frames.plan"
    result = cli("build", tiny_onnx, "-o", plan, "--device", "cpu", *SHAPES, "--preprocess", SPEC,
                 "--input-format", "uint8:24x40:bgr")
    assert result.code == 0, result
    assert "raw frames uint8:24x40:bgr" in result.out and "frames 1x24x40x3..4x24x40x3" in result.out
    result = cli("inspect", plan)
    assert result.code == 0, result
    assert "raw frames uint8:24x40:bgr (N×H×W×3), preprocessed by the first layer" in result.out
    info = json.loads(cli("inspect", plan, "--json").out)
    assert info["input_format"]["size"] == [24, 40] and info["input_format"]["order"] == "bgr"
    assert [(v["name"], v["dtype"]) for v in info["inputs"]] == [("frames", "uint8")]
    assert info["layers"][0]["op"] == "Preprocess"

    frames = np.random.default_rng(0).integers(0, 256, (2, 24, 40, 3), dtype=np.uint8)
    np.save(tmp_path / "frames.npy", frames)
    result = cli("run", plan, "--input", f"frames={tmp_path / 'frames.npy'}")
    assert result.code == 0, result
    np.save(tmp_path / "small.npy", frames[:, :20])
    assert_cli_error(cli("run", plan, "--input", f"frames={tmp_path / 'small.npy'}"), "20x40 frames",
                     "24x40x3 uint8 frames", "--input-format uint8:24x40:bgr")


def test_bad_input_formats_exit_2_in_one_line(tiny_onnx, tmp_path, cli):
    plan = tmp_path / "x.plan"
    assert_cli_error(cli("build", tiny_onnx, "-o", plan, "--device", "cpu", *SHAPES, "--input-format", "uint8:24x40"),
                     "--input-format uint8:24x40 needs --preprocess")
    assert_cli_error(cli("build", tiny_onnx, "-o", plan, "--device", "cpu", *SHAPES, "--preprocess", SPEC,
                         "--input-format", "uint8:24by40"), "HxW")
    assert not plan.exists()
