"""Shared by the `sartor serve` tests: engines, model repositories and running servers (loopback only,
ports chosen by the OS, every server stopped at the end of its test)."""
from __future__ import annotations

import contextlib
import os
import shutil
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from conftest import IMAGE, MAX_SHAPES, MIN_SHAPES, OPT_SHAPES, classifier_model, make_model, save

pytest.importorskip("aiohttp")
pytest.importorskip("tritonclient.grpc")
try:  # tritonclient raises RuntimeError, not ImportError, when installed without its http extra (gevent)
    import tritonclient.http  # noqa: F401
except (ImportError, RuntimeError) as exc:
    pytest.skip(f"tritonclient.http: {exc}", allow_module_level=True)

BATCHING = """max_batch_size: 4
dynamic_batching { max_queue_delay_microseconds: 5000 }
"""
HOST = "127.0.0.1"


def build_plan(model, directory: Path, name: str, **kwargs) -> Path:
    import sartor
    onnx_path = save(model, directory / f"{name}.onnx")
    out = directory / f"{name}.plan"
    options = dict(min_shapes=MIN_SHAPES, opt_shapes=OPT_SHAPES, max_shapes=MAX_SHAPES)
    options.update(kwargs)
    sartor.build(onnx_path, out, device="cpu", **options)
    return out


@pytest.fixture(scope="session")
def plan_v2(tmp_path_factory) -> Path:
    """The tiny classifier with other weights (seed 1): a second version whose outputs differ."""
    return build_plan(classifier_model(seed=1), tmp_path_factory.mktemp("serve_v2"), "tiny_v2")


def add_model(repo: Path, name: str, plan: Path, config: str | None = None, version: int = 1) -> Path:
    model_dir = repo / name
    (model_dir / str(version)).mkdir(parents=True, exist_ok=True)
    shutil.copyfile(plan, model_dir / str(version) / "model.plan")
    if config is not None:
        (model_dir / "config.pbtxt").write_text(config)
    return model_dir


def publish_version(repo: Path, name: str, plan: Path, version: int) -> None:
    """Write a version directory elsewhere and rename it in (what a deploy script should do)."""
    staging = repo / f".staging-{name}-{version}"
    staging.mkdir()
    shutil.copyfile(plan, staging / "model.plan")
    os.rename(staging, repo / name / str(version))


@contextlib.contextmanager
def running(repo: Path, **options):
    from sartor.serve import ServeOptions, Server
    settings = dict(host=HOST, http_port=0, grpc_port=0, metrics_port=0, poll_interval=None)
    settings.update(options)
    server = Server(ServeOptions(str(repo), **settings)).start()
    try:
        yield server
    finally:
        server.stop(grace=2.0)
    # Every thread the server started has ended (workers, poller, event loop, retirements).
    wait_for(lambda: not [t for t in threading.enumerate() if t.name.startswith("sartor-serve")], timeout=20,
             what="the server's threads to end")


def run_threads(target, count: int, timeout: float) -> None:
    """target(k) for k in range(count), each in its own thread; all must finish within `timeout` each."""
    threads = [threading.Thread(target=target, args=(k,)) for k in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    assert not any(t.is_alive() for t in threads)


def http_client(server, **kwargs):
    import tritonclient.http as httpclient
    return httpclient.InferenceServerClient(server.http_url, connection_timeout=10.0, network_timeout=30.0, **kwargs)


def grpc_client(server):
    import tritonclient.grpc as grpcclient
    return grpcclient.InferenceServerClient(server.grpc_url)


def http_infer(client, x: np.ndarray, model: str = "tiny", binary: bool = True, **kwargs):
    import tritonclient.http as httpclient
    tensor = httpclient.InferInput("images", list(x.shape), "FP32")
    tensor.set_data_from_numpy(x, binary_data=binary)
    outputs = [httpclient.InferRequestedOutput("logits", binary_data=binary)]
    return client.infer(model, [tensor], outputs=outputs, **kwargs)


def grpc_infer(client, x: np.ndarray, model: str = "tiny", **kwargs):
    import tritonclient.grpc as grpcclient
    tensor = grpcclient.InferInput("images", list(x.shape), "FP32")
    tensor.set_data_from_numpy(x)
    return client.infer(model, [tensor], **kwargs)


def images(batch: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((batch, 3, IMAGE, IMAGE)).astype(np.float32)


def reference(plan: Path, x: np.ndarray) -> np.ndarray:
    import sartor
    return sartor.load(plan, device="cpu").context().run({"images": x})["logits"]


def wait_for(predicate, timeout: float = 20.0, interval: float = 0.02, what: str = "condition"):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def fill_queue_and_expect_refusal(server, batcher, model: str = "tiny") -> tuple[list, list]:
    """With `batcher` paused, queue 2 requests from client threads (the queue's size in the tests'
    configs), then check that one more is refused at once: HTTP 503 and gRPC UNAVAILABLE, both
    "queue is full". Returns (the threads, their results); the caller resumes and joins."""
    from tritonclient.utils import InferenceServerException
    results: list = []

    def queued(k: int) -> None:
        client = http_client(server)
        results.append(http_infer(client, images(1, k), model=model).as_numpy("logits"))
        client.close()

    threads = [threading.Thread(target=queued, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    wait_for(lambda: batcher.pending == 2, what="2 queued requests")
    h, g = http_client(server), grpc_client(server)
    start = time.monotonic()
    with pytest.raises(InferenceServerException, match="queue is full") as info:
        http_infer(h, images(1, 5), model=model)
    assert info.value.status() == "503"
    with pytest.raises(InferenceServerException, match="StatusCode.UNAVAILABLE.*queue is full"):
        grpc_infer(g, images(1, 5), model=model)
    assert time.monotonic() - start < 5.0  # refused at once, not after a wait
    return threads, results


def detector_model(classes: int = 2, anchors: int = 8) -> tuple:
    """A YOLO-like head [B, 4+C, N] whose values do not depend on the image: anchor 0 is a box
    cx=8, cy=8, w=4, h=4 (network-input pixels) of class 1 with score 0.9; every other score is 0."""
    head = np.zeros((1, 4 + classes, anchors), np.float32)
    head[0, :4, :] = [[8.0], [8.0], [4.0], [4.0]]
    head[0, 4 + 1, 0] = 0.9
    nodes = [
        helper.make_node("ReduceMean", ["images"], ["m"], name="mean", axes=[1, 2, 3], keepdims=1),
        helper.make_node("Mul", ["m", "zero"], ["z"], name="zero_it"),
        helper.make_node("Reshape", ["z", "shape"], ["r"], name="reshape"),
        helper.make_node("Add", ["r", "head"], ["output0"], name="add_head"),
    ]
    inits = [numpy_helper.from_array(np.zeros(1, np.float32), "zero"),
             numpy_helper.from_array(np.array([-1, 1, 1], np.int64), "shape"),
             numpy_helper.from_array(head, "head")]
    inputs = [helper.make_tensor_value_info("images", TensorProto.FLOAT, ["batch", 3, IMAGE, IMAGE])]
    outputs = [helper.make_tensor_value_info("output0", TensorProto.FLOAT, ["batch", 4 + classes, anchors])]
    return make_model(nodes, inputs, outputs, inits, name="tiny_detector"), head
