"""Resize (and its ancestor Upsample), Pad: the ops whose ONNX rules need care per axis.

Resize is computed axis by axis from ONNX's coordinate formulas (exact for every mode), with a
fast path through torch's interpolate for the integer-scale nearest resize detectors use. That
resize also has a Triton tactic over channels-last tensors which can store straight into a channel
slice of the Concat that follows it in detector necks (runtime/concat_plan.py).

A nearest resize between two INT8 (FP8) layers runs on their 1-byte codes (sartor/quant/quantize.py).
It only copies values, so it moves them as uint8 bytes: PyTorch's interpolate and index_select take
uint8 on every device, but not int8 or float8 everywhere (the CPU's interpolate takes neither).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..kernels.pointwise.epilogue import pixel_stride
from ..kernels.registry import fixed_tactic
from ..kernels.pointwise.resize import upsample_nearest_nhwc, upsample_nearest_nhwc_supported
from .registry import OpTable
from .util import floats, ints, norm_axis, only_dtypes, programmatic_launch

OPS = OpTable("resize")

BYTE_CODES = (torch.int8, torch.float8_e4m3fn)  # moved as uint8 by nearest resizes (module docstring)

RESIZE_ATTRS = {"antialias": 0, "axes": None, "coordinate_transformation_mode": "half_pixel",
                "cubic_coeff_a": -0.75, "exclude_outside": 0, "extrapolation_value": 0.0,
                "keep_aspect_ratio_policy": "stretch", "mode": "nearest", "nearest_mode": "round_prefer_floor"}


def _resize_check(attrs: dict, dtypes: list):
    if attrs.get("antialias") and attrs.get("mode") == "nearest":
        return "antialias=1 with mode nearest not supported"
    if attrs.get("mode") not in ("nearest", "linear", "cubic"):
        return f"mode {attrs.get('mode')} not supported"
    return None


def _source_coords(out_size, in_size, scale, mode, roi_start, roi_end, device):
    x = torch.arange(out_size, dtype=torch.float64, device=device)
    # The formulas' "length_resized" is in_size * scale, unrounded (it differs from out_size when
    # scales are given and in_size * scale is not an integer).
    length = in_size * scale
    if abs(length - round(length)) < 1e-9 * max(1.0, length):
        length = float(round(length))
    if mode == "half_pixel":
        return (x + 0.5) / scale - 0.5
    if mode == "pytorch_half_pixel":
        return (x + 0.5) / scale - 0.5 if out_size > 1 else torch.zeros_like(x)
    if mode == "align_corners":
        return x * (in_size - 1) / (length - 1) if length != 1 else torch.zeros_like(x)
    if mode == "asymmetric":
        return x / scale
    if mode == "tf_half_pixel_for_nn":
        return (x + 0.5) / scale
    if mode == "half_pixel_symmetric":
        adjustment = out_size / (scale * in_size)
        offset = in_size / 2 * (1 - adjustment)
        return offset + (x + 0.5) / scale - 0.5
    if mode == "tf_crop_and_resize":
        if length != 1:
            return roi_start * (in_size - 1) + x * (roi_end - roi_start) * (in_size - 1) / (length - 1)
        return torch.full_like(x, 0.5 * (roi_start + roi_end) * (in_size - 1))
    raise ValueError(f"coordinate_transformation_mode {mode}")


def _nearest_index(coords, in_size, rule, scale):
    if rule == "round_prefer_floor":
        idx = torch.ceil(coords - 0.5)
    elif rule == "round_prefer_ceil":
        idx = torch.floor(coords + 0.5)
    elif rule == "floor":
        idx = torch.floor(coords)
    else:
        idx = torch.ceil(coords)
    return idx.clamp(0, in_size - 1).to(torch.int64)


def _filter_taps(t, mode, a, scale, antialias):
    """Tap offsets (from base = ceil(coord) - 1, so t in (0, 1]) and weights of the linear or cubic
    filter. With antialias a downsampling filter is stretched by 1 / scale and normalised."""
    s = min(scale, 1.0) if antialias else 1.0
    support = 1 if mode == "linear" else 2
    start = math.floor(-support / s) + 1
    offsets = list(range(start, 2 - start))
    # arange, not torch.tensor(offsets): made on the device by a kernel, no host copy to capture.
    args = (torch.arange(start, 2 - start, dtype=t.dtype, device=t.device) - t.unsqueeze(-1)) * s
    x = args.abs()
    if mode == "linear":
        weights = (1 - x).clamp(0, 1)
    else:
        near = ((a + 2) * x - (a + 3)) * x * x + 1
        far = ((a * x - 5 * a) * x + 8 * a) * x - 4 * a
        weights = torch.where(x <= 1, near, torch.where(x < 2, far, torch.zeros_like(x)))
    if antialias:
        weights = weights / weights.sum(-1, keepdim=True)
    return offsets, weights


def _resize_axis(x, axis, out_size, scale, attrs, roi_start, roi_end):
    in_size = x.shape[axis]
    coords = _source_coords(out_size, in_size, scale, attrs["coordinate_transformation_mode"], roi_start, roi_end,
                            x.device)
    mode = attrs["mode"]
    if mode == "nearest":
        index = _nearest_index(coords, in_size, attrs["nearest_mode"], scale)
        out = _copy_codes(lambda t: t.index_select(axis, index), x)
    else:
        base = torch.ceil(coords) - 1
        t = coords - base
        offsets, weights = _filter_taps(t, mode, attrs["cubic_coeff_a"], scale, attrs["antialias"])
        taps = torch.stack([base + o for o in offsets], dim=-1)
        if attrs["exclude_outside"]:
            inside = (taps >= 0) & (taps <= in_size - 1)
            weights = weights * inside
            weights = weights / weights.sum(-1, keepdim=True)
        taps = taps.clamp(0, in_size - 1).to(torch.int64)
        moved = x.movedim(axis, -1).to(torch.float64 if x.dtype == torch.float64 else torch.float32)
        gathered = moved[..., taps]  # [..., out, taps]
        out = (gathered * weights.to(gathered.dtype)).sum(-1).to(x.dtype).movedim(-1, axis)
    if attrs["coordinate_transformation_mode"] == "tf_crop_and_resize":
        # Unconditionally: asking whether any coordinate is outside would wait for the device.
        outside = (coords < 0) | (coords > in_size - 1)
        shape = [1] * x.dim()
        shape[axis] = out_size
        out = torch.where(outside.view(shape), torch.full((), attrs["extrapolation_value"], dtype=out.dtype,
                                                          device=out.device), out)
    return out


def _output_geometry(x: torch.Tensor, sizes: list[int] | None, scales: list[float] | None, attrs: dict,
                     axes: list[int] | None) -> tuple[list, list, list]:
    """(axes, output sizes, scales) of the resized axes under ONNX's rules, from sizes or scales."""
    rank = x.dim()
    axes = [norm_axis(a, rank) for a in (axes or range(rank))]
    in_sizes = [x.shape[a] for a in axes]
    if sizes:
        if attrs["keep_aspect_ratio_policy"] != "stretch":
            pick = min if attrs["keep_aspect_ratio_policy"] == "not_larger" else max
            s = pick(o / i for o, i in zip(sizes, in_sizes))
            scales = [s] * len(axes)
            sizes = [int(math.floor(i * s + 0.5)) for i in in_sizes]
        else:
            scales = [o / i for o, i in zip(sizes, in_sizes)]
    else:
        sizes = [int(math.floor(i * s)) for i, s in zip(in_sizes, scales)]
    return axes, sizes, scales


def resize_tensor(x: torch.Tensor, sizes: list[int] | None, scales: list[float] | None, attrs: dict,
                  roi: list[float] | None = None, axes: list[int] | None = None) -> torch.Tensor:
    axes, sizes, scales = _output_geometry(x, sizes, scales, attrs, axes)
    if roi:
        n = len(roi) // 2
        roi_start = dict(zip(axes, roi[:n])) if n == len(axes) else dict(enumerate(roi[:n]))
        roi_end = dict(zip(axes, roi[n:])) if n == len(axes) else dict(enumerate(roi[n:]))
    else:
        roi_start, roi_end = {}, {}
    fast = _fast_nearest(x, axes, sizes, scales, attrs)
    if fast is not None:
        return fast
    out = x
    for axis, size, scale in zip(axes, sizes, scales):
        if size != x.shape[axis] or scale != 1.0 or attrs["coordinate_transformation_mode"] == "tf_crop_and_resize":
            out = _resize_axis(out, axis, size, scale, attrs, roi_start.get(axis, 0.0), roi_end.get(axis, 1.0))
    return out


def _copy_codes(copy, x: torch.Tensor) -> torch.Tensor:
    """`copy(x)` for a function that only moves values; INT8 and FP8 codes are moved as bytes."""
    if x.dtype in BYTE_CODES:
        return copy(x.view(torch.uint8)).view(x.dtype)
    return copy(x)


def _fast_nearest(x, axes, sizes, scales, attrs):
    """Integer-factor upsampling of H and W where the ONNX rule picks source i // f, as torch does."""
    factors = _nearest_factors(x, axes, sizes, scales, attrs)
    if factors is None:
        return None
    return _copy_codes(lambda t: F.interpolate(t, scale_factor=factors, mode="nearest"), x)


def _nearest_factors(x, axes, sizes, scales, attrs) -> tuple[int, int] | None:
    """(fh, fw) when this resize is a nearest upsampling of H and W by integer factors whose ONNX
    coordinate rule picks source i // f; None otherwise."""
    if attrs["mode"] != "nearest" or x.dim() != 4 or not (x.is_floating_point() or x.dtype in BYTE_CODES):
        return None
    by_axis = {a: s for a, s in zip(axes, scales)}
    if by_axis.get(0, 1.0) != 1.0 or by_axis.get(1, 1.0) != 1.0:
        return None
    factors = [by_axis.get(2, 1.0), by_axis.get(3, 1.0)]
    if any(f < 1 or f != int(f) for f in factors):
        return None
    if [int(x.shape[a] * f) for a, f in zip((2, 3), factors)] != [s for a, s in zip(axes, sizes) if a in (2, 3)]:
        return None
    mode, rule = attrs["coordinate_transformation_mode"], attrs["nearest_mode"]
    floor_asymmetric = mode == "asymmetric" and rule == "floor"
    rounded_half_pixel = mode in ("half_pixel", "pytorch_half_pixel") and rule in ("round_prefer_floor", "round_prefer_ceil")
    if not (floor_asymmetric or rounded_half_pixel):
        return None
    return int(factors[0]), int(factors[1])


# ---- the ops: a request is (x, sizes, scales, roi, axes, Resize attributes) ----------------------
TRITON_NEAREST = "triton_nhwc"
fixed_tactic(TRITON_NEAREST, "triton channels-last nearest upsample", programmatic_launch=True)


def _resize_request(inputs: list, attrs: dict) -> tuple:
    x = inputs[0]
    roi = floats(inputs[1]) if len(inputs) > 1 and inputs[1] is not None else None
    scales = floats(inputs[2]) if len(inputs) > 2 and inputs[2] is not None else None
    sizes = ints(inputs[3]) if len(inputs) > 3 and inputs[3] is not None else None
    if len(inputs) == 2:  # opset 10: (X, scales)
        scales, roi = roi, None
    return x, sizes or None, scales or None, roi or None, attrs["axes"], attrs


def _upsample_request(inputs: list, attrs: dict) -> tuple:
    scales = floats(inputs[1]) if len(inputs) > 1 else attrs["scales"]
    resize_attrs = dict(RESIZE_ATTRS, mode="linear" if attrs["mode"] in ("linear", "bilinear") else "nearest",
                        coordinate_transformation_mode="asymmetric", nearest_mode="floor")
    return inputs[0], None, scales, None, None, resize_attrs


def _triton_factors(request: tuple) -> tuple[int, int] | None:
    """The integer factors when the Triton kernel computes this request exactly, else None."""
    x, sizes, scales, _, axes, attrs = request
    if not upsample_nearest_nhwc_supported(x):
        return None
    axes, sizes, scales = _output_geometry(x, sizes, scales, attrs, axes)
    return _nearest_factors(x, axes, sizes, scales, attrs)


def _nearest_tactics(request: tuple) -> list[str]:
    """"torch" (the reference) and, for channels-last CUDA float tensors upsampled by integer
    factors under a rule that picks source i // f, the Triton kernel."""
    if request[0].is_cuda and _triton_factors(request) is not None:
        return ["torch", TRITON_NEAREST]
    return ["torch"]


def _triton_nearest(request: tuple, tactic: str | None, out: torch.Tensor | None = None,
                    pdl: bool = False) -> torch.Tensor | None:
    """The Triton tactic's result, new or in `out`; None where it is not the tactic or does not apply.
    `pdl`: launched with programmatic dependent launch (`programmatic_launch` of the layer: an Upsample's
    request carries Resize attributes of its own)."""
    if tactic != TRITON_NEAREST:
        return None
    factors = _triton_factors(request)
    return None if factors is None else upsample_nearest_nhwc(request[0], factors, out=out, pdl=pdl)


def _nearest_into(request: tuple, tactic: str | None, out: torch.Tensor, pdl: bool) -> torch.Tensor | None:
    """The Triton tactic's result stored straight into `out` (a channel slice of a Concat's buffer,
    as in YOLO's necks); None for PyTorch's kernel."""
    if out.dtype != request[0].dtype or pixel_stride(out) is None:
        return None
    return _triton_nearest(request, tactic, out, pdl)


def _run_request(request: tuple, tactic: str | None, pdl: bool) -> torch.Tensor:
    computed = _triton_nearest(request, tactic, pdl=pdl)
    if computed is not None:
        return computed
    x, sizes, scales, roi, axes, attrs = request
    return resize_tensor(x, sizes, scales, attrs, roi, axes)


def resize_tactics(inputs: list, attrs: dict, effort: int = 2) -> list[str]:
    return _nearest_tactics(_resize_request(inputs, attrs))


def resize_into(inputs: list, attrs: dict, out: torch.Tensor) -> torch.Tensor | None:
    return _nearest_into(_resize_request(inputs, attrs), attrs.get("tactic"), out,
                         programmatic_launch(inputs[0], attrs))


@OPS.op("Resize", attrs=dict(RESIZE_ATTRS), host_inputs=(1, 2, 3), check=_resize_check, tactics=resize_tactics,
        write_into=resize_into)
def resize(inputs, attrs):
    return _run_request(_resize_request(inputs, attrs), attrs.get("tactic"), programmatic_launch(inputs[0], attrs))


def upsample_tactics(inputs: list, attrs: dict, effort: int = 2) -> list[str]:
    return _nearest_tactics(_upsample_request(inputs, attrs))


def upsample_into(inputs: list, attrs: dict, out: torch.Tensor) -> torch.Tensor | None:
    return _nearest_into(_upsample_request(inputs, attrs), attrs.get("tactic"), out,
                         programmatic_launch(inputs[0], attrs))


@OPS.op("Upsample", attrs={"mode": "nearest", "scales": None}, host_inputs=(1,), tactics=upsample_tactics,
        write_into=upsample_into)
def upsample(inputs, attrs):
    return _run_request(_upsample_request(inputs, attrs), attrs.get("tactic"), programmatic_launch(inputs[0], attrs))


@OPS.op("Pad", attrs={"mode": "constant", "pads": None, "value": 0.0}, host_inputs=(1, 2, 3))
def pad(inputs, attrs):
    x = inputs[0]
    pads = ints(inputs[1]) if len(inputs) > 1 and inputs[1] is not None else list(attrs["pads"])
    value = attrs["value"]
    if len(inputs) > 2 and inputs[2] is not None and inputs[2].numel():
        value = inputs[2].reshape(-1)[0].item()
    axes = ints(inputs[3]) if len(inputs) > 3 and inputs[3] is not None else list(range(x.dim()))
    axes = [norm_axis(a, x.dim()) for a in axes]
    n = len(axes)
    out = x
    for axis, lo, hi in zip(axes, pads[:n], pads[n:]):
        out = _pad_axis(out, axis, lo, hi, attrs["mode"], value)
    return out


def _pad_axis(x, axis, lo, hi, mode, value):
    if lo < 0:
        x = x.narrow(axis, -lo, x.shape[axis] + lo)
        lo = 0
    if hi < 0:
        x = x.narrow(axis, 0, x.shape[axis] + hi)
        hi = 0
    if lo == 0 and hi == 0:
        return x
    size = x.shape[axis]
    if mode == "constant":
        shape = list(x.shape)
        parts = []
        if lo:
            shape[axis] = lo
            parts.append(torch.full(shape, value, dtype=x.dtype, device=x.device))
        parts.append(x)
        if hi:
            shape[axis] = hi
            parts.append(torch.full(shape, value, dtype=x.dtype, device=x.device))
        return torch.cat(parts, dim=axis)
    pos = torch.arange(-lo, size + hi, device=x.device)
    if mode == "edge":
        idx = pos.clamp(0, size - 1)
    elif mode == "reflect":
        period = 2 * (size - 1) if size > 1 else 1
        m = torch.remainder(pos, period)
        idx = torch.where(m >= size, period - m, m)
    elif mode == "wrap":
        idx = torch.remainder(pos, size)
    else:
        raise ValueError(f"pad mode {mode}")
    return x.index_select(axis, idx)



_GRID_MODES = {"linear": "bilinear", "bilinear": "bilinear", "nearest": "nearest", "cubic": "bicubic",
               "bicubic": "bicubic"}


def _grid_sample_check(attrs: dict, dtypes: list):
    if attrs["mode"] not in _GRID_MODES:
        return f"mode {attrs['mode']} not supported"
    if attrs["padding_mode"] not in ("zeros", "border", "reflection"):
        return f"padding_mode {attrs['padding_mode']} not supported"
    return only_dtypes({"float32", "float16", "float64", "bfloat16"}, (0, 1))(attrs, dtypes)


@OPS.op("GridSample", attrs={"align_corners": 0, "mode": "linear", "padding_mode": "zeros"}, check=_grid_sample_check)
def grid_sample(inputs, attrs):
    # ONNX defines GridSample as torch's grid_sample (4-D input; 5-D for linear and nearest).
    x, grid = inputs
    mode = _GRID_MODES[attrs["mode"]]
    if mode == "bicubic" and x.dim() != 4:
        raise NotImplementedError("GridSample cubic is defined for 4-D inputs only")
    return F.grid_sample(x, grid.to(x.dtype), mode=mode, padding_mode=attrs["padding_mode"],
                         align_corners=bool(attrs["align_corners"]))
