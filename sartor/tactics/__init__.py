from .select import select_tactics

__all__ = ["select_tactics"]
