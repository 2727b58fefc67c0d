from .registry import OpDef, OpRegistry, OpTable, default_registry

__all__ = ["OpDef", "OpRegistry", "OpTable", "default_registry"]
