"""A loaded engine: its layers, weights on the device, profiles, and the contexts that run it."""
from __future__ import annotations

import os
import shlex
import weakref

import torch

from ..errors import EngineFileError
from .capture import EagerLayer, static_eager_layers
from .branch_streams import DEFAULT_MAX_TIMED
from .context import MAX_BOUND_GRAPHS, ExecutionContext
from .engine_file import read_engine
from .engine_signature import trust_store
from .executor import Executor
from .fingerprint import check_fingerprint, device_fingerprint, parse_device
from .graph_codec import decode_graph
from .memory_plan import memory_by_profile
from .kernel_store import cuda_arch, install_engine_kernels, install_refusal, split_kernel_tensors
from .launchers import start_host_builds
from .profiles import Profile


class Engine:
    def __init__(self, header: dict, tensors: dict[str, torch.Tensor], device: torch.device,
                 path: str | None = None) -> None:
        self.header = header
        self.path = path
        self.device = device
        self.graph, weights = decode_graph(header["graph"], tensors)
        self.profiles = [Profile.from_json(p) for p in header["profiles"]]
        self.layer_precision = {layer["name"]: layer["precision"] for layer in header["layers"]}
        self.precision = header["build_config"]["precision"]
        self.weight_bytes = sum(t.numel() * t.element_size() for t in weights.values())
        self.executor = Executor(self.graph, weights, device, self.layer_precision,
                                 channels_last=device.type == "cuda" and header.get("channels_last", False))
        # Weights a profile's tactic reads in another layout than profile 0's, kept a second time.
        self.profile_weight_bytes = self.executor.profile_weight_bytes
        # The layers that run between captured CUDA graph pieces (runtime/capture.py): known from
        # their ops, recorded by the build's trial capture, and learned at run time.
        self.eager_layers = merge_eager_layers(static_eager_layers(self.executor),
                                               header.get("capture", {}).get("eager_layers", []), self.executor)
        # The contexts made from this engine, weakly: a context refers to its engine, and a strong
        # list back would keep both (weights, graph pools) alive until the cyclic collector runs.
        self._contexts: weakref.WeakSet[ExecutionContext] = weakref.WeakSet()
        # What `load` did with the compiled kernels the file carries (kernel_store.InstallReport).
        self.kernels_installed = None
        # Triton's host modules for those kernels, built at load (launchers.HostModuleReport), or None.
        self.host_modules = None
        # The signer's key fingerprint when the file is signed (verified), else None.
        self.signed_by: str | None = None
        # How the fingerprint compared with this machine's at load (fingerprint.Compatibility).
        self.fingerprint_check = None

    @property
    def graph_capturable(self) -> bool:
        """Whether any of a run can be captured as a CUDA graph."""
        eager = {layer.index for layer in self.eager_layers}
        return any(not step.on_host and i not in eager for i, step in enumerate(self.executor.steps))

    # ---- what the engine declares ------------------------------------------------------
    @property
    def inputs(self):
        return self.graph.inputs

    @property
    def outputs(self):
        return self.graph.outputs

    @property
    def fingerprint(self) -> dict:
        return self.header["fingerprint"]

    @property
    def layers(self) -> list[dict]:
        return self.header["layers"]

    @property
    def provenance(self) -> dict:
        return self.header["provenance"]

    @property
    def preprocess(self):
        """The PreprocessSpec given at build time (`--preprocess`), or None; with several sizes
        (resolution buckets, `buckets`) the largest one's."""
        from ..data.preprocess import PreprocessSpec
        record = self.header.get("preprocess")
        return PreprocessSpec.from_json(record) if record else None

    @property
    def buckets(self):
        """The resolution buckets (`sartor.data.buckets.Buckets`, smallest first): one per size of an
        engine built with `--preprocess letterbox=320|480|640,...`, else the one `preprocess` spec;
        None when the engine records no preprocessing."""
        from ..data.buckets import buckets_from_header
        return buckets_from_header(self.header)

    @property
    def input_format(self):
        """The FrameFormat of an engine built with --input-format uint8:HxW (raw frames in, its first
        layer preprocessing them), or None: the engine takes the model's own input."""
        from ..data.frame_format import FrameFormat
        record = self.header.get("input_format")
        return FrameFormat.from_json(record) if record else None

    @property
    def memory_by_profile(self) -> list[dict]:
        """Per profile at its max shapes: the weights all contexts share (the copies some profiles'
        tactics read in another layout included) and each context's arena, inputs and workspace
        (memory_plan.memory_by_profile)."""
        return memory_by_profile(self.header, self.weight_bytes, self.profile_weight_bytes)

    @property
    def context_memory_bytes(self) -> int:
        """What one more context adds at the largest profile: activation arena, inputs, workspace."""
        return max((p["context_bytes"] for p in self.memory_by_profile), default=0)

    @property
    def nms(self) -> dict | None:
        """The in-engine NMS (`sartor build --nms`): its settings, the head output it reads (`head_output`)
        and its four outputs (`outputs`: count, boxes, scores, classes); None for other engines."""
        return self.header.get("nms")

    @property
    def device_memory_bytes(self) -> int:
        """Weights on the device (with the copies some profiles' tactics read in another layout) plus
        one context at the largest profile (arena, inputs, workspace)."""
        return self.weight_bytes + self.profile_weight_bytes + self.context_memory_bytes

    def device_memory_for(self, contexts: int) -> int:
        """The weights once and `contexts` contexts at the largest profile."""
        return self.weight_bytes + self.profile_weight_bytes + contexts * self.context_memory_bytes

    @property
    def aux_streams(self) -> int:
        """The auxiliary streams the build chose for this engine's contexts (its header's
        `aux_streams`, builder/aux_streams.py); 0 for an engine built without that choice."""
        return int((self.header.get("aux_streams") or {}).get("streams", 0))

    def context(self, profile: int | None = None, aux_streams: int | None = None,
                bound_graphs: int = MAX_BOUND_GRAPHS) -> ExecutionContext:
        """A context bound to profile `profile`, or (None) to the first profile admitting each run;
        `aux_streams`: CUDA streams beside its own for the engine's independent branches
        (runtime/branch_streams.py), by default the count the build chose (`Engine.aux_streams`);
        `bound_graphs`: how many reused input buffers are read where they are rather than copied in
        (docs/decisions/0069; 0 copies every input)."""
        ctx = ExecutionContext(self, profile, aux_streams=self.aux_streams if aux_streams is None else aux_streams,
                               bound_graphs=bound_graphs)
        self._contexts.add(ctx)
        return ctx


# What an engine built from a provenance bundle records as its bundle directory (sartor/deploy/).
BUNDLE_LABEL = "<bundle>"


def rebuild_command(header: dict) -> str:
    config = header.get("build_config", {})
    if str(config.get("model_path", "")).startswith(BUNDLE_LABEL):  # the options are in the bundle
        return "sartor rebuild BUNDLE -o OUT.plan --device <this device> (BUNDLE: the engine's provenance bundle)"
    args = ["sartor", "build", config.get("model_path", "MODEL.onnx"), "-o", config.get("output_path", "OUT.plan"),
            "--precision", config.get("precision", "fp32")]
    for index, profile in enumerate(config.get("profiles") or []):
        if index:
            args.append("--profile")
        for kind in ("min", "opt", "max"):
            shapes = profile.get(kind) or {}
            if shapes:
                args += [f"--{kind}-shapes",
                         ",".join(f"{name}:{'x'.join(str(d) for d in shape)}" for name, shape in shapes.items())]
    for flag, table in (("--layer-precision", config.get("layer_precision")), ("--op-precision", config.get("op_precision"))):
        for key, value in (table or {}).items():
            args += [flag, f"{key}={value}"]
    if config.get("preprocess"):
        args += ["--preprocess", config["preprocess"]]
    if config.get("input_format"):
        args += ["--input-format", config["input_format"]]
    if config.get("nms"):
        args += ["--nms", config["nms"]]
    for flag, key in (("--calib", "calib"), ("--calib-cache", "calib_cache"), ("--calib-method", "calib_method")):
        if config.get(key) and not str(config[key]).startswith("<python:"):  # data from Python has no path
            args += [flag, str(config[key])]
    method = ((header.get("provenance") or {}).get("calibration") or {}).get("method")
    if method and config.get("calib") and not config.get("calib_method"):
        args += ["--calib-method", method]  # the method it used, not today's default (mse before 0048)
    if config.get("overflow_guard") is False:
        args.append("--no-overflow-guard")
    if config.get("embed_kernels") is False:
        args.append("--no-embed-kernels")
    if config.get("pdl"):
        args.append("--pdl")
    elif config.get("pdl") is False:  # off, where the default measures it (before 0055: the default)
        args.append("--no-pdl")
    if config.get("conv_chains") is not None:
        args.append("--conv-chains" if config["conv_chains"] else "--no-conv-chains")
    if config.get("max_aux_streams") not in (None, DEFAULT_MAX_TIMED):
        args += ["--max-aux-streams", str(config["max_aux_streams"])]
    return " ".join(shlex.quote(a) for a in args) + " --device <this device>"


def load(path: str | os.PathLike, device: str | None = None, install_kernels: bool = True,
         trust=None, compatibility: str | None = None) -> Engine:
    """Read, verify and bind an engine file to this machine's device (no rebuild, no JIT).

    `trust`: the keys whose signatures are accepted (a directory of .pub files, one .pub file, an
    Ed25519 public key, or a list of these); by default `$SARTOR_TRUST`. With a trust store, an
    engine that is unsigned, signed by another key, or changed after signing is refused before
    anything from it is used. Without one, any engine whose checksum holds loads, as an engine you
    built does; a signature it carries must still verify.

    A CUDA engine's compiled Triton kernels are installed into a private cache keyed by the
    engine's checksum (`$SARTOR_CACHE_DIR/kernels/<digest>/`, never Triton's user-wide cache) and
    this process's Triton reads them there, so that runs at the profiles' min, opt and max shapes
    compile nothing. They are GPU code from the file: they are installed from an engine that
    verified against the trust store, or, with no trust store, from any engine (the caller vouches
    for the files it loads, as for their weights). `install_kernels=False` (or
    SARTOR_NO_KERNEL_INSTALL=1) trusts the weights but not the binaries: they are compiled here.
    For the kernels installed, Triton's host modules (its C launchers) are built during the load,
    in parallel, where its first launches would build them one at a time (launchers.py;
    SARTOR_NO_LAUNCHER_BUILD=1 leaves them to those launches).

    `compatibility` ("strict", "default", "loose"; else $SARTOR_FINGERPRINT, else "default") says
    which fingerprint differences refuse the load and which are warned about in the log
    (fingerprint.py).
    """
    store = trust_store(trust)
    engine_file = read_engine(path, store)
    header, tensors = engine_file.header, engine_file.tensors
    try:
        built_for = header["fingerprint"]
        kind = built_for["kind"]
    except (KeyError, TypeError):
        raise EngineFileError(f"{path} has no device fingerprint in its header") from None
    target = parse_device(device or ("cuda" if kind == "cuda" else "cpu"))
    try:
        fingerprint_check = check_fingerprint(built_for, device_fingerprint(target), rebuild_command(header),
                                              compatibility, str(path))
        tensors, kernel_tensors = split_kernel_tensors(tensors)
        # Before the first run: the JIT then finds every kernel the engine runs in its cache.
        installed = (install_engine_kernels(header, kernel_tensors, cuda_arch(target), install_refusal(install_kernels),
                                            digest=engine_file.digest) if target.type == "cuda" else None)
        # Triton's host code for those kernels compiles meanwhile, in parallel (launchers.py), so that
        # the first run does not build it one launcher at a time.
        host_builds = start_host_builds(installed.entries) if installed is not None else None
        engine = Engine(header, tensors, target, str(path))
    except (KeyError, TypeError, ValueError, AttributeError, IndexError) as exc:
        # The checksum proves the file is whole, not that its header was written by sartor: a field
        # missing or of the wrong type is a malformed engine, said in one line.
        raise EngineFileError(f"{path} has a malformed header ({type(exc).__name__}: {exc}); rebuild the engine "
                              f"from its ONNX model") from None
    engine.kernels_installed = installed
    engine.host_modules = host_builds.wait() if host_builds is not None else None
    engine.digest = engine_file.digest  # the file's SHA-256 checksum: which engine a report describes
    engine.signed_by = engine_file.signature.fingerprint if engine_file.signature else None
    engine.fingerprint_check = fingerprint_check
    return engine


def merge_eager_layers(known: list[EagerLayer], recorded: list[dict], executor: Executor) -> list[EagerLayer]:
    """The layers known to run eagerly, with those the build's trial capture recorded (by index,
    checked against the layer's name: a record that does not match this graph is ignored)."""
    merged = {layer.index: layer for layer in known}
    for record in recorded:
        index = record.get("index")
        if isinstance(index, int) and 0 <= index < len(executor.steps) and index not in merged \
                and executor.steps[index].node.name == record.get("layer"):
            merged[index] = EagerLayer(index, record["layer"], record.get("op", ""), record.get("reason", ""))
    return [merged[i] for i in sorted(merged)]
