"""The accuracy a bundle's labelled validation data measures: `--data` of an INT8/FP8 build, kept
in the bundle when it is a folder (ImageFolder, or COCO with its images) of at most
CALIB_COPY_LIMIT bytes. The task metric (top-1, COCO mAP) of the bundled engine and of the FP32
model is recorded when the bundle is made; a rebuild measures its engine on the same images, and
the drop against the bundled engine is gated."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import SartorError
from ..runtime.engine import Engine
from ..runtime.engine_file import write_atomic
from ..validate.runner import validate

DATA_DIR = "validation/data"
RECORD = "validation/validation.json"
# A rebuilt engine may lose this much of the task metric against the bundled engine (half a point
# of top-1 or mAP): more is a change of kernels or rounding that the golden cosines may not show.
DEFAULT_MAX_DROP = 0.005


def measure(engine: Engine, data: Path, model: Path, split_by: str | None, classes: list | None) -> dict:
    """The engine's and the FP32 model's task metric on `data`, overall and per split."""
    report = validate(engine, data, reference=model, split_by=split_by, class_names=classes)
    return {"task": report.task, "metric": report.metric, "mode": report.mode, "images": report.overall.images,
            "engine": report.overall.engine, "reference": report.overall.reference,
            "splits": {s.name: {"engine": s.engine, "reference": s.reference} for s in report.splits}}


def record_validation(record: dict, staging: Path, engine: Engine, model: Path, split_by: str | None,
                      classes: list | None) -> None:
    """Write validation.json: where the data came from (`record`, from bundle.keep_data) and, when it
    was copied, what the engine and the FP32 model score on it."""
    record = dict(record, split_by=split_by, classes=classes, measured=None)
    if not record["copied"]:
        record["why_not_measured"] = "the data is not in the bundle (a file, or over the copy limit)"
    else:
        try:
            record["measured"] = measure(engine, staging / DATA_DIR, model, split_by, classes)
        except SartorError as exc:  # e.g. an engine without --preprocess: validate cannot feed it
            record["why_not_measured"] = str(exc)
    write_atomic(staging / RECORD, (json.dumps(record, indent=1, sort_keys=True) + "\n").encode("utf-8"))


@dataclass
class AccuracyDrop:
    metric: str
    bundled: float | None  # the bundled engine's metric
    rebuilt: float | None
    reference: float | None  # the FP32 model's
    max_drop: float
    splits: dict = field(default_factory=dict)  # name -> {"bundled", "rebuilt"}

    @property
    def drop(self) -> float | None:
        if self.bundled is None or self.rebuilt is None:
            return None
        return self.bundled - self.rebuilt

    @property
    def passed(self) -> bool:
        drops = [self.drop] + [s["bundled"] - s["rebuilt"] for s in self.splits.values()
                               if s["bundled"] is not None and s["rebuilt"] is not None]
        return all(d is None or d <= self.max_drop + 1e-12 for d in drops)

    def to_json(self) -> dict:
        return {"metric": self.metric, "bundled": self.bundled, "rebuilt": self.rebuilt, "reference": self.reference,
                "drop": self.drop, "max_drop": self.max_drop, "splits": self.splits, "passed": self.passed}


def accuracy_drop(root: Path, engine: Engine, model: Path, max_drop: float) -> AccuracyDrop | None:
    """The rebuilt engine's drop against the bundled one on the bundle's validation data (None when
    the bundle measured none)."""
    path = root / RECORD
    if not path.is_file():
        return None
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
        stored = record.get("measured")
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError):
        from .manifest import BundleError
        raise BundleError(f"bundle {root}: {RECORD} is malformed") from None
    if not isinstance(stored, dict):
        return None
    now = measure(engine, root / DATA_DIR, model, record.get("split_by"), record.get("classes"))
    splits = {name: {"bundled": (stored.get("splits") or {}).get(name, {}).get("engine"), "rebuilt": s["engine"]}
              for name, s in now["splits"].items()}
    return AccuracyDrop(now["metric"], stored.get("engine"), now["engine"], now["reference"], max_drop, splits)
