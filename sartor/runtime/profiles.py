"""Optimization profiles: per dynamic input a min/opt/max shape. Kernels are chosen at opt; a
run whose shapes fall outside the profile is refused at the gate, never padded or rebuilt."""
from __future__ import annotations

from dataclasses import dataclass

from ..errors import ProfileError


@dataclass(frozen=True)
class ShapeRange:
    min: tuple
    opt: tuple
    max: tuple

    def admits(self, shape: tuple) -> bool:
        return len(shape) == len(self.min) and all(lo <= d <= hi for d, lo, hi in zip(shape, self.min, self.max))

    def describe(self) -> str:
        fmt = lambda s: "x".join(str(d) for d in s)  # noqa: E731
        if self.min == self.max:
            return fmt(self.min)
        return f"{fmt(self.min)}..{fmt(self.max)} (opt {fmt(self.opt)})"


@dataclass(frozen=True)
class Profile:
    shapes: dict  # input name -> ShapeRange

    def admits(self, shapes: dict) -> bool:
        return all(self.shapes[name].admits(tuple(shape)) for name, shape in shapes.items() if name in self.shapes)

    def opt_shapes(self) -> dict:
        return {name: r.opt for name, r in self.shapes.items()}

    def max_shapes(self) -> dict:
        return {name: r.max for name, r in self.shapes.items()}

    def describe(self) -> str:
        return ", ".join(f"{name} {r.describe()}" for name, r in self.shapes.items())

    def to_json(self) -> dict:
        return {name: {"min": list(r.min), "opt": list(r.opt), "max": list(r.max)} for name, r in self.shapes.items()}

    @staticmethod
    def from_json(data: dict) -> "Profile":
        return Profile({name: ShapeRange(tuple(r["min"]), tuple(r["opt"]), tuple(r["max"])) for name, r in data.items()})


def parse_shape_spec(text: str) -> dict[str, tuple]:
    """`images:1x3x320x320,mask:1x1` → {"images": (1, 3, 320, 320), "mask": (1, 1)} (trtexec syntax)."""
    shapes: dict[str, tuple] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, sep, dims = item.rpartition(":")
        if not sep or not name:
            raise ProfileError(f"shape {item!r} must look like NAME:1x3x224x224")
        try:
            shape = tuple(int(d) for d in dims.lower().split("x"))
        except ValueError:
            raise ProfileError(f"shape {item!r} must look like NAME:1x3x224x224") from None
        if any(d < 0 for d in shape):
            raise ProfileError(f"shape {item!r} has a negative dimension")
        shapes[name] = shape
    return shapes


def _compatible(declared: tuple | None, shape: tuple) -> bool:
    if declared is None:
        return True
    return len(declared) == len(shape) and all(not isinstance(d, int) or d == s for d, s in zip(declared, shape))


def make_profile(declared: dict[str, tuple | None], min_shapes: dict, opt_shapes: dict, max_shapes: dict) -> Profile:
    """Combine user shapes with the model's declared input shapes into one checked profile.

    Inputs the user leaves out must be static in the model; a user may give just one of
    min/opt/max and the others default to it (a fixed-shape profile).
    """
    for given in (min_shapes, opt_shapes, max_shapes):
        unknown = sorted(set(given) - set(declared))
        if unknown:
            raise ProfileError(f"shape given for unknown input(s) {', '.join(unknown)}; model inputs: "
                               f"{', '.join(declared)}")
    ranges = {}
    for name, shape in declared.items():
        given = [s.get(name) for s in (min_shapes, opt_shapes, max_shapes)]
        if all(g is None for g in given):
            if shape is None or not all(isinstance(d, int) for d in shape):
                dims = "x".join(str(d) for d in shape) if shape else "unknown rank"
                raise ProfileError(f"input {name!r} has dynamic shape {dims}: give --min-shapes/--opt-shapes/"
                                   f"--max-shapes for it")
            ranges[name] = ShapeRange(tuple(shape), tuple(shape), tuple(shape))
            continue
        anchor = next(g for g in (given[1], given[0], given[2]) if g is not None)
        lo, opt, hi = (g if g is not None else anchor for g in given)
        if not (len(lo) == len(opt) == len(hi)):
            raise ProfileError(f"input {name!r}: min/opt/max shapes have different ranks")
        for label, s, g in zip(("min", "opt", "max"), (lo, opt, hi), given):
            if g is not None and not _compatible(shape, s):  # name the flag the user gave
                dims = "x".join(str(d) for d in shape)
                raise ProfileError(f"input {name!r}: {label} shape {'x'.join(map(str, s))} does not fit the model's "
                                   f"declared shape {dims}")
        if not all(a <= b <= c for a, b, c in zip(lo, opt, hi)):
            raise ProfileError(f"input {name!r}: opt shape {'x'.join(map(str, opt))} is not within min "
                               f"{'x'.join(map(str, lo))} and max {'x'.join(map(str, hi))}")
        ranges[name] = ShapeRange(tuple(lo), tuple(opt), tuple(hi))
    return Profile(ranges)
