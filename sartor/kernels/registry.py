"""Tactics by name: one naming scheme for every kernel family, and the registry of the families.

A tactic's name is its family's word, then its fields, dot-separated, in the order the family
declares them: `igemm.128x128x64.w8.s3.halves.residual-early`, `resident.64x64.t8.w4.s2.cols-loaded.grouped`.
A family is a frozen dataclass deriving `Tactic` with a `SCHEME` of field spellings (`Dims`,
`Number`, `Flag`, `Choice`, `Inline`): the name and its parser both come from that one declaration.
Optional fields at their default are left out of the name, so each tactic has one spelling.

Each family registers itself in its own module (`@register`); FAMILY_MODULES lists those modules,
imported on the first lookup, so that a name parses whoever asks first. This module sits in
`kernels/` and imports nothing of sartor but `errors`: the kernels, the ops, the builder, the
executor and `inspect` all read it (`sartor.tactics` imports the executor, so it cannot hold it).
"""
from __future__ import annotations

import functools
import importlib
import re
from dataclasses import dataclass
from typing import Any, Callable, ClassVar

from ..errors import TacticNameError  # noqa: F401 - raised here, imported from here by callers

# The modules that register tactic families; a new family is one module and one line here.
FAMILY_MODULES = (
    "sartor.kernels.conv.igemm",
    "sartor.kernels.gemm.resident",
    "sartor.kernels.conv.tma",
    "sartor.kernels.gemm.tma",
    "sartor.kernels.pool.max_pool",
    "sartor.kernels.conv.depthwise",
    "sartor.kernels.conv.direct_words",
    "sartor.kernels.conv.chain",
    "sartor.ops.conv",
    "sartor.ops.quantized",
    "sartor.ops.quantized_im2col",
    "sartor.ops.quantized_window",
    "sartor.ops.quantized_library",
    "sartor.ops.resize",
    "sartor.ops.detection_head",
    "sartor.kernels.preprocess.letterbox",
    "sartor.ops.nms",
    "sartor.ops.attention",
    "sartor.kernels.norm.add_layernorm",
    "sartor.kernels.attention.short",
)
SEPARATOR = "."

# Weight layouts a tactic reads (the executor stores the weight so once, at load).
AS_GIVEN = "as-given"
PACKED_K_MAJOR = "packed-k-major"  # conv_igemm.pack_weight: [Cout, kh·kw·C] in memory
CHANNELS_LAST = "channels-last"
DEPTHWISE_TAPS = "depthwise-taps"  # depthwise.pack_depthwise_weight: taps outermost
PIXEL_WINDOWS = "pixel-windows"  # quantized_window.window_weight
IM2COL_ROWS = "im2col-rows"  # [Cout, kh·kw·C] rows, K zero-padded for the GEMM tile
TAP_WORDS = "tap-words"  # direct_stem.tap_words: int32 words of four taps' codes, [words, Cout]
ROW_WORDS = "row-words"  # direct_stem.row_words: int32 words of a filter row's codes, [C·KH, Cout]


@dataclass(frozen=True)
class LayerFacts:
    """What a tactic's description depends on besides the tactic: the layer's op, whether it runs
    FP8 codes, whether it carries a projection, and the device type ("cuda", "cpu")."""
    op_type: str
    fp8: bool = False
    projected: bool = False
    device_type: str = "cuda"

    @property
    def codes(self) -> str:
        """The layer's 8-bit format, as the descriptions say it."""
        return "fp8" if self.fp8 else "int8"

    @property
    def library(self) -> str:
        return {"cuda": "cudnn/cublas", "cpu": "onednn/mkl"}.get(self.device_type, self.device_type)


# Field spellings. Each consumes at most one token (Inline: the nested family's tokens).
@dataclass(frozen=True)
class Dims:
    """Integer fields joined by "x": "128x128x64"."""
    names: tuple

    def format(self, values: dict) -> list[str]:
        return ["x".join(str(values[name]) for name in self.names)]

    def read(self, token: str | None) -> dict | None:
        parts = (token or "").split("x")
        if len(parts) != len(self.names) or not all(part.isdigit() for part in parts):
            return None
        return dict(zip(self.names, map(int, parts)))


@dataclass(frozen=True)
class Number:
    """An integer field after a word: "w8". Left out of the name at `omit` (then optional)."""
    name: str
    prefix: str
    omit: int | None = None

    def format(self, values: dict) -> list[str]:
        value = values[self.name]
        return [] if value == self.omit else [f"{self.prefix}{value}"]

    def read(self, token: str | None) -> dict | None:
        match = re.fullmatch(re.escape(self.prefix) + r"(\d+)", token or "")
        if match:
            return {self.name: int(match.group(1))}
        return None if self.omit is None else {self.name: self.omit, "_skip": True}


@dataclass(frozen=True)
class Flag:
    """A bool field, named by its word where true."""
    name: str
    word: str

    def format(self, values: dict) -> list[str]:
        return [self.word] if values[self.name] else []

    def read(self, token: str | None) -> dict:
        return {self.name: True} if token == self.word else {self.name: False, "_skip": True}


@dataclass(frozen=True)
class Choice:
    """An integer field naming one of several modes by a word; the mode whose word is "" is left out."""
    name: str
    words: dict

    def format(self, values: dict) -> list[str]:
        word = self.words[values[self.name]]
        return [word] if word else []

    def read(self, token: str | None) -> dict | None:
        for value, word in self.words.items():
            if word and token == word:
                return {self.name: value}
        default = [value for value, word in self.words.items() if not word]
        return {self.name: default[0], "_skip": True} if default else None


@dataclass(frozen=True)
class Inline:
    """A field holding another family's tactic, its fields spelled in place (without its word)."""
    name: str
    kind: type


class Tactic:
    """A way to run a layer. A family is a frozen dataclass deriving this, with:
    FAMILY, the name's first word ("" for a tile that only appears inline in other families);
    SCHEME, how its fields are spelled; WEIGHT_LAYOUT, the layout of the weight it reads;
    PROGRAMMATIC_LAUNCH, whether it is one of sartor's own kernels with the epilogue fused that
    --pdl launches so; `describe`, the words `inspect` shows; `invalid`, why a parsed combination
    of fields cannot run (None where it can)."""
    FAMILY: ClassVar[str] = ""
    SCHEME: ClassVar[tuple] = ()
    WEIGHT_LAYOUT: ClassVar[str] = AS_GIVEN
    PROGRAMMATIC_LAUNCH: ClassVar[bool] = False
    FUSES_MAX_POOL: ClassVar[bool] = False

    @property
    def name(self) -> str:
        return SEPARATOR.join(([self.FAMILY] if self.FAMILY else []) + self.tokens())

    @property
    def fields_text(self) -> str:
        """The name without the family's word: "128x128x64.w8.s3"."""
        return SEPARATOR.join(self.tokens())

    @property
    def weight_layout(self) -> str:
        return self.WEIGHT_LAYOUT

    @property
    def fuses_max_pool(self) -> bool:
        """Whether the tactic computes the layer's carried max pool in its kernel."""
        return self.FUSES_MAX_POOL

    def tokens(self) -> list[str]:
        values = vars(self)
        out = []
        for spec in self.SCHEME:
            out += values[spec.name].tokens() if isinstance(spec, Inline) else spec.format(values)
        return out

    def invalid(self) -> str | None:
        return None

    def describe(self, layer: LayerFacts) -> str:
        raise NotImplementedError(f"{type(self).__name__} does not describe itself")

    @classmethod
    def read_tokens(cls, tokens: list[str], start: int) -> tuple[Any, int] | None:
        """The tactic spelled by tokens[start:…] and the index after it; None where they do not spell one."""
        values: dict = {}
        at = start
        for spec in cls.SCHEME:
            if isinstance(spec, Inline):
                nested = spec.kind.read_tokens(tokens, at)
                if nested is None:
                    return None
                values[spec.name], at = nested
                continue
            read = spec.read(tokens[at] if at < len(tokens) else None)
            if read is None:
                return None
            at += 0 if read.pop("_skip", False) else 1
            values.update(read)
        try:
            tactic = cls(**values)
        except (TypeError, ValueError):
            return None
        return (tactic, at) if tactic.invalid() is None else None

    @classmethod
    def parse(cls, name: str) -> "Tactic":
        """The tactic of this family that `name` spells; TacticNameError where it spells none."""
        tokens = name.split(SEPARATOR) if isinstance(name, str) else []
        start = 1 if cls.FAMILY else 0
        read = cls.read_tokens(tokens, start) if tokens and (not cls.FAMILY or tokens[0] == cls.FAMILY) else None
        if read is None or read[1] != len(tokens) or read[0].name != name:
            raise TacticNameError(f"tactic {name!r} is not a {cls.FAMILY or cls.__name__} tactic "
                                  f"(fields: {_scheme_text(cls)})")
        return read[0]


def _scheme_text(cls: type) -> str:
    """The fields of a family, as the error messages show them."""
    words = []
    for spec in cls.SCHEME:
        if isinstance(spec, Dims):
            words.append("x".join(spec.names))
        elif isinstance(spec, Number):
            words.append(f"{spec.prefix}<{spec.name}>" + (" (optional)" if spec.omit is not None else ""))
        elif isinstance(spec, Flag):
            words.append(f"[{spec.word}]")
        elif isinstance(spec, Choice):
            words.append("[" + "|".join(w for w in spec.words.values() if w) + "]")
        else:
            words.append(_scheme_text(spec.kind))
    return ".".join(words) or "none"


_FAMILIES: dict[str, type] = {}
_loaded = False


def register(cls: type) -> type:
    """Registers a family under its word; a second family with the same word is a programming error."""
    if not cls.FAMILY:
        raise ValueError(f"{cls.__name__} has no FAMILY word to register under")
    if cls.FAMILY in _FAMILIES and _FAMILIES[cls.FAMILY] is not cls:
        raise ValueError(f"tactic family {cls.FAMILY!r} is registered twice ({_FAMILIES[cls.FAMILY].__name__}, "
                         f"{cls.__name__})")
    _FAMILIES[cls.FAMILY] = cls
    return cls


def _load_families() -> None:
    global _loaded
    if not _loaded:
        _loaded = True
        for module in FAMILY_MODULES:
            importlib.import_module(module)


def families() -> dict[str, type]:
    """Every registered family by its word."""
    _load_families()
    return dict(_FAMILIES)


def parse_tactic(name: str) -> Tactic:
    """The tactic `name` spells; TacticNameError naming the known families where no family does."""
    _load_families()
    return _parse_known(name)


@functools.lru_cache(maxsize=None)
def _parse_known(name: str) -> Tactic:
    """parse_tactic once the families are loaded; tactics are frozen, so one parse serves every run."""
    family = _FAMILIES.get(name.split(SEPARATOR)[0]) if isinstance(name, str) else None
    if family is None:
        raise TacticNameError(f"unknown tactic {name!r}: tactic names start with one of "
                              f"{', '.join(sorted(_FAMILIES))} (an engine or timing cache naming others was made "
                              f"by another sartor: rebuild it)")
    return family.parse(name)


REFERENCE = "torch"


def tactic_for(name: str | None) -> Tactic:
    """A layer's tactic from its `tactic` attribute (None: the reference)."""
    return parse_tactic(name or REFERENCE)


def fixed_tactic(word: str, describe: Callable[[LayerFacts], str] | str, weight_layout: str = AS_GIVEN,
                 programmatic_launch: bool = False) -> type:
    """Registers a family of one tactic without fields, named `word` ("cudnn_fused"); `programmatic_launch`:
    its PROGRAMMATIC_LAUNCH."""
    words = describe if callable(describe) else (lambda layer: describe)
    cls = dataclass(frozen=True)(type(f"Fixed_{word}", (Tactic,), {
        "FAMILY": word, "WEIGHT_LAYOUT": weight_layout, "PROGRAMMATIC_LAUNCH": programmatic_launch,
        "describe": lambda self, layer: words(layer),
        "__module__": __name__}))
    return register(cls)


def _reference_words(layer: LayerFacts) -> str:
    if layer.op_type in ("Conv", "FusedConv", "ConvTranspose"):
        return f"torch.conv ({layer.library})" + (" + torch epilogue" if layer.op_type == "FusedConv" else "")
    if layer.op_type in ("Gemm", "FusedGemm", "MatMul"):
        return f"torch.matmul ({layer.library})"
    if layer.op_type in ("QConv", "QGemm") and layer.fp8:
        return "fp8 e4m3 emulation (exact accumulation in float64)"
    if layer.op_type in ("QConv", "QGemm"):
        return "int8 emulation (exact integer accumulation in float64)"
    return "torch"


Reference = fixed_tactic(REFERENCE, _reference_words)
