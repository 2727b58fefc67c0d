"""The `Preprocess` op (ops/preprocess.py), the first layer of a raw-frames engine: its torch
reference against the CPU reference (Pillow), its Triton tactic against the reference (through the
interpreter on CPU), and which tactics it offers where."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from sartor.data.preprocess import parse_preprocess, preprocess_image
from sartor.kernels.preprocess.letterbox import PREPROCESS_TILES
from sartor.ops import default_registry
from sartor.ops.preprocess import preprocess, preprocess_tactics
from sartor.ops.quantized import quantize

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SPEC = "letterbox=32,mean=123.675:116.28:103.53,std=58.395:57.12:57.375,rgb,nchw,dtype=float16"


def frames(count: int = 2, size=(37, 53), seed: int = 0) -> torch.Tensor:
    return torch.from_numpy(np.random.default_rng(seed).integers(0, 256, (count, *size, 3), dtype=np.uint8))


def as_levels(values: torch.Tensor, spec) -> np.ndarray:
    std, mean = (np.asarray(v).reshape(3, 1, 1) for v in (spec.std, spec.mean))
    return values.float().cpu().numpy() * std + mean


@pytest.mark.parametrize("frame_order", ["rgb", "bgr"])
def test_reference_and_kernel_tactic_match_the_pil_reference(frame_order):
    spec = parse_preprocess(SPEC)
    given = frames()
    rgb = given.flip(-1) if frame_order == "bgr" else given  # what the camera saw, in RGB
    expected = np.stack([preprocess_image(f.numpy(), spec)[0] for f in rgb])
    attrs = {"spec": SPEC, "frame_order": frame_order}
    reference = preprocess([given.to(DEVICE)], attrs)
    fused = preprocess([given.to(DEVICE)], dict(attrs, tactic=PREPROCESS_TILES[0].name))
    assert reference.shape == fused.shape == expected.shape and fused.dtype == torch.float16
    slack = 0.5 * max(spec.std) / 1024  # float16 holds these values to 2^-11 of their size
    kernel_levels = np.abs(as_levels(fused, spec) - as_levels(torch.from_numpy(expected), spec))
    assert kernel_levels.max() <= 1 + slack
    torch_levels = np.abs(as_levels(reference, spec) - as_levels(torch.from_numpy(expected), spec))
    assert torch_levels.max() <= (2 if DEVICE == "cpu" else 1) + slack


def test_the_builder_times_the_row_tiles_beside_the_one_row_tiles():
    """On CUDA the Preprocess layer offers every tile, those of several output rows per program
    among them; the one-row tile stays first (the tile that runs untimed)."""
    on_cuda = SimpleNamespace(is_cuda=True)  # preprocess_tactics reads nothing else of the frames
    offered = preprocess_tactics([on_cuda], {"spec": SPEC})
    assert offered[:2] == ["torch", "preprocess.pixels128.w4"]
    assert {"preprocess.pixels128.w4.rows4", "preprocess.pixels128.w4.rows2"} <= set(offered)
    assert offered == ["torch", *(tile.name for tile in PREPROCESS_TILES)]


def test_tactics_are_the_kernel_tiles_on_cuda_only():
    assert default_registry()["Preprocess"].tactics is preprocess_tactics
    assert preprocess_tactics([frames()], {}) == ["torch"]  # a CPU tensor
    if torch.cuda.is_available():
        offered = preprocess_tactics([frames().cuda()], {"spec": SPEC})
        assert offered == ["torch", *(tile.name for tile in PREPROCESS_TILES)]
        # OpenCV's filter is not the kernel's: the torch path alone
        assert preprocess_tactics([frames().cuda()], {"spec": SPEC + ",resampler=cv2"}) == ["torch"]


@pytest.mark.parametrize("spec_text", [SPEC, "letterbox=32,mean=0,std=255,bgr,nchw"])
def test_int8_codes_are_the_quantized_image_by_every_tactic(spec_text):
    """With an INT8 reader's input scale (passes/quantize_in_preprocess.py) each tactic writes the
    codes that reader would make of the image the same tactic writes as floats."""
    attrs = {"spec": spec_text, "frame_order": "bgr"}
    codes_attrs = dict(attrs, output_scale=1 / 40.0, output_inv_scale=40.0, qmin=-127)
    given = frames(seed=4).to(DEVICE)
    # Every tactic on CUDA; on the CPU the reference, a one-row and a four-row tile through Triton's interpreter.
    tactics = (preprocess_tactics([given], attrs) if DEVICE == "cuda"
               else ["torch", PREPROCESS_TILES[0].name, "preprocess.pixels128.w4.rows4"])
    for tactic in tactics:
        values = preprocess([given], dict(attrs, tactic=tactic))
        codes = preprocess([given], dict(codes_attrs, tactic=tactic))
        assert codes.dtype == torch.int8 and codes.stride() == values.stride(), tactic  # channels-last on CUDA
        assert torch.equal(codes, quantize(values, 40.0, -127)), tactic
