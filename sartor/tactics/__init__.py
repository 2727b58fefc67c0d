from .select import (
    EFFORTS,
    TacticSelection,
    record_tactics,
    select_tactics,
    select_tactics_by_profile,
    summary_by_profile,
)
from .timing_cache import TimingCache, TimingCacheError

__all__ = ["EFFORTS", "TacticSelection", "TimingCache", "TimingCacheError", "record_tactics", "select_tactics",
           "select_tactics_by_profile", "summary_by_profile"]
