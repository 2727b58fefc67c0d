"""Labelled image sets: COCO detection files, ImageFolder trees and JSONL/CSV manifests.

Everything is checked when the dataset is opened (files exist, ids resolve, boxes lie inside their
images), so an accuracy run fails in the first second with one line naming what is wrong, not after
an hour. Pixels are only read while iterating.
"""
from __future__ import annotations

import csv
import json
import os
from collections import defaultdict
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..errors import DataError
from ..progress import ProgressReport
from .buckets import BucketRefused, Buckets
from .preprocess import ImageMeta, PreprocessSpec, load_image, preprocess_image

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".webp", ".tif", ".tiff", ".gif", ".ppm", ".pgm")
NO_VALUE = "(none)"
BOX_TOLERANCE = 1.0  # pixels an annotation box may stick out of its image
# Keys of a COCO image record that describe the file, not the scene.
_COCO_IMAGE_KEYS = {"id", "file_name", "width", "height", "license", "coco_url", "flickr_url", "date_captured"}


def _empty_boxes() -> np.ndarray:
    return np.zeros((0, 4), dtype=np.float32)


def _empty_classes() -> np.ndarray:
    return np.zeros((0,), dtype=np.int64)


@dataclass
class Sample:
    path: str
    label: int | None = None  # class index (classification)
    boxes: np.ndarray = field(default_factory=_empty_boxes)  # N×4 x1 y1 x2 y2, original pixels, float32
    classes: np.ndarray = field(default_factory=_empty_classes)  # N class indices, int64
    attributes: dict = field(default_factory=dict)  # e.g. {"lighting": "night"}
    image_id: int = 0
    # COCO `iscrowd` regions: not objects to find, but areas where detections are not false positives.
    crowd_boxes: np.ndarray = field(default_factory=_empty_boxes)
    crowd_classes: np.ndarray = field(default_factory=_empty_classes)
    size: tuple[int, int] | None = None  # (H, W) as the annotations declare it, when they do


@dataclass
class Dataset:
    samples: list[Sample]
    class_names: list[str]
    task: str  # classify | detect
    source: str  # the path it was read from
    format: str = ""  # coco | imagefolder | images (a plain folder, no labels) | manifest
    category_ids: list[int] | None = None  # COCO: class index → original category id

    def __len__(self) -> int:
        return len(self.samples)

    def __iter__(self) -> Iterator[Sample]:
        return iter(self.samples)

    def attributes(self) -> list[str]:
        """The attribute names any sample carries, sorted."""
        return sorted({k for s in self.samples for k in s.attributes})

    def splits(self, attribute: str) -> dict[str, list[Sample]]:
        """Attribute value (as text) → samples; samples without the attribute go under "(none)"."""
        groups: dict[str, list[Sample]] = {}
        for sample in self.samples:
            value = sample.attributes.get(attribute)
            key = NO_VALUE if value is None or value == "" else str(value)
            groups.setdefault(key, []).append(sample)
        return dict(sorted(groups.items(), key=lambda kv: (kv[0] == NO_VALUE, kv[0])))

    def describe(self) -> str:
        objects = sum(len(s.boxes) for s in self.samples)
        what = f"{objects} boxes" if self.task == "detect" else "labels"
        return (f"{self.format or self.task} dataset {self.source}: {len(self)} images, {what}, "
                f"{len(self.class_names)} classes")


# ---- checks shared by the loaders ------------------------------------------------------------------

def _check_exists(path: Path, what: str = "dataset") -> None:
    if not path.exists():
        raise DataError(f"{what} {path} does not exist")


def _check_images_exist(samples: Sequence[Sample], source: str) -> None:
    missing = [s.path for s in samples if not os.path.isfile(s.path)]
    if missing:
        shown = ", ".join(missing[:5]) + (", ..." if len(missing) > 5 else "")
        raise DataError(f"dataset {source}: {len(missing)} of {len(samples)} image file(s) missing: {shown}")


def _check_not_empty(samples: Sequence[Sample], source: str, hint: str = "") -> None:
    if not samples:
        raise DataError(f"dataset {source} is empty: it lists no images{hint}")


def _resolve(path: str, base: Path) -> str:
    p = Path(os.path.expanduser(path))
    return str(p if p.is_absolute() else base / p)


# ---- COCO --------------------------------------------------------------------------------------------

def _read_json(path: Path) -> object:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise DataError(f"cannot read {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise DataError(f"{path} is not a text (JSON) file") from None
    if not text.strip():
        raise DataError(f"annotation file {path} is empty")
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise DataError(f"annotation file {path} is not valid JSON: {exc.msg} at line {exc.lineno}") from None


def _is_coco(data: object) -> bool:
    return isinstance(data, dict) and isinstance(data.get("images"), list)


def _coco_image_root(json_path: Path, images: list[dict]) -> Path:
    """Images are relative to the JSON's folder, or to an `images/` folder beside it, or (for the
    usual `annotations/instances_val2017.json` layout) to the folder above."""
    base = json_path.parent
    first = next((im.get("file_name") for im in images if isinstance(im, dict) and im.get("file_name")), None)
    if first is None or Path(first).is_absolute():
        return base
    stem = json_path.stem.split("_")[-1]  # instances_val2017 → val2017
    for candidate in (base, base / "images", base.parent / stem, base.parent / "images", base.parent,
                      base / "images" / stem, base.parent / "images" / stem):
        if (candidate / first).is_file():
            return candidate
    return base


def load_coco(json_path: str | os.PathLike, image_root: str | os.PathLike | None = None) -> Dataset:
    """A COCO detection file: bbox [x, y, w, h] → xyxy, categories → contiguous indices in id order,
    extra keys of each image record (e.g. "lighting") → attributes, `iscrowd` boxes kept apart."""
    json_path = Path(json_path)
    _check_exists(json_path, "annotation file")
    data = _read_json(json_path)
    if not _is_coco(data):
        raise DataError(f"{json_path} is not a COCO annotation file: it has no \"images\" list")
    assert isinstance(data, dict)
    images = data["images"]
    annotations = data.get("annotations") or []
    categories = data.get("categories") or []
    if not isinstance(annotations, list) or not isinstance(categories, list):
        raise DataError(f"{json_path}: \"annotations\" and \"categories\" must be lists")
    source = str(json_path)
    _check_not_empty(images, source)

    try:
        cats = sorted(((int(c["id"]), str(c.get("name", c["id"]))) for c in categories), key=lambda c: c[0])
    except (KeyError, TypeError, ValueError):
        raise DataError(f"{json_path}: every category needs an integer \"id\"") from None
    if len({cid for cid, _ in cats}) != len(cats):
        raise DataError(f"{json_path}: category ids repeat")
    index_of = {cid: i for i, (cid, _) in enumerate(cats)}

    root = Path(image_root) if image_root is not None else _coco_image_root(json_path, images)
    if image_root is not None:
        _check_exists(root, "image root")
    samples: list[Sample] = []
    by_id: dict[int, int] = {}
    for record in images:
        try:
            image_id, file_name = int(record["id"]), str(record["file_name"])
        except (KeyError, TypeError, ValueError):
            raise DataError(f"{json_path}: image record {str(record)[:80]} needs \"id\" and \"file_name\"") from None
        if image_id in by_id:
            raise DataError(f"{json_path}: image id {image_id} appears twice")
        size = None
        if record.get("height") and record.get("width"):
            size = (int(record["height"]), int(record["width"]))
        attributes = {k: v for k, v in record.items() if k not in _COCO_IMAGE_KEYS and k != "attributes"}
        if isinstance(record.get("attributes"), dict):
            attributes.update(record["attributes"])
        by_id[image_id] = len(samples)
        samples.append(Sample(path=_resolve(file_name, root), attributes=attributes, image_id=image_id, size=size))

    boxes: dict[int, list] = defaultdict(list)
    crowd: dict[int, list] = defaultdict(list)
    unknown_images: set = set()
    unknown_cats: set = set()
    for ann in annotations:
        try:
            image_id, cat_id = int(ann["image_id"]), int(ann["category_id"])
            x, y, w, h = (float(v) for v in ann["bbox"])
        except (KeyError, TypeError, ValueError):
            raise DataError(f"{json_path}: annotation {str(ann)[:80]} needs \"image_id\", \"category_id\" and a "
                            f"4-number \"bbox\"") from None
        if image_id not in by_id:
            unknown_images.add(image_id)
            continue
        if cat_id not in index_of:
            unknown_cats.add(cat_id)
            continue
        sample = samples[by_id[image_id]]
        where = f"annotation {ann.get('id', '?')} of image {image_id} ({Path(sample.path).name})"
        if not (w > 0 and h > 0):
            raise DataError(f"{json_path}: {where} has a box of non-positive size: bbox [{x:g}, {y:g}, {w:g}, {h:g}]")
        if sample.size is not None:
            ih, iw = sample.size
            t = BOX_TOLERANCE
            if x < -t or y < -t or x + w > iw + t or y + h > ih + t:
                raise DataError(f"{json_path}: {where} has a box outside the {iw}x{ih} image: "
                                f"bbox [{x:g}, {y:g}, {w:g}, {h:g}] (xyxy {x:g}, {y:g}, {x + w:g}, {y + h:g})")
        (crowd if ann.get("iscrowd") else boxes)[image_id].append((x, y, x + w, y + h, index_of[cat_id]))
    if unknown_images:
        ids = sorted(unknown_images)
        raise DataError(f"{json_path}: annotations reference {len(ids)} unknown image id(s): "
                        f"{', '.join(map(str, ids[:5]))}{', ...' if len(ids) > 5 else ''}")
    if unknown_cats:
        ids = sorted(unknown_cats)
        raise DataError(f"{json_path}: annotations reference unknown category id(s) {', '.join(map(str, ids[:5]))}"
                        f"{', ...' if len(ids) > 5 else ''} (categories: {', '.join(str(c) for c, _ in cats[:10])}"
                        f"{', ...' if len(cats) > 10 else ''})")
    for image_id, i in by_id.items():
        s = samples[i]
        s.boxes, s.classes = _box_arrays(boxes.get(image_id, []))
        s.crowd_boxes, s.crowd_classes = _box_arrays(crowd.get(image_id, []))
    _check_images_exist(samples, source)
    return Dataset(samples, [name for _, name in cats], "detect", source, "coco", [cid for cid, _ in cats])


def _box_arrays(rows: list) -> tuple[np.ndarray, np.ndarray]:
    if not rows:
        return _empty_boxes(), _empty_classes()
    a = np.asarray(rows, dtype=np.float64)
    return a[:, :4].astype(np.float32), a[:, 4].astype(np.int64)


# ---- ImageFolder -------------------------------------------------------------------------------------

def _is_image(path: Path) -> bool:
    return path.is_file() and path.suffix.lower() in IMAGE_EXTENSIONS and not path.name.startswith(".")


def load_image_folder(root: str | os.PathLike, class_names: list[str] | None = None) -> Dataset:
    """root/<class>/**/<image>: one folder per class, classes in sorted order (or `class_names`' order).
    A folder without sub-folders is a plain folder of unlabelled images (`load_plain_folder`)."""
    root = Path(root)
    _check_exists(root)
    if not root.is_dir():
        raise DataError(f"dataset {root} is not a directory")
    folders = sorted(p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))
    loose = sorted(p.name for p in root.iterdir() if _is_image(p))
    if not folders:
        if loose:
            return load_plain_folder(root)
        raise DataError(f"dataset {root} is empty: it holds no image with an extension of "
                        f"{', '.join(IMAGE_EXTENSIONS)} (and no sub-folder per class)")
    if loose:
        # Sub-folders name classes; images beside them would be silently left out (or unlabelled).
        raise DataError(f"dataset {root} mixes {len(loose)} image(s) at its top level ({', '.join(loose[:3])}"
                        f"{', ...' if len(loose) > 3 else ''}) with class sub-folders ({', '.join(folders[:3])}"
                        f"{', ...' if len(folders) > 3 else ''}): move the images into a class folder, or the "
                        f"sub-folders out")
    if class_names is not None:
        unknown = [f for f in folders if f not in class_names]
        if unknown:
            raise DataError(f"dataset {root}: folder(s) {', '.join(unknown[:5])} are not among the "
                            f"{len(class_names)} given class names")
        names = list(class_names)
    else:
        names = folders
    samples = []
    for folder in folders:
        label = names.index(folder)
        for path in sorted((root / folder).rglob("*")):
            if _is_image(path):
                samples.append(Sample(path=str(path), label=label, image_id=len(samples)))
    _check_not_empty(samples, str(root), f" with an extension of {', '.join(IMAGE_EXTENSIONS)}")
    return Dataset(samples, names, "classify", str(root), "imagefolder")


def load_plain_folder(root: str | os.PathLike) -> Dataset:
    """root/<image>: a plain folder of unlabelled images (what users have for calibration), in
    sorted order, not recursive: a folder with sub-folders is an ImageFolder, whose sub-folders are
    its classes."""
    root = Path(root)
    samples = [Sample(path=str(path), image_id=k) for k, path in enumerate(p for p in sorted(root.iterdir())
                                                                          if _is_image(p))]
    _check_not_empty(samples, str(root), f" with an extension of {', '.join(IMAGE_EXTENSIONS)}")
    return Dataset(samples, [], "classify", str(root), "images")


# ---- manifests ---------------------------------------------------------------------------------------

def _manifest_rows(path: Path) -> list[dict]:
    try:
        text = path.read_text(encoding="utf-8-sig")
    except OSError as exc:
        raise DataError(f"cannot read {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise DataError(f"manifest {path} is not a text file") from None
    rows: list[dict] = []
    if path.suffix.lower() == ".csv":
        reader = csv.DictReader(text.splitlines())
        if reader.fieldnames is None:
            raise DataError(f"manifest {path} is empty")
        if "path" not in [f.strip() for f in reader.fieldnames]:
            raise DataError(f"manifest {path}: the CSV header {','.join(reader.fieldnames)} has no \"path\" column")
        for row in reader:
            rows.append({(k or "").strip(): (v.strip() if isinstance(v, str) else v) for k, v in row.items()})
    else:
        for number, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DataError(f"manifest {path} line {number} is not valid JSON: {exc.msg}") from None
            if not isinstance(row, dict):
                raise DataError(f"manifest {path} line {number} is not a JSON object")
            rows.append(row)
    return rows


def _as_int(value) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str) and value.strip().lstrip("-").isdigit():
        return int(value)
    return None


def load_manifest(path: str | os.PathLike, class_names: list[str] | None = None) -> Dataset:
    """JSONL or CSV with `path`, `label` (class name or index) and any other keys as attributes.
    Relative paths are relative to the manifest's folder. Classes: `class_names` if given, else the
    sorted unique names (or 0..max when every label is an integer)."""
    path = Path(path)
    _check_exists(path)
    rows = _manifest_rows(path)
    source = str(path)
    _check_not_empty(rows, source)
    base = path.parent
    labels = []
    for number, row in enumerate(rows, 1):
        if not row.get("path"):
            raise DataError(f"manifest {path} row {number} has no \"path\"")
        value = row.get("label")
        labels.append(None if value is None or value == "" else value)
    given = [v for v in labels if v is not None]
    all_ints = bool(given) and all(_as_int(v) is not None for v in given)
    if class_names is not None:
        names = list(class_names)
        lookup = {n: i for i, n in enumerate(names)}
        unknown = sorted({str(v) for v in given if str(v) not in lookup
                          and not (all_ints and 0 <= _as_int(v) < len(names))})  # type: ignore[operator]
        if unknown:
            raise DataError(f"manifest {path}: {len(unknown)} label(s) not among the {len(names)} given class names: "
                            f"{', '.join(unknown[:5])}{', ...' if len(unknown) > 5 else ''}")
    elif all_ints:
        names = [str(i) for i in range(max(_as_int(v) for v in given) + 1)]  # type: ignore[type-var]
        lookup = {}
    else:
        names = sorted({str(v) for v in given})
        lookup = {n: i for i, n in enumerate(names)}
    samples = []
    for index, (row, value) in enumerate(zip(rows, labels)):
        label = None
        if value is not None:
            label = lookup[str(value)] if str(value) in lookup else _as_int(value)
            if label is None or not 0 <= label < len(names):
                raise DataError(f"manifest {path} row {index + 1}: label {value!r} is not a class")
        attributes = {k: v for k, v in row.items() if k not in ("path", "label", "image_id") and k}
        image_id = _as_int(row.get("image_id"))
        samples.append(Sample(path=_resolve(str(row["path"]), base), label=label, attributes=attributes,
                              image_id=index if image_id is None else image_id))
    _check_images_exist(samples, source)
    return Dataset(samples, names, "classify", source, "manifest")


# ---- one entry point -----------------------------------------------------------------------------------

def _looks_like_coco(path: Path) -> bool:
    """Cheap test on the file's first 64 KiB (annotation files can be hundreds of MB)."""
    try:
        with path.open("rb") as f:
            head = f.read(1 << 16)
    except OSError:
        return False
    return head.lstrip().startswith(b"{") and b'"images"' in head


def _coco_in_folder(folder: Path) -> Path | None:
    preferred = folder / "annotations.json"
    if preferred.is_file():
        return preferred
    candidates = [p for p in sorted(folder.glob("*.json")) + sorted((folder / "annotations").glob("*.json"))
                  if _looks_like_coco(p)]
    if len(candidates) > 1:
        names = ", ".join(str(p.relative_to(folder)) for p in candidates[:5])
        raise DataError(f"dataset {folder} holds several COCO files ({names}): give the one to use")
    return candidates[0] if candidates else None


def open_dataset(path: str | os.PathLike, task: str | None = None,
                 class_names: list[str] | None = None) -> Dataset:
    """A folder → ImageFolder (a plain folder of images when it has no sub-folders), unless it holds a COCO file (annotations.json or another *.json, also
    under annotations/), then COCO with images relative to the folder; .json → COCO; .jsonl/.csv →
    manifest. `task` ("classify"/"detect"), when given, must match what the files hold."""
    if task not in (None, "classify", "detect"):
        raise DataError(f"task {task!r} is not classify or detect")
    path = Path(path)
    _check_exists(path)
    if path.is_dir():
        coco = _coco_in_folder(path)
        if coco is not None:
            dataset = load_coco(coco)
        else:
            dataset = load_image_folder(path, class_names)
    else:
        suffix = path.suffix.lower()
        if suffix == ".json":
            dataset = load_coco(path)
        elif suffix in (".jsonl", ".csv"):
            dataset = load_manifest(path, class_names)
        else:
            raise DataError(f"dataset {path}: expected a folder, a COCO .json, or a .jsonl/.csv manifest")
    if class_names is not None and dataset.format == "coco" and list(class_names) != dataset.class_names:
        if len(class_names) != len(dataset.class_names):
            raise DataError(f"dataset {path} has {len(dataset.class_names)} categories but {len(class_names)} "
                            f"class names were given")
        dataset.class_names = list(class_names)
    if task is not None and task != dataset.task:
        kinds = {"classify": "classification", "detect": "detection"}
        raise DataError(f"dataset {path} is a {kinds[dataset.task]} dataset ({dataset.format}), "
                        f"but task {task} was asked for")
    return dataset


# ---- batches -------------------------------------------------------------------------------------------

def _samples_of(data: Dataset | Iterable[Sample]) -> list[Sample]:
    return list(data.samples if isinstance(data, Dataset) else data)


def iterate_batches(data: Dataset | Sequence[Sample], spec: PreprocessSpec | Buckets, batch_size: int,
                    progress: bool = False, workers: int | None = None,
                    ) -> Iterator[tuple[np.ndarray | list[np.ndarray], list[ImageMeta], list[Sample]]]:
    """(batch array, one ImageMeta per image, the samples) in dataset order; the last batch may be
    smaller. Images are decoded by a few threads (Pillow releases the GIL while decoding). With
    resolution Buckets, each image is preprocessed by the spec of the bucket it routes to (an image
    no bucket takes is a DataError naming it), and the first item is a list of arrays, one per image
    (their sizes may differ: the caller groups them by bucket)."""
    if batch_size < 1:
        raise DataError(f"batch size {batch_size} must be at least 1")
    samples = _samples_of(data)
    _check_not_empty(samples, getattr(data, "source", "(samples)"))
    workers = workers if workers is not None else min(4, os.cpu_count() or 1)

    def one(sample: Sample) -> tuple[np.ndarray, ImageMeta]:
        image = load_image(sample.path)
        if sample.size is not None and (image.height, image.width) != tuple(sample.size):
            raise DataError(f"image {sample.path} is {image.width}x{image.height} (WxH) but its annotations say "
                            f"{sample.size[1]}x{sample.size[0]}: boxes would not line up")
        if not isinstance(spec, Buckets):
            return preprocess_image(image, spec, path=sample.path)
        try:
            chosen = spec.spec_for(image.height, image.width)
        except BucketRefused as exc:
            raise BucketRefused(f"image {sample.path}: {exc}") from None
        return preprocess_image(image, chosen, path=sample.path)

    # A live bar on a terminal, a line every few seconds in a log (sartor/progress.py).
    bar = ProgressReport("validate") if progress else None
    if bar is not None:
        bar("images")
    done = 0
    pool = ThreadPoolExecutor(max_workers=workers) if workers > 1 else None
    try:
        for start in range(0, len(samples), batch_size):
            chunk = samples[start:start + batch_size]
            results = list(pool.map(one, chunk)) if pool is not None else [one(s) for s in chunk]
            arrays = [a for a, _ in results]
            metas = [m for _, m in results]
            if isinstance(spec, Buckets):
                done += len(chunk)
                if bar is not None:
                    bar.advance(done, len(samples), Path(metas[-1].path).name if metas[-1].path else "")
                yield arrays, metas, chunk
                continue
            if len({a.shape for a in arrays}) > 1:
                sizes = ", ".join(f"{Path(m.path).name} {m.orig_size[0]}x{m.orig_size[1]}" for m in metas[:5])
                raise DataError(f"images of different sizes cannot share a batch with preprocess "
                                f"{spec.describe()!r} ({sizes}): use letterbox= or resize=")
            done += len(chunk)
            if bar is not None:
                bar.advance(done, len(samples), Path(metas[-1].path).name if metas[-1].path else "")
            yield np.stack(arrays), metas, chunk
    finally:
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
        if bar is not None:
            bar.finish()


# ---- sampling ------------------------------------------------------------------------------------------

def balanced_sample(data: Dataset | Sequence[Sample], attribute: str, size: int, seed: int = 0) -> list[Sample]:
    """`size` samples with an equal share per value of `attribute` (samples without it form the group
    "(none)"). A group with fewer images gives all it has and the others fill in. Deterministic for a
    seed; the groups are interleaved, so any prefix of the result is balanced too."""
    if size < 1:
        raise DataError(f"sample size {size} must be at least 1")
    samples = _samples_of(data)
    dataset = data if isinstance(data, Dataset) else Dataset(samples, [], "classify", "(samples)")
    groups = dataset.splits(attribute)
    if not groups:
        raise DataError("cannot sample from an empty dataset")
    rng = np.random.default_rng(seed)
    shuffled = {k: [g[i] for i in rng.permutation(len(g))] for k, g in groups.items()}
    # Water-filling: every group gets min(its size, an equal share of what is left).
    quota = {k: 0 for k in shuffled}
    left = min(size, len(samples))
    open_groups = sorted(shuffled, key=lambda k: len(shuffled[k]))
    while left > 0 and open_groups:
        share = left // len(open_groups)
        if share == 0:
            for k in sorted(open_groups)[:left]:  # the remainder, one each, in name order
                quota[k] += 1
            break
        nxt = []
        for k in open_groups:
            take = min(share, len(shuffled[k]) - quota[k])
            quota[k] += take
            left -= take
            if quota[k] < len(shuffled[k]):
                nxt.append(k)
        open_groups = nxt
    picked = {k: shuffled[k][:quota[k]] for k in shuffled}
    out: list[Sample] = []
    for i in range(max(quota.values(), default=0)):
        for k in groups:  # sorted group order
            if i < len(picked[k]):
                out.append(picked[k][i])
    return out
