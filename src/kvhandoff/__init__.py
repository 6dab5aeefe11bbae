"""kvhandoff: cross-model KV-cache transfer with a closed-form linear mapper."""

from kvhandoff.config import FitConfig
from kvhandoff.errors import KVHandoffError
from kvhandoff.fit.pipeline import fit_mapper
from kvhandoff.mapper.mapper import Mapper
from kvhandoff.model.cache import prefill
from kvhandoff.runtime.handoff import MappedCache, catch_up, handoff_cache, handoff_generate, map_for_target
from kvhandoff.runtime.offset import reuse_run
from kvhandoff.runtime.plan import HandoffPlan
from kvhandoff.runtime.policy import DEFAULT_RECOMPUTE, RecomputePolicy
from kvhandoff.runtime.prefix_store import PrefixStore
from kvhandoff.runtime.seam import KVCache
from kvhandoff.runtime.session import SwitchingSession

__all__ = [
    "DEFAULT_RECOMPUTE",
    "FitConfig",
    "HandoffPlan",
    "KVCache",
    "KVHandoffError",
    "MappedCache",
    "Mapper",
    "PrefixStore",
    "RecomputePolicy",
    "SwitchingSession",
    "catch_up",
    "fit_mapper",
    "handoff_cache",
    "handoff_generate",
    "map_for_target",
    "prefill",
    "reuse_run",
]
__version__ = "0.1.0"
