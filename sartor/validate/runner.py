"""`validate`: the task metric of an engine and of its FP32 ONNX reference, on the same images,
overall and per split, and the accuracy gate (reference − engine ≤ max_drop in every split).

Both models see the same preprocessed batches (the engine's `--preprocess` spec, or an override).
With labels, both are scored against them. Without labels, the reference's own outputs are the
ground truth: argmax agreement for classifiers, pseudo-label mAP for detectors (the reference's
detections above `pseudo_conf`), so the reference scores 1.0 and the engine's figure is how much
of the reference it reproduces.
"""
from __future__ import annotations

import hashlib
import itertools
import os
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Sequence

import numpy as np

from ..data.buckets import Buckets, buckets_from_header
from ..data.datasets import Dataset, Sample, iterate_batches, open_dataset
from ..data.preprocess import PreprocessSpec, parse_preprocess
from ..errors import ConfigError, DataError, InputError, ModelLoadError, SartorError
from ..pipeline.pipeline import Pipeline
from ..pipeline.pipeline import image_input as engine_image_input
from ..version import __version__
from .ap import DEFAULT_AP_METHOD, ApMethod, get_ap_method
from .compare import first_error_line
from .decoders import DecodeOptions, Decoder, Detections, make_decoder
from .metrics import (
    DEFAULT_PSEUDO_CONF,
    histogram_top,
    label_ranks,
    metrics_from_ranks,
    predictions,
    probabilities,
    pseudo_labels,
    score_histogram,
)

TASKS = ("classify", "detect")
METRIC_NAMES = {"classify": "top-1", "detect": "mAP@[.5:.95]"}
HIST_BINS = 20
EXAMPLES_PER_SPLIT = 6  # the report's thumbnails per split: enough to see a pattern, a page that stays small
EXAMPLE_CONF = 0.25  # detections drawn and compared per image: Ultralytics' predict default
DROP_EPS = 1e-9  # float noise allowed over max_drop


# ---- the report ------------------------------------------------------------------------------------

@dataclass
class SplitResult:
    name: str
    images: int
    reference: float | None  # the task metric (top-1, or mAP@[.5:.95]); None when undefined (no ground truth)
    engine: float | None
    instances: int = 0  # ground-truth objects (detection)
    reference_extra: dict = field(default_factory=dict)  # top5 / map50
    engine_extra: dict = field(default_factory=dict)
    max_drop: float | None = None

    @property
    def drop(self) -> float | None:
        if self.reference is None or self.engine is None:
            return None
        return self.reference - self.engine

    @property
    def passed(self) -> bool:
        drop = self.drop
        return self.max_drop is None or drop is None or drop <= self.max_drop + DROP_EPS

    def to_json(self) -> dict:
        return {"name": self.name, "images": self.images, "instances": self.instances, "reference": self.reference,
                "engine": self.engine, "drop": self.drop, "passed": self.passed,
                "reference_extra": self.reference_extra, "engine_extra": self.engine_extra}


@dataclass
class ValidationReport:
    engine_path: str
    reference_path: str
    data: str
    task: str
    mode: str  # "labels": scored against the dataset's labels; "reference": against the FP32 model's outputs
    metric: str
    overall: SplitResult
    splits: list = field(default_factory=list)  # SplitResult per value of split_by
    split_by: str | None = None
    max_drop: float | None = None
    per_class: list = field(default_factory=list)  # {"id", "name", "instances", "reference", "engine"}
    scores: dict = field(default_factory=dict)  # {"what", "edges", "reference", "engine"}: histograms
    class_names: list = field(default_factory=list)
    preprocess: str = ""
    decoder: str | None = None
    batch: int = 0
    device: str = ""
    precision: str = ""
    options: dict = field(default_factory=dict)
    notes: list = field(default_factory=list)
    seconds: dict = field(default_factory=dict)
    created: str = ""  # UTC, ISO 8601: when this validation ran
    sartor_version: str = ""
    engine_info: dict = field(default_factory=dict)  # digest, fingerprint, build options of the engine
    latency: dict = field(default_factory=dict)  # the engine's time per batch and image in this run
    examples: list = field(default_factory=list)  # per split, the images where engine and reference differ most
    ap_method: str | None = None  # detection: which AP code computed the mAP (validate --ap-method)

    @property
    def gated(self) -> bool:
        return self.max_drop is not None

    @property
    def passed(self) -> bool:
        return all(s.passed for s in [self.overall, *self.splits])

    @property
    def failed_splits(self) -> list:
        return [s for s in [self.overall, *self.splits] if not s.passed]

    def to_json(self) -> dict:
        return {"passed": self.passed, "gated": self.gated, "max_drop": self.max_drop, "task": self.task,
                "mode": self.mode, "metric": self.metric, "ap_method": self.ap_method, "engine": self.engine_path,
                "reference_model": self.reference_path, "data": self.data, "device": self.device,
                "precision": self.precision, "preprocess": self.preprocess, "decoder": self.decoder,
                "batch": self.batch, "options": self.options, "overall": self.overall.to_json(),
                "split_by": self.split_by, "splits": [s.to_json() for s in self.splits],
                "per_class": self.per_class, "scores": self.scores, "class_names": self.class_names,
                "notes": self.notes, "seconds": self.seconds, "created": self.created,
                "sartor_version": self.sartor_version, "engine_info": self.engine_info, "latency": self.latency,
                "examples": self.examples}


# ---- the ONNX Runtime reference -------------------------------------------------------------------

class OnnxReference:
    """One ONNX Runtime FP32 CPU session, kept for every batch."""

    def __init__(self, path: str | Path) -> None:
        from ..extras import require_extra
        require_extra("build", "the ONNX Runtime FP32 reference", ("onnxruntime",))
        import onnxruntime as ort
        self.path = Path(path)
        if not self.path.is_file():
            raise ModelLoadError(f"reference model not found: {self.path}")
        options = ort.SessionOptions()
        options.log_severity_level = 3
        try:
            self.session = ort.InferenceSession(str(self.path), options, providers=["CPUExecutionProvider"])
        except Exception as exc:
            raise ModelLoadError(f"ONNX Runtime cannot load {self.path}: {first_error_line(exc)}") from None
        self.inputs = [i.name for i in self.session.get_inputs()]
        self.outputs = [o.name for o in self.session.get_outputs()]
        self.class_names = _metadata_class_names(self.session)

    def run(self, feeds: dict, names: Sequence[str]) -> dict:
        try:
            values = self.session.run(list(names), {k: np.ascontiguousarray(v) for k, v in feeds.items()})
        except Exception as exc:
            raise InputError(f"ONNX Runtime cannot run {self.path} on these inputs: {first_error_line(exc)}") from None
        return dict(zip(names, values))


def _metadata_class_names(session) -> list[str]:
    """Class names the exporter stored in the model's metadata: Ultralytics' `names` ("{0: 'person',
    ...}") or PaddleOCR-style `character` (one per line); [] when there are none."""
    import ast
    try:
        meta = session.get_modelmeta().custom_metadata_map or {}
    except Exception:
        return []
    if meta.get("names"):
        try:
            names = ast.literal_eval(meta["names"])
        except (ValueError, SyntaxError):
            return []
        if isinstance(names, dict):
            try:
                return [str(names[k]) for k in sorted(names, key=int)]
            except (TypeError, ValueError):
                return []
        if isinstance(names, (list, tuple)):
            return [str(n) for n in names]
    if meta.get("character"):
        return [line for line in meta["character"].splitlines() if line.strip()]
    return []


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


# ---- set-up helpers ---------------------------------------------------------------------------------

def _engine_buckets(engine) -> Buckets | None:
    """The engine's resolution buckets (one for an engine of one size), or None."""
    buckets = getattr(engine, "buckets", None)
    return buckets if buckets is not None else buckets_from_header(getattr(engine, "header", None) or {})


def _by_shape(arrays: list[np.ndarray]) -> list[list[int]]:
    """Positions of arrays of one shape (one bucket), each list in order, by first appearance."""
    groups: dict[tuple, list[int]] = {}
    for i, a in enumerate(arrays):
        groups.setdefault(a.shape, []).append(i)
    return list(groups.values())


def _bucket_note(buckets: Buckets, metas: list) -> str:
    counts: dict[tuple, int] = {}
    for meta in metas:
        counts[tuple(meta.input_size)] = counts.get(tuple(meta.input_size), 0) + 1
    routed = ", ".join(f"{s.height}x{s.width} {counts.get(s.size, 0)}" for s in buckets.specs)
    return (f"resolution buckets {buckets.describe()}: each image ran (engine and reference alike) at the smallest "
            f"bucket that holds it, above the largest {buckets.policy_text()}; images per bucket: {routed}")


def _has_labels(dataset: Dataset) -> bool:
    if dataset.task == "detect":
        return any(len(s.boxes) or len(getattr(s, "crowd_boxes", ())) for s in dataset.samples)
    labelled = [s for s in dataset.samples if s.label is not None]
    if labelled and len(labelled) != len(dataset.samples):
        missing = [s.path for s in dataset.samples if s.label is None]
        raise DataError(f"dataset {dataset.source}: {len(missing)} of {len(dataset.samples)} images have no label "
                        f"(first: {missing[0]}): label every image, or none for reference mode")
    return bool(labelled)


def python_images(paths: list | tuple) -> Dataset:
    """Unlabelled images given from Python as a list of paths (reference mode), checked as a folder is."""
    bad = next((p for p in paths if not isinstance(p, (str, os.PathLike))), None)
    if bad is not None:
        raise ConfigError(f"validation data from Python is a list of image paths; one item is a {type(bad).__name__} "
                          f"(arrays and PIL images carry no original size for the boxes: save them as files)")
    if not paths:
        raise DataError("validation data: the list of image paths is empty")
    missing = [str(p) for p in paths if not os.path.isfile(p)]
    if missing:
        raise DataError(f"validation data: {len(missing)} of {len(paths)} image file(s) missing: "
                        f"{', '.join(missing[:5])}{', ...' if len(missing) > 5 else ''}")
    return Dataset([Sample(path=str(p), image_id=k) for k, p in enumerate(paths)], [], "classify",
                   f"<python: {len(paths)} path(s)>", "images")


def _has_crowd_regions(dataset: Dataset) -> bool:
    return any(len(getattr(s, "crowd_boxes", ())) for s in dataset.samples)


def _split_indices(dataset: Dataset, split_by: str | None) -> dict[str, list[int]]:
    if not split_by:
        return {}
    present = dataset.attributes()
    if split_by not in present:
        raise DataError(f"--split-by {split_by}: no image of {dataset.source} has that attribute "
                        f"(attributes: {', '.join(present) or 'none'})")
    position = {id(s): i for i, s in enumerate(dataset.samples)}
    return {value: [position[id(s)] for s in samples] for value, samples in dataset.splits(split_by).items()}


def _is_class_scores(shape) -> bool:
    """[B, C], or [B, C, 1, 1] as some exporters leave it."""
    return len(shape) >= 2 and all(d == 1 for d in shape[2:])


def _pick_classifier_output(shapes: dict) -> str:
    rank2 = [k for k, s in shapes.items() if _is_class_scores(s)]
    if not rank2:
        listing = ", ".join(f"{k} {list(s)}" for k, s in shapes.items())
        raise DataError(f"a classifier needs an output of shape [B, classes]; the model gives {listing}")
    return rank2[0]


def _auto_task(shapes: dict) -> str:
    """Without labels: classify when the outputs hold class scores and nothing shaped like detections."""
    if any(_is_class_scores(s) for s in shapes.values()) and not any(len(s) == 3 for s in shapes.values()):
        return "classify"
    return "detect"


def _check_classes(dataset: Dataset, num_classes: int | None, labelled: bool, task: str) -> None:
    """The dataset's classes must be the model's: same count, every label inside the outputs."""
    if num_classes is None or not labelled:
        return
    names = list(dataset.class_names)
    if task == "classify":
        labels = [s.label for s in dataset.samples if s.label is not None]
        top = max(labels) if labels else -1
    else:
        top = max((int(c.max()) for s in dataset.samples for c in (s.classes,) if len(c)), default=-1)
    shown = ", ".join(names[:5]) + (", ..." if len(names) > 5 else "")
    integer_names = all(n.isdigit() for n in names)  # manifests with integer labels: names are "0".."max"
    if len(names) != num_classes and not integer_names:
        raise DataError(f"dataset {dataset.source} has {len(names)} classes ({shown}) but the model outputs "
                        f"{num_classes}: give the model's {num_classes} class names in output order (--classes)")
    if top >= num_classes:
        raise DataError(f"dataset {dataset.source} has class {top} ({names[top] if top < len(names) else '?'}) "
                        f"but the model outputs {num_classes} classes: give the class names in the model's "
                        f"output order (--classes)")


# ---- the run -----------------------------------------------------------------------------------------

def validate(engine_path, data, reference: str | Path | None = None, task: str | None = None,
             split_by: str | None = None, max_drop: float | None = None, batch: int | None = None,
             decoder: str | None = None, preprocess: str | PreprocessSpec | None = None, device: str | None = None,
             conf: float = DecodeOptions.conf, iou: float = DecodeOptions.iou,
             max_det: int = DecodeOptions.max_det, pseudo_conf: float = DEFAULT_PSEUDO_CONF,
             class_names: list[str] | None = None, progress: bool = False,
             fast_decode: bool = False, max_downscale: float | str | None = None,
             ap_method: str = DEFAULT_AP_METHOD) -> ValidationReport:
    """Run the engine and the FP32 ONNX reference on the dataset `data` and compare their task metric.

    `engine_path` is an engine file (or a loaded Engine); `data` a path `open_dataset` reads (a
    Dataset, or a list of image paths: unlabelled, measured in reference mode). `reference`
    defaults to the model the engine was built from. Returns a ValidationReport; `report.passed` is
    False when a split's drop exceeds `max_drop`. The engine runs through `sartor.Pipeline`
    (`fast_decode` as it takes it), the reference on `sartor.data.preprocess`'s batches. An engine
    with resolution buckets runs each image at the bucket `sartor.Pipeline` routes it to (under the
    engine's max_downscale, or `max_downscale`), and the reference sees that bucket's preprocessing;
    `preprocess` (one spec) validates one size. `ap_method` says how a detector's mAP is computed
    (`sartor.validate.ap.AP_METHODS`: "coco", pycocotools' COCOeval; "ultralytics", as `yolo val`).
    """
    from ..runtime import load
    started = time.perf_counter()
    if task not in (None, *TASKS):
        raise ConfigError(f"--task {task!r} must be classify or detect")
    if max_drop is not None and max_drop < 0:
        raise ConfigError(f"--max-drop {max_drop} must not be negative")
    ap = get_ap_method(ap_method)
    options = DecodeOptions(conf=conf, iou=iou, max_det=max_det, clip=ap.clips_boxes)
    options.check()
    if not 0.0 <= pseudo_conf <= 1.0:
        raise ConfigError(f"--pseudo-conf {pseudo_conf} must be in [0, 1]")

    engine = engine_path if hasattr(engine_path, "context") else load(engine_path, device=device)
    engine_label = str(getattr(engine, "path", None) or engine_path)
    if isinstance(preprocess, str):
        preprocess = parse_preprocess(preprocess)
    buckets = Buckets((preprocess,)) if preprocess is not None else _engine_buckets(engine)
    if buckets is None:
        raise ConfigError(f"engine {engine_label} records no preprocessing: rebuild it with --preprocess, or give "
                          f"--preprocess (e.g. letterbox=640,mean=0,std=255,rgb,nchw)")
    spec = buckets.largest
    image_input = engine_image_input(engine, needed_by="validate")
    frames = getattr(engine, "input_format", None)
    if frames is not None:
        raise ConfigError(f"engine {engine_label} takes raw {frames.size[0]}x{frames.size[1]} frames (built with "
                          f"--input-format {frames.describe()}); validation reads images of every size: validate "
                          f"the same build without --input-format")
    if image_input.dtype != spec.dtype:
        raise ConfigError(f"preprocess {spec.describe()} produces {spec.dtype} but input {image_input.name!r} "
                          f"takes {image_input.dtype}: add dtype={image_input.dtype}")

    notes: list[str] = []
    config = engine.header.get("build_config", {}) if getattr(engine, "header", None) else {}
    if reference is None:
        built_from = config.get("model_path")
        if not built_from or not Path(built_from).is_file():
            raise ConfigError(f"give --reference MODEL.onnx: the model the engine was built from "
                              f"({built_from or 'unknown'}) is not found")
        reference = built_from
    reference = Path(reference)
    onnx = OnnxReference(reference)
    if onnx.inputs != [image_input.name]:
        raise InputError(f"the reference model's inputs ({', '.join(onnx.inputs)}) are not the engine's "
                         f"({image_input.name}): was the engine built from {reference}?")
    output_names = [v.name for v in engine.outputs]
    nms = getattr(engine, "nms", None)
    if nms is not None:  # NMS in the engine: the reference's raw head, through the engine's own NMS settings
        output_names = [nms["head_output"]]
        options = DecodeOptions(conf=nms["conf"], iou=nms["iou"], max_det=nms["max_det"], agnostic=nms["agnostic"])
        notes.append(f"the engine runs NMS itself (--nms conf={options.conf:g},iou={options.iou:g},"
                     f"max_det={options.max_det}{',agnostic' if options.agnostic else ''}, at most {nms['topk']} "
                     f"candidates an image): the reference's head is decoded with those settings")
        if not ap.clips_boxes:
            notes.append(f"the engine's NMS clips its boxes to the image: the {ap.name} AP scores clipped boxes "
                         f"on both sides here, where it would score them as NMS left them")
    missing = [n for n in output_names if n not in onnx.outputs]
    if missing:
        raise InputError(f"engine output(s) {', '.join(missing)} are not outputs of {reference}: "
                         f"was the engine built from it?")
    built_sha = (engine.header.get("provenance") or {}).get("onnx_sha256")
    if built_sha and _sha256(reference) != built_sha:
        notes.append(f"the reference {reference} is not the file the engine was built from (SHA-256 differs)")

    dataset = data if isinstance(data, Dataset) else python_images(data) if isinstance(data, (list, tuple)) else \
        open_dataset(data, class_names=class_names)
    labelled = _has_labels(dataset)
    if task is not None and labelled and task != dataset.task:
        kinds = {"classify": "classification", "detect": "detection"}
        raise DataError(f"dataset {dataset.source} holds {kinds[dataset.task]} labels, but --task {task} was given")
    splits = _split_indices(dataset, split_by)
    # The engine sees its images through the Pipeline (normalised on its device, into its input),
    # the reference sartor.data.preprocess's batches. Exact decoding gives both the same values, so
    # the drop is the engine's; fast_decode measures the deployed decoders (nvJPEG, DCT scaling).
    pipeline = Pipeline(engine, batch_size=batch, preprocess=spec if len(buckets) == 1 else None,
                        fast_decode=fast_decode, max_downscale=max_downscale)
    batch_size, buckets = pipeline.batch_size, pipeline.buckets  # the reference routes as the pipeline does
    engine_results = pipeline.stream(s.path for s in dataset.samples)
    all_metas: list = []

    # ---- run both models over the same batches --------------------------------------------------
    class_stats: list[dict] = []  # classification, per batch: ranks, predictions, top-1 probabilities
    num_classes = 0
    ref_dets: list[Detections] = []
    eng_dets: list[Detections] = []
    chosen: Decoder | None = None
    class_output = None
    engine_seconds = reference_seconds = 0.0
    batch_seconds: list[tuple[int, float]] = []  # (images, seconds) of each engine batch
    for arrays, metas, samples in iterate_batches(dataset.samples, buckets, batch_size, progress=progress):
        count = len(samples)
        all_metas += metas
        t0 = time.perf_counter()
        results = list(itertools.islice(engine_results, count))
        t1 = time.perf_counter()
        # One reference run per bucket the batch's images went to (one for an engine of one size).
        groups = []
        for rows in _by_shape(arrays):
            stacked = np.stack([arrays[i] for i in rows]).astype(spec.dtype, copy=False)
            groups.append((rows, onnx.run({image_input.name: stacked}, output_names)))
        t2 = time.perf_counter()
        engine_seconds += t1 - t0
        reference_seconds += t2 - t1
        batch_seconds.append((count, t1 - t0))
        ref_batch: list = [None] * count
        eng_batch: list = [None] * count
        class_rows = None
        for rows, expected in groups:
            n = len(rows)
            part = [results[i] for i in rows]
            got = {} if nms is not None else \
                {k: np.stack([_to_numpy(r.outputs[k]) for r in part]) for k in output_names}
            engine_metas = [r.meta for r in part]  # the pipeline's: the same geometry, its own decode
            expected = {k: np.asarray(v)[:n] for k, v in expected.items()}
            if task is None:
                task = dataset.task if labelled else _auto_task({k: v.shape for k, v in expected.items()})
            if task == "classify":
                if class_output is None:
                    class_output = _pick_classifier_output({k: v.shape for k, v in expected.items()})
                    num_classes = int(np.prod(expected[class_output].shape[1:]))
                    _check_classes(dataset, num_classes, labelled, task)
                if class_rows is None:
                    class_rows = (np.empty((count, num_classes), expected[class_output].dtype),
                                  np.empty((count, num_classes), got[class_output].dtype))
                class_rows[0][rows] = expected[class_output].reshape(n, -1)
                class_rows[1][rows] = got[class_output].reshape(n, -1)
                continue
            if chosen is None:
                chosen = make_decoder(decoder, {k: v.shape for k, v in expected.items()},
                                      {k: v.dtype for k, v in expected.items()}, options)
                _check_classes(dataset, chosen.num_classes, labelled, task)
            # An --nms engine's kept boxes come through the Pipeline's EngineNms, in image pixels.
            for i, ref, eng in zip(rows, chosen(expected, [metas[i] for i in rows]),
                                   [r.detections for r in part] if nms is not None else chosen(got, engine_metas)):
                ref_batch[i], eng_batch[i] = ref, eng
        if task == "classify":
            labels = np.asarray([s.label for s in samples], dtype=np.int64) if labelled else None
            class_stats.append(_class_stats(class_rows[0], class_rows[1], labels))
        else:
            ref_dets.extend(ref_batch)
            eng_dets.extend(eng_batch)
    if task is None:
        raise DataError(f"dataset {dataset.source} has no images")

    if len(buckets) > 1:
        notes.append(_bucket_note(buckets, all_metas))
    split_items = list(splits.items())
    if task == "classify":
        stats = {k: np.concatenate([b[k] for b in class_stats]) for k in class_stats[0]}
        result = _score_classification(stats, num_classes, split_items, max_drop)
        if not labelled:
            notes.append("the dataset has no labels: the reference's top-1 classes are the ground truth "
                         "(engine figure = top-1 agreement with the reference)")
    else:
        if not labelled:
            notes.append(f"the dataset has no labels: the reference's detections with score ≥ {pseudo_conf:g} are "
                         f"the ground truth (pseudo-labels)")
        if not labelled and not any(len(d.above(pseudo_conf)) for d in ref_dets):
            top = max((float(d.scores.max()) for d in ref_dets if len(d)), default=None)
            best = "none over --conf" if top is None else f"the highest is {top:.3g}"
            raise DataError(f"no pseudo-labels: no reference detection reached --pseudo-conf {pseudo_conf:g} "
                            f"({best}); lower --pseudo-conf (and --conf) to compare an untrained or weak model")
        if not ap.crowd_regions and labelled and _has_crowd_regions(dataset):
            notes.append(f"the {ap.name} AP has no crowd regions: a detection on one of the dataset's iscrowd "
                         f"regions counts as a false positive")
        result = _score_detection(dataset, labelled, ref_dets, eng_dets, split_items, max_drop, pseudo_conf, ap)
    overall, split_results, per_class, scores = result
    names = list(dataset.class_names)
    if not names and onnx.class_names:
        names = list(onnx.class_names)
    elif labelled and onnx.class_names and names != onnx.class_names and not all(n.isdigit() for n in names):
        notes.append(f"the dataset's class names ({', '.join(names[:4])}{', ...' if len(names) > 4 else ''}) are "
                     f"not the model's ({', '.join(onnx.class_names[:4])}"
                     f"{', ...' if len(onnx.class_names) > 4 else ''}): check the class order (--classes)")
    for row in per_class:
        row["name"] = names[row["id"]] if 0 <= row["id"] < len(names) else str(row["id"])
    if task == "classify":
        examples = classification_examples(dataset.samples, stats, split_items, names)
    else:
        examples = detection_examples(dataset.samples, ref_dets, eng_dets, split_items, names)
    return ValidationReport(
        engine_path=engine_label, reference_path=str(reference), data=str(dataset.source), task=task,
        mode="labels" if labelled else "reference", metric=METRIC_NAMES[task], overall=overall,
        splits=split_results, split_by=split_by, max_drop=max_drop, per_class=per_class, scores=scores,
        class_names=names, preprocess=buckets.describe(), decoder=chosen.name if chosen is not None else None,
        batch=batch_size, device=str(engine.device), precision=str(getattr(engine, "precision", "")),
        options=({"conf": options.conf, "iou": options.iou, "max_det": options.max_det, "pseudo_conf": pseudo_conf,
                  "ap_method": ap.name, **ap.options} if task == "detect" else {}) | {"fast_decode": fast_decode},
        notes=notes, seconds={"engine": engine_seconds, "reference": reference_seconds,
                              "total": time.perf_counter() - started},
        created=datetime.now(timezone.utc).isoformat(timespec="seconds"), sartor_version=__version__,
        engine_info=_engine_info(engine), latency=_latency(batch_seconds), examples=examples,
        ap_method=ap.name if task == "detect" else None)


def _engine_info(engine) -> dict:
    """What identifies the engine in a report: its file's SHA-256, the device it was built for and
    the build's options (the header's own records)."""
    header = getattr(engine, "header", None) or {}
    digest = getattr(engine, "digest", None)
    path = getattr(engine, "path", None)
    if digest is None and path and Path(path).is_file():
        digest = _sha256(Path(path))
    return {"digest": digest, "fingerprint": header.get("fingerprint") or {},
            "build_config": header.get("build_config") or {}}


def _latency(batch_seconds: list[tuple[int, float]]) -> dict:
    """The engine's side of this run, as the Pipeline delivered it (decode, preprocess and inference
    overlapped): per batch median and 95th percentile, per image mean, images per second."""
    if not batch_seconds:
        return {}
    images = sum(n for n, _ in batch_seconds)
    seconds = np.asarray([t for _, t in batch_seconds], dtype=np.float64)
    total = float(seconds.sum())
    return {"batches": len(seconds), "images": images, "batch_ms_p50": float(np.percentile(seconds, 50) * 1e3),
            "batch_ms_p95": float(np.percentile(seconds, 95) * 1e3), "image_ms_mean": total / images * 1e3,
            "images_per_second": images / total if total > 0 else None}


def _box_iou(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    lt = np.maximum(a[:, None, :2], b[None, :, :2])
    rb = np.minimum(a[:, None, 2:], b[None, :, 2:])
    inter = np.prod(np.clip(rb - lt, 0, None), axis=2)
    area = lambda x: np.prod(np.clip(x[:, 2:] - x[:, :2], 0, None), axis=1)
    return inter / np.maximum(area(a)[:, None] + area(b)[None, :] - inter, 1e-9)


def detection_disagreement(ref: Detections, eng: Detections, conf: float = EXAMPLE_CONF) -> float:
    """1 - F1 of the engine's boxes against the reference's (score ≥ conf, same class, IoU ≥ 0.5,
    greedy by score): 0 when they agree box for box, 1 when no box matches."""
    r, e = ref.above(conf), eng.above(conf)
    if not len(r) and not len(e):
        return 0.0
    if not len(r) or not len(e):
        return 1.0
    iou = _box_iou(r.boxes, e.boxes)
    iou[r.classes[:, None] != e.classes[None, :]] = 0.0
    matched, used = 0, np.zeros(len(e), bool)
    for i in np.argsort(-r.scores, kind="stable"):
        candidates = np.where(~used & (iou[i] >= 0.5))[0]
        if len(candidates):
            used[candidates[np.argmax(iou[i][candidates])]] = True
            matched += 1
    return 1.0 - 2.0 * matched / (len(r) + len(e))


def _worst(disagreement: np.ndarray, splits: list) -> list[tuple[str, list[int]]]:
    """Per split ("all" first), the indices of at most EXAMPLES_PER_SPLIT images, worst first."""
    groups = [("all", list(range(len(disagreement)))), *splits]
    return [(name, sorted(idx, key=lambda i: -disagreement[i])[:EXAMPLES_PER_SPLIT]) for name, idx in groups]


def _label(names: list[str], cls: int) -> str:
    return names[cls] if 0 <= cls < len(names) else str(cls)


def classification_examples(samples: list, stats: dict, splits: list, names: list[str]) -> list[dict]:
    """Per split, the images whose top-1 differs most: a different class first, then the largest
    change of the top-1 probability."""
    differ = (stats["ref_pred"] != stats["eng_pred"]).astype(np.float64)
    disagreement = differ + np.abs(stats["ref_prob"] - stats["eng_prob"])
    return [{"split": name, "images": [
        {"path": str(samples[i].path), "disagreement": float(disagreement[i]),
         "label": None if samples[i].label is None else _label(names, int(samples[i].label)),
         "reference": {"top1": _label(names, int(stats["ref_pred"][i])), "probability": float(stats["ref_prob"][i])},
         "engine": {"top1": _label(names, int(stats["eng_pred"][i])), "probability": float(stats["eng_prob"][i])}}
        for i in idx]} for name, idx in _worst(disagreement, splits)]


def _boxes_json(dets: Detections, names: list[str], conf: float = EXAMPLE_CONF) -> list[dict]:
    kept = dets.above(conf)
    return [{"box": [round(float(v), 1) for v in box], "score": round(float(score), 3), "label": _label(names, int(c))}
            for box, score, c in zip(kept.boxes, kept.scores, kept.classes)]


def detection_examples(samples: list, ref: list, eng: list, splits: list, names: list[str]) -> list[dict]:
    """Per split, the images whose engine boxes (score ≥ EXAMPLE_CONF) match the reference's least."""
    disagreement = np.asarray([detection_disagreement(r, e) for r, e in zip(ref, eng)], dtype=np.float64)
    return [{"split": name, "images": [
        {"path": str(samples[i].path), "disagreement": float(disagreement[i]),
         "reference": {"boxes": _boxes_json(ref[i], names)}, "engine": {"boxes": _boxes_json(eng[i], names)}}
        for i in idx]} for name, idx in _worst(disagreement, splits)]


def _to_numpy(value) -> np.ndarray:
    if isinstance(value, np.ndarray):
        return value
    try:
        import torch
        if isinstance(value, torch.Tensor):
            value = value.detach()
            return (value.float() if value.dtype == torch.bfloat16 else value).cpu().numpy()
    except ImportError:
        pass
    return np.asarray(value)


def _histograms(what: str, reference: np.ndarray, engine: np.ndarray) -> dict:
    top = histogram_top(reference, engine)
    edges = [float(f"{v:.6g}") for v in np.linspace(0, top, HIST_BINS + 1)]
    return {"what": what, "edges": edges, "reference": score_histogram(reference, HIST_BINS, top),
            "engine": score_histogram(engine, HIST_BINS, top)}


def _class_stats(ref: np.ndarray, eng: np.ndarray, labels: np.ndarray | None) -> dict:
    """What the metrics need from one batch, so that [N, classes] scores are never kept: the label's
    rank under each model (without labels: the reference's top-1 class is the label), each model's
    top-1 class and top-1 probability."""
    ref_pred, eng_pred = predictions(ref), predictions(eng)
    labels = ref_pred if labels is None else labels
    return {"labels": labels, "ref_rank": label_ranks(ref, labels), "eng_rank": label_ranks(eng, labels),
            "ref_pred": ref_pred, "eng_pred": eng_pred,
            "ref_prob": np.nan_to_num(probabilities(ref).max(axis=1), nan=0.0).astype(np.float32),
            "eng_prob": np.nan_to_num(probabilities(eng).max(axis=1), nan=0.0).astype(np.float32)}


def _score_classification(stats: dict, num_classes: int, splits: list, max_drop: float | None) -> tuple:
    labels = stats["labels"]

    def result(name: str, idx) -> tuple:
        r = metrics_from_ranks(stats["ref_rank"][idx], labels[idx], num_classes)
        e = metrics_from_ranks(stats["eng_rank"][idx], labels[idx], num_classes)
        agree = stats["ref_pred"][idx] == stats["eng_pred"][idx]
        split = SplitResult(name, len(idx), r["top1"], e["top1"], reference_extra={"top5": r["top5"]},
                            engine_extra={"top5": e["top5"], "agreement": float(agree.mean()) if len(idx) else None},
                            max_drop=max_drop)
        return split, r, e

    overall, r, e = result("all", np.arange(len(labels)))
    split_results = [result(name, np.asarray(idx, dtype=np.int64))[0] for name, idx in splits]
    per_class = [{"id": int(c), "instances": int(np.sum(labels == c)), "reference": r["per_class"].get(c),
                  "engine": e["per_class"].get(c)} for c in sorted(r["per_class"])]
    scores = _histograms("top-1 probability", stats["ref_prob"], stats["eng_prob"])
    return overall, split_results, per_class, scores


def _score_detection(dataset: Dataset, labelled: bool, ref: list, eng: list, splits: list,
                     max_drop: float | None, pseudo_conf: float, ap: ApMethod) -> tuple:
    truth = list(dataset.samples) if labelled else pseudo_labels(ref, pseudo_conf)
    sizes = [s.size or (0, 0) for s in dataset.samples]
    class_ids = list(range(len(dataset.class_names))) if labelled and dataset.class_names else None

    def result(name: str, idx: Sequence[int]) -> tuple:
        gt = [truth[i] for i in idx]
        r = ap.score(gt, [ref[i] for i in idx], class_ids, [sizes[i] for i in idx])
        e = ap.score(gt, [eng[i] for i in idx], class_ids, [sizes[i] for i in idx])
        split = SplitResult(name, len(idx), r.map, e.map, instances=r.instances,
                            reference_extra={"map50": r.map50, "detections": r.detections},
                            engine_extra={"map50": e.map50, "detections": e.detections}, max_drop=max_drop)
        return split, r, e

    overall, r, e = result("all", range(len(truth)))
    split_results = [result(name, idx)[0] for name, idx in splits]
    per_class = [{"id": int(c), "instances": v["instances"], "reference": v["ap"],
                  "engine": e.per_class.get(c, {}).get("ap"), "reference_ap50": v["ap50"],
                  "engine_ap50": e.per_class.get(c, {}).get("ap50")} for c, v in sorted(r.per_class.items())]
    scores = _histograms("detection score", np.concatenate([d.scores for d in ref]) if ref else np.zeros(0),
                         np.concatenate([d.scores for d in eng]) if eng else np.zeros(0))
    return overall, split_results, per_class, scores


__all__ = ["OnnxReference", "SartorError", "SplitResult", "ValidationReport", "validate"]
