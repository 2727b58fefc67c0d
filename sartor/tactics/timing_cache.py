"""The timing cache: what tactic selection measured, kept in a readable JSON file so that the next
build of the same layers (same model or another one) times nothing it has timed before.

    {"format": "sartor-timing-cache-2",
     "devices": {"<fingerprint digest>": {
         "fingerprint": {...the device fingerprint, in full...},
         "entries": {"<layer signature>": {"winner": "channels_last",
                                           "timings_ms": {"torch": 0.41, "channels_last": 0.29},
                                           "rejected": {"...": "why"}, "effort": 2,
                                           "measured_at": "2025-01-01T00:00:00Z"}}}}}

An entry is used only on a device with the same fingerprint (GPU or CPU model, driver, CUDA,
torch, Triton and sartor versions) and when it was measured with at least the build's effort.
Entries for other fingerprints are kept as they are, so one file can be shared between machines.
The digest is recomputed from the recorded fingerprint when the file is read: the fingerprint,
not its key, says which device an entry belongs to.

A layer signature is a canonical string of what determines a kernel's speed: op type, input shapes,
dtypes and memory formats at the profile's opt shape, the weight's, the convolution's geometry,
the epilogue, the precision (and TF32). See `conv_signature`; other layers with tactics (MaxPool)
are identified by their input tensors and attributes (`layer_signature`).
"""
from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

import torch

from ..errors import SartorError
from ..kernels.pointwise.epilogue import pixel_stride
from ..kernels.common.tile_steps import sums_decoded
from ..ops.conv import conv_geometry
from ..ops.fused_pool import max_pool_label
from ..ops.quantized import ACCUMULATOR_BOUND
from ..runtime.engine_file import write_atomic

FORMAT = "sartor-timing-cache-2"
# Caches of an older format, refused with what they lack: their winners would name no tactic now.
OLDER_FORMATS = {"sartor-timing-cache-1": "its tactics are named in sartor's scheme before the tactic registry"}
_DTYPES = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16", torch.float64: "f64",
           torch.int8: "i8", torch.uint8: "u8", torch.int32: "i32", torch.int64: "i64"}


class TimingCacheError(SartorError):
    """The timing cache file is unreadable or malformed."""


def fingerprint_digest(fingerprint: dict) -> str:
    canonical = json.dumps(fingerprint, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()[:16]


SMALL_HOST_TENSOR = 16


def _tensor(t: torch.Tensor) -> str:
    if t.dim() == 4 and t.is_contiguous(memory_format=torch.channels_last) and not t.is_contiguous():
        fmt = "nhwc"
    elif t.is_contiguous():
        fmt = "contiguous"
    else:  # a channel slice of a channels-last buffer: pixels `pixel_stride` apart
        row = pixel_stride(t) if t.dim() == 4 else None
        fmt = "strided" if row is None else f"nhwc/{row}"
    return f"{_DTYPES.get(t.dtype, str(t.dtype))}[{'x'.join(map(str, t.shape))}]:{fmt}"


def _int8_output(attrs: dict) -> list[str]:
    """An INT8 layer's output in its signature: whether it writes INT8 or floats, and whether its sums
    are decoded from their bits (another epilogue: kernels/common/tile_steps.py); nothing for others."""
    if "input_inv_scale" not in attrs:
        return []
    parts = [f"out={'i8' if attrs.get('output_inv_scale') is not None else 'float'}"]
    return parts + (["sums=decoded"] if sums_decoded(attrs.get(ACCUMULATOR_BOUND)) else [])


def conv_signature(op_type: str, args: list, attrs: dict, precision: str, tf32: bool) -> str:
    """One FusedConv's timing identity, e.g.
    FusedConv x=f32[2x3x16x16]:contiguous w=f32[8x3x3x3]:contiguous b=f32 strides=1,1 pads=1,1/1,1
    dilations=1,1 group=1 act=Relu residual=none precision=fp32 tf32=0"""
    x, w = args[0], args[1]
    b = args[2] if len(args) > 2 else None
    residual = args[3] if len(args) > 3 else None
    strides, dilations, begin, end = conv_geometry(x, w, attrs)
    if residual is None:
        res = "none"
    else:
        res = f"{_tensor(residual)}@{'after' if attrs.get('residual_after_activation') else 'before'}"
    parts = [op_type, f"x={_tensor(x)}", f"w={_tensor(w)}",
             f"b={'none' if b is None else _DTYPES.get(b.dtype, str(b.dtype))}",
             f"strides={','.join(map(str, strides))}",
             f"pads={','.join(map(str, begin))}/{','.join(map(str, end))}",
             f"dilations={','.join(map(str, dilations))}", f"group={attrs.get('group', 1)}",
             f"act={attrs.get('activation') or 'none'}", f"residual={res}",
             f"precision={precision}", f"tf32={int(bool(tf32))}"]
    parts += _int8_output(attrs)
    pool = max_pool_label(attrs)
    if pool is not None:  # a QConv carrying its max pool (ops/fused_pool.py): another output
        parts.append(f"pool={pool}")
    if len(args) > 6 and args[5] is not None:  # a projected QConv (ops/quantized.py): its second product
        parts.append(f"projection={_tensor(args[5])}*{_tensor(args[6])}"
                     f"@{','.join(map(str, attrs.get('projection_strides') or (1, 1)))}")
    return " ".join(parts)


def _input_label(t: torch.Tensor) -> str:
    """A tensor's label, with its values when it is a small host tensor (Resize's scales or sizes:
    two Resizes of one input by different factors are different layers)."""
    if t.device.type == "cpu" and t.numel() <= SMALL_HOST_TENSOR:
        return f"{_tensor(t)}={','.join(str(v) for v in t.reshape(-1).tolist())}"
    return _tensor(t)


def _chain_signature(args: list, attrs: dict, precision: str, tf32: bool) -> str:
    """A convolution chain's (ops/conv_chain.py) timing identity: its first layer's conv_signature, then
    the 1×1 layer's weight, bias, activation and output, e.g.
    ConvChain QConv x=i8[…] … then w=i8[32x32x1x1]:contiguous b=i32 act=SiLU out=i8"""
    split = attrs["first_inputs"]
    first = conv_signature(attrs["layers"], list(args[:split]), attrs["first"], precision, tf32)
    weight, bias = args[split], args[split + 1] if len(args) > split + 1 else None
    second = attrs["second"]
    parts = [f"then w={_tensor(weight)}", f"b={'none' if bias is None else _DTYPES.get(bias.dtype, str(bias.dtype))}",
             f"act={second.get('activation') or 'none'}"]
    return " ".join(["ConvChain", first, *parts, *_int8_output(second)])


def layer_signature(op_type: str, args: list, attrs: dict, precision: str, tf32: bool,
                    into: torch.Tensor | None = None) -> str:
    """The timing identity of any layer with tactics: conv_signature for the convolution and GEMM
    layers (which have weights), otherwise op type, input tensors and attributes, e.g.
    MaxPool in=f16[8x64x112x112]:nhwc kernel_shape=3,3 pads=1,1,1,1 strides=2,2 precision=fp16.
    `into`: the Concat slice the layer's output goes to, when it was timed storing there."""
    if op_type in ("FusedConv", "QConv", "QGemm", "Conv"):
        signature = conv_signature(op_type, args, attrs, precision, tf32)
    elif op_type == "ConvChain":
        signature = _chain_signature(args, attrs, precision, tf32)
    else:
        tensors = " ".join(f"in={_input_label(a)}" for a in args if isinstance(a, torch.Tensor))
        settings = " ".join(f"{key}={','.join(map(str, value)) if isinstance(value, (list, tuple)) else value}"
                            for key, value in sorted(attrs.items()) if key != "tactic" and value is not None)
        signature = f"{op_type} {tensors} {settings} precision={precision}"
    return signature if into is None else f"{signature} into={_tensor(into)}"


def _check_entry(entry, where: str) -> dict:
    if not (isinstance(entry, dict) and isinstance(entry.get("winner"), str)
            and isinstance(entry.get("timings_ms"), dict)
            and all(isinstance(v, (int, float)) for v in entry["timings_ms"].values())
            and isinstance(entry.get("rejected", {}), dict) and isinstance(entry.get("effort", 0), int)):
        raise TimingCacheError(f"{where} is malformed")
    return entry


def _parse(data, where: str) -> dict[str, dict]:
    """{digest: {"fingerprint": {...}, "entries": {...}}}, digests recomputed from the fingerprints."""
    if isinstance(data, dict) and data.get("format") in OLDER_FORMATS:
        raise TimingCacheError(f"{where} is a timing cache of format {data['format']!r} ("
                               f"{OLDER_FORMATS[data['format']]}); this sartor reads {FORMAT!r}: delete it to time "
                               f"the layers again")
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        found = data.get("format") if isinstance(data, dict) else type(data).__name__
        raise TimingCacheError(f"{where} is not a sartor timing cache (format {found!r}, expected {FORMAT!r})")
    devices = data.get("devices")
    if not isinstance(devices, dict):
        raise TimingCacheError(f"{where} is malformed (no 'devices' object)")
    parsed: dict[str, dict] = {}
    for key, device in devices.items():
        if not (isinstance(device, dict) and isinstance(device.get("fingerprint"), dict)
                and isinstance(device.get("entries"), dict)):
            raise TimingCacheError(f"{where}: device {key!r} is malformed (needs 'fingerprint' and 'entries')")
        digest = fingerprint_digest(device["fingerprint"])
        slot = parsed.setdefault(digest, {"fingerprint": device["fingerprint"], "entries": {}})
        for signature, entry in device["entries"].items():
            slot["entries"][signature] = _check_entry(entry, f"{where}: entry {signature!r}")
    return parsed


def _read(path: Path) -> dict[str, dict]:
    """The file's devices; {} when it does not exist yet."""
    reset = "fix it, or delete it (or give another --timing-cache) to start a new cache"
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return {}
    except IsADirectoryError:
        raise TimingCacheError(f"timing cache {path} is a directory, not a file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise TimingCacheError(f"timing cache {path} is not readable ({type(exc).__name__}): {reset}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise TimingCacheError(f"timing cache {path} is not valid JSON (line {exc.lineno}, column {exc.colno}): "
                               f"{reset}") from None
    try:
        return _parse(data, f"timing cache {path}")
    except TimingCacheError as exc:
        raise TimingCacheError(f"{exc}: {reset}") from None


class TimingCache:
    """The entries of one cache file (or none: an in-memory cache). `lookup` serves only the given
    fingerprint; `record` adds what this build measured; `save` merges that into the file."""

    def __init__(self, path: str | Path | None = None) -> None:
        self.path = None if path is None else Path(path)
        self.devices = _read(self.path) if self.path is not None else {}
        self.new: dict[tuple[str, str], dict] = {}  # (digest, signature) -> entry recorded by this build
        self._fingerprints: dict[str, dict] = {}

    def __len__(self) -> int:
        return sum(len(d["entries"]) for d in self.devices.values())

    def lookup(self, fingerprint: dict, signature: str, effort: int = 0) -> dict | None:
        """The entry for this device and layer, if one was measured with at least `effort`."""
        entry = self.devices.get(fingerprint_digest(fingerprint), {}).get("entries", {}).get(signature)
        if entry is None or entry.get("effort", 0) < effort:
            return None
        return entry

    def record(self, fingerprint: dict, signature: str, winner: str, timings_ms: dict, rejected: dict,
               effort: int) -> dict:
        digest = fingerprint_digest(fingerprint)
        entry = {"winner": winner, "timings_ms": dict(timings_ms), "rejected": dict(rejected), "effort": int(effort),
                 "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        slot = self.devices.setdefault(digest, {"fingerprint": dict(fingerprint), "entries": {}})
        slot["entries"][signature] = entry
        self._fingerprints[digest] = dict(fingerprint)
        self.new[(digest, signature)] = entry
        return entry

    def to_json(self) -> dict:
        return {"format": FORMAT,
                "devices": {digest: {"fingerprint": d["fingerprint"], "entries": dict(sorted(d["entries"].items()))}
                            for digest, d in sorted(self.devices.items())}}

    def save(self, path: str | Path | None = None) -> None:
        """Merge this build's entries into the file as it is now (another build may have written
        to it meanwhile; its entries and those of other devices are kept), atomically."""
        path = Path(path) if path is not None else self.path
        if path is None:
            raise ValueError("TimingCache.save needs a path")
        merged = TimingCache()
        merged.devices = _read(path)
        for (digest, signature), entry in self.new.items():
            slot = merged.devices.setdefault(digest, {"fingerprint": self._fingerprints[digest], "entries": {}})
            slot["entries"][signature] = entry
        write_atomic(path, (json.dumps(merged.to_json(), indent=1) + "\n").encode("utf-8"))
        self.devices = merged.devices
