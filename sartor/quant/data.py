"""Calibration batches from `--calib DATA`, and the SHA-256 of exactly the samples used.

- `.npy`: one array of preprocessed samples for a one-input model, shaped like the input with the
  batch axis holding the samples ([N, 3, H, W]); an array of rank + 1 ([B, n, 3, H, W]) is read
  as B ready-made batches of n.
- `.npz`: one array per input name, each [N, ...] (a single array of any name for a one-input
  model).
- anything else (an image folder, a COCO .json, a .jsonl/.csv manifest): read with
  `sartor.data.open_dataset` and preprocessed with the build's `--preprocess`; `calib_size`
  images spread evenly over the dataset, or, with `--calib-balance-by ATTR`, drawn equally from
  each value of that image attribute (`sartor.data.balanced_sample`).

`split_coverage` compares the calibration sample with the validation set (`--data`) split by an
attribute: a split of the validation set that calibration never saw, or saw far less than its fair
share of, gets thresholds fitted to other conditions (a day-only calibration clips night scenes).

The SHA-256 covers each sample used, in order: input name, dtype, shape and bytes; so the same
samples give the same digest whether they came batched or not, from .npy or .npz.
"""
from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np

from ..errors import ConfigError
from ..ir import ValueInfo

ARRAY_SUFFIXES = (".npy", ".npz")
CALIB_BATCH = 8  # samples per calibration batch when the batch dimension is dynamic


COVERAGE_SHARE = 0.25  # a validation split below this fraction of its fair share of the calibration sample is warned about


class CalibrationSet:
    """Streams batches ({input name: array}); `sha256` and `size` describe the samples yielded
    (final after a full pass). `samples` holds the dataset samples drawn (image datasets; None for
    arrays) and `balance_by` the attribute they were balanced on."""

    def __init__(self, source: str, batches: Callable[[], Iterator[dict]], available: int,
                 samples: list | None = None, balance_by: str | None = None) -> None:
        self.source = source
        self._batches = batches
        self.available = available
        self.samples = samples
        self.balance_by = balance_by
        self.size = 0
        self._digest = hashlib.sha256()

    def split_counts(self, attribute: str) -> dict[str, int] | None:
        """Attribute value → images of the calibration sample (None: array samples carry no attributes)."""
        if self.samples is None:
            return None
        return split_counts(self.samples, attribute)

    @property
    def sha256(self) -> str:
        return self._digest.hexdigest()

    def __iter__(self) -> Iterator[dict]:
        self.size, self._digest = 0, hashlib.sha256()
        for batch in self._batches():
            names = sorted(batch)
            n = len(batch[names[0]])
            for k in range(n):
                for name in names:
                    sample = np.ascontiguousarray(batch[name][k])
                    self._digest.update(f"{name}|{sample.dtype.str}|{'x'.join(map(str, sample.shape))}|".encode())
                    self._digest.update(sample.tobytes())
            self.size += n
            yield batch


def array_batches(arrays: dict, limit: int, batch_size: int) -> Callable[[], Iterator[dict]]:
    total = min(min(len(a) for a in arrays.values()), limit)

    def batches():
        for start in range(0, total, batch_size):
            stop = min(start + batch_size, total)
            yield {name: np.array(a[start:stop]) for name, a in arrays.items()}
    return batches


def _one_input(inputs: list[ValueInfo], path: Path) -> ValueInfo:
    if len(inputs) != 1:
        raise ConfigError(f"--calib {path}: a .npy file feeds one input, but the model has {len(inputs)} "
                          f"({', '.join(v.name for v in inputs)}): use a .npz with one array per input")
    return inputs[0]


def checked_input_array(name: str, array: np.ndarray, info: ValueInfo, path: Path | str) -> np.ndarray:
    """`array` ([samples, ...]) if it fits input `info`; `path` names the data in the error (a
    file, or `calib <python: ...>` for data given from Python)."""
    where = path if isinstance(path, str) and path.startswith("calib <") else f"--calib {path}"
    if info.shape is not None and array.ndim != len(info.shape):
        raise ConfigError(f"{where}: array for input {name!r} has shape {'x'.join(map(str, array.shape))}, "
                          f"not [samples, ...] of rank {len(info.shape)} like the input "
                          f"({'x'.join(map(str, info.shape))})")
    if info.shape is not None:
        for axis, (have, want) in enumerate(zip(array.shape[1:], info.shape[1:]), start=1):
            if isinstance(want, int) and have != want:
                raise ConfigError(f"{where}: input {name!r} has size {want} on axis {axis}, the samples "
                                  f"{have} (shape {'x'.join(map(str, array.shape))})")
    if str(array.dtype) != info.dtype:
        raise ConfigError(f"{where}: array for input {name!r} is {array.dtype}, the input takes {info.dtype}")
    return array


def _flatten_batches(array: np.ndarray, info: ValueInfo) -> np.ndarray:
    """[B, n, ...] ready-made batches → [B·n, ...] samples (rank + 1 arrays only)."""
    if info.shape is not None and array.ndim == len(info.shape) + 1:
        return array.reshape((-1,) + array.shape[2:])
    return array


def load_input_arrays(path: Path, inputs: list[ValueInfo]) -> dict:
    try:
        loaded = np.load(path, mmap_mode="r", allow_pickle=False) if path.suffix == ".npy" else \
            np.load(path, allow_pickle=False)
    except Exception as exc:  # noqa: BLE001 - numpy raises many kinds on a damaged file
        raise ConfigError(f"--calib {path}: not a readable {path.suffix} file ({type(exc).__name__})") from None
    if isinstance(loaded, np.ndarray):
        info = _one_input(inputs, path)
        return {info.name: checked_input_array(info.name, _flatten_batches(loaded, info), info, path)}
    with loaded:
        keys = list(loaded.files)
        declared = {v.name: v for v in inputs}
        if len(declared) == 1 and len(keys) == 1:
            info = next(iter(declared.values()))
            return {info.name: checked_input_array(info.name, _flatten_batches(loaded[keys[0]], info), info, path)}
        missing = [name for name in declared if name not in keys]
        if missing:
            raise ConfigError(f"--calib {path}: the .npz holds {', '.join(keys) or 'no arrays'}; the model's inputs "
                              f"{', '.join(missing)} are missing")
        arrays = {name: checked_input_array(name, _flatten_batches(loaded[name], info), info, path) for name, info in declared.items()}
    counts = {name: len(a) for name, a in arrays.items()}
    if len(set(counts.values())) > 1:
        raise ConfigError(f"--calib {path}: inputs hold different sample counts ({counts})")
    return arrays


def spread_evenly(samples: list, limit: int) -> list:
    """`limit` samples spread evenly over the dataset (folders are sorted by class: the first N
    would cover only the first classes)."""
    if len(samples) <= limit:
        return list(samples)
    return [samples[(k * len(samples)) // limit] for k in range(limit)]


def split_counts(samples: list, attribute: str) -> dict[str, int]:
    """Attribute value (as `Dataset.splits` spells it) → number of samples."""
    from ..data.datasets import Dataset
    return {value: len(group) for value, group in Dataset(list(samples), [], "classify", "(samples)")
            .splits(attribute).items()}


def split_coverage(calib_counts: dict[str, int], data_counts: dict[str, int], attribute: str,
                   data: str) -> list[str]:
    """Warnings (one line each) for the splits of the validation set that the calibration sample
    misses or holds under COVERAGE_SHARE of their fair share (its size / the number of splits)."""
    total = sum(calib_counts.values())
    fair = total / max(1, len(data_counts))
    warnings = []
    for value, images in data_counts.items():
        have = calib_counts.get(value, 0)
        if have == 0:
            warnings.append(f"warning: the calibration sample ({total} images) holds no {attribute}={value} image, "
                            f"a split of --data {data} ({images} images): the INT8 thresholds never saw it "
                            f"(calibrate on a set that has such images, with --calib-balance-by {attribute})")
        elif have < COVERAGE_SHARE * fair:
            warnings.append(f"warning: the calibration sample holds {have} {attribute}={value} image(s) of {total}, "
                            f"under {COVERAGE_SHARE:.0%} of a fair share ({fair:.0f}) for that split of --data "
                            f"{data} (--calib-balance-by {attribute} to draw equally)")
    return warnings


def _dataset_set(path: Path, inputs: list[ValueInfo], limit: int, batch_size: int, preprocess,
                 balance_by: str | None = None, seed: int = 0) -> CalibrationSet:
    try:
        from ..data import balanced_sample, iterate_batches, open_dataset
    except ImportError:
        raise ConfigError(f"--calib {path}: image datasets need sartor.data, which this build lacks; give a "
                          f".npy/.npz of preprocessed input samples") from None
    if len(inputs) != 1:
        raise ConfigError(f"--calib {path}: image datasets feed one-input models; give a .npz with one array per "
                          f"input ({', '.join(v.name for v in inputs)})")
    if preprocess is None:
        raise ConfigError(f"--calib {path} is an image dataset: give --preprocess to say how images become the "
                          f"input (or a .npy/.npz of preprocessed samples)")
    info = inputs[0]
    dataset = open_dataset(path)
    if balance_by is None:
        samples = spread_evenly(list(dataset.samples), limit)
    else:
        if balance_by not in dataset.attributes():
            raise ConfigError(f"--calib-balance-by {balance_by}: no image of --calib {path} has that attribute "
                              f"(attributes: {', '.join(dataset.attributes()) or 'none'})")
        samples = balanced_sample(dataset, balance_by, limit, seed)

    def batches():
        for array, _, _ in iterate_batches(samples, preprocess, batch_size):
            yield {info.name: checked_input_array(info.name, array, info, path)}
    return CalibrationSet(str(path), batches, len(samples), samples, balance_by)


def open_calibration(path: str | Path, inputs: list[ValueInfo], limit: int, batch_size: int,
                     preprocess=None, balance_by: str | None = None, seed: int = 0) -> CalibrationSet:
    """The calibration batches of `path`; `balance_by` (image datasets only) draws `limit` images
    equally from each value of that attribute, deterministically for `seed`."""
    path = Path(path)
    batch_size = max(1, batch_size)
    if not path.exists():
        raise ConfigError(f"--calib {path}: not found")
    if not (path.is_file() and path.suffix in ARRAY_SUFFIXES):
        return _dataset_set(path, inputs, limit, batch_size, preprocess, balance_by, seed)
    if balance_by is not None:
        raise ConfigError(f"--calib-balance-by {balance_by}: --calib {path} is a {path.suffix} of samples without "
                          f"attributes; give an image dataset (COCO, ImageFolder or a manifest)")
    arrays = load_input_arrays(path, inputs)
    available = min(len(a) for a in arrays.values())
    if available == 0:
        raise ConfigError(f"--calib {path}: holds no samples")
    return CalibrationSet(str(path), array_batches(arrays, limit, batch_size), min(available, limit))
