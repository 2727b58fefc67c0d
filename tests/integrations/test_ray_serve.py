"""`sartor_app` on a local Ray Serve (CPU) over real HTTP: concurrent v2 tensor requests of two
models, batched and multiplexed on one replica (one model held at a time, so that they are also
unloaded and reloaded), answer what the engine answers; the image route answers what the
Pipeline gives; bad requests get one-line errors with 400/404; a model over the memory budget 507."""
from __future__ import annotations

import io
import json
import socket
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from conftest import IMAGE, MAX_SHAPES, MIN_SHAPES, OPT_SHAPES, classifier_model, save
from PIL import Image

import sartor
from sartor.pipeline import Pipeline
from sartor.serve.memory_budget import needs

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")
skimage_data = pytest.importorskip("skimage.data")
from sartor.integrations.ray_serve import sartor_app  # (needs ray)

SPEC = f"letterbox={IMAGE},mean=0,std=255,rgb,nchw"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def repository(tmp_path_factory):
    """Two models in Triton's layout: `first` (version 1) and `second` (versions 1 and 3: 3 served)."""
    root = tmp_path_factory.mktemp("ray_repository")
    for name, seed, version in (("first", 0, 1), ("second", 1, 1), ("second", 1, 3)):
        onnx_path = save(classifier_model(seed), root / f"{name}.onnx")
        (root / name / str(version)).mkdir(parents=True, exist_ok=True)
        sartor.build(onnx_path, root / name / str(version) / "model.plan", device="cpu", min_shapes=MIN_SHAPES,
                     opt_shapes=OPT_SHAPES, max_shapes=MAX_SHAPES, preprocess=SPEC)
    return root


@pytest.fixture(scope="module")
def served(repository):
    port = free_port()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(sartor_app(str(repository), num_gpus=0, num_cpus=0.25, max_models_per_replica=1, max_batch_size=4,
                         batch_wait_timeout_s=0.2), name="models", route_prefix="/")
    serve.run(sartor_app({"first": str(repository / "first" / "1" / "model.plan")}, num_gpus=0, num_cpus=0.25,
                         memory_budget="1K"), name="tight", route_prefix="/tight")
    # Room for one model and a half: held one at a time they all load; two at once, the second is refused.
    room = str(int(1.5 * needs(sartor.load(repository / "first" / "1" / "model.plan", device="cpu"),
                               [("cpu", 1)])["cpu"][0]))
    for held in (1, 2):  # the second through Serve's autoscaling settings (one replica here)
        scaling = {"autoscaling_config": {"min_replicas": 1, "max_replicas": 1, "target_ongoing_requests": 32}}
        serve.run(sartor_app(str(repository), num_gpus=0, num_cpus=0.25, max_models_per_replica=held,
                             memory_budget=room, **(scaling if held == 2 else {})),
                  name=f"held{held}", route_prefix=f"/held{held}")
    yield f"http://127.0.0.1:{port}"
    serve.shutdown()
    ray.shutdown()


def call(url: str, body: bytes | None = None, headers: dict | None = None) -> tuple[int, bytes]:
    request = urllib.request.Request(url, data=body, headers=headers or {}, method="POST" if body is not None else "GET")
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def tensor_request(images: np.ndarray) -> bytes:
    return json.dumps({"inputs": [{"name": "images", "datatype": "FP32", "shape": list(images.shape),
                                   "data": images.reshape(-1).tolist()}]}).encode()


def expected(repository, name: str, version: int, images: np.ndarray) -> np.ndarray:
    engine = sartor.load(repository / name / str(version) / "model.plan", device="cpu")
    return np.asarray(engine.context().run({"images": images})["logits"])


def test_concurrent_requests_of_two_models_answer_what_the_engines_answer(served, repository):
    rng = np.random.default_rng(7)
    jobs = [("first" if i % 3 else "second", rng.random((1 + i % 2, 3, IMAGE, IMAGE), dtype=np.float32))
            for i in range(12)]
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda job: call(f"{served}/v2/models/{job[0]}/infer", tensor_request(job[1])), jobs))
    for (name, images), (status, body) in zip(jobs, answers):
        assert status == 200, body
        reply = json.loads(body)
        assert reply["model_name"] == name and reply["model_version"] == ("3" if name == "second" else "1")
        (logits,) = reply["outputs"]
        assert logits["shape"] == [len(images), 10]
        np.testing.assert_allclose(np.asarray(logits["data"]).reshape(logits["shape"]),
                                   expected(repository, name, 3 if name == "second" else 1, images),
                                   rtol=1e-5, atol=1e-5)


def test_the_image_route_answers_what_the_pipeline_gives(served, repository):
    buffer = io.BytesIO()
    Image.fromarray(skimage_data.astronaut()).save(buffer, "JPEG", quality=90)
    status, body = call(f"{served}/v2/models/first/infer_image", buffer.getvalue(), {"Content-Type": "image/jpeg"})
    assert status == 200, body
    reply = json.loads(body)
    assert reply["image"] == {"width": 512, "height": 512}
    engine = sartor.load(repository / "first" / "1" / "model.plan", device="cpu")
    (want,) = Pipeline(engine, fast_decode=False).run([buffer.getvalue()])
    np.testing.assert_allclose(reply["outputs"][0]["data"], want.outputs["logits"], rtol=1e-5, atol=1e-5)


def test_health_and_metadata(served):
    assert call(f"{served}/v2/health/live")[0] == 200 and call(f"{served}/v2/health/ready")[0] == 200
    status, body = call(f"{served}/v2/models/second")
    assert status == 200
    meta = json.loads(body)
    assert meta["versions"] == ["3"] and meta["inputs"][0]["name"] == "images"


@pytest.mark.parametrize("path,body,status,fragment", [
    ("/v2/models/absent/infer", b"{}", 404, "unknown model 'absent'"),
    ("/v2/models/first/infer", b"{not json", 400, "malformed JSON request"),
    ("/v2/models/first/infer", json.dumps({"inputs": [{"name": "pixels", "datatype": "FP32", "shape": [1],
                                                        "data": [0.0]}]}).encode(), 400,
     "takes inputs images; unknown: pixels; missing: images"),
    ("/v2/models/first/infer", tensor_request(np.zeros((1, 3, 8, 8), np.float32)), 400, "model 'first'"),
    ("/v2/models/first/infer", tensor_request(np.zeros((9, 3, IMAGE, IMAGE), np.float32)), 400, "model 'first'"),
    ("/v2/models/first/versions/2/infer", tensor_request(np.zeros((1, 3, IMAGE, IMAGE), np.float32)), 404,
     "has no version 2"),
    ("/v2/models/first/infer_image", b"", 400, "the request body is empty"),
    ("/v2/models/first/infer_image", b"not an image", 400, "the body is not an image"),
    ("/v2/models/first/infer_image?conf=high", b"x", 400, "query parameter conf='high' must be a float"),
    ("/v1/models/first:predict", b"{}", 404, "no route POST /v1/models/first:predict"),
], ids=["unknown-model", "bad-json", "wrong-input", "wrong-size", "over-max-batch", "wrong-version", "empty-image",
        "not-image", "bad-query", "unknown-route"])
def test_bad_requests_are_refused_in_one_line(served, path, body, status, fragment):
    got, reply = call(served + path, body)
    assert got == status, reply
    error = json.loads(reply)["error"]
    assert fragment in error and "\n" not in error


def test_a_model_over_the_memory_budget_is_refused_with_507(served):
    status, reply = call(f"{served}/tight/v2/models/first/infer", tensor_request(np.zeros((1, 3, IMAGE, IMAGE),
                                                                                         np.float32)))
    assert status == 507
    error = json.loads(reply)["error"]
    assert "model 'first' version 1 needs" in error and "--memory-budget 1.0 KiB" in error


def test_the_budget_is_given_back_when_serve_unloads_a_model(served):
    request = tensor_request(np.zeros((1, 3, IMAGE, IMAGE), np.float32))
    # One model held at a time: each load finds the budget the unloaded one gave back.
    assert [call(f"{served}/held1/v2/models/{name}/infer", request)[0]
            for name in ("first", "second", "first")] == [200, 200, 200]
    # Two held at once: the second does not fit beside the first.
    assert call(f"{served}/held2/v2/models/first/infer", request)[0] == 200
    status, reply = call(f"{served}/held2/v2/models/second/infer", request)
    assert status == 507 and "has" in json.loads(reply)["error"] and "held: first" in json.loads(reply)["error"]


def test_a_replica_warms_every_batch_size_it_forms_and_pads_up_to_them(repository):
    """A shape's first run captures a CUDA graph (about a second on a GPU): a replica runs each batch
    size `@serve.batch` can form before it answers, and pads a batch up to a warmed size."""
    from sartor.integrations.ray_serve import SartorServer, ServedEngine, stacked
    engine = sartor.load(repository / "first" / "1" / "model.plan", device="cpu")
    model = ServedEngine("first", "1", engine, on_unload=lambda m: None, max_batch_size=3)
    assert model.warm_sizes == [1, 2, 3]
    ran = {dict(key)["images"][0] for key in model.context._memos}
    assert {1, 2, 3} <= ran and MAX_SHAPES["images"][0] in ran  # and the profile's min, opt and max

    rng = np.random.default_rng(5)
    parts = [{"images": rng.random((1, 3, IMAGE, IMAGE), dtype=np.float32)} for _ in range(2)]
    padded = stacked(parts, 4)["images"]
    assert padded.shape[0] == 4 and not padded[2:].any()
    np.testing.assert_array_equal(padded[:2], np.concatenate([p["images"] for p in parts]))

    model.warm_sizes = [4]  # two rows run as a batch of four; each request gets its own row back
    results = [None, None]
    SartorServer._run_group(model, parts, [0, 1], results)
    for part, result in zip(parts, results):
        assert result["logits"].shape[0] == 1
        np.testing.assert_allclose(result["logits"], engine.context().run(part)["logits"], rtol=1e-5, atol=1e-6)
