"""The profiles of an engine with resolution buckets (`--preprocess letterbox=320|480|640,...`,
docs/decisions/0037-resolution-buckets.md): one fixed H×W per bucket, so that each size has its own
kernels, chosen at its own opt shape, and the gate admits exactly the buckets' sizes.

Two ways to give them:
- the batch range once (the shape flags as for one size, their H×W one of the buckets' or left to
  the model): every profile given is made once per bucket, its H×W the bucket's, smallest first;
- one profile per size (`--profile` between them), each fixed at a bucket's H×W, every bucket
  named: taken as given, e.g. a larger batch for the small size."""
from __future__ import annotations

from ..data.buckets import Buckets
from ..errors import ConfigError
from ..runtime.profiles import Profile, make_profile
from .config import check_preprocess

KINDS = ("min", "opt", "max")


def _hw(shape, axes) -> tuple[int, int] | None:
    return tuple(int(shape[a]) for a in axes) if shape is not None and len(shape) == 4 else None


def _fmt(hw) -> str:
    return f"{hw[0]}x{hw[1]}"


def bucket_profiles(buckets: Buckets, inputs: list, given: list[dict], log: list[str]) -> list[Profile]:
    """The checked profiles for `buckets` (two or more) from the profiles the user `given`
    ({"min"|"opt"|"max": {name: shape}}), with a line for the build log."""
    image = next((v for v in inputs if v.shape is not None and len(v.shape) == 4), None)
    text = buckets.describe()
    if image is None:
        raise ConfigError(f"--preprocess {text}: the model has no 4-D image input "
                          f"(inputs: {', '.join(v.name for v in inputs)})")
    axes = (2, 3) if buckets.largest.layout == "nchw" else (1, 2)
    sizes = [s.size for s in buckets.specs]
    declared = {v.name: v.shape for v in inputs}
    per_profile = []  # the H×W each given profile names for the image input (a set)
    for k, profile in enumerate(given):
        named = set()
        for kind in KINDS:
            shape = (profile.get(kind) or {}).get(image.name)
            hw = _hw(shape, axes)
            if shape is not None and hw not in sizes:
                shown = "x".join(map(str, shape))
                raise ConfigError(f"--{kind}-shapes {image.name}:{shown} (profile {k}): its H×W is not one of the "
                                  f"buckets of --preprocess {text} ({buckets.sizes()}); with buckets, give the batch "
                                  f"range at one of their sizes (each bucket gets its own profile), or one profile "
                                  f"per bucket size")
            if hw is not None:
                named.add(hw)
        per_profile.append(named)
    one_each = all(len(named) == 1 for named in per_profile) and len(set().union(*per_profile)) > 1
    if one_each:  # one profile per size, as given
        missing = [s for s in sizes if all(s not in named for named in per_profile)]
        if missing:
            raise ConfigError(f"the profiles name the sizes {', '.join(_fmt(s) for s in sizes if s not in missing)} "
                              f"but not {', '.join(_fmt(s) for s in missing)} of --preprocess {text}: give one profile "
                              f"per bucket size, or the batch range once (each bucket then gets its own profile)")
        specs = list(given)
        how = "one profile per size, as given"
    elif any(len(named) > 1 for named in per_profile):
        k = next(k for k, named in enumerate(per_profile) if len(named) > 1)
        raise ConfigError(f"profile {k} ranges over {', '.join(_fmt(s) for s in sorted(per_profile[k]))} for input "
                          f"{image.name!r}: with --preprocess {text} each profile has one bucket's size; give the "
                          f"batch range at one size (each bucket then gets its own profile), or one profile per size")
    else:  # the batch range once: each given profile made at every bucket's size
        specs = [_at_size(profile, image.name, declared[image.name], axes, size) for size in sizes for profile in given]
        how = f"{len(given)} profile(s) given, made at each size"
    profiles = [make_profile(declared, p.get("min", {}), p.get("opt", {}), p.get("max", {})) for p in specs]
    for spec in buckets.specs:
        own = [p for p in profiles if _hw(p.shapes[image.name].min, axes) == spec.size]
        check_preprocess(spec, inputs, own)
    log.append(f"buckets: {buckets.describe()} ({buckets.sizes()}; {buckets.policy_text()} to fit): "
               f"{len(profiles)} profile(s), {how}")
    return profiles


def _at_size(profile: dict, name: str, declared: tuple | None, axes: tuple, size: tuple[int, int]) -> dict:
    """`profile` with the image input's H and W set to `size`; an image input the profile leaves
    out gets the model's declared shape at that size when its other dimensions are fixed."""
    out = {kind: dict(profile.get(kind) or {}) for kind in KINDS}
    given = [kind for kind in KINDS if name in out[kind]]
    if not given:
        if declared is None or not all(isinstance(d, int) for i, d in enumerate(declared) if i not in axes):
            return out  # make_profile says which shapes the dynamic input needs
        given, out["opt"][name] = ["opt"], tuple(declared)
    for kind in given:
        shape = list(out[kind][name])
        shape[axes[0]], shape[axes[1]] = size
        out[kind][name] = tuple(shape)
    return out
