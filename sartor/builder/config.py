"""BuildConfig: every option of one build, in one place, with its defaults."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..errors import ConfigError

PRECISIONS = ("fp32", "tf32", "fp16", "bf16")
FP16_MAX = 65504.0


@dataclass
class BuildConfig:
    model_path: str
    output_path: str
    device: str | None = None  # None: cuda when available, else cpu
    precision: str = "fp32"
    # One entry per profile: {"min": {name: shape}, "opt": {...}, "max": {...}}
    profiles: list = field(default_factory=list)
    layer_precision: dict = field(default_factory=dict)  # ONNX node name (glob) -> precision
    op_precision: dict = field(default_factory=dict)  # ONNX op type -> precision
    overflow_guard: bool = True
    overflow_threshold: float = FP16_MAX
    guard_samples: int = 2  # random batches at the opt shape used by the FP16 overflow guard
    seed: int = 0

    def validate(self) -> None:
        if Path(self.output_path).resolve() == Path(self.model_path).resolve():
            raise ConfigError(f"output {self.output_path} is the model file itself: choose another output path")
        if self.precision not in PRECISIONS:
            raise ConfigError(f"precision {self.precision!r} is not one of {', '.join(PRECISIONS)}")
        for kind, table in (("layer", self.layer_precision), ("op", self.op_precision)):
            for key, value in table.items():
                if value not in PRECISIONS:
                    raise ConfigError(f"--{kind}-precision {key}={value}: precision must be one of {', '.join(PRECISIONS)}")

    def to_json(self) -> dict:
        return asdict(self)


def parse_precision_overrides(items: list[str] | None, flag: str) -> dict:
    table = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep or not key or not value:
            raise ConfigError(f"{flag} {item!r} must look like NAME=fp32")
        table[key.strip()] = value.strip().lower()
    return table
