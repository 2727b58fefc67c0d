"""The frontend channel (ipc.py) when a frame is wrong: an unreadable header is dropped and the stream
stays in step, an oversized frame closes the channel (and the frontend comes back), a reply that
cannot be decoded fails its request (500 / INTERNAL) instead of leaving it waiting, and senders split
groups to stay within the limit. Channels on fake transports, then one server with two frontends."""
from __future__ import annotations

import asyncio
import socket

import numpy as np
import pytest
from serve_helpers import add_model, grpc_client, grpc_infer, http_client, http_infer, images, reference, running
from serve_helpers import wait_for

from sartor.serve import frontend_pool, ipc
from sartor.serve.errors import InvalidRequest
from sartor.serve.workers import RemoteCore

pytest.importorskip("grpc")
from tritonclient.utils import InferenceServerException  # noqa: E402


class Transport:
    """What a Channel needs of an asyncio transport: writes recorded, close() remembered."""

    def __init__(self) -> None:
        self.written: list[bytes] = []
        self.closed = False

    def write(self, data) -> None:
        self.written.append(bytes(data))

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True


def channel(max_frame: int = ipc.REPLY_FRAME_LIMIT, on_frame=None) -> tuple[ipc.Channel, list, Transport]:
    got: list = []
    ch = ipc.Channel(on_frame or (lambda header, payload: got.append((header, bytes(payload)))), max_frame=max_frame)
    transport = Transport()
    ch.connection_made(transport)
    return ch, got, transport


def feed(ch: ipc.Channel, data: bytes) -> None:
    """Bytes as the event loop hands them over: into get_buffer(), then buffer_updated()."""
    while data:
        view = ch.get_buffer(-1)
        n = min(len(view), len(data))
        view[:n] = data[:n]
        ch.buffer_updated(n)
        data = data[n:]


def raw_frame(head: bytes, payload: bytes = b"") -> bytes:
    return ipc.PREFIX.pack(len(head), len(payload)) + head + payload


def good_frame(header: dict, payload: bytes = b"") -> bytes:
    return b"".join(bytes(memoryview(p)) for p in ipc.frame(header, (payload,) if payload else ()))


# ---- unreadable headers ------------------------------------------------------------------------------------

@pytest.mark.parametrize("head", [b"{not json", b"\xff\xfe", b"[1, 2]", b""])
def test_a_frame_with_an_unreadable_header_is_dropped_and_the_next_is_delivered(head):
    ch, got, transport = channel()
    feed(ch, raw_frame(head, b"\0" * 5) + good_frame({"k": "x", "n": 1}, b"abc"))
    assert got == [({"k": "x", "n": 1}, b"abc")]
    feed(ch, good_frame({"k": "x", "n": 2}))  # later reads too: the stream stayed in step
    assert got[-1] == ({"k": "x", "n": 2}, b"") and not transport.closed


def test_a_large_frame_with_an_unreadable_header_is_dropped_too():
    # Large enough to be read into a buffer of its own, and fed in small pieces.
    ch, got, transport = channel()
    data = raw_frame(b"{oops", b"\1" * (ipc.OWN_BUFFER_FROM + 10)) + good_frame({"k": "x"}, b"z")
    for start in range(0, len(data), 4096):
        feed(ch, data[start:start + 4096])
    assert got == [({"k": "x"}, b"z")] and not transport.closed


# ---- oversized frames -----------------------------------------------------------------------------------------

def test_an_oversized_frame_closes_the_channel_without_allocating_it():
    ch, got, transport = channel(max_frame=1 << 20)
    feed(ch, ipc.PREFIX.pack(16, 0xFFFFFFF0))  # asks for 4 GiB
    assert transport.closed and ch._own is None
    feed(ch, good_frame({"k": "x"}))  # whatever still arrives is not read
    assert got == []


def test_a_frame_at_the_limit_is_delivered():
    frame = good_frame({"k": "x"}, b"\2" * 1000)
    ch, got, transport = channel(max_frame=len(frame))
    feed(ch, frame)
    assert got == [({"k": "x"}, b"\2" * 1000)] and not transport.closed


def test_the_limits_cover_what_the_senders_send():
    # The main process's limit for request frames leaves room for the largest payload a worker sends.
    limit = ipc.request_payload_limit(1 << 20)
    assert limit == 8 << 20 and ipc.frame_limit(limit) >= ipc.PREFIX.size + ipc.HEADER_ROOM + limit
    assert ipc.REPLY_PAYLOAD_LIMIT < 1 << 32  # what the prefix's payload field can state


def test_groups_are_split_to_stay_within_the_payload_limit():
    members = [({"id": k}, [np.zeros(k, np.uint8)]) for k in (40, 40, 30, 90, 10)]
    frames = list(ipc.grouped_frames("G", members, 100))
    assert [[h["id"] for h in header["rs"]] for header, _ in frames] == [[40, 40], [30], [90, 10]]
    assert all(sum(b.nbytes for b in buffers) <= 100 for _, buffers in frames)
    many = [({"id": k}, []) for k in range(ipc.MAX_GROUP + 1)]
    assert [len(h["rs"]) for h, _ in ipc.grouped_frames("g", many, 100)] == [ipc.MAX_GROUP, 1]
    assert len(list(ipc.grouped_frames("G", members, 1 << 20))) == 1  # not split where it fits


# ---- replies that cannot be decoded -----------------------------------------------------------------------------

def reply_header(request_id: int, dtype: str = "<f4", nbytes: int = 8) -> dict:
    return {"k": "r", "id": request_id, "model": "m", "version": "1",
            "outputs": [{"name": "y", "dtype": dtype, "shape": [2], "bytes": nbytes}]}


async def _ask(answer_frames) -> tuple[list, RemoteCore]:
    """Requests 1 and 2 sent through a RemoteCore, then `answer_frames(...)` fed back; their results."""
    core = RemoteCore(payload_limit=1 << 20)
    ch, _, transport = channel(on_frame=core.on_frame)
    core.channel = ch
    tasks = [asyncio.ensure_future(core.infer("m", None, {"x": np.zeros(2, np.float32)})) for _ in range(2)]
    await asyncio.sleep(0.01)
    assert transport.written  # the requests left
    feed(ch, answer_frames)
    done, pending = await asyncio.wait(tasks, timeout=2.0)
    assert not pending, "a request is still waiting after its answer arrived"
    results = [t.exception() or t.result() for t in tasks]
    return results, core


def test_a_reply_with_an_unknown_dtype_fails_its_request_instead_of_hanging():
    frames = good_frame(reply_header(1, dtype="<c8"), b"\0" * 8) + good_frame(reply_header(2), b"\0" * 8)
    (first, second), core = asyncio.run(_ask(frames))
    assert isinstance(first, ipc.RemoteInternalError)
    assert first.http_status == 500 and first.grpc_code == "INTERNAL"
    assert "\n" not in str(first) and "cannot be read" in str(first) and "<c8" in str(first)
    np.testing.assert_array_equal(second.outputs["y"], np.zeros(2, np.float32))  # its neighbour is answered
    assert core._waiting == {}


def test_a_grouped_reply_fails_only_the_member_that_cannot_be_decoded():
    group = {"k": "G", "rs": [reply_header(1, nbytes=8), {"k": "?", "id": 2}]}
    (first, second), core = asyncio.run(_ask(good_frame(group, b"\0" * 8)))
    np.testing.assert_array_equal(first.outputs["y"], np.zeros(2, np.float32))
    assert isinstance(second, ipc.RemoteInternalError) and core._waiting == {}


def test_a_grouped_reply_that_cannot_be_split_fails_every_member_it_names():
    group = {"k": "G", "rs": [reply_header(1), {"k": "r", "id": 2, "outputs": "not a list"}]}
    (first, second), core = asyncio.run(_ask(good_frame(group, b"\0" * 8)))
    assert isinstance(first, ipc.RemoteInternalError) and isinstance(second, ipc.RemoteInternalError)
    assert core._waiting == {}


def test_a_request_larger_than_the_channel_limit_is_refused_before_it_is_sent():
    async def ask():
        core = RemoteCore(payload_limit=100)
        core.channel, _, transport = channel(on_frame=core.on_frame)
        with pytest.raises(InvalidRequest, match="limit of the frontend channel"):
            await core.infer("m", None, {"x": np.zeros(26, np.float32)})
        await asyncio.sleep(0.01)
        return transport.written, core
    written, core = asyncio.run(ask())
    assert written == [] and core._waiting == {}


# ---- through a server with two frontends--------------------------------------------------------------------------

@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_plan):
    root = tmp_path_factory.mktemp("ipc") / "repo"
    add_model(root, "tiny", tiny_plan, "max_batch_size: 4\n")
    with running(root, frontends=2, metrics_port=None) as server:
        yield server


def test_the_main_process_drops_a_bad_header_and_answers_the_next_request(server, tiny_plan):
    x = images(1, seed=3)
    described, buffers = ipc.encode_tensors({"images": x})
    request = {"k": "i", "id": 7, "model": "tiny", "version": None, "inputs": described, "outputs": None,
               "regions": {}, "timeout": None, "deadline": None}
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.connect(server._pool._path("ipc"))
        sock.settimeout(20)
        sock.sendall(raw_frame(b"{garbage") + good_frame({"k": "g", "rs": [request]}, bytes(buffers[0])))
        received = b""
        while len(received) < ipc.PREFIX.size or len(received) < ipc.PREFIX.size + sum(
                ipc.PREFIX.unpack_from(received)):
            chunk = sock.recv(1 << 16)
            assert chunk, "the main process closed the channel"
            received += chunk
    header, payload = ipc.parse(received)
    assert header["k"] == "r" and header["id"] == 7
    np.testing.assert_allclose(ipc.outcome_of(header, payload).outputs["logits"], reference(tiny_plan, x),
                               rtol=1e-5, atol=1e-6)


def test_an_oversized_frame_from_a_frontend_closes_its_channel_and_it_comes_back(server, tiny_plan):
    before = list(server.frontend_pids)
    link = next(link for link in server._pool._links if link.index == 0)

    def oversized() -> None:  # as if the frontend had written it
        data = ipc.PREFIX.pack(64, 0xFFFFFFF0)
        link.channel.get_buffer(-1)[:len(data)] = data
        link.channel.buffer_updated(len(data))
    server._loop.call_soon_threadsafe(oversized)
    after = wait_for(lambda: len(server.frontend_pids) == 2 and before[0] not in server.frontend_pids
                     and list(server.frontend_pids), timeout=25, what="the frontend to be restarted")
    assert after[1] == before[1]  # the other frontend kept its channel
    x = images(2, seed=4)
    for _ in range(4):  # new connections: each lands on either process
        client = http_client(server)
        np.testing.assert_allclose(http_infer(client, x).as_numpy("logits"), reference(tiny_plan, x), rtol=1e-5,
                                   atol=1e-6)
        client.close()


def test_an_undecodable_reply_is_a_500_and_internal_through_the_frontend(server, monkeypatch):
    def unreadable(request_id, outcome):
        header, buffers = reply(request_id, outcome)
        header["outputs"][0]["dtype"] = "<c8"  # a dtype the channel does not carry
        return header, buffers
    reply = frontend_pool.reply
    monkeypatch.setattr(frontend_pool, "reply", unreadable)
    x = images(1, seed=5)
    client = http_client(server)
    with pytest.raises(InferenceServerException) as http_error:
        http_infer(client, x)
    client.close()
    client = grpc_client(server)
    with pytest.raises(InferenceServerException) as grpc_error:
        grpc_infer(client, x, client_timeout=20)
    client.close()
    assert http_error.value.status() == "500" and "cannot be read" in http_error.value.message()
    assert grpc_error.value.status() == "StatusCode.INTERNAL" and "cannot be read" in grpc_error.value.message()
    assert "\n" not in http_error.value.message()


def test_outputs_larger_than_the_reply_limit_are_a_one_line_400(server, monkeypatch):
    monkeypatch.setattr(frontend_pool, "REPLY_PAYLOAD_LIMIT", 4)  # the tiny model's logits are larger
    client = http_client(server)
    with pytest.raises(InferenceServerException) as error:
        http_infer(client, images(1, seed=6))
    client.close()
    assert error.value.status() == "400" and "ask for them in shared memory" in error.value.message()
