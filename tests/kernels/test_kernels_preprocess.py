"""The fused preprocessing kernel (kernels/preprocess/letterbox.py) against the CPU reference
(`sartor.data.preprocess`, Pillow) and today's torch path, through Triton's interpreter on small
frames (natively on a GPU): letterbox geometry exact, pixels within one level; its INT8 codes the
quantization of its values bit for bit; its taps against Pillow's one-axis resizes; the tiles of
several rows per program equal to the one-row tile bit for bit; its tactics by name."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch
from PIL import Image

# conftest.py switches Triton to its interpreter when there is no GPU.
triton = pytest.importorskip("triton")

from sartor.data.preprocess import parse_preprocess, placement, preprocess_image
from sartor.errors import ConfigError, DataError, TacticNameError
from sartor.kernels.preprocess import letterbox
from sartor.kernels.preprocess.letterbox import (
    PREPROCESS_TILES,
    InputCodes,
    PreprocessTile,
    letterbox_frames,
)
from sartor.kernels.preprocess.taps import MAX_SPAN, pillow_taps, row_groups, used_taps
from sartor.kernels.preprocess.torch_path import letterbox_torch
from sartor.kernels.registry import parse_tactic
from sartor.ops.quantized import quantize
from sartor.pipeline import prepare_batch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# The torch path resizes in uint8 on the CPU with weights of its own: two levels from Pillow there.
TORCH_LEVELS = {"cpu": 2, "cuda": 1}


def frame(h: int, w: int, seed: int = 0) -> np.ndarray:
    """A smooth gradient plus noise, H×W×3 uint8 RGB: edges and flat areas both."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:h, 0:w]
    base = np.stack([yy * 255 / max(h - 1, 1), xx * 255 / max(w - 1, 1), (yy + xx) * 127 / max(h + w - 2, 1)], -1)
    return np.clip(base + rng.normal(0, 30, base.shape), 0, 255).astype(np.uint8)


def levels(values: torch.Tensor | np.ndarray, spec) -> np.ndarray:
    """Values of the spec's output → float64 pixel levels (undoing mean/std)."""
    x = (values.cpu().numpy() if isinstance(values, torch.Tensor) else values).astype(np.float64)
    if spec.dtype == "uint8":
        return x
    shape = (3, 1, 1) if spec.layout == "nchw" else (1, 1, 3)
    return x * np.asarray(spec.std).reshape(shape) + np.asarray(spec.mean).reshape(shape)


def run_kernel(pixels: np.ndarray, spec, frame_layout: str = "chw", frame_order: str = "rgb", batch: int = 2,
               tile=None, codes: InputCodes | None = None) -> torch.Tensor:
    """The kernel over `batch` copies of an H×W×3 RGB frame, given as `frame_layout`/`frame_order`
    (with `codes`: their INT8 codes)."""
    h, w, _ = pixels.shape
    given = pixels[..., ::-1] if frame_order == "bgr" else pixels
    t = torch.from_numpy(np.ascontiguousarray(given)).to(DEVICE)
    t = t.permute(2, 0, 1).contiguous() if frame_layout == "chw" else t
    frames = torch.stack([t] * batch)
    place = placement(h, w, spec)
    shape = spec.input_shape(batch) or ((batch, 3, h, w) if spec.layout == "nchw" else (batch, h, w, 3))
    out = torch.full(shape, 7, dtype=torch.int8 if codes else getattr(torch, spec.dtype), device=DEVICE)
    return letterbox_frames(frames, frame_layout, frame_order, spec, place.resized, place.pad, out, tile, codes)


CASES = [  # (frame H, W, spec): downscale, upscale, odd sizes, both layouts, orders and dtypes
    (37, 53, "letterbox=32,mean=0,std=255,rgb,nchw"),
    (37, 53, "letterbox=32,mean=0,std=255,bgr,nhwc,dtype=float16"),
    (19, 23, "letterbox=45x61,mean=123.675:116.28:103.53,std=58.395:57.12:57.375,rgb,nchw"),
    (41, 17, "resize=13x29,mean=0,std=1,bgr,nchw,dtype=uint8"),
    (33, 64, "letterbox=31,mean=10,std=3,rgb,nhwc,dtype=uint8,pad=0"),
    (24, 32, "none,mean=0,std=255,rgb,nchw"),
    (40, 61, "resize=32,crop=24,mean=123.675:116.28:103.53,std=58.395:57.12:57.375,rgb,nchw"),  # shorter side, centre crop
    (70, 45, "resize=37,crop=29,mean=0,std=1,bgr,nhwc,dtype=float16"),
]
# 7× down: 15 × 15 taps, past MAX_UNROLLED_TAPS, so the vertical taps are a loop
LOOPED_CASE = (56, 56, "letterbox=8,mean=0,std=255,rgb,nchw")


@pytest.mark.parametrize("h,w,text", [*CASES, LOOPED_CASE])
def test_kernel_matches_the_pil_reference_and_the_torch_path(h, w, text):
    spec = parse_preprocess(text)
    pixels = frame(h, w)
    reference, meta = preprocess_image(pixels, spec)
    ours = run_kernel(pixels, spec)
    assert tuple(ours.shape) == (2, *reference.shape) and ours.dtype == getattr(torch, spec.dtype)
    assert torch.equal(ours[0], ours[1])
    apart = np.abs(levels(ours[0], spec) - levels(reference, spec))
    slack = 0.5 * max(spec.std) / 1024 if spec.dtype == "float16" else 1e-3  # float16 holds values to 2^-11
    assert apart.max() <= 1 + slack
    # Most pixels equal: a shifted or blurred image fails here. (Exact where Pillow runs its
    # horizontal pass first; Pillow 13 runs the vertical one first for some shapes.)
    assert (apart > slack).mean() < 0.25
    # The pad bands hold the pad value exactly: geometry exact. A crop has none.
    (top, left), (new_h, new_w) = meta.pad, placement(h, w, spec).resized
    image = levels(ours[0], spec)
    if spec.layout == "nchw":
        image = image.transpose(1, 2, 0)
    inside = np.zeros(image.shape[:2], bool)
    inside[max(top, 0):top + new_h, max(left, 0):left + new_w] = True  # a crop's pad is negative: no bands
    assert np.abs(image[~inside] - spec.pad_value).max(initial=0) <= slack
    place = placement(h, w, spec)
    canvas = torch.empty_like(ours)
    t = torch.from_numpy(pixels).permute(2, 0, 1).to(DEVICE)
    torch_path = letterbox_torch(torch.stack([t, t]), "chw", "rgb", spec, place.resized, place.pad, canvas)
    between = np.abs(levels(ours, spec) - levels(torch_path, spec))
    assert between.max() <= TORCH_LEVELS[DEVICE] + slack


# (inv_scale, qmin): a stem's usual scale (values of a few units), half steps (the integer values of
# mean=0,std=1 specs fall on ties), and one that saturates most values, to [-128, 127] as Q/DQ layers.
CODE_SCALES = [(37.25, -127), (0.5, -127), (300.0, -128)]


@pytest.mark.parametrize("h,w,text", CASES)
@pytest.mark.parametrize("frame_layout,frame_order", [("chw", "rgb"), ("hwc", "bgr")])
def test_int8_codes_are_the_quantized_values_bit_for_bit(h, w, text, frame_layout, frame_order):
    """The codes are what the INT8 layer reading the values would make of them (ops.quantized's
    quantize, its emulation's): an engine's numbers do not change when the kernel writes them."""
    spec = parse_preprocess(text)
    pixels = frame(h, w, seed=7)
    values = run_kernel(pixels, spec, frame_layout, frame_order, batch=1)
    reference = torch.from_numpy(preprocess_image(pixels, spec)[0]).to(DEVICE)
    same = values[0] == reference  # where the kernel's pixels are Pillow's (most: see the test above)
    for inv_scale, qmin in CODE_SCALES:
        codes = run_kernel(pixels, spec, frame_layout, frame_order, batch=1, codes=InputCodes(inv_scale, qmin))
        assert codes.dtype == torch.int8 and codes.shape == values.shape
        assert torch.equal(codes, quantize(values, inv_scale, qmin)), (inv_scale, qmin)
        assert torch.equal(codes[0][same], quantize(reference, inv_scale, qmin)[same])
    assert same.float().mean() > 0.75


def test_int8_codes_round_ties_to_even_and_saturate():
    """Levels 0..255 unresized: level · 0.5 has a tie at every odd level; 255 saturates at 127 and
    -200 at qmin."""
    pixels = np.repeat(np.arange(256, dtype=np.uint8).reshape(16, 16, 1), 3, axis=-1)
    levels_ = torch.arange(256, dtype=torch.float64).reshape(16, 16)
    for text, inv_scale, qmin, values in [
            ("none,mean=0,std=1,rgb,nchw", 0.5, -127, levels_ * 0.5),
            ("none,mean=0,std=1,rgb,nchw", 1.0, -127, levels_),
            ("none,mean=200,std=1,rgb,nchw", 1.0, -128, levels_ - 200),
            ("none,mean=200,std=1,rgb,nchw", 1.0, -127, levels_ - 200)]:
        codes = run_kernel(pixels, parse_preprocess(text), batch=1, codes=InputCodes(inv_scale, qmin))
        expected = torch.from_numpy(np.clip(np.rint(values.numpy()), qmin, 127).astype(np.int8))  # rint: ties to even
        assert all(torch.equal(codes[0, c].cpu(), expected) for c in range(3)), text


def test_int8_codes_need_an_int8_output_and_it_needs_them():
    spec = parse_preprocess("letterbox=32,mean=0,std=255,rgb,nchw")
    place = placement(37, 53, spec)
    frames = torch.from_numpy(frame(37, 53)).permute(2, 0, 1)[None].contiguous().to(DEVICE)
    with pytest.raises(ValueError, match="int8 output"):
        letterbox_frames(frames, "chw", "rgb", spec, place.resized, place.pad, torch.empty(1, 3, 32, 32,
                         device=DEVICE), codes=InputCodes(2.0))
    with pytest.raises(ValueError, match="int8 output"):
        letterbox_frames(frames, "chw", "rgb", spec, place.resized, place.pad,
                         torch.empty(1, 3, 32, 32, dtype=torch.int8, device=DEVICE))


@pytest.mark.parametrize("frame_layout,frame_order", [("hwc", "rgb"), ("hwc", "bgr"), ("chw", "bgr")])
def test_frames_as_cameras_give_them_equal_channels_first_rgb(frame_layout, frame_order):
    spec = parse_preprocess("letterbox=32,mean=0,std=255,bgr,nchw")
    pixels = frame(37, 53, seed=3)
    assert torch.equal(run_kernel(pixels, spec, frame_layout, frame_order), run_kernel(pixels, spec))


@pytest.mark.parametrize("tile", PREPROCESS_TILES[1:])
def test_every_tile_computes_the_same_pixels(tile):
    spec = parse_preprocess("letterbox=32x40,mean=0,std=255,rgb,nhwc,dtype=float16")
    pixels = frame(29, 31, seed=5)
    assert torch.equal(run_kernel(pixels, spec, tile=tile), run_kernel(pixels, spec))


def test_kernel_writes_into_a_slice_of_a_wider_buffer_and_nothing_else():
    spec = parse_preprocess("letterbox=32,mean=0,std=255,rgb,nchw")
    pixels = frame(37, 53)
    place = placement(37, 53, spec)
    frames = torch.from_numpy(pixels).permute(2, 0, 1)[None].contiguous().to(DEVICE)
    buffer = torch.full((3, 3, 32, 32), -1.0, device=DEVICE)
    letterbox_frames(frames, "chw", "rgb", spec, place.resized, place.pad, buffer[1:2])
    assert torch.equal(buffer[1], run_kernel(pixels, spec, batch=1)[0])
    assert bool((buffer[0] == -1).all()) and bool((buffer[2] == -1).all())


@pytest.mark.parametrize("in_size,out_size", [(53, 32), (53, 23), (37, 90), (7, 5), (720, 360), (1280, 640), (5, 5)])
def test_taps_reproduce_pillow_on_one_axis(in_size, out_size):
    """A one-row image resized along its width is one Pillow pass: the taps give its pixels exactly."""
    row = frame(1, in_size, seed=in_size)
    expected = np.asarray(Image.fromarray(row).resize((out_size, 1), Image.Resampling.BILINEAR)).astype(np.int64)
    starts, weights = pillow_taps(in_size, out_size)
    k = len(weights[0])
    index = np.minimum(np.asarray(starts)[:, None] + np.arange(k), in_size - 1)
    sums = (row[0].astype(np.int64)[index] * np.asarray(weights)[:, :, None]).sum(1) + (1 << 21)
    assert np.array_equal(np.clip(sums >> 22, 0, 255), expected[0])


def test_prepare_batch_kernel_and_torch_paths_agree_on_interleaved_sizes():
    spec = parse_preprocess("letterbox=32,mean=0,std=255,rgb,nhwc,dtype=float16")
    a, b = (torch.from_numpy(frame(*size, seed=k)).permute(2, 0, 1).to(DEVICE)
            for k, size in enumerate([(37, 53), (29, 19)]))
    fused, fused_metas = prepare_batch([a, b, a], list("xyz"), spec, kernel=True)  # sizes {0, 2} and {1}
    ops, op_metas = prepare_batch([a, b, a], list("xyz"), spec, kernel=False)
    assert fused_metas == op_metas
    assert torch.equal(fused[0], fused[2])
    assert (fused.float() - ops.float()).abs().max().item() * 255 <= TORCH_LEVELS[DEVICE] + 0.5


def test_tactic_names_parse_back_and_bad_ones_are_refused():
    for tile in PREPROCESS_TILES:
        assert parse_tactic(tile.name) == tile
    assert PREPROCESS_TILES[0].name == "preprocess.pixels128.w4"
    assert parse_tactic("preprocess.pixels128.w4.rows4") == PreprocessTile(128, 4, 4)
    assert {tile.rows for tile in PREPROCESS_TILES} == {1, 2, 4}
    with pytest.raises(TacticNameError):
        parse_tactic("preprocess.pixels100.w4")  # not a power of two
    with pytest.raises(TacticNameError):
        PreprocessTile.parse("preprocess.pixels64.w4")  # fewer pixels than threads
    with pytest.raises(TacticNameError):
        parse_tactic("preprocess.pixels128.w4.rows3")  # the kernel holds 2 or 4 rows
    with pytest.raises(TacticNameError):
        parse_tactic("preprocess.pixels128.w4.rows1")  # one row is spelled without the field


# Several output rows per program (`_letterbox_rows_kernel`) against the one-row tile, bit for bit:
# (frame H, W, spec, frame layout, frame order, rows, INT8 codes, batch).
ROW_CASES = [
    (24, 40, "letterbox=20,mean=0,std=255,rgb,nchw,dtype=float16", "chw", "rgb", 4, None, 2),  # 720p → 640, small
    (24, 40, "letterbox=20,mean=0,std=255,bgr,nhwc,dtype=float16", "hwc", "rgb", 4, InputCodes(37.25, -127), 1),
    (25, 39, "letterbox=16x12,mean=0,std=255,bgr,nhwc", "hwc", "bgr", 2, None, 3),  # odd sizes
    (36, 60, "letterbox=20,mean=10,std=3,rgb,nchw,dtype=uint8", "chw", "bgr", 4, None, 1),  # 3×, levels
    (30, 21, "letterbox=20,mean=123.675:116.28:103.53,std=58.395:57.12:57.375,rgb,nchw", "hwc", "rgb", 4,
     InputCodes(0.5, -128), 1),  # 1.5×
    (11, 17, "letterbox=32,mean=0,std=255,rgb,nhwc,dtype=float16", "chw", "rgb", 4, None, 1),  # upscale
    (40, 61, "resize=32,crop=24,mean=123.675:116.28:103.53,std=58.395:57.12:57.375,rgb,nchw", "chw", "rgb", 4,
     None, 2),  # crop: no pad rows, rows start inside the resized image
    (70, 45, "resize=37,crop=29,mean=0,std=1,bgr,nhwc,dtype=float16", "hwc", "bgr", 2, None, 1),
]


@pytest.mark.parametrize("h,w,text,frame_layout,frame_order,rows,codes,batch", ROW_CASES)
def test_row_tiles_equal_the_one_row_tile_bit_for_bit(h, w, text, frame_layout, frame_order, rows, codes, batch):
    """Each input row is filtered once and shared by the group's output rows, the same integer
    products summed: every output value the one-row tile's, pad bands and crops included; the
    output is filled with 7 first, so a pixel left unwritten shows."""
    spec = parse_preprocess(text)
    pixels = frame(h, w, seed=h + w)
    one_row = run_kernel(pixels, spec, frame_layout, frame_order, batch, codes=codes)
    ours = run_kernel(pixels, spec, frame_layout, frame_order, batch, tile=PreprocessTile(64, 2, rows), codes=codes)
    assert torch.equal(ours, one_row)


def test_row_groups_hold_each_rows_own_taps():
    """A group's table is each member row's Pillow taps, moved to where its first input row lies
    from the group's; at 720p → 640 (2× down) four rows filter 10 input rows, not 16, and the
    columns use 4 taps of the table's 5."""
    starts, weights = pillow_taps(720, 360)
    firsts, used, flat, span = row_groups(720, 360, 0, 360, 4)
    assert span == 10 and used_taps(1280, 640) == 4 and len(firsts) == 90
    for g, y0 in enumerate(firsts):
        for r in range(4):
            iy = 4 * g + r
            column = [flat[g][k * 4 + r] for k in range(span)]
            moved = [0] * span
            for i, weight in enumerate(weights[iy]):
                if weight:
                    moved[starts[iy] - y0 + i] = weight
            assert column == moved
    # a crop's rows start inside the image; a last group of fewer rows has zero weights past them
    firsts, used, flat, span = row_groups(53, 32, 5, 7, 4)
    assert firsts[0] == pillow_taps(53, 32)[0][5] and all(w == 0 for w in flat[1][3::4])
    assert row_groups(120, 20, 0, 20, 4) is None  # 6× down: more than MAX_SPAN rows, the one-row kernel runs
    assert row_groups(120, 20, 0, 20, 2)[3] <= MAX_SPAN


def test_row_tiles_fall_back_to_one_row_where_groups_read_too_many_rows():
    spec = parse_preprocess("letterbox=8,mean=0,std=255,rgb,nchw")
    pixels = frame(50, 4, seed=2)  # 50 → 8 rows: over MAX_SPAN rows for a group of 4
    assert row_groups(50, 8, 0, 8, 4) is None
    four_rows = run_kernel(pixels, spec, batch=1, tile=PreprocessTile(64, 2, 4))
    assert torch.equal(four_rows, run_kernel(pixels, spec, batch=1))


def test_vertical_taps_looped_equal_them_unrolled(monkeypatch):
    """A shrink of many taps loops over its input rows instead of unrolling them (the compile
    time grows with the taps unrolled): the same products summed in the same order, bit for bit."""
    spec = parse_preprocess("letterbox=20,mean=123.675:116.28:103.53,std=58.395:57.12:57.375,bgr,nhwc")
    pixels = frame(36, 60, seed=4)  # 3× down to 12×20: 7 × 7 taps, unrolled
    looped_taps = len(pillow_taps(LOOPED_CASE[0], 8)[1][0])
    assert not letterbox.unrolled_rows(looped_taps, looped_taps)  # LOOPED_CASE runs the loop
    unrolled = run_kernel(pixels, spec, "hwc", "rgb", batch=2)
    asked = []
    monkeypatch.setattr(letterbox, "unrolled_rows", lambda ky, kx: asked.append((ky, kx)) and False)
    assert torch.equal(run_kernel(pixels, spec, "hwc", "rgb", batch=2), unrolled)
    assert asked == [(len(pillow_taps(36, 12)[1][0]), len(pillow_taps(60, 20)[1][0]))]
    assert letterbox.MAX_UNROLLED_TAPS >= asked[0][0] * asked[0][1]  # so `unrolled` was the unrolled kernel


def test_row_tiles_fall_back_to_the_one_row_kernel_past_the_unrolled_taps(monkeypatch):
    spec = parse_preprocess("letterbox=20,mean=0,std=255,rgb,nchw,dtype=float16")
    pixels = frame(36, 60, seed=5)
    one_row = run_kernel(pixels, spec, batch=1)
    monkeypatch.setattr(letterbox, "MAX_UNROLLED_TAPS", 0)
    launched = []
    monkeypatch.setattr(letterbox, "_letterbox_rows_kernel", launched)  # indexing a list by a grid fails
    assert torch.equal(run_kernel(pixels, spec, batch=1, tile=PreprocessTile(64, 2, 4)), one_row)


def test_prepare_batch_writes_an_engines_staged_forms_bit_for_bit():
    """What a Pipeline prepares for an engine that takes its input staged (decision 0068): the INT8
    codes of the float batch, and a float16 channels-last batch equal to the float32 one rounded,
    both from the kernel in one pass; codes are refused where the kernel does not run."""
    spec = parse_preprocess("letterbox=32,mean=0,std=255,rgb,nchw")
    a, b = (torch.from_numpy(frame(*size, seed=k)).permute(2, 0, 1).to(DEVICE)
            for k, size in enumerate([(37, 53), (29, 19)]))
    floats, metas = prepare_batch([a, b, a], list("xyz"), spec, kernel=True)
    codes = InputCodes(97.5, -128)
    written, code_metas = prepare_batch([a, b, a], list("xyz"), spec, kernel=True, codes=codes)
    assert code_metas == metas and written.dtype == torch.int8
    assert torch.equal(written, quantize(floats, codes.inv_scale, codes.qmin))
    assert written.unique().numel() > 50
    half = torch.empty((3, 3, 32, 32), dtype=torch.float16, device=DEVICE, memory_format=torch.channels_last)
    prepare_batch([a, b, a], list("xyz"), replace(spec, dtype="float16"), out=half, kernel=True)
    assert torch.equal(half, floats.half()) and half.is_contiguous(memory_format=torch.channels_last)
    with pytest.raises(ConfigError, match="INT8 codes are written by the fused preprocessing kernel only"):
        prepare_batch([a], ["x"], spec, kernel=False, codes=codes)
    with pytest.raises(DataError, match=r"makes \(1, 3, 32, 32\) torch.int8 codes"):
        prepare_batch([a], ["x"], spec, out=torch.empty((1, 3, 32, 32), device=DEVICE), kernel=True, codes=codes)
    with pytest.raises(ConfigError, match=r"Pillow's filter only; leave kernel= unset \(and codes= out\)"):
        prepare_batch([a], ["x"], replace(spec, resampler="cv2"), codes=codes)
