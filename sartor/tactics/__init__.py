from .select import EFFORTS, TacticSelection, select_tactics
from .timing_cache import TimingCache, TimingCacheError

__all__ = ["EFFORTS", "TacticSelection", "TimingCache", "TimingCacheError", "select_tactics"]
