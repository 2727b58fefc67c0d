"""What a device needs around an engine: signing keys and signed engines (signing.py), provenance
bundles (`sartor build --bundle`), `sartor rebuild`, and releases with preflight, swap, health watch
and rollback (`sartor deploy`: releases.py, preflight.py, health.py, update.py).

Releases, preflight and the health watch run on the device with the runtime install alone; bundles
and rebuilds compile, so they need the build extra. Without it `import sartor.deploy` still works
and the names below that need it say so when asked for."""
from ..errors import MissingExtraError
from .manifest import BundleError, verify_bundle

try:
    from .bundle import BundleResult, build_bundle
    from .rebuild import RebuildReport, rebuild
except MissingExtraError:
    _NEEDS_BUILD = {"BundleResult": ".bundle", "build_bundle": ".bundle", "RebuildReport": ".rebuild",
                    "rebuild": ".rebuild"}

    def __getattr__(name: str):
        """The names that need the build extra: importing their module raises MissingExtraError."""
        if name in _NEEDS_BUILD:
            import importlib
            return getattr(importlib.import_module(_NEEDS_BUILD[name], __name__), name)
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

__all__ = ["BundleError", "BundleResult", "RebuildReport", "build_bundle", "rebuild", "verify_bundle"]
