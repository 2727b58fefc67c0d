"""Every failure a user can cause is a SartorError with a one-line message."""
from __future__ import annotations


class SartorError(Exception):
    """Base class: the CLI prints the message on one line and exits 2."""

    def __init__(self, message: str) -> None:
        super().__init__(" ".join(str(message).split()))


class ModelLoadError(SartorError):
    """The model file is missing, truncated, not ONNX or fails the ONNX checker."""


class UnsupportedModelError(SartorError):
    """The graph holds ops, attributes or dtypes sartor cannot compile."""


class GraphError(SartorError):
    """The graph is malformed (cycle, undefined value, duplicate producer)."""


class ProfileError(SartorError):
    """A shape profile is malformed or an input falls outside every profile."""


class InputError(SartorError):
    """Inputs passed to a context do not match the engine's bindings."""


class EngineFileError(SartorError):
    """The engine file is truncated, tampered, of another format or not an engine."""


class FingerprintMismatchError(SartorError):
    """The engine was built for another device or toolkit."""


class OutputPathError(SartorError):
    """The output path cannot be written."""


class DeviceError(SartorError):
    """The requested device is not available here."""


class TacticFaultError(SartorError):
    """A candidate kernel faulted the GPU while the builder ran it: the process's CUDA context is lost."""


class TacticNameError(SartorError):
    """A tactic name that no registered family spells: unknown, malformed, or of an older scheme."""


class ConfigError(SartorError):
    """A build option is malformed or contradicts another."""


class MissingDependencyError(ConfigError):
    """An option asks for an optional package (e.g. OpenCV for resampler=cv2) that does not import."""


class MissingExtraError(MissingDependencyError, ImportError):
    """A feature needs one of sartor's extras (`sartor[build]`, `sartor[serve]`, ...) that is not
    installed (`sartor/extras.py`). An ImportError too, so that `except ImportError` around an
    optional import keeps working."""

    def __init__(self, feature: str, extra: str, missing: str, detail: str = "") -> None:
        self.feature, self.extra, self.missing = feature, extra, missing
        self.detail = " ".join(str(detail).split()) or f"No module named {missing!r}"
        super().__init__(f"{feature} needs the {extra} extra: pip install 'sartor[{extra}]' ({self.detail})")

    def __reduce__(self):  # across processes (serve's engine processes) by its fields, not its message
        return type(self), (self.feature, self.extra, self.missing, self.detail)

    def for_feature(self, feature: str) -> "MissingExtraError":
        """The same missing extra, said of another feature (a CLI command rather than a module)."""
        return MissingExtraError(feature, self.extra, self.missing, self.detail)


class DataError(SartorError):
    """A dataset, its annotations or one of its images is missing, malformed or inconsistent."""


class UntrustedEngineError(EngineFileError):
    """A trust store is set and the engine is unsigned or signed by a key it does not hold, or the
    engine's signature does not verify."""


class KeyFileError(SartorError):
    """A signing key, public key or trust store is missing, unreadable or not an Ed25519 key."""
