"""The channels-last max-pool kernel against the MaxPool reference, through Triton's interpreter on
CPU (and natively on a GPU); and its place among MaxPool's tactics."""
from __future__ import annotations

import pytest
import torch

# conftest.py switches Triton to its interpreter when there is no GPU.
triton = pytest.importorskip("triton")

from sartor.kernels.registry import TacticNameError  # noqa: E402
from sartor.kernels.pointwise.epilogue import code_words  # noqa: E402
from sartor.kernels.pool.max_pool import (POOL_TILES, SMALL_POOL_LOADS_FIRST, SMALL_POOL_TILE, PoolTile,  # noqa: E402
                                 max_pool_nhwc, max_pool_nhwc_supported, pool_tactics)
from sartor.ops import default_registry  # noqa: E402
from sartor.ops.pool import _pool_geometry, max_pool  # noqa: E402
from pool_helpers import SPPF_POOL, assert_sppf_chain_in_one_buffer  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

CASES = [
    {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1]},  # ResNet's stem pool
    {"kernel_shape": [2, 2], "strides": [2, 2]},
    {"kernel_shape": [3, 3], "strides": [2, 2], "ceil_mode": 1},
    {"kernel_shape": [5, 5], "strides": [1, 1], "pads": [2, 2, 2, 2]},  # YOLO's SPPF
    {"kernel_shape": [3, 2], "strides": [1, 2], "pads": [0, 1, 2, 0], "dilations": [2, 1]},
    {"kernel_shape": [3, 3], "auto_pad": "SAME_UPPER", "strides": [2, 2]},
]


@pytest.mark.parametrize("attrs", CASES)
@pytest.mark.parametrize("channels", [8, 70])
def test_max_pool_kernel_matches_reference(attrs, channels):
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(2, channels, 11, 9, generator=generator)
    x[0, 0, 0, 0] = float("nan")  # NaN propagates, as in PyTorch
    expected = max_pool([x], dict(attrs))
    x_cl = x.to(DEVICE).contiguous(memory_format=torch.channels_last)
    kernel, strides, dilations, begin, _, outs = _pool_geometry(x_cl, attrs)
    out = max_pool_nhwc(x_cl, tuple(kernel), tuple(strides), tuple(begin), tuple(dilations), tuple(outs))
    assert out.is_contiguous(memory_format=torch.channels_last)
    torch.testing.assert_close(out.cpu(), expected, equal_nan=True, rtol=0, atol=0)


@pytest.mark.parametrize("attrs", CASES)
def test_int8_max_pool_compares_codes_as_integers(attrs):
    """INT8 codes are compared without converting them to float: negative codes down to -128 at the
    padded borders (the masked taps must never win) and the first tile's partial channel block."""
    generator = torch.Generator().manual_seed(1)
    x = torch.randint(-128, -100, (2, 70, 11, 9), generator=generator, dtype=torch.int8)
    x[:, :, 4:6, 3:5] = torch.randint(0, 128, (2, 70, 2, 2), generator=generator, dtype=torch.int8)
    expected = max_pool([x], dict(attrs))
    x_cl = x.to(DEVICE).contiguous(memory_format=torch.channels_last)
    kernel, strides, dilations, begin, _, outs = _pool_geometry(x_cl, attrs)
    out = max_pool_nhwc(x_cl, tuple(kernel), tuple(strides), tuple(begin), tuple(dilations), tuple(outs))
    assert out.dtype == torch.int8 and torch.equal(out.cpu(), expected)


@pytest.mark.parametrize("channels, offset", [(68, 0), (68, 4), (70, 0), (68, 2), (71, 0)])
def test_int8_pool_takes_codes_in_words_where_the_layout_allows(channels, offset):
    """Channel counts and offsets that are multiples of four pool as int32 words of four codes
    (`code_words`); others code by code. Both give the reference over every code from -128 to 127, in a channel slice
    of a wider buffer (a Concat's) at `offset`."""
    attrs = CASES[0]
    generator = torch.Generator().manual_seed(7)
    x = torch.randint(-128, 128, (2, channels, 11, 9), generator=generator, dtype=torch.int8)
    buffer = torch.zeros(2, channels + 4, 11, 9, dtype=torch.int8).contiguous(memory_format=torch.channels_last)
    buffer[:, offset:offset + channels] = x
    view = buffer.to(DEVICE)[:, offset:offset + channels]
    assert (code_words(view) is not None) == (channels % 4 == 0 and offset % 4 == 0)
    kernel, strides, dilations, begin, _, outs = _pool_geometry(view, attrs)
    out = max_pool_nhwc(view, tuple(kernel), tuple(strides), tuple(begin), tuple(dilations), tuple(outs))
    assert torch.equal(out.cpu(), max_pool([x], dict(attrs)))


@pytest.mark.parametrize("dtype, channels, width, offset", [
    (torch.int8, 96, 384, 96),  # the sample detector's SPPF: 24 words of a 96-word pixel
    (torch.int8, 40, 120, 40),  # 10 words of a 30-word pixel
    (torch.float16, 40, 120, 40),
    (torch.float16, 24, 72, 24),
])
def test_pool_of_a_concat_slice_told_its_alignment_keeps_the_numbers(dtype, channels, width, offset):
    """A pool reading one channel slice of a Concat's buffer and writing the next, at channel
    counts of 8 or 2 but not 16 (in the kernel's units): told that factor (CH_ALIGN), the kernel
    rewrites the count and strides as multiples of it, which a wrong factor would shrink. Every
    value equals the reference's."""
    generator = torch.Generator().manual_seed(11)
    if dtype == torch.int8:
        x = torch.randint(-128, 128, (2, channels, 10, 10), generator=generator, dtype=dtype)
    else:
        x = torch.randn(2, channels, 10, 10, generator=generator).to(dtype)
    buffer = torch.zeros(2, width, 10, 10, dtype=dtype).contiguous(memory_format=torch.channels_last).to(DEVICE)
    buffer[:, offset:offset + channels] = x.to(DEVICE)
    attrs = CASES[3]  # YOLO's SPPF pool
    source, target = buffer[:, offset:offset + channels], buffer[:, offset + channels:offset + 2 * channels]
    kernel, strides, dilations, begin, _, outs = _pool_geometry(source, attrs)
    max_pool_nhwc(source, tuple(kernel), tuple(strides), tuple(begin), tuple(dilations), tuple(outs), out=target)
    assert torch.equal(target.cpu(), max_pool([x], dict(attrs)))
    assert torch.equal(source.cpu(), x) and not buffer[:, :offset].cpu().any()


@pytest.mark.parametrize("tile", [*POOL_TILES[1:], SMALL_POOL_LOADS_FIRST], ids=lambda tile: tile.name)
def test_every_pool_tile_matches_reference(tile):
    """The tiles the builder times besides the first: the stem pool over INT8 codes and a float
    tensor whose channels are not a power of two (partial channel blocks). The loads-first tile's
    plain lane maximum is what the interpreter runs for every tile; on sm_90 the others take the
    packed instruction."""
    attrs = CASES[0]
    generator = torch.Generator().manual_seed(3)
    for x in (torch.randint(-127, 128, (2, 24, 11, 9), generator=generator, dtype=torch.int8),
              torch.randn(2, 70, 11, 9, generator=generator)):
        expected = max_pool([x], dict(attrs))
        x_cl = x.to(DEVICE).contiguous(memory_format=torch.channels_last)
        kernel, strides, dilations, begin, _, outs = _pool_geometry(x_cl, attrs)
        out = max_pool_nhwc(x_cl, tuple(kernel), tuple(strides), tuple(begin), tuple(dilations), tuple(outs),
                            tile=tile)
        assert torch.equal(out.cpu(), expected)
        through_the_op = max_pool([x_cl], dict(attrs, tactic=tile.name))
        assert torch.equal(through_the_op.cpu(), expected)


def test_pool_tile_names_round_trip_and_bad_names_are_refused():
    assert POOL_TILES[0].name == "max_pool.elements4096.channels64.w4"
    for tile in POOL_TILES:
        assert PoolTile.parse(tile.name) == tile
    for bad in ("max_pool.elements8192.channels64", "max_pool.elements8192.channels64.w3",
                "max_pool.elements32.channels64.w4", "max_pool.x1.channels1.w1", "max_pool.elements8192.channels64.wx",
                "torch", None, "triton_nhwc", "triton_nhwc_e8192_c64_w4"):
        with pytest.raises(TacticNameError):
            PoolTile.parse(bad)
    assert pool_tactics(0) == [POOL_TILES[0].name] and len(pool_tactics(1)) == 3
    assert pool_tactics(5) == [tile.name for tile in POOL_TILES]
    # ResNet-50's stem pool on 132 SMs: at batch 1 the first tile leaves SMs idle, at batch 8 it does not.
    stem = 64 * 56 * 56
    assert pool_tactics(1, stem, 132) == pool_tactics(1) + [SMALL_POOL_TILE.name]
    assert pool_tactics(1, 8 * stem, 132) == pool_tactics(1) and pool_tactics(0, stem, 132) == pool_tactics(0)
    assert pool_tactics(5, stem, 132) == pool_tactics(5)  # already among them
    # Over INT8 codes in words, that small tile with its loads first as well; not where the first tile fills the SMs.
    assert SMALL_POOL_LOADS_FIRST.name == "max_pool.elements1024.channels64.w4.loads-first"
    assert PoolTile.parse(SMALL_POOL_LOADS_FIRST.name) == SMALL_POOL_LOADS_FIRST
    assert pool_tactics(1, stem, 132, int8_words=True) == pool_tactics(1, stem, 132) + [SMALL_POOL_LOADS_FIRST.name]
    assert pool_tactics(1, 8 * stem, 132, int8_words=True) == pool_tactics(1)
    assert pool_tactics(0, stem, 132, int8_words=True) == pool_tactics(0)


def test_inspect_describes_each_pool_tile_and_keeps_resize_apart():
    from sartor.builder.pipeline import _tactic
    from sartor.ir import Node
    for tile in POOL_TILES:
        described = _tactic(Node("MaxPool", "pool", ["x"], ["y"], {"tactic": tile.name}), torch.device("cpu"))
        assert described.startswith("triton channels-last max pool") and f"{tile.elements} elements" in described
    resize = _tactic(Node("Resize", "up", ["x"], ["y"], {"tactic": "triton_nhwc"}), torch.device("cpu"))
    assert resize == "triton channels-last nearest upsample"


def test_max_pool_tactics():
    tactics = default_registry()["MaxPool"].tactics
    x = torch.zeros(1, 8, 6, 6)
    assert tactics([x], {"kernel_shape": [2, 2]}) == ["torch"]  # CPU: the reference only
    assert not max_pool_nhwc_supported(x) and max_pool_nhwc_supported(x.contiguous(memory_format=torch.channels_last))
    assert not max_pool_nhwc_supported(torch.zeros(1, 8, 6, 6, dtype=torch.int8))  # NCHW (int8 channels-last: see
    # tests/quant/test_quant_passthrough.py)
    if DEVICE == "cuda":
        x_cl = x.cuda().contiguous(memory_format=torch.channels_last)
        # A 200-element output leaves SMs idle under the first tile, so the smallest tile is timed too.
        assert tactics([x_cl], {"kernel_shape": [2, 2]}, 1) == ["torch", *pool_tactics(1), SMALL_POOL_TILE.name]
        assert tactics([x_cl], {"kernel_shape": [2, 2], "_with_indices": 1}) == ["torch"]
        codes = torch.zeros(1, 8, 6, 6, dtype=torch.int8, device="cuda").contiguous(memory_format=torch.channels_last)
        assert tactics([codes], {"kernel_shape": [2, 2]}, 1)[-2:] == [SMALL_POOL_TILE.name, SMALL_POOL_LOADS_FIRST.name]


def test_the_chosen_tactic_reaches_the_executor():
    """A schema'd ONNX op keeps the builder's tactic through attribute filling (an H200 build chose
    the Triton pool for ResNet-50's pool while the engine still ran PyTorch's: the key was dropped)."""
    opdef = default_registry()["MaxPool"]
    attrs = opdef.fill_attrs({"kernel_shape": [3, 3], "tactic": POOL_TILES[0].name})
    assert attrs["tactic"] == POOL_TILES[0].name
    assert opdef.unsupported_reason({"kernel_shape": [3, 3], "tactic": POOL_TILES[0].name}, ["float32"]) is None
    assert "tactic" not in default_registry()["Relu"].fill_attrs({"tactic": "x"})


def test_sppf_pool_reads_and_writes_channel_slices_of_one_buffer():
    """YOLO's SPPF with its Concat written in place: each pool reads the previous one's slice of
    the Concat buffer and writes its own (MaxPool's write_into); the first slice stays as it was."""
    from sartor.ops.pool import max_pool_into
    buffer = assert_sppf_chain_in_one_buffer(torch.randn(2, 6, 7, 7, generator=torch.Generator().manual_seed(5)))
    assert max_pool_into([buffer[:, :6]], dict(SPPF_POOL, tactic="torch"), buffer[:, 6:12]) is None
