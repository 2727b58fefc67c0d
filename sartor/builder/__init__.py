from .config import BuildConfig
from .pipeline import BuildResult, build

__all__ = ["BuildConfig", "BuildResult", "build"]
