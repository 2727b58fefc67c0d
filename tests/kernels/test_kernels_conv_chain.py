"""The chain kernel (`kernels/conv/chain.py`, op ConvChain in `ops/conv_chain.py`): a convolution and
the 1×1 convolution that reads it, in one kernel. INT8 chains equal the two layers' emulation bit
for bit and float chains the two layers within float16 rounding, through Triton's interpreter on
CPU (natively on a GPU); what the kernel refuses; where the tactics are offered."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

# conftest.py switches Triton to its interpreter when there is no GPU.
triton = pytest.importorskip("triton")

from sartor.errors import TacticNameError  # noqa: E402
from sartor.kernels.conv.chain import (  # noqa: E402
    CHAIN_TILES, GATHERED_CHAIN_TILES, MAX_CHAIN_CHANNELS, ChainLayer, ChainTile, chain_tiles, conv_chain,
    gathered_walk_applies, middle_width)
from sartor.kernels.conv.igemm import ConvGeometry, row_block  # noqa: E402
from sartor.kernels.registry import REFERENCE, parse_tactic  # noqa: E402
from sartor.ops import default_registry  # noqa: E402
from sartor.ops.conv_chain import (  # noqa: E402
    CHAIN, chain_tactics, chain_weight_for_tactic, conv_chain_into, conv_chain_layer)
from sartor.ops.quantized import qconv  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# a 64-channel and a 32-channel K block, a 16-column N block as narrowed for 16 outputs (chain_tiles), and a
# gathered tile (whole taps gathered where the row walk would run; elsewhere its walk is the others')
TILES = [CHAIN_TILES[0].name, CHAIN_TILES[3].name, "chain.64x64x16.w4.s3", GATHERED_CHAIN_TILES[0].name]

# (input channels, middle channels, output channels, kernel, stride, pads, dilation):
# YOLOv8n's 3×3 stride 2 into its C2f's 1×1 (16 channels: a filter row a K step), a blocked K walk, a 1×1
# into a 1×1 of a ragged middle (80: padded to 128), the widest middle (32 channels: rows of 128
# columns on a 64-column tile, the tap walk on a 32-column one), asymmetric pads and a dilation over
# 24 channels (rows told their 8-element runs), 80 channels 3×3 (YOLOv8n's class branch: the tap walk,
# each tap's last channel block masked) and the flat gather: 4 channels (told, as shifts) and 3.
CASES = [
    (16, 32, 32, 3, 2, (1, 1, 1, 1), 1),
    (64, 64, 48, 3, 1, (1, 1, 1, 1), 1),
    (64, 80, 40, 1, 1, (0, 0, 0, 0), 1),
    (32, MAX_CHAIN_CHANNELS, 64, 3, 2, (1, 1, 1, 1), 1),
    (24, 24, 16, 3, 1, (0, 2, 1, 1), 2),
    (80, 80, 16, 3, 1, (1, 1, 1, 1), 1),
    (4, 16, 32, 3, 1, (1, 1, 1, 1), 1),
    (3, 16, 16, 3, 2, (1, 1, 1, 1), 1),
]


def _geometry_attrs(k, stride, pads, dilation) -> dict:
    return {"kernel_shape": [k, k], "strides": [stride, stride], "pads": list(pads), "dilations": [dilation] * 2,
            "group": 1}


def _int8_chain(cin, cmid, cout, k, stride, pads, dilation, generator, *, float_input=False, float_output=False):
    """A ConvChain's inputs and attributes of two QConv layers, scaled so that few codes saturate."""
    x = (torch.randn(2, cin, 9, 11, generator=generator) if float_input else
         torch.randint(-127, 128, (2, cin, 9, 11), dtype=torch.int8, generator=generator))
    w1 = torch.randint(-127, 128, (cmid, cin, k, k), dtype=torch.int8, generator=generator)
    b1 = torch.randint(-3000, 3000, (cmid,), dtype=torch.int32, generator=generator)
    s1 = (torch.rand(cmid, generator=generator) + 0.5) * 2.0 / (127 * 127 * cin * k * k) ** 0.5 / 40
    w2 = torch.randint(-127, 128, (cout, cmid, 1, 1), dtype=torch.int8, generator=generator)
    b2 = torch.randint(-3000, 3000, (cout,), dtype=torch.int32, generator=generator)
    s2 = (torch.rand(cout, generator=generator) + 0.5) * 2.0 / (127 * 127 * cmid) ** 0.5 / 40
    first = dict(_geometry_attrs(k, stride, pads, dilation), activation="SiLU", input_inv_scale=40.0,
                 output_inv_scale=40.0, qmin=-127)
    second = dict(_geometry_attrs(1, 1, (0, 0, 0, 0), 1), activation="SiLU", input_inv_scale=40.0,
                  output_inv_scale=None if float_output else 40.0, qmin=-127)
    inputs = [x.contiguous(memory_format=torch.channels_last), w1, b1, None, s1, w2, b2, None, s2]
    return inputs, {"layers": "QConv", "first_inputs": 5, "first": first, "second": second}


def _on_device(inputs: list, tactic: str) -> list:
    moved = [t.to(DEVICE) if t is not None else None for t in inputs]
    moved[1] = chain_weight_for_tactic(moved[1], tactic)
    return moved


def _two_layers(inputs: list, attrs: dict) -> torch.Tensor:
    """What the graph computed before the chain: the two QConv layers in turn, by the emulation."""
    split = attrs["first_inputs"]
    middle = qconv(inputs[:split], dict(attrs["first"], tactic=REFERENCE))
    return qconv([middle, *inputs[split:]], dict(attrs["second"], tactic=REFERENCE))


@pytest.mark.parametrize("case", CASES, ids=lambda c: "{}-{}-{}-k{}s{}".format(*c[:5]))
@pytest.mark.parametrize("tactic", TILES)
def test_int8_chain_equals_the_two_layers_bit_for_bit(case, tactic):
    generator = torch.Generator().manual_seed(sum(case[:3]))
    inputs, attrs = _int8_chain(*case, generator)
    expected = _two_layers(inputs, attrs)
    saturated = (expected.abs() == 127).float().mean().item()
    assert saturated < 0.1 and expected.unique().numel() > 50  # the codes tell the arithmetic apart
    got = conv_chain_layer(_on_device(inputs, tactic), dict(attrs, tactic=tactic))
    assert got.dtype == torch.int8 and got.is_contiguous(memory_format=torch.channels_last)
    assert torch.equal(got.cpu(), expected)


@pytest.mark.parametrize("float_input, float_output", [(True, False), (False, True)])
def test_int8_chain_quantizes_a_float_input_and_writes_a_float_output(float_input, float_output):
    generator = torch.Generator().manual_seed(3)
    inputs, attrs = _int8_chain(*CASES[0], generator, float_input=float_input, float_output=float_output)
    expected = _two_layers(inputs, attrs)
    got = conv_chain_layer(_on_device(inputs, TILES[0]), dict(attrs, tactic=TILES[0]))
    assert got.dtype == expected.dtype
    if float_output:  # the activation's exponential is the kernel's own: float32 steps apart
        assert torch.allclose(got.cpu(), expected, rtol=1e-5, atol=1e-6) and not torch.equal(expected, 0 * expected)
    else:
        assert torch.equal(got.cpu(), expected)


def _float_chain(cin, cmid, cout, k, stride, pads, dilation, generator):
    x = torch.randn(2, cin, 9, 11, generator=generator)
    w1 = torch.randn(cmid, cin, k, k, generator=generator) / (cin * k * k) ** 0.5
    b1 = torch.randn(cmid, generator=generator) * 0.1
    w2 = torch.randn(cout, cmid, 1, 1, generator=generator) / cmid ** 0.5
    b2 = torch.randn(cout, generator=generator) * 0.1
    inputs = [t.half() for t in (x.contiguous(memory_format=torch.channels_last), w1, b1, w2, b2)]
    attrs = {"layers": "FusedConv", "first_inputs": 3, "first": dict(_geometry_attrs(k, stride, pads, dilation),
                                                                      activation="SiLU"),
             "second": dict(_geometry_attrs(1, 1, (0, 0, 0, 0), 1), activation="SiLU")}
    return inputs, attrs


@pytest.mark.parametrize("case", CASES, ids=lambda c: "{}-{}-{}-k{}s{}".format(*c[:5]))
@pytest.mark.parametrize("tactic", [TILES[0], GATHERED_CHAIN_TILES[0].name])
def test_float16_chain_equals_the_two_layers_within_their_rounding(case, tactic):
    generator = torch.Generator().manual_seed(7)
    inputs, attrs = _float_chain(*case, generator)
    expected = conv_chain_layer(inputs, dict(attrs, tactic=REFERENCE)).float()
    moved = [t.to(DEVICE) for t in inputs]
    moved[1] = chain_weight_for_tactic(moved[1], tactic)
    got = conv_chain_layer(moved, dict(attrs, tactic=tactic))
    assert got.dtype == torch.float16
    # The intermediate is rounded to float16 as the first layer stored it; the sums' order differs.
    assert torch.allclose(got.cpu().float(), expected, atol=4e-3, rtol=4e-3)


def _mixed_chain(cin, cmid, cout, k, stride, pads, dilation, generator, *, float_input=False):
    """A mixed ConvChain's inputs and attributes: a QConv writing float, then a 1×1 FusedConv in float16
    reading it (an INT8 layer before a float output head)."""
    inputs, attrs = _int8_chain(cin, cmid, cout, k, stride, pads, dilation, generator, float_input=float_input)
    first = dict(attrs["first"], output_inv_scale=None)
    w2 = (torch.randn(cout, cmid, 1, 1, generator=generator) / cmid ** 0.5).half()
    b2 = (torch.randn(cout, generator=generator) * 0.1).half()
    second = dict(_geometry_attrs(1, 1, (0, 0, 0, 0), 1), activation="SiLU")
    return inputs[:5] + [w2, b2], {"layers": "QConv", "second_layers": "FusedConv", "second_dtype": "float16",
                                   "first_inputs": 5, "first": first, "second": second}


@pytest.mark.parametrize("case", [CASES[0], CASES[1], CASES[5]], ids=lambda c: "{}-{}-{}-k{}s{}".format(*c[:5]))
@pytest.mark.parametrize("float_input", [False, True])
def test_mixed_chain_equals_the_int8_layer_then_the_float16_layer(case, float_input):
    """The INT8 layer's float output rounded to float16 as its reader takes it, then the float16 product:
    what the reference (the two layers in turn) computes, up to the order of float32 sums."""
    generator = torch.Generator().manual_seed(11)
    inputs, attrs = _mixed_chain(*case, generator, float_input=float_input)
    split = attrs["first_inputs"]
    middle = qconv(inputs[:split], dict(attrs["first"], tactic=REFERENCE))
    assert middle.dtype == torch.float32 and middle.abs().max() > 1  # the INT8 layer's float output
    expected = conv_chain_layer(inputs, dict(attrs, tactic=REFERENCE))
    assert expected.dtype == torch.float16
    got = conv_chain_layer(_on_device(inputs, TILES[0]), dict(attrs, tactic=TILES[0]))
    assert got.dtype == torch.float16 and got.is_contiguous(memory_format=torch.channels_last)
    assert torch.allclose(got.cpu().float(), expected.float(), atol=4e-3, rtol=4e-3)
    # The intermediate is not the codes an INT8 second layer would read: skipping the float16 rounding
    # of it, or quantizing it, gives other numbers.
    unrounded = torch.nn.functional.conv2d(middle, inputs[5].float(), inputs[6].float())
    unrounded = torch.nn.functional.silu(unrounded)
    assert not torch.equal(unrounded.half(), expected)


def test_refuses_an_unpacked_first_weight_and_a_middle_wider_than_a_tile():
    generator = torch.Generator().manual_seed(1)
    inputs, attrs = _int8_chain(*CASES[1], generator)
    x, w1, b1, _, s1, w2, b2, _, s2 = inputs
    geometry = ConvGeometry((3, 3), (1, 1), (1, 1), (1, 1), (9, 11))
    first, second = ChainLayer(b1, s1, input_inv_scale=40.0, output_inv_scale=40.0), ChainLayer(b2, s2)
    with pytest.raises(ValueError, match="packed by pack_weight"):
        conv_chain(x, w1.permute(1, 0, 2, 3).contiguous().permute(1, 0, 2, 3), w2, geometry, first, second,
                   CHAIN_TILES[0])
    wide = torch.zeros(MAX_CHAIN_CHANNELS + 8, 64, 1, 1, dtype=torch.int8)
    with pytest.raises(ValueError, match=f"at most {MAX_CHAIN_CHANNELS}"):
        conv_chain(x, wide, torch.zeros(8, MAX_CHAIN_CHANNELS + 8, 1, 1, dtype=torch.int8),
                   ConvGeometry((1, 1), (1, 1), (0, 0), (1, 1), (9, 11)), first, second, CHAIN_TILES[0])
    with pytest.raises(ValueError, match="writes codes the second reads"):
        conv_chain(x, chain_weight_for_tactic(w1, TILES[0]), w2, geometry, ChainLayer(b1, s1), second, CHAIN_TILES[0])
    with pytest.raises(ValueError, match="mixed chain's INT8 layer writes the float16 or bfloat16"):
        conv_chain(x, chain_weight_for_tactic(w1, TILES[0]), w2.float(), geometry, ChainLayer(b1, s1),
                   ChainLayer(b2, None), CHAIN_TILES[0])


def test_tile_names_parse_and_a_block_that_is_no_tensor_core_tile_is_refused():
    for tile in CHAIN_TILES + GATHERED_CHAIN_TILES:
        assert parse_tactic(tile.name) == tile
    assert GATHERED_CHAIN_TILES[0].name == "chain.128x32x64.w4.s4.gathered"
    with pytest.raises(TacticNameError):
        ChainTile.parse("chain.64x24x64.w4.s3")
    assert len(chain_tiles(1)) < len(chain_tiles(3)) == len(CHAIN_TILES)


def test_tiles_narrow_their_n_block_to_the_second_layer_s_outputs():
    """32 outputs: no tile spends columns past 32 (the 64- and 128-column ones narrowed, their other
    blocks kept); 5 outputs: 16 columns, the narrowest; 128 or more: the tiles as listed."""
    narrowed = chain_tiles(3, 32)
    assert [tile.block_n for tile in narrowed] == [32] * len(narrowed)
    assert [(tile.block_m, tile.block_k) for tile in narrowed] == [(t.block_m, t.block_k) for t in CHAIN_TILES]
    assert [tile.block_n for tile in chain_tiles(3, 64)] == [64, 64, 64, 64, 64, 64]
    assert len(chain_tiles(3, 16)) == len(CHAIN_TILES)
    assert {tile.block_n for tile in chain_tiles(3, 5)} == {16}
    assert chain_tiles(3, 128) == chain_tiles(3, 200) == chain_tiles(3)
    assert all(parse_tactic(tile.name) == tile for tile in narrowed)
    assert middle_width(80, int8=True) == 128 and middle_width(8, int8=True) == 32 and middle_width(8, int8=False) == 16


def test_gathered_tiles_are_offered_where_the_row_walk_would_run_over_whole_taps_of_a_block():
    """16 channels at 3×3 (YOLO's first backbone chain), INT8 or float: the row walk's place, each tap's
    channels half a 32-column block. Not at 32 channels (the tap walk fills the block), 24 (no power of
    two: an element gather), 48 (no row walk), nor a 1×1."""
    for eight_bit in (True, False):
        tiles = chain_tiles(2, 32, 16, (3, 3), eight_bit=eight_bit)
        assert tiles[:len(chain_tiles(2, 32))] == chain_tiles(2, 32)
        assert [t for t in tiles if t.gathered] == [replace(GATHERED_CHAIN_TILES[0], block_n=32)]
    assert len([t for t in chain_tiles(3, 64, 16, (3, 3)) if t.gathered]) == len(GATHERED_CHAIN_TILES)
    for channels, kernel in ((32, (3, 3)), (24, (3, 3)), (48, (3, 3)), (16, (1, 1)), (3, (3, 3))):
        assert not any(t.gathered for t in chain_tiles(3, 32, channels, kernel)), (channels, kernel)
    assert gathered_walk_applies(8, (3, 3), 32, eight_bit=True) and not gathered_walk_applies(16, (3, 3), 16, True)


class _LaunchRecorder:
    """Stands in for the kernel: records the walk's compile-time choices of one launch."""

    def __init__(self):
        self.walk = None

    def __getitem__(self, grid):
        def launch(*args, **meta):
            self.walk = {name: meta[name] for name in ("GATHER", "C_TAPS", "ROW_K", "CHANNEL_TAIL")}
        return launch


@pytest.mark.parametrize("gathered", [False, True])
def test_a_gathered_tile_launches_the_gather_of_whole_taps_where_its_twin_walks_rows(monkeypatch, gathered):
    """YOLO's first chain (16 channels, 3×3 stride 2): the tile walks filter rows of 64 columns, its
    gathered twin gathers two taps of 16 channels a 32-column step, told as a power of two."""
    import sartor.kernels.conv.chain as chain_module

    recorder = _LaunchRecorder()
    monkeypatch.setattr(chain_module, "_conv_chain_kernel", recorder)
    generator = torch.Generator().manual_seed(5)
    inputs, attrs = _int8_chain(*CASES[0], generator)
    tactic = replace(GATHERED_CHAIN_TILES[0], gathered=gathered).name
    conv_chain_layer(_on_device(inputs, tactic), dict(attrs, tactic=tactic))
    if gathered:
        assert recorder.walk == {"GATHER": True, "C_TAPS": 16, "ROW_K": 0, "CHANNEL_TAIL": False}
    else:
        assert recorder.walk == {"GATHER": False, "C_TAPS": 0, "ROW_K": 64, "CHANNEL_TAIL": False}


def test_a_filter_row_is_one_k_step_for_few_channels_a_multiple_of_8_whose_row_fits_a_block():
    assert row_block(16, (3, 3), eight_bit=True) == 64 and row_block(32, (3, 3), eight_bit=True) == 128
    assert row_block(24, (3, 3), eight_bit=True) == 128 and row_block(8, (3, 3), eight_bit=True) == 32
    assert row_block(8, (3, 3), eight_bit=False) == 32 and row_block(8, (1, 2), eight_bit=False) == 16
    assert row_block(48, (3, 3), eight_bit=True) == 0  # 144 columns: more than a block
    assert row_block(12, (3, 3), eight_bit=True) == 0 and row_block(3, (3, 3), eight_bit=True) == 0  # the gather's
    assert row_block(16, (1, 1), eight_bit=True) == row_block(16, (3, 1), eight_bit=True) == 0  # one tap a row


def test_int8_chain_reads_a_split_half_off_a_16_byte_boundary_a_row_at_a_time():
    """The second 40 of 80 channels of codes, as a C2f's Split hands them on: each pixel's run starts
    40 bytes in, 8 past a 16-byte boundary, and pixels are 80 codes apart. The kernel reads from the
    boundary before (`aligned_start`), its rows told 8-element runs; equal to the two layers on the
    slice made contiguous."""
    generator = torch.Generator().manual_seed(16)
    inputs, attrs = _int8_chain(40, 32, 32, 3, 1, (1, 1, 1, 1), 1, generator)
    wide = torch.randint(-127, 128, (2, 80, 9, 11), dtype=torch.int8, generator=generator)
    half = wide.contiguous(memory_format=torch.channels_last)[:, 40:]
    assert half.data_ptr() % 16 == 8 and half.stride()[3] == 80
    inputs[0] = half
    expected = _two_layers([half.contiguous(memory_format=torch.channels_last), *inputs[1:]], attrs)
    assert expected.unique().numel() > 50
    got = conv_chain_layer(_on_device(inputs, TILES[0]), dict(attrs, tactic=TILES[0]))
    assert torch.equal(got.cpu(), expected)


def test_tactics_offered_on_cuda_only_and_the_op_registered_once():
    generator = torch.Generator().manual_seed(2)
    inputs, attrs = _int8_chain(*CASES[0], generator)
    assert chain_tactics(inputs, attrs) == [REFERENCE]  # CPU tensors: the reference alone
    assert default_registry()[CHAIN].impl is conv_chain_layer
    if DEVICE == "cuda":
        moved = _on_device(inputs, REFERENCE)
        offered = chain_tactics(moved, attrs, effort=2)
        assert offered == [REFERENCE] + [t.name for t in chain_tiles(2, 32, 16, (3, 3))]
        assert any(parse_tactic(name).gathered for name in offered[1:])


def _concat_buffer(like: torch.Tensor, channels_before: int, channels_after: int) -> torch.Tensor:
    """A channels-last buffer with `like`'s channels between others, filled with a sentinel."""
    n, c, h, w = like.shape
    buffer = torch.empty(n, channels_before + c + channels_after, h, w, dtype=like.dtype, device=DEVICE,
                         memory_format=torch.channels_last)
    return buffer.fill_(-5 if like.dtype == torch.int8 else -5.0)


@pytest.mark.parametrize("precision", ["int8", "fp16"])
def test_a_chain_writes_into_a_channel_slice_of_a_concat_buffer(precision):
    """Under a C2f's Split the chain's output lies in the Concat's buffer (runtime/concat_plan.py):
    the kernel stores it there at the buffer's pixel stride, equal to the layer's own output, and
    leaves the buffer's other channels alone."""
    generator = torch.Generator().manual_seed(21)
    if precision == "int8":
        inputs, attrs = _int8_chain(*CASES[0], generator)
    else:
        inputs, attrs = _float_chain(*CASES[0], generator)
    moved = _on_device(inputs, TILES[0])
    attrs = dict(attrs, tactic=TILES[0])
    expected = conv_chain_layer(moved, attrs)
    buffer = _concat_buffer(expected, 8, 16)
    target = buffer[:, 8:8 + expected.shape[1]]
    assert conv_chain_into(moved, attrs, target) is target
    assert torch.equal(target.cpu(), expected.cpu())
    outside = torch.cat([buffer[:, :8], buffer[:, 8 + expected.shape[1]:]], dim=1)
    assert bool((outside.cpu() == -5).all())


def test_a_chain_leaves_a_slice_it_cannot_write_to_the_concat():
    """The reference (two layers in turn), an output of another dtype and a tensor whose pixels are
    not evenly spaced channel runs: None, and the executor copies the layer's result instead."""
    generator = torch.Generator().manual_seed(22)
    inputs, attrs = _int8_chain(*CASES[0], generator)
    moved = _on_device(inputs, TILES[0])
    expected = conv_chain_layer(moved, dict(attrs, tactic=TILES[0]))
    slot = _concat_buffer(expected, 0, 8)[:, :expected.shape[1]]
    assert conv_chain_into(_on_device(inputs, REFERENCE), dict(attrs, tactic=REFERENCE), slot) is None
    assert conv_chain_into(moved, dict(attrs, tactic=TILES[0]), slot.float()) is None
    assert conv_chain_into(moved, dict(attrs, tactic=TILES[0]), torch.empty_like(expected).contiguous()) is None
    assert bool((slot.cpu() == -5).all())
