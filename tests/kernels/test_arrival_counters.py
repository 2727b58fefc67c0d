"""kernels/common/arrival_counters.py and the split-K shares that count in at them
(conv/igemm.py `reduce_shares_in_place`): who owns which counters, that the last share to arrive
adds the slots in share order whichever share it is, and that every counter is back at zero."""
from __future__ import annotations

import pytest
import torch

# conftest.py switches Triton to its interpreter when there is no GPU.
triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

from sartor.kernels.common.arrival_counters import (  # noqa: E402
    ArrivalCounters, bound, bound_counters, current_launch_site, reset_launch_site, set_launch_site, take_counters)
from sartor.kernels.conv import igemm  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def test_a_site_gets_the_same_zeroed_words_every_time_and_sites_never_share():
    counters = ArrivalCounters()
    first = counters.take(3, 12, "cpu")
    assert first.dtype == torch.int32 and first.shape == (12,) and not first.any()
    assert counters.take(3, 12, "cpu").data_ptr() == first.data_ptr()
    other = counters.take(4, 12, "cpu")
    wider = counters.take(3, 40, "cpu")  # another tile count at the same site (another profile's tactic)
    spans = sorted((t.data_ptr(), t.data_ptr() + 4 * t.numel()) for t in (first, other, wider))
    assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:])), "counters overlap"
    assert counters.words == 12 + 12 + 40


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a CUDA device's two names need CUDA")
def test_cuda_and_its_numbered_name_are_one_devices_counters():
    # A kernel asks for its tensor's device ("cuda:0"), a caller may say "cuda": one set of words.
    counters = ArrivalCounters()
    plain = counters.take("conv", 4, "cuda")
    numbered = counters.take("conv", 4, torch.device("cuda", torch.cuda.current_device()))
    assert numbered.data_ptr() == plain.data_ptr() and counters.words == 4


def test_bound_counters_serve_launches_at_a_site_and_the_stream_serves_the_rest():
    context = ArrivalCounters()
    unbound = take_counters(8, "cpu")
    assert take_counters(8, "cpu").data_ptr() == unbound.data_ptr()  # one stream's kernels run in turn
    with bound(context):
        assert bound_counters() is context
        assert take_counters(8, "cpu").data_ptr() == unbound.data_ptr()  # no site: not the context's
        token = set_launch_site(5)
        try:
            assert current_launch_site() == 5
            mine = take_counters(8, "cpu")
        finally:
            reset_launch_site(token)
    assert mine.data_ptr() == context.take(5, 8, "cpu").data_ptr() != unbound.data_ptr()
    assert bound_counters() is None and current_launch_site() is None


if triton is not None:
    @triton.jit
    def _reversed_arrivals_kernel(parts_ptr, ws_ptr, arrivals_ptr, out_ptr, last_ptr, M, COUT,
                                  SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        """Share s of a tile holds parts[s]; program (tile, j) plays share SPLIT_K - 1 - j, so that in
        the interpreter's order (j ascending) share 0 arrives last."""
        tile = tl.program_id(0)
        share = SPLIT_K - 1 - tl.program_id(1)
        offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = tl.arange(0, BLOCK_N)
        m_ok = offs_m < M
        n_ok = offs_n < COUT
        acc = tl.load(parts_ptr + ((share * M + offs_m)[:, None] * COUT + offs_n[None, :]),
                      mask=m_ok[:, None] & n_ok[None, :], other=0.0)
        total, last = igemm.reduce_shares_in_place(acc, ws_ptr, arrivals_ptr + tile, share, offs_m, offs_n, m_ok,
                                                   n_ok, M, COUT, SPLIT_K)
        if last:
            tl.store(out_ptr + (offs_m[:, None] * COUT + offs_n[None, :]), total, mask=m_ok[:, None] & n_ok[None, :])
            tl.store(last_ptr + tile, share)


def test_the_last_share_adds_every_slot_in_share_order_and_zeroes_its_counter():
    """Float32 parts whose sum depends on the order (1e8 + 1 - 1e8): the result is the share-order
    sum, as the epilogue kernel adds, even though share 0 arrives last (in the interpreter; on a
    GPU any share may); every tile's counter is back at zero."""
    split, m, cout, block_m = 4, 40, 16, 16
    generator = torch.Generator().manual_seed(2)
    parts = torch.randn(split, m, cout, generator=generator)
    parts[0] += 1e8
    parts[2] -= 1e8
    tiles = triton.cdiv(m, block_m)
    ws = torch.full((split, m, cout), float("nan"), device=DEVICE)
    arrivals = torch.zeros(tiles, dtype=torch.int32, device=DEVICE)
    out = torch.full((m, cout), float("nan"), device=DEVICE)
    last = torch.full((tiles,), -1, dtype=torch.int32, device=DEVICE)
    _reversed_arrivals_kernel[(tiles, split)](parts.to(DEVICE), ws, arrivals, out, last, m, cout, SPLIT_K=split,
                                              BLOCK_M=block_m, BLOCK_N=cout)
    expected = ((parts[0] + parts[1]) + parts[2]) + parts[3]
    assert not torch.equal(expected, ((parts[3] + parts[2]) + parts[1]) + parts[0])  # the order shows
    assert torch.equal(out.cpu(), expected)
    assert not arrivals.any()
    if DEVICE == "cpu":
        assert last.tolist() == [0] * tiles
    else:
        assert ((last >= 0) & (last < split)).all()


@pytest.mark.skipif(DEVICE != "cuda", reason="shares that really run at once, graph replays and streams: CUDA")
def test_last_reduces_on_the_gpu_every_launch_replay_and_stream_gives_the_epilogue_kernels_bits():
    """A batch-1 layer's shape (20×20, 128 → 256 channels, 3×3: 28 tiles of 64×64 split 4 ways), INT8
    and FP16: eager launches, launches replayed from a CUDA graph, and two streams at once each
    with its own context's counters, all equal the epilogue kernel's result, the counters at zero."""
    from sartor.kernels.conv.igemm import ConvGeometry, TileConfig, conv_igemm, pack_weight
    generator = torch.Generator().manual_seed(4)
    geometry = ConvGeometry((3, 3), (1, 1), (1, 1), (1, 1), (20, 20))
    two_kernels, one_kernel = (TileConfig(64, 64, 64, 4, 4, split_k=4, last_reduces=last) for last in (False, True))
    xq = torch.randint(-127, 128, (1, 128, 20, 20), dtype=torch.int8, generator=generator).cuda()
    wq = pack_weight(torch.randint(-127, 128, (256, 128, 3, 3), dtype=torch.int8, generator=generator).cuda())
    scale = (torch.rand(256, generator=generator) * 1e-4).cuda()
    xh = torch.randn(1, 128, 20, 20, generator=generator).cuda().half()
    wh = pack_weight((torch.randn(256, 128, 3, 3, generator=generator) / 30).cuda().half())

    def int8(tile, x=xq):
        return conv_igemm(x.contiguous(memory_format=torch.channels_last), wq, None, geometry, tile,
                          dequant_scale=scale, activation="SiLU", output_inv_scale=20.0)

    def fp16(tile, x=xh):
        return conv_igemm(x.contiguous(memory_format=torch.channels_last), wh, None, geometry, tile, activation="SiLU")

    for layer in (int8, fp16):
        expected = layer(two_kernels).clone()
        for _ in range(50):
            assert torch.equal(layer(one_kernel), expected)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            layer(one_kernel)  # the counters made before the capture
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=stream):
                outs = [layer(one_kernel) for _ in range(8)]
        torch.cuda.current_stream().wait_stream(stream)
        for _ in range(20):
            graph.replay()
            assert all(torch.equal(out, expected) for out in outs)
    flipped = (-xq.float()).clamp(-127, 127).to(torch.int8)
    expected = {0: int8(two_kernels).clone(), 1: int8(two_kernels, flipped).clone()}
    contexts, streams = [ArrivalCounters(), ArrivalCounters()], [torch.cuda.Stream(), torch.cuda.Stream()]
    results = {0: [], 1: []}
    for stream in streams:
        stream.wait_stream(torch.cuda.current_stream())
    for _ in range(30):
        for i in (0, 1):
            with torch.cuda.stream(streams[i]), bound(contexts[i]):
                site = set_launch_site("layer")
                try:
                    results[i].append(int8(one_kernel, xq if i == 0 else flipped))
                finally:
                    reset_launch_site(site)
    torch.cuda.synchronize()
    for i in (0, 1):
        assert all(torch.equal(out, expected[i]) for out in results[i])
        assert contexts[i].words == 28 and not contexts[i].take("layer", 28, xq.device).any()
