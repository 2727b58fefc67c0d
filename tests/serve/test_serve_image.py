"""`sartor serve`'s image route: POST /v2/models/{name}/infer_image with JPEG/PNG bytes, the engine's
stored preprocessing applied, detections decoded for detector models. CPU engines, loopback only."""
from __future__ import annotations

import http.client
import io
import json

import numpy as np
import pytest
from serve_helpers import HOST, add_model, build_plan, detector_model, running

from conftest import classifier_model

PIL = pytest.importorskip("PIL")
from PIL import Image  # noqa: E402

from sartor.data.preprocess import parse_preprocess, preprocess_image  # noqa: E402


def picture(width: int, height: int, fmt: str = "PNG", seed: int = 0) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format=fmt)
    return buffer.getvalue()


def post(server, path: str, body: bytes, content_type: str = "image/png"):
    conn = http.client.HTTPConnection(HOST, server.http_port, timeout=20)
    try:
        conn.request("POST", path, body=body, headers={"Content-Type": content_type})
        response = conn.getresponse()
        return response.status, json.loads(response.read())
    finally:
        conn.close()


@pytest.fixture(scope="module")
def image_plans(tmp_path_factory):
    directory = tmp_path_factory.mktemp("serve_image")
    classifier = build_plan(classifier_model(), directory, "classifier", preprocess="resize=16,mean=0,std=255,rgb,nchw")
    model, head = detector_model()
    detector = build_plan(model, directory, "detector", preprocess="letterbox=16,mean=0,std=255,rgb,nchw")
    return {"classifier": classifier, "detector": detector, "head": head}


def test_image_route_applies_the_stored_preprocessing(tmp_path, image_plans, tiny_plan):
    import sartor
    root = tmp_path / "repo"
    add_model(root, "classifier", image_plans["classifier"], "max_batch_size: 4\ndynamic_batching { }\n")
    add_model(root, "plain", tiny_plan)  # no preprocessing stored
    add_model(root, "configured", tiny_plan, 'parameters { key: "preprocess" value { string_value: '
                                             '"letterbox=16,mean=0,std=255,rgb,nchw" } }\n')
    with running(root) as server:
        body = picture(40, 24, "JPEG")
        status, result = post(server, "/v2/models/classifier/infer_image", body, "image/jpeg")
        assert status == 200, result
        assert result["image"] == {"width": 40, "height": 24}
        assert result["preprocess"] == "resize=16x16,mean=0,std=255,rgb,nchw"
        array, _ = preprocess_image(Image.open(io.BytesIO(body)).convert("RGB"), parse_preprocess(result["preprocess"]))
        want = sartor.load(image_plans["classifier"], device="cpu").context().run({"images": array[None]})["logits"]
        (output,) = result["outputs"]
        assert output["name"] == "logits" and output["shape"] == [1, 10]
        np.testing.assert_allclose(np.array(output["data"]).reshape(1, 10), want, rtol=1e-5, atol=1e-5)

        status, result = post(server, "/v2/models/configured/versions/1/infer_image", picture(20, 30))
        assert status == 200 and result["preprocess"].startswith("letterbox=16")

        status, result = post(server, "/v2/models/plain/infer_image", picture(16, 16))
        assert status == 400 and "has no stored preprocessing" in result["error"]
        status, result = post(server, "/v2/models/classifier/infer_image", b"not an image")
        assert status == 400 and "not an image" in result["error"]
        status, result = post(server, "/v2/models/classifier/infer_image", picture(16, 16)[:60])
        assert status == 400 and "corrupt or truncated" in result["error"]
        status, result = post(server, "/v2/models/classifier/infer_image", b"")
        assert status == 400 and "empty" in result["error"]
        status, result = post(server, "/v2/models/classifier/infer_image?decoder=evil:function", picture(16, 16))
        assert status == 400 and "is not one of auto, none, yolo, boxes" in result["error"]


def test_image_route_decodes_detections_in_original_pixels(tmp_path, image_plans):
    root = tmp_path / "repo"
    add_model(root, "detector", image_plans["detector"], "max_batch_size: 4\ndynamic_batching { }\n")
    with running(root) as server:
        # 64 wide, 32 high: letterboxed into 16x16 at scale 0.25, 4 rows of padding on top.
        status, result = post(server, "/v2/models/detector/infer_image?conf=0.5", picture(64, 32))
        assert status == 200, result
        assert result["decoder"] == "yolo" and result["image"] == {"width": 64, "height": 32}
        (detection,) = result["detections"]
        assert detection["class"] == 1 and detection["score"] == pytest.approx(0.9)
        # Input box (6, 6)-(10, 10) → original ((6-0)/0.25, (6-4)/0.25) - ((10-0)/0.25, (10-4)/0.25).
        assert detection["box"] == pytest.approx([24.0, 8.0, 40.0, 24.0], abs=1e-3)
        status, result = post(server, "/v2/models/detector/infer_image?conf=0.95", picture(64, 32))
        assert status == 200 and result["detections"] == []
        status, result = post(server, "/v2/models/detector/infer_image?decoder=none", picture(64, 32))
        assert status == 200 and result["outputs"][0]["shape"] == [1, 6, 8]
        status, result = post(server, "/v2/models/detector/infer_image?conf=high", picture(64, 32))
        assert status == 400 and "conf='high' must be a float" in result["error"]
