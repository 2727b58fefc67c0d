from .context import ExecutionContext
from .engine import Engine, load
from .profiles import Profile, ShapeRange

__all__ = ["Engine", "ExecutionContext", "Profile", "ShapeRange", "load"]
