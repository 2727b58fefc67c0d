"""Resolution buckets: an engine built with `--preprocess letterbox=320|480|640,...` holds one
profile per size, and the pipeline sends each frame to one of them
(docs/decisions/0037-resolution-buckets.md).

The rule, for an h×w frame:
1. the smallest bucket (by area) that holds the frame whole, i.e. shrinks it by at most 1 (it may
   enlarge it, as a letterbox does);
2. else the bucket that shrinks it least (the largest, when the buckets are squares), if that
   shrink is at most the policy's `max_downscale` (None: any);
3. else the frame is refused, in one line naming its size, the buckets, the shrink and the override.

How much a bucket shrinks a frame (`downscale`): letterbox and resize, max(h/H, w/W), the factor on
the side that fits; a shorter-side resize with a centre crop, min(h, w)/N; none, 1.

A spec of one size is one bucket with its own policy: none unless `max_downscale=` is given, so an
engine built before buckets (or without them) letterboxes any frame, as it did. Several sizes
default to max_downscale=1: a frame above the largest bucket is refused, never shrunk, unless the
build or the caller allows it."""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

from ..errors import ConfigError, DataError
from .preprocess import BUCKET_SEPARATOR, PreprocessSpec, format_number, parse_preprocess

BUCKETS_DEFAULT_MAX_DOWNSCALE = 1.0  # several sizes: a frame is never shrunk unless the policy says so
_SLACK = 1e-9  # a frame of exactly the bucket's size (or the policy's factor) fits


class BucketRefused(DataError):
    """A frame that no bucket holds within the policy: refused, not shrunk."""


def downscale(spec: PreprocessSpec, h: int, w: int) -> float:
    """How much `spec` shrinks an h×w frame (> 1: shrunk; ≤ 1: kept or enlarged)."""
    if spec.resize in ("letterbox", "resize"):
        return max(h / spec.height, w / spec.width)
    if spec.resize == "crop":
        return min(h, w) / spec.shorter_side
    return 1.0


@dataclass(frozen=True)
class Buckets:
    """The specs of an engine's buckets, smallest first; they share every setting but the size,
    and the policy (each spec's `max_downscale`)."""
    specs: tuple

    def __post_init__(self) -> None:
        specs = tuple(self.specs)
        if not specs:
            raise ConfigError("resolution buckets need at least one preprocess spec")
        object.__setattr__(self, "specs", tuple(sorted(specs, key=lambda s: (s.height * s.width, s.size))))

    def __len__(self) -> int:
        return len(self.specs)

    @property
    def largest(self) -> PreprocessSpec:
        return self.specs[-1]

    @property
    def max_downscale(self) -> float | None:
        return self.specs[0].max_downscale

    def with_max_downscale(self, factor: float | None) -> Buckets:
        """The same buckets under another policy (None: any shrink)."""
        return Buckets(tuple(replace(s, max_downscale=factor) for s in self.specs))

    def sizes(self) -> str:
        """'320x320, 480x480, 640x640'."""
        return ", ".join(f"{s.height}x{s.width}" for s in self.specs)

    def describe(self) -> str:
        """The --preprocess text: `letterbox=320|480|640,...` (max_downscale written when it is not
        the default of its kind), or the one spec's own text."""
        if len(self.specs) == 1:
            return self.specs[0].describe()
        text = self.largest.describe(sizes=BUCKET_SEPARATOR.join(s.size_text() for s in self.specs), policy=False)
        factor = self.max_downscale
        if factor is None:
            return f"{text},max_downscale=any"
        return text if factor == BUCKETS_DEFAULT_MAX_DOWNSCALE else f"{text},max_downscale={format_number(factor)}"

    def policy_text(self) -> str:
        factor = self.max_downscale
        if factor is None:
            return "any shrink"
        return "never shrink" if factor == 1 else f"shrink at most {format_number(factor)}x"

    # ---- routing -----------------------------------------------------------------------------------
    def route(self, h: int, w: int) -> int:
        """The index of the bucket an h×w frame goes to; BucketRefused when none may take it."""
        factors = [downscale(s, h, w) for s in self.specs]
        for k, factor in enumerate(factors):
            if factor <= 1 + _SLACK:
                return k
        best = min(range(len(factors)), key=lambda k: (factors[k], k))
        limit = self.max_downscale
        if limit is None or factors[best] <= limit * (1 + _SLACK):
            return best
        raise BucketRefused(self._refusal(h, w, best, factors[best]))

    def spec_for(self, h: int, w: int) -> PreprocessSpec:
        return self.specs[self.route(h, w)]

    def _refusal(self, h: int, w: int, best: int, factor: float) -> str:
        spec = self.specs[best]
        allow = format_number(math.ceil(factor * 100 - 1e-6) / 100)
        return (f"a {h}x{w} frame fits no bucket ({spec.resize} {self.sizes()}): {spec.height}x{spec.width} would "
                f"shrink it {factor:.3g}x, over max_downscale {format_number(self.max_downscale)}; refused, not shrunk "
                f"(allow it with max_downscale={allow} or --max-downscale {allow}, or build a bucket that holds it)")


def parse_buckets(text: str) -> Buckets:
    """`letterbox=320|480|640,mean=0,std=255` → Buckets of three specs; a spec of one size → one
    bucket. Sizes go in the letterbox= or resize=HxW token; the other tokens apply to every size."""
    if not isinstance(text, str) or BUCKET_SEPARATOR not in text:
        return Buckets((parse_preprocess(text),))
    tokens = [t.strip() for t in text.split(",")]
    keys = [t.partition("=")[0].strip().lower() for t in tokens]
    listed = [k for k, t in enumerate(tokens) if BUCKET_SEPARATOR in t]
    if len(listed) > 1 or keys[listed[0]] not in ("letterbox", "resize") or "crop" in keys:
        raise ConfigError(f"preprocess spec {text!r}: resolution buckets are sizes in one letterbox= or resize=HxW "
                          f"token (e.g. letterbox=320|480|640), not with crop=")
    index = listed[0]
    key, _, sizes = tokens[index].partition("=")
    if any(not size.strip() for size in sizes.split(BUCKET_SEPARATOR)):
        raise ConfigError(f"preprocess token {tokens[index]!r} has an empty size: separate sizes by one "
                          f"'{BUCKET_SEPARATOR}' (e.g. letterbox=320|480|640)")
    specs = []
    for size in sizes.split(BUCKET_SEPARATOR):
        one = tokens[:index] + [f"{key.strip()}={size.strip()}"] + tokens[index + 1:]
        specs.append(parse_preprocess(",".join(one)))
    seen: dict[tuple, str] = {}
    for spec, size in zip(specs, sizes.split(BUCKET_SEPARATOR)):
        if spec.size in seen:
            raise ConfigError(f"preprocess spec {text!r} names the size {spec.height}x{spec.width} twice "
                              f"({seen[spec.size]!r} and {size.strip()!r})")
        seen[spec.size] = size.strip()
    if "max_downscale" not in keys:
        specs = [replace(s, max_downscale=BUCKETS_DEFAULT_MAX_DOWNSCALE) for s in specs]
    return Buckets(tuple(specs))


def buckets_from_header(header: dict) -> Buckets | None:
    """An engine's buckets: `preprocess_buckets` (several sizes), else its one `preprocess` spec
    (engines from before buckets, and those built with one size); None without preprocessing."""
    records = header.get("preprocess_buckets")
    if records:
        return Buckets(tuple(PreprocessSpec.from_json(r) for r in records))
    record = header.get("preprocess")
    return Buckets((PreprocessSpec.from_json(record),)) if record else None


def preprocess_line(header: dict) -> str | None:
    """What `sartor build`'s summary and `sartor inspect` print for an engine's preprocessing: the
    spec, and with several sizes the buckets and their policy; None when none is recorded."""
    buckets = buckets_from_header(header)
    if buckets is None:
        return None
    if len(buckets) == 1:
        return buckets.describe()
    return f"{buckets.describe()} (buckets {buckets.sizes()}; a frame goes to the smallest that holds it, " \
           f"above the largest: {buckets.policy_text()})"
