"""The model repository in Triton's layout, and what is served from it.

    <repository>/<model>/config.pbtxt          optional (see config.py)
    <repository>/<model>/<version>/model.plan  a sartor engine; the newest version is served

Loading a version reads its config, loads the engine on each instance device (the fingerprint check
included), makes one execution context per instance, warms each up (every profile's min/opt/max, and
the batch sizes dynamic batching will form), starts its batcher, and only then swaps it in. The old
version's batcher stops taking requests and runs what it has queued, so a swap loses nothing; a
caller that reaches a closed batcher retries with the new version.

A version that fails to load is recorded with its reason (repository index, model ready = false);
when an older version is being served it keeps serving. The poller retries a failed version only
once its files change.

A model directory may instead be a release root's (`sartor deploy`, deploy/releases.py):

    <repository>/<model>/releases/<id>/model.plan, <repository>/<model>/current -> releases/<id>

Its version is the release id that `current` names, or, when that release does not run on this
machine, the one `deploy.releases.choose_release` picks (logged). The poller sees `current` change
like a new version directory, so a deploy's swap (and a rollback) is served without a restart.
config.pbtxt's version_policy chooses among Triton-layout versions (config.serving_version); a
release root serves `current`, so a version_policy there is refused.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..deploy.releases import RELEASES, choose_release, is_release_model, release_ids
from ..errors import ConfigError, SartorError
from ..runtime import load as load_engine
from ..runtime.engine_signature import trust_store
from .batcher import (
    FLAG_GATE,
    Batcher,
    BatchPolicy,
    Instance,
    device_gate,
    on_device,
    release_cached_memory,
    shape_key,
    wants_tf32,
    warm_batch_sizes,
    warm_feeds,
)
from .config import (
    CONFIG_FILE,
    DEFAULT_MODEL_FILE,
    ModelSettings,
    check_devices,
    complete_config,
    read_config,
    serving_version,
)
from .errors import InvalidRequest, ModelUnavailable
from .memory_budget import MemoryBudget
from .memory_budget import needs as budget_needs
from .tensors import kserve_datatype

log = logging.getLogger("sartor.serve")

READY, UNAVAILABLE, LOADING, UNLOADING = "READY", "UNAVAILABLE", "LOADING", "UNLOADING"
RETIRE_TIMEOUT_S = 120.0
CHECKED_SIGNATURES = 256  # input signatures a model version remembers as valid (see ServedModel.check_inputs)


def _stat(path: Path):
    try:
        st = path.stat()
        return (st.st_mtime_ns, st.st_size)
    except OSError:
        return None


@dataclass
class ServedModel:
    """One loaded version: its config, engines (one per device), batcher and metadata."""
    name: str
    version: str
    path: Path
    config: object  # model_config_pb2.ModelConfig, completed
    settings: ModelSettings
    engines: dict  # device -> Engine
    batcher: Batcher
    stamp: tuple
    checker: object = None  # an ExecutionContext used only for its (stateless) input checks
    preprocess: object = None  # PreprocessSpec or None (with resolution buckets, the largest's)
    buckets: object = None  # sartor.data.buckets.Buckets the image route routes by, or None
    last_inference_ms: int = 0
    # What loading it took: the engine files read (s), and each instance's warm-up (shapes run, s), which
    # the ready log line reports (a warm-up over many batch sizes can take most of a minute).
    load_s: float = 0.0
    warmups: list = field(default_factory=list)
    # (name, type, dtype, shape) of each input -> batch size, for input sets that passed check_inputs:
    # the checks read nothing else, so a request shaped like an earlier one skips them.
    _checked: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def engine(self):
        return next(iter(self.engines.values()))

    @property
    def max_batch_size(self) -> int:
        return self.settings.max_batch_size

    def _shape(self, name: str) -> list[int]:
        for entry in list(self.config.input) + list(self.config.output):
            if entry.name == name:
                dims = [int(d) for d in entry.dims]
                return ([-1] + dims) if self.max_batch_size else dims
        return []

    def metadata(self) -> dict:
        def io(values) -> list[dict]:
            return [{"name": v.name, "datatype": kserve_datatype(v.dtype), "shape": self._shape(v.name)}
                    for v in values]

        return {"name": self.name, "versions": [self.version], "platform": self.config.platform,
                "inputs": io(self.engine.inputs), "outputs": io(self.engine.outputs)}

    def check_outputs(self, names) -> None:
        declared = [v.name for v in self.engine.outputs]
        unknown = [n for n in names if n not in declared]
        if unknown:
            raise InvalidRequest(f"model '{self.name}': unknown output(s) {', '.join(map(repr, unknown))}; "
                                 f"the outputs are {', '.join(declared)}")

    def check_inputs(self, inputs: dict) -> int:
        """Names, dtypes, ranks, batch size and profile ranges; returns the request's batch size."""
        try:
            signature = tuple((name, type(v), v.dtype, tuple(v.shape)) for name, v in inputs.items())
        except AttributeError:  # not arrays: the full checks word the error
            signature = None
        batch = self._checked.get(signature) if signature is not None else None
        if batch is not None:
            return batch
        batch = self._check_inputs(inputs)
        if signature is not None and len(self._checked) < CHECKED_SIGNATURES:
            self._checked[signature] = batch
        return batch

    def _check_inputs(self, inputs: dict) -> int:
        context = self.checker
        try:
            shapes = context.check_inputs(inputs)
        except SartorError as exc:
            raise InvalidRequest(f"model '{self.name}': {exc}") from None
        batch = 1
        if self.max_batch_size:
            batches = {s[0] for s in shapes.values() if len(s)}
            if len(batches) != 1 or any(len(s) == 0 for s in shapes.values()):
                described = ", ".join(f"{n} {list(s)}" for n, s in shapes.items())
                raise InvalidRequest(f"model '{self.name}': every input needs the same batch size as its first "
                                     f"dim ({described})")
            batch = batches.pop()
            if not 1 <= batch <= self.max_batch_size:
                raise InvalidRequest(f"model '{self.name}': batch size {batch} is outside 1..{self.max_batch_size} "
                                     f"(max_batch_size)")
        try:
            context.select_profile(shapes)
        except SartorError as exc:
            raise InvalidRequest(f"model '{self.name}': {exc}") from None
        return batch


@dataclass
class ModelRecord:
    name: str
    state: str = UNAVAILABLE
    reason: str = ""
    served: ServedModel | None = None
    failures: dict = field(default_factory=dict)  # version -> (stamp, reason)
    user_unloaded: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)  # one load/unload at a time


class Repository:
    def __init__(self, root, metrics, devices: list[str] | None = None, max_queue_size: int = 1024,
                 poll_interval: float | None = None, trust=None, memory_budget: int | None = None,
                 allow_rebuild: bool = False) -> None:
        self.root = Path(root)
        if not self.root.is_dir():
            raise ConfigError(f"model repository {self.root} is not a directory")
        # Read once, before any model loads: an engine not signed by these keys is UNAVAILABLE.
        self.trust = trust_store(trust)
        self.trust_option = trust
        self.allow_rebuild = allow_rebuild  # a release root's model with no release that runs here is rebuilt at start
        self.metrics = metrics
        self.devices = check_devices(devices) if devices else None
        self.max_queue_size = max_queue_size
        self.poll_interval = poll_interval
        self.memory = MemoryBudget(memory_budget)  # what each model holds per device (memory_budget.py)
        self._records: dict[str, ModelRecord] = {}
        self._lock = threading.RLock()
        self._stop = threading.Event()
        self._poller: threading.Thread | None = None
        self._retiring: list[threading.Thread] = []
        self.ready = False

    # ---- the files ------------------------------------------------------------------------------------
    def model_dirs(self) -> dict[str, Path]:
        try:
            entries = sorted(self.root.iterdir())
        except OSError:
            return {}
        return {p.name: p for p in entries if p.is_dir() and not p.name.startswith(".")}

    @staticmethod
    def versions(model_dir: Path, filename: str) -> dict[int, Path]:
        """Triton layout: {version number: its engine file}."""
        found = {}
        try:
            for p in model_dir.iterdir():
                if p.is_dir() and p.name.isdigit() and int(p.name) > 0 and (p / filename).is_file():
                    found[int(p.name)] = p / filename
        except OSError:
            return {}
        return found

    def _locate(self, model_dir: Path) -> tuple[str | None, Path | None, str | None]:
        """(the version to serve, its engine file, why it is not the expected one); (None, None, None)
        when there is no version. Raises ConfigError or ReleaseError with the reason."""
        config, _ = read_config(model_dir)
        where = str(model_dir / CONFIG_FILE)
        if is_release_model(model_dir):
            if config.HasField("version_policy"):
                raise ConfigError(f"{where}: version_policy does not apply to a release root, which serves its "
                                  f"`current` release (sartor deploy): remove it")
            choice = choose_release(model_dir)
            return str(choice.release), choice.engine, choice.note
        versions = self.versions(model_dir, config.default_model_filename or DEFAULT_MODEL_FILE)
        chosen = serving_version(config, sorted(versions), where)
        return (None, None, None) if chosen is None else (str(chosen), versions[chosen], None)

    def _stamp(self, model_dir: Path) -> tuple:
        """What the served version depends on: a change means a (re)load. (version, engine file's stat,
        config's stat, engine path or, when none is found, the layout's state, note)."""
        config_stat = _stat(model_dir / "config.pbtxt")
        try:
            version, plan, note = self._locate(model_dir)
        except SartorError:
            version = plan = note = None
        if plan is None:
            try:
                current = os.readlink(model_dir / "current")
            except OSError:
                current = None
            state = (current, tuple(release_ids(model_dir)), _stat(model_dir / RELEASES),
                     tuple(sorted(p.name for p in model_dir.iterdir())) if model_dir.is_dir() else ())
            return (None, None, config_stat, state, None)
        return (version, _stat(plan), config_stat, str(plan), note)

    # ---- loading ---------------------------------------------------------------------------------------
    def load_all(self) -> None:
        for name, model_dir in self.model_dirs().items():
            if self.allow_rebuild and is_release_model(model_dir):
                self._rebuild_when_none_runs_here(name, model_dir)
            try:
                self.load(name)
            except SartorError as exc:
                log.warning("%s", exc)
        self.ready = True

    def _rebuild_when_none_runs_here(self, name: str, model_dir: Path) -> None:
        """--allow-rebuild: a release root's model none of whose releases runs on this machine is
        rebuilt from its current release's bundle and preflighted (`sartor deploy --check
        --allow-rebuild`) before it loads."""
        try:
            choose_release(model_dir)
            return
        except SartorError:
            pass
        from ..deploy.update import DeployOptions, check_current
        try:
            result = check_current(self.root, name, DeployOptions(trust=self.trust_option, allow_rebuild=True))
        except SartorError as exc:
            log.warning("%s", exc)
            return
        if result.note:
            log.warning("model %s: %s", name, result.note)

    def load(self, name: str) -> ServedModel:
        """(Re)load the newest version of `name` and swap it in; raises ModelUnavailable on failure
        (the previous version, if any, keeps serving)."""
        model_dir = self.model_dirs().get(name)
        if model_dir is None:
            raise InvalidRequest(f"no model '{name}' in the repository {self.root}")
        with self._lock:
            record = self._records.setdefault(name, ModelRecord(name))
        with record.lock:
            record.user_unloaded = False
            if record.served is None:
                record.state, record.reason = LOADING, ""
            stamp = self._stamp(model_dir)
            version = stamp[0] if stamp else None
            try:
                served = self._build(name, model_dir, stamp)
            except Exception as exc:
                reason = (str(exc) if isinstance(exc, SartorError)
                          else f"{type(exc).__name__}: {' '.join(str(exc).split())}")
                if not isinstance(exc, SartorError):
                    log.exception("loading model %s failed", name)
                with self._lock:
                    record.failures[version or ""] = (stamp, reason)
                    if record.served is None:
                        record.state, record.reason = UNAVAILABLE, reason
                raise ModelUnavailable(f"failed to load model '{name}'"
                                       + (f" version {version}" if version else "") + f": {reason}") from None
            with self._lock:
                old = record.served
                record.served, record.state, record.reason = served, READY, ""
                record.failures = {v: f for v, f in record.failures.items() if v and int(v) > int(served.version)}
            for device, engine in served.engines.items():
                self.metrics.set("nv_model_device_memory_bytes",
                                 {"model": name, "version": served.version, "device": device},
                                 engine.device_memory_bytes)
            log.info("model %s version %s ready (%s; loaded in %.1f s; warmed up %s)", name, served.version,
                     ", ".join(f"{d} x{c}" for d, c in served.settings.instances), served.load_s,
                     ", ".join(f"{shapes} shapes in {seconds:.1f} s" for shapes, seconds in served.warmups))
        if old is not None:
            self._retire(old)
        return served

    def _build(self, name: str, model_dir: Path, stamp) -> ServedModel:
        where = str(model_dir / "config.pbtxt")
        config, has_max_batch = read_config(model_dir)
        filename = config.default_model_filename or DEFAULT_MODEL_FILE
        version = stamp[0] if stamp else None  # the version the stamp describes, even if a newer one appeared since
        if version is None:
            self._locate(model_dir)  # raises the reason when there is one (a release root, version_policy)
            wanted = "" if not config.HasField("version_policy") else " that its version_policy names"
            raise ConfigError(f"{model_dir} has no version directory{wanted} with a {filename} (expected "
                              f"{model_dir}/1/{filename})")
        plan = Path(stamp[3])
        if stamp[4]:
            log.warning("%s", stamp[4])
        load_started = time.perf_counter()
        first_device = self.devices[0] if self.devices else None
        with device_gate(first_device).exclusive():  # loading allocates on the device: never during a capture
            first = load_engine(plan, device=first_device, trust=self.trust)
        config, settings = complete_config(config, has_max_batch, name, first, self.devices, where)
        # Before any other device's copy, context or warm-up: a version over the budget costs no more.
        previous = self.memory.reserve(name, version, budget_needs(first, settings.instances), settings.memory_budget)
        try:
            return self._build_instances(name, version, plan, config, settings, first, stamp, load_started)
        except BaseException:
            self.memory.restore(name, previous)
            raise

    def _build_instances(self, name: str, version: str, plan: Path, config, settings: ModelSettings, first, stamp,
                         load_started: float) -> ServedModel:
        loaded = {str(first.device): first}
        engines = {}  # only the devices that hold instances: `first` is dropped when none runs on its device
        for device, _ in settings.instances:
            if device not in loaded:
                with device_gate(device).exclusive():
                    loaded[device] = load_engine(plan, device=device, trust=self.trust)
            engines[device] = loaded[device]
        buckets = first.buckets
        del loaded, first
        load_s = time.perf_counter() - load_started
        instances, warmups = [], []
        for device, count in settings.instances:
            for _ in range(count):
                with device_gate(device).exclusive():
                    context = engines[device].context()
                instance = Instance(context, device)
                warm_started = time.perf_counter()
                self._warm(instance, engines[device], settings)
                warmups.append((len(instance.seen), time.perf_counter() - warm_started))
                instances.append(instance)
        if buckets is None and settings.preprocess:
            from ..data.buckets import Buckets
            from ..data.preprocess import parse_preprocess
            buckets = Buckets((parse_preprocess(settings.preprocess),))
        if buckets is not None and settings.max_downscale:
            from ..data.preprocess import parse_max_downscale
            buckets = buckets.with_max_downscale(parse_max_downscale(settings.max_downscale))
        preprocess = buckets.largest if buckets is not None else None
        policy = BatchPolicy(max_batch_size=settings.max_batch_size, dynamic=settings.dynamic_batching,
                             preferred=settings.preferred_batch_sizes, max_delay_s=settings.max_queue_delay_s,
                             max_queue_size=settings.max_queue_size or self.max_queue_size)
        checker_device = settings.instances[0][0]
        with device_gate(checker_device).exclusive():
            checker = engines[checker_device].context()  # used only for its input checks
        batcher = Batcher(name, version, instances, policy, checker.engine.profiles, self.metrics)  # starts the workers
        return ServedModel(name, version, plan, config, settings, engines, batcher, stamp, checker, preprocess,
                           buckets, load_s=load_s, warmups=warmups)

    @staticmethod
    def _warm(instance: Instance, engine, settings: ModelSettings) -> None:
        """ctx.warmup() (each profile at min/opt/max), then the batch sizes batching will form."""
        with device_gate(instance.device).exclusive(), FLAG_GATE.hold(wants_tf32(instance.context)), \
                on_device(instance.context):
            instance.context.warmup()
            for profile in engine.profiles:
                for pick in ("min", "opt", "max"):
                    shapes = {n: np.empty(getattr(r, pick), np.uint8) for n, r in profile.shapes.items()}
                    instance.mark_run(shape_key(shapes))
            if not settings.dynamic_batching:
                release_cached_memory(instance.device)
                return
            for feeds in warm_feeds(engine, warm_batch_sizes(settings.max_batch_size, settings.preferred_batch_sizes)):
                key = shape_key(feeds)
                if key not in instance.seen:
                    instance.context.run(feeds)
                    instance.mark_run(key)
            release_cached_memory(instance.device)

    def _retire(self, old: ServedModel) -> None:
        """Stop taking requests for `old`; its workers run what is queued, then exit."""
        old.batcher.close()

        def wait() -> None:
            if not old.batcher.join(RETIRE_TIMEOUT_S):
                old.batcher.abort(f"model '{old.name}' version {old.version} was unloaded")
                old.batcher.join(5)
            for device in old.engines:
                self.metrics.forget("nv_model_device_memory_bytes",
                                    {"model": old.name, "version": old.version, "device": device})
            log.info("model %s version %s retired", old.name, old.version)

        thread = threading.Thread(target=wait, daemon=True, name=f"sartor-serve-retire-{old.name}-v{old.version}")
        thread.start()
        with self._lock:
            self._retiring = [t for t in self._retiring if t.is_alive()] + [thread]

    def unload(self, name: str, reason: str = "unloaded", forget: bool = False) -> None:
        with self._lock:
            record = self._records.get(name)
        if record is None:
            raise InvalidRequest(f"no model '{name}' in the repository {self.root}")
        with record.lock:
            with self._lock:
                old, record.served = record.served, None
                record.state, record.reason, record.user_unloaded = UNAVAILABLE, reason, not forget
                if forget:
                    self._records.pop(name, None)
            self.memory.release(name)
        if old is not None:
            self._retire(old)

    # ---- polling ----------------------------------------------------------------------------------------
    def poll_once(self) -> None:
        """Load new models and new versions, retry changed failures, unload models whose directory is gone."""
        dirs = self.model_dirs()
        with self._lock:
            records = dict(self._records)
        for name, record in records.items():
            if name not in dirs:
                log.info("model %s left the repository: unloading", name)
                self.unload(name, "removed from the repository", forget=True)
        for name, model_dir in dirs.items():
            record = records.get(name)
            if record is not None and (record.user_unloaded or record.lock.locked()):
                continue
            stamp = self._stamp(model_dir)
            if record is not None:
                if record.served is not None and record.served.stamp == stamp:
                    continue
                failed = record.failures.get(stamp[0] or "") if stamp else None
                if failed is not None and failed[0] == stamp:
                    continue
            try:
                self.load(name)
            except SartorError as exc:
                log.warning("%s", exc)

    def start_polling(self) -> None:
        if not self.poll_interval or self._poller is not None:
            return

        def loop() -> None:
            while not self._stop.wait(self.poll_interval):
                try:
                    self.poll_once()
                except Exception:
                    log.exception("repository poll failed")

        self._poller = threading.Thread(target=loop, daemon=True, name="sartor-serve-poller")
        self._poller.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stop.set()
        if self._poller is not None:
            self._poller.join(timeout)
        with self._lock:
            served = [r.served for r in self._records.values() if r.served is not None]
            retiring = list(self._retiring)
        end = time.monotonic() + timeout
        for model in served:
            model.batcher.close()
        for model in served:
            if not model.batcher.join(max(0.0, end - time.monotonic())):
                model.batcher.abort("the server is shutting down")
        for thread in retiring:
            thread.join(max(0.0, end - time.monotonic()))

    # ---- lookups ----------------------------------------------------------------------------------------
    def served(self, name: str, version: str | None = None) -> ServedModel:
        with self._lock:
            record = self._records.get(name)
            served = record.served if record is not None else None
        if record is None:
            raise InvalidRequest(f"unknown model '{name}'" + (f" (models: {', '.join(sorted(self._records))})"
                                                              if self._records else ""))
        if version not in (None, ""):
            if served is not None and version == served.version:
                return served
            failed = record.failures.get(version)
            if failed is not None:
                raise ModelUnavailable(f"model '{name}' version {version} is unavailable: {failed[1]}")
            serving = f"version {served.version} is served" if served is not None else "no version is served"
            raise InvalidRequest(f"model '{name}' has no version {version!r} ready ({serving})")
        if served is None:
            state = "is loading" if record.state == LOADING else "is unavailable"
            raise ModelUnavailable(f"model '{name}' {state}" + (f": {record.reason}" if record.reason else ""))
        return served

    def is_ready(self, name: str, version: str | None = None) -> bool:
        try:
            self.served(name, version)
            return True
        except SartorError:
            return False

    def index(self, ready_only: bool = False) -> list[dict]:
        rows = []
        with self._lock:
            records = sorted(self._records.items())
            known = set(self._records)
        for name, record in records:
            if record.served is not None:
                rows.append({"name": name, "version": record.served.version, "state": READY, "reason": ""})
            for version, (_, reason) in sorted(record.failures.items()):
                if record.served is not None and version == record.served.version:
                    continue
                rows.append({"name": name, "version": version, "state": UNAVAILABLE, "reason": reason})
            if record.served is None and not record.failures:
                rows.append({"name": name, "version": "", "state": record.state, "reason": record.reason})
        if not ready_only:
            for name in sorted(set(self.model_dirs()) - known):
                rows.append({"name": name, "version": "", "state": UNAVAILABLE, "reason": "not loaded"})
        else:
            rows = [r for r in rows if r["state"] == READY]
        return rows

    def served_models(self) -> list[ServedModel]:
        with self._lock:
            return [r.served for r in self._records.values() if r.served is not None]
