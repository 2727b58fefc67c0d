from .pipeline import BuildResult, build
from .config import BuildConfig

__all__ = ["BuildConfig", "BuildResult", "build"]
