from .select import (
    EFFORTS,
    TacticSelection,
    family_seconds,
    record_tactics,
    select_tactics,
    select_tactics_by_profile,
    summary_by_profile,
)
from .timing_cache import TimingCache, TimingCacheError

__all__ = ["EFFORTS", "TacticSelection", "TimingCache", "TimingCacheError", "family_seconds", "record_tactics",
           "select_tactics", "select_tactics_by_profile", "summary_by_profile"]
