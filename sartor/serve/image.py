"""The image route: JPEG/PNG bytes in, the engine's stored preprocessing applied, and for detector
models the detections decoded (boxes in original-image pixels, scores, classes) as JSON.

The preprocessing comes from the engine (`sartor build --preprocess ...`, `engine.preprocess`), else
from the model's config.pbtxt (`parameters { key: "preprocess" value { string_value: "..." } }`).
An engine with resolution buckets runs the image at the bucket its size routes to, under the
engine's max_downscale or config.pbtxt's `max_downscale` parameter (never the request's); an image
no bucket takes is refused with 400 and the one line saying why
(docs/decisions/0037-resolution-buckets.md).
Detections are decoded by sartor.validate.decoders when the outputs look like a YOLO head
(`[B, 4+C, N]`) or like boxes+scores; otherwise the raw outputs are returned.
"""
from __future__ import annotations

import numpy as np

from ..errors import SartorError
from .errors import InvalidRequest
from .tensors import kserve_datatype

DECODER_CHOICES = ("auto", "none", "yolo", "boxes")  # never module:function from the network
MAX_IMAGE_PIXELS = 64_000_000


def _number(query: dict, key: str, default, kind):
    value = query.get(key)
    if value is None:
        return default
    try:
        return kind(value)
    except ValueError:
        raise InvalidRequest(f"query parameter {key}={value!r} must be a {kind.__name__}") from None


def prepare(model, body: bytes, query: dict) -> tuple[dict, object, dict]:
    """(inputs, ImageMeta, decode options) for one image; runs off the event loop. The image is
    decoded and preprocessed by the pipeline's own functions (`sartor.pipeline.decode`, `prepare`)
    on the host: the batcher gathers requests' inputs on the host and copies a batch at once."""
    from ..data.buckets import BucketRefused, Buckets
    from ..pipeline.decode import ImageTooLarge, decode_on_host
    from ..pipeline.prepare import prepare_batch
    buckets = getattr(model, "buckets", None)
    if buckets is None and model.preprocess is not None:
        buckets = Buckets((model.preprocess,))
    if buckets is None:
        raise InvalidRequest(f"model '{model.name}' has no stored preprocessing: build it with --preprocess or add "
                             f"parameters {{ key: \"preprocess\" value {{ string_value: \"...\" }} }} "
                             f"to its config.pbtxt")
    images = [v for v in model.engine.inputs if v.shape is not None and len(v.shape) == 4]
    if len(model.engine.inputs) != 1 or not images:
        raise InvalidRequest(f"model '{model.name}': the image route needs a model with one 4-D image input")
    options = {"decoder": query.get("decoder", "auto"), "conf": _number(query, "conf", 0.25, float),
               "iou": _number(query, "iou", 0.7, float), "max_det": _number(query, "max_det", 300, int)}
    if options["decoder"] not in DECODER_CHOICES:
        raise InvalidRequest(f"decoder={options['decoder']!r} is not one of {', '.join(DECODER_CHOICES)}")
    if not body:
        raise InvalidRequest("the request body is empty: send the JPEG or PNG bytes")
    try:
        pixels, size = decode_on_host(body, buckets, max_pixels=MAX_IMAGE_PIXELS)  # exact: the reference's pixels
    except (ImageTooLarge, BucketRefused) as exc:
        raise InvalidRequest(str(exc)) from None
    except SartorError as exc:
        raise InvalidRequest(f"the body is not an image, or is corrupt or truncated: {exc} (send JPEG or PNG "
                             f"bytes)") from None
    spec = buckets.spec_for(*size)  # the bucket decode_on_host resized it for
    try:
        batch, (meta,) = prepare_batch([pixels], ["<request>"], spec, orig_sizes=[size])
    except SartorError as exc:
        raise InvalidRequest(f"preprocessing failed: {exc}") from None
    options["preprocess"] = spec.describe()
    return {images[0].name: batch.numpy()}, meta, options


def respond(model, outputs: dict, meta, options: dict) -> dict:
    """Detections when a decoder applies, else the raw outputs (JSON)."""
    from ..validate.decoders import DecodeOptions, detect_decoder, make_decoder
    result = {"model_name": model.name, "model_version": model.version,
              "image": {"width": int(meta.orig_size[1]), "height": int(meta.orig_size[0])},
              "preprocess": options.get("preprocess") or model.preprocess.describe()}
    shapes = {name: tuple(np.shape(v)) for name, v in outputs.items()}
    dtypes = {name: str(np.asarray(v).dtype) for name, v in outputs.items()}
    choice = options["decoder"]
    name = detect_decoder(shapes, dtypes) if choice == "auto" else (None if choice == "none" else choice)
    if name is None:
        result["outputs"] = []
        for n, value in outputs.items():
            value = np.asarray(value)
            flat = value.astype(np.float64) if value.dtype.kind == "f" else value
            result["outputs"].append({"name": n, "datatype": kserve_datatype(value.dtype.name),
                                      "shape": list(value.shape), "data": flat.reshape(-1).tolist()})
        return result
    try:
        decode = make_decoder(name, shapes, dtypes, DecodeOptions(conf=options["conf"], iou=options["iou"],
                                                                   max_det=options["max_det"]))
        detections = decode(outputs, [meta])[0]
    except SartorError as exc:
        raise InvalidRequest(f"model '{model.name}': cannot decode detections: {exc}") from None
    result["decoder"] = decode.name
    result["detections"] = [{"box": [round(float(c), 3) for c in box], "score": round(float(score), 5),
                             "class": int(cls)}
                            for box, score, cls in zip(detections.boxes, detections.scores, detections.classes)]
    return result
