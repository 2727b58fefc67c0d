"""`sartor serve`: KServe v2 over HTTP and gRPC with the Triton clients, metadata, config, repository
API, model availability, bad requests, metrics and the command line. CPU engines, loopback only."""
from __future__ import annotations

import http.client
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from serve_helpers import (BATCHING, HOST, add_model, grpc_client, grpc_infer, http_client, http_infer, images,
                           reference, running, wait_for)

from sartor.runtime.engine_file import pack, unpack

grpc = pytest.importorskip("grpc")
from tritonclient.grpc import service_pb2 as pb  # noqa: E402
from tritonclient.utils import InferenceServerException  # noqa: E402


@pytest.fixture
def repo(tmp_path, tiny_plan) -> Path:
    root = tmp_path / "repo"
    add_model(root, "tiny", tiny_plan, BATCHING + "instance_group [{ count: 2 }]\n")
    return root


def alien_plan(plan: Path, dest: Path) -> Path:
    """The same engine, signed for another CPU: refused by the fingerprint check."""
    header, tensors = unpack(plan.read_bytes())
    header["fingerprint"].update(cpu="Imaginary CPU 9000", arch="imaginary64")
    dest.write_bytes(pack(header, tensors))
    return dest


def raw_http(server, method: str, path: str, body: bytes = b"", headers: dict | None = None):
    conn = http.client.HTTPConnection(HOST, server.http_port, timeout=20)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        response = conn.getresponse()
        return response.status, dict(response.getheaders()), response.read()
    finally:
        conn.close()


def error_of(status_body) -> str:
    message = json.loads(status_body)["error"]
    assert "\n" not in message
    return message


# ---- round trips ---------------------------------------------------------------------------------------

def test_http_round_trips_match_ctx_run(repo, tiny_plan):
    with running(repo) as server:
        client = http_client(server)
        assert client.is_server_live() and client.is_server_ready() and client.is_model_ready("tiny")
        assert client.is_model_ready("tiny", "1") and not client.is_model_ready("tiny", "2")
        for batch in (1, 2, 4):
            x = images(batch, seed=batch)
            want = reference(tiny_plan, x)
            for binary in (True, False):
                result = http_infer(client, x, binary=binary, request_id=f"r{batch}")
                np.testing.assert_allclose(result.as_numpy("logits"), want, rtol=1e-5, atol=1e-6)
                response = result.get_response()
                assert response["model_name"] == "tiny" and response["model_version"] == "1"
                assert response["id"] == f"r{batch}"
        # No outputs named: tritonclient asks for all of them in binary.
        import tritonclient.http as httpclient
        x = images(3, seed=7)
        tensor = httpclient.InferInput("images", list(x.shape), "FP32")
        tensor.set_data_from_numpy(x)
        result = client.infer("tiny", [tensor], model_version="1")
        np.testing.assert_allclose(result.as_numpy("logits"), reference(tiny_plan, x), rtol=1e-5, atol=1e-6)
        # Compressed request and response bodies.
        result = client.infer("tiny", [tensor], request_compression_algorithm="gzip",
                              response_compression_algorithm="deflate")
        np.testing.assert_allclose(result.as_numpy("logits"), reference(tiny_plan, x), rtol=1e-5, atol=1e-6)
        client.close()


def test_grpc_round_trips_match_ctx_run(repo, tiny_plan):
    import tritonclient.grpc as grpcclient
    with running(repo) as server:
        client = grpc_client(server)
        assert client.is_server_live() and client.is_server_ready() and client.is_model_ready("tiny")
        assert not client.is_model_ready("tiny", "7")
        for batch in (1, 2, 4):
            x = images(batch, seed=10 + batch)
            result = grpc_infer(client, x, request_id=f"g{batch}")
            np.testing.assert_allclose(result.as_numpy("logits"), reference(tiny_plan, x), rtol=1e-5, atol=1e-6)
            assert result.get_response().id == f"g{batch}"
            assert result.get_response().model_version == "1"
        # Typed contents instead of raw bytes (what non-Triton KServe clients send).
        x = images(2, seed=3)
        request = pb.ModelInferRequest(model_name="tiny")
        tensor = request.inputs.add(name="images", datatype="FP32", shape=list(x.shape))
        tensor.contents.fp32_contents.extend(x.reshape(-1).tolist())
        stub = grpcclient.service_pb2_grpc.GRPCInferenceServiceStub(grpc.insecure_channel(server.grpc_url))
        response = stub.ModelInfer(request, timeout=20)
        logits = np.frombuffer(response.raw_output_contents[0], np.float32).reshape(2, 10)
        np.testing.assert_allclose(logits, reference(tiny_plan, x), rtol=1e-5, atol=1e-6)
        # Streaming: every request is answered (in completion order, with its id); an error does not end the stream.
        results = []
        client.start_stream(callback=lambda result, error: results.append((result, error)))
        xs = [images(1, seed=s) for s in range(3)]
        for i, x in enumerate(xs):
            tensor = grpcclient.InferInput("images", list(x.shape), "FP32")
            tensor.set_data_from_numpy(x)
            client.async_stream_infer("tiny", [tensor], request_id=str(i))
        bad = grpcclient.InferInput("images", [1, 3, 5, 5], "FP32")
        bad.set_data_from_numpy(np.zeros((1, 3, 5, 5), np.float32))
        client.async_stream_infer("tiny", [bad], request_id="bad")
        wait_for(lambda: len(results) == 4, what="4 stream responses")
        client.stop_stream()
        answered = {result.get_response().id: result for result, error in results if error is None}
        for i, x in enumerate(xs):
            np.testing.assert_allclose(answered[str(i)].as_numpy("logits"), reference(tiny_plan, x), rtol=1e-5, atol=1e-6)
        (error,) = [error for result, error in results if error is not None]
        assert "outside the allowed ranges" in str(error)
        client.close()


# ---- metadata, config, repository ------------------------------------------------------------------------

def test_metadata_config_index_and_statistics(repo):
    with running(repo) as server:
        h, g = http_client(server), grpc_client(server)
        meta = h.get_server_metadata()
        assert meta["name"] == "sartor" and "binary_tensor_data" in meta["extensions"]
        assert g.get_server_metadata().name == "sartor"
        model = h.get_model_metadata("tiny")
        assert model["versions"] == ["1"]
        assert model["inputs"] == [{"name": "images", "datatype": "FP32", "shape": [-1, 3, 16, 16]}]
        assert model["outputs"] == [{"name": "logits", "datatype": "FP32", "shape": [-1, 10]}]
        gmodel = g.get_model_metadata("tiny")
        assert list(gmodel.inputs[0].shape) == [-1, 3, 16, 16] and gmodel.outputs[0].datatype == "FP32"
        config = h.get_model_config("tiny")
        assert config["max_batch_size"] == 4
        assert config["dynamic_batching"]["max_queue_delay_microseconds"] in ("5000", 5000)
        assert config["instance_group"][0]["count"] == 2 and config["instance_group"][0]["kind"] == "KIND_CPU"
        assert [i["name"] for i in config["input"]] == ["images"]
        gconfig = g.get_model_config("tiny").config
        assert gconfig.max_batch_size == 4 and list(gconfig.input[0].dims) == [3, 16, 16]
        assert h.get_model_repository_index() == [{"name": "tiny", "version": "1", "state": "READY", "reason": ""}]
        index = g.get_model_repository_index().models
        assert [(m.name, m.version, m.state) for m in index] == [("tiny", "1", "READY")]
        http_infer(h, images(2, 0))
        stats = h.get_inference_statistics("tiny")["model_stats"][0]
        assert stats["inference_count"] == 2 and stats["inference_stats"]["success"]["count"] == 1
        gstats = g.get_inference_statistics("tiny").model_stats[0]
        assert gstats.inference_stats.success.count == 1
        with pytest.raises(InferenceServerException, match="unknown model 'nope'"):
            h.get_model_metadata("nope")
        with pytest.raises(InferenceServerException, match="INVALID_ARGUMENT"):
            g.get_model_config("nope")


def test_load_and_unload_through_the_api(repo):
    with running(repo) as server:
        h, g = http_client(server), grpc_client(server)
        h.unload_model("tiny")
        assert not h.is_model_ready("tiny") and not g.is_model_ready("tiny")
        assert h.get_model_repository_index()[0]["state"] == "UNAVAILABLE"
        with pytest.raises(InferenceServerException, match="unavailable: unloaded") as info:
            http_infer(h, images(1, 0))
        assert info.value.status() == "400"
        with pytest.raises(InferenceServerException, match="UNAVAILABLE"):
            grpc_infer(g, images(1, 0))
        g.load_model("tiny")
        assert h.is_model_ready("tiny")
        http_infer(h, images(1, 0))
        g.unload_model("tiny")
        assert not g.is_model_ready("tiny")
        h.load_model("tiny")
        assert g.is_model_ready("tiny")
        with pytest.raises(InferenceServerException, match="no model 'ghost'"):
            h.load_model("ghost")


def test_fingerprint_mismatch_marks_only_that_model_unavailable(tmp_path, tiny_plan):
    root = tmp_path / "repo"
    add_model(root, "tiny", tiny_plan, BATCHING)
    add_model(root, "alien", alien_plan(tiny_plan, tmp_path / "alien.plan"))
    add_model(root, "broken_config", tiny_plan, "max_batch_size: 4\ndynamic_batching { bogus_field: 1 }\n")
    add_model(root, "too_big", tiny_plan, "max_batch_size: 16\n")
    with running(root) as server:
        h, g = http_client(server), grpc_client(server)
        assert h.is_server_ready()
        index = {row["name"]: row for row in h.get_model_repository_index()}
        assert index["tiny"]["state"] == "READY"
        assert index["alien"]["state"] == "UNAVAILABLE"
        assert "Imaginary CPU 9000" in index["alien"]["reason"] and "rebuild it here" in index["alien"]["reason"]
        assert "config.pbtxt" in index["broken_config"]["reason"] and "bogus_field" in index["broken_config"]["reason"]
        assert "max_batch_size 16 exceeds" in index["too_big"]["reason"]
        assert not h.is_model_ready("alien") and not g.is_model_ready("alien")
        with pytest.raises(InferenceServerException, match="model 'alien' is unavailable: engine was built for") as info:
            http_infer(h, images(1, 0), model="alien")
        assert info.value.status() == "400"
        with pytest.raises(InferenceServerException, match=r"StatusCode.UNAVAILABLE.*Imaginary CPU") as info:
            grpc_infer(g, images(1, 0), model="alien")
        # The others serve on.
        x = images(2, 5)
        np.testing.assert_allclose(http_infer(h, x).as_numpy("logits"), reference(tiny_plan, x), rtol=1e-5, atol=1e-6)
        assert [m.name for m in g.get_model_repository_index().models if m.state == "READY"] == ["tiny"]
        with pytest.raises(InferenceServerException, match="failed to load model 'alien' version 1"):
            h.load_model("alien")


# ---- bad requests --------------------------------------------------------------------------------------

def _infer_body(x: np.ndarray, datatype: str = "FP32", name: str = "images", shape=None, binary: bool = True,
                size_delta: int = 0) -> tuple[bytes, dict]:
    data = x.tobytes()
    tensor = {"name": name, "shape": list(shape or x.shape), "datatype": datatype}
    if binary:
        tensor["parameters"] = {"binary_data_size": len(data) + size_delta}
        header = json.dumps({"inputs": [tensor]}).encode()
        return header + data, {"Inference-Header-Content-Length": str(len(header))}
    tensor["data"] = x.reshape(-1).tolist()
    return json.dumps({"inputs": [tensor]}).encode(), {}


BAD_HTTP = [
    ("unknown model", "/v2/models/nope/infer", _infer_body(images(1, 0)), "unknown model 'nope'"),
    ("unknown version", "/v2/models/tiny/versions/9/infer", _infer_body(images(1, 0)), "has no version '9'"),
    ("wrong input name", "/v2/models/tiny/infer", _infer_body(images(1, 0), name="pixels"), "unknown input name(s) pixels"),
    ("batch over max", "/v2/models/tiny/infer", _infer_body(np.zeros((5, 3, 16, 16), np.float32)), "batch size 5 is outside 1..4"),
    ("shape outside profile", "/v2/models/tiny/infer", _infer_body(np.zeros((1, 3, 17, 17), np.float32)),
     "outside the allowed ranges"),
    ("wrong rank", "/v2/models/tiny/infer", _infer_body(np.zeros((1, 768), np.float32)), "rank 2"),
    ("dtype", "/v2/models/tiny/infer", _infer_body(np.zeros((1, 3, 16, 16), np.float64), datatype="FP64"),
     "has dtype float64; the engine expects float32"),
    ("byte size mismatch", "/v2/models/tiny/infer", _infer_body(images(1, 0), shape=[2, 3, 16, 16]),
     "3072 bytes of data for shape [2, 3, 16, 16] FP32; expected 6144 bytes"),
    ("binary size past the end", "/v2/models/tiny/infer", _infer_body(images(1, 0), size_delta=8), "runs past the end"),
    ("unclaimed binary bytes", "/v2/models/tiny/infer",
     (_infer_body(images(1, 0))[0] + bytes(8), _infer_body(images(1, 0))[1]), "8 bytes of binary data"),
    ("binary size short", "/v2/models/tiny/infer", _infer_body(images(1, 0), size_delta=-8), "3064 bytes of data"),
    ("json count mismatch", "/v2/models/tiny/infer", _infer_body(images(1, 0), shape=[1, 3, 16, 15], binary=False),
     "768 data elements for shape [1, 3, 16, 15]"),
    ("unknown datatype", "/v2/models/tiny/infer", _infer_body(images(1, 0), datatype="FLOAT"), "not a KServe v2 datatype"),
    ("malformed json", "/v2/models/tiny/infer", (b'{"inputs": [', {}), "malformed JSON request"),
    ("not an object", "/v2/models/tiny/infer", (b'[1, 2]', {}), "the request must be a JSON object"),
    ("no inputs", "/v2/models/tiny/infer", (b'{"inputs": []}', {}), "non-empty array"),
    ("header length not a number", "/v2/models/tiny/infer", (b'{}', {"Inference-Header-Content-Length": "x"}),
     "is not an integer"),
    ("header length too long", "/v2/models/tiny/infer", (b'{}', {"Inference-Header-Content-Length": "99"}),
     "outside 1..2"),
    ("unknown output", "/v2/models/tiny/infer",
     (json.dumps({"inputs": [{"name": "images", "shape": [1, 3, 16, 16], "datatype": "FP32",
                              "data": [0.0] * 768}], "outputs": [{"name": "probs"}]}).encode(), {}),
     "unknown output(s) 'probs'"),
    ("oversized body", "/v2/models/tiny/infer", (b"{" + b" " * 70000 + b"}", {}), "exceeds the limit of 65536 bytes"),
    ("bad gzip", "/v2/models/tiny/infer", (b"not gzip", {"Content-Encoding": "gzip"}), "Can not decode content-encoding: gzip"),
]


def test_bad_http_requests_get_400_with_one_line(repo):
    with running(repo, max_request_bytes=65536) as server:
        for label, path, (body, headers), fragment in BAD_HTTP:
            status, _, payload = raw_http(server, "POST", path, body, headers)
            assert status == 400, (label, status, payload)
            message = error_of(payload)
            assert fragment in message, (label, message)
        status, _, payload = raw_http(server, "GET", "/v2/models/tiny/versions/1/ready")
        assert status == 200
        status, _, payload = raw_http(server, "POST", "/v2/repository/index", b"{nope")
        assert status == 400 and "malformed JSON" in error_of(payload)
        status, _, payload = raw_http(server, "GET", "/v2/no/such/route")
        assert status == 404 and error_of(payload)
        # Still serving.
        x = images(2, 1)
        body, headers = _infer_body(x)
        status, headers, payload = raw_http(server, "POST", "/v2/models/tiny/infer", body, headers)
        assert status == 200 and headers["Content-Type"] == "application/json"
        assert len(json.loads(payload)["outputs"][0]["data"]) == 20


def test_bad_grpc_requests_get_invalid_argument(repo):
    import tritonclient.grpc as grpcclient
    with running(repo, max_request_bytes=65536) as server:
        stub = grpcclient.service_pb2_grpc.GRPCInferenceServiceStub(grpc.insecure_channel(server.grpc_url))

        def request(model="tiny", version="", name="images", datatype="FP32", shape=(1, 3, 16, 16), raw=None):
            r = pb.ModelInferRequest(model_name=model, model_version=version)
            r.inputs.add(name=name, datatype=datatype, shape=list(shape))
            count = int(np.prod(shape)) * 4
            r.raw_input_contents.append(np.zeros(count, np.uint8).tobytes() if raw is None else raw)
            return r

        cases = [
            (request(model="nope"), "unknown model 'nope'"),
            (request(version="3"), "has no version '3'"),
            (request(name="pixels"), "unknown input name(s) pixels"),
            (request(shape=(1, 3, 17, 17)), "outside the allowed ranges"),
            (request(shape=(1, 3, 16, 16), raw=b"\0" * 100), "100 bytes of data"),
            (request(datatype="INT32"), "has dtype int32; the engine expects float32"),
            (request(shape=(1, -3, 16, 16), raw=b""), "must hold non-negative integers"),
            (pb.ModelInferRequest(model_name="tiny"), "the request has no inputs"),
        ]
        for message, fragment in cases:
            with pytest.raises(grpc.RpcError) as info:
                stub.ModelInfer(message, timeout=20)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (fragment, info.value)
            assert fragment in info.value.details(), (fragment, info.value.details())
        raw_call = grpc.insecure_channel(server.grpc_url).unary_unary("/inference.GRPCInferenceService/ModelInfer")
        with pytest.raises(grpc.RpcError) as info:
            raw_call(b"\xff\xff\xff\xff\x0f\x01", timeout=20)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "malformed ModelInferRequest" in info.value.details()
        with pytest.raises(grpc.RpcError) as info:
            stub.TraceSetting(pb.TraceSettingRequest(), timeout=20)
        assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED
        # Still serving.
        x = images(1, 2)
        r = request(raw=x.tobytes())
        out = np.frombuffer(stub.ModelInfer(r, timeout=20).raw_output_contents[0], np.float32)
        assert out.shape == (10,)


# ---- metrics ---------------------------------------------------------------------------------------------

def _metric(text: str, name: str, **labels) -> float:
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            found = dict(re.findall(r'(\w+)="([^"]*)"', line.split("}")[0]))
            if all(found.get(k) == str(v) for k, v in labels.items()):
                return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} {labels} not in the metrics")


def test_prometheus_metrics(repo, tiny_engine):
    with running(repo) as server:
        client = http_client(server)
        for i in range(3):
            http_infer(client, images(2, i))
        with pytest.raises(InferenceServerException):
            http_infer(client, np.zeros((1, 3, 8, 8), np.float32))
        with urllib.request.urlopen(f"http://{HOST}:{server.metrics_port}/metrics", timeout=20) as response:
            assert response.headers["Content-Type"].startswith("text/plain; version=0.0.4")
            text = response.read().decode()
    labels = {"model": "tiny", "version": "1"}
    assert _metric(text, "nv_inference_request_success", **labels) == 3
    assert _metric(text, "nv_inference_request_failure", reason="OTHER", **labels) == 1
    assert _metric(text, "nv_inference_count", **labels) == 6
    assert _metric(text, "nv_inference_exec_count", **labels) == 3
    assert _metric(text, "nv_inference_batch_size_bucket", le="2", **labels) == 3
    assert _metric(text, "nv_inference_batch_size_sum", **labels) == 6
    assert _metric(text, "nv_inference_queue_duration_us", **labels) > 0
    assert _metric(text, "nv_inference_compute_infer_duration_us", **labels) > 0
    assert _metric(text, "nv_inference_queue_histogram_ms_count", **labels) == 3
    assert _metric(text, "nv_model_device_memory_bytes", device="cpu", **labels) == tiny_engine.device_memory_bytes
    assert "# TYPE nv_inference_request_success counter" in text


# ---- the command line ------------------------------------------------------------------------------------

def test_cli_dry_run(cli, tmp_path, tiny_plan):
    root = tmp_path / "repo"
    add_model(root, "tiny", tiny_plan, BATCHING)
    result = cli("serve", "--model-repository", root, "--dry-run")
    assert result.code == 0, result
    assert "tiny" in result.out and "READY" in result.out
    add_model(root, "alien", alien_plan(tiny_plan, tmp_path / "alien.plan"))
    result = cli("serve", "--model-repository", root, "--dry-run")
    assert result.code == 1 and "UNAVAILABLE" in result.out, result
    result = cli("serve", "--model-repository", tmp_path / "missing", "--dry-run")
    assert result.code == 2 and "is not a directory" in result.err
    result = cli("serve", "--model-repository", root, "--device", "tpu")
    assert result.code == 2 and "unknown device 'tpu'" in result.err


def test_cli_serves_until_sigint(tmp_path, tiny_plan):
    root = tmp_path / "repo"
    add_model(root, "tiny", tiny_plan, BATCHING)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    process = subprocess.Popen([sys.executable, "-m", "sartor", "serve", "--model-repository", str(root),
                                "--http-port", "0", "--grpc-port", "0", "--metrics-port", "-1", "--poll-interval", "0"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        deadline = time.monotonic() + 60
        line = ""
        while time.monotonic() < deadline and "serving on" not in line:
            line = process.stdout.readline()
            if not line and process.poll() is not None:
                break
        match = re.search(r"HTTP 127\.0\.0\.1:(\d+), gRPC 127\.0\.0\.1:(\d+)", line)
        assert match, (line, process.poll())
        with urllib.request.urlopen(f"http://{HOST}:{match.group(1)}/v2/health/ready", timeout=20) as response:
            assert response.status == 200
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=30) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(10)
        process.stdout.close()
        process.stderr.close()


# ---- config.pbtxt ------------------------------------------------------------------------------------------

CONFIG_ERRORS = [
    ("max_batch_size: 4\ndynamic_batching { preferred_batch_size: [8] }", "preferred_batch_size [8] must be in 1..max_batch_size (4)"),
    ("instance_group [{ count: 1, gpus: [0] }]", "names gpus [0] but the engine is built for the CPU"),
    ("instance_group [{ count: 500 }]", "count 500 must be in 1..64"),
    ('name: "other"', "differs from the model directory name 'tiny'"),
    ('input [{ name: "pixels" data_type: TYPE_FP32 dims: [3, 16, 16] }]', "input 'pixels' is not one of the engine's"),
    ('output [{ name: "logits" data_type: TYPE_INT64 dims: [10] }]', "is TYPE_INT64 in the config but the engine has"),
    ("max_batch_size: -2", "max_batch_size -2 must be >= 0"),
    ("max_batch_size: 4 max_batch_size {", "config.pbtxt"),
]


@pytest.mark.parametrize("text, fragment", CONFIG_ERRORS, ids=[c[1][:30] for c in CONFIG_ERRORS])
def test_config_errors_name_the_problem(tmp_path, tiny_engine, text, fragment):
    from sartor.errors import ConfigError
    from sartor.serve.config import complete_config, read_config
    (tmp_path / "config.pbtxt").write_text(text)
    with pytest.raises(ConfigError) as info:
        config, has_max_batch = read_config(tmp_path)
        complete_config(config, has_max_batch, "tiny", tiny_engine, None, "tiny/config.pbtxt")
    assert fragment in str(info.value) and "\n" not in str(info.value)


def test_config_auto_completes_from_the_engine(tmp_path, tiny_engine):
    from sartor.serve.config import complete_config, read_config
    config, has_max_batch = read_config(tmp_path)  # no file
    config, settings = complete_config(config, has_max_batch, "tiny", tiny_engine, None, "tiny")
    assert config.max_batch_size == 4 and settings.dynamic_batching and settings.max_queue_delay_s == 0
    assert settings.instances == [("cpu", 1)] and config.platform == "sartor_plan"
    (tmp_path / "config.pbtxt").write_text("max_batch_size: 0\n")
    config, has_max_batch = read_config(tmp_path)
    config, settings = complete_config(config, has_max_batch, "tiny", tiny_engine, None, "tiny")
    assert settings.max_batch_size == 0 and not settings.dynamic_batching
    assert list(config.input[0].dims) == [-1, 3, 16, 16]  # the batch dim stays in the shape


def test_instances_spread_over_the_server_devices():
    from tritonclient.grpc import model_config_pb2 as mc

    from sartor.errors import ConfigError
    from sartor.serve.config import _instances

    def config(text: str):
        from google.protobuf import text_format
        return text_format.Parse(text, mc.ModelConfig())

    gpus = ["cuda:0", "cuda:1"]
    assert _instances(config(""), gpus, "cuda", "w") == [("cuda:0", 1), ("cuda:1", 1)]
    assert _instances(config("instance_group [{ count: 2 }]"), gpus, "cuda", "w") == [("cuda:0", 2), ("cuda:1", 2)]
    assert _instances(config("instance_group [{ count: 3, gpus: [1] }]"), gpus, "cuda", "w") == [("cuda:1", 3)]
    assert _instances(config("instance_group [{ count: 1, gpus: [0] }, { count: 2, gpus: [0, 1] }]"), gpus, "cuda",
                      "w") == [("cuda:0", 3), ("cuda:1", 2)]
    assert _instances(config("instance_group [{ kind: KIND_CPU }]"), gpus, "cuda", "w") == [("cpu", 1)]
    assert _instances(config(""), None, "cuda", "w") == [("cuda:0", 1)]
    with pytest.raises(ConfigError, match=r"gpus \[2\] are not among the server's devices"):
        _instances(config("instance_group [{ gpus: [2] }]"), gpus, "cuda", "w")


def test_device_list_is_checked_before_anything_starts(cli, tmp_path, tiny_plan):
    import torch

    from sartor.errors import SartorError
    from sartor.serve import ServeOptions, Server

    absent = f"cuda:{torch.cuda.device_count()}"  # one past the last GPU (cuda:0 without any)
    cases = [([absent], "requested but"), (["tpu"], "unknown device 'tpu'"),
             (["cpu", "cpu"], "names cpu more than once"), (["cpu", "cuda:0"], "mixes the CPU and GPUs")]
    for devices, fragment in cases:
        with pytest.raises(SartorError, match=re.escape(fragment)) as caught:
            Server(ServeOptions(str(tmp_path), devices=devices))
        assert "\n" not in str(caught.value)
    root = tmp_path / "repo"
    add_model(root, "tiny", tiny_plan)
    result = cli("serve", "--model-repository", root, "--device", f"cuda:0,{absent}", "--dry-run")
    assert result.code == 2 and "requested but" in result.err and result.err.count("\n") == 1, result


def test_several_gpus_with_several_instances_each(tmp_path, tiny_plan, monkeypatch):
    """--device cuda:0,cuda:1 and instance_group { count, gpus }: one engine per GPU that holds
    instances, the contexts spread as configured, each with its own worker. No GPU here: each "GPU"
    is the CPU engine under a GPU's name, which walks the same code path short of the kernels."""
    import torch

    import sartor.serve.config as config_module
    import sartor.serve.repository as repository_module

    real_load = repository_module.load_engine
    loads = []

    class OnNamedGpu:
        def __init__(self, engine, device: str) -> None:
            self._engine, self.device = engine, torch.device(device)

        def __getattr__(self, name):
            return getattr(self._engine, name)

    def load_as(plan, device=None, **options):
        loads.append((Path(plan).parent.parent.name, device))
        return OnNamedGpu(real_load(plan, device="cpu", **options), device)

    monkeypatch.setattr(config_module, "parse_device", lambda spec: torch.device(spec if ":" in spec else spec + ":0"))
    monkeypatch.setattr(repository_module, "load_engine", load_as)
    root = tmp_path / "repo"
    add_model(root, "spread", tiny_plan, BATCHING + "instance_group [{ count: 2 }, { count: 1, gpus: [1] }]\n")
    add_model(root, "second_gpu", tiny_plan, BATCHING + "instance_group [{ count: 2, gpus: [1] }]\n")
    with running(root, devices=["cuda:0", "cuda:1"]) as server:
        workers = sorted(t.name.rsplit("-", 1)[0] for t in threading.enumerate()
                         if t.name.startswith("sartor-serve-spread") or t.name.startswith("sartor-serve-second"))
        client = http_client(server)
        for model in ("spread", "second_gpu"):
            x = images(3, seed=5)
            np.testing.assert_allclose(http_infer(client, x, model=model).as_numpy("logits"),
                                       reference(tiny_plan, x), rtol=1e-5, atol=1e-6)
        groups = {m: [(g["kind"], g["count"], g["gpus"]) for g in client.get_model_config(m)["instance_group"]]
                  for m in ("spread", "second_gpu")}
        engines = {m: sorted(server.repository.served(m).engines) for m in ("spread", "second_gpu")}
        with urllib.request.urlopen(f"http://{HOST}:{server.metrics_port}/metrics", timeout=20) as response:
            metrics = response.read().decode()
    assert sorted(loads) == [("second_gpu", "cuda:0"), ("second_gpu", "cuda:1"), ("spread", "cuda:0"),
                             ("spread", "cuda:1")]
    assert groups == {"spread": [("KIND_GPU", 2, [0]), ("KIND_GPU", 3, [1])],
                      "second_gpu": [("KIND_GPU", 2, [1])]}
    # The engine loaded first on cuda:0 holds no instance of second_gpu, so it is not kept.
    assert engines == {"spread": ["cuda:0", "cuda:1"], "second_gpu": ["cuda:1"]}
    assert workers == ["sartor-serve-second_gpu-v1-cuda:1"] * 2 + ["sartor-serve-spread-v1-cuda:0"] * 2 + \
        ["sartor-serve-spread-v1-cuda:1"] * 3
    memory = re.findall(r'nv_model_device_memory_bytes\{device="([^"]+)",model="([^"]+)"', metrics)
    assert sorted(memory) == [("cuda:0", "spread"), ("cuda:1", "second_gpu"), ("cuda:1", "spread")]
