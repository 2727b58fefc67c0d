"""`sartor serve --frontends N`: requests grouped on the frontend channel. A frontend sends the infer
requests of one wake-up as one frame ("g"); the main process validates them, queues them with one
batcher lock (`Batcher.submit_group`) and answers them in groups ("G") as they finish, each member
with its own result, error, timeout and cancellation. Real frontends through HTTP and gRPC, and a
fake frontend on the channel socket for exact groups. CPU engines, loopback only."""
from __future__ import annotations

import socket
import time
import uuid

import numpy as np
import pytest
from serve_helpers import (BATCHING, add_model, grpc_client, grpc_infer, http_client, http_infer, images,
                           reference, run_threads, running, wait_for)

from sartor.serve import ipc

pytest.importorskip("grpc")

QUEUE_OF_TWO = ("max_batch_size: 4\ndynamic_batching { max_queue_delay_microseconds: 1000 "
                "default_queue_policy { max_queue_size: 2 } }\n")


def close(a, b) -> None:
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_plan):
    root = tmp_path_factory.mktemp("groups") / "repo"
    add_model(root, "tiny", tiny_plan, BATCHING + "instance_group [{ count: 2 }]\n")
    add_model(root, "tiny_p", tiny_plan, BATCHING)  # paused by the tests that need requests to wait
    add_model(root, "tiny_q", tiny_plan, QUEUE_OF_TWO)
    with running(root, frontends=2, metrics_port=None) as server:
        yield server


class FakeFrontend:
    """A frontend process as the main process sees one: frames on the channel socket, nothing else."""

    def __init__(self, server) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.connect(server._pool._path("ipc"))
        self.received = b""
        self.answers: dict[int, tuple[dict, np.ndarray | None, float]] = {}

    def send(self, header: dict, buffers=()) -> None:
        self.sock.sendall(b"".join(bytes(memoryview(piece)) for piece in ipc.frame(header, tuple(buffers))))

    def send_group(self, requests: list) -> None:
        headers, buffers = [], []
        for header, payload in requests:
            headers.append(header)
            buffers.extend(payload)
        self.send({"k": "g", "rs": headers}, buffers)

    def _frame(self, timeout: float):
        self.sock.settimeout(timeout)
        while True:
            if len(self.received) >= ipc.PREFIX.size:
                head, size = ipc.PREFIX.unpack_from(self.received)
                total = ipc.PREFIX.size + head + size
                if len(self.received) >= total:
                    data, self.received = self.received[:total], self.received[total:]
                    return ipc.parse(data)
            chunk = self.sock.recv(1 << 16)
            if not chunk:
                raise ConnectionError("the main process closed the channel")
            self.received += chunk

    def wait(self, ids, timeout: float = 20.0) -> dict:
        """Answers by id (header, logits or None, arrival time) until all of `ids` have one."""
        end = time.monotonic() + timeout
        while not set(ids) <= set(self.answers):
            header, payload = self._frame(max(end - time.monotonic(), 0.01))
            arrived = time.monotonic()
            for entry, part in (ipc.group_members(header, payload) if header["k"] == "G" else [(header, payload)]):
                logits = ipc.outcome_of(entry, part).outputs["logits"] if entry["k"] == "r" else None
                self.answers[entry["id"]] = (entry, logits, arrived)
        return self.answers

    def silent(self, seconds: float) -> bool:
        """Nothing more arrives within `seconds`."""
        try:
            self._frame(seconds)
        except (socket.timeout, TimeoutError):
            return True
        return False

    def close(self) -> None:
        self.sock.close()


def request(request_id: int, x: np.ndarray, model: str = "tiny", timeout_us=None, regions=None, tensors=None):
    described, buffers = ipc.encode_tensors(tensors if tensors is not None else {"images": x})
    return ({"k": "i", "id": request_id, "model": model, "version": None, "inputs": described, "outputs": None,
             "regions": regions or {}, "timeout": timeout_us, "deadline": None}, buffers)


@pytest.fixture
def fake(server):
    frontend = FakeFrontend(server)
    yield frontend
    frontend.close()


@pytest.fixture
def submitted(server, monkeypatch):
    """The sizes of the groups each model's batcher took through submit_group."""
    sizes: dict[str, list] = {}
    for name in ("tiny", "tiny_p", "tiny_q"):
        batcher = server.repository.served(name).batcher
        original = batcher.submit_group

        def spy(requests, original=original, name=name):
            sizes.setdefault(name, []).append(len(requests))
            return original(requests)
        monkeypatch.setattr(batcher, "submit_group", spy)
    return sizes


def executed(server, model: str) -> float:
    return server.metrics.get("nv_inference_count", {"model": model, "version": "1"})


# ---- through the real frontends --------------------------------------------------------------------------

def test_many_concurrent_clients_through_two_frontends_match_ctx_run(server, tiny_plan, submitted):
    xs = [images(1 + k % 4, seed=200 + k) for k in range(16)]
    wants = [reference(tiny_plan, x) for x in xs]
    failures = []

    def client_thread(k: int) -> None:
        try:
            client = grpc_client(server) if k % 2 else http_client(server)
            for _ in range(4):
                got = grpc_infer(client, xs[k]) if k % 2 else http_infer(client, xs[k])
                close(got.as_numpy("logits"), wants[k])
            client.close()
        except Exception as exc:  # noqa: BLE001 (reported below)
            failures.append(exc)

    run_threads(client_thread, len(xs), timeout=60)
    assert not failures, failures[:3]
    # Every request went through the grouped path.
    assert sum(submitted["tiny"]) == 16 * 4, submitted


# ---- exact groups on the channel ---------------------------------------------------------------------------

def test_one_group_is_queued_under_one_lock_and_answered(server, fake, tiny_plan, submitted):
    xs = [images(1 + k % 3, seed=300 + k) for k in range(5)]
    fake.send_group([request(10 + k, x) for k, x in enumerate(xs)])
    answers = fake.wait(range(10, 15))
    assert submitted["tiny"] == [5]
    for k, x in enumerate(xs):
        entry, logits, _ = answers[10 + k]
        assert entry["k"] == "r" and entry["model"] == "tiny" and entry["version"] == "1"
        close(logits, reference(tiny_plan, x))


def test_a_bad_member_gets_its_own_error_and_the_others_succeed(server, fake, tiny_plan):
    good = [images(1, seed=41), images(2, seed=42)]
    odd_dtype, _ = request(23, images(1, 0))
    odd_dtype["inputs"][0]["dtype"] = "<c16"  # cannot cross the channel: rejected while decoding
    odd_dtype["inputs"][0]["bytes"] = 0
    fake.send_group([request(20, good[0]), request(21, np.zeros((1, 3, 5, 5), np.float32)),
                     request(22, images(1, 0), model="ghost"), (odd_dtype, []),
                     request(24, images(9, 0)), request(25, good[1]),
                     request(26, images(1, 0), timeout_us="soon")])
    answers = fake.wait(range(20, 27))
    close(answers[20][1], reference(tiny_plan, good[0]))
    close(answers[25][1], reference(tiny_plan, good[1]))
    errors = {i: answers[i][0] for i in (21, 22, 23, 24, 26)}
    assert all(e["k"] == "e" for e in errors.values()), errors
    assert errors[21]["error"] == "InvalidRequest" and "outside the allowed ranges" in errors[21]["message"]
    assert "ghost" in errors[22]["message"]
    assert errors[23]["error"] == "InvalidRequest" and "c16" in errors[23]["message"]
    assert errors[24]["error"] == "InvalidRequest" and "max_batch_size" in errors[24]["message"]
    assert errors[26]["error"] == "InvalidRequest" and "timeout" in errors[26]["message"]


def test_a_timed_out_member_does_not_hold_up_the_rest(server, fake, tiny_plan):
    batcher = server.repository.served("tiny_p").batcher
    batcher.pause()
    try:
        x = images(1, seed=50)
        sent = time.monotonic()
        # A timeout long against a loaded machine's delays, so that the other member's answer tells waiting
        # for it (at its timeout or after) from not (any time before half of it).
        fake.send_group([request(30, images(1, 0), model="tiny_p", timeout_us=2_000_000), request(31, x)])
        answers = fake.wait([31])
        assert 30 not in answers and answers[31][2] - sent < 1.0  # the other member did not wait for it
        close(answers[31][1], reference(tiny_plan, x))
        answers = fake.wait([30])
        assert answers[30][0]["error"] == "RequestTimeout" and answers[30][2] - sent >= 2.0
    finally:
        batcher.resume()


def test_cancelling_one_member_drops_it_and_answers_the_other(server, fake, tiny_plan):
    batcher = server.repository.served("tiny_p").batcher
    before = executed(server, "tiny_p")
    batcher.pause()
    try:
        x = images(2, seed=60)
        fake.send_group([request(40, images(3, 0), model="tiny_p"), request(41, x, model="tiny_p")])
        wait_for(lambda: batcher.pending == 2, what="2 queued members")
        fake.send({"k": "c", "id": 40})
        time.sleep(0.2)  # the cancel reaches the queue before it resumes
    finally:
        batcher.resume()
    answers = fake.wait([41])
    close(answers[41][1], reference(tiny_plan, x))
    assert fake.silent(0.5) and 40 not in fake.answers  # a member whose caller went away gets no answer
    assert executed(server, "tiny_p") - before == 2  # only the other member's rows ran


def test_a_member_cancelled_in_the_same_read_is_never_queued(server, fake, tiny_plan, submitted):
    before = executed(server, "tiny_p")
    x = images(1, seed=65)
    group, buffers = [], []
    for header, payload in (request(45, images(2, 0), model="tiny_p"), request(46, x, model="tiny_p")):
        group.append(header)
        buffers.extend(payload)
    pieces = ipc.frame({"k": "g", "rs": group}, tuple(buffers)) + ipc.frame({"k": "c", "id": 45})
    fake.sock.sendall(b"".join(bytes(memoryview(piece)) for piece in pieces))  # one write, one read
    answers = fake.wait([46])
    close(answers[46][1], reference(tiny_plan, x))
    assert fake.silent(0.3) and 45 not in fake.answers
    assert submitted["tiny_p"] == [1] and executed(server, "tiny_p") - before == 1


def test_a_full_queue_fails_only_the_members_past_it(server, fake, tiny_plan, submitted):
    batcher = server.repository.served("tiny_q").batcher
    batcher.pause()
    try:
        xs = [images(1, seed=70 + k) for k in range(3)]
        fake.send_group([request(50 + k, x, model="tiny_q") for k, x in enumerate(xs)])
        answers = fake.wait([52])
        assert answers[52][0]["error"] == "QueueFull" and "queue is full" in answers[52][0]["message"]
        assert submitted["tiny_q"] == [3]
    finally:
        batcher.resume()
    answers = fake.wait([50, 51])
    for k in (0, 1):
        close(answers[50 + k][1], reference(tiny_plan, xs[k]))


def test_single_requests_still_work(server, fake, tiny_plan):
    x = images(2, seed=80)
    fake.send(*request(60, x))
    answers = fake.wait([60])
    assert answers[60][0]["k"] == "r"
    close(answers[60][1], reference(tiny_plan, x))


def test_members_naming_one_region_share_one_lease(server, fake, tiny_plan, monkeypatch):
    shm = pytest.importorskip("tritonclient.utils.shared_memory")
    per_image = 3 * 16 * 16 * 4
    key_in, key_out = (f"/sartor_grp_{uuid.uuid4().hex[:10]}" for _ in range(2))
    inp = shm.create_shared_memory_region("in", key_in, 3 * per_image)
    out = shm.create_shared_memory_region("out", key_out, 3 * 10 * 4)
    registry = server.core.shared_memory
    leases = []
    original = registry.lease
    monkeypatch.setattr(registry, "lease", lambda: leases.append(1) or original())
    try:
        registry.register_system("grp_in", key_in, 0, 3 * per_image)
        registry.register_system("grp_out", key_out, 0, 3 * 10 * 4)
        xs = [images(1, seed=90 + k) for k in range(3)]
        for k, x in enumerate(xs):
            shm.set_shared_memory_region(inp, [x], offset=k * per_image)
        members = []
        for k in range(3):
            ref = ipc.ShmRef("grp_in", per_image, k * per_image, "input 'images'")
            tensors = {"images": ipc.ShmInput(ref, (1, 3, 16, 16), np.dtype(np.float32))}
            regions = {"logits": ["grp_out", 40, k * 40, "output 'logits'"]} if k == 1 else None
            members.append(request(70 + k, None, tensors=tensors, regions=regions))
        ghost = ipc.ShmInput(ipc.ShmRef("nope", per_image, 0, "input 'images'"), (1, 3, 16, 16), np.dtype(np.float32))
        members.append(request(73, None, tensors={"images": ghost}))
        fake.send_group(members)
        answers = fake.wait(range(70, 74))
        assert len(leases) == 1  # one lease for the whole group
        close(answers[70][1], reference(tiny_plan, xs[0]))
        close(answers[72][1], reference(tiny_plan, xs[2]))
        assert answers[71][0]["outputs"][0]["written"] == 40  # in the region, not in the reply
        close(shm.get_contents_as_numpy(out, np.float32, [1, 10], offset=40), reference(tiny_plan, xs[1]))
        assert answers[73][0]["error"] == "RegionNotFound" and "nope" in answers[73][0]["message"]
        # Every hold was given back: once unregistered, nothing keeps the regions mapped.
        regions = [registry._regions["grp_in"], registry._regions["grp_out"]]
        assert not any(r.closed for r in regions)
        registry.unregister("system")
        wait_for(lambda: all(r.closed for r in regions), timeout=5, what="the regions to be unmapped")
    finally:
        registry.unregister("system")
        shm.destroy_shared_memory_region(inp)
        shm.destroy_shared_memory_region(out)

