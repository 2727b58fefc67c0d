"""What several subcommands share: consoles, `--input NAME=FILE.npy`, the calibration flags,
formatting, npz output."""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table
from rich.text import Text

from ..errors import InputError
from ..ir.dtypes import QUANTIZED_PRECISIONS

# Columns when the output is not a terminal (logs, pipes, tests): wide enough that no cell is ever
# cut or wrapped (a layer name with "…" in it cannot be searched for); rich sizes tables to their content.
UNLIMITED = 100_000


def on_terminal() -> bool:
    return sys.stdout.isatty()


class _TrimmedLines:
    """A text stream that drops the spaces rich pads table rows with up to their width (in logs they
    are noise that diff and grep see)."""

    def __init__(self, stream) -> None:
        self.stream = stream
        self._partial = ""

    def write(self, data: str) -> int:
        lines = (self._partial + data).split("\n")
        self._partial = lines.pop()
        if lines:
            self.stream.write("".join(line.rstrip(" ") + "\n" for line in lines))
        return len(data)

    def flush(self) -> None:
        if self._partial:
            self.stream.write(self._partial)
            self._partial = ""
        self.stream.flush()

    def isatty(self) -> bool:
        return False


def console(stderr: bool = False) -> Console:
    stream = sys.stderr if stderr else sys.stdout
    if stream.isatty():
        return Console(file=stream, highlight=False)
    return Console(file=_TrimmedLines(stream), width=UNLIMITED, highlight=False)


def text(value) -> Text:
    """Cell text taken literally (layer names may hold `[...]`, which rich would read as markup)."""
    return Text("-" if value is None or value == "" else str(value))


def _plain_if_piped(kwargs: dict) -> dict:
    """Plain text tables (columns apart by spaces, no box-drawing characters) when stdout is not a
    terminal, so logs stay greppable and ASCII."""
    if on_terminal():
        return kwargs
    return {"box": None, "show_edge": False, "pad_edge": False, **kwargs}


def table(title: str | None, *columns: str, **kwargs) -> Table:
    t = Table(title=title, title_justify="left", **_plain_if_piped(kwargs))
    for column in columns:
        t.add_column(column)
    return t


def key_values(title: str | None, rows: list[tuple[str, object]]) -> Table:
    t = Table(title=title, title_justify="left", show_header=False, **_plain_if_piped({}))
    t.add_column(style="bold")
    t.add_column()
    for key, value in rows:
        t.add_row(key, text(value))
    return t


def add_calibration_args(parser: argparse.ArgumentParser, calib_size: int, required: bool, cache_help: str,
                         methods: tuple | None = None, default_method: str | None = None) -> None:
    """The INT8 calibration flags `sartor build` and `sartor sensitivity` share (--calib, --calib-size,
    --calib-method, --percentile, --calib-balance-by, --calib-cache); `methods` and `default_method`
    (the single methods and mse unless given) are what --calib-method offers."""
    from ..builder.config import BuildConfig
    from ..quant.calibrators import DEFAULT_METHOD, METHODS
    methods, default_method = methods or METHODS, default_method or DEFAULT_METHOD
    parser.add_argument("--calib", required=required, metavar="DATA",
                        help="INT8 calibration data: .npy/.npz of preprocessed input samples, or images read with "
                             "--preprocess: a plain folder of images, an ImageFolder, a COCO .json (or a folder "
                             "holding one), a .jsonl/.csv manifest")
    parser.add_argument("--calib-size", type=int, default=calib_size, metavar="N",
                        help=f"calibration samples to use (default {calib_size})")
    parser.add_argument("--calib-method", type=str.lower, choices=methods, default=None,
                        help=f"INT8 threshold method (default {default_method}"
                             + ("; auto: per tensor, by output error on held-out calibration samples)"
                                if default_method == "auto" else ")"))
    parser.add_argument("--percentile", type=float, default=BuildConfig.percentile, metavar="P",
                        help=f"percentile of |x| for --calib-method percentile (default {BuildConfig.percentile})")
    parser.add_argument("--calib-balance-by", metavar="ATTRIBUTE",
                        help="image datasets: draw the calibration images equally from each value of this attribute")
    parser.add_argument("--calib-cache", metavar="FILE", help=cache_help)


def describe_precision(header: dict) -> str:
    """The build precision; for INT8 (FP8), what the other layers run at and who chose it. `header`
    is an engine header, or `sartor inspect`'s summary (the same keys)."""
    config = header.get("build_config") or {}
    fallback = header.get("int8_fallback_precision")
    precision = config.get("precision")
    if precision not in QUANTIZED_PRECISIONS or fallback is None:
        return str(precision)
    chosen = ("--int8-fallback-precision" if config.get("int8_fallback_precision")
              else f"the {header.get('device', 'device')} default")
    return f"{precision}; layers outside {precision.upper()} run {fallback} ({chosen})"


def fmt_shape(shape) -> str:
    if shape is None:
        return "?"
    return "x".join(str(d) for d in shape) if len(shape) else "scalar"


def fmt_bytes(n: int | float) -> str:
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{int(n)} B" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} GiB"


def fmt_float(value: float | None, spec: str = ".3g") -> str:
    if value is None:
        return "-"
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return format(value, spec)


def print_json(data: dict) -> None:
    """JSON on stdout; inf/nan become strings so that the output stays strict JSON."""
    def clean(v):
        if isinstance(v, float) and not math.isfinite(v):
            return str(v)
        if isinstance(v, dict):
            return {str(k): clean(x) for k, x in v.items()}
        if isinstance(v, (list, tuple)):
            return [clean(x) for x in v]
        return v
    sys.stdout.write(json.dumps(clean(data), indent=2, sort_keys=False, default=str) + "\n")


def _load_array(name: str, path: Path) -> np.ndarray:
    if not path.is_file():
        raise InputError(f"--input {name}={path}: file not found")
    try:
        loaded = np.load(path, allow_pickle=False)
    except Exception as exc:
        raise InputError(f"--input {name}={path}: not a .npy/.npz array file ({type(exc).__name__})") from None
    if isinstance(loaded, np.lib.npyio.NpzFile):
        with loaded:
            keys = list(loaded.files)
            key = name if name in keys else (keys[0] if len(keys) == 1 else None)
            if key is None:
                raise InputError(f"--input {name}={path}: the .npz holds {', '.join(keys) or 'no arrays'}, "
                                 f"not {name!r}")
            return loaded[key]
    return loaded


def parse_inputs(items: list[str] | None, input_names: list[str]) -> dict[str, np.ndarray]:
    """`--input NAME=FILE.npy` (repeatable; a bare FILE.npy when the engine has one input)."""
    feeds: dict[str, np.ndarray] = {}
    for item in items or []:
        name, sep, file = item.partition("=")
        if not sep:
            if len(input_names) != 1:
                raise InputError(f"--input {item!r} must look like NAME=FILE.npy (the engine's inputs are "
                                 f"{', '.join(input_names)})")
            name, file = input_names[0], item
        if not name or not file:
            raise InputError(f"--input {item!r} must look like NAME=FILE.npy")
        if name in feeds:
            raise InputError(f"--input {name} is given twice")
        feeds[name] = _load_array(name, Path(file))
    return feeds




def add_trust_arg(parser: argparse.ArgumentParser) -> None:
    """`--trust KEYS`, for every subcommand that loads engines (sartor.load's `trust`)."""
    parser.add_argument("--trust", metavar="KEYS",
                        help="load only engines signed by one of these keys: a directory of .pub files or one .pub "
                             "file (default: $SARTOR_TRUST; when neither is set, any engine whose checksum holds)")
