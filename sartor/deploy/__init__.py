"""What a device needs around an engine: signing keys and signed engines (signing.py), provenance
bundles (`sartor build --bundle`), `sartor rebuild`, and releases with preflight, swap, health watch
and rollback (`sartor deploy`: releases.py, preflight.py, health.py, update.py)."""
from .bundle import BundleResult, build_bundle
from .manifest import BundleError, verify_bundle
from .rebuild import RebuildReport, rebuild

__all__ = ["BundleError", "BundleResult", "RebuildReport", "build_bundle", "rebuild", "verify_bundle"]
