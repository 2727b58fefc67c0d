"""`config.pbtxt` (Triton's protobuf text format) -> model_config_pb2.ModelConfig, completed from
the engine (inputs, outputs, max_batch_size), and the settings the server acts on (`ModelSettings`).

Read: max_batch_size, dynamic_batching { preferred_batch_size, max_queue_delay_microseconds,
default_queue_policy { default_timeout_microseconds, max_queue_size } }, instance_group [{ count,
kind, gpus }], input/output names and data types (checked against the engine), default_model_filename,
and parameters { key: "preprocess" value: { string_value: "letterbox=640,..." } } (used by the image
route when the engine stores no preprocessing), { key: "max_downscale" value: { string_value: "2" } } (the
image route's resolution-bucket policy instead of the engine's: a factor ≥ 1, or "any";
docs/decisions/0037-resolution-buckets.md) and { key: "memory_budget" value: { string_value: "2G" } }
(the most device memory the version may take: memory_budget.py), and version_policy (repository.py:
latest { num_versions: 1 } or specific { versions: [N] }; one version is served per model). Any other
field (sequence_batching, optimization, model_warmup, ...) is refused with a line naming it rather
than silently ignored (`check_acted_on`).

As Triton's auto-complete does: without max_batch_size in the config, it is the largest batch the
engine's profiles admit (0 when the engine has no shared dynamic batch dim), and a batching model
then gets `dynamic_batching { }` (no delay) unless the config says otherwise.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc

from ..data.preprocess import parse_max_downscale
from ..errors import ConfigError
from ..runtime.fingerprint import parse_device
from .memory_budget import parse_size
from .tensors import kserve_datatype

CONFIG_FILE = "config.pbtxt"
DEFAULT_MODEL_FILE = "model.plan"
PLATFORM = "sartor_plan"
MAX_INSTANCES = 64


@dataclass
class ModelSettings:
    """What the server does with one model, after the config is completed from the engine."""
    max_batch_size: int  # 0: requests give full shapes, no batching
    dynamic_batching: bool
    preferred_batch_sizes: tuple[int, ...] = ()
    max_queue_delay_s: float = 0.0
    max_queue_size: int = 0  # 0: the server default
    default_timeout_s: float | None = None  # None: the server default
    allow_timeout_override: bool = True
    instances: list[tuple[str, int]] = field(default_factory=list)  # (device, count)
    preprocess: str | None = None  # config.pbtxt parameter "preprocess"
    max_downscale: str | None = None  # config.pbtxt parameter "max_downscale" (checked when read)
    memory_budget: int | None = None  # config.pbtxt parameter "memory_budget", in bytes


def read_config(model_dir: Path) -> tuple[mc.ModelConfig, bool]:
    """(config, whether max_batch_size was written); an empty config when the file is absent."""
    path = Path(model_dir) / CONFIG_FILE
    config = mc.ModelConfig()
    if not path.is_file():
        return config, False
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: cannot be read ({type(exc).__name__})") from None
    try:
        text_format.Parse(text, config)
    except text_format.ParseError as exc:
        raise ConfigError(f"{path}: {exc}") from None
    return config, re.search(r"(^|[\s{;,])max_batch_size\s*:", text) is not None


# The fields sartor serve acts on, per message; a field set outside these is refused (check_acted_on).
ACTED_ON = {
    "ModelConfig": {"name", "platform", "backend", "max_batch_size", "input", "output", "dynamic_batching",
                    "instance_group", "default_model_filename", "parameters", "version_policy"},
    "ModelDynamicBatching": {"preferred_batch_size", "max_queue_delay_microseconds", "default_queue_policy"},
    "ModelQueuePolicy": {"default_timeout_microseconds", "allow_timeout_override", "max_queue_size"},
    "ModelInstanceGroup": {"name", "kind", "count", "gpus"},
    "ModelInput": {"name", "data_type", "dims"},
    "ModelOutput": {"name", "data_type", "dims"},
}
PARAMETERS = ("preprocess", "max_downscale", "memory_budget")


def _unused_fields(message, path: str) -> list[str]:
    found = []
    acted_on = ACTED_ON.get(message.DESCRIPTOR.name)
    for descriptor, value in message.ListFields():
        where = f"{path}{descriptor.name}"
        if acted_on is not None and descriptor.name not in acted_on:
            found.append(where)
        elif descriptor.message_type is not None and descriptor.message_type.name in ACTED_ON:
            items = [value] if hasattr(value, "ListFields") else value  # one message, or a repeated field
            for item in items:
                found += _unused_fields(item, where + ".")
    return found


def check_acted_on(config: mc.ModelConfig, where: str) -> None:
    """Refuse, in one line, any field of `config` that sartor serve would not act on."""
    unused = sorted(set(_unused_fields(config, "")))
    unused += [f"parameters[{key!r}]" for key in sorted(config.parameters) if key not in PARAMETERS]
    kinds = {mc.ModelInstanceGroup.KIND_AUTO, mc.ModelInstanceGroup.KIND_GPU, mc.ModelInstanceGroup.KIND_CPU}
    unused += [f"instance_group kind {mc.ModelInstanceGroup.Kind.Name(g.kind)}" for g in config.instance_group
               if g.kind not in kinds]
    if unused:
        raise ConfigError(f"{where}: sets {', '.join(unused)}, which sartor serve does not act on; remove "
                          f"{'it' if len(unused) == 1 else 'them'} (the fields it reads are listed in "
                          f"sartor/serve/config.py)")


def serving_version(config: mc.ModelConfig, available: list[int], where: str) -> int | None:
    """The version `config`'s version_policy serves among `available` (None: none of them). sartor
    serves one version per model: a policy that asks for several at once is refused."""
    policy = config.version_policy
    which = policy.WhichOneof("policy_choice")
    if which is None or (which == "latest" and policy.latest.num_versions <= 1):
        return max(available) if available else None
    if which == "specific" and len(policy.specific.versions) == 1:
        wanted = int(policy.specific.versions[0])
        return wanted if wanted in available else None
    asked = (f"latest {{ num_versions: {policy.latest.num_versions} }}" if which == "latest" else
             "all { }" if which == "all" else f"specific {{ versions: {list(policy.specific.versions)} }}")
    raise ConfigError(f"{where}: version_policy {asked} serves several versions at once, and sartor serve serves "
                      f"one version per model: use latest {{ num_versions: 1 }} or specific {{ versions: [N] }}")


def _dim0_symbol(shape) -> object:
    return shape[0] if shape else None


def engine_max_batch(engine) -> int:
    """The largest batch the engine's profiles admit when dim 0 of every input and output is one
    shared dynamic (batch) dimension; 0 when the engine has no batch dimension."""
    inputs, outputs = engine.inputs, engine.outputs
    if not inputs or any(v.shape is None or len(v.shape) == 0 for v in list(inputs) + list(outputs)):
        return 0
    symbols = {_dim0_symbol(v.shape) for v in inputs}
    if len(symbols) != 1:
        return 0
    symbol = symbols.pop()
    if isinstance(symbol, int) or any(_dim0_symbol(v.shape) != symbol for v in outputs):
        return 0
    best = 0
    for profile in engine.profiles:
        ranges = [profile.shapes[v.name] for v in inputs if v.name in profile.shapes]
        if ranges:
            best = max(best, min(r.max[0] for r in ranges))
    return best


def _dims(engine, name: str, batch: bool) -> list[int]:
    """Dims as Triton reports them: -1 where the profiles allow a range (the batch dim left out)."""
    ranges = [p.shapes[name] for p in engine.profiles if name in p.shapes]
    if ranges:
        rank = len(ranges[0].min)
        dims = []
        for axis in range(rank):
            values = {r.min[axis] for r in ranges} | {r.max[axis] for r in ranges}
            dims.append(values.pop() if len(values) == 1 else -1)
    else:
        value = next(v for v in list(engine.inputs) + list(engine.outputs) if v.name == name)
        dims = [d if isinstance(d, int) else -1 for d in (value.shape or ())]
    return dims[1:] if batch else dims


def _output_dims(value, batch: bool) -> list[int]:
    dims = [d if isinstance(d, int) else -1 for d in (value.shape or ())]
    return dims[1:] if batch else dims


def _check_io(config_entries, engine_values, kind: str, where: str) -> None:
    declared = {v.name: v for v in engine_values}
    for entry in config_entries:
        if entry.name not in declared:
            raise ConfigError(f"{where}: {kind} {entry.name!r} is not one of the engine's {kind}s "
                              f"({', '.join(declared)})")
        if entry.data_type != mc.TYPE_INVALID:
            want = "TYPE_" + kserve_datatype(declared[entry.name].dtype)
            got = mc.DataType.Name(entry.data_type)
            if want != got:
                raise ConfigError(f"{where}: {kind} {entry.name!r} is {got} in the config but the engine has {want}")


def check_devices(devices: list[str] | None) -> list[str] | None:
    """The server's device list (`--device cuda:0,cuda:1`), normalised ("cuda" is "cuda:0") and
    checked against this machine at start-up, so that a GPU that is not there is one line before
    any model loads rather than every model failing with it."""
    if devices is None:
        return None
    if not devices:
        raise ConfigError("--device names no device")
    kinds = {str(d).strip().partition(":")[0] for d in devices}
    if kinds == {"cpu", "cuda"}:
        raise ConfigError(f"--device {','.join(devices)} mixes the CPU and GPUs: name one kind (a model's "
                          f"instance_group {{ kind: KIND_CPU }} puts its instances on the CPU)")
    normalised = [str(parse_device(str(d).strip())) for d in devices]
    twice = sorted({d for d in normalised if normalised.count(d) > 1})
    if twice:
        raise ConfigError(f"--device names {', '.join(twice)} more than once (several execution contexts on one "
                          f"GPU come from instance_group {{ count: N }})")
    return normalised


def _instances(config: mc.ModelConfig, devices: list[str] | None, engine_kind: str,
               where: str) -> list[tuple[str, int]]:
    default = devices or (["cuda:0"] if engine_kind == "cuda" else ["cpu"])
    groups = list(config.instance_group) or [mc.ModelInstanceGroup(count=1)]
    counts: dict[str, int] = {}
    for group in groups:
        count = group.count or 1
        if not 0 < count <= MAX_INSTANCES:
            raise ConfigError(f"{where}: instance_group count {count} must be in 1..{MAX_INSTANCES}")
        if group.kind == mc.ModelInstanceGroup.KIND_CPU:
            targets = ["cpu"]
        elif group.gpus:
            targets = [f"cuda:{g}" for g in group.gpus]
            if devices and not all(t in devices for t in targets):
                raise ConfigError(f"{where}: instance_group gpus {list(group.gpus)} are not among the server's "
                                  f"devices ({', '.join(devices)})")
            if not devices and engine_kind != "cuda":
                raise ConfigError(f"{where}: instance_group names gpus {list(group.gpus)} but the engine is "
                                  f"built for the CPU")
        else:
            targets = default
        for target in targets:
            counts[target] = counts.get(target, 0) + count
    return list(counts.items())


def complete_config(config: mc.ModelConfig, has_max_batch: bool, name: str, engine,
                    devices: list[str] | None, where: str) -> tuple[mc.ModelConfig, ModelSettings]:
    """Fill in what the engine knows (as Triton's auto-complete does) and check what the user wrote."""
    config = mc.ModelConfig.FromString(config.SerializeToString())
    check_acted_on(config, where)
    if config.name and config.name != name:
        raise ConfigError(f"{where}: name {config.name!r} differs from the model directory name {name!r}")
    config.name = name
    config.platform = config.platform or PLATFORM
    config.backend = config.backend or "sartor"
    engine_batch = engine_max_batch(engine)
    if not has_max_batch:
        config.max_batch_size = engine_batch
        if engine_batch and not config.HasField("dynamic_batching") and not config.HasField("sequence_batching"):
            config.dynamic_batching.SetInParent()  # as Triton's auto-complete does for batching models
    max_batch = config.max_batch_size
    if max_batch < 0:
        raise ConfigError(f"{where}: max_batch_size {max_batch} must be >= 0")
    if max_batch > 0 and engine_batch == 0:
        raise ConfigError(f"{where}: max_batch_size {max_batch} but the engine has no shared dynamic batch "
                          f"dimension: set max_batch_size: 0")
    if max_batch > engine_batch > 0:
        raise ConfigError(f"{where}: max_batch_size {max_batch} exceeds the largest batch the engine's profiles "
                          f"admit ({engine_batch}): lower it or rebuild with a larger --max-shapes batch")
    _check_io(config.input, engine.inputs, "input", where)
    _check_io(config.output, engine.outputs, "output", where)
    batch = max_batch > 0
    written = {(kind, e.name): list(e.dims) for kind, entries in (("input", config.input), ("output", config.output))
               for e in entries if len(e.dims)}
    del config.input[:]
    del config.output[:]
    for v in engine.inputs:
        config.input.add(name=v.name, data_type=mc.DataType.Value("TYPE_" + kserve_datatype(v.dtype)),
                         dims=_dims(engine, v.name, batch))
    for v in engine.outputs:
        config.output.add(name=v.name, data_type=mc.DataType.Value("TYPE_" + kserve_datatype(v.dtype)),
                          dims=_output_dims(v, batch))
    for kind, entries in (("input", config.input), ("output", config.output)):
        for entry in entries:
            dims = written.get((kind, entry.name))
            if dims is not None and dims != list(entry.dims):
                raise ConfigError(f"{where}: {kind} {entry.name!r} has dims {dims} in the config but the engine's are "
                                  f"{list(entry.dims)} (-1: any size the profiles admit)")

    settings = ModelSettings(max_batch_size=max_batch, dynamic_batching=batch and config.HasField("dynamic_batching"))
    if config.HasField("dynamic_batching"):
        db = config.dynamic_batching
        preferred = tuple(int(p) for p in db.preferred_batch_size)
        bad = [p for p in preferred if not 0 < p <= max(max_batch, 1)]
        if bad:
            raise ConfigError(f"{where}: preferred_batch_size {bad} must be in 1..max_batch_size ({max_batch})")
        settings.preferred_batch_sizes = tuple(sorted(set(preferred)))
        settings.max_queue_delay_s = db.max_queue_delay_microseconds / 1e6
        policy = db.default_queue_policy
        settings.max_queue_size = int(policy.max_queue_size)
        if policy.default_timeout_microseconds:
            settings.default_timeout_s = policy.default_timeout_microseconds / 1e6
        settings.allow_timeout_override = policy.allow_timeout_override or not policy.default_timeout_microseconds
    settings.instances = _instances(config, devices, engine.fingerprint.get("kind", "cpu"), where)
    del config.instance_group[:]
    for device, count in settings.instances:
        kind = mc.ModelInstanceGroup.KIND_CPU if device == "cpu" else mc.ModelInstanceGroup.KIND_GPU
        group = config.instance_group.add(name=f"{name}_{device.replace(':', '')}", kind=kind, count=count)
        if device != "cpu":
            group.gpus.append(int(device.partition(":")[2] or 0))
    if "preprocess" in config.parameters:
        settings.preprocess = config.parameters["preprocess"].string_value or None
    if "max_downscale" in config.parameters:
        settings.max_downscale = config.parameters["max_downscale"].string_value or None
        if settings.max_downscale is not None:
            parse_max_downscale(settings.max_downscale, f"{where}: parameter max_downscale")
    if "memory_budget" in config.parameters:
        settings.memory_budget = parse_size(config.parameters["memory_budget"].string_value,
                                            f"{where}: parameter memory_budget")
    config.default_model_filename = config.default_model_filename or DEFAULT_MODEL_FILE
    return config, settings
