"""sartor's own nvJPEG binding: its struct layout and errors here, its frames against torchvision's on a GPU."""
from __future__ import annotations

import ctypes
import io
import threading
import warnings
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image

from sartor.errors import ConfigError, DataError
from sartor.pipeline import decode as decode_module
from sartor.pipeline import read_sources
from sartor.pipeline.decode import GpuJpegDecoder, GpuJpegDecoders
from sartor.pipeline.nvjpeg_batched import DecodedJpegs, NvjpegBatched, NvjpegImage, _buffer
from sartor.pipeline.prepare import stack_frames



def jpeg_bytes(size: tuple[int, int], seed: int = 0) -> bytes:
    """A baseline JPEG of smooth colour ramps and noise (w, h): made here, so the GPU machine needs no photos."""
    w, h = size
    y, x = np.mgrid[0:h, 0:w]
    noise = np.random.default_rng(w + h + seed).integers(0, 40, (h, w, 3))
    pixels = np.stack([x * 255 // w, y * 255 // h, (x + y) * 255 // (w + h)], axis=-1) + noise
    buffer = io.BytesIO()
    Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8)).save(buffer, "JPEG", quality=90)
    return buffer.getvalue()


def test_the_image_struct_is_nvjpegs_four_pointers_and_four_size_t_pitches():
    assert ctypes.sizeof(NvjpegImage) == 4 * ctypes.sizeof(ctypes.c_void_p) + 4 * ctypes.sizeof(ctypes.c_size_t)
    assert NvjpegImage.pitch.offset == 4 * ctypes.sizeof(ctypes.c_void_p)


def test_encoded_images_are_read_in_place_from_bytes_and_cpu_tensors():
    data = jpeg_bytes((64, 48))
    address, length = _buffer(data)
    assert length == len(data) and ctypes.string_at(address, length) == data
    tensor = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    assert _buffer(tensor) == (tensor.data_ptr(), len(data))


def test_other_encoded_tensors_are_refused_with_one_line():
    with pytest.raises(ConfigError, match="contiguous uint8 CPU tensors"):
        _buffer(torch.zeros(8, dtype=torch.int32))
    with pytest.raises(ConfigError, match="contiguous uint8 CPU tensors"):
        _buffer(torch.zeros(8, dtype=torch.uint8)[::2])


def test_a_cpu_device_is_refused():
    with pytest.raises(ConfigError, match="CUDA device"):
        NvjpegBatched("cpu")


def test_an_unknown_backend_is_refused_naming_the_known_ones():
    with pytest.raises(ConfigError, match="nvJPEG backend 'fast' is not one of default, hybrid, gpu_hybrid, hardware"):
        NvjpegBatched("cuda", backend="fast")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="nvJPEG needs CUDA")
@pytest.mark.parametrize("backend", ["default", "hybrid", "gpu_hybrid"])
def test_on_a_gpu_the_other_backends_decode_the_frames_the_hardware_engines_do(backend):
    encoded = [jpeg_bytes((1280, 720)), jpeg_bytes((640, 360), seed=1)]
    stream = torch.cuda.Stream()
    reference = NvjpegBatched("cuda").decode(encoded, stream)
    frames = NvjpegBatched("cuda", backend=backend).decode(encoded, stream)
    stream.synchronize()
    for frame, expected in zip(frames, reference):  # IDCTs may round apart: a level at most on average
        assert frame.shape == expected.shape
        assert (frame.float() - expected.float()).abs().mean() <= 1.0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="nvJPEG needs CUDA")
def test_on_a_gpu_its_frames_are_torchvisions_on_any_stream_priority():
    torchvision_io = pytest.importorskip("torchvision.io")
    encoded = [jpeg_bytes((1280, 720)), jpeg_bytes((640, 360)), jpeg_bytes((1280, 720))]
    expected = torchvision_io.decode_jpeg([torch.frombuffer(bytearray(e), dtype=torch.uint8) for e in encoded],
                                          mode=torchvision_io.ImageReadMode.RGB, device="cuda")
    decoder = NvjpegBatched("cuda")
    for priority in (0, -100):
        stream = torch.cuda.Stream(priority=priority)
        frames = decoder.decode(encoded, stream)
        frames_again = decoder.decode(encoded[:2], stream)  # another batch size: initialised again
        stream.synchronize()
        assert [tuple(f.shape) for f in frames] == [(720, 1280, 3), (360, 640, 3), (720, 1280, 3)]
        for frame, reference in zip(frames + frames_again, expected + expected[:2]):
            assert torch.equal(frame.permute(2, 0, 1), reference)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="nvJPEG needs CUDA")
def test_on_a_gpu_frames_of_one_size_are_views_of_one_batch_tensor_and_frames_of_several_are_not():
    torchvision_io = pytest.importorskip("torchvision.io")
    decoder = NvjpegBatched("cuda")
    stream = torch.cuda.Stream()
    same = [jpeg_bytes((640, 360), seed=k) for k in range(3)]
    jpegs = decoder.decode_batch(same, stream)
    mixed = decoder.decode_batch([jpeg_bytes((640, 360)), jpeg_bytes((320, 240))], stream)
    stream.synchronize()
    assert tuple(jpegs.batch.shape) == (3, 360, 640, 3) and mixed.batch is None
    expected = torchvision_io.decode_jpeg([torch.frombuffer(bytearray(e), dtype=torch.uint8) for e in same],
                                          mode=torchvision_io.ImageReadMode.RGB, device="cuda")
    for k, (frame, reference) in enumerate(zip(jpegs.frames, expected)):
        assert frame.data_ptr() == jpegs.batch[k].data_ptr()
        assert torch.equal(frame.permute(2, 0, 1), reference)


def test_fewer_than_one_decode_state_is_refused():
    with pytest.raises(ConfigError, match="states 0 must be at least 1"):
        NvjpegBatched("cuda", states=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="nvJPEG needs CUDA")
@pytest.mark.parametrize("states", [1, 2, 3])
def test_on_a_gpu_batches_queued_back_to_back_on_the_states_in_turn_keep_their_own_frames(states):
    # Each batch is handed to nvJPEG before the last one has run: a state reused too early would
    # decode one batch's bitstreams into another's frames.
    torchvision_io = pytest.importorskip("torchvision.io")
    batches = [[jpeg_bytes((640 + 64 * k, 360)), jpeg_bytes((320, 240 + 16 * k))] for k in range(5)]
    decoder = NvjpegBatched("cuda", states=states)
    stream = torch.cuda.Stream()
    decoded = [decoder.decode(batch, stream) for batch in batches]
    stream.synchronize()
    for batch, frames in zip(batches, decoded):
        expected = torchvision_io.decode_jpeg([torch.frombuffer(bytearray(e), dtype=torch.uint8) for e in batch],
                                              mode=torchvision_io.ImageReadMode.RGB, device="cuda")
        for frame, reference in zip(frames, expected):
            assert torch.equal(frame.permute(2, 0, 1), reference)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="nvJPEG needs CUDA")
def test_on_a_gpu_a_corrupt_file_fails_the_batch_with_one_line():
    decoder = NvjpegBatched("cuda")
    with pytest.raises(DataError, match="nvJPEG status"):
        decoder.decode([jpeg_bytes((64, 48)), b"\xff\xd8\xff" + b"\x00" * 200], torch.cuda.current_stream())


class DecoderStandingIn:
    """NvjpegBatched's part the pipeline uses: frames H×W×3 (here Pillow's), or DataError for the batch
    when `fail` or when one of its files is not an image, as nvjpegDecodeBatched fails the whole call."""
    def __init__(self, fail: bool = False):
        self.fail, self.batches = fail, []

    def as_decoders(self, device) -> GpuJpegDecoders:
        """What `_batched_decoder` gives: here one decoder, this, on the caller's stream."""
        return GpuJpegDecoders(lambda: GpuJpegDecoder(self), GpuJpegDecoder(self), limit=1)

    def decode_batch(self, encoded: list, stream) -> DecodedJpegs:
        self.batches.append(len(encoded))
        if self.fail:
            raise DataError("nvjpegDecodeBatched: nvJPEG status 3 (bad JPEG)")
        try:
            frames = [torch.from_numpy(np.asarray(Image.open(io.BytesIO(e.numpy().tobytes())).convert("RGB")).copy())
                      for e in encoded]
        except Exception as exc:  # Pillow's refusal, or what a plugin patched into Image.open raises instead
            raise DataError(f"nvjpegDecodeBatched: nvJPEG status 3 ({exc})") from None
        if len({f.shape for f in frames}) > 1:
            return DecodedJpegs(frames)
        batch = torch.stack(frames)  # one allocation, as the binding's for frames of one size
        return DecodedJpegs(list(batch.unbind(0)), batch)


def test_the_pipeline_decodes_a_batch_of_jpegs_in_one_call_to_the_binding(monkeypatch):
    standing_in = DecoderStandingIn()
    monkeypatch.setattr(decode_module, "_batched_decoder", standing_in.as_decoders)
    items = [jpeg_bytes((64, 48)), jpeg_bytes((32, 24))]
    decoded = [None, None]
    decode_module._decode_jpegs_on_gpu(read_sources(items), torch.device("cpu"), [0, 1], decoded)
    assert standing_in.batches == [2]
    for frame, data in zip(decoded, items):
        expected = torch.from_numpy(np.asarray(Image.open(io.BytesIO(data)).convert("RGB")).copy()).permute(2, 0, 1)
        assert frame.error is None and torch.equal(frame.pixels, expected)  # channels first, as torchvision's


def test_a_batch_of_one_size_reaches_preprocessing_as_views_of_the_decoders_one_tensor(monkeypatch):
    # prepare_batch then reads the frames in place (stack_frames) rather than copying them into a stack.
    standing_in = DecoderStandingIn()
    monkeypatch.setattr(decode_module, "_batched_decoder", standing_in.as_decoders)
    items = [jpeg_bytes((64, 48), seed=k) for k in range(3)]
    decoded = [None] * 3
    decode_module._decode_jpegs_on_gpu(read_sources(items), torch.device("cpu"), [0, 1, 2], decoded)
    stacked = stack_frames([d.pixels for d in decoded])
    assert stacked.data_ptr() == decoded[0].pixels.data_ptr()  # a view, not a copy
    for frame, data in zip(stacked, items):
        expected = torch.from_numpy(np.asarray(Image.open(io.BytesIO(data)).convert("RGB")).copy()).permute(2, 0, 1)
        assert torch.equal(frame, expected)


def test_a_batch_the_binding_refuses_is_decoded_one_by_one_by_the_binding_so_only_the_bad_file_fails(monkeypatch):
    standing_in = DecoderStandingIn()
    monkeypatch.setattr(decode_module, "_batched_decoder", standing_in.as_decoders)
    monkeypatch.setattr(decode_module, "_image_io", None)  # torchvision's decoders take no part
    items = [jpeg_bytes((64, 48)), b"\xff\xd8\xff" + b"\x01" * 300 + b"\xff\xd9", jpeg_bytes((32, 24))]
    decoded = [None, None, None]
    decode_module._decode_jpegs_on_gpu(read_sources(items), torch.device("cpu"), [0, 1, 2], decoded)
    assert standing_in.batches == [3, 1, 1, 1]
    for frame, data in zip([decoded[0], decoded[2]], [items[0], items[2]]):
        expected = torch.from_numpy(np.asarray(Image.open(io.BytesIO(data)).convert("RGB")).copy()).permute(2, 0, 1)
        assert frame.error is None and torch.equal(frame.pixels, expected)
    assert decoded[1].pixels is None
    assert decoded[1].error.startswith(f"image {decoded[1].name} is corrupt") and "nvJPEG status 3" in decoded[1].error


def test_without_the_binding_a_batch_torchvision_refuses_is_decoded_one_by_one_by_it(monkeypatch):
    torchvision_io = pytest.importorskip("torchvision.io")
    calls = []

    def counted(encoded, **kwargs):
        calls.append(len(encoded) if isinstance(encoded, list) else 1)
        return torchvision_io.decode_jpeg(encoded, **kwargs)
    monkeypatch.setattr(decode_module, "_batched_decoder", lambda device: None)
    monkeypatch.setattr(decode_module, "_image_io", lambda: SimpleNamespace(decode_jpeg=counted,
                                                                            ImageReadMode=torchvision_io.ImageReadMode))
    items = [jpeg_bytes((64, 48)), b"\xff\xd8\xff" + b"\x01" * 300 + b"\xff\xd9"]
    decoded = [None, None]
    decode_module._decode_jpegs_on_gpu(read_sources(items), torch.device("cpu"), [0, 1], decoded)
    assert calls == [2, 1, 1]
    assert decoded[0].error is None and tuple(decoded[0].pixels.shape) == (3, 48, 64)
    assert decoded[1].pixels is None and decoded[1].error.startswith(f"image {decoded[1].name} is corrupt")


def test_batches_on_two_threads_take_two_decoders_made_on_need_and_a_third_waits_for_one():
    made = []

    def make():
        made.append(GpuJpegDecoder(DecoderStandingIn()))
        return made[-1]
    decoders = GpuJpegDecoders(make, make(), limit=2)
    inside, release = threading.Barrier(3, timeout=10), threading.Event()
    taken, order = [], []

    def batch(name: str) -> None:
        with decoders.take() as decoder:
            taken.append(decoder)
            order.append(name)
            if name != "third":
                inside.wait()  # both first batches hold a decoder at once
                release.wait(10)
    first, second = (threading.Thread(target=batch, args=(n,)) for n in ("first", "second"))
    first.start(), second.start()
    inside.wait()
    assert len(made) == 2 and taken[0] is not taken[1]  # the second decoder made when first needed
    third = threading.Thread(target=batch, args=("third",))
    third.start()
    third.join(0.3)
    assert third.is_alive() and order == ["first", "second"]  # no third decoder: it waits
    release.set()
    for thread in (first, second, third):
        thread.join(10)
    assert order[2] == "third" and taken[2] in taken[:2] and len(made) == 2


def test_a_decoder_that_cannot_be_made_leaves_the_batch_to_wait_for_the_one_there_is():
    calls = []

    def make():
        calls.append(1)
        if len(calls) > 1:
            raise ConfigError("out of device memory")
        return GpuJpegDecoder(DecoderStandingIn())
    decoders = GpuJpegDecoders(make, make(), limit=2)
    with decoders.take() as held:
        got = []
        waiting = threading.Thread(target=lambda: got.append(decoders.take().__enter__()))
        waiting.start()
        waiting.join(0.3)
        assert waiting.is_alive() and decoders.limit == 1  # tried to make a second, failed, waits
    waiting.join(10)
    assert got == [held] and len(calls) == 2


def test_without_the_binding_jpegs_go_to_torchvision_and_the_reason_is_said_once(monkeypatch):
    def unavailable(device):
        raise ConfigError("nvJPEG was not found")
    monkeypatch.setattr(decode_module, "NvjpegBatched", unavailable)
    monkeypatch.setattr(decode_module, "_BATCHED", {})
    with pytest.warns(RuntimeWarning, match="torchvision's decode_jpeg"):
        assert decode_module._batched_decoder(torch.device("cuda:0")) is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # remembered: no second warning
        assert decode_module._batched_decoder(torch.device("cuda:0")) is None


def test_set_decoders_replace_the_devices_shared_ones(monkeypatch):
    """What the benchmarks use to compare nvJPEG backends: every pipeline on the device takes the new
    decoders, made by the given function up to the given count; other devices keep theirs."""
    monkeypatch.setattr(decode_module, "_BATCHED", {torch.device("cuda:1"): None})
    made = []
    decode_module.set_gpu_jpeg_decoders(torch.device("cuda:0"), lambda: made.append(object()) or made[-1], limit=2)
    decoders = decode_module._batched_decoder(torch.device("cuda:0"))
    assert decoders.limit == 2 and len(made) == 1  # the first made at once: a backend that cannot load fails here
    with decoders.take() as first, decoders.take() as second:
        assert {id(first), id(second)} == {id(d) for d in made} and len(made) == 2
    assert decode_module._batched_decoder(torch.device("cuda:1")) is None
