"""Calibration samples given from Python (`sartor.build(calib=...)`), checked as `--calib` files are.

What is accepted:
- a numpy array or a torch tensor of preprocessed samples, [N, ...] like the model's input (as a
  `.npy`), or a dict {input name: array or tensor} (as a `.npz`);
- a list, tuple or other iterable whose items are each one of: an array/tensor of one sample
  (the input's shape without the batch axis) or of several ([n, ...]); a PIL image; an image path.
  Images are read and preprocessed with the build's `preprocess`, and need it. Iterables are read
  once, when the build starts (a generator is consumed then).

The first `calib_size` samples are used, in order (as for a `.npy`); the samples after them are
the held-out samples of `--min-cosine`/`--min-snr` when no `data` is given.
"""
from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator

import numpy as np
import torch

from ..errors import ConfigError
from ..ir import ValueInfo
from .data import CalibrationSet, array_batches, checked_input_array

# One sample as a thunk: () -> array without the batch axis (images are only read when batched).
SampleThunk = Callable[[], np.ndarray]


def _as_array(value) -> np.ndarray:
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().numpy()
    return np.asarray(value)


def _is_image(item) -> bool:
    from PIL import Image
    return isinstance(item, Image.Image)


class PythonSamples:
    """Calibration data from Python, normalised: either `arrays` ({input name or None: [N, ...]})
    or `items` (a list of arrays, PIL images and paths). `label` describes it in logs and the
    engine's build configuration, which cannot hold the data itself."""

    def __init__(self, data) -> None:
        self.arrays: dict | None = None
        self.items: list | None = None
        if isinstance(data, (np.ndarray, torch.Tensor)):
            self.arrays = {None: _as_array(data)}
            array = self.arrays[None]
            self.label = f"<python: {type(data).__name__} {'x'.join(map(str, array.shape))} {array.dtype}>"
        elif isinstance(data, dict):
            self.arrays = {str(name): _as_array(value) for name, value in data.items()}
            self.label = f"<python: dict of {len(self.arrays)} array(s): {', '.join(self.arrays)}>"
        elif isinstance(data, (str, bytes, os.PathLike)) or _is_image(data):
            raise ConfigError(f"calib: give a path as a str (a file or folder), or a list of samples; got one "
                              f"{type(data).__name__}" + ("" if not _is_image(data) else " (wrap one image in a list)"))
        elif isinstance(data, Iterable):
            self.items = list(data)
            kinds = sorted({_kind(item) for item in self.items})
            self.label = f"<python: {len(self.items)} {'/'.join(kinds) or 'item'}(s)>"
        else:
            raise ConfigError(f"calib: a {type(data).__name__} is not calibration data: give a path, an array or "
                              f"tensor of samples, a dict of arrays by input name, or a list of arrays, PIL images "
                              f"or image paths")

    def sample_thunks(self, inputs: list[ValueInfo], preprocess) -> list[SampleThunk]:
        """Each sample of `items` as a thunk, checked against the (one) model input as far as it can
        be without reading images; images need `preprocess`."""
        if len(inputs) != 1:
            raise ConfigError(f"calib {self.label}: a list of samples feeds one-input models; this one has "
                              f"{len(inputs)} ({', '.join(v.name for v in inputs)}): give a dict of arrays by input name")
        info = inputs[0]
        thunks: list[SampleThunk] = []
        for index, item in enumerate(self.items or []):
            kind = _kind(item)
            if kind == "array":
                array = _as_array(item)
                rank = len(info.shape) if info.shape is not None else array.ndim + 1
                if array.ndim == rank - 1:
                    array = array[None]
                where = f"{self.label} item {index}"
                checked = checked_input_array(info.name, array, info, f"calib {where}")
                thunks.extend((lambda a=a: a) for a in checked)
            elif kind in ("image", "path"):
                if preprocess is None:
                    raise ConfigError(f"calib {self.label}: item {index} is an image: give preprocess= to say how "
                                      f"images become the input (or give arrays of preprocessed samples)")
                thunks.append(_image_thunk(item, preprocess))
            else:
                raise ConfigError(f"calib {self.label}: item {index} is a {type(item).__name__}, not an array, a "
                                  f"tensor, a PIL image or an image path")
        return thunks


def _kind(item) -> str:
    if isinstance(item, (np.ndarray, torch.Tensor)):
        return "array"
    if isinstance(item, (str, os.PathLike)):
        return "path"
    if _is_image(item):
        return "image"
    return type(item).__name__


def _image_thunk(item, preprocess) -> SampleThunk:
    from ..data.preprocess import load_image, preprocess_image

    def read() -> np.ndarray:
        if isinstance(item, (str, os.PathLike)):
            return preprocess_image(load_image(item), preprocess, path=str(item))[0]
        return preprocess_image(item, preprocess)[0]
    return read


def python_arrays(samples: PythonSamples, inputs: list[ValueInfo]) -> dict:
    """`samples.arrays` by the model's input names, checked as a .npy/.npz is."""
    where = samples.label
    arrays = samples.arrays or {}
    if None in arrays:
        if len(inputs) != 1:
            raise ConfigError(f"calib {where}: one array feeds one input, but the model has {len(inputs)} "
                              f"({', '.join(v.name for v in inputs)}): give a dict of arrays by input name")
        arrays = {inputs[0].name: arrays[None]}
    declared = {v.name: v for v in inputs}
    missing = [name for name in declared if name not in arrays]
    if missing:
        raise ConfigError(f"calib {where}: the model's inputs {', '.join(missing)} are missing")
    checked = {name: checked_input_array(name, arrays[name], info, f"calib {where}")
               for name, info in declared.items()}
    counts = {name: len(a) for name, a in checked.items()}
    if len(set(counts.values())) > 1:
        raise ConfigError(f"calib {where}: inputs hold different sample counts ({counts})")
    return checked


def open_python_calibration(samples: PythonSamples, inputs: list[ValueInfo], limit: int, batch_size: int,
                            preprocess=None, start: int = 0) -> CalibrationSet:
    """Samples [start, start + limit) of `samples` as calibration batches."""
    batch_size = max(1, batch_size)
    if samples.arrays is not None:
        arrays = python_arrays(samples, inputs)
        available = min(len(a) for a in arrays.values())
        if available == 0:
            raise ConfigError(f"calib {samples.label}: holds no samples")
        start = min(start, available)
        stop = min(available, start + limit)
        return CalibrationSet(samples.label, array_batches({k: a[start:stop] for k, a in arrays.items()},
                                                           stop - start, batch_size), stop - start)
    thunks = samples.sample_thunks(inputs, preprocess)
    if not thunks:
        raise ConfigError(f"calib {samples.label}: holds no samples")
    chosen = thunks[min(start, len(thunks)):start + limit]
    info = inputs[0]

    def batches() -> Iterator[dict]:
        for first in range(0, len(chosen), batch_size):
            arrays = [read() for read in chosen[first:first + batch_size]]
            shapes = {a.shape for a in arrays}
            if len(shapes) > 1:
                raise ConfigError(f"calib {samples.label}: samples of different shapes "
                                  f"({', '.join('x'.join(map(str, s)) for s in sorted(shapes))}) cannot share a "
                                  f"batch: use preprocess with letterbox= or resize=")
            batch = checked_input_array(info.name, np.stack(arrays), info, f"calib {samples.label}")
            yield {info.name: batch}
    return CalibrationSet(samples.label, batches, len(chosen))


def sample_count(samples: PythonSamples, inputs: list[ValueInfo], preprocess=None) -> int:
    if samples.arrays is not None:
        return min(len(a) for a in python_arrays(samples, inputs).values())
    return len(samples.sample_thunks(inputs, preprocess))
