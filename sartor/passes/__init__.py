from .base import PipelineReport, run_passes
from .pipelines import FUSE, OPTIMIZE, SIMPLIFY, optimize

__all__ = ["FUSE", "OPTIMIZE", "PipelineReport", "SIMPLIFY", "optimize", "run_passes"]
