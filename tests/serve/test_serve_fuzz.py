"""Malformed-request fuzzing of `sartor serve`: a fixed seed and a fixed count of random mutations of
valid HTTP bodies and headers and of valid gRPC messages. The server must answer each one with a
client error (or a result, when the mutation left the request valid), never an internal error or a
dropped connection, and it must still answer a valid request correctly afterwards."""
from __future__ import annotations

import copy
import http.client
import json
import random

import numpy as np
import pytest
from serve_helpers import BATCHING, HOST, add_model, grpc_client, grpc_infer, http_client, http_infer, images, reference, running

grpc = pytest.importorskip("grpc")
from tritonclient.grpc import service_pb2 as pb  # noqa: E402

SEED = 20240601
COUNT = 300
STRANGE = [None, True, False, 0, -1, 1, 3, 17, 2**31, 2**70, -2**70, 1e308, -0.5, float("nan"), "", "x", "FP32",
           "FP64", "INT8", "BYTES", "images", "logits", [], {}, [1], [[1, 2], [3]], [1, 3, 16, 16], [-1, 3, 16, 16],
           [2**40, 2**40], {"binary_data_size": 7}, {"binary_data": True}, {"timeout": 1}, "\u0000\ud7ff"]


def _valid_http_bodies() -> list[tuple[bytes, dict]]:
    x = images(1, 0)
    json_body = {"id": "a", "inputs": [{"name": "images", "shape": [1, 3, 16, 16], "datatype": "FP32",
                                        "data": x.reshape(-1).tolist()}],
                 "outputs": [{"name": "logits", "parameters": {"binary_data": False}}]}
    binary_header = {"inputs": [{"name": "images", "shape": [2, 3, 16, 16], "datatype": "FP32",
                                 "parameters": {"binary_data_size": 6144}}],
                     "parameters": {"binary_data_output": True, "timeout": 10_000_000}}
    header = json.dumps(binary_header).encode()
    return [(json.dumps(json_body).encode(), {}),
            (header + images(2, 1).tobytes(), {"Inference-Header-Content-Length": str(len(header))})]


def _mutate_json(rng: random.Random, header: bytes) -> bytes:
    try:
        doc = json.loads(header)
    except ValueError:
        return header
    # Collect the containers and keys, then replace or delete one.
    slots = []

    def walk(node):
        if isinstance(node, dict):
            for key in list(node):
                slots.append((node, key))
                walk(node[key])
        elif isinstance(node, list) and len(node) < 50:
            for index in range(len(node)):
                slots.append((node, index))
                walk(node[index])
    walk(doc)
    if not slots:
        return header
    container, key = rng.choice(slots)
    action = rng.random()
    if action < 0.2 and isinstance(container, dict):
        del container[key]
    elif action < 0.3 and isinstance(container, dict):
        container[rng.choice(["extra", "parameters", "data", "shape", "outputs"])] = copy.deepcopy(rng.choice(STRANGE))
    else:
        container[key] = copy.deepcopy(rng.choice(STRANGE))
    return json.dumps(doc, allow_nan=True).encode()


def mutate_http(rng: random.Random, body: bytes, headers: dict) -> tuple[str, bytes, dict]:
    headers = dict(headers)
    path = "/v2/models/tiny/infer"
    n = int(headers.get("Inference-Header-Content-Length", len(body)))
    header, binary = body[:n], body[n:]
    for _ in range(rng.randint(1, 3)):
        kind = rng.randrange(9)
        if kind == 0:  # flip bytes
            data = bytearray(header + binary)
            for _ in range(rng.randint(1, 8)):
                data[rng.randrange(len(data))] = rng.randrange(256)
            header, binary = bytes(data[:len(header)]), bytes(data[len(header):])
        elif kind == 1:  # truncate
            cut = rng.randrange(len(header) + len(binary))
            header, binary = (header[:cut], b"") if cut < len(header) else (header, binary[:cut - len(header)])
        elif kind == 2:  # insert junk
            junk = bytes(rng.randrange(256) for _ in range(rng.randint(1, 16)))
            pos = rng.randrange(len(header) + 1)
            header = header[:pos] + junk + header[pos:]
        elif kind in (3, 4, 5):  # structural JSON mutation
            header = _mutate_json(rng, header)
        elif kind == 6:  # the binary header length
            headers["Inference-Header-Content-Length"] = rng.choice(
                [str(rng.randint(-5, len(header) + len(binary) + 10)), "abc", "", " 12 ", "1e3", str(2**70)])
        elif kind == 7:
            headers.pop("Inference-Header-Content-Length", None)
            if rng.random() < 0.5:
                headers["Content-Encoding"] = rng.choice(["gzip", "deflate", "br", "identity"])
        else:  # the path
            path = rng.choice(["/v2/models/tiny/versions/1/infer", "/v2/models/tiny/versions/x/infer",
                               "/v2/models/%00/infer", "/v2/models/tiny/versions/99999999999999999999/infer",
                               "/v2/models/tiny/infer_image", "/v2/models/../infer", "/v2/repository/index",
                               "/v2/repository/models/tiny/load"])
    if "Inference-Header-Content-Length" in headers and rng.random() < 0.5:
        headers["Inference-Header-Content-Length"] = str(len(header))
    return path, header + binary, headers


def test_http_fuzzing_never_breaks_the_server(tmp_path, tiny_plan):
    root = tmp_path / "repo"
    add_model(root, "tiny", tiny_plan, BATCHING)
    rng = random.Random(SEED)
    bases = _valid_http_bodies()
    statuses: dict = {}
    with running(root, max_request_bytes=1 << 20) as server:
        for i in range(COUNT):
            body, headers = rng.choice(bases)
            path, body, headers = mutate_http(rng, body, headers)
            conn = http.client.HTTPConnection(HOST, server.http_port, timeout=20)
            try:
                conn.request("POST", path, body=body, headers=headers)
                response = conn.getresponse()
                payload = response.read()
            finally:
                conn.close()
            statuses[response.status] = statuses.get(response.status, 0) + 1
            assert response.status in (200, 400, 404, 405, 504), (i, path, headers, body[:300], payload[:300])
            if response.status >= 400:
                message = json.loads(payload)["error"]
                assert message and "\n" not in message and "internal error" not in message, (i, message)
        assert statuses.get(400, 0) > COUNT // 3, statuses
        client = http_client(server)
        assert client.is_server_live() and client.is_model_ready("tiny")
        x = images(3, 9)
        np.testing.assert_allclose(http_infer(client, x).as_numpy("logits"), reference(tiny_plan, x), rtol=1e-5, atol=1e-6)
        labels = {"model": "tiny", "version": "1", "reason": "BACKEND"}
        assert server.metrics.get("nv_inference_request_failure", labels) == 0


def _valid_grpc_requests() -> list[pb.ModelInferRequest]:
    raw = pb.ModelInferRequest(model_name="tiny", id="r")
    raw.inputs.add(name="images", datatype="FP32", shape=[2, 3, 16, 16])
    raw.raw_input_contents.append(images(2, 3).tobytes())
    raw.outputs.add(name="logits")
    raw.parameters["timeout"].int64_param = 10_000_000
    typed = pb.ModelInferRequest(model_name="tiny", model_version="1")
    tensor = typed.inputs.add(name="images", datatype="FP32", shape=[1, 3, 16, 16])
    tensor.contents.fp32_contents.extend(images(1, 4).reshape(-1).tolist())
    return [raw, typed]


def mutate_grpc(rng: random.Random, base: pb.ModelInferRequest) -> bytes:
    request = pb.ModelInferRequest()
    request.CopyFrom(base)
    for _ in range(rng.randint(1, 3)):
        kind = rng.randrange(10)
        if kind == 0 and request.inputs:
            tensor = request.inputs[0]
            del tensor.shape[:]
            tensor.shape.extend(rng.choice([[1, 3, 16, 16], [0, 3, 16, 16], [5, 3, 16, 16], [1, 3, 17, 17], [-1, 3, 16, 16],
                                            [2**40, 2**40], [], [768], [1] * 17]))
        elif kind == 1 and request.inputs:
            request.inputs[0].datatype = rng.choice(["FP16", "FP64", "INT32", "BYTES", "BF16", "", "fp32", "INT8"])
        elif kind == 2 and request.inputs:
            request.inputs[0].name = rng.choice(["", "pixels", "images", "logits", "\u00e9"])
        elif kind == 3:
            if request.raw_input_contents:
                data = request.raw_input_contents[0]
                request.raw_input_contents[0] = data[:rng.randrange(len(data) + 1)]
            else:
                request.raw_input_contents.append(b"\x00" * rng.randrange(4000))
        elif kind == 4:
            request.raw_input_contents.append(b"\x01" * rng.randrange(10))
        elif kind == 5:
            param = request.parameters[rng.choice(["timeout", "sequence_id", "priority", "binary_data_output"])]
            choice = rng.randrange(4)
            if choice == 0:
                param.int64_param = rng.choice([-1, 0, 1, 2**62])
            elif choice == 1:
                param.string_param = "abc"
            elif choice == 2:
                param.bool_param = True
            else:
                param.double_param = -0.5
        elif kind == 6:
            request.model_name = rng.choice(["", "nope", "tiny", "TINY", "tiny/1"])
            request.model_version = rng.choice(["", "1", "2", "x", "-1"])
        elif kind == 7:
            request.outputs.add(name=rng.choice(["logits", "probs", ""]))
        elif kind == 8 and request.inputs:
            request.inputs.add().CopyFrom(request.inputs[0])
        else:
            del request.inputs[:]
    data = bytearray(request.SerializeToString())
    if rng.random() < 0.4 and data:  # then damage the wire bytes themselves
        for _ in range(rng.randint(1, 6)):
            action = rng.randrange(3)
            if action == 0 and data:
                data[rng.randrange(len(data))] = rng.randrange(256)
            elif action == 1 and data:
                del data[rng.randrange(len(data)):]
            else:
                pos = rng.randrange(len(data) + 1)
                data[pos:pos] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 8)))
    return bytes(data)


def test_grpc_fuzzing_never_breaks_the_server(tmp_path, tiny_plan):
    root = tmp_path / "repo"
    add_model(root, "tiny", tiny_plan, BATCHING)
    rng = random.Random(SEED)
    bases = _valid_grpc_requests()
    codes: dict = {}
    allowed = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.DEADLINE_EXCEEDED}
    with running(root, max_request_bytes=1 << 20) as server:
        channel = grpc.insecure_channel(server.grpc_url)
        call = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer")
        for i in range(COUNT):
            message = mutate_grpc(rng, rng.choice(bases))
            try:
                pb.ModelInferResponse.FromString(call(message, timeout=20))
                code = grpc.StatusCode.OK
            except grpc.RpcError as exc:
                code = exc.code()
                assert code in allowed, (i, code, exc.details())
                assert exc.details() and "\n" not in exc.details() and "internal error" not in exc.details()
            codes[code] = codes.get(code, 0) + 1
        channel.close()
        assert codes.get(grpc.StatusCode.INVALID_ARGUMENT, 0) > COUNT // 3, codes
        client = grpc_client(server)
        assert client.is_server_live() and client.is_model_ready("tiny")
        x = images(2, 8)
        np.testing.assert_allclose(grpc_infer(client, x).as_numpy("logits"), reference(tiny_plan, x), rtol=1e-5, atol=1e-6)
