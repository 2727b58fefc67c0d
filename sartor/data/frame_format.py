"""What an engine built with `--input-format uint8:HxW[:rgb|bgr]` takes: raw uint8 frames,
N×H×W×3 (as decoders and camera SDKs give them), of one declared size and channel order. The
engine's first layer applies its stored `--preprocess` to them."""
from __future__ import annotations

from dataclasses import dataclass

from ..errors import ConfigError

FRAME_INPUT_SYNTAX = "uint8:HxW or uint8:HxW:bgr (e.g. uint8:720x1280)"
FRAME_ORDERS = ("rgb", "bgr")


@dataclass(frozen=True)
class FrameFormat:
    size: tuple[int, int]  # (H, W) of every frame
    order: str = "rgb"  # the frames' channel order
    name: str = "frames"  # the engine's input

    def shape(self, batch: int) -> tuple[int, int, int, int]:
        return (batch, *self.size, 3)

    def describe(self) -> str:
        return f"uint8:{self.size[0]}x{self.size[1]}" + (":bgr" if self.order == "bgr" else "")

    def to_json(self) -> dict:
        return {"kind": "uint8", "name": self.name, "size": list(self.size), "order": self.order,
                "layout": "nhwc", "text": self.describe()}

    @staticmethod
    def from_json(record: dict) -> FrameFormat:
        try:
            size = tuple(int(d) for d in record["size"])
            if len(size) != 2 or record["order"] not in FRAME_ORDERS:
                raise ValueError("size is not (H, W) or the order is unknown")
            return FrameFormat(size, record["order"], str(record["name"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError(f"input format record {record!r} is malformed: {exc}") from None


def parse_frame_format(text: str) -> FrameFormat:
    """`uint8:720x1280[:bgr]` → FrameFormat; anything else is a ConfigError naming the syntax."""
    parts = text.strip().lower().split(":") if isinstance(text, str) else []
    if len(parts) not in (2, 3) or parts[0] != "uint8":
        raise ConfigError(f"--input-format {text!r} is not understood: expected {FRAME_INPUT_SYNTAX}")
    dims = parts[1].split("x")
    if len(dims) != 2 or not all(d.isdigit() and int(d) > 0 for d in dims):
        raise ConfigError(f"--input-format {text!r}: the frame size must be HxW with positive integers "
                          f"(e.g. uint8:720x1280)")
    order = parts[2] if len(parts) == 3 else "rgb"
    if order not in FRAME_ORDERS:
        raise ConfigError(f"--input-format {text!r}: channel order {order!r} is not one of {', '.join(FRAME_ORDERS)}")
    return FrameFormat((int(dims[0]), int(dims[1])), order)
