"""Which of sartor's extras each feature needs, and the one line that says so when one is missing.

    pip install sartor        (= sartor[runtime]) load and run engines: `sartor.load`, contexts, the
                              Pipeline, `sartor run/inspect/bench/deploy/keygen/sign`
    sartor[build]             compile and check: `sartor build/rebuild/compare/validate/sensitivity`,
                              `sartor.build` (onnx, onnxruntime, a COCO evaluator)
    sartor[serve]             `sartor serve` (aiohttp, grpcio, tritonclient's protos)
    sartor[ray]               sartor.integrations: Ray Data and Ray Serve (with the serve extra)
    sartor[video], [cv2]      video files as pipeline sources (PyAV); OpenCV's resize in preprocessing
    sartor[test]              everything the test suite needs (build, serve, video and the test tools)

torch is a dependency of every install, but which build (CPU or CUDA) is the user's choice: install
it first (`pip install torch --index-url .../whl/cpu` for the CPU build) and pip keeps it.
`tests/test_installs.py` checks, with every other installed package made unimportable, that each
install does what this table says. Why: [0035](../docs/decisions/0035-installs-that-fit.md).
"""
from __future__ import annotations

import importlib.util

from .errors import MissingExtraError

# The modules each extra is known by: the first one that does not import names the missing extra.
# pyproject.toml's [project.optional-dependencies] is the list of what each installs.
EXTRAS = {
    "build": ("onnx", "onnxruntime"),
    "serve": ("aiohttp", "grpc", "tritonclient.grpc", "google.protobuf"),
    "ray": ("ray", "ray.data", "ray.serve"),
}


def _present(module: str) -> str | None:
    """None when `module` can be imported here, else why not (one line)."""
    try:
        if importlib.util.find_spec(module) is not None:
            return None
        return f"No module named {module!r}"
    except (ImportError, ValueError) as exc:  # a parent package missing; a module set to None in sys.modules
        return str(exc) or f"No module named {module!r}"


def require_extra(extra: str, feature: str, modules: tuple | None = None) -> None:
    """Raise MissingExtraError ("FEATURE needs the EXTRA extra: pip install 'sartor[EXTRA]' (...)")
    unless every module the extra is known by (or `modules`) is installed. Finding a module imports
    only its parent packages, so the check costs little where the extra is there."""
    for module in EXTRAS[extra] if modules is None else modules:
        why = _present(module)
        if why is not None:
            raise MissingExtraError(feature, extra, module, why)
