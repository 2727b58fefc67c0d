from .families import default_registry
from .registry import OpDef, OpRegistry, OpTable

__all__ = ["OpDef", "OpRegistry", "OpTable", "default_registry"]
